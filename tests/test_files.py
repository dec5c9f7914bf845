"""What the scripts write, and what they leave behind: a full disk is one line and the file before stays
whole; new files get the mode a plain open() gives; unpacking into a shared --data-dir takes a name of its
own; the shared-memory averager's name goes even when its set-up fails; the interrupt line says what the
checkpoint holds."""

import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
import types
from datetime import timedelta

import pytest
import torch

import convnet_distributed
import convnet_distributed_cuda
import convnet_undistributed
from conftest import REPO, default_ctrl_c, finish, free_port, launch, script_env, spawn_bounded, wait_for_line
from test_faults import job, left_running

# A tmpfs of its own, seen by this command alone (a mount namespace): the disk fills where a test says.
ON_A_SMALL_DISK = """
mount -t tmpfs -o size={size} tmpfs {disk} || exit 99
{prepare}
"$@"
status=$?
ls -A {disk} > {listing}
cp -p {disk}/{keep} {kept} 2>/dev/null
exit $status
"""


def can_mount():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


needs_mount = pytest.mark.skipif(not can_mount(), reason="needs root and unshare -m, to mount a small tmpfs")


def on_a_small_disk(tmp_path, command, size, keep, prepare=""):
    """Run command with tmp_path/disk a tmpfs of size; returns (result, names left on the disk, path of a copy
    of the file keep as it was at the end, pgid)."""
    disk, listing, kept = tmp_path / "disk", tmp_path / "listing", tmp_path / "kept"
    disk.mkdir()
    shell = ON_A_SMALL_DISK.format(
        size=size, disk=disk, prepare=prepare, listing=listing, keep=keep, kept=kept
    )
    proc = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", shell, "sh", *map(str, command)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=script_env(),
        start_new_session=True,
        preexec_fn=default_ctrl_c,
    )
    result = finish(proc, 180)
    assert result.returncode != 99, "could not mount a tmpfs"
    return result, listing.read_text().split(), kept, proc.pid


def assert_one_line(result, path, cause="No space left on device"):
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert result.stderr.startswith(f"error: cannot write {path} ({cause})"), result.stderr


@needs_mount
def test_a_full_disk_stops_a_distributed_run_with_one_line_and_the_checkpoint_before_whole(
    data_dir, tmp_path
):
    """2 processes, 2 epochs: epoch 0's checkpoint (3.6 MB) fits on a 5 MB disk, epoch 1's cannot be written
    beside it. Rank 0 once raised OSError (two tracebacks through the launcher) while rank 1 trained on."""
    ck = tmp_path / "disk" / "ck.pt"
    command = [sys.executable, os.path.join(REPO, "convnet_distributed.py"), "--data-dir", data_dir,
               "--num-processes", 2, "--batch-size", 64, "--master-port", free_port(), "--epochs", 2,
               "--checkpoint", ck, "--metrics-json", tmp_path / "m.json"]  # fmt: skip
    result, names, kept, pgid = on_a_small_disk(tmp_path, command, "5m", "ck.pt")
    assert_one_line(result, ck)
    assert "Test set, epoch 1" in result.stdout and "Finished training" not in result.stdout
    assert names == ["ck.pt"]  # no temporary file left
    assert torch.load(kept, weights_only=True)["epoch"] == 0  # the previous checkpoint, whole
    assert not (tmp_path / "m.json").exists()
    assert left_running(pgid) == []


@needs_mount
def test_a_full_disk_stops_the_baseline_with_one_line_and_the_metrics_before_whole(data_dir, tmp_path):
    """The disk filled up before the run ends: the old --metrics-json stays as it was."""
    metrics = tmp_path / "disk" / "m.json"
    fill = f"echo old > {metrics}; cat /dev/zero > {tmp_path / 'disk' / 'filler'} 2>/dev/null"
    command = [sys.executable, os.path.join(REPO, "convnet_undistributed.py"), "--data-dir", data_dir,
               "--metrics-json", metrics]  # fmt: skip
    result, names, kept, pgid = on_a_small_disk(tmp_path, command, "1m", "m.json", prepare=fill)
    assert_one_line(result, metrics)
    assert sorted(names) == ["filler", "m.json"] and kept.read_text() == "old\n"
    assert left_running(pgid) == []


GPU_SCRIPT_SAVES = """
import sys
import types
sys.path.insert(0, {repo!r})
import torch.distributed as dist
import convnet_distributed_cuda as script

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
job, path = types.SimpleNamespace(rank=0, first_rank=0), sys.argv[1]  # a launcher's rank 0, alone
try:
    script.on_rank0(job, script.write_atomically, path, lambda f: f.write(b"first" * 400_000))  # 2 of 3 MB
    script.on_rank0(job, script.write_atomically, path, lambda f: f.write(b"second" * 400_000))  # no room
except SystemExit as e:  # leave as the script does: a teardown with the group alive can abort
    script.exit_at_once(e.code)
"""


