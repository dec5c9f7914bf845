#!/usr/bin/env python3
"""How convnet_distributed.py scales with processes on this machine, and how close it is to the floor.

Launches the scripts as a user would, one subprocess per run, and writes to --out-dir:
  scaling.md   the scaling table (1, 2, 4, 8 processes at a global batch of 128) and the reference
               table (a bare training loop, 1 process vs 2, the baseline, torchvision's textbook data
               path, bfloat16 autocast) with each target marked PASS or FAIL
  scaling.png  speed-up against processes (needs matplotlib; skipped, saying so, without it)
  runs.json    every run: command, the script's metrics, peak memory

Run from the repository root, on a quiet machine (about 25 minutes on 2 cores with the defaults):
    mkdir -p data/FashionMNIST/raw && cp /usr/share/datasets/fashion-mnist/*.gz data/FashionMNIST/raw/
    python bench/scaling.py --dataset fashion-mnist --data-dir data
A quick check of the benchmark itself: point --data-dir at a small data set in the same layout and
pass --repeats 1 --processes 1,2. The report says how busy other programs kept the machine during
the runs, and warns where that disturbed the timings.

Each configuration runs --repeats times and the tables show medians. The runs are interleaved (every
configuration once, then every configuration again, ...), so that a disturbance of the machine
spreads over all configurations instead of landing on one; the runs a target compares run next to
each other, in reverse order every other repeat. A target is judged on the median of its ratio
taken within each repeat, between runs a minute apart: a host whose speed drifts over the
benchmark's half hour moves both sides of such a ratio alike. Beside the median stands an interval
that holds the median this machine would give with at least 90% probability (order statistics: no
assumption about how the repeats are distributed; 5 repeats or more). Where it reaches across the
target, the verdict says "inside the noise": a rerun could well give the other answer, and only
more repeats or a quieter machine can settle it.

Earlier runs can be reported again, or pooled into one report with more repeats, without measuring:
    python bench/scaling.py --from-runs first/runs.json second/runs.json --out-dir pooled

Memory, two figures, both exact: a rank's peak resident set size while it works, which each script
reads from the kernel (getrusage) once its last epoch is done and writes to its metrics; and the
peak of the whole run, exit included, the largest of the launcher and its ranks (wait4, as
`/usr/bin/time -v`). Exiting adds about 110 MiB to every process of torch's CUDA build, even on a
CPU: the CUDA libraries' destructors page in their own code.
"""

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass

from common import free_port, machine_facts, positive_int, script_env, write_json
from runner import run_monitored

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
DISTRIBUTED, BASELINE = "convnet_distributed.py", "convnet_undistributed.py"
FLOOR, TORCHVISION = "bench/floor.py", "bench/torchvision_reference.py"
MIB = 2**20


@dataclass(frozen=True)
class Config:
    """One command to time: a script and its own flags (the common ones are added at launch)."""

    script: str
    flags: tuple = ()

    @property
    def key(self):
        return " ".join((self.script,) + self.flags)


# --- the configurations -------------------------------------------------------------------------


