#!/usr/bin/env python3
"""This project's 2-process run against the baseline and what users would pick instead, launch to exit.

Runs, one subprocess each, every one on the same data and the same ConvNet recipe (global batch 128):
  distributed          convnet_distributed.py --num-processes 2 --batch-size 64
  baseline             convnet_undistributed.py --batch-size 128
  tutorial-ddp         bench/peers/tutorial_ddp.py under torchrun --standalone --nproc-per-node 2
  lightning-ddp        bench/peers/lightning_ddp.py --strategy ddp (needs lightning)
  lightning-ddp-spawn  bench/peers/lightning_ddp.py --strategy ddp_spawn (needs lightning)

Every line a run prints is timestamped on arrival, and each run gets four timings:
  wall        launch to the exit of the launched process (what a user waits for)
  first step  launch to the first progress line (`epoch: `), printed once the first training step is done
  loop        the training loop alone: train_seconds from the run's own metrics JSON
  exit        the last line the run prints (stdout or stderr) to its exit

and writes to --out: compare.md (the table and the checks of issue 15's targets) and runs.json (every run).

    mkdir -p data/FashionMNIST/raw && cp /usr/share/datasets/fashion-mnist/*.gz data/FashionMNIST/raw/
    python bench/compare.py --dataset fashion-mnist --data-dir data --repeats 5

The runs are interleaved: every run once, then every run again in reverse order, and so on, so that a
slow spell of the machine spreads over all of them. Each check is taken within each repeat, between
runs minutes apart at most, and the median over the repeats is judged, with bench/scaling.py's
order-statistics interval (5 repeats or more) and its verdicts. Before the first run the data's .gz
files are unpacked and torch, torchvision (and lightning) are imported once, so that no run pays for
unpacking or for a cold page cache on behalf of the others.
"""

import argparse
import gzip
import importlib.util
import json
import os
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

from common import free_port, machine_facts, package_version, positive_int, script_env, write_json
from runner import busy_cpu_seconds, own_cpu_seconds
from scaling import (
    CONFIDENCE,
    Target,
    median_interval,
    quietness,
)

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
PEERS = ("tutorial-ddp", "lightning-ddp", "lightning-ddp-spawn")
NEEDS_LIGHTNING = ("lightning-ddp", "lightning-ddp-spawn")
# The data set's folder in torchvision's layout, and its four files.
FOLDERS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}
FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
FIRST_STEP = "epoch: "  # the first progress line, printed once the first training step is done
MIB = 2**20
# How long the processes of a launch may outlive the launcher before they count as left behind and are killed.
GRACE_SECONDS = 2.0

DESCRIPTIONS = {
    "distributed": "this project, 2 processes",
    "baseline": "this project's baseline, 1 process",
    "tutorial-ddp": "the PyTorch tutorials' torchrun + DDP script",
    "lightning-ddp": 'Lightning `Trainer(accelerator="cpu", devices=2, strategy="ddp")`',
    "lightning-ddp-spawn": 'Lightning, `strategy="ddp_spawn"`',
}


# --- the runs -----------------------------------------------------------------------------------


def run_names(args):
    """The runs of one repeat, in run order: the judged pair next to each other, then the peers."""
    return ["distributed", "baseline", *args.peers]


def command(name, args, metrics_path):
    python = sys.executable
    common = ["--epochs", str(args.epochs), "--dataset", args.dataset, "--data-dir", args.data_dir]
    common += ["--metrics-json", metrics_path]
    if name == "distributed":
        flags = ["--num-processes", "2", "--batch-size", "64", "--master-port", str(free_port())]
        return [python, os.path.join(REPO, "convnet_distributed.py"), *flags, *common]
    if name == "baseline":
        return [python, os.path.join(REPO, "convnet_undistributed.py"), "--batch-size", "128", *common]
    if name == "tutorial-ddp":
        # `python -m torch.distributed.run` is the torchrun command itself, run by this Python for sure.
        launcher = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        return [*launcher, os.path.join(BENCH, "peers", "tutorial_ddp.py"), "--batch-size", "64", *common]
    strategy = {"lightning-ddp": "ddp", "lightning-ddp-spawn": "ddp_spawn"}[name]
    script = os.path.join(BENCH, "peers", "lightning_ddp.py")
    return [python, script, "--strategy", strategy, "--devices", "2", "--batch-size", "64", *common]


