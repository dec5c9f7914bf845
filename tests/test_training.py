"""End to end: the scripts launched as a user launches them, on the small generated data set."""

import os
import platform
import re
import subprocess
import sys

import psutil
import pytest
import torch

from conftest import (
    N_TEST,
    N_TRAIN,
    REPO,
    finish,
    free_port,
    launch,
    read_json,
    run_script,
    script_env,
    wait_for_line,
)

METRIC_KEYS = {
    "script",
    "world_size",
    "epochs",
    "batch_size",
    "global_batch_size",
    "threads",
    "amp",
    "device",
    "train_seconds",
    "total_seconds",
    "samples_per_second",
    "final_train_loss",
    "test_loss",
    "test_accuracy",
}
PROGRESS = re.compile(r"^epoch: (\d+) \[(\d+)/(\d+) \((\d+)%\)\]\t training loss: (\d+\.\d{6})$")
SPLIT = re.compile(
    r"Epoch (\d+) trained in (\S+) s: (\S+) s computing, (\S+) s \((\d+)%\) waiting for gradients"
)


def check_run(result, metrics_path, world_size, batch_size, epochs=1):
    """What every good run shows: exit 0, the article's log format, a last line, sound metrics."""
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"Finished training in \d+\.\d+ secs", lines[-1]), lines[-1]
    progress = [PROGRESS.match(line) for line in lines if line.startswith("epoch: ")]
    assert progress and all(progress), lines
    batches = -(-N_TRAIN // (batch_size * world_size))
    # Only rank 0 prints: one progress line per 10 batches, not one per process.
    assert [(int(m[1]), int(m[2])) for m in progress] == [
        (e, b) for e in range(epochs) for b in range(0, batches, 10)
    ]
    assert all(int(m[3]) == batches for m in progress)
    assert len([line for line in lines if line.startswith("Test set, epoch")]) == epochs
    m = read_json(metrics_path)
    if m["script"] == "convnet_distributed.py":  # each epoch's loop: computing, then waiting for gradients
        split = [SPLIT.fullmatch(line) for line in lines if line.startswith("Epoch ")]
        assert [int(s[1]) for s in split] == list(range(epochs)), lines
        assert all(float(s[3]) + float(s[4]) == pytest.approx(float(s[2]), abs=0.011) for s in split), lines
        assert [(h["train_seconds"], h["waiting_seconds"]) for h in m["history"]] == [
            pytest.approx((float(s[2]), float(s[4])), abs=0.006) for s in split
        ]
    # Before training, one line with the layout: nobody trains alone, or on another layout, unawares.
    layout = [line for line in lines if line.startswith("World size ")]
    assert len(layout) == 1 and lines.index(layout[0]) < lines.index(progress[0][0]), lines
    threads = f"{m['threads']} thread{'s' if m['threads'] > 1 else ''}"
    if world_size == 1 and m["script"] == "convnet_undistributed.py":
        assert layout[0] == f"World size 1 = 1 process; batch {batch_size}; {threads}; no gradient averaging"
    else:
        assert layout[0].startswith(f"World size {world_size} = "), layout
        assert (
            f"; global batch {batch_size * world_size} = {world_size} x {batch_size}; {threads} per process;"
            in (layout[0])
        )
    assert METRIC_KEYS <= set(m)
    assert (m["world_size"], m["batch_size"], m["global_batch_size"]) == (
        world_size,
        batch_size,
        batch_size * world_size,
    )
    assert m["test_samples"] == N_TEST  # every test image counted exactly once, whatever the world size
    assert 0 < m["train_seconds"] < m["total_seconds"]
    assert m["samples_per_second"] == pytest.approx(epochs * N_TRAIN / m["train_seconds"])
    assert 0 <= m["test_accuracy"] <= 1
    # Every rank's peak memory while it worked: more than torch alone takes, less than this machine has.
    peaks = m.get("peak_rss_mib_per_rank", [m.get("peak_rss_mib")])
    assert len(peaks) == world_size and all(200 < p < psutil.virtual_memory().total / 2**20 for p in peaks), (
        peaks
    )
    first_loss = float(progress[0][5])
    assert first_loss > 2.0 and m["final_train_loss"] < first_loss  # started at chance, and learnt
    return m


def test_baseline_article_command_trains_and_reports(data_dir, tmp_path):
    metrics = tmp_path / "m.json"
    result = run_script(
        "convnet_undistributed.py", "--epochs", 1, "--data-dir", data_dir, "--metrics-json", metrics
    )
    m = check_run(result, metrics, 1, 128)
    assert m["script"] == "convnet_undistributed.py" and m["device"] == "cpu" and m["amp"] is False
    assert m["threads"] == len(os.sched_getaffinity(0))
    assert m["test_accuracy"] > 0.8  # chance is 0.1


@pytest.mark.parametrize("processes,batch_size", [(1, 128), (2, 64), (3, 32), (4, 32), (8, 16)])
def test_distributed_article_commands_train(data_dir, tmp_path, processes, batch_size):
    """The article's runs (1, 2, 4, 8 processes at 128, 64, 32, 16), and 3 processes: uneven test shards.
    Under -W error: the article's Dropout2d warned on every forward pass."""
    metrics = tmp_path / "m.json"
    result = run_script(
        "convnet_distributed.py",
        "--num-machines",
        1,
        "--num-processes",
        processes,
        "--machine-id",
        0,
        "--epochs",
        1,
        "--batch-size",
        batch_size,
        "--data-dir",
        data_dir,
        "--master-port",
        free_port(),
        "--metrics-json",
        metrics,
        python_flags=["-W", "error"],
        timeout=240,
    )
    m = check_run(result, metrics, processes, batch_size)
    if processes == 2:  # on one host, 2 processes on 2 cores: little waiting for gradients (measured: 3-7%)
        (epoch,) = m["history"]
        assert 0 <= epoch["waiting_seconds"] < epoch["train_seconds"] / 4, epoch
    averaged = "in shared memory" if processes > 1 else "over Gloo"
    assert f"World size {processes} = 1 machine x {processes} process" in result.stdout
    assert f"gradients averaged {averaged}\n" in result.stdout
    assert m["script"] == "convnet_distributed.py"
    assert m["threads"] == max(1, len(os.sched_getaffinity(0)) // processes)  # no oversubscription
    assert m["test_accuracy"] > 0.8  # chance is 0.1
    assert result.stderr == ""


def test_two_machines_on_one_host_form_one_group(data_dir, tmp_path):
    """The article's two-machine commands, both spellings, with the master address and port given."""
    port = free_port()
    common = [
        "--num-processes",
        2,
        "--epochs",
        1,
        "--batch-size",
        32,
        "--data-dir",
        data_dir,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]
    machine1 = launch(
        "convnet_distributed.py",
        "--num_machines=2",
        "--machine_id=1",
        *common,
        "--metrics-json",
        tmp_path / "m1.json",
    )
    machine0 = launch(
        "convnet_distributed.py",
        "--num-machines",
        2,
        "--machine-id",
        0,
        *common,
        "--metrics-json",
        tmp_path / "m0.json",
    )
    result0, result1 = finish(machine0, 180), finish(machine1, 180)
    assert result1.returncode == 0, result1.stderr
    check_run(result0, tmp_path / "m0.json", 4, 32)
    assert "epoch: " not in result1.stdout  # rank 0 lives on machine 0: machine 1 prints no progress
    assert not (tmp_path / "m1.json").exists()


def test_launches_given_rank_and_world_size_without_local_rank_form_one_group(data_dir, tmp_path):
    """Kubeflow's PyTorchJob, and hand-written env:// jobs: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, no
    LOCAL_RANK. Each launch joins as one process. Before, rank 0 trained alone and rank 1 could not serve
    the store."""
    port = free_port()
    common = ["--batch-size", 64, "--data-dir", data_dir, "--threads", 1]
    launches = [
        launch(
            "convnet_distributed.py",
            *common,
            "--metrics-json",
            tmp_path / f"m{rank}.json",
            env=script_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        )
        for rank in (1, 0)
    ]
    result1, result0 = (finish(p, 180) for p in launches)
    assert result1.returncode == 0, result1.stderr
    m = check_run(result0, tmp_path / "m0.json", 2, 64)
    assert "World size 2 = 2 machines x 1 process;" in result0.stdout
    assert m["test_accuracy"] > 0.8 and not (tmp_path / "m1.json").exists()


def test_amp_trains_with_bfloat16_autocast(data_dir, tmp_path):
    metrics = tmp_path / "m.json"
    result = run_script(
        "convnet_distributed.py",
        "--amp",
        "--batch-size",
        64,
        "--data-dir",
        data_dir,
        "--master-port",
        free_port(),
        "--metrics-json",
        metrics,
    )
    m = check_run(result, metrics, 1, 64)
    assert m["amp"] is True and m["test_accuracy"] > 0.8


@pytest.mark.parametrize("script,processes", [("convnet_undistributed.py", 1), ("convnet_distributed.py", 2)])
def test_the_seed_decides_a_run_to_the_bit_and_amp_changes_it(data_dir, tmp_path, script, processes):
    """--seed draws the initial weights, the batches' order and the dropout masks: the same seed gives the
    same run to the bit (on the same threads), another seed another run; --amp (bfloat16) changes it."""

    def losses(name, *flags):
        metrics = tmp_path / f"{name}.json"
        layout = ["--num-processes", processes, "--master-port", free_port()] if processes > 1 else []
        result = run_script(script, *layout, "--batch-size", 128 // processes, "--data-dir", data_dir,
                            "--threads", 1, "--log-interval", 1000, "--metrics-json", metrics,
                            *flags)  # fmt: skip
        assert result.returncode == 0, result.stderr
        m = read_json(metrics)
        return [m["final_train_loss"], m["test_loss"], m["test_accuracy"]]

    first, again, other, amp = (
        losses("first"),
        losses("again", "--seed", 0),
        losses("other", "--seed", 1),
        losses("amp", "--amp"),
    )
    assert first == again, (first, again)
    assert other[0] != first[0] and other[1] != first[1], (first, other)
    assert amp[0] != first[0] and amp[1] != first[1], (first, amp)


def torchrun(*args, script_args=()):
    """Start torchrun as a user would (python -m torch.distributed.run is the torchrun command)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *map(str, args),
        os.path.join(REPO, "convnet_distributed.py"),
        *map(str, script_args),
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=script_env(),
        start_new_session=True,
    )


def test_torchrun_launch_joins_its_group_and_matches_the_scripts_own_launch(data_dir, tmp_path):
    """Under torchrun the script does not spawn: it joins the group torchrun made, with torchrun's ranks,
    and trains exactly as its own launch of the same world size does."""
    common = ["--batch-size", 64, "--data-dir", data_dir, "--seed", 3, "--threads", 1]  # both: the same sums
    proc = torchrun(
        "--nproc-per-node",
        2,
        "--master-port",
        free_port(),
        script_args=[*common, "--metrics-json", tmp_path / "torchrun.json"],
    )
    under_torchrun = finish(proc, 180)
    m = check_run(under_torchrun, tmp_path / "torchrun.json", 2, 64)
    assert m["threads"] == 1
    own = run_script(
        "convnet_distributed.py",
        *common,
        "--num-processes",
        2,
        "--master-port",
        free_port(),
        "--metrics-json",
        tmp_path / "own.json",
    )
    o = check_run(own, tmp_path / "own.json", 2, 64)
    assert set(m) == set(o)
    first_line = [line for line in under_torchrun.stdout.splitlines() if line.startswith("epoch: ")][0]
    assert first_line == [line for line in own.stdout.splitlines() if line.startswith("epoch: ")][0]
    assert m["test_loss"] == pytest.approx(o["test_loss"], rel=1e-5)


def test_torchrun_restarts_a_killed_rank_and_the_group_resumes_from_the_checkpoint(data_dir, tmp_path):
    """torchrun --max-restarts: a rank killed mid-epoch makes torchrun restart the group, which resumes from
    the last complete checkpoint and ends as an unbroken run ends."""
    ck = tmp_path / "ck.pt"
    common = ["--batch-size", 64, "--data-dir", data_dir, "--epochs", 3, "--log-interval", 1]
    unbroken = run_script(
        "convnet_distributed.py",
        *common,
        "--num-processes",
        2,
        "--master-port",
        free_port(),
        "--metrics-json",
        tmp_path / "unbroken.json",
        timeout=180,
    )
    assert unbroken.returncode == 0, unbroken.stderr
    proc = torchrun(
        "--nproc-per-node",
        2,
        "--max-restarts",
        2,
        "--master-port",
        free_port(),
        script_args=[*common, "--checkpoint", ck, "--resume", "--metrics-json", tmp_path / "m.json"],
    )
    wait_for_line(proc, "epoch: 1 [2/")
    ranks = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "convnet_distributed.py" in " ".join(p.cmdline())
    ]
    assert len(ranks) == 2
    ranks[1].kill()
    result = finish(proc, 240)
    assert result.returncode == 0, result.stderr
    assert "Resuming from" in result.stdout and "starting epoch 1" in result.stdout
    restarted, whole = read_json(tmp_path / "m.json"), read_json(tmp_path / "unbroken.json")
    assert restarted["epochs_trained"] == 2 and torch.load(ck, weights_only=True)["epoch"] == 2
    assert restarted["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-4)
    assert restarted["test_accuracy"] == whole["test_accuracy"]


# The GPU script on the CPU: one fake GPU, NCCL become Gloo (as tests/test_cuda_script.py's FAKE_GPUS).
FAKE_GPU = """
torch.cuda.is_available, torch.cuda.device_count = lambda: True, lambda: 1
torch.cuda.set_device, torch.cuda.current_device = lambda index: None, lambda: 0
torch.cuda.get_device_properties = lambda index: types.SimpleNamespace(uuid="GPU-a")
script.select_device = lambda rank, select=script.select_device: (select(rank), torch.device("cpu"))[1]
"""


@pytest.mark.parametrize("script", ["convnet_distributed.py", "convnet_distributed_cuda.py"])
def test_dynamo_is_imported_just_before_the_process_group(script, data_dir):
    """DDP's constructor imports torch._dynamo. Imported only then, after the process group exists, it kept
    Gloo's threads alive past destroy_process_group(), and 1 run in 7 of a 3-process job aborted at exit.
    The scripts import it just before the group: this fails if that import goes or moves after it. Not at the
    top, nor torchvision (which imports it): a process that stops before the group (--help, a flag, the roll
    call) is spared a second of CPU. A launch that forks its workers imports it once, before the fork."""
    fork = [] if "cuda" in script else ["--num-processes", "2"]  # forked workers keep this code's patches
    argv = ["--check", "--data-dir", data_dir, "--master-port", str(free_port()), *fork]
    code = f"""
import sys, types, torch, torch.distributed as dist
import {os.path.splitext(script)[0]} as script
print("imported:", "torch._dynamo" in sys.modules, "torchvision" in sys.modules)
{FAKE_GPU if "cuda" in script else ""}
def spy(backend, *, device_id=None, init=dist.init_process_group, **kwargs):
    print("at the group:", "torch._dynamo" in sys.modules, flush=True)
    return init("gloo", **kwargs)
dist.init_process_group = spy
def before_the_fork(*args, run_workers=script.run_workers):
    print("before the fork:", "torch._dynamo" in sys.modules, flush=True)
    return run_workers(*args)
script.run_workers = before_the_fork
try:
    script.main({argv!r})
except SystemExit as e:
    script.exit_at_once(e)
script.exit_at_once()
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=script_env()
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "imported: False False" and "at the group: False" not in lines, done.stdout
    assert lines.count("at the group: True") == (1 if "cuda" in script else 2), done.stdout
    assert ("before the fork: True" in lines) == ("cuda" not in script), done.stdout


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="keep_freed_memory tunes glibc's allocator")
def test_freed_memory_is_kept_for_the_next_step_and_released_after_evaluation():
    """keep_freed_memory keeps freed blocks (each step reuses them); release_freed_memory hands them back."""
    code = """if True:
        import convnet_undistributed as c, torch
        rss = lambda: int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
        c.keep_freed_memory()
        before = rss()
        blocks = [torch.ones(2 << 20) for _ in range(16)]  # 16 x 8 MiB: below the 32 MiB that goes to mmap
        del blocks
        kept = rss()
        c.release_freed_memory()
        print(before, kept, rss())"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, kept, released = map(int, done.stdout.split())
    assert kept > before + 100 and released < kept - 100, (before, kept, released)
