"""The scripts on systems that lack what Linux has, simulated: a sitecustomize module takes away, in every
Python process of a run (the spawned workers too), what Windows lacks, or what macOS lacks, and the scripts'
real code then trains. macOS and Windows themselves are not run here.

What each lacks, of what the scripts call (the Python docs' "Availability", and the systems themselves):
- Windows: the modules fcntl and resource; os.sched_getaffinity, os.statvfs, os.sched_yield, os.killpg,
  signal.pthread_sigmask, glibc (libc.so.6: getifaddrs, so the network interfaces cannot be listed); /dev/shm;
  fork (sys.platform says win32, so the scripts spawn their workers). Its os.getppid never changes when the
  parent dies (no orphan gets a new parent).
- macOS: os.sched_getaffinity, /dev/shm, glibc (libc.so.6, whose getifaddrs lists Linux's interfaces);
  sys.platform says darwin, so the scripts spawn their workers and cannot name the network interface.
Left in place, as the scripts never call them: os.fork (they spawn where sys.platform is not Linux) and
signal.SIGKILL (multiprocessing's POSIX Popen needs it; a test below checks the scripts do not)."""

import ast
import os

import pytest

from conftest import REPO, finish, free_port, launch, read_json, script_env
from test_faults import assert_workers_stop_when_their_launcher_is_killed

NO_DEV_SHM = """
_statvfs, _isdir = getattr(os, "statvfs", None), os.path.isdir


def statvfs(path):
    if str(path).startswith("/dev/shm"):
        raise FileNotFoundError(2, "No such file or directory", str(path))
    return _statvfs(path)


os.statvfs = statvfs
os.path.isdir = lambda path: False if str(path).startswith("/dev/shm") else _isdir(path)
"""

NO_GLIBC = """
import ctypes

_CDLL = ctypes.CDLL


def CDLL(name, *args, **kwargs):
    if name == "libc.so.6":
        raise OSError(f"dlopen({name}, 0x0006): image not found")
    return _CDLL(name, *args, **kwargs)


ctypes.CDLL = CDLL
"""

SIMULATIONS = {
    "windows": """
import os, signal, sys
import torch.multiprocessing  # imported under Linux's sys.platform, as the rest of torch is
"""
    + NO_DEV_SHM
    + NO_GLIBC
    + """
for name in ("sched_getaffinity", "statvfs", "sched_yield", "killpg"):
    delattr(os, name)
launcher = "-c" not in sys.orig_argv  # not a spawned worker, nor multiprocessing's resource tracker
if launcher:
    # multiprocessing's POSIX machinery, which Windows does without, masks signals in and around its tracker:
    # start it first. The scripts call pthread_sigmask in the launcher alone.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    del signal.pthread_sigmask
sys.modules["fcntl"] = sys.modules["resource"] = None  # an import of either fails
_ppid = os.getppid()
os.getppid = lambda: _ppid  # the parent's id, even after it died
if launcher:  # a spawned worker starts as on POSIX
    sys.platform = "win32"
""",
    "macos": """
import os, sys
import torch.multiprocessing  # imported under Linux's sys.platform, as the rest of torch is
"""
    + NO_DEV_SHM
    + NO_GLIBC
    + """
del os.sched_getaffinity
sys.platform = "darwin"
""",
}


@pytest.fixture(params=sorted(SIMULATIONS))
def elsewhere(request, tmp_path):
    """The environment of a launch on a system without what Windows, or macOS, lacks."""
    folder = tmp_path / "simulation"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SIMULATIONS[request.param])
    return script_env(PYTHONPATH=str(folder), SIMULATED=request.param)


def test_the_baseline_runs_without_sched_getaffinity(data_dir, tmp_path, elsewhere):
    """macOS and Windows: the baseline raised AttributeError unless --threads or OMP_NUM_THREADS was set."""
    metrics = tmp_path / "m.json"
    result = finish(
        launch("convnet_undistributed.py", "--data-dir", data_dir, "--metrics-json", metrics, env=elsewhere)
    )
    assert result.returncode == 0, result.stderr
    m = read_json(metrics)
    assert m["threads"] == os.cpu_count() and m["test_accuracy"] > 0.8
    assert (m["peak_rss_mib"] is None) == (elsewhere["SIMULATED"] == "windows")  # getrusage is Unix-only


