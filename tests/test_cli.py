"""Command lines: the article's spellings, defaults read from the environment, ranks and threads."""

import argparse
import os
import subprocess
import sys

import pytest
import torch

import convnet_distributed
import convnet_distributed_cuda
import convnet_undistributed
from conftest import REPO, free_port, run_script, script_env

ARTICLE_MULTI_MACHINE = "--num_machines=2 --num-processes 8 --machine_id=1 --epochs 1 --batch-size 16".split()


def test_article_multi_machine_flags_parse_in_both_spellings(clean_env):
    """The article's commands use --num_machines and --machine_id, which its own parser rejected."""
    underscore = convnet_distributed.parse_args(ARTICLE_MULTI_MACHINE)
    dashes = convnet_distributed.parse_args([a.replace("_", "-") for a in ARTICLE_MULTI_MACHINE])
    assert vars(underscore) == vars(dashes)
    assert (underscore.num_machines, underscore.machine_id, underscore.num_processes) == (2, 1, 8)
    assert (underscore.first_rank, underscore.world_size, underscore.processes_here) == (8, 16, 8)  # 1 x 8


def test_master_address_and_port_come_from_flags_then_environment(clean_env, monkeypatch):
    """The article hard-coded 127.0.0.1:8892, so its second machine rendezvoused with itself. A job on one
    machine given no port takes a free one as it starts (0 until then: claim_port); across machines 8892."""
    defaults = convnet_distributed.parse_args([])
    assert (defaults.master_addr, defaults.master_port) == ("127.0.0.1", 0)
    across = convnet_distributed.parse_args(["--num-machines", "2"])
    assert (across.master_addr, across.master_port) == ("127.0.0.1", 8892)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29400")
    from_env = convnet_distributed.parse_args([])
    assert (from_env.master_addr, from_env.master_port) == ("10.1.2.3", 29400)
    flags = convnet_distributed.parse_args(["--master-addr", "10.9.9.9", "--master_port=1234"])
    assert (flags.master_addr, flags.master_port) == ("10.9.9.9", 1234)


@pytest.mark.parametrize(
    "argv",
    [
        ["--machine-id", "2", "--num-machines", "2"],
        ["--machine-id", "-1"],
        ["--num-processes", "0"],
        ["--batch-size", "0"],
        ["--master-port", "70000"],
        ["--lr", "0"],
        ["--resume"],
        ["--epochs", "x"],
    ],
)
def test_bad_command_lines_are_usage_errors(clean_env, argv, capsys):
    with pytest.raises(SystemExit) as exit:
        convnet_distributed.parse_args(argv)
    assert exit.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_threads_are_shared_out_between_the_processes_of_a_machine(clean_env, monkeypatch):
    """The article let each of N processes start one thread per core: N-fold oversubscription."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    threads = {
        n: convnet_distributed.parse_args(["--num-processes", str(n)]).threads for n in (1, 2, 4, 8, 16)
    }
    assert threads == {1: 8, 2: 4, 4: 2, 8: 1, 16: 1}
    assert convnet_undistributed.parse_args([]).threads == 8
    assert convnet_distributed.parse_args(["--num-processes", "2", "--threads", "3"]).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert convnet_distributed.parse_args(["--num-processes", "2"]).threads == 5


def test_torchrun_environment_decides_rank_and_world(clean_env, monkeypatch):
    for name, value in dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    args = convnet_distributed.parse_args([])
    assert args.launcher == "torchrun" and args.machine_id == 1  # no GROUP_RANK: rank // local size
    assert (args.rank, args.first_rank, args.world_size, args.processes_here) == (5, 4, 8, 4)
    assert args.threads == 2


def test_cuda_script_uses_every_visible_gpu_by_default(clean_env, monkeypatch):
    """The article's GPU script said the GPU count was detected, but defaulted to 1."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    args = convnet_distributed_cuda.parse_args(["--num-machines", "2", "--machine-id", "1"])
    assert args.num_gpu_processes == 4
    assert args.batch_size == 64
    assert (args.rank, args.first_rank, args.world_size, args.processes_here) == (None, 4, 8, 4)
    assert convnet_distributed_cuda.parse_args(["--num-gpu-processes", "2"]).num_gpu_processes == 2