@needs_mount
def test_a_full_disk_in_the_gpu_script_is_one_line(tmp_path):
    """Its on_rank0 (the CPU script's, as test_model checks) on a world of one over Gloo: no GPU here."""
    (tmp_path / "saves.py").write_text(GPU_SCRIPT_SAVES.format(repo=REPO, port=free_port()))
    ck = tmp_path / "disk" / "ck.pt"
    command = [sys.executable, tmp_path / "saves.py", ck]
    result, names, kept, pgid = on_a_small_disk(tmp_path, command, "3m", "ck.pt")
    assert_one_line(result, ck)
    assert names == ["ck.pt"] and kept.read_bytes() == b"first" * 400_000


@pytest.mark.parametrize("script", [convnet_undistributed, convnet_distributed, convnet_distributed_cuda])
def test_files_written_get_the_mode_of_a_plain_open_and_keep_their_own(script, tmp_path, monkeypatch):
    """NamedTemporaryFile once made every checkpoint and metrics file 0600: unreadable to teammates and
    evaluation jobs on shared storage; a file made readable lost it next epoch. The file is flushed."""
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)) or fsync(fd)
    )
    old_umask = os.umask(0o027)
    try:
        path = tmp_path / "ck.pt"
        assert script.write_atomically(path, lambda f: f.write(b"one")) is None
        assert stat.S_IMODE(path.stat().st_mode) == 0o640  # 0666 less the umask, as open() gives
        path.chmod(0o644)
        assert script.write_atomically(path, lambda f: f.write(b"two")) is None
        assert stat.S_IMODE(path.stat().st_mode) == 0o644 and path.read_bytes() == b"two"
    finally:
        os.umask(old_umask)
    assert synced == [False, False]  # the file, each time
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_unpacking_beside_another_launch_of_the_same_pid_leaves_its_file_alone(tmp_path, monkeypatch):
    """Pods that share --data-dir are often each PID 1: a name made of the PID (`.part1`) was the other pod's
    half-unpacked file too, truncated and renamed away under it. Here the other pod is midway, under PID 1."""
    from conftest import write_dataset

    raw = os.path.join(write_dataset(str(tmp_path), gz=True), "MNIST", "raw")
    path = os.path.join(raw, "t10k-labels-idx1-ubyte")
    theirs = f"{path}.part1"  # the name the other pod, PID 1 too, was writing under
    with open(theirs, "wb") as f:
        f.write(b"the other pod's half")
    monkeypatch.setattr(os, "getpid", lambda: 1)
    convnet_distributed.prepare_data(types.SimpleNamespace(data_dir=str(tmp_path), dataset="mnist"))
    assert open(theirs, "rb").read() == b"the other pod's half"
    assert open(path, "rb").read()[:4] == b"\x00\x00\x08\x01"  # idx magic: whole
    leftovers = sorted(n for n in os.listdir(raw) if n.startswith("."))
    assert leftovers == [], leftovers


def set_up_averager_and_fail(rank, port, token, out):
    """Rank 1 fails as it maps the averager's file (killed, out of memory, a timeout): rank 0 then fails too.
    Each writes what it raised to out/rank{rank}."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=5)
    )
    convnet_distributed.uuid = types.SimpleNamespace(uuid4=lambda: types.SimpleNamespace(hex=token))
    if rank == 1:
        torch.from_file = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("rank 1 stopped"))
    raised = "nothing"
    try:
        convnet_distributed.SharedMemoryAverager(convnet_distributed.ConvNet(), rank, 2, 5)
    except Exception as e:  # expected: the test checks which, and what it leaves behind
        raised = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(raised)
    os._exit(0)  # as the scripts' workers leave: Gloo's threads are not torn down


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="the averager works in /dev/shm")
def test_a_failed_averager_set_up_leaves_nothing_in_dev_shm(tmp_path):
    """Rank 0 created /dev/shm/convnet-ddp-* and removed it only once every rank had mapped it: a rank that
    failed or timed out in between left it there, and /dev/shm is memory."""
    token = secrets.token_hex(8)
    spawn_bounded(set_up_averager_and_fail, (free_port(), token, str(tmp_path)), nprocs=2, timeout=60)
    assert not os.path.exists(f"/dev/shm/convnet-ddp-{token}")
    assert (tmp_path / "rank1").read_text() == "RuntimeError: rank 1 stopped"
    rank0 = (
        tmp_path / "rank0"
    ).read_text()  # Gloo's error at the barrier rank 1 never reached: reset, or timed out
    assert rank0.split(":")[0] in ("RuntimeError", "DistBackendError") and "gloo" in rank0, rank0


@pytest.mark.parametrize(
    "script,extra,existing,words",
    [
        ("convnet_undistributed.py", [], False, "no epoch completed, so nothing was saved to {ck}"),
        (
            "convnet_distributed.py",
            ["--num-processes", 2],
            True,
            "no epoch completed since this launch: {ck} is as",
        ),
    ],
)
def test_the_interrupt_line_says_what_the_checkpoint_really_holds(
    data_dir, tmp_path, script, extra, existing, words
):
    """Stopped in its first epoch, a run once said "ck.pt holds the last complete epoch" of a file that did
    not exist, or that an earlier run left."""
    ck = tmp_path / "ck.pt"
    if existing:
        ck.write_bytes(b"an earlier run's")
    port = ["--master-port", free_port()] if extra else []
    proc = launch(script, "--data-dir", data_dir, "--batch-size", 32, "--epochs", 5, "--log-interval", 1,
                  "--checkpoint", ck, *extra, *port)  # fmt: skip
    wait_for_line(proc, "epoch: 0 [3/")
    os.killpg(proc.pid, signal.SIGTERM)
    started = time.monotonic()
    result = finish(proc, 60)
    assert result.returncode == 143 and time.monotonic() - started < 30, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert result.stderr.strip().endswith(words.format(ck=ck) + (" it was before" if existing else "")), (
        result.stderr
    )
    assert ck.exists() == existing and (not existing or ck.read_bytes() == b"an earlier run's")


def test_the_interrupt_line_after_an_epoch_says_the_checkpoint_holds_it(tmp_path):
    """stop_line against the file's version at launch: replaced, it holds the last complete epoch."""
    ck, stop = tmp_path / "ck.pt", SystemExit(130)
    ck.write_bytes(b"old")
    before = convnet_undistributed.file_version(ck)
    assert convnet_undistributed.write_atomically(ck, lambda f: f.write(b"new")) is None
    assert (
        convnet_undistributed.stop_line(stop, str(ck), before)
        == f"Interrupted; {ck} holds the last complete epoch"
    )
    assert convnet_undistributed.stop_line(stop, None, before) == "Interrupted"


