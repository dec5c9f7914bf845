"""Machines that run different code: another model or torch stops every machine with one line naming both
sides; another copy of the script whose flags, model and torch agree trains; a warning names the machine."""

import os
import socket

import torch

from conftest import REPO, finish, free_port, launch, script_env
from test_faults import left_running

HOST = socket.gethostname()


def check_job(script, data_dir, port, machine, env=None):
    """One machine of 2, one process each, with --check: the roll call and one exchange, no training."""
    args = ["--data-dir", data_dir, "--num-machines", 2, "--num-processes", 1, "--machine-id", machine,
            "--master-port", port, "--timeout", 60, "--check"]  # fmt: skip
    return launch(script, *args, env=env)


def run_two(data_dir, script1="convnet_distributed.py", env1=None):
    """Machine 0 runs the script; machine 1 runs script1, in env1."""
    port = free_port()
    procs = [
        check_job("convnet_distributed.py", data_dir, port, 0),
        check_job(script1, data_dir, port, 1, env1),
    ]
    results = [finish(p, timeout=120) for p in procs]
    assert [left_running(p.pid) for p in procs] == [[], []]
    return results


def copy_of_the_script(tmp_path, old, new):
    """convnet_distributed.py in another folder, old replaced with new: a machine with another copy."""
    with open(os.path.join(REPO, "convnet_distributed.py")) as f:
        text = f.read()
    assert old in text
    (tmp_path / "other").mkdir()
    copy = tmp_path / "other" / "convnet_distributed.py"
    copy.write_text(text.replace(old, new, 1))
    return str(copy)


def assert_both_stop_with(results, line):
    for r in results:
        assert r.returncode == 1 and r.stderr == line + "\n" and "epoch" not in r.stdout, r.stderr


def test_another_model_stops_every_machine_naming_the_first_parameter_that_differs(data_dir, tmp_path):
    copy = copy_of_the_script(
        tmp_path,
        (
            "self.fc1 = nn.Linear(4608, 64)  # 32 channels x 12 x 12 after the pool\n"
            "        self.fc2 = nn.Linear(64, 10)"
        ),
        (
            "self.fc1 = nn.Linear(4608, 32)  # 32 channels x 12 x 12 after the pool\n"
            "        self.fc2 = nn.Linear(32, 10)"
        ),
    )
    results = run_two(data_dir, copy)
    assert_both_stop_with(
        results,
        f"error: the machines disagree on model: machine 0 ({HOST}) has fc1.weight [64, 4608]; "
        f"machine 1 ({HOST}) has fc1.weight [32, 4608]: "
        "use the same script and torch version on every machine",
    )


def test_another_torch_version_stops_every_machine_naming_both(data_dir, tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.99.0+cpu'\n")
    results = run_two(data_dir, env1=script_env(PYTHONPATH=str(tmp_path)))
    ours = torch.__version__.split("+")[0]
    assert_both_stop_with(
        results,
        f"error: the machines disagree on torch: machine 0 ({HOST}) has torch {ours}; "
        f"machine 1 ({HOST}) has torch 2.99.0: use the same script and torch version on every machine",
    )


def test_another_copy_of_the_script_trains_with_a_warning_naming_its_machine(data_dir, tmp_path):
    copy = copy_of_the_script(
        tmp_path, "\nimport argparse\n", "\n# a copy edited on machine 1\nimport argparse\n"
    )
    results = run_two(data_dir, copy)
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    assert results[0].stderr == (
        "warning: machine 1 runs another convnet_distributed.py: copy one script to all machines\n"
    )
    assert results[1].stderr == ""


def test_the_same_script_on_both_machines_warns_of_nothing(data_dir):
    results = run_two(data_dir)
    assert [r.returncode for r in results] == [0, 0] and [r.stderr for r in results] == ["", ""], results
