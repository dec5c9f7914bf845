#!/usr/bin/env bash
# The tests that matter on another torch/torchvision pair: each script trains, resumes and exits, forked, spawned
# and under torchrun, stops cleanly on SIGTERM, and writes its files. CI runs them on requirements.txt's pair with
# the rest; run them on another pair with a Python that has it (pytest, pytest-timeout, numpy, psutil too):
#   bash tests/torch_versions.sh /path/to/venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-python}
"$python" -c 'import sys, torch, torchvision; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, torchvision {torchvision.__version__}")'
# -o addopts=: one process, without pytest.ini's two pytest-xdist workers (which that Python may lack).
"$python" -m pytest -q -rs -p no:cacheprovider -o addopts= \
  tests/test_model.py \
  tests/test_checkpoint.py \
  tests/test_files.py \
  tests/test_portability.py \
  "tests/test_training.py::test_baseline_article_command_trains_and_reports" \
  "tests/test_training.py::test_distributed_article_commands_train" \
  "tests/test_training.py::test_amp_trains_with_bfloat16_autocast" \
  "tests/test_training.py::test_torchrun_launch_joins_its_group_and_matches_the_scripts_own_launch" \
  "tests/test_cuda_script.py::test_cuda_script_training_runs_on_cpu_through_its_own_functions" \
  "tests/test_faults.py::test_sigterm_stops_every_process_with_status_143_and_one_line" \
  "tests/test_faults.py::test_a_signal_as_spawned_workers_start_stops_the_run_cleanly" \
  "tests/test_faults.py::test_workers_stop_when_their_launcher_is_killed" \
  "tests/test_faults.py::test_no_process_of_a_run_tears_its_interpreter_down" \
  "tests/test_faults.py::test_a_killed_rank_stops_the_whole_job" \
  "tests/test_faults.py::test_master_port_held_by_another_program"
