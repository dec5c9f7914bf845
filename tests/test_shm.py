"""/dev/shm, a tmpfs of fixed size (64 MiB in a Docker or Kubernetes container): where the gradient average
does not fit, the gradients go over Gloo and the run trains all the same; no data goes there: spawned workers
load their own. A process that touched a page beyond its size died of SIGBUS."""

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

import convnet_distributed
from conftest import REPO, free_port, read_json, script_env

MIB = 1 << 20
AVERAGER_8 = 4 * convnet_distributed.SharedMemoryAverager.floats(300_426, 8)  # 8 processes: 18 MiB


def fake_statvfs(free):
    def statvfs(path):
        assert path == "/dev/shm"
        return SimpleNamespace(f_bavail=free // 4096, f_frsize=4096)

    return statvfs


@pytest.mark.parametrize("free", [1024 * MIB, 64 * MIB, 16 * MIB])
def test_a_gradient_average_that_does_not_fit_in_dev_shm_is_one_line_saying_how_to_fix_it(monkeypatch, free):
    """A container's 64 MiB holds the gradient areas of 8 processes (18 MiB); 16 MiB does not."""
    monkeypatch.setattr(os, "statvfs", fake_statvfs(free))
    model = convnet_distributed.ConvNet()
    assert sum(p.numel() for p in model.parameters()) == 300_426
    line = convnet_distributed.gradient_shortfall(model, 8)
    if free > AVERAGER_8:
        assert line is None
        return
    assert line == (
        "/dev/shm has 16 MiB free, too little for the gradient average (18 MiB): gradients are averaged over "
        "Gloo; for more, run the container with --shm-size=1g (Docker), or mount an emptyDir with medium: "
        "Memory at /dev/shm (Kubernetes)"
    )


def test_without_dev_shm_there_is_no_cap_but_the_averager_is_off(monkeypatch):
    """macOS and Windows have no /dev/shm: their shared memory has no such cap; the averager needs Linux's."""

    def missing(path):
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(os, "statvfs", missing)
    assert convnet_distributed.gradient_shortfall(convnet_distributed.ConvNet(), 8) is None
    args = convnet_distributed.parse_args(["--num-processes", "2", "--master-port", "1"])
    assert convnet_distributed.averages_in_shared_memory(args, 2)
    real_isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda path: False if path == "/dev/shm" else real_isdir(path))
    assert not convnet_distributed.averages_in_shared_memory(args, 2)


def namespaces_unavailable():
    if not shutil.which("unshare"):
        return "no unshare command (util-linux)"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"cannot make a mount namespace with its own /dev/shm here: {probe.stderr.strip()}"
    return None


def in_small_dev_shm(size_mib, command, timeout):
    """command, run in a mount namespace whose /dev/shm is a tmpfs of size_mib, as in a container."""
    mount = f'mount -t tmpfs -o size={size_mib}m tmpfs /dev/shm && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", mount, "sh", *command],
        capture_output=True,
        text=True,
        env=script_env(),
        timeout=timeout,
    )


@pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))
@pytest.mark.parametrize("size_mib", [64, 16])
def test_eight_processes_train_in_a_containers_small_dev_shm(data_dir, tmp_path, size_mib):
    """A mount namespace with a tmpfs of 64 or 16 MiB over /dev/shm: 8 processes, whose gradient areas need
    18 MiB. 16 MiB once ended the run with SIGBUS; now the gradients go over Gloo, and rank 0 says why."""
    metrics = tmp_path / "m.json"
    command = [sys.executable, os.path.join(REPO, "convnet_distributed.py"), "--num-processes", "8",
               "--batch-size", "16", "--data-dir", str(data_dir), "--master-port", str(free_port()),
               "--metrics-json", str(metrics)]  # fmt: skip
    result = in_small_dev_shm(size_mib, command, timeout=400)
    assert result.returncode == 0, result.stderr
    m = read_json(metrics)
    assert m["world_size"] == 8 and m["test_accuracy"] > 0.8
    shortfall = [line for line in result.stdout.splitlines() if line.startswith("/dev/shm has")]
    if size_mib == 64:  # the gradient areas fit
        assert shortfall == [] and m["allreduce"] == "shared-memory"
    else:
        assert len(shortfall) == 1 and "too little for the gradient average (18 MiB)" in shortfall[0], (
            result.stdout
        )
        assert m["allreduce"] == "gloo"
        assert "gradients averaged over Gloo" in result.stdout


