"""bench/scaling.py, the user's benchmark, on small generated data: it writes its tables, plot and runs."""

import json
import math
import os
import platform
import random
import subprocess
import sys

import pytest

from conftest import N_TRAIN, REPO, script_env

sys.path.insert(0, os.path.join(REPO, "bench"))
import scaling


@pytest.mark.timeout(900)
def test_scaling_benchmark_writes_table_plot_and_runs(data_dir, tmp_path):
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        os.path.join(REPO, "bench", "scaling.py"),
        "--dataset",
        "mnist",
        "--data-dir",
        data_dir,
        "--processes",
        "1,2",
        "--repeats",
        "1",
        "--out-dir",
        str(out),
        "--timeout",
        "300",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=script_env(), timeout=800)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (out / "scaling.md").read_text()
    assert "| processes | threads per process | train loop (s) |" in table
    assert f"{N_TRAIN:,} training images" in table and "Reference runs" in table
    assert table.count("PASS") + table.count("FAIL") == 7  # every target judged
    assert table.count("too few repeats to tell from noise") == 7  # 1 repeat is no evidence either way
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = json.loads((out / "runs.json").read_text())["runs"]
    assert len(runs) == 9  # 1 and 2 processes, then the reference runs (a)-(h), (b) being the 2-process run
    for run in runs:
        m = run["metrics"]
        assert 0 < m["train_seconds"] < 300 and m["samples_per_second"] > 0, run["config"]
        # torch alone is a few hundred MiB; the whole run's peak, exit included, is at least a working rank's
        assert 100 < scaling.rank_peak_mib(run) <= run["peak_rss_run_mib"] < 8192, run["config"]
        if "test_accuracy" in m:  # the floor does not evaluate
            assert 0.5 < m["test_accuracy"] <= 1, run["config"]  # the fixture's classes are learnable
    two = next(r for r in runs if "--num-processes 2 --batch-size 64" in r["config"])
    assert len(two["metrics"]["peak_rss_mib_per_rank"]) == 2 and two["metrics"]["world_size"] == 2
    assert two["metrics"]["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    gloo = next(r for r in runs if "--allreduce gloo" in r["config"])
    copies = next(r for r in runs if "--copies 2" in r["config"])["metrics"]
    assert len(copies["copy_seconds"]) == 2 and copies["train_seconds"] == max(copies["copy_seconds"])
    shared = "shared-memory" if platform.machine() in ("x86_64", "AMD64") else "gloo"  # the script's rule
    assert (two["metrics"]["allreduce"], gloo["metrics"]["allreduce"]) == (shared, "gloo")


def test_targets_are_judged_within_each_repeat():
    """A slow second repeat moves both runs of a pair: the judged ratio stays that of its own repeat."""
    keys = {label: config.key for label, _, config in scaling.reference_configs()}
    records = []
    for repeat, slow in enumerate([1.0, 1.5, 1.0]):
        for label, seconds in {
            "a": 10,
            "b": 11,
            "c": 20,
            "d": 12,
            "e": 25,
            "f": 8,
            "g": 13,
            "h": 10.5,
        }.items():
            extra = 3 if (repeat, label) == (2, "b") else 0  # one disturbed run
            records.append(
                {
                    "config": keys[label],
                    "repeat": repeat,
                    "peak_rss_run_mib": 1000,
                    "metrics": {
                        "train_seconds": seconds * slow + extra,
                        "test_accuracy": 0.86,
                        "peak_rss_mib_per_rank": [900, 950],
                    },
                }
            )
    rows = {check.split(":")[0]: rest for check, *rest in scaling.targets(records)}
    values, median, interval, from_medians, target, verdict = rows["(b) / (a)"]
    assert values == pytest.approx([1.1, 1.1, 1.4]) and median == pytest.approx(1.1)
    assert verdict == "PASS, too few repeats to tell from noise" and interval is None
    assert from_medians == pytest.approx(14 / 10)  # medians of b (11, 16.5, 14) and a (10, 15, 10)
    assert rows["(d) / (f)"][1] == pytest.approx(1.5) and rows["(d) / (f)"][5].startswith("PASS")
    assert rows["(f) − (d)"][1] == 0 and rows["(f) − (d)"][5].startswith("PASS")
    assert rows["(b) / (e)"][1] == pytest.approx(1.0) and rows["(b) / (e)"][5].startswith(
        "PASS"
    )  # a rank's largest peak
    assert rows["(b) / (e), exit included"][1] == pytest.approx(1.0)
    assert (
        rows["(b) / (e), exit included"][4:] == rows["(h) / (a)"][4:] == [None, None]
    )  # measurements, not targets


def test_the_median_interval_holds_the_median_with_at_least_90_percent():
    assert scaling.median_interval([1.0, 2.0, 3.0, 4.0]) is None  # 4 values: the full range holds it only 88%
    assert scaling.median_interval([5, 1, 4, 2, 3]) == (1, 5)  # 94%: the smallest to the largest
    assert scaling.median_interval(list(range(10))) == (1, 8)  # 98%; dropping one more on each side: 89%
    assert scaling.median_interval(list(range(20))) == (5, 14)  # 96%
    # Its coverage, checked by drawing: samples of 10 from a skewed distribution whose median is known.
    rng = random.Random(0)
    draws = [[rng.expovariate(1.0) for _ in range(10)] for _ in range(4000)]
    held = sum(low <= math.log(2) <= high for low, high in map(scaling.median_interval, draws)) / len(draws)
    assert 0.96 < held < 0.995  # 97.9% in theory


@pytest.mark.parametrize(
    "median, interval, verdict",
    [
        (1.12, (1.05, 1.14), "PASS"),
        (1.20, (1.16, 1.30), "FAIL"),
        (1.12, (1.10, 1.20), "PASS, inside the noise"),
        (1.17, (1.10, 1.20), "FAIL, inside the noise"),
        (1.12, None, "PASS, too few repeats to tell from noise"),
    ],
)
def test_a_verdict_says_when_the_interval_reaches_across_the_target(median, interval, verdict):
    assert scaling.Target("≤ 1.15", high=1.15).verdict(median, interval) == verdict


def test_a_two_sided_target_fails_clearly_only_when_the_whole_interval_misses_it():
    within = scaling.Target("within ±0.5", low=-0.5, high=0.5)
    assert within.verdict(0.6, (0.55, 0.7)) == "FAIL"
    assert within.verdict(0.6, (-0.7, 0.7)) == "FAIL, inside the noise"  # both ends miss, the middle passes
    strict = scaling.Target("> 1", low=1, strict=True)
    assert (
        strict.verdict(1.0, (0.9, 1.0)) == "FAIL"
        and strict.verdict(1.05, (1.0, 1.1)) == "PASS, inside the noise"
    )


def test_the_runs_of_each_judged_pair_run_next_to_each_other():
    args = scaling.parse_args(["--processes", "1,2,4"])
    order = [config.key for config in scaling.all_configs(args)]
    labels = {config.key: label for label, _, config in scaling.reference_configs()}
    assert [labels.get(key) for key in order[:8]] == list("abcdfehg")
    assert len(order) == len(set(order)) == 10  # the 2-process run is (b), once


def saved_benchmark(path, repeats, b_seconds, commit):
    """A runs.json as bench/scaling.py writes it, for 1 and 2 processes and the reference runs."""
    args = scaling.parse_args(["--processes", "1,2", "--repeats", str(repeats), "--dataset", "fashion-mnist"])
    seconds = {label: s for label, s in zip("abcdefgh", (10, b_seconds, 20, 12, 25, 8, 13, 10.5))}
    labels = {config.key: label for label, _, config in scaling.reference_configs()}
    runs = []
    for repeat in range(repeats):
        for config in scaling.all_configs(args):
            train = seconds.get(labels.get(config.key), 15)
            runs.append(
                {
                    "config": config.key,
                    "repeat": repeat,
                    "peak_rss_run_mib": 1000,
                    "other_cpu_cores": 0.01,
                    "metrics": {
                        "train_seconds": train,
                        "samples_per_second": 60000 / train,
                        "epochs": 1,
                        "threads": 1,
                        "allreduce": "shared-memory",
                        "test_accuracy": 0.86,
                        "peak_rss_mib_per_rank": [900],
                    },
                }
            )
    machine = {
        "cpu": "test CPU",
        "usable_cores": 2,
        "logical_cpus": 2,
        "python": "3",
        "torch": "2",
        "torchvision": "0",
        "commit": commit,
        "date": f"date of {commit}",
        "dataset": "fashion-mnist",
        "import_rss_mib": 600,
    }
    path.write_text(json.dumps({"machine": machine, "options": vars(args), "runs": runs}))
    return str(path)


def test_earlier_benchmarks_are_reported_again_and_pooled_without_measuring(tmp_path):
    first = saved_benchmark(tmp_path / "first.json", 2, 11.0, "aaaaaaa")
    second = saved_benchmark(tmp_path / "second.json", 3, 12.0, "bbbbbbb")
    scaling.main(["--from-runs", first, second, "--out-dir", str(tmp_path / "pooled")])
    table = (tmp_path / "pooled" / "scaling.md").read_text()
    assert (
        "commit aaaaaaa, bbbbbbb" in table
        and "median of 5 run(s) per row" in table
        and "2 benchmarks, pooled" in table
    )
    # 5 repeats: 1.1, 1.1, 1.2, 1.2, 1.2 against the floor; the median fails, the interval reaches across 1.15
    assert (
        "| 1.10, 1.10, 1.20, 1.20, 1.20 | 1.200 | 1.10 to 1.20 |" in table
        and "FAIL, inside the noise" in table
    )
    pooled = json.loads((tmp_path / "pooled" / "runs.json").read_text())
    assert sorted({r["repeat"] for r in pooled["runs"]}) == [0, 1, 2, 3, 4]


def test_one_benchmark_reported_again_in_its_own_folder_keeps_its_runs_as_measured(tmp_path):
    measured = saved_benchmark(tmp_path / "runs.json", 1, 11.52, "aaaaaaa")
    before = (tmp_path / "runs.json").read_bytes()
    scaling.main(["--from-runs", measured, "--out-dir", str(tmp_path)])
    assert (tmp_path / "runs.json").read_bytes() == before
    # The judged median to 3 places: 1.152 against "≤ 1.15" fails, and must not read 1.15
    assert (
        "| 1.152 | – | 1.15 | ≤ 1.15 | FAIL, too few repeats to tell from noise |"
        in (tmp_path / "scaling.md").read_text()
    )


def test_benchmarks_of_different_configurations_are_not_pooled(tmp_path):
    first = saved_benchmark(tmp_path / "first.json", 1, 11.0, "aaaaaaa")
    other = json.loads((tmp_path / "first.json").read_text())
    other["options"]["global_batch"] = 256
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="measured different configurations"):
        scaling.main(["--from-runs", first, str(tmp_path / "other.json"), "--out-dir", str(tmp_path / "out")])
