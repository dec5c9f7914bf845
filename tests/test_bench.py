"""bench/scaling.py, the benchmark a user runs, on the small generated data: it writes its tables, plot and runs."""
import json
import os
import platform
import subprocess
import sys

import pytest

from conftest import N_TRAIN, REPO, script_env


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
        assert 100 < max(run["peak_rss_per_rank_mib"]) < 8192, run["config"]  # torch alone is a few hundred MiB
        if "test_accuracy" in m:  # the floor does not evaluate
            assert 0.5 < m["test_accuracy"] <= 1, run["config"]  # the fixture's classes are learnable
    two = next(r for r in runs if "--num-processes 2 --batch-size 64" in r["config"])
    assert len(two["peak_rss_per_rank_mib"]) == 2 and two["metrics"]["world_size"] == 2
    assert two["metrics"]["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    gloo = next(r for r in runs if "--allreduce gloo" in r["config"])
    copies = next(r for r in runs if "--copies 2" in r["config"])["metrics"]
    assert len(copies["copy_seconds"]) == 2 and copies["train_seconds"] == max(copies["copy_seconds"])
    shared = "shared-memory" if platform.machine() in ("x86_64", "AMD64") else "gloo"  # the script's rule
    assert (two["metrics"]["allreduce"], gloo["metrics"]["allreduce"]) == (shared, "gloo")