@pytest.mark.gpu
def test_cuda_script_without_a_gpu_says_so_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_script("convnet_distributed_cuda.py", "--data-dir", tmp_path, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "GPU" in result.stderr and "convnet_distributed.py" in result.stderr
    assert "Traceback" not in result.stderr
    assert not os.listdir(tmp_path)  # nothing started: no download either


@pytest.mark.parametrize("module", [convnet_undistributed, convnet_distributed, convnet_distributed_cuda])
def test_every_flag_has_help_ending_with_its_default(module):
    for action in module.build_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert "(default: " in action.help and action.help.endswith(")"), f"{action.dest}: {action.help}"
        # Dashes first, as --help lists them; a flag of two words takes the article's underscores too.
        dashed = action.option_strings[0]
        assert dashed.startswith("--") and "_" not in dashed
        underscored = "--" + dashed[2:].replace("-", "_")
        assert action.option_strings == ([dashed, underscored] if "-" in dashed[2:] else [dashed])


def test_help_shows_the_launch_commands():
    result = run_script("convnet_distributed.py", "--help", timeout=60, env=script_env())
    assert result.returncode == 0
    assert "--num-machines 2 --machine-id 1" in result.stdout
    assert "torchrun --nproc-per-node" in result.stdout


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--num-processes", "4"], "--num-processes 4 disagrees with torchrun"),
        (["--num-machines", "1"], "--num-machines 1 disagrees"),
        (["--machine-id", "0"], "--machine-id 0 disagrees"),
        (["--master-port", "1234"], "--master-port 1234 disagrees"),
    ],
)
def test_flags_that_disagree_with_torchrun_are_reported(clean_env, monkeypatch, capsys, flags, message):
    """torchrun --nnodes 2 --nproc-per-node 2, node 1: its environment decides; a flag against it is wrong."""
    for name, value in dict(
        RANK="3",
        WORLD_SIZE="4",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="2",
        GROUP_RANK="1",
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="29500",
    ).items():
        monkeypatch.setenv(name, value)
    args = convnet_distributed.parse_args(
        ["--num-processes", "2", "--num-machines", "2", "--machine-id", "1"]
    )
    assert (args.num_processes, args.num_machines, args.machine_id) == (2, 2, 1)
    assert (args.master_addr, args.master_port) == ("10.0.0.1", 29500)
    with pytest.raises(SystemExit) as exit:
        convnet_distributed.parse_args(flags)
    assert exit.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--num-processes", "4"], "--num-processes 4 disagrees with RANK and WORLD_SIZE, which set 1"),
        (["--num-machines", "3"], "--num-machines 3 disagrees with RANK and WORLD_SIZE, which set 2"),
        (["--machine-id", "0"], "--machine-id 0 disagrees with RANK and WORLD_SIZE, which set 1"),
    ],
)
def test_rank_and_world_size_without_local_rank_make_one_process_per_launch(
    clean_env, monkeypatch, capsys, flags, message
):
    """Kubeflow's PyTorchJob sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each pod, no LOCAL_RANK."""
    for name, value in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    args = convnet_distributed.parse_args([])
    assert (args.num_processes, args.num_machines, args.machine_id) == (1, 2, 1)
    assert (args.master_addr, args.master_port) == ("10.0.0.1", 29500)
    assert (args.rank, args.first_rank, args.world_size, args.processes_here) == (1, 1, 2, 1)
    assert args.launcher == "RANK and WORLD_SIZE"
    assert convnet_distributed.parse_args(["--num-processes", "1", "--machine-id", "1"]).num_machines == 2
    with pytest.raises(SystemExit) as exit:
        convnet_distributed.parse_args(flags)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and message in err and "unset RANK and WORLD_SIZE" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("module", [convnet_undistributed, convnet_distributed, convnet_distributed_cuda])
def test_an_empty_environment_variable_is_unset(clean_env, monkeypatch, module):
    """`MASTER_PORT=` was an error, an empty OMP_NUM_THREADS ignored: now every empty variable is unset."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    for name in ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME", "SLURM_CPUS_PER_TASK"):  # fmt: skip
        monkeypatch.setenv(name, "")
    args = module.parse_args([])
    assert args.threads == 4
    if module is not convnet_undistributed:
        assert (args.master_addr, args.master_port, args.machine_id, args.num_machines) == (
            "127.0.0.1",
            0,
            0,
            1,
        )
        assert args.launcher is None and args.rank is None


def test_master_port_empty_in_a_launch_is_the_default_not_an_error():
    parsed = subprocess.run(
        [sys.executable, "-c", "import convnet_distributed as c; print(c.parse_args([]).master_port)"],
        cwd=REPO, env=script_env(MASTER_PORT=""), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert parsed.returncode == 0 and parsed.stdout.strip() == "0", (
        parsed.stderr
    )  # 0: a free port, at the start


def test_default_threads_honour_slurm_cpus_per_task(clean_env, monkeypatch):
    """Under SLURM's task/none nothing pins a task to its cores: each process took every core of the node."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    assert convnet_undistributed.parse_args([]).threads == 4
    assert convnet_distributed.parse_args(["--num-processes", "2"]).threads == 2
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "64")  # more than this machine has: the cores it has
    assert convnet_distributed.parse_args([]).threads == 16


@pytest.mark.parametrize("module", [convnet_undistributed, convnet_distributed, convnet_distributed_cuda])
def test_omp_num_threads_as_a_list_per_nesting_level_gives_the_outer_count(clean_env, monkeypatch, module):
    """OMP_NUM_THREADS=4,2 is valid OpenMP (4 threads, each nested region 2): it was a traceback."""
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")
    assert module.parse_args([]).threads == 4


def test_omp_num_threads_as_a_list_lets_a_run_start(tmp_path):
    result = run_script("convnet_distributed.py", "--check", "--master-port", free_port(),
                        "--data-dir", tmp_path, env=script_env(OMP_NUM_THREADS="4,2"),
                        timeout=60)  # fmt: skip
    assert result.returncode == 0 and "Check passed" in result.stdout, result.stderr


@pytest.mark.parametrize(
    "script,value", [("convnet_undistributed.py", "0"), ("convnet_distributed.py", "many")]
)
def test_omp_num_threads_that_is_no_count_is_one_line_naming_it(tmp_path, script, value):
    """A traceback of int() or positive_int once; now the parser's one line, naming the variable and the fix.
    (libgomp, loaded with torch, may say "Invalid value" on a line of its own before it.)"""
    result = run_script(script, "--data-dir", tmp_path, env=script_env(OMP_NUM_THREADS=value), timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    ours = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(ours) == 1 and f"OMP_NUM_THREADS={value!r} in the environment" in ours[0], result.stderr
    assert "pass --threads" in ours[0] and result.stderr.splitlines()[-1] == ours[0]
    assert not os.listdir(tmp_path)  # nothing started: no download
