#!/usr/bin/env python3
"""What a network between machines costs convnet_distributed.py, and what --compress auto buys back.

Two hosts made of network namespaces joined by a veth pair, the link shaped in both directions by tc's token
bucket filter (tbf) to each speed of --links, as a real link of that speed: a bucket of 1 ms of the rate, and
no segment larger (veth's 64 KiB segments need a bucket that passes a compressed step at once). One process on
each host. The reference is the same 2 processes on one host, averaging over Gloo (--allreduce gloo). Every
process gets the same threads (the cores shared out between the 2), the same batch (--batch-size per process)
and the same data.

Each configuration (a link, a --compress: by default none, and auto, the README's advice) runs --repeats
times, interleaved (every configuration once, then every one again), in reverse order every other repeat, with
a reference run before and after each: a throughput ratio is a run's training loop against the mean of the two
references beside it (a vCPU's speed drifts by 10-20% over minutes, more than the targets' margins), and the
median of the ratios is judged. Beside it stands the range over the repeats: for the median, an interval of
1 - 2 / 2**repeats coverage (75% for 3 repeats, 94% for 5). Then, apart, one run of --accuracy-epochs epochs
per --compress taken (auto takes one per link) on one host over Gloo (the same arithmetic as across two
hosts), for the accuracy after several epochs.

Writes to --out-dir: network.md (the tables, each target marked), network.png (throughput against link speed,
one line per --compress, the accuracy in the legend; needs matplotlib) and runs.json (every run).

Needs root (ip netns, tc). Run from the repository root, on a quiet machine (about 55 minutes on 2 cores, most
of it the plain runs at 10 Mbit/s):
    mkdir -p data/FashionMNIST/raw && cp /usr/share/datasets/fashion-mnist/*.gz data/FashionMNIST/raw/
    python bench/network.py --dataset fashion-mnist --data-dir data
"""

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from common import REPO, free_port, machine_facts, positive_int, script_env, write_json
from runner import busy_cpu_seconds, own_cpu_seconds

SCRIPT = os.path.join(REPO, "convnet_distributed.py")
CHOICES = ("none", "local-sgd", "auto")


# --- the two hosts --------------------------------------------------------------------------------


def ip(*args, check=True):
    return subprocess.run(["ip", *map(str, args)], capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """Network namespaces a and b, joined by a veth pair: machine 0 at addr[0] in a, machine 1 at addr[1]."""

    def __init__(self):
        base = f"nb{os.getpid()}{secrets.token_hex(3)}"[
            :12
        ]  # unique per run; + a/b stays within 15 characters
        self.ns = (f"{base}a", f"{base}b")
        prefix = f"198.{18 + secrets.randbelow(2)}.{secrets.randbelow(256)}."  # the benchmarking range
        self.addr = (f"{prefix}1", f"{prefix}2")
        self.made = []
        for ns in self.ns:
            ip("netns", "add", ns)
            self.made.append(ns)
        ip(
            "link",
            "add",
            self.ns[0],
            "netns",
            self.ns[0],
            "type",
            "veth",
            "peer",
            "name",
            self.ns[1],
            "netns",
            self.ns[1],
        )
        for ns, addr in zip(self.ns, self.addr):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", ns, "up")

    def shape(self, mbit):
        """Both directions at mbit Mbit/s, as a real link: its bucket holds 1 ms of the rate (two packets at
        least), and veth sends no segment larger (its default, 64 KiB, would need a bucket that passes a
        compressed step's 80 KB at 10 Mbit/s in 11 ms, not 64); packets wait up to 100 ms in the queue."""
        burst = max(3000, int(mbit * 1e6 / 8 / 1000))
        for ns in self.ns:
            ip("-n", ns, "link", "set", ns, "gso_max_size", min(burst, 65536))
            tc = ["tc", "-n", ns, "qdisc", "replace", "dev", ns, "root", "tbf"]
            subprocess.run(
                [*tc, "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms"], check=True, timeout=30
            )

    def remove(self):
        for ns in self.made:
            for _ in range(20):
                pids = ip("netns", "pids", ns, check=False).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            ip("netns", "del", ns, check=False)


# --- the runs -------------------------------------------------------------------------------------


def common_flags(args, threads, compress, epochs):
    return [
        *["--dataset", args.dataset, "--data-dir", os.path.abspath(args.data_dir), "--epochs", epochs],
        *["--batch-size", args.batch_size, "--threads", threads, "--log-interval", 100_000],
        *["--compress", compress, "--timeout", args.timeout],
    ]


def launch(ns, argv, folder, label):
    with (
        open(os.path.join(folder, f"{label}.out"), "w") as out,
        open(os.path.join(folder, f"{label}.err"), "w") as err,
    ):
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, SCRIPT, *map(str, argv)],
            stdout=out,
            stderr=err,
            env=script_env(),
            start_new_session=True,
        )


