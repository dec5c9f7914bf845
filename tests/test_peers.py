"""bench/compare.py, this project against the baseline and the peers, on the small generated data: every run
gets its four timings, and the report judges the targets within each repeat."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, script_env

sys.path.insert(0, os.path.join(REPO, "bench"))
import compare  # noqa: E402

LIGHTNING = importlib.util.find_spec("lightning") is not None
NO_LIGHTNING = (
    "lightning is not installed (pip install -r requirements-dev.txt): the Lightning peers were not run"
)
# The module's one comparison (a minute) is made once: its tests stay on one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("peers")
PEERS = ["tutorial-ddp", *(compare.NEEDS_LIGHTNING if LIGHTNING else ())]


@pytest.fixture(scope="module")
def comparison(data_dir, tmp_path_factory):
    """One repeat of every run on the same small data: (runs.json, compare.md's text)."""
    out = tmp_path_factory.mktemp("compare")
    script = os.path.join(REPO, "bench", "compare.py")
    flags = ["--dataset", "mnist", "--repeats", "1", "--epochs", "1", "--timeout", "240"]
    cmd = [sys.executable, script, *flags, "--data-dir", data_dir, "--out", str(out), "--peers", *PEERS]
    done = subprocess.run(cmd, capture_output=True, text=True, env=script_env(), timeout=540)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    return json.loads((out / "runs.json").read_text()), (out / "compare.md").read_text()


@pytest.mark.timeout(600)
def test_every_run_gets_four_timings_and_learns(comparison):
    saved, table = comparison
    runs = {r["config"]: r for r in saved["runs"]}
    assert sorted(runs) == sorted(["distributed", "baseline", *PEERS]) and len(saved["runs"]) == len(runs)
    for name, r in runs.items():
        # Launch, first step, last line, exit: in that order, and the loop fits inside the run.
        assert 0 < r["first_step_seconds"] < r["last_line_seconds"] <= r["wall_seconds"], name
        assert 0 < r["train_seconds"] < r["wall_seconds"] and r["exit_seconds"] >= 0, name
        assert r["wall_seconds"] == pytest.approx(r["last_line_seconds"] + r["exit_seconds"]), name
        assert 0.3 < r["test_accuracy"] <= 1, name  # the fixture's 10 classes are learnable: far above chance
        assert r["world_size"] == (1 if name == "baseline" else 2), name
        assert r["peak_rss_run_mib"] > 100 and not r["left_processes_behind"], name
    assert "| run | wall (s) | first step (s) | loop (s) | exit (s) |" in table
    assert all(f"| {name}: " in table for name in runs)
    assert table.count("too few repeats to tell from noise") == 3 + len(
        PEERS
    )  # every target judged, 1 repeat


@pytest.mark.skipif(not LIGHTNING, reason=NO_LIGHTNING)
def test_the_lightning_peers_ran_with_both_strategies(comparison):
    runs = {r["config"]: r for r in comparison[0]["runs"]}
    assert {runs[name]["metrics"]["strategy"] for name in compare.NEEDS_LIGHTNING} == {"ddp", "ddp_spawn"}
    # Lightning shares the cores out between its processes, as torchrun does.
    assert all(
        runs[name]["threads"] == max(1, len(os.sched_getaffinity(0)) // 2) for name in compare.NEEDS_LIGHTNING
    )


def test_lines_are_timed_on_arrival_and_the_exit_after_the_last_one():
    code = (
        "import time; print('starting', flush=True); time.sleep(0.3); "
        "print('epoch: 0 [0/1 (0%)]', flush=True); time.sleep(0.4); "
        "print('last', flush=True); time.sleep(0.6)"
    )
    run = compare.TimedRun([sys.executable, "-c", code], timeout=60)
    assert run.returncode == 0 and [line for _, _, line in run.lines] == [
        "starting",
        "epoch: 0 [0/1 (0%)]",
        "last",
    ]
    first, step, last = (t for t, _, _ in run.lines)
    assert step - first == pytest.approx(0.3, abs=0.15) and last - step == pytest.approx(0.4, abs=0.15)
    assert run.first(compare.FIRST_STEP) == step and run.exit_at - last == pytest.approx(0.6, abs=0.15)


def test_a_run_past_its_timeout_is_killed_with_its_children():
    child = "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    code = f"import subprocess, sys, time; {child}; time.sleep(60)"
    run = compare.TimedRun([sys.executable, "-c", code], timeout=1)
    assert run.timed_out and run.returncode == -9 and run.exit_at < 10
    deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously
    while compare.live_members(run.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert compare.live_members(run.proc.pid) == []


def test_the_checks_are_taken_within_each_repeat():
    """A slow second repeat moves both runs of a pair alike: the judged ratio stays that of its own repeat."""
    timings = {"distributed": (17, 5, 1.0), "baseline": (20, 4.5, 0.9), "tutorial-ddp": (34, 9, 2.0)}
    records = [
        dict(
            config=name,
            repeat=repeat,
            wall_seconds=wall * slow,
            first_step_seconds=first * slow,
            exit_seconds=exit_,
        )
        for repeat, slow in enumerate([1.0, 1.5, 1.0, 1.0, 1.0])
        for name, (wall, first, exit_) in timings.items()
    ]
    for record in records:
        record["train_seconds"] = record["wall_seconds"] / 2
    rows = {check: rest for check, *rest in compare.checks(records, ["tutorial-ddp"])}
    values, median, interval, target, verdict = rows["distributed wall ÷ baseline wall"]
    assert values == pytest.approx([0.85] * 5) and median == pytest.approx(0.85) and verdict == "PASS"
    assert interval == pytest.approx((0.85, 0.85)) and target == "≤ 0.90"
    assert rows["distributed first step − baseline first step (s)"][1] == pytest.approx(0.5)
    assert rows["distributed exit − baseline exit (s)"][1] == pytest.approx(0.1)
    median, interval, target, verdict = rows["tutorial-ddp wall ÷ distributed wall"][1:]
    assert (median, interval, target, verdict) == (
        pytest.approx(2.0),
        pytest.approx((2.0, 2.0)),
        "≥ 1.8",
        "PASS",
    )