SHORT_OF_ROOM = """
import os, sys
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
import convnet_distributed as c

# /dev/shm (1 MiB here) had the room when it was checked, and another job, started at the same time, \
took it since.
shortfall = c.gradient_shortfall
c.gradient_shortfall = lambda model, world_size, failed=False: (
    shortfall(model, world_size, failed) if failed else None
)
c.averages_in_shared_memory = lambda args, world_size: True
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
ddp_model, allreduce, _ = c.data_parallel(c.ConvNet(), 0, 1, c.parse_args(["--master-port", "{port}"]))
loss = torch.nn.functional.nll_loss(ddp_model(torch.randn(4, 1, 28, 28)), torch.zeros(4, dtype=torch.long))
loss.backward()  # a step: its gradients averaged
print("gradients averaged", allreduce, flush=True)
print("left in /dev/shm", os.listdir("/dev/shm"), flush=True)
c.GROUPS_KEPT.append(dist.group.WORLD)
dist.destroy_process_group()
c.exit_at_once()
"""


@pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))
def test_room_taken_in_dev_shm_after_the_check_is_one_line_not_a_sigbus(tmp_path):
    """Jobs started together in one container each found room in /dev/shm (statvfs), then filled it together:
    the averager's file was sparse, and the first step's gradients killed the process with SIGBUS. The room is
    reserved now as the file is made (posix_fallocate): a shortfall there is one line, and the gradients go
    over Gloo."""
    (tmp_path / "short.py").write_text(SHORT_OF_ROOM.format(repo=REPO, port=free_port()))
    result = in_small_dev_shm(1, [sys.executable, str(tmp_path / "short.py")], timeout=120)
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)  # -7: SIGBUS
    advice = (
        "; for more, run the container with --shm-size=1g (Docker), "
        "or mount an emptyDir with medium: Memory at /dev/shm (Kubernetes)"
    )
    assert result.stdout.splitlines() == [
        "/dev/shm has 1 MiB free, too little for the gradient average (2 MiB): "
        "gradients are averaged over Gloo" + advice,
        "gradients averaged gloo",
        "left in /dev/shm []",
    ], result.stderr


SPAWNED = """
import os, sys
sys.path.insert(0, {repo!r})
import torch.multiprocessing as mp
import convnet_distributed as c

if __name__ == "__main__":  # a spawned worker imports this file too
    c.START_METHOD = "spawn"  # as on macOS and Windows
    start_processes = mp.start_processes

    def start_and_tell(fn, args, *rest, **kwargs):
        print("data handed down", args[1] is not None, flush=True)
        return start_processes(fn, args, *rest, **kwargs)

    mp.start_processes = start_and_tell
    c.main(sys.argv[1:])
    print("left in /dev/shm", os.listdir("/dev/shm"), flush=True)
    c.exit_at_once()
"""


@pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))
def test_spawned_workers_load_their_own_data_and_put_none_in_dev_shm(data_dir, tmp_path):
    """Spawned workers were handed the data through /dev/shm where it fitted, for a start-up no faster than
    each loading its own (bench/README.md). In a container's 64 MiB now only the gradient areas go there."""
    (tmp_path / "spawned.py").write_text(SPAWNED.format(repo=REPO))
    metrics = tmp_path / "m.json"
    command = [sys.executable, str(tmp_path / "spawned.py"), "--num-processes", "2", "--batch-size", "32",
               "--data-dir", str(data_dir), "--master-port", str(free_port()),
               "--metrics-json", str(metrics)]  # fmt: skip
    result = in_small_dev_shm(64, command, timeout=300)
    assert result.returncode == 0, result.stderr
    m = read_json(metrics)
    assert m["world_size"] == 2 and m["test_accuracy"] > 0.8 and m["allreduce"] == "shared-memory"
    lines = result.stdout.splitlines()
    assert "data handed down False" in lines and lines[-1] == "left in /dev/shm []", result.stdout
    assert not [line for line in lines if line.startswith("/dev/shm has")], result.stdout