class TimedRun:
    """One launch, run to its end: its output lines, each with the seconds since launch at which it
    arrived, its exit status and the seconds to its exit, and the peak RSS of its processes."""

    def __init__(self, argv, timeout):
        self.argv, self.lines, self.lock = argv, [], threading.Lock()
        self.returncode, self.exit_at, self.peak_rss, self.timed_out = None, None, None, False
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env=script_env(),
            start_new_session=True,
        )
        streams = ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr"))
        readers = [threading.Thread(target=self.read, args=stream) for stream in streams]
        for reader in readers:
            reader.start()
        waiter = threading.Thread(target=self.wait)
        waiter.start()
        try:
            waiter.join(timeout)
        finally:
            if waiter.is_alive():  # overran, or interrupted: leave no process behind
                self.timed_out = True
                self.kill()
                waiter.join()
        # A process of the launch that outlives the launcher (multiprocessing's resource tracker ends on its
        # own just after it) would hold the pipes open: give it a moment, then end it; the run is over.
        deadline = time.monotonic() + GRACE_SECONDS
        while live_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.left_behind = self.kill()
        for reader in readers:
            reader.join()
        self.proc.stdout.close()
        self.proc.stderr.close()

    def read(self, stream, name):
        for raw in iter(stream.readline, b""):
            arrived = time.monotonic() - self.start
            with self.lock:
                self.lines.append((arrived, name, raw.decode(errors="replace").rstrip("\n")))

    def wait(self):
        # wait4 returns the moment the launcher exits, with the peak RSS of it and the children it waited for.
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.exit_at = time.monotonic() - self.start
        self.returncode = self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.peak_rss = usage.ru_maxrss * 1024  # Linux counts KiB

    def kill(self):
        """Kill what is left alive of the launch's process group; whether anything was. A process that
        has exited but not been reaped (a zombie, which holds nothing) does not count."""
        alive = live_members(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return bool(alive)

    def first(self, prefix, stream="stdout"):
        """When the first line of stream starting with prefix arrived; None if none did."""
        return next((t for t, s, line in self.lines if s == stream and line.startswith(prefix)), None)

    def tail(self, stream, n=25):
        return [line for _, s, line in self.lines if s == stream][-n:]


def live_members(group):
    """The processes of a process group that are still running (Linux's /proc), zombies left out."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
        state, pgrp = fields[0], int(fields[2])
        if pgrp == group and state not in ("Z", "X"):
            members.append(int(entry))
    return members


def run_once(name, args, repeat, tmp):
    """Run name once; its record, or exit non-zero showing why it failed."""
    metrics_path = os.path.join(tmp, f"{name}.json")
    if os.path.exists(metrics_path):
        os.unlink(metrics_path)  # a stale file must not pass for this run's figures
    busy_before, own_before = busy_cpu_seconds(), own_cpu_seconds()
    run = TimedRun(command(name, args, metrics_path), args.timeout)
    if run.returncode and any("address already in use" in line.lower() for _, _, line in run.lines):
        # Another program took the free port between the check and the bind: once more, on another port.
        run = TimedRun(command(name, args, metrics_path), args.timeout)
    other = (busy_cpu_seconds() - busy_before) - (own_cpu_seconds() - own_before)
    metrics = None
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            metrics = json.load(f)
    first_step = run.first(FIRST_STEP)
    if run.returncode != 0 or metrics is None or first_step is None:
        fail(name, repeat, run, args.timeout, metrics is None)
    last_line = max(t for t, _, _ in run.lines)
    return {
        "config": name,  # the key bench/scaling.py's helpers read
        "repeat": repeat,
        "argv": run.argv,
        "wall_seconds": run.exit_at,
        "first_step_seconds": first_step,
        "train_seconds": metrics["train_seconds"],
        "exit_seconds": run.exit_at - last_line,
        "last_line_seconds": last_line,
        "last_stdout_line_seconds": max((t for t, s, _ in run.lines if s == "stdout"), default=None),
        "first_line_seconds": min(t for t, _, _ in run.lines),
        "test_line_seconds": run.first("Test set"),
        "test_accuracy": metrics["test_accuracy"],
        "world_size": metrics["world_size"],
        "threads": metrics.get("threads"),
        "peak_rss_run_mib": run.peak_rss / MIB,
        "left_processes_behind": run.left_behind,
        "other_cpu_cores": max(0.0, other / run.exit_at),
        "metrics": metrics,
    }


def fail(name, repeat, run, timeout, no_metrics):
    if run.timed_out:
        why = f"ran past the {timeout:g} s timeout and was killed"
    elif run.returncode:
        why = f"exited with status {run.returncode}"
    elif no_metrics:
        why = "wrote no metrics file"
    else:
        why = f"printed no progress line ({FIRST_STEP!r})"
    message = [
        f"error: {name} (repeat {repeat + 1}) {why} after {run.exit_at:.1f} s",
        f"command: {' '.join(run.argv)}",
    ]
    for stream in ("stderr", "stdout"):
        lines = run.tail(stream)
        if lines:
            message += [f"--- {stream}, last lines ---", *lines]
    sys.exit("\n".join(message))


def shown(argv):
    """argv as a user types it: paths from the repository root, `python`, no per-run port or metrics file."""
    words, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in ("--master-port", "--metrics-json"):
            skip = True
        else:
            words.append(
                "python"
                if word == sys.executable
                else os.path.relpath(word, REPO)
                if word.startswith(REPO)
                else word
            )
    return " ".join(words)


def measure(args, facts):
    """Every run, args.repeats times, interleaved; runs.json is rewritten after each run, so that an
    interrupted comparison keeps what it measured."""
    records = []
    with tempfile.TemporaryDirectory(prefix="compare-") as tmp:
        for repeat in range(args.repeats):
            # Every other repeat backwards: a drift of the host's speed favours neither side of a pair.
            names = run_names(args)[:: 1 if repeat % 2 == 0 else -1]
            for i, name in enumerate(names):
                record = run_once(name, args, repeat, tmp)
                records.append(record)
                write_json(
                    os.path.join(args.out, "runs.json"),
                    {"machine": facts, "options": vars(args), "runs": records},
                )
                print(
                    f"[repeat {repeat + 1}/{args.repeats}, run {i + 1}/{len(names)}] {name}: "
                    f"wall {record['wall_seconds']:.2f} s, first step {record['first_step_seconds']:.2f} s, "
                    f"loop {record['train_seconds']:.2f} s, exit {record['exit_seconds']:.2f} s, "
                    f"accuracy {100 * record['test_accuracy']:.2f}%, "
                    f"other programs {record['other_cpu_cores']:.2f} cores",
                    flush=True,
                )
    return records


# --- the data -----------------------------------------------------------------------------------


def raw_folder(args):
    return os.path.join(args.data_dir, FOLDERS[args.dataset], "raw")


def prepare(args):
    """Unpack the data's .gz files once, and import the libraries once (downloading the data where it is
    missing), before any run is timed."""
    folder = raw_folder(args)
    for name in FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path) and os.path.isfile(path + ".gz"):
            part = f"{path}.part{os.getpid()}"
            with gzip.open(path + ".gz", "rb") as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(part, path)
    code = (
        "import sys, torch, torchvision\n"
        "from torchvision import datasets\n"
        "cls, root = getattr(datasets, sys.argv[1]), sys.argv[2]\n"
        "cls(root, train=True, download=True)\n"
        "cls(root, train=False, download=True)\n"
    )
    if any(peer in NEEDS_LIGHTNING for peer in args.peers):
        code += "import lightning\n"
    done = subprocess.run(
        [sys.executable, "-c", code, FOLDERS[args.dataset], args.data_dir],
        capture_output=True,
        text=True,
        env=script_env(),
    )
    if done.returncode != 0:
        sys.exit(f"error: cannot prepare {args.dataset} in {folder}/:\n{done.stderr[-2000:]}")


def train_size(args):
    """Images in the training set, from the labels file's header (magic number, then the count)."""
    with open(os.path.join(raw_folder(args), "train-labels-idx1-ubyte"), "rb") as f:
        return struct.unpack(">II", f.read(8))[1]