def test_the_distributed_script_runs_without_fcntl_and_dev_shm(data_dir, tmp_path, elsewhere):
    """Two launches as two machines of 2 processes each (on this host): the spawned workers load their own
    data, the gradients go over Gloo, and rank 0 says to set GLOO_SOCKET_IFNAME, which it cannot choose there.
    The import of fcntl once stopped the script on Windows; then, without resource, every run ended in a
    traceback after its last epoch (torch.tensor([None]) for peak memory), no metrics."""
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
    peaks = m["peak_rss_mib_per_rank"]
    assert peaks == [None] * 4 if elsewhere["SIMULATED"] == "windows" else all(p > 0 for p in peaks), peaks
    assert "Traceback" not in result0.stderr + result1.stderr
    told = [line for line in result0.stdout.splitlines() if "GLOO_SOCKET_IFNAME" in line]
    assert len(told) == 1 and "cannot tell which network interface" in told[0], result0.stdout
    assert "GLOO_SOCKET_IFNAME" not in result1.stdout  # rank 0 says it, once


def test_workers_stop_when_their_launcher_is_killed_where_the_parent_id_stays(data_dir, tmp_path):
    """Windows gives an orphan no new parent: os.getppid() goes on naming the dead launcher, and workers that
    watched it alone trained on. They watch the launcher's handle too (multiprocessing's sentinel)."""
    folder = tmp_path / "simulation"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SIMULATIONS["windows"])
    assert_workers_stop_when_their_launcher_is_killed(data_dir, script_env(PYTHONPATH=str(folder)))


# What Windows lacks, of the os, signal and socket modules (the Python docs' "Availability"), that a script
# may call only behind a guard: hasattr, a caught AttributeError, or a path that runs on Linux alone.
WINDOWS_LACKS = {
    "os": {"fork", "forkpty", "killpg", "getpgid", "setsid", "getuid", "geteuid", "sched_getaffinity",
           "sched_setaffinity", "sched_yield", "statvfs", "fchmod", "fchown", "register_at_fork", "nice",
           "pipe2", "getloadavg", "O_DIRECTORY", "setpgrp", "wait3", "wait4", "WNOHANG"},
    "signal": {"SIGKILL", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGALRM", "SIGPIPE", "alarm",
               "pthread_sigmask", "pthread_kill", "sigwait", "setitimer", "siginterrupt", "SIG_BLOCK",
               "SIG_SETMASK", "SIG_UNBLOCK"},
    "socket": {"AF_UNIX", "SO_REUSEPORT", "sethostname", "CMSG_LEN", "sendmsg", "recvmsg"},
}  # fmt: skip
# Each call of one of them, and why it is safe where it is missing.
GUARDED = {
    ("os", "sched_getaffinity"): "hasattr(os, 'sched_getaffinity')",
    ("os", "statvfs"): "AttributeError caught in gradient_shortfall",
    ("os", "sched_yield"): "SharedMemoryAverager, which runs on Linux x86-64 alone",
    ("signal", "pthread_sigmask"): "hasattr(signal, 'pthread_sigmask')",
    ("signal", "SIG_BLOCK"): "with pthread_sigmask, behind its hasattr",
    ("signal", "SIG_UNBLOCK"): "with pthread_sigmask, behind its hasattr (raise_on_signals)",
}


@pytest.mark.parametrize(
    "script", ["convnet_undistributed.py", "convnet_distributed.py", "convnet_distributed_cuda.py"]
)
def test_the_scripts_call_nothing_windows_lacks_unguarded(script):
    """Every os.X, signal.X and socket.X a script names that Windows lacks is a guarded call above."""
    with open(os.path.join(REPO, script)) as f:
        tree = ast.parse(f.read())
    found = {
        (node.value.id, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in WINDOWS_LACKS and node.attr in WINDOWS_LACKS[node.value.id]
    }  # fmt: skip
    assert found <= set(GUARDED), sorted(found - set(GUARDED))
