"""bench/scaling.py, the benchmark a user runs, on the small generated data: it writes its tables, plot and runs."""
import json
import os
import platform
import subprocess
import sys

import pytest

from conftest import N_TRAIN, REPO, script_env

sys.path.insert(0, os.path.join(REPO, "bench"))
import scaling  # noqa: E402


@pytest.mark.timeout(900)
def test_scaling_benchmark_writes_table_plot_and_runs(data_dir, tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, os.path.join(REPO, "bench", "scaling.py"), "--dataset", "mnist", "--data-dir", data_dir,
           "--processes", "1,2", "--repeats", "1", "--out-dir", str(out), "--timeout", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=script_env(), timeout=800)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (out / "scaling.md").read_text()
    assert "| processes | threads per process | train loop (s) |" in table
    assert f"{N_TRAIN:,} training images" in table and "Reference runs" in table
    assert table.count("PASS") + table.count("FAIL") == 7  # every target judged
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = json.loads((out / "runs.json").read_text())["runs"]
    assert len(runs) == 9  # 1 and 2 processes, then the reference runs (a)-(h), (b) being the 2-process run
    for run in runs:
        m = run["metrics"]
        assert 0 < m["train_seconds"] < 300 and m["samples_per_second"] > 0, run["config"]
        # torch alone is a few hundred MiB; the whole run's peak, exit included, is at least a rank's while it worked
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
        for label, seconds in {"a": 10, "b": 11, "c": 20, "d": 12, "e": 25, "f": 8, "g": 13, "h": 10.5}.items():
            extra = 3 if (repeat, label) == (2, "b") else 0  # one disturbed run
            records.append({"config": keys[label], "repeat": repeat, "peak_rss_run_mib": 1000,
                            "metrics": {"train_seconds": seconds * slow + extra, "test_accuracy": 0.86,
                                        "peak_rss_mib_per_rank": [900, 950]}})
    rows = {check.split(":")[0]: rest for check, *rest in scaling.targets(records)}
    values, median, from_medians, target, passed = rows["(b) / (a)"]
    assert values == pytest.approx([1.1, 1.1, 1.4]) and median == pytest.approx(1.1) and passed
    assert from_medians == pytest.approx(14 / 10)  # medians of b (11, 16.5, 14) and a (10, 15, 10)
    assert rows["(d) / (f)"][1] == pytest.approx(1.5) and rows["(d) / (f)"][4]
    assert rows["(f) − (d)"][1] == 0 and rows["(f) − (d)"][4]
    assert rows["(b) / (e)"][1] == pytest.approx(1.0) and rows["(b) / (e)"][4]  # a rank's largest peak
    assert rows["(b) / (e), exit included"][1] == pytest.approx(1.0) and rows["(b) / (e), exit included"][4] is None
    assert rows["(h) / (a)"][4] is None  # a measurement, not a target


def test_the_runs_of_each_judged_pair_run_next_to_each_other():
    args = scaling.parse_args(["--processes", "1,2,4"])
    order = [config.key for config in scaling.all_configs(args)]
    labels = {config.key: label for label, _, config in scaling.reference_configs()}
    assert [labels.get(key) for key in order[:8]] == list("abcdfehg")
    assert len(order) == len(set(order)) == 10  # the 2-process run is (b), once
