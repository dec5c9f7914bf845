"""The GPU script's training, run here on the CPU through its own functions (Gloo for NCCL, CPU for CUDA),
and its GPU runs, which only a machine with a GPU can do."""

import os
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

import convnet_distributed_cuda as cuda_script
from conftest import (
    N_TEST,
    REPO,
    finish,
    free_port,
    read_json,
    run_script,
    script_env,
    spawn_bounded,
    tensors,
)
from test_faults import left_running


def needs_gpu(test):
    """The only tests that may skip under CI's CONVNET_REQUIRE_ALL=1 (conftest.py): those that need a GPU."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible here")
    return pytest.mark.gpu(skip(test))


def worker_on_cpu(local_rank, args):
    """A rank of the script's own worker, its one choice of backend and device pointed at Gloo and the CPU."""
    init_process_group = dist.init_process_group

    def on_gloo(backend, device_id=None, **kwargs):
        assert backend == "nccl" and device_id is not None  # NCCL connects inside the script's guard
        init_process_group("gloo", **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "init_process_group", on_gloo)
        patch.setattr(cuda_script, "select_device", lambda local_rank: torch.device("cpu"))
        gpu_of_its_own(patch, local_rank)
        cuda_script.worker(local_rank, args, tensors())


def gpu_of_its_own(patch, index):
    """What prepare_backend asks of the GPU this process took: cuda:index, a GPU no other process has."""
    patch.setattr(torch.cuda, "current_device", lambda: index)
    patch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=f"GPU-{i}"))


def spawned_worker_on_cpu(local_rank, args):
    """A spawned rank ends as the script's own do (exit_at_once): the Gloo group is kept to the exit
    (rendezvous), and tearing the interpreter down with it aborted about 1 run in 20 (SIGABRT)."""
    worker_on_cpu(local_rank, args)
    cuda_script.exit_at_once()


@pytest.mark.parametrize("processes", [1, 2])
def test_cuda_script_training_runs_on_cpu_through_its_own_functions(tmp_path, monkeypatch, capsys, processes):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    args = cuda_script.parse_args(
        [
            "--num-gpu-processes",
            str(processes),
            "--batch-size",
            str(128 // processes),
            "--metrics-json",
            str(tmp_path / "m.json"),
            "--checkpoint",
            str(tmp_path / "ck.pt"),
        ]
    )
    if processes == 1:
        try:
            worker_on_cpu(0, args)
        finally:  # free the group kept for its exit (rendezvous) now: pytest's process goes on
            cuda_script.GROUPS_KEPT.clear()
        assert "Finished training in" in capsys.readouterr().out
    else:
        spawn_bounded(spawned_worker_on_cpu, (args,), nprocs=processes)
    m = read_json(tmp_path / "m.json")
    assert (m["script"], m["world_size"], m["global_batch_size"]) == (
        "convnet_distributed_cuda.py",
        processes,
        128,
    )
    assert m["test_samples"] == N_TEST and m["test_accuracy"] > 0.8
    state = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert set(state["model"]) == set(cuda_script.ConvNet().state_dict())  # loads in the CPU scripts too


def test_a_failed_check_names_nccl_which_the_script_uses(clean_env, monkeypatch):
    """--check's error, when the sum comes out short, names the GPU script's backend: it said Gloo."""
    args = cuda_script.parse_args(["--num-gpu-processes", "1", "--check"])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", lambda tensor: None)  # one process's 1: the other's never came
    with pytest.raises(SystemExit) as exited:
        cuda_script.try_the_group(2, torch.device("cpu"), None, args)
    assert str(exited.value) == "error: the check summed 1 over 2 processes: NCCL lost some"


def nccl_interface_at_init(monkeypatch, args, world_size):
    """NCCL_SOCKET_IFNAME as the GPU script's join_group leaves it for NCCL (read in init_process_group)."""
    seen = []

    def init_process_group(backend, **kwargs):
        seen.append(os.environ.get("NCCL_SOCKET_IFNAME"))
        raise RuntimeError("stop here")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    gpu_of_its_own(monkeypatch, 0)
    with pytest.raises(SystemExit):  # the join fails as NCCL's would, in one line
        cuda_script.join_group(0, world_size, args)
    return seen[0]


def test_a_job_on_one_machine_keeps_nccl_on_loopback(clean_env, monkeypatch):
    """NCCL's bootstrap listens, unauthenticated, on the first interface it finds: on loopback for a job on
    one machine; a NCCL_SOCKET_IFNAME given by the user stays."""
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    args = cuda_script.parse_args(["--num-gpu-processes", "1", "--master-port", str(free_port())])
    assert nccl_interface_at_init(monkeypatch, args, 1) == "=lo"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")
    args = cuda_script.parse_args(["--num-gpu-processes", "1", "--master-port", str(free_port())])
    assert nccl_interface_at_init(monkeypatch, args, 1) == "eth1"
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    two_machines = cuda_script.parse_args(["--num-machines", "2", "--num-gpu-processes", "1"])
    gpu_of_its_own(monkeypatch, 0)
    cuda_script.prepare_backend(dist.HashStore(), 0, 2, two_machines)
    assert "NCCL_SOCKET_IFNAME" not in os.environ  # NCCL's own choice, between machines


# A launch of the GPU script on a host with two GPUs, faked: every process sees the GPU whose UUID it is given
# as cuda:0 (device_count 2); NCCL becomes Gloo and the GPU the CPU, past select_device.
FAKE_GPUS = """
import sys, types
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
uuid = sys.argv[2]
torch.cuda.is_available, torch.cuda.device_count = lambda: True, lambda: 2
torch.cuda.set_device, torch.cuda.current_device = lambda index: None, lambda: 0
torch.cuda.get_device_properties = lambda index: types.SimpleNamespace(uuid=uuid)
import convnet_distributed_cuda as script
init_process_group, select_device = dist.init_process_group, script.select_device
dist.init_process_group = lambda backend, device_id=None, **kwargs: init_process_group("gloo", **kwargs)
script.select_device = lambda local_rank: (select_device(local_rank), torch.device("cpu"))[1]
sys.argv = ["convnet_distributed_cuda.py", *sys.argv[3:]]
try:
    script.main()
except SystemExit as e:
    script.exit_at_once(e.code)
script.exit_at_once()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("uuids", [("GPU-a", "GPU-a"), ("GPU-a", "GPU-b")])
def test_processes_that_share_one_gpu_stop_with_one_line(tmp_path, uuids):
    """RANK and WORLD_SIZE without LOCAL_RANK (each process a machine of its own, on cuda:0), two processes on
    one host: both took the same GPU, and NCCL's "Duplicate GPU detected" came out as "lost contact with the
    job". Now each says which ranks share which GPU, within seconds. Two processes each bound to its own GPU,
    seen as cuda:0 (a container's, srun --gpus-per-task=1), are told apart by UUID and form their group."""
    harness, port = tmp_path / "fake_gpus.py", free_port()
    harness.write_text(FAKE_GPUS)
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, harness, REPO, uuid, "--check", "--timeout", "60"],
            env=script_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            start_new_session=True,
        )
        for rank, uuid in enumerate(uuids)
    ]
    results = [finish(p, timeout=90) for p in procs]
    seconds = time.monotonic() - start
    assert all(left_running(p.pid) == [] for p in procs)
    if uuids[0] != uuids[1]:
        assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
        assert "Check passed: 2 processes on 2 machines reached each other" in results[0].stdout
        return
    host = os.uname().nodename
    for r in results:
        assert r.returncode == 1 and r.stdout == "", r.stderr
        assert r.stderr.splitlines() == [
            f"error: ranks 0 and 1 share one GPU (cuda:0 on {host}): give each its own (a launcher's local "
            "rank, or CUDA_VISIBLE_DEVICES)"
        ], r.stderr
    assert seconds < 30, seconds


