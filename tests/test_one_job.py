"""One job, whatever runs beside it: a sweep of jobs on one host, a launch on a port another job holds,
machines whose data or script differ, and a stranger who writes into the rendezvous store. Each job that can
train trains; each launch that cannot stops within seconds with one line, and nothing is left running."""

import ast
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch.distributed as dist

import convnet_distributed
from conftest import N_TEST, REPO, finish, free_port, launch, read_json, script_env, write_dataset
from test_cuda_script import FAKE_GPUS
from test_faults import job, left_running
from test_launchers import TIMEOUT, WITHIN, one_line_each, run_together

pytestmark = pytest.mark.timeout(4 * WITHIN + 120)


def sweep_job(data_dir, *args):
    """A launch as a parameter sweep writes it: no --master-port, no MASTER_PORT."""
    return launch("convnet_distributed.py", "--data-dir", data_dir, "--num-processes", 2, "--batch-size", 64,
                  "--log-interval", 1000, "--threads", 1, "--timeout", TIMEOUT, *args)  # fmt: skip


def store_of(port, key, proc, within=WITHIN):
    """A client of the store a launch serves on port, once its rank 0 has written key there."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and proc.poll() is None:
        try:  # refused until the store listens: TCPStore's client would back off for seconds
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            store = dist.TCPStore(
                "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=within)
            )
            store.wait([key], datetime.timedelta(seconds=max(1, deadline - time.monotonic())))
            return store
        except (OSError, RuntimeError):
            time.sleep(0.2)
    pytest.fail(f"no {key!r} in the store of the launch on port {port}")


def single_lines(results):
    """Each launch's one line (and exit status 1, nothing trained)."""
    lines = []
    for r in results:
        err = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(err) == 1 and err[0].startswith("error: "), r.stderr
        assert "epoch: " not in r.stdout and "Traceback" not in r.stderr
        lines.append(err[0])
    return lines


def test_three_jobs_started_at_once_with_no_port_all_train(data_dir, tmp_path):
    """for lr in ...; do python convnet_distributed.py --lr $lr & done: every job took port 8892 and two of
    three stopped ('rank 0 joined twice', 'cannot serve the rendezvous'). Now each takes its own free port."""
    rates = ("0.5", "0.6", "0.7")
    procs = [sweep_job(data_dir, "--lr", lr, "--metrics-json", tmp_path / f"{lr}.json") for lr in rates]
    results = [finish(p, timeout=3 * WITHIN + 60) for p in procs]
    assert [r.returncode for r in results] == [0, 0, 0], [r.stderr for r in results]
    assert all(r.stderr == "" for r in results), [r.stderr for r in results]
    metrics = [read_json(tmp_path / f"{lr}.json") for lr in rates]
    assert all(m["world_size"] == 2 and m["test_samples"] == N_TEST for m in metrics)
    assert len({m["final_train_loss"] for m in metrics}) == 3  # three learning rates: three jobs, not one
    assert all(left_running(p.pid) == [] for p in procs)