def run(hosts, config, args, threads, repeat, folder):
    """One run of (link Mbit/s or None for one host, --compress, epochs): its record; a failure stops all."""
    link, compress, epochs = config
    metrics = os.path.join(folder, "metrics.json")
    flags = [*common_flags(args, threads, compress, epochs), "--metrics-json", metrics]
    if link is None:  # the reference: both processes on host a, over Gloo through its loopback
        procs = [launch(hosts.ns[0], [*flags, "--num-processes", 2, "--allreduce", "gloo"], folder, "m0")]
    else:
        hosts.shape(link)
        port = free_port()
        procs = [
            launch(
                hosts.ns[i],
                [
                    *flags,
                    "--num-machines",
                    2,
                    "--machine-id",
                    i,
                    "--master-addr",
                    hosts.addr[0],
                    "--master-port",
                    port,
                ],
                folder,
                f"m{i}",
            )
            for i in range(2)
        ]
    start, deadline = time.monotonic(), time.monotonic() + args.timeout
    busy, own = busy_cpu_seconds(), own_cpu_seconds()  # what other programs use meanwhile disturbs the timing
    for proc in procs:
        try:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.monotonic() - start
    other = max(0.0, (busy_cpu_seconds() - busy) - (own_cpu_seconds() - own)) / wall
    if any(proc.returncode != 0 for proc in procs) or not os.path.exists(metrics):
        with open(os.path.join(folder, "m0.err")) as f:
            last = (f.read().strip().splitlines() or ["no output"])[-1]
        sys.exit(f"error: {describe(config)} failed in repeat {repeat} after {wall:.0f} s: {last}")
    with open(metrics) as f:
        record = {
            "link_mbit": link,
            "compress": compress,
            "epochs": epochs,
            "repeat": repeat,
            "other_cpu": other,
        }
        record["metrics"] = json.load(f)
    os.unlink(metrics)
    return record


def describe(config):
    link, compress, epochs = config
    where = "one host, Gloo" if link is None else f"{link:g} Mbit/s"
    return f"{where}, --compress {compress}, {epochs} epoch(s)"


def measure(hosts, args, threads):
    timed = [(None, "none", args.epochs)] + [
        (link, c, args.epochs) for link in args.links for c in args.compress
    ]
    records = []
    reference, others = timed[0], timed[1:]
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            order = others if repeat % 2 == 0 else others[::-1]
            for config in [reference] + [c for other in order for c in (other, reference)]:
                records.append(run(hosts, config, args, threads, repeat, folder))
                records[-1]["sequence"] = len(records) - 1
                m = records[-1]["metrics"]
                print(
                    f"repeat {repeat}: {describe(config)}: {m['train_seconds']:.2f} s, "
                    f"{100 * m['test_accuracy']:.2f}%"
                )
        if args.accuracy_epochs:  # each --compress the timed runs took (auto takes one by the link)
            for compress in dict.fromkeys(["none", *(taken(r) for r in records)]):
                config = (None, compress, args.accuracy_epochs)
                records.append(run(hosts, config, args, threads, 0, folder))
                print(f"accuracy: {describe(config)}: {100 * records[-1]['metrics']['test_accuracy']:.2f}%")
    return records


# --- the report -----------------------------------------------------------------------------------


def taken(record):
    """The --compress a run took: its own, or what auto chose for its link (the script's metrics say)."""
    return record["metrics"]["compress"]


def ratios(records, link, compress, epochs):
    """Per run of this configuration: the training loop of the references just before and after it (their
    mean) over its own, its throughput against one host."""
    timed = sorted(
        (r for r in records if r["epochs"] == epochs and "sequence" in r), key=lambda r: r["sequence"]
    )
    found = []
    for i, r in enumerate(timed):
        if (r["link_mbit"], r["compress"]) != (link, compress):
            continue
        beside = [
            next((s for s in side if s["link_mbit"] is None and s["compress"] == "none"), None)
            for side in (reversed(timed[:i]), timed[i + 1 :])
        ]
        seconds = [s["metrics"]["train_seconds"] for s in beside if s is not None]
        if seconds:
            found.append(statistics.mean(seconds) / r["metrics"]["train_seconds"])
    return found


def accuracy(records, epochs, compress, link=None):
    """The median test accuracy of the runs of this link (None: one host) and epochs, with this --compress."""
    found = [
        r["metrics"]["test_accuracy"]
        for r in records
        if (r["link_mbit"], r["compress"], r["epochs"]) == (link, compress, epochs)
    ]
    return statistics.median(found) if found else None


def waiting(record):
    """The share of a run's training loop its rank 0 spent waiting for gradients (the epoch lines')."""
    history = record["metrics"]["history"]
    return sum(h["waiting_seconds"] for h in history) / sum(h["train_seconds"] for h in history)


