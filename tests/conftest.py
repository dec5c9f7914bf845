"""Shared fixtures: small MNIST-format data sets, free ports, and running a script as a user would."""

import fcntl
import gzip
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

# OpenMP's threads spin while they wait for work, and a spinning thread takes a core from every other process:
# two runs side by side on 2 cores (pytest.ini's workers, or a job of more processes than cores) trained
# 7x slower (15.4 s an epoch against 2.2 s; alone, 1.43 s against 1.48 s). Every run the tests start, and this
# process, whose torch is not imported yet, sleep while they wait instead; a value already set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # tests import the scripts as modules too: their functions, not copies of them
N_TRAIN, N_TEST = 2560, 300  # N_TEST is not a multiple of 4 or 7: uneven test shards get exercised

FILES = {  # file name: (split, images or labels)
    "train-images-idx3-ubyte": ("train", "images"),
    "train-labels-idx1-ubyte": ("train", "labels"),
    "t10k-images-idx3-ubyte": ("test", "images"),
    "t10k-labels-idx1-ubyte": ("test", "labels"),
}


def make_split(n, seed):
    """Images whose class is learnable: a fixed random 28x28 template per class, plus noise."""
    templates = np.random.default_rng(1234).random((10, 28, 28)) > 0.7
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    images = templates[labels] * 100 + rng.integers(0, 156, (n, 28, 28))
    return images.astype(np.uint8), labels


def idx_bytes(array):
    """The idx format of MNIST: magic (0, 0, uint8 type 0x08, dimensions), big-endian sizes, data."""
    header = struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def write_dataset(root, folder="MNIST", gz=False, n_train=N_TRAIN, n_test=N_TEST):
    raw = os.path.join(root, folder, "raw")
    os.makedirs(raw, exist_ok=True)
    splits = {"train": make_split(n_train, 1), "test": make_split(n_test, 2)}
    for name, (split, kind) in FILES.items():
        images, labels = splits[split]
        data = idx_bytes(images if kind == "images" else labels)
        if gz:
            with gzip.open(os.path.join(raw, name + ".gz"), "wb") as f:
                f.write(data)
        else:
            with open(os.path.join(raw, name), "wb") as f:
                f.write(data)
    return root


# CI (.ci/run) sets CONVNET_REQUIRE_ALL=1: a test that would skip for want of a facility (namespaces, a mount,
# a cgroup, SLURM, mpirun, the data set...) fails instead, so that a broken set-up cannot pass with a feature
# unchecked. Only tests marked `gpu` may still skip.
REQUIRE_ALL = os.environ.get("CONVNET_REQUIRE_ALL") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if (
        REQUIRE_ALL
        and report.skipped
        and not hasattr(report, "wasxfail")
        and not item.get_closest_marker("gpu")
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome, report.longrepr = "failed", f"skipped under CONVNET_REQUIRE_ALL=1: {reason}"


# The quick set, to run after each edit (pytest -m quick, README.md): the command line, the model and the code
# the scripts share, and one short training run, the README's first command. Test files, or single tests.
QUICK = (
    "test_cli.py",
    "test_model.py",
    "test_readme.py",
    "test_training.py::test_distributed_article_commands_train[2-64]",
)


def pytest_collection_modifyitems(items):
    """Marks the quick set `quick`, and orders the run (pytest-xdist hands the tests out in this order)."""
    for item in items:
        path, _, name = item.nodeid.rpartition("/")[2].partition("::")
        if path in QUICK or f"{path}::{name}" in QUICK:
            item.add_marker(pytest.mark.quick)
    items.sort(key=run_order)


def run_order(item):
    """The quick files' tests last: each takes a second or less, so they keep every worker busy to the end.
    Just before them the `alone` tests: each waits for the other workers' tests to end, there `alone` or
    quick ones, not the long tests before."""
    if item.nodeid.rpartition("/")[2].partition("::")[0] in QUICK:
        return 2
    return 1 if item.get_closest_marker("alone") else 0


@pytest.fixture(autouse=True)
def alone_if_marked(request, tmp_path_factory):
    """pytest.ini runs the tests on pytest-xdist workers side by side. A test marked `alone` (a time bound
    with little room, or a timing of its own) runs with no other test beside it: each test holds a shared lock
    on a file of this run, an `alone` test an exclusive one. A gate before the lock lets no test start while
    an `alone` test waits for it. Nothing to do where the tests run in one process."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    folder = tmp_path_factory.getbasetemp().parent  # the run's folder, shared by its workers
    alone = request.node.get_closest_marker("alone") is not None
    with open(folder / f"gate-{run}", "a") as gate, open(folder / f"lock-{run}", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A data folder in torchvision's layout, with plain (not gzipped) idx files; shared, read-only use."""
    return write_dataset(str(tmp_path_factory.mktemp("data")))


def free_port():
    """A port free now, below the ephemeral range (as test_multihost.py's random_port): the kernel hands the
    ports of that range to outgoing connections, the other pytest workers' Gloo and store ones among them, and
    one could take a port handed out from it before the script listens on it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    while True:
        port = low - 1 - secrets.randbelow(min(12000, low - 1024))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:  # taken
                continue


# Variables a launcher sets that change what the scripts do: each test sets the ones it means to.
LAUNCHER_ENV = ("OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME", "SLURM_CPUS_PER_TASK", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID",
                "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")  # fmt: skip


def script_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture
def clean_env(monkeypatch):
    """This process's environment without LAUNCHER_ENV, for the scripts' functions called in-process."""
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)


def default_ctrl_c():
    # A test run started in the background (`pytest &`) ignores SIGINT, and a child would inherit that:
    # start each script as a terminal would, with Ctrl-C at its default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launch(script, *args, env=None, python_flags=(), cwd=None, cgroup=None):
    """Start a script as a user would, in the cgroup whose cgroup.procs file is given (as a container would);
    returns the Popen."""
    cmd = [sys.executable, *python_flags, os.path.join(REPO, script), *map(str, args)]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or script_env(),
        cwd=cwd,
        start_new_session=True,
        preexec_fn=default_ctrl_c if cgroup is None else lambda: (default_ctrl_c(), join_cgroup(cgroup)),
    )


def join_cgroup(procs):
    with open(procs, "w") as f:
        f.write("0")  # 0: the process that writes


def finish(proc, timeout=120):
    """Wait for a launched script (bounded); kill its whole process group if it overruns."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_script(script, *args, timeout=120, **kw):
    return finish(launch(script, *args, **kw), timeout)


def wait_for_line(proc, prefix, limit=120):
    """Read a launch's stdout until a line starts with prefix; returns the lines read. Past the limit
    the launch's process group is killed, which ends the read, and the test fails."""
    lines = []
    deadline = threading.Timer(limit, kill_group, (proc,))
    deadline.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(prefix):
                return lines
    finally:
        deadline.cancel()
    pytest.fail(
        f"no line {prefix!r} within {limit} s, or the launch ended:\n{''.join(lines)}\n{proc.stderr.read()}"
    )


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_json(path):
    with open(path) as f:
        return json.load(f)


def spawn_bounded(fn, args, nprocs, timeout=120):
    """torch.multiprocessing.spawn, with a deadline: a hung rank fails the test instead of hanging it."""
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"spawned processes still running after {timeout} s")


def tensors(n_train=N_TRAIN, n_test=N_TEST):
    """The fixture's data as the scripts hold it: uint8 images and int64 labels, train then test."""
    import torch

    (a, b), (c, d) = make_split(n_train, 1), make_split(n_test, 2)
    return (torch.from_numpy(a), torch.from_numpy(b).long(), torch.from_numpy(c), torch.from_numpy(d).long())