C_PRINTF_THEN_EXIT = """
import ctypes, sys
sys.path.insert(0, {repo!r})
import {module} as script
ctypes.CDLL(None).printf(b"written by C's printf\\n")  # stdout is a file: C holds the line in its buffer
script.exit_at_once(0)
"""


@pytest.mark.skipif(
    os.name != "posix", reason="C's stdio is reached through CDLL(None) on POSIX systems only"
)
@pytest.mark.parametrize(
    "module", ["convnet_undistributed", "convnet_distributed", "convnet_distributed_cuda"]
)
def test_leaving_at_once_keeps_what_c_code_buffered_in_stdio(tmp_path, module):
    """exit_at_once leaves by os._exit, which dropped C's stdio buffers: NCCL_DEBUG=INFO's log, sent to a
    file, lost its last block."""
    out = tmp_path / "out.txt"
    env = {
        k: v for k, v in script_env().items() if k != "PYTHONUNBUFFERED"
    }  # -u makes C's stdout unbuffered too
    with open(out, "w") as f:
        result = subprocess.run(
            [sys.executable, "-c", C_PRINTF_THEN_EXIT.format(repo=REPO, module=module)],
            stdout=f, stderr=subprocess.PIPE, text=True, env=env, timeout=60,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert out.read_text() == "written by C's printf\n"


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_stop_while_unpacking_leaves_no_half_unpacked_file(tmp_path, monkeypatch, stop):
    """Ctrl-C or SIGTERM midway through unpacking MNIST's images left their temporary file (47 MB) in the data
    folder: only an Exception removed it."""
    from conftest import FILES, write_dataset

    raw = os.path.join(write_dataset(str(tmp_path), gz=True), "MNIST", "raw")

    def stopped(src, dst):
        dst.write(src.read(1000))  # midway
        raise stop

    monkeypatch.setattr(convnet_distributed.shutil, "copyfileobj", stopped)
    with pytest.raises(stop):
        convnet_distributed.prepare_data(types.SimpleNamespace(data_dir=str(tmp_path), dataset="mnist"))
    assert sorted(os.listdir(raw)) == sorted(name + ".gz" for name in FILES)  # the .gz files alone


@needs_mount
def test_a_checkpoint_machine_0_cannot_write_is_one_line_on_every_machine(data_dir, tmp_path):
    """Rank 0 could not write --checkpoint (here a disk too small for it): machine 0 said why, and the other
    machines exited 1 with no line. Now every machine says it, once: two machines of 2 processes each."""
    port, ck = free_port(), tmp_path / "disk" / "ck.pt"
    machine1 = job(data_dir, processes=2, machines=2, machine=1, port=port, timeout=60)
    command = [sys.executable, os.path.join(REPO, "convnet_distributed.py"), "--data-dir", data_dir,
               "--num-processes", 2, "--batch-size", 32, "--num-machines", 2, "--machine-id", 0,
               "--master-port", port, "--timeout", 60, "--log-interval", 1, "--checkpoint", ck]  # fmt: skip
    result, names, _, pgid = on_a_small_disk(tmp_path, command, "1m", "ck.pt")
    other = finish(machine1, 60)
    for machine in result, other:
        assert_one_line(machine, ck)
        assert "Test set, epoch 0" in machine.stdout or machine is other
    assert names == []  # no temporary file left
    assert left_running(pgid) == [] and left_running(machine1.pid) == []
