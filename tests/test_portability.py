"""What Linux alone has, taken away: os.sched_getaffinity and netlink sockets (Linux-only), fcntl (Unix-only;
Windows has none), and /dev/shm (macOS and Windows have none). A sitecustomize module removes them in every Python
process of the run, the spawned workers too; the scripts' real code then trains. macOS and Windows themselves are
not run here."""

import os

import pytest

from conftest import finish, free_port, launch, read_json, script_env

SIMULATION = """
import os, sys
del os.sched_getaffinity  # Linux-only
sys.modules["fcntl"] = None  # Unix-only: an import of it fails, as on Windows
import socket
del socket.AF_NETLINK  # Linux-only: the network interfaces cannot be listed
_statvfs, _isdir = os.statvfs, os.path.isdir


def statvfs(path):
    if str(path).startswith("/dev/shm"):
        raise FileNotFoundError(2, "No such file or directory", str(path))
    return _statvfs(path)


os.statvfs = statvfs
os.path.isdir = lambda path: False if str(path).startswith("/dev/shm") else _isdir(path)
"""


@pytest.fixture
def elsewhere(tmp_path):
    """The environment of a launch on a system without sched_getaffinity, fcntl and /dev/shm."""
    folder = tmp_path / "simulation"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SIMULATION)
    return script_env(PYTHONPATH=str(folder))


def test_the_baseline_runs_without_sched_getaffinity(data_dir, tmp_path, elsewhere):
    """macOS and Windows: the baseline once raised AttributeError unless --threads or OMP_NUM_THREADS was set."""
    metrics = tmp_path / "m.json"
    result = finish(
        launch("convnet_undistributed.py", "--data-dir", data_dir, "--metrics-json", metrics, env=elsewhere)
    )
    assert result.returncode == 0, result.stderr
    m = read_json(metrics)
    assert m["threads"] == os.cpu_count() and m["test_accuracy"] > 0.8


def test_the_distributed_script_runs_without_fcntl_and_dev_shm(data_dir, tmp_path, elsewhere):
    """Two launches as two machines of 2 processes each (on this host): the data is shared with the workers by the
    system's shared memory, the gradients go over Gloo, and rank 0 says to set GLOO_SOCKET_IFNAME, which it cannot
    choose there. The import of fcntl once stopped the script on Windows."""
    port = free_port()
    common = ["--num-processes", 2, "--batch-size", 32, "--data-dir", data_dir, "--master-port", port,
              "--num-machines", 2]  # fmt: skip
    launches = [
        launch(
            "convnet_distributed.py",
            *common,
            "--machine-id",
            m,
            "--metrics-json",
            tmp_path / f"{m}.json",
            env=elsewhere,
        )  # fmt: skip
        for m in (1, 0)
    ]
    result1, result0 = (finish(p, 240) for p in launches)
    assert (result0.returncode, result1.returncode) == (0, 0), result0.stderr + result1.stderr
    m = read_json(tmp_path / "0.json")
    assert m["world_size"] == 4 and m["allreduce"] == "gloo" and m["test_accuracy"] > 0.8
    assert m["threads"] == max(1, os.cpu_count() // 2)
    told = [line for line in result0.stdout.splitlines() if "GLOO_SOCKET_IFNAME" in line]
    assert len(told) == 1 and "cannot tell which network interface" in told[0], result0.stdout
    assert "GLOO_SOCKET_IFNAME" not in result1.stdout  # rank 0 says it, once