# --- the checks ---------------------------------------------------------------------------------


def paired(records, x, y, get, combine):
    """combine(get(x's run), get(y's run)) within each repeat that has both runs."""
    by_repeat = {}
    for record in records:
        by_repeat.setdefault(record["repeat"], {})[record["config"]] = record
    return [combine(get(r[x]), get(r[y])) for _, r in sorted(by_repeat.items()) if x in r and y in r]


def checks(records, peers):
    """(check, values per repeat, their median, the median's interval, target text, verdict) for each row;
    target and verdict are None for a measurement."""

    def ratio(x, y, key):
        return paired(records, x, y, lambda r: r[key], lambda u, v: u / v)

    def difference(x, y, key):
        return paired(records, x, y, lambda r: r[key], lambda u, v: u - v)

    rows = [
        (
            "distributed wall ÷ baseline wall",
            ratio("distributed", "baseline", "wall_seconds"),
            Target("≤ 0.90", high=0.90),
        ),
        (
            "distributed first step − baseline first step (s)",
            difference("distributed", "baseline", "first_step_seconds"),
            Target("≤ 1.0 s", high=1.0),
        ),
        (
            "distributed exit − baseline exit (s)",
            difference("distributed", "baseline", "exit_seconds"),
            Target("≤ 0.3 s", high=0.3),
        ),
        ("baseline loop ÷ distributed loop", ratio("baseline", "distributed", "train_seconds"), None),
    ]
    for peer in peers:
        rows.append(
            (
                f"{peer} wall ÷ distributed wall",
                ratio(peer, "distributed", "wall_seconds"),
                Target("≥ 1.8", low=1.8),
            )
        )
        rows.append((f"{peer} loop ÷ distributed loop", ratio(peer, "distributed", "train_seconds"), None))
    judged = []
    for check, values, target in rows:
        if not values:
            continue
        median, interval = statistics.median(values), median_interval(values)
        judged.append(
            (
                check,
                values,
                median,
                interval,
                target and target.text,
                target and target.verdict(median, interval),
            )
        )
    return judged


