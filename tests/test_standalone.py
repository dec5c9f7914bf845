"""Each script runs alone: copied by itself into an empty folder, it needs nothing else of the repository."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, default_ctrl_c, free_port, script_env

SCRIPTS = ["convnet_undistributed.py", "convnet_distributed.py", "convnet_distributed_cuda.py"]


def run_alone(folder, script, *args):
    env = script_env(PYTHONPATH="", PYTHONSAFEPATH="1")  # nothing importable from the repository
    return subprocess.run(
        [sys.executable, os.path.join(folder, script), *map(str, args)],
        cwd=folder, env=env, capture_output=True, text=True, timeout=180, preexec_fn=default_ctrl_c,
    )  # fmt: skip


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_copied_alone_into_an_empty_folder_runs(tmp_path, data_dir, script):
    folder = tmp_path / "alone"
    folder.mkdir()
    shutil.copy(os.path.join(REPO, script), folder)
    help_ = run_alone(folder, script, "--help")
    assert help_.returncode == 0 and help_.stdout.startswith("usage:"), help_.stderr
    layout = {
        "convnet_undistributed.py": [],
        "convnet_distributed.py": ["--num-processes", 2, "--master-port", free_port()],
        "convnet_distributed_cuda.py": ["--num-gpu-processes", 1, "--master-port", free_port()],
    }[script]
    metrics = folder / "metrics.json"
    run = run_alone(folder, script, *layout, "--epochs", 1, "--data-dir", data_dir, "--metrics-json", metrics)
    if script == "convnet_distributed_cuda.py" and not torch.cuda.is_available():
        assert run.returncode == 1 and run.stderr == (
            "error: no CUDA GPU is visible: this script needs one; on CPUs run convnet_distributed.py\n"
        )
        return
    assert run.returncode == 0, run.stderr
    assert "Test set, epoch 0: average loss" in run.stdout and "Finished training" in run.stdout, run.stdout
    assert metrics.is_file()
    assert sorted(p.name for p in folder.iterdir()) == sorted([script, "metrics.json"])
