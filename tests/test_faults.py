"""Faults a distributed job meets and a single process never does: each ends the whole job, within a bound,
with a message naming the cause, and loses no finished work."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

import convnet_distributed
from conftest import REPO, finish, free_port, kill_group, launch, read_json, script_env, wait_for_line

pytestmark = pytest.mark.timeout(300)


def job(data_dir, *args, processes=2, machines=1, machine=0, port=None, timeout=20, env=None):
    """A launch of the CPU script, 20 batches an epoch per rank, as one machine of a job."""
    return launch(
        "convnet_distributed.py",
        "--data-dir",
        data_dir,
        "--num-processes",
        processes,
        "--batch-size",
        128 // (processes * machines),
        "--num-machines",
        machines,
        "--machine-id",
        machine,
        "--master-port",
        port or free_port(),
        "--timeout",
        timeout,
        "--log-interval",
        1,
        *args,
        env=env,
    )


def workers(proc):
    """The rank processes a launch started (forked or spawned; not multiprocessing's resource tracker)."""
    deadline = time.monotonic() + 60
    while True:
        found = [
            p for p in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(p.cmdline())
        ]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def left_running(pgid, grace=15):
    """Processes of a launch's process group still running after a grace period (zombies do not count)."""
    deadline = time.monotonic() + grace
    while True:
        alive = []
        for p in psutil.process_iter(["pid", "status"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def ended(proc, within):
    """Wait for the launch, at most `within` seconds; returns (result, seconds it took)."""
    start = time.monotonic()
    result = finish(proc, timeout=within)
    return result, time.monotonic() - start


def assert_clean_failure(result, *phrases):
    assert result.returncode not in (0, None), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


# Bad input: one line, the flag named, exit status 2, nothing started.


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--num-processes", "0"], "--num-processes"),
        (["--num-machines", "0"], "--num-machines"),
        (["--epochs", "0"], "--epochs"),
        (["--batch-size", "-3"], "--batch-size"),
        (["--threads", "0"], "--threads"),
        (["--log-interval", "0"], "--log-interval"),
        (["--lr", "0"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--master-port", "0"], "--master-port"),
        (["--master-port", "65536"], "--master-port"),
        (["--machine-id", "-1"], "--machine-id"),
        (["--num-machines", "2", "--machine-id", "2"], "--machine-id"),
        (["--timeout", "0"], "--timeout"),
        (["--epochs", "two"], "--epochs"),
    ],
)
def test_out_of_range_numbers_are_one_line_naming_the_flag(argv, flag, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(SystemExit) as exit:
        convnet_distributed.parse_args(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert len(err.strip().splitlines()) == 1 and flag in err and "error:" in err, err


def test_master_port_in_the_environment_that_is_not_a_number(tmp_path):
    result = finish(
        launch("convnet_distributed.py", "--data-dir", tmp_path, env=script_env(MASTER_PORT="http")),
        timeout=60,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "MASTER_PORT='http'" in result.stderr
    assert not os.listdir(tmp_path)  # nothing started: no download


@pytest.mark.parametrize("script", ["convnet_undistributed.py", "convnet_distributed.py"])
def test_a_command_line_mistake_is_one_line_and_starts_nothing(script, tmp_path):
    (tmp_path / "not-a-folder").write_text("")
    result = finish(
        launch(
            script, "--data-dir", tmp_path / "not-a-folder", "--metrics-json", tmp_path / "missing" / "m.json"
        ),
        timeout=60,
    )
    assert result.returncode == 2 and result.stdout == ""
    # Two mistakes: the first found is named, in one line.
    missing = tmp_path / "missing"
    assert (
        result.stderr == f"{script}: error: --metrics-json: cannot write to folder {missing} (see --help)\n"
    )
    assert os.listdir(tmp_path) == ["not-a-folder"]  # nothing started: no download


# Faults: the whole job ends, within a bound, saying why.


def test_master_port_held_by_another_program(data_dir):
    """A program that takes connections and never answers holds the port. The launcher finds it before any
    worker starts: a worker connected to it waited in C++, deaf to SIGTERM, until killed 10 s later."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        proc = job(data_dir, port=port, timeout=60)
        result, seconds = ended(proc, within=90)
    assert_clean_failure(result, f"127.0.0.1:{port}", "--master-port")
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert seconds < 30, (
        seconds
    )  # not --timeout, nor a stuck worker's kill: about 12 s on 2 cores, 40 s before
    assert left_running(proc.pid) == []


def test_machine_that_never_starts_is_reported_after_the_timeout(data_dir):
    port = free_port()
    machine0 = job(data_dir, machines=2, machine=0, port=port, timeout=5)
    result, seconds = ended(machine0, within=90)
    assert_clean_failure(result, "only 2 of 4 processes joined within --timeout 5 s", "--num-machines 2")
    assert 5 <= seconds < 60  # it waited --timeout for the missing machine, and not much longer
    assert result.stdout == ""
    assert left_running(machine0.pid) == []

    machine1 = job(data_dir, machines=2, machine=1, port=port, timeout=5)  # and machine 0 never starts
    result, seconds = ended(machine1, within=90)
    assert_clean_failure(result, f"no answer from machine 0 at 127.0.0.1:{port} within --timeout 5 s")
    assert 5 <= seconds < 60
    assert left_running(machine1.pid) == []


@pytest.mark.timeout(180)
def test_a_waiting_machine_says_what_it_waits_for_every_30_s(data_dir):
    """Machine 1 started before machine 0, or machine 0 whose peers had not come, printed nothing until
    --timeout's line. Now each says, 5 s into the wait and every 30 s after, what it waits for."""
    timeout, port = 40, free_port()
    procs = [  # machine 0 of 3, alone; machine 1 of another job, alone
        job(data_dir, "--check", processes=1, machines=3, machine=0, timeout=timeout),
        job(data_dir, "--check", processes=1, machines=2, machine=1, port=port, timeout=timeout),
    ]
    start, said = time.monotonic(), [[], []]
    readers = [
        threading.Thread(target=lambda p=p, s=s: s.extend((time.monotonic() - start, x) for x in p.stdout))
        for p, s in zip(procs, said)
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout + 60)  # till the launch ends its output
    results = [finish(p, timeout=30) for p in procs]
    assert_clean_failure(results[0], "only 1 of 3 processes joined within --timeout 40 s")
    assert_clean_failure(results[1], f"no answer from machine 0 at 127.0.0.1:{port} within --timeout 40 s")
    waits = (
        r"1 of 3 processes have joined; waiting for machines 1, 2 \((\d+) s left of --timeout 40 s\)\n",
        rf"Waiting for machine 0 at 127\.0\.0\.1:{port} \((\d+) s left of --timeout 40 s\)\n",
    )
    for lines, wait in zip(said, waits):
        assert len(lines) == 2 and all(re.fullmatch(wait, x) for _, x in lines), lines  # at 5 s and 35 s
        # Said 5 s into the wait (after importing torch: 3 s on a quiet host, 10 s on a loaded one), then
        # 30 s on.
        left, gap = int(re.fullmatch(wait, lines[0][1])[1]), lines[1][0] - lines[0][0]
        assert left >= timeout - 6 and gap > 20, lines


@pytest.mark.timeout(180)
def test_a_machine_0_stopped_during_the_roll_call_leaves_machine_1_stoppable(data_dir):
    """Machine 1 waiting for the others polls the store; machine 0 stopped (SIGSTOP) after it answered held
    that call in C++, where SIGTERM went unheard: machine 1 ran on till killed. Now it exits 143 at once."""
    port = free_port()
    machines = [
        job(data_dir, "--check", processes=1, machines=3, machine=m, port=port, timeout=120) for m in (0, 1)
    ]
    try:
        wait_for_line(machines[1], "Waiting for all 3 processes to join", 90)
        os.killpg(machines[0].pid, signal.SIGSTOP)
        time.sleep(2)  # machine 1 polls the stopped store
        os.killpg(machines[1].pid, signal.SIGTERM)
        result = finish(machines[1], timeout=20)
    finally:
        os.killpg(machines[0].pid, signal.SIGKILL)
        os.killpg(machines[0].pid, signal.SIGCONT)
    assert result.returncode == 143, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.alone  # under load, machine 1 named its other rank's "lost contact" before the killed worker
@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_rank_stops_the_whole_job(data_dir, victim):
    port = free_port()
    machines = [job(data_dir, "--epochs", 50, machines=2, machine=m, port=port, timeout=20) for m in (0, 1)]
    wait_for_line(machines[0], "epoch: 0 [5/")
    killed = workers(machines[victim])[-1]
    killed.kill()  # SIGKILL, mid-epoch: no chance to say goodbye
    start = time.monotonic()
    results = [finish(m, timeout=120) for m in machines]
    assert time.monotonic() - start < 60  # well inside --timeout (20 s) plus shutdown
    assert_clean_failure(results[victim], "was killed by SIGKILL")
    assert_clean_failure(results[1 - victim], "lost contact with the job")
    assert [left_running(m.pid) for m in machines] == [[], []]


def test_a_rank_that_hangs_alive_is_ended_by_the_timeout_on_every_machine(data_dir):
    """A rank stopped, not dead (SIGSTOP: a debugger, a paused VM, a node swapping), mid-epoch: its sockets
    stay open, so no peer hears a reset, and the others wait in the Gloo exchange. --timeout ends it on every
    machine, each with one line, and the stopped rank is not left behind."""
    timeout, port = 10, free_port()
    machines = [
        job(data_dir, "--epochs", 50, machines=2, machine=m, port=port, timeout=timeout) for m in (0, 1)
    ]
    wait_for_line(machines[0], "epoch: 0 [5/")
    workers(machines[1])[-1].suspend()  # SIGSTOP
    stopped = time.monotonic()
    results, seconds = [], []
    for m in machines:  # each one's end, as the test sees it
        results.append(finish(m, timeout=120))
        seconds.append(time.monotonic() - stopped)
    for r in results:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, [x.stderr for x in results]
        line = lines[0]
        assert (
            r.returncode == 1 and line.startswith("error: rank ") and "lost contact with the job" in line
        ), r.stderr
        assert line.endswith(f"another process stopped, or did not answer within --timeout {timeout} s"), line
    # Machine 0 waited --timeout, not much longer; machine 1 gives its stopped rank torch's 30 s to end on
    # SIGTERM (which a stopped process does not act on) before it kills it.
    assert timeout - 2 < seconds[0] < timeout + 20 and seconds[1] < timeout + 50, seconds
    assert [left_running(m.pid) for m in machines] == [[], []]


@pytest.mark.parametrize(
    "script,processes,target",
    [
        ("convnet_undistributed.py", 1, "group"),
        ("convnet_distributed.py", 2, "group"),
        ("convnet_distributed.py", 2, "launcher"),
    ],
)
def test_ctrl_c_stops_every_process_with_status_130_and_the_checkpoint_loads(
    data_dir, tmp_path, script, processes, target
):
    ck = tmp_path / "ck.pt"
    extra = [] if processes == 1 else ["--num-processes", processes, "--master-port", free_port()]
    proc = launch(
        script,
        "--data-dir",
        data_dir,
        "--batch-size",
        128 // processes,
        "--epochs",
        50,
        "--log-interval",
        1,
        "--checkpoint",
        ck,
        *extra,
    )
    lines = wait_for_line(proc, "epoch: 1 [3/")  # epoch 0's checkpoint is written before epoch 1 starts
    # A terminal's Ctrl-C reaches the whole foreground process group; `kill -INT` reaches the launcher alone.
    if target == "group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    result, seconds = ended(proc, within=60)
    assert result.returncode == 130, result.stderr
    assert "Interrupted" in result.stderr and str(ck) in result.stderr and "Traceback" not in result.stderr
    assert seconds < 30
    assert left_running(proc.pid) == []
    assert torch.load(ck, weights_only=True)["epoch"] == last_complete_epoch(lines, result)


def last_complete_epoch(lines, result):
    """The last epoch whose test line the run printed, before (lines) or after the stop: what its checkpoint
    holds. The stop came in epoch 1 or later: at least epoch 0."""
    output = [*lines, *result.stdout.splitlines()]
    return max(int(line.split()[3].rstrip(":")) for line in output if line.startswith("Test set, epoch "))


def assert_terminated(result, ck, seconds, pgid, lines):
    """SIGTERM's end: status 143, one line saying so, within seconds, nothing left, the checkpoint whole."""
    assert result.returncode == 143, result.stderr
    assert result.stderr.startswith("Terminated (SIGTERM)") and str(ck) in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert seconds < 30
    assert left_running(pgid) == []
    assert torch.load(ck, weights_only=True)["epoch"] == last_complete_epoch(lines, result)
    assert [p.name for p in ck.parent.iterdir() if p.name.startswith(".tmp-")] == []


@pytest.mark.parametrize(
    "script,processes,target",
    [
        ("convnet_undistributed.py", 1, "group"),
        ("convnet_distributed.py", 2, "group"),
    ],
)
def test_sigterm_stops_every_process_with_status_143_and_one_line(
    data_dir, tmp_path, script, processes, target
):
    """`kill -TERM -PGID` and SLURM's scancel signal every process. (`kill PID`, `timeout`, docker stop and
    Kubernetes signal the launcher alone: test_a_run_stopped_by_sigterm_resumes_to_the_same_result.)"""
    ck = tmp_path / "ck.pt"
    extra = [] if processes == 1 else ["--num-processes", processes, "--master-port", free_port()]
    proc = launch(script, "--data-dir", data_dir, "--batch-size", 128 // processes, "--epochs", 50,
                  "--log-interval", 1, "--checkpoint", ck, *extra)  # fmt: skip
    lines = wait_for_line(proc, "epoch: 1 [3/")  # epoch 0's checkpoint is written before epoch 1 starts
    if target == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    result, seconds = ended(proc, within=60)
    assert_terminated(result, ck, seconds, proc.pid, lines)


SIGNAL_AT_FORK = """
import os, signal
os.register_at_fork(after_in_{side}=lambda: os.kill(os.getpid(), signal.{name}))
"""


@pytest.mark.parametrize("side", ["child", "parent"])
@pytest.mark.parametrize(
    "name,status,line", [("SIGTERM", 143, "Terminated (SIGTERM)"), ("SIGINT", 130, "Interrupted")]
)
def test_a_signal_as_the_workers_start_still_stops_the_run_cleanly(
    data_dir, tmp_path, side, name, status, line
):
    """A stop that comes as the workers are forked (scancel, or a job stopped as it starts) once went astray:
    raised inside fork's own bookkeeping, it printed a traceback and the run trained on. A sitecustomize
    module sends it to each forked worker once it exists ("child"), or to the launcher after each fork."""
    (tmp_path / "sitecustomize.py").write_text(SIGNAL_AT_FORK.format(side=side, name=name))
    proc = job(data_dir, "--epochs", 50, env=script_env(PYTHONPATH=str(tmp_path)))
    result, seconds = ended(proc, within=60)
    assert result.returncode == status, result.stderr
    assert result.stderr.startswith(line) and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert seconds < 30 and left_running(proc.pid) == []


SPAWNED = """
import os, signal, sys
import torch.multiprocessing  # imported under Linux's sys.platform, as it is there
sys.platform = "darwin"  # where the scripts spawn their workers, as the GPU script does everywhere
if "spawn_main" in " ".join(sys.orig_argv):  # a spawned worker, as its interpreter starts
    os.kill(os.getpid(), signal.{name})
"""


@pytest.mark.parametrize(
    "name,status,line", [("SIGTERM", 143, "Terminated (SIGTERM)"), ("SIGINT", 130, "Interrupted")]
)
@pytest.mark.alone  # its 30 s include two spawned workers' imports, which another test's load can double
def test_a_signal_as_spawned_workers_start_stops_the_run_cleanly(data_dir, tmp_path, name, status, line):
    """macOS, Windows and the GPU script spawn their workers, which take a second or more to start their
    interpreter and import torch before their handlers are set: a Ctrl-C then once ended each in a "Fatal
    Python error" and its traceback. Here a sitecustomize module spawns them, as on macOS, and each signals
    itself as its interpreter starts."""
    (tmp_path / "sitecustomize.py").write_text(SPAWNED.format(name=name))
    proc = job(data_dir, "--epochs", 50, env=script_env(PYTHONPATH=str(tmp_path)))
    result, seconds = ended(proc, within=60)
    assert result.returncode == status, result.stderr
    assert result.stderr.startswith(line) and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert seconds < 30 and left_running(proc.pid) == []


TEARDOWN_WATCH = """
import atexit, os, sys
if {spawn}:
    import torch.multiprocessing  # imported under Linux's sys.platform, as it is there
    sys.platform = "darwin"  # where the scripts spawn their workers, as the GPU script does everywhere
if "-c" not in sys.orig_argv or "spawn_main" in " ".join(sys.orig_argv):  # the script, or a worker it spawned
    atexit.register(lambda: open(os.environ["TORN_DOWN"], "a").write(f"{{os.getpid()}}\\n"))
"""


@pytest.mark.parametrize(
    "processes,spawn,outcome",
    [(1, False, "failed"), (2, False, "failed"), (2, True, "failed"), (2, True, "trained")],
)
def test_no_process_of_a_run_tears_its_interpreter_down(data_dir, tmp_path, processes, spawn, outcome):
    """A process that keeps its Gloo group to the exit (worker) and then tears its interpreter down frees
    the group's threads on the way: about 1 run in 20 then ended in "terminate called without an active
    exception" (SIGABRT) instead of its own status. That was the launcher's sys.exit where it is the only
    worker (a failure of a 1-process run), and every spawned worker. An atexit hook, which runs only in a
    teardown, names the processes that went that way."""
    (tmp_path / "sitecustomize.py").write_text(TEARDOWN_WATCH.format(spawn=spawn))
    torn_down = tmp_path / "torn_down"
    ck = tmp_path / "ck.pt"
    if outcome == "failed":
        ck.write_bytes(b"")  # --resume stops every rank with one line
    env = script_env(PYTHONPATH=str(tmp_path), TORN_DOWN=str(torn_down))
    result = finish(job(data_dir, "--checkpoint", ck, "--resume", processes=processes, env=env), 120)
    if outcome == "failed":
        assert result.returncode == 1, result.stderr
        assert (
            result.stderr == f"error: --resume: cannot read {ck} (EOFError): truncated or not a checkpoint\n"
        )
    else:
        assert result.returncode == 0 and ck.exists(), result.stderr
    assert not torn_down.exists(), f"processes torn down: {torn_down.read_text().split()}"


@pytest.mark.parametrize(
    "script", ["convnet_undistributed", "convnet_distributed", "convnet_distributed_cuda"]
)
def test_a_ctrl_c_before_the_signal_handlers_is_a_stop_not_a_bug(script):
    """A Ctrl-C before raise_on_signals (during imports or parse_args) reached exit_at_once as a
    KeyboardInterrupt, taken for a bug: a traceback and status 1. A stop is status 130, with no trace."""
    code = f"import {script} as s\ns.exit_at_once(KeyboardInterrupt())"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stderr) == (130, ""), result.stderr


def test_sigterm_to_torchrun_stops_its_workers_with_one_line(data_dir, tmp_path):
    ck = tmp_path / "ck.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()),
           os.path.join(REPO, "convnet_distributed.py"), "--data-dir", str(data_dir), "--batch-size", "64",
           "--epochs", "50", "--log-interval", "1", "--checkpoint", str(ck)]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=script_env(),
        start_new_session=True,
    )
    read = wait_for_line(proc, "epoch: 1 [3/")
    proc.send_signal(signal.SIGTERM)  # torchrun sends SIGTERM to each worker
    result, seconds = ended(proc, within=60)
    lines = [line for line in result.stderr.splitlines() if "Terminated (SIGTERM)" in line]
    assert lines == [
        f"Terminated (SIGTERM): every process of this launch stopped; {ck} holds the last complete epoch"
    ]
    assert seconds < 30 and left_running(proc.pid) == []
    assert torch.load(ck, weights_only=True)["epoch"] == last_complete_epoch(read, result)


def test_workers_stop_when_their_launcher_is_killed(data_dir):
    """SIGKILL (or the out-of-memory killer) gives the launcher no chance to stop its workers: they notice.
    Started as a script's background job (SIGINT ignored), where torch's parent-death SIGINT goes unheard."""
    assert_workers_stop_when_their_launcher_is_killed(data_dir, script_env())


def assert_workers_stop_when_their_launcher_is_killed(data_dir, env):
    """A 2-process run, started as a background job (SIGINT ignored, and with it torch's parent-death signal):
    SIGKILL its launcher mid-epoch, and every worker must stop within 20 s."""
    cmd = [sys.executable, os.path.join(REPO, "convnet_distributed.py"), "--data-dir", str(data_dir),
           "--num-processes", "2", "--batch-size", "64", "--master-port", str(free_port()), "--epochs", "50",
           "--log-interval", "1"]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    wait_for_line(proc, "epoch: 0 [3/")
    ranks = workers(proc)
    assert len(ranks) == 2
    proc.kill()
    proc.wait(timeout=30)  # not its output: the workers hold the pipes open while they run
    gone, alive = psutil.wait_procs(ranks, timeout=20)
    kill_group(proc)
    proc.communicate()
    assert alive == [], f"still training after their launcher died: {alive}"


@pytest.fixture(scope="module")
def unbroken_run(data_dir, tmp_path_factory):
    """The metrics of an unbroken 3-epoch run, which each run stopped below must end as once resumed: one run
    for the module, whose tests that use it stay on one pytest-xdist worker (group "unbroken")."""
    path = tmp_path_factory.mktemp("unbroken") / "whole.json"
    whole = finish(job(data_dir, "--epochs", 3, "--metrics-json", path))
    assert whole.returncode == 0, whole.stderr
    return read_json(path)


@pytest.mark.xdist_group("unbroken")
def test_a_run_stopped_by_sigterm_resumes_to_the_same_result(data_dir, tmp_path, unbroken_run):
    """SIGTERM to the launcher alone (`kill PID`, `timeout`, Kubernetes): it died at once, and its workers
    trained on as orphans. Now every process stops, and a rerun with --resume ends as an unbroken run."""
    ck = tmp_path / "ck.pt"

    def run(*args, name):
        return job(
            data_dir, "--epochs", 3, "--checkpoint", ck, "--resume", "--metrics-json", tmp_path / name, *args
        )

    stopped = run(name="stopped.json")
    lines = wait_for_line(stopped, "epoch: 1 [2/")
    stopped.send_signal(signal.SIGTERM)
    result, seconds = ended(stopped, within=60)
    assert_terminated(result, ck, seconds, stopped.pid, lines)
    assert torch.load(ck, weights_only=True)["epoch"] == 0
    resumed = finish(run(name="resumed.json"))
    assert resumed.returncode == 0, resumed.stderr
    assert "starting epoch 1" in resumed.stdout
    a, b = read_json(tmp_path / "resumed.json"), unbroken_run
    assert a["epochs_trained"] == 2 and b["epochs_trained"] == 3
    assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-4)
    assert [h["train_loss"] for h in a["history"]] == pytest.approx(
        [h["train_loss"] for h in b["history"][1:]], rel=1e-4
    )


def test_killed_while_writing_a_checkpoint_the_previous_one_still_loads(tmp_path):
    ck = tmp_path / "ck.pt"
    assert convnet_distributed.write_atomically(ck, lambda f: torch.save({"epoch": 3}, f)) is None
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import os, sys, time
sys.path.insert(0, {REPO!r})
import convnet_distributed
def stalled_flush(fd):  # the new file's bytes are in the folder, not yet renamed over the old one
    print("writing", flush=True)
    time.sleep(120)
os.fsync = stalled_flush
convnet_distributed.write_atomically({str(ck)!r}, lambda f: f.write(b"x" * 100000))
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline() == "writing\n"
    writer.kill()
    writer.wait(timeout=30)
    assert torch.load(ck, weights_only=True) == {"epoch": 3}
    assert [p.stat().st_size for p in tmp_path.glob("ck.pt.*.tmp")] == [
        100000
    ]  # it was killed mid-write, not before


@pytest.mark.xdist_group("unbroken")
def test_a_run_killed_mid_epoch_resumes_to_the_same_result(data_dir, tmp_path, unbroken_run):
    ck = tmp_path / "ck.pt"

    def run(*args, name):
        return job(
            data_dir, "--epochs", 3, "--checkpoint", ck, "--resume", "--metrics-json", tmp_path / name, *args
        )

    crashed = run(name="crashed.json")
    wait_for_line(crashed, "epoch: 1 [2/")
    os.killpg(crashed.pid, signal.SIGKILL)  # the machine goes down: nobody cleans up
    finish(crashed)
    assert torch.load(ck, weights_only=True)["epoch"] == 0
    resumed = finish(run(name="resumed.json"))
    assert resumed.returncode == 0, resumed.stderr
    assert "starting epoch 1" in resumed.stdout
    a, b = read_json(tmp_path / "resumed.json"), unbroken_run
    assert a["epochs_trained"] == 2 and b["epochs_trained"] == 3
    assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-4)
    assert [h["train_loss"] for h in a["history"]] == pytest.approx(
        [h["train_loss"] for h in b["history"][1:]], rel=1e-4
    )


def test_the_sampler_order_of_an_epoch_does_not_depend_on_the_epochs_before_it():
    """A resumed run starts with a fresh sampler at epoch k: it must draw what an unbroken run draws there."""
    labels = torch.zeros(1000)

    def sampler():
        return torch.utils.data.distributed.DistributedSampler(labels, num_replicas=2, rank=1, seed=7)

    unbroken = sampler()
    orders = [torch.cat(convnet_distributed.epoch_batches(unbroken, epoch, 64)) for epoch in range(3)]
    fresh = torch.cat(convnet_distributed.epoch_batches(sampler(), 2, 64))
    assert torch.equal(fresh, orders[2])
    assert not torch.equal(orders[1], orders[2])  # set_epoch reshuffles


def test_two_jobs_side_by_side_on_one_host_do_not_interfere(data_dir, tmp_path):
    jobs = [job(data_dir, "--metrics-json", tmp_path / f"{i}.json") for i in (0, 1)]
    results = [finish(j, timeout=180) for j in jobs]
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    a, b = read_json(tmp_path / "0.json"), read_json(tmp_path / "1.json")
    assert a["world_size"] == b["world_size"] == 2
    assert a["test_loss"] == b["test_loss"] and a["final_train_loss"] == b["final_train_loss"]


BROKEN_OPTIMIZER = """
import torch.optim

def broken(*args, **kwargs):
    raise ValueError("a bug in the training code")

torch.optim.Adadelta = broken  # every rank meets it after joining its process group
"""


@pytest.mark.parametrize(
    "script,processes,spawn",
    [("convnet_undistributed.py", 1, False), ("convnet_distributed.py", 1, False),
     ("convnet_distributed.py", 2, False), ("convnet_distributed.py", 2, True)],
)  # fmt: skip
def test_a_bug_in_a_rank_prints_its_traceback_and_leaves_at_once(
    data_dir, tmp_path, script, processes, spawn
):
    """An exception other than a stop or sys.exit skipped exit_at_once: the process tore its interpreter down
    with its Gloo group kept (worker), which can abort it; in a worker, spawn's handler caught it and the
    launcher printed its own traceback on top. Now each rank prints its traceback and leaves with status 1."""
    (tmp_path / "sitecustomize.py").write_text(BROKEN_OPTIMIZER + TEARDOWN_WATCH.format(spawn=spawn))
    torn_down = tmp_path / "torn_down"
    env = script_env(PYTHONPATH=str(tmp_path), TORN_DOWN=str(torn_down))
    if script == "convnet_undistributed.py":
        proc = launch(script, "--data-dir", data_dir, env=env)
    else:
        proc = job(data_dir, processes=processes, env=env)
    result = finish(proc, 120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("Traceback (most recent call last)") == processes, result.stderr
    assert result.stderr.count("ValueError: a bug in the training code") == processes, result.stderr
    assert "ProcessRaisedException" not in result.stderr, result.stderr
    assert not torn_down.exists(), f"processes torn down: {torn_down.read_text().split()}"
