"""Start-up: the CPU script forks its workers, which is safe only while nothing fork breaks exists yet."""

import subprocess
import sys

import pytest

from conftest import REPO, script_env, write_dataset

PROBE = """
import os, sys
sys.path.insert(0, {repo!r})
import convnet_distributed as c
import torch.multiprocessing as mp

def threads():
    return sorted(os.listdir("/proc/self/task"))

after_imports = threads()
seen = {{}}

def start_processes(fn, args, nprocs, join, start_method):
    seen.update(method=start_method, threads=threads(), data=args[1] is not None)
    raise SystemExit(0)

mp.start_processes = start_processes
try:
    c.main(["--num-processes", "2", "--data-dir", {data!r}, "--master-port", "1"])
finally:
    print(after_imports == seen["threads"], seen["method"], seen["data"], \
len(after_imports), len(seen["threads"]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the workers are forked on Linux only")
def test_the_launcher_forks_before_any_thread_pool_exists(tmp_path):
    """Between its imports and the fork, the launcher (loading the data included) starts no thread: no OpenMP
    pool, whose threads a forked child would not have. The data goes to the workers as it is, not through
    /dev/shm. MNIST's size: a smaller set would stay under the size at which torch starts its pool."""
    data_dir = write_dataset(str(tmp_path), n_train=60000)
    probe = subprocess.run(
        [sys.executable, "-c", PROBE.format(repo=REPO, data=str(data_dir))],
        capture_output=True,
        text=True,
        env=script_env(),
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    same, method, data, *_ = probe.stdout.split()
    assert method == "fork"
    assert same == "True", probe.stdout  # the same threads as right after the imports
    assert data == "True"