def test_a_launch_on_a_port_another_job_holds_stops_alone_naming_it(data_dir, tmp_path):
    """A second launch on the port of a job that was training stopped that job ('rank 0 joined twice'). Now
    the job trains on, untouched, and the second launch stops within seconds, saying the port is held."""
    port = free_port()
    first = job(
        data_dir, "--epochs", 12, "--metrics-json", tmp_path / "first.json", port=port, timeout=TIMEOUT
    )
    store_of(port, "ready", first)
    start = time.monotonic()
    second = job(
        data_dir, "--lr", "0.4", "--metrics-json", tmp_path / "second.json", port=port, timeout=TIMEOUT
    )
    (line,) = single_lines([finish(second, timeout=WITHIN + 30)])
    assert time.monotonic() - start < WITHIN and first.poll() is None  # the first job still trains
    assert f"cannot serve the rendezvous on 127.0.0.1:{port}" in line, line
    assert "another program holds the port: choose a free --master-port" in line, line
    result = finish(first, timeout=3 * WITHIN + 60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    m = read_json(tmp_path / "first.json")
    assert m["epochs_trained"] == 12 and m["test_accuracy"] > 0.8
    assert not (tmp_path / "second.json").exists()
    assert left_running(first.pid) == [] and left_running(second.pid) == []


@pytest.mark.parametrize("flags, phrase", [(["--lr", "0.4"], "the machines disagree on --lr"),
                                          ([], "rank 1 joined twice")])  # fmt: skip
def test_a_late_launch_stops_alone_once_the_job_is_ready(data_dir, tmp_path, flags, phrase):
    """A launch as machine 1 of a job that had formed (a command run twice, or with another flag) stopped
    every process of that job. Now, once every process has checked in, it stops alone; the job trains on."""
    port = free_port()
    machines = [
        job(data_dir, "--epochs", 12, "--metrics-json", tmp_path / "m.json", processes=1, machines=2,
            machine=m, port=port, timeout=TIMEOUT)
        for m in (0, 1)
    ]  # fmt: skip
    store_of(port, "ready", machines[0])
    late = job(
        data_dir, "--epochs", 12, *flags, processes=1, machines=2, machine=1, port=port, timeout=TIMEOUT
    )
    (line,) = single_lines([finish(late, timeout=WITHIN + 30)])
    assert phrase in line and machines[0].poll() is None, line
    results = [finish(m, timeout=3 * WITHIN + 60) for m in machines]
    assert [r.returncode for r in results] == [0, 0] and [r.stderr for r in results] == ["", ""]
    assert read_json(tmp_path / "m.json")["epochs_trained"] == 12
    assert all(left_running(p.pid) == [] for p in (*machines, late))


def test_machines_whose_data_differ_stop_before_training(data_dir, tmp_path):
    """Machine 1's copy of the training labels shifted by one class, every file still parsing: the job trained
    on two data sets, silently. Now both machines stop before the first step, naming the files that differ."""
    other = write_dataset(str(tmp_path / "other"))
    labels = os.path.join(other, "MNIST", "raw", "train-labels-idx1-ubyte")
    raw = np.fromfile(labels, dtype=np.uint8)
    raw[8:] = (raw[8:] + 1) % 10  # after the idx header: every label one class on
    raw.tofile(labels)
    port = free_port()
    machines = [
        job(data, "--epochs", 2, processes=2, machines=2, machine=m, port=port, timeout=TIMEOUT)
        for m, data in ((0, data_dir), (1, other))
    ]
    results, seconds = run_together(machines)
    one_line_each(results, "error: machine 1's mnist training labels differ from machine 0's", "copy")
    assert "images" not in results[0].stderr and "test labels" not in results[0].stderr
    assert results[0].stderr == results[1].stderr
    assert seconds < WITHIN, seconds


@pytest.mark.timeout(2 * WITHIN + 60)
def test_the_cpu_script_and_the_gpu_script_in_one_job_stop_naming_the_backend(data_dir, tmp_path):
    """Machine 0 ran the CPU script, machine 1 the GPU script: the roll call passed ('flags, model and torch
    agree'), then the GPU side waited for keys the CPU side never writes, and ended in a traceback after
    --timeout. The GPU script runs here on CPUs, as in tests/test_cuda_script.py."""
    port, harness = free_port(), tmp_path / "fake_gpus.py"
    harness.write_text(FAKE_GPUS)
    common = ["--data-dir", data_dir, "--num-machines", 2, "--batch-size", 64, "--master-port", port]
    common += ["--timeout", TIMEOUT, "--check"]
    cpu = launch("convnet_distributed.py", *common, "--machine-id", 0, "--num-processes", 1)
    gpu = subprocess.Popen(
        [sys.executable, harness, REPO, "GPU-a", *map(str, common), "--machine-id", "1",
         "--num-gpu-processes", "1"],
        env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    results, seconds = run_together([cpu, gpu])
    one_line_each(
        results, "error: the machines disagree on backend: ", "backend Gloo (convnet_distributed.py)"
    )
    assert "backend NCCL (convnet_distributed_cuda.py)" in results[0].stderr, results[0].stderr
    assert "use the same script and torch version on every machine" in results[0].stderr
    assert seconds < WITHIN, seconds


def an_older_script(tmp_path):
    """A copy of the script as an older version wrote its roll-call record: without 'launcher'."""
    folder = tmp_path / "old"
    folder.mkdir()
    text = open(os.path.join(REPO, "convnet_distributed.py")).read()
    record = "launch=args.launch_id, launcher=args.launcher,"
    assert record in text
    text = text.replace(record, "launch=args.launch_id,")
    (folder / "convnet_distributed.py").write_text(text)
    return folder / "convnet_distributed.py"


def test_a_machine_running_an_older_script_is_one_line_on_both(data_dir, tmp_path):
    """A record without the keys this version reads raised KeyError with a traceback: the mixed-version case
    the script's digest is compared for. Now both machines name it."""
    old, port = an_older_script(tmp_path), free_port()
    machines = [
        job(data_dir, "--check", processes=1, machines=2, machine=0, port=port, timeout=TIMEOUT),
        subprocess.Popen(
            [sys.executable, old, "--data-dir", data_dir, "--num-machines", "2", "--machine-id", "1",
             "--master-port", str(port), "--timeout", str(TIMEOUT), "--check", "--batch-size", "64"],
            env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        ),
    ]  # fmt: skip
    results, seconds = run_together(machines)
    one_line_each(
        results, "runs another version of convnet_distributed.py", "copy one script to every machine"
    )
    assert seconds < WITHIN, seconds


# A stranger's client writes into the store while machine 0 waits for machine 1: (key, value, what happens).
BAD_VALUES = {
    "job": (
        '{"rank": 0, "job": "junk"}',
        'another program wrote a record = b\'{"rank": 0, "job": "junk"}\'',
    ),
    "ready, too large": ("[0, 1000000000]", "another program wrote ready = b'[0, 1000000000]'"),
    "ready, null": ("null", "another program wrote ready = b'null'"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_a_bad_value_in_the_store_is_one_line_on_every_machine(data_dir, tmp_path, case):
    """The store is unauthenticated and reachable from the network: ready as [0, 1000000000] allocated
    gigabytes on every rank, null was a traceback. Now every value read is checked first. Machines 0 and 1 of
    3 wait for machine 2, which never comes: the stranger writes meanwhile (job before machine 1 reads it)."""
    value, phrase = BAD_VALUES[case]
    port, key = free_port(), case.split(",")[0]
    machines = [job(data_dir, "--check", processes=1, machines=3, machine=0, port=port, timeout=TIMEOUT)]
    store = store_of(port, "job", machines[0])
    if key == "job":
        store.set(key, value)
    machines.append(job(data_dir, "--check", processes=1, machines=3, machine=1, port=port, timeout=TIMEOUT))
    if key == "ready":
        store.wait(["rank/1"], datetime.timedelta(seconds=WITHIN))
        store.set(key, value)
    results, seconds = run_together(machines)
    one_line_each(results, phrase, "use another --master-port")
    assert seconds < WITHIN, seconds


def test_file_flags_written_into_the_store_steer_no_file(data_dir, tmp_path):
    """Non-zero ranks took --checkpoint and --metrics-json from rank 0's record in the store, and rank 0 read
    its own back: a client that rewrote it chose where the job wrote. Now rank 0 writes where its own command
    says, and the others learn only that it writes."""
    port, mine, theirs = free_port(), tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir()
    theirs.mkdir()
    files = ["--checkpoint", mine / "ck.pt", "--metrics-json", mine / "m.json"]
    machine0 = job(data_dir, *files, processes=1, machines=2, machine=0, port=port, timeout=TIMEOUT)
    store = store_of(port, "job", machine0)
    forged = json.loads(store.get("job"))
    forged["files"] = {
        "checkpoint": str(theirs / "ck.pt"),
        "resume": True,
        "metrics_json": str(theirs / "m.json"),
    }
    store.set("job", json.dumps(forged))
    machine1 = job(data_dir, processes=1, machines=2, machine=1, port=port, timeout=TIMEOUT)
    results, _ = run_together([machine0, machine1])
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    assert sorted(os.listdir(mine)) == ["ck.pt", "m.json"] and os.listdir(theirs) == []
    assert read_json(mine / "m.json")["world_size"] == 2
    assert "Resuming" not in results[0].stdout  # machine 1 did not take the forged --resume


def test_the_port_is_held_from_the_claim_but_refuses_connections_till_the_store_serves(clean_env):
    """The launcher checked the port, then let it go until rank 0's store bound it: a program taking it then
    cost a 10 s wait, or exit 1 with no line. Then it listened from the claim on, and machine 1, connected
    long before the store served, waited in C++, deaf to signals. Now the claimed socket is bound, not
    listening: no other program binds it, a connection is refused (machine 1 waits in Python), and TCPStore
    serves on it."""
    args = convnet_distributed.parse_args(["--master-port", str(free_port())])
    listener, port = convnet_distributed.claim_port(args)
    assert port == args.master_port
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", args.master_port))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", args.master_port), timeout=5).close()
        with convnet_distributed.rendezvous(0, True, args, listener) as options:
            store = dist.TCPStore("127.0.0.1", args.master_port, 1, True, **options)
            store.set("served", "yes")
            assert store.get("served") == b"yes"
    finally:
        listener.close()
    free = convnet_distributed.parse_args([])  # no port given: a free one, held the same way
    assert free.master_port == 0
    listener, port = convnet_distributed.claim_port(free)
    assert port == listener.getsockname()[1] > 0
    assert free.master_port == 0  # the port taken goes into the job's record: args stays what was typed
    listener.close()


def test_a_master_addr_that_does_not_resolve_on_one_machine_says_so(data_dir):
    """A one-machine job with an unknown --master-addr said 'another program may hold the port' after 5 s."""
    proc = launch("convnet_distributed.py", "--data-dir", data_dir, "--num-processes", 2, "--master-addr",
                  "no-such-host.invalid", "--timeout", 3)  # fmt: skip
    (line,) = single_lines([finish(proc, timeout=60)])
    assert "--master-addr no-such-host.invalid does not resolve" in line, line
    assert left_running(proc.pid) == []


SIGTERM_IN_EXIT = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import convnet_distributed as script
script.raise_on_signals(ctrl_c=True)
flush = sys.stdout.flush
def flush_and_be_stopped():
    os.kill(os.getpid(), signal.SIGTERM)  # docker stop, just as the process leaves
    flush()
sys.stdout.flush = flush_and_be_stopped
script.exit_at_once(0)
"""


def test_a_sigterm_as_a_process_exits_changes_nothing(tmp_path):
    """A SIGTERM arriving inside exit_at_once raised Terminated there, with a traceback, and exit status 1."""
    (tmp_path / "exit.py").write_text(SIGTERM_IN_EXIT)
    result = subprocess.run(
        [sys.executable, tmp_path / "exit.py", REPO], capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stderr) == (0, ""), result.stderr


WATCHED = """
import datetime, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
import convnet_distributed as script
args = script.parse_args(["--master-port", sys.argv[2], "--num-processes", "2", "--timeout", "60"])
server = dist.TCPStore("127.0.0.1", args.master_port, 2, True, wait_for_workers=False)
store = dist.TCPStore("127.0.0.1", args.master_port, 2, False)
threading.Timer(2, lambda: server.set("abort", "error: rank 0: the line of the process that failed")).start()
with script.rendezvous(0, False, args, None):  # a process that is not the master: its own client watches
    store.get("never")  # as Gloo's set-up waits for a peer's address, holding this client
"""


def test_the_abort_watcher_sees_an_abort_while_the_set_up_waits_in_the_store(tmp_path):
    """The watcher shared the store client with Gloo's set-up, and a client's calls wait for each other: a
    blocking get held it, so the watcher saw the abort only when the get timed out. Now it has its own."""
    (tmp_path / "watched.py").write_text(WATCHED)
    start = time.monotonic()
    result = subprocess.run([sys.executable, tmp_path / "watched.py", REPO, str(free_port())],
                            capture_output=True, text=True, timeout=90, env=script_env())  # fmt: skip
    assert result.returncode == 1 and result.stderr == "error: rank 0: the line of the process that failed\n"
    assert time.monotonic() - start < 20  # the get would wait --timeout, 60 s


def test_the_ready_list_of_a_job_of_16384_ranks_is_accepted(clean_env):
    """2,048 nodes x 8 GPUs: "ready", 98 KB, was over from_json's cap of 64 KiB, taken for a stranger's
    value, and every rank stopped."""
    args = convnet_distributed.parse_args(["--num-machines", "2048", "--num-processes", "8", "--master-port",
                                           str(free_port()), "--timeout", "10"])  # fmt: skip
    store = dist.TCPStore("127.0.0.1", args.master_port, 1, True, wait_for_workers=False)
    record = convnet_distributed.roll_call_record(0, 16384, args)
    store.set("job", json.dumps(dict(record, address="127.0.0.1")))
    addresses = [f"10.0.{m // 256}.{m % 256}" for m in range(2048)]
    store.set("ready", json.dumps([[r // 8 for r in range(16384)], addresses]))
    assert len(store.get("ready")) > 1 << 16
    me = dict(convnet_distributed.roll_call_record(5, 16384, args), address="127.0.0.1")
    found = convnet_distributed.wait_for_ready(store, 5, 16384, args, me, "127.0.0.1")  # machine 0's sixth
    assert found == dict(machine_id=0, num_machines=2048, machine_sizes=[8] * 2048, addresses=addresses)


@pytest.mark.timeout(WITHIN + 120)
def test_a_machine_that_stops_after_the_roll_call_is_one_line_on_machine_0(data_dir):
    """Machine 1 killed once the roll call said "ready": machine 0 waited in the store for its address and
    ended in a DistStoreError traceback after --timeout. Now it names the machine it waited for."""
    port, timeout = free_port(), 10
    machines = [job(data_dir, "--check", processes=1, machines=2, machine=m, port=port, timeout=timeout)
                for m in (0, 1)]  # fmt: skip
    store = store_of(port, "rank/1", machines[0])
    os.killpg(machines[1].pid, signal.SIGSTOP)  # before it reads "ready": it never says where it is
    store.wait(["ready"], datetime.timedelta(seconds=WITHIN))
    os.killpg(machines[1].pid, signal.SIGKILL)
    start = time.monotonic()
    (line,) = single_lines([finish(machines[0], timeout=WITHIN + timeout)])
    assert line == (
        f"error: rank 0: machine 1 sent nothing within --timeout {timeout} s: it stopped after joining "
        "(see its output)"
    )
    assert time.monotonic() - start < timeout + 10
    assert left_running(machines[0].pid) == []


CHANGED = """
import sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
import convnet_distributed as script
{change}
try:
    script.main(sys.argv[2:])
except BaseException as e:
    script.exit_at_once(e)
script.exit_at_once()
"""


def changed_job(tmp_path, change, *args):
    """A launch of the script as the change (Python, run after the script is imported) makes it."""
    program = tmp_path / "changed.py"
    program.write_text(CHANGED.format(change=change))
    return launch(program, REPO, *args)


STRANGER = """
class Payload:  # unpickled, it writes a file
    def __reduce__(self):
        return open, ({marker!r}, "w")

def check_same_data(*args):  # machine 1's data digests, offered as a pickle
    dist.all_gather_object([None] * dist.get_world_size(), Payload())

script.check_same_data = check_same_data
"""


def test_a_stranger_in_machine_1s_place_runs_no_code_on_machine_0(data_dir, tmp_path):
    """A program that takes machine 1's rank in the store (its record as rank 0's: the script's own code) and
    offers a pickle as machine 1's data digests: rank 0 unpickled it (all_gather_object), running the
    stranger's code. Now no machine unpickles what another sends: no file is written, and machine 0 stops
    with one line."""
    port, marker, timeout = free_port(), tmp_path / "written", 20
    machine0 = job(data_dir, processes=1, machines=2, machine=0, port=port, timeout=timeout)
    stranger = changed_job(tmp_path, STRANGER.format(marker=str(marker)), "--data-dir", data_dir,
                           "--batch-size", 64, "--num-machines", 2, "--machine-id", 1, "--master-port", port,
                           "--timeout", timeout)  # fmt: skip
    result = finish(machine0, timeout=timeout + WITHIN + 30)
    finish(stranger, timeout=30)
    assert not marker.exists()
    single_lines([result])  # the stranger's rank took no part: rank 0 waited --timeout for it
    assert left_running(machine0.pid) == []


def test_no_object_collective_takes_what_another_rank_sends():
    """An object collective unpickles what its senders sent: only rank 0 may send one, which every rank
    trusts already (it serves the store). Tensors carry anything another rank sends."""
    for script in ("convnet_distributed.py", "convnet_distributed_cuda.py", "convnet_undistributed.py"):
        with open(os.path.join(REPO, script)) as f:
            tree = ast.parse(f.read())
        for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
            name = getattr(call.func, "attr", getattr(call.func, "id", ""))
            if name.endswith(("_object", "_object_list")):
                src = {k.arg: k.value for k in call.keywords}.get("src")
                where = f"{script}:{call.lineno}: {name}"
                assert name == "broadcast_object_list", where
                assert isinstance(src, ast.Constant) and src.value == 0, f"{where}: not src=0"


LATE = """
import time
reach = script.reach_every_machine
def late(*args):  # as a slow resolver made it: resolve() ran again just before the check
    time.sleep(20)
    reach(*args)
script.reach_every_machine = late
"""


@pytest.mark.timeout(3 * WITHIN + 120)
def test_machines_that_come_to_the_reachability_check_20_s_apart_train(data_dir, tmp_path):
    """Machine 0 waited 10 s for the others at the reachability check, then closed its listener: machine 1,
    20 s late, stopped the job with "cannot reach machine 0 ... open all TCP ports". Now each waits as long
    as the roll call does (--timeout), and the job trains."""
    port, metrics = free_port(), tmp_path / "m.json"
    machine0 = job(data_dir, "--metrics-json", metrics, machines=2, port=port, timeout=TIMEOUT)
    machine1 = changed_job(tmp_path, LATE, "--data-dir", data_dir, "--num-processes", 2, "--batch-size", 32,
                           "--num-machines", 2, "--machine-id", 1, "--master-port", port,
                           "--timeout", TIMEOUT, "--log-interval", 1)  # fmt: skip
    results, _ = run_together([machine0, machine1])
    assert [r.returncode for r in results] == [0, 0] and [r.stderr for r in results] == ["", ""], results
    assert read_json(metrics)["world_size"] == 4