# --- the report ---------------------------------------------------------------------------------


def cell(values, spec=".2f"):
    """The median, and its interval where there are enough repeats for one."""
    median, interval = statistics.median(values), median_interval(values)
    text = format(median, spec)
    return text if interval is None else f"{text} ({format(interval[0], spec)}–{format(interval[1], spec)})"


def write_markdown(path, args, facts, records):
    names = [n for n in run_names(args) if any(r["config"] == n for r in records)]
    runs = {n: [r for r in records if r["config"] == n] for n in names}
    base_wall = statistics.median(r["wall_seconds"] for r in runs["distributed"])
    lines = [
        "# Launch to exit: this project against the baseline and the peers",
        "",
        f"Machine: {facts['cpu']}, {facts['usable_cores']} usable cores "
        f"({facts['logical_cpus']} logical CPUs); "
        f"Python {facts['python']}, torch {facts['torch']}, torchvision {facts['torchvision']}, "
        f"lightning {facts['lightning']}; commit {facts['commit']}; {facts['date']}.",
        "",
        f"Data: {args.dataset}, {facts['train_size']:,} training images, {args.epochs} epoch(s), "
        f"global batch 128; median of {args.repeats} run(s) per row, the runs interleaved.",
        "",
        quietness(records, facts["usable_cores"]),
        "",
        "| run | wall (s) | first step (s) | loop (s) | exit (s) | test accuracy | wall ÷ distributed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        rs = runs[name]
        accuracy = statistics.median(100 * r["test_accuracy"] for r in rs)
        wall = statistics.median(r["wall_seconds"] for r in rs)
        lines.append(
            f"| {name}: {DESCRIPTIONS[name]} | {cell([r['wall_seconds'] for r in rs], '.1f')} "
            f"| {cell([r['first_step_seconds'] for r in rs])} "
            f"| {cell([r['train_seconds'] for r in rs], '.1f')} "
            f"| {cell([r['exit_seconds'] for r in rs])} | {accuracy:.2f}% | {wall / base_wall:.2f} |"
        )
    lines += [
        "",
        "Wall: launch to exit. First step: launch to the first progress line, printed after the first "
        "training step. Loop: the training loop alone, as the run measures it. Exit: from the last line the "
        "run prints to its exit. In brackets, where there are 5 repeats or more: the interval that holds the "
        f"median with at least {CONFIDENCE:.0%} probability (order statistics).",
        "",
        "Commands:",
        "",
    ]
    lines += [f"- {name}: `{shown(runs[name][0]['argv'])}`" for name in names]
    lines += [
        "",
        "## Checks, side by side",
        "",
        "Each check is taken within each repeat and the median over the repeats is judged; where its "
        "interval reaches across the target, the result is marked inside the noise.",
        "",
        f"| check | per repeat | median (judged) | {CONFIDENCE:.0%} interval | target | result |",
        "|---|---|---:|---:|---|---|",
    ]
    for check, values, median, interval, target, verdict in checks(
        records, [p for p in args.peers if p in runs]
    ):
        span = "–" if interval is None else f"{interval[0]:.2f} to {interval[1]:.2f}"
        lines.append(
            f"| {check} | {', '.join(f'{v:.2f}' for v in values)} | {median:.3f} | {span} "
            f"| {target or '–'} | {verdict or '–'} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# --- command line -------------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dataset", choices=sorted(FOLDERS), default="mnist", help="data set of every run (default: mnist)"
    )
    p.add_argument(
        "--data-dir",
        default="./data",
        metavar="DIR",
        help="data folder in torchvision's layout (DIR/MNIST/raw, DIR/FashionMNIST/raw) (default: ./data)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        metavar="N",
        help="rounds of every run; 5 or more give each median an interval (default: 5)",
    )
    p.add_argument(
        "--epochs", type=positive_int, default=1, metavar="N", help="epochs of every run (default: 1)"
    )
    p.add_argument(
        "--peers",
        nargs="*",
        choices=PEERS,
        default=list(PEERS),
        metavar="PEER",
        help=f"peers to run, any of {', '.join(PEERS)}; none at all: the 2-process run and the "
        "baseline only (default: all)",
    )
    p.add_argument(
        "--out",
        default=os.path.join(BENCH, "results", "compare"),
        metavar="DIR",
        help="where compare.md and runs.json go (default: bench/results/compare)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800,
        metavar="SECONDS",
        help="longest a single run may take before it is killed and the comparison fails (default: 1800)",
    )
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    args.peers = list(dict.fromkeys(args.peers))
    if any(p in NEEDS_LIGHTNING for p in args.peers) and importlib.util.find_spec("lightning") is None:
        parser.error(
            "the Lightning peers need lightning (pip install -r requirements-dev.txt); "
            f"or leave them out: --peers {' '.join(p for p in args.peers if p not in NEEDS_LIGHTNING)}"
        )
    if os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):
        parser.error(f"--data-dir: {args.data_dir} is not a folder")
    args.data_dir = os.path.abspath(args.data_dir)  # the runs start in the repository root
    args.out = os.path.abspath(args.out)
    return args


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    prepare(args)
    facts = machine_facts(args.dataset, lightning=package_version("lightning"), train_size=train_size(args))
    records = measure(args, facts)
    path = os.path.join(args.out, "compare.md")
    write_markdown(path, args, facts, records)
    with open(path) as f:
        print("\n" + f.read())
    print(f"Written: {path}, {os.path.join(args.out, 'runs.json')}")


if __name__ == "__main__":
    main()