def scaling_configs(args):
    """processes: the distributed script at that many processes, the global batch kept constant."""
    return {
        p: Config(DISTRIBUTED, ("--num-processes", str(p), "--batch-size", str(args.global_batch // p)))
        for p in args.processes
    }


def reference_configs():
    """(label, what it is, config) of the reference table."""
    return [
        (
            "a",
            "floor: one rank's work of a 2-process run, bare loop, 1 thread",
            Config(FLOOR, ("--world-size", "2", "--batch-size", "64", "--threads", "1")),
        ),
        (
            "b",
            "distributed, 2 processes",
            Config(DISTRIBUTED, ("--num-processes", "2", "--batch-size", "64")),
        ),
        (
            "c",
            "distributed, 1 process, 1 thread",
            Config(DISTRIBUTED, ("--num-processes", "1", "--threads", "1", "--batch-size", "128")),
        ),
        ("d", "baseline", Config(BASELINE, ("--batch-size", "128"))),
        ("e", "torchvision transform + DataLoader", Config(TORCHVISION, ("--batch-size", "128"))),
        ("f", "baseline, bfloat16 autocast", Config(BASELINE, ("--batch-size", "128", "--amp"))),
        (
            "g",
            "distributed, 2 processes, gradients averaged over Gloo (loopback TCP), not shared memory",
            Config(DISTRIBUTED, ("--num-processes", "2", "--batch-size", "64", "--allreduce", "gloo")),
        ),
        (
            "h",
            "the floor twice at once, one process each, no communication: the slowest of the two",
            Config(FLOOR, ("--world-size", "2", "--batch-size", "64", "--threads", "1", "--copies", "2")),
        ),
    ]


# Run order of the reference runs: each judged pair (b/a, c/b, d/b, d/f, e/d) one or two runs apart.
RUN_ORDER = "abcdfehg"


def all_configs(args):
    """Every distinct command, in run order: the reference runs, then the rest of the scaling table (the
    2-process run is in both tables and runs once per repeat)."""
    configs = []
    if not args.skip_reference:
        labelled = {label: config for label, _, config in reference_configs()}
        configs += [labelled[label] for label in RUN_ORDER]
    configs += list(scaling_configs(args).values())
    return list(dict.fromkeys(configs))


# --- running ------------------------------------------------------------------------------------


def command(config, args, metrics_path):
    argv = [
        sys.executable,
        os.path.join(REPO, config.script),
        *config.flags,
        "--epochs",
        str(args.epochs),
        "--dataset",
        args.dataset,
        "--data-dir",
        args.data_dir,
        "--metrics-json",
        metrics_path,
    ]
    if config.script == DISTRIBUTED:
        argv += ["--master-port", str(free_port())]
    return argv


def run_once(config, args, repeat, tmp):
    """Run a configuration once; its record, or exit non-zero showing why it failed."""
    metrics_path = os.path.join(tmp, "metrics.json")
    if os.path.exists(metrics_path):
        os.unlink(metrics_path)  # a stale file must not pass for this run's figures
    result = run_monitored(command(config, args, metrics_path), args.timeout, cwd=REPO, env=script_env())
    if result.returncode and "address already in use" in result.stderr_tail.lower():
        # Another program took the free port between our check and the script's bind: once more, another port.
        result = run_monitored(command(config, args, metrics_path), args.timeout, cwd=REPO, env=script_env())
    if result.returncode != 0 or not os.path.exists(metrics_path):
        fail(config, repeat, result, args.timeout)
    with open(metrics_path) as f:
        metrics = json.load(f)
    return {
        "config": config.key,
        "repeat": repeat,
        "argv": result.argv,
        "wall_seconds": result.wall_seconds,
        "peak_rss_run_mib": result.peak_rss / MIB,
        "other_cpu_cores": result.other_cpu,
        "metrics": metrics,
    }


def fail(config, repeat, result, timeout):
    why = (
        f"ran past the {timeout:g} s timeout and was killed"
        if result.returncode is None
        else f"exited with status {result.returncode}"
        if result.returncode
        else "wrote no metrics file"
    )
    message = [
        f"error: {config.key} (repeat {repeat + 1}) {why} after {result.wall_seconds:.1f} s",
        f"command: {' '.join(result.argv)}",
    ]
    for name, text in (("stderr", result.stderr_tail), ("stdout", result.stdout_tail)):
        if text.strip():
            message += [f"--- {name}, last lines ---", text]
    sys.exit("\n".join(message))


def import_rss_mib():
    """Peak RSS of a Python that has only imported torch and torchvision, before it exits: the part of
    every figure below that is the libraries' pages, not the run's data and model."""
    code = "import resource, torch, torchvision; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    result = run_monitored([sys.executable, "-c", code], timeout=300, env=script_env())
    return int(result.stdout_tail.split()[-1]) / 1024 if result.returncode == 0 else None


def measure(args, facts):
    """Every configuration, args.repeats times, interleaved; runs.json is rewritten after each run,
    so an interrupted benchmark keeps what it measured."""
    records = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for repeat in range(args.repeats):
            # Every other repeat backwards: a drift of the host's speed favours neither side of a pair.
            configs = all_configs(args)[:: 1 if repeat % 2 == 0 else -1]
            for i, config in enumerate(configs):
                record = run_once(config, args, repeat, tmp)
                records.append(record)
                write_json(
                    os.path.join(args.out_dir, "runs.json"),
                    {"machine": facts, "options": vars(args), "runs": records},
                )
                print(
                    f"[repeat {repeat + 1}/{args.repeats}, run {i + 1}/{len(configs)}] {config.key}: "
                    f"train loop {record['metrics']['train_seconds']:.2f} s, "
                    f"peak RSS per rank {rank_peak_mib(record):.0f} MiB, "
                    f"other programs {record['other_cpu_cores']:.2f} cores",
                    flush=True,
                )
    return records


# --- summarising --------------------------------------------------------------------------------


def summarise(records):
    """Per configuration: medians over its repeats."""
    by_config = {}
    for record in records:
        by_config.setdefault(record["config"], []).append(record)
    return {key: summary(runs) for key, runs in by_config.items()}


def summary(runs):
    def median(get):
        values = [get(r) for r in runs]
        return None if None in values else statistics.median(values)

    return {
        "runs": len(runs),
        "threads": runs[0]["metrics"].get("threads"),
        "allreduce": runs[0]["metrics"].get("allreduce"),
        "train_seconds": median(lambda r: r["metrics"]["train_seconds"]),
        "samples_per_second": median(lambda r: r["metrics"]["samples_per_second"]),
        "test_accuracy": median(lambda r: r["metrics"].get("test_accuracy")),
        "peak_rss_rank_mib": median(rank_peak_mib),
        "peak_rss_run_mib": median(run_peak_mib),
        "train_size": round(
            runs[0]["metrics"]["samples_per_second"]
            * runs[0]["metrics"]["train_seconds"]
            / runs[0]["metrics"]["epochs"]
        ),
    }


def scaling_rows(args, summaries):
    """One row per process count; speed-up against the smallest count measured (normally 1)."""
    configs = scaling_configs(args)
    base_p = min(configs)
    base_seconds = summaries[configs[base_p].key]["train_seconds"]
    rows = []
    for p, config in configs.items():
        s = summaries[config.key]
        speedup = base_seconds / s["train_seconds"]
        rows.append({"processes": p, "speedup": speedup, "efficiency": speedup * base_p / p, **s})
    return rows


def by_label(summaries):
    """The reference runs' summaries by their label, (a) to (f)."""
    return {label: summaries[config.key] for label, _, config in reference_configs()}


def train_seconds(record):
    return record["metrics"]["train_seconds"]


def rank_peak_mib(record):
    """The largest rank's peak RSS while it worked, as the script measured it."""
    metrics = record["metrics"]
    return max(metrics.get("peak_rss_mib_per_rank") or [metrics["peak_rss_mib"]])


def run_peak_mib(record):
    """The peak RSS of the whole run, exit included: its largest process's."""
    return record["peak_rss_run_mib"]


def accuracy_points(record):
    return 100 * record["metrics"]["test_accuracy"]


def compare(records, x, y, get, combine):
    """combine(get(x's run), get(y's run)) for each repeat that has both runs, a comparison between runs a
    minute apart; and combine() of the two medians over all repeats, for reference."""
    labelled = {config.key: label for label, _, config in reference_configs()}
    runs = {}
    for record in records:
        runs.setdefault(record["repeat"], {})[labelled.get(record["config"])] = record
    paired = [combine(get(r[x]), get(r[y])) for _, r in sorted(runs.items()) if x in r and y in r]
    medians = [statistics.median(get(r[label]) for r in runs.values() if label in r) for label in (x, y)]
    return paired, combine(*medians)


# The probability with which a check's interval (median_interval) holds the median the host would give.
CONFIDENCE = 0.90


def median_interval(values, confidence=CONFIDENCE):
    """Where the median of the population the values were drawn from lies, with at least the given
    probability, assuming nothing of its shape: the k-th smallest to the k-th largest value, k as large as
    the binomial distribution of the values below the median allows (5 values: the smallest to the
    largest, 94%; 10: the second smallest to the second largest, 98%). None for fewer than 5 values at 90%."""
    ordered, n, interval = sorted(values), len(values), None
    for k in range(1, n // 2 + 1):
        outside = 2 * sum(math.comb(n, i) for i in range(k)) / 2**n  # k or more values on either side
        if 1 - outside < confidence:
            break
        interval = (ordered[k - 1], ordered[n - k])
    return interval


@dataclass(frozen=True)
class Target:
    """The values a check passes: one interval, unbounded at an end left out, open at low where strict."""

    text: str
    low: float = -math.inf
    high: float = math.inf
    strict: bool = False

    def accepts(self, value):
        return (value > self.low if self.strict else value >= self.low) and value <= self.high

    def verdict(self, median, interval):
        """PASS or FAIL by the median; "inside the noise" where the median's interval reaches across the
        target, so that another run on the same machine could well give the other answer."""
        word = "PASS" if self.accepts(median) else "FAIL"
        if interval is None:
            return f"{word}, too few repeats to tell from noise"
        low, high = interval
        passes = self.accepts(low) and self.accepts(high)  # the accepted values are one interval
        fails = high < self.low or (high == self.low and self.strict) or low > self.high
        return word if passes or fails else f"{word}, inside the noise"


def targets(records):
    """(check, values per repeat, their median, the median's interval, the value from the medians, target,
    verdict) for each row of the check table; target and verdict are None for a measurement."""

    def ratio(x, y, get=train_seconds):
        return compare(records, x, y, get, lambda u, v: u / v)

    rows = [
        ("(b) / (a): 2 processes against the floor", ratio("b", "a"), Target("≤ 1.15", high=1.15)),
        (
            "(c) / (b): speed-up of 2 processes over 1 process of 1 thread",
            ratio("c", "b"),
            Target("≥ 1.8", low=1.8),
        ),
        (
            "(d) / (b): speed-up of 2 processes over the baseline",
            ratio("d", "b"),
            Target("> 1", low=1, strict=True),
        ),
        (
            "(e) / (d): torchvision's data path against the baseline's",
            ratio("e", "d"),
            Target("≥ 1.3", low=1.3),
        ),
        ("(d) / (f): speed-up of bfloat16 autocast", ratio("d", "f"), Target("≥ 1.4", low=1.4)),
        (
            "(f) − (d): test accuracy under bfloat16 autocast, points",
            compare(records, "f", "d", accuracy_points, lambda u, v: u - v),
            Target("within ±0.5", low=-0.5, high=0.5),
        ),
        (
            "(b) / (e): peak RSS of a rank against torchvision's data path",
            ratio("b", "e", rank_peak_mib),
            Target("≤ 1", high=1),
        ),
        (
            "(b) / (e), exit included: the same for the whole run's largest process",
            ratio("b", "e", run_peak_mib),
            None,
        ),
        (
            "(h) / (a): two floors at once against one (the machine's share of (b) / (a))",
            ratio("h", "a"),
            None,
        ),
        ("(b) / (h): 2 processes against two floors at once (the scripts' share)", ratio("b", "h"), None),
        ("(g) / (b): gradients over Gloo against shared memory", ratio("g", "b"), None),
    ]
    judged = []
    for check, (paired, from_medians), target in rows:
        median, interval = statistics.median(paired), median_interval(paired)
        judged.append(
            (
                check,
                paired,
                median,
                interval,
                from_medians,
                target and target.text,
                target and target.verdict(median, interval),
            )
        )
    return judged


# --- reporting ----------------------------------------------------------------------------------


def fmt(value, spec):
    return "–" if value is None else format(value, spec)


def quietness(records, cores):
    """A line on how busy other programs kept the machine during the runs; a warning where they mattered."""
    worst = max(records, key=lambda r: r["other_cpu_cores"])
    mean = statistics.mean(r["other_cpu_cores"] for r in records)
    line = (
        f"Other programs kept {mean:.2f} of {cores} cores busy on average during the runs "
        f"(at most {worst['other_cpu_cores']:.2f}, during `{worst['config']}`)."
    )
    if worst["other_cpu_cores"] > 0.1 * cores:
        line += (
            " **Warning: the machine was not quiet; the timings are disturbed. Rerun on a quiet machine.**"
        )
    return line


def header(args, facts, records, train_size):
    lines = [
        f"Machine: {facts['cpu']}, {facts['usable_cores']} usable cores "
        f"({facts['logical_cpus']} logical CPUs); "
        f"Python {facts['python']}, torch {facts['torch']}, torchvision {facts['torchvision']}; "
        f"commit {facts['commit']}; {facts['date']}.",
        "",
        f"Data: {args.dataset}, {train_size:,} training images, {args.epochs} epoch(s); "
        f"median of {args.repeats} run(s) per row, the runs interleaved"
        + (
            f"; the repeats of {len(args.from_runs)} benchmarks, pooled."
            if len(args.from_runs or ()) > 1
            else "."
        ),
        "",
        quietness(records, facts["usable_cores"]),
    ]
    if train_size < 60000:
        lines += [
            "",
            f"Note: a {train_size:,}-image training set, not the full 60,000: start-up weighs more and "
            "the targets below are meant for the full set.",
        ]
    return lines


def scaling_table(args, rows, facts):
    base_p = rows[0]["processes"]  # rows go by process count, up
    lines = [
        f"## Scaling: `{DISTRIBUTED}`, global batch {args.global_batch}",
        "",
        f"| processes | threads per process | train loop (s) | samples/s | speed-up vs {base_p} "
        "| efficiency | test accuracy | gradients averaged | peak RSS per rank (MiB) "
        "| peak RSS, exit included (MiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['processes']} | {r['threads']} | {r['train_seconds']:.2f} "
            f"| {r['samples_per_second']:,.0f} "
            f"| {r['speedup']:.2f}× | {100 * r['efficiency']:.0f}% | {fmt(100 * r['test_accuracy'], '.2f')}% "
            f"| {'–' if r['processes'] == 1 else r['allreduce']} "
            f"| {r['peak_rss_rank_mib']:.0f} | {r['peak_rss_run_mib']:.0f} |"
        )
    lines += [
        "",
        "Efficiency is speed-up ÷ processes. Peak RSS per rank: the largest rank's, while it worked; "
        "exit included: the largest process of the run (with 1 process the launcher is the rank; with "
        "more, the ranks share the launcher's copy of the data, and RSS counts it in each).",
    ]
    if facts["import_rss_mib"]:
        lines[-1] += (
            f" For scale: a Python that has only imported torch and torchvision has an RSS of "
            f"{facts['import_rss_mib']:.0f} MiB, most of it library pages shared between processes."
        )
    return lines


def reference_table(records, summaries):
    d_seconds = by_label(summaries)["d"]["train_seconds"]
    lines = [
        "## Reference runs, side by side",
        "",
        "| | run | command | threads | train loop (s) | ÷ (d) | test accuracy | peak RSS per rank (MiB) "
        "| exit included (MiB) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, what, config in reference_configs():
        s = summaries[config.key]
        accuracy = "–" if s["test_accuracy"] is None else f"{100 * s['test_accuracy']:.2f}%"
        lines.append(
            f"| ({label}) | {what} | `{config.key}` | {s['threads']} | {s['train_seconds']:.2f} "
            f"| {s['train_seconds'] / d_seconds:.2f} | {accuracy} | {s['peak_rss_rank_mib']:.0f} "
            f"| {s['peak_rss_run_mib']:.0f} |"
        )
    lines += [
        "",
        "Each check is taken within each repeat, between runs a minute apart, and the median of those is "
        f"judged. The interval holds the median this machine would give with at least {CONFIDENCE:.0%} "
        "probability (the order statistics of the repeats, whatever their distribution); where it reaches "
        "across the target, the result is marked inside the noise: a rerun could well give the other "
        "answer. The value from the medians of the table above is shown for reference.",
        "",
        f"| check | per repeat | median (judged) | {CONFIDENCE:.0%} interval "
        "| from the medians | target | result |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for check, values, median, interval, from_medians, target, verdict in targets(records):
        span = "–" if interval is None else f"{interval[0]:.2f} to {interval[1]:.2f}"
        # The judged median to 3 places: at 2, a median of 1.152 against "≤ 1.15" would read 1.15 and FAIL.
        lines.append(
            f"| {check} | {', '.join(f'{v:.2f}' for v in values)} | {median:.3f} | {span} "
            f"| {from_medians:.2f} | {target or '–'} | {verdict or '–'} |"
        )
    return lines


def write_markdown(path, args, facts, records, rows, summaries):
    train_size = next(iter(summaries.values()))["train_size"]
    lines = [
        "# Scaling of the CPU data-parallel script",
        "",
        *header(args, facts, records, train_size),
        "",
        *scaling_table(args, rows, facts),
    ]
    if not args.skip_reference:
        lines += ["", *reference_table(records, summaries)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(path, rows, facts):
    """Speed-up against processes, with the ideal line; False where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): skipping the plot", file=sys.stderr)
        return False
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    processes = [r["processes"] for r in rows]
    top = max(processes + [facts["usable_cores"]])
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    ax.plot([1, top], [1, top], "--", color="grey", label="ideal (speed-up = processes)")
    ax.plot(processes, [r["speedup"] for r in rows], "o-", label="measured (median)")
    ax.axvline(
        facts["usable_cores"], color="tab:red", linestyle=":", label=f"usable cores ({facts['usable_cores']})"
    )
    ax.set_xticks(sorted(set(processes + [facts["usable_cores"]])))
    ax.set_xlabel("processes (global batch kept constant)")
    ax.set_ylabel(f"speed-up of the training loop vs {min(processes)} process(es)")
    ax.set_title(
        f"{DISTRIBUTED}, {facts['dataset']}\n{facts['cpu']}, {facts['usable_cores']} usable cores",
        fontsize=10,
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --- command line -------------------------------------------------------------------------------


def process_list(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected process counts of at least 1, got {text!r}")
    return sorted(set(values))


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dataset",
        choices=["fashion-mnist", "mnist"],
        default="mnist",
        help="data set, passed to every script (default: mnist)",
    )
    p.add_argument(
        "--data-dir",
        default="./data",
        metavar="DIR",
        help="data folder in torchvision's layout (DIR/MNIST/raw, DIR/FashionMNIST/raw); a small "
        "data set here makes a quick run (default: ./data)",
    )
    p.add_argument(
        "--processes",
        type=process_list,
        default=[1, 2, 4, 8],
        metavar="P,P,...",
        help="process counts of the scaling table (default: 1,2,4,8)",
    )
    p.add_argument(
        "--global-batch",
        type=positive_int,
        default=128,
        metavar="N",
        help="global batch of the scaling table; each of P processes gets N/P (default: 128)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        metavar="N",
        help="runs of each configuration; the tables show medians (default: 5)",
    )
    p.add_argument(
        "--epochs", type=positive_int, default=1, metavar="N", help="epochs of every run (default: 1)"
    )
    p.add_argument(
        "--out-dir",
        default=os.path.join(BENCH, "results"),
        metavar="DIR",
        help="where scaling.md, scaling.png and runs.json go (default: bench/results)",
    )
    p.add_argument(
        "--skip-reference",
        action="store_true",
        help="measure the scaling table only, not the reference runs (default: off)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800,
        metavar="SECONDS",
        help="longest a single run may take before it is killed and the benchmark fails (default: 1800)",
    )
    p.add_argument(
        "--from-runs",
        nargs="+",
        metavar="RUNS_JSON",
        help="measure nothing: write the report from the runs.json of earlier benchmarks, pooling "
        "their repeats where there are several (default: measure)",
    )
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    uneven = [p for p in args.processes if args.global_batch % p]
    if uneven:
        parser.error(f"--global-batch {args.global_batch} does not split evenly over {uneven} processes")
    if os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):
        parser.error(f"--data-dir: {args.data_dir} is not a folder")
    args.data_dir = os.path.abspath(args.data_dir)  # the scripts run from the repository root
    args.out_dir = os.path.abspath(args.out_dir)
    return args


def load_runs(paths, args):
    """The runs of earlier benchmarks, their repeats numbered on from one file to the next, and their machine
    facts; args takes the options they ran with. They must have measured the same configurations."""
    records, facts, options = [], [], []
    for path in paths:
        try:
            with open(path) as f:
                saved = json.load(f)
            runs, machine, ran_with = saved["runs"], saved["machine"], saved["options"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"error: --from-runs: cannot read {path} ({type(e).__name__}: {e})")
        if not runs:
            sys.exit(f"error: --from-runs: {path} holds no runs")
        offset = 1 + max((r["repeat"] for r in records), default=-1)
        records += [{**r, "repeat": r["repeat"] + offset} for r in runs]
        facts.append(machine)
        options.append(
            {k: ran_with[k] for k in ("dataset", "epochs", "processes", "global_batch", "skip_reference")}
        )
    if any(o != options[0] for o in options):
        sys.exit(
            "error: --from-runs: the files measured different configurations ("
            + "; ".join(f"{p}: {o}" for p, o in zip(paths, options))
            + "): pool only runs of the same benchmark"
        )
    vars(args).update(options[0], repeats=1 + max(r["repeat"] for r in records))
    pooled = dict(facts[0])
    for key in ("commit", "date"):  # where the files differ, name every one
        pooled[key] = ", ".join(dict.fromkeys(str(f[key]) for f in facts))
    return records, pooled


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.from_runs:
        records, facts = load_runs(args.from_runs, args)
        if len(args.from_runs) > 1:  # a new set of runs; one file reported again is left as it was measured
            write_json(
                os.path.join(args.out_dir, "runs.json"),
                {"machine": facts, "options": vars(args), "runs": records},
            )
    else:
        facts = machine_facts(args.dataset, import_rss_mib=import_rss_mib())
        records = measure(args, facts)
    summaries = summarise(records)
    rows = scaling_rows(args, summaries)
    write_markdown(os.path.join(args.out_dir, "scaling.md"), args, facts, records, rows, summaries)
    png = os.path.join(args.out_dir, "scaling.png")
    plotted = plot(png, rows, facts)
    if not plotted and os.path.exists(png):
        os.unlink(png)  # an earlier benchmark's plot would pass for this one's
    with open(os.path.join(args.out_dir, "scaling.md")) as f:
        print("\n" + f.read())
    print(
        f"Written: {os.path.join(args.out_dir, 'scaling.md')}"
        + (f", {png}" if plotted else "")
        + ("" if len(args.from_runs or ()) == 1 else f", {os.path.join(args.out_dir, 'runs.json')}")
    )


if __name__ == "__main__":
    main()