def span(values):
    return f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""


def verdict(value, low, spread):
    """PASS or FAIL by the median; "inside the noise" where the repeats' range reaches across the target."""
    result = "PASS" if value >= low else "FAIL"
    if len(spread) < 3:
        result += ", too few repeats to tell from noise"
    elif min(spread) < low <= max(spread):
        result += ", inside the noise"
    return result


# The throughput targets: link (Mbit/s), --compress given, the least share of one host's throughput
TARGETS = ((1000, "none", 0.95), (100, "auto", 0.90), (10, "auto", 0.60))
POINTS = 1.0  # the most test accuracy any choice may lose against one host's plain average


def row(records, args, link, compress):
    """One link and --compress: its table row, its throughput ratios, and its accuracy targets' rows."""
    runs = [
        r for r in records if (r["link_mbit"], r["compress"], r["epochs"]) == (link, compress, args.epochs)
    ]
    spread = ratios(records, link, compress, args.epochs)
    took = "/".join(dict.fromkeys(taken(r) for r in runs))  # auto's choice on this link
    seconds = statistics.median(r["metrics"]["train_seconds"] for r in runs)
    figures = [statistics.median(map(waiting, runs)), statistics.median(spread)]
    accuracies = {args.epochs: accuracy(records, args.epochs, compress, link)}
    if args.accuracy_epochs:  # one host's run of the --compress taken: the same arithmetic
        accuracies[args.accuracy_epochs] = accuracy(records, args.accuracy_epochs, took)
    name = f"{link:g} Mbit/s, --compress {compress}"
    text = [f"{link:g} Mbit/s", compress + (f" ({took})" if took != compress else ""), f"{seconds:.2f}"]
    text += [f"{figures[0]:.0%}", f"{figures[1]:.2f}{span(spread)}"]
    text += [f"{100 * a:.2f}%" for a in accuracies.values()]
    checks = []
    for epochs, acc in accuracies.items():
        points = 100 * (acc - accuracy(records, epochs, "none"))
        target = f"{name}: test accuracy after {epochs} epoch(s) within {POINTS:g} point of one host's"
        checks.append(f"| {target} | {points:+.2f} points | {'PASS' if abs(points) <= POINTS else 'FAIL'} |")
    return "| " + " | ".join(text) + " |", spread, checks


def report(records, args, facts):
    interval = f", a {100 * (1 - 2 / 2**args.repeats):.0f}% interval" if args.repeats > 1 else ""
    epochs = [args.epochs] + ([args.accuracy_epochs] if args.accuracy_epochs else [])
    lines = [
        "# What the network costs, and what --compress buys back",
        "",
        f"{facts['date']}, commit {facts['commit']}; {facts['cpu']}, {facts['usable_cores']} usable cores; "
        f"Python {facts['python']}, torch {facts['torch']}. {facts['dataset']}, {args.epochs} epoch(s), "
        f"2 processes of {facts['threads']} thread(s), --batch-size {args.batch_size} each; "
        f"{args.repeats} interleaved repeat(s). Throughput: the training loop of the references run just "
        f"before and after a run (their mean) over the run's, median (range over the repeats{interval}). "
        "Waiting: the share of the loop rank 0 waited for gradients (the epoch lines)."
        + (
            f" After {args.accuracy_epochs} epochs: one run on one host over Gloo per --compress taken."
            if args.accuracy_epochs
            else ""
        ),
        "",
        "| link | --compress (taken) | training loop (s) | waiting | throughput vs one host | "
        + " | ".join(f"test accuracy, {e} epoch(s)" for e in epochs)
        + " |",
        "|---|---|---:|---:|---:|" + "---:|" * len(epochs),
    ]
    references = [r for r in records if r["link_mbit"] is None and r["epochs"] == args.epochs]
    seconds = statistics.median(r["metrics"]["train_seconds"] for r in references)
    ones = " | ".join(f"{100 * accuracy(records, e, 'none'):.2f}%" for e in epochs)
    lines.append(f"| one host, Gloo | none | {seconds:.2f} | | 1.00 | {ones} |")
    summary, checks = {}, []
    for link in sorted(args.links, reverse=True):
        for compress in args.compress:
            text, summary[(link, compress)], more = row(records, args, link, compress)
            lines.append(text)
            checks += more
    lines += ["", "| target | measured | result |", "|---|---|---|"]
    for link, compress, low in (t for t in TARGETS if t[:2] in summary):
        spread = summary[(link, compress)]
        median = statistics.median(spread)
        name = f"{link:g} Mbit/s, --compress {compress}: throughput ≥ {low:.2f} of one host"
        lines.append(f"| {name} | {median:.3f}{span(spread)} | {verdict(median, low, spread)} |")
    other = [r["other_cpu"] for r in records]
    lines += checks + [
        "",
        f"Other programs kept {statistics.mean(other):.2f} cores busy on average during the runs (at most "
        f"{max(other):.2f}, of {facts['usable_cores']}): above about 0.1 they slow the computing, not the "
        "link, and the ratios flatter the network.",
    ]
    return "\n".join(lines) + "\n", summary