def test_a_process_bound_to_one_gpu_takes_the_one_it_sees(monkeypatch):
    """srun --gpus-per-task=1 shows a task one GPU as cuda:0, whatever SLURM_LOCALID: set_device(1) failed."""
    chosen = []
    if hasattr(
        torch.backends.cudnn, "conv"
    ):  # select_device turns TF32 on (torch 2.9 and later): put back after
        for switches in (torch.backends.cuda.matmul, torch.backends.cudnn.conv):
            monkeypatch.setattr(switches, "fp32_precision", switches.fp32_precision)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert cuda_script.select_device(1) == torch.device("cuda", 0) and chosen == [0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert cuda_script.select_device(2) == torch.device("cuda", 2) and chosen == [0, 2]


@needs_gpu
def test_one_gpu_epoch(data_dir, tmp_path):
    result = run_script(
        "convnet_distributed_cuda.py",
        "--num-gpu-processes",
        1,
        "--batch-size",
        128,
        "--data-dir",
        data_dir,
        "--master-port",
        free_port(),
        "--metrics-json",
        tmp_path / "m.json",
    )
    assert result.returncode == 0, result.stderr
    m = read_json(tmp_path / "m.json")
    assert m["device"].startswith("cuda") and m["test_samples"] == N_TEST and m["test_accuracy"] > 0.8
    assert "Grad strides do not match" not in result.stderr  # DDP's warning when it must copy a gradient


def test_gradients_reach_ddp_in_their_parameters_strides():
    """cuDNN hands conv1's weight gradient (16x1x3x3) over with the contiguous stride on its size-1 channel
    dimension, (9, 9, 3, 1), where the channels-last parameter has (9, 1, 3, 1): the hook restates it."""
    model = cuda_script.ConvNet().to(memory_format=torch.channels_last)
    cuda_script.match_gradient_strides(model)
    weight = model.conv1.weight
    (hook,) = weight._backward_hooks.values()
    grad = torch.randn(weight.shape)  # as cuDNN gives it
    assert grad.stride() != weight.stride()
    restated = hook(grad)
    assert restated.stride() == weight.stride() and torch.equal(restated, grad)
    other = torch.randn(3, 3, 16, 1).permute(2, 3, 0, 1)  # the same shape in another memory order: left alone
    assert hook(other) is other


@needs_gpu
def test_every_gpu_by_default(data_dir, tmp_path):
    result = run_script(
        "convnet_distributed_cuda.py",
        "--data-dir",
        data_dir,
        "--master-port",
        free_port(),
        "--metrics-json",
        tmp_path / "m.json",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert read_json(tmp_path / "m.json")["world_size"] == torch.cuda.device_count()


@needs_gpu
def test_more_gpu_processes_than_gpus_is_a_clear_error(data_dir):
    result = run_script(
        "convnet_distributed_cuda.py",
        "--num-gpu-processes",
        torch.cuda.device_count() + 1,
        "--data-dir",
        data_dir,
        timeout=60,
    )
    assert result.returncode == 1 and "GPU" in result.stderr and "Traceback" not in result.stderr
