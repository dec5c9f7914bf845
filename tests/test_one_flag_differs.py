"""One job, one decision: two machines whose commands differ in one flag, as users' commands do.

Users give the file flags to machine 0 alone, and add a flag on one machine and not the other. Every option of
build_parser() is walked, so that a new flag is covered as it is added: machine 1 differs from machine 0 in
that flag alone, and the job either trains as one group, with the files written where machine 0 asked, or
every launch stops within seconds with one line naming the flag, and nothing is left running. The script's
own classification says which (JOB_FLAGS must agree, RANK0_FLAGS are rank 0's, MACHINE_FLAGS each machine's).
"""

import argparse
import shutil
import time

import pytest

import convnet_distributed
import convnet_distributed_cuda
from conftest import finish, free_port, launch, read_json, write_dataset
from test_faults import left_running

TIMEOUT = 60  # each launch's --timeout: a mistake must be named long before it
WITHIN = 30  # seconds from the start to the last exit of a job that must stop (start-up included)
N_TRAIN, N_TEST = (
    512,
    100,
)  # 4 steps an epoch per machine: the group and the files are the point, not accuracy
# Where the outcome is not the class's: machine 1 pointed at another port waits for an absent machine 0, so
# both launches wait --timeout (short here) and name the flag; machine 1 without --machine-id claims rank 0.
SPECIAL = {"master_port": ("stops", "--master-port"), "machine_id": ("stops", "--machine-id")}


def options(module):
    return [a for a in module.build_parser()._actions if not isinstance(a, argparse._HelpAction)]


def another_value(action, tmp_path, common):
    """What machine 1 adds to the common command: the flag, or another value of it."""
    flag = action.option_strings[0]
    given = dict(zip(common[::2], common[1::2])).get(flag)
    if action.nargs == 0:  # store_true: added on machine 1 alone
        return [flag]
    if action.choices:
        return [flag, next(c for c in action.choices if c != action.default)]
    if action.dest == "data_dir":  # the same data in another folder: each machine reads its own
        return [flag, shutil.copytree(tmp_path / "data", tmp_path / "data1")]
    if action.dest == "master_addr":
        return [flag, "127.0.0.2"]  # another address of this host (all of 127/8 is loopback)
    if action.dest == "master_port":
        return [flag, free_port()]
    if action.dest == "machine_id":
        return [flag, 0]
    if action.dest in ("checkpoint", "metrics_json"):  # a path machine 0 lacks, in a folder no one can write
        return [flag, tmp_path / "nowhere" / "machine1.out"]
    value = action.default if given is None else given
    if action.type is convnet_distributed.positive_float:
        return [flag, (value or 1) / 2]
    return [flag, (value or 1) + 1]


def expected(module, dest):
    if dest in SPECIAL:
        return SPECIAL[dest]
    if dest in module.JOB_FLAGS:
        return "stops", "error: the machines disagree on "
    if dest in module.RANK0_FLAGS or dest in module.MACHINE_FLAGS:
        return "trains", None
    raise AssertionError(f"{dest}: add it to JOB_FLAGS, RANK0_FLAGS or MACHINE_FLAGS in both scripts")


@pytest.mark.parametrize("module", [convnet_distributed, convnet_distributed_cuda])
def test_every_flag_is_classified(module):
    """A flag in none of the classes would be neither compared nor taken from rank 0: say which it is."""
    for action in options(module):
        expected(module, action.dest)
    assert not set(module.RANK0_FLAGS) & (set(module.JOB_FLAGS) | set(module.MACHINE_FLAGS))


@pytest.mark.timeout(TIMEOUT + 2 * WITHIN)
@pytest.mark.parametrize("flag", [a.option_strings[0] for a in options(convnet_distributed)])
def test_machine_1_differs_in_one_flag(tmp_path, flag):
    """Machine 0 alone has the metrics and checkpoint flags, and writes both; machine 1 differs in flag."""
    action = next(a for a in options(convnet_distributed) if a.option_strings[0] == flag)
    for folder in ("MNIST", "FashionMNIST"):
        write_dataset(str(tmp_path / "data"), folder=folder, n_train=N_TRAIN, n_test=N_TEST)
    port, timeout = free_port(), 8 if action.dest == "master_port" else TIMEOUT
    common = ["--data-dir", tmp_path / "data", "--num-machines", 2, "--num-processes", 1, "--batch-size", 64,
              "--master-port", port, "--timeout", timeout, "--threads", 1,
              "--log-interval", 1000]  # fmt: skip
    extra = another_value(action, tmp_path, common)
    outcome, phrase = expected(convnet_distributed, action.dest)
    files = ["--metrics-json", tmp_path / "m.json", "--checkpoint", tmp_path / "ck.pt"]
    start = time.monotonic()
    procs = [
        launch("convnet_distributed.py", *common, "--machine-id", 0, *files, cwd=tmp_path),
        launch("convnet_distributed.py", *common, "--machine-id", 1, *extra, cwd=tmp_path),
    ]
    results = [finish(p, timeout=TIMEOUT + WITHIN) for p in procs]
    seconds = time.monotonic() - start
    assert all(left_running(p.pid) == [] for p in procs)
    said = "\n".join(f"machine {m}: exit {r.returncode}\n{r.stdout}{r.stderr}" for m, r in enumerate(results))
    if outcome == "trains":
        assert [r.returncode for r in results] == [0, 0], said
        metrics = read_json(tmp_path / "m.json")
        assert (
            metrics["world_size"] == 2
            and metrics["test_samples"] == N_TEST
            and metrics["epochs_trained"] == 1
        )
        assert (tmp_path / "ck.pt").exists() and not (tmp_path / "nowhere").exists()
        assert "Finished training in" in results[0].stdout and results[1].stdout == "", said
        assert results[0].stderr == "", said
        if action.dest in convnet_distributed.RANK0_FLAGS:  # machine 1's own is named as unused, in one line
            (line,) = results[1].stderr.strip().splitlines()
            assert (
                line.startswith("warning: machine 1: ") and f"{flag}" in line and "not used here" in line
            ), said
        else:
            assert results[1].stderr == "", said
        return
    for r in results:
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), said
        assert phrase in lines[0] and flag in lines[0], said
        assert "epoch" not in r.stdout, said
    assert not (tmp_path / "m.json").exists()
    assert seconds < WITHIN, f"{seconds:.1f} s\n{said}"