def plot(path, args, records, summary):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    links = sorted(args.links)
    for compress in args.compress:
        spreads = [summary[(link, compress)] for link in links]
        medians = [statistics.median(spread) for spread in spreads]
        lows = [m - min(spread) for spread, m in zip(spreads, medians)]
        highs = [max(spread) - m for spread, m in zip(spreads, medians)]
        acc = accuracy(records, args.epochs, compress, min(links))
        label = f"--compress {compress} (test accuracy {100 * acc:.2f}%)"
        ax.errorbar(links, medians, yerr=[lows, highs], marker="o", capsize=4, label=label)
    ax.axhline(1.0, color="gray", linestyle="--", label="one host, Gloo (the reference)")
    ax.set_xscale("log")
    ax.set_xticks(links, [f"{link:g}" for link in links])
    ax.set_xlabel("link speed (Mbit/s), both directions")
    ax.set_ylabel("throughput against one host")
    ax.set_ylim(0, max(1.1, 1.05 * max(map(max, summary.values()))))
    ax.set_title(
        f"2 processes on 2 hosts, {args.epochs} epoch(s), median of {args.repeats} interleaved repeat(s)"
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- command line ---------------------------------------------------------------------------------


def number_list(text, kind):
    values = [kind(v) for v in text.split(",") if v]
    if not values:
        raise argparse.ArgumentTypeError("give at least one value")
    return values


def compress_list(text):
    values = number_list(text, str)
    for value in values:
        if value not in CHOICES:
            raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(CHOICES)}")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dataset",
        choices=["mnist", "fashion-mnist"],
        default="fashion-mnist",
        help="(default: fashion-mnist)",
    )
    p.add_argument(
        "--data-dir", default="data", metavar="DIR", help="the scripts' --data-dir (default: data)"
    )
    p.add_argument("--links", type=lambda t: number_list(t, float), default=[1000, 100, 10], metavar="MBITS",
                   help="link speeds in Mbit/s, comma-separated (default: 1000,100,10)")  # fmt: skip
    p.add_argument("--compress", type=compress_list, default=["none", "auto"], metavar="LIST",
                   help="--compress choices at each speed: plain, and the README's advice "
                        "(default: none,auto)")  # fmt: skip
    p.add_argument(
        "--repeats", type=positive_int, default=3, metavar="N", help="interleaved repeats (default: 3)"
    )
    p.add_argument(
        "--epochs", type=positive_int, default=1, metavar="N", help="epochs of each timed run (default: 1)"
    )
    p.add_argument("--accuracy-epochs", type=int, default=3, metavar="N",
                   help="epochs of the accuracy runs, one per --compress taken; 0 for none "
                        "(default: 3)")  # fmt: skip
    p.add_argument(
        "--batch-size", type=positive_int, default=64, metavar="N", help="per process (default: 64)"
    )
    p.add_argument(
        "--timeout", type=positive_int, default=900, metavar="SECONDS", help="per run (default: 900)"
    )
    p.add_argument("--out-dir", default=os.path.join(REPO, "bench", "results", "network"), metavar="DIR",
                   help="where the report goes (default: bench/results/network)")  # fmt: skip
    args = p.parse_args(argv)
    return args


def main(argv=None):
    args = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit(
            "bench/network.py needs root, to make network namespaces and shape the link (ip netns, tc): "
            "run it as root"
        )
    if not (shutil.which("ip") and shutil.which("tc")):
        sys.exit("bench/network.py needs the ip and tc commands (apt-get install iproute2)")
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    facts = machine_facts(args.dataset, threads=threads, links_mbit=args.links, repeats=args.repeats)
    os.makedirs(args.out_dir, exist_ok=True)
    hosts = None
    try:
        hosts = Hosts()
        records = measure(hosts, args, threads)
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: cannot set up the two hosts ({' '.join(e.cmd)}: {(e.stderr or '').strip()})")
    finally:
        if hosts:
            hosts.remove()
    text, summary = report(records, args, facts)
    with open(os.path.join(args.out_dir, "network.md"), "w") as f:
        f.write(text)
    write_json(os.path.join(args.out_dir, "runs.json"), {"facts": facts, "args": vars(args), "runs": records})
    plot(os.path.join(args.out_dir, "network.png"), args, records, summary)
    print(text)


if __name__ == "__main__":
    main()
