"""Every way a cluster starts a job, read from one table (LAUNCHERS), and a rendezvous that knows who is who.

The first tests set each launcher's variables as it sets them and check the layout that parse_args()
makes of them; the launchers themselves run in tests/test_slurm.py (srun), here (mpirun) and
tests/test_multihost.py (elastic torchrun). The last tests start real launches on this host that cannot make
one job, and check that each ends within seconds with one line naming the mistake, and nothing left running.
"""

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import convnet_distributed
import convnet_distributed_cuda
from conftest import N_TEST, REPO, finish, free_port, launch, read_json, script_env, write_dataset
from test_faults import job, left_running

SCRIPTS = [convnet_distributed, convnet_distributed_cuda]


def layout(module, monkeypatch, env, argv=()):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    args = module.parse_args(list(argv))
    processes = args.num_gpu_processes if module is convnet_distributed_cuda else args.num_processes
    return args, processes


# srun --nodes 2 --ntasks-per-node 2: task 3 is the second task of the second node.
SRUN_2X2 = dict(SLURM_JOB_ID="4711", SLURM_STEP_ID="0", SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NODEID="1",
                SLURM_STEP_NUM_TASKS="4", SLURM_STEP_NUM_NODES="2", SLURM_STEP_TASKS_PER_NODE="2(x2)",
                SLURM_NTASKS="4", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[07-08]")  # fmt: skip


@pytest.mark.parametrize("module", SCRIPTS)
def test_srun_with_two_tasks_per_node_makes_each_task_one_rank(clean_env, monkeypatch, module):
    """Each task trained alone: four unrelated runs. The GPU script gives each task cuda:SLURM_LOCALID."""
    args, processes = layout(module, monkeypatch, SRUN_2X2)
    assert (args.launcher, args.rank, args.local_rank, args.world_size) == ("SLURM", 3, 1, 4)
    assert (args.num_machines, args.machine_id, processes) == (2, 1, 2)
    assert (args.master_addr, args.master_port) == (
        "node07",
        15000 + (4711 * 97 + 0) % 17000,
    )  # job 4711, step 0
    assert (args.first_rank, args.processes_here) == (2, 2)  # task 3 = 2 + local rank 1
    assert args.launch_note == "SLURM: 4 tasks on 2 nodes"
    assert args.threads == 4  # the 8 cores of this node shared by its 2 tasks
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    args, _ = layout(module, monkeypatch, {})
    assert (args.master_addr, args.master_port) == ("10.0.0.7", 29500)


@pytest.mark.parametrize("module", SCRIPTS)
def test_srun_steps_side_by_side_each_meet_on_their_own_first_node_and_port(clean_env, monkeypatch, module):
    """A sweep's steps in one allocation (srun -N1 -n2 -r1 ... &): machine 0 was the job's first node, and the
    port the job's, so a step on node08 went to node07's step. Now each step meets on its own first node and
    port; a given --master-port or --master-addr is used (SLURM sets neither: the script derives them)."""
    step1 = dict(SRUN_2X2, SLURM_STEP_ID="1", SLURM_STEP_NODELIST="node08", SLURM_STEP_NUM_NODES="1",
                 SLURM_NODEID="0", SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="2",
                 SLURM_STEP_TASKS_PER_NODE="2")  # fmt: skip
    args, _ = layout(module, monkeypatch, dict(step1, SLURM_STEP_ID="0", SLURM_STEP_NODELIST="node07"))
    step0 = (args.master_addr, args.master_port)
    args, _ = layout(module, monkeypatch, step1)
    assert (args.master_addr, args.num_machines, args.world_size) == ("node08", 1, 2)
    assert step0[0] == "node07" and args.master_port != step0[1]
    assert args.launch_id == "4711/1"  # steps are launches of their own: each its own roll call
    ports = {layout(module, monkeypatch, dict(step1, SLURM_STEP_ID=str(s)))[0].master_port for s in range(50)}
    ports |= {
        layout(module, monkeypatch, dict(step1, SLURM_JOB_ID="4712", SLURM_STEP_ID=str(s)))[0].master_port
        for s in range(50)
    }
    assert len(ports) == 100 and all(15000 <= p < 32768 for p in ports)  # below Linux's ephemeral ports
    args, _ = layout(module, monkeypatch, step1, ["--master-port", "29500", "--master-addr", "10.0.0.9"])
    assert (args.master_addr, args.master_port) == ("10.0.0.9", 29500)


def test_a_flag_that_disagrees_with_torchrun_is_refused(clean_env, monkeypatch, capsys):
    """torchrun serves its store at the MASTER_ADDR:MASTER_PORT it set: another --master-port cannot work."""
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29400")  # fmt: skip
    with pytest.raises(SystemExit) as exit:
        layout(convnet_distributed, monkeypatch, env, ["--master-port", "29500"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "--master-port 29500 disagrees with torchrun, which set 29400" in err, err


def test_srun_gpus_per_task_gives_each_task_its_gpu(clean_env, monkeypatch):
    """srun --ntasks-per-node 2 --gpus-per-task 1: each task sees one GPU, its own, as cuda:0. main() stopped
    with 'only 1 GPU(s) visible' (tasks per node taken for GPUs wanted); now each task trains on its GPU."""
    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(convnet_distributed_cuda, "raise_on_signals", lambda ctrl_c: None)
    monkeypatch.setattr(
        convnet_distributed_cuda, "worker", lambda local_rank, args, data: ran.append(local_rank)
    )
    args, processes = layout(convnet_distributed_cuda, monkeypatch, SRUN_2X2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    convnet_distributed_cuda.main([])
    assert ran == [1] and processes == 2  # the task's local rank; select_device takes cuda:1 % 1 = cuda:0


def test_srun_with_uneven_tasks_per_node(clean_env, monkeypatch):
    """--ntasks 3 on 2 nodes: node 1 holds one task, the third of the job."""
    env = dict(SRUN_2X2, SLURM_PROCID="2", SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS="3",
               SLURM_STEP_TASKS_PER_NODE="2,1")  # fmt: skip
    args, processes = layout(convnet_distributed, monkeypatch, env)
    assert (args.rank, args.world_size, args.machine_id, args.num_machines, processes) == (2, 3, 1, 2, 1)


def test_srun_with_one_task_per_node_runs_the_scripts_own_launcher(clean_env, monkeypatch, capsys):
    """The SLURM recipe (docs/launching.md) without --num-machines and --machine-id: SLURM gives both."""
    env = dict(
        SRUN_2X2,
        SLURM_PROCID="1",
        SLURM_LOCALID="0",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
    )
    args, _ = layout(convnet_distributed, monkeypatch, env, ["--num-processes", "4"])
    assert (args.launcher, args.rank, args.num_machines, args.machine_id, args.num_processes) == (
        "SLURM",
        None,
        2,
        1,
        4,
    )
    assert (args.first_rank, args.world_size, args.processes_here, args.threads) == (4, 8, 4, 2)
    assert args.launch_note == "SLURM: 2 nodes, one task each"
    args, _ = layout(
        convnet_distributed, monkeypatch, {}, ["--num-machines", "2", "--machine-id", "1"]
    )  # explicit
    assert (args.num_machines, args.machine_id) == (2, 1)
    with pytest.raises(SystemExit) as exit:
        layout(convnet_distributed, monkeypatch, {}, ["--machine-id", "0"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "--machine-id 0 disagrees with SLURM, which set 1" in err, err


def test_a_shell_inside_an_allocation_is_not_a_slurm_launch(clean_env, monkeypatch):
    """salloc, then python outside srun: the job's variables, no step's. One process, as on any machine."""
    env = {
        k: v for k, v in SRUN_2X2.items() if not k.startswith(("SLURM_STEP", "SLURM_PROCID", "SLURM_LOCALID"))
    }
    args, processes = layout(convnet_distributed, monkeypatch, env)
    assert (args.launcher, args.rank, args.num_machines, args.machine_id, processes) == (None, None, 1, 0, 1)


@pytest.mark.parametrize(
    "env",
    [
        dict(OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="1",
             OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_MCA_orte_hnp_uri="12.0;tcp://10.0.0.1:4000"),
        dict(PMI_RANK="3", PMI_SIZE="4", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="2"),  # MPICH, Intel MPI
        dict(MV2_COMM_WORLD_RANK="3", MV2_COMM_WORLD_SIZE="4", MV2_COMM_WORLD_LOCAL_RANK="1",
             MV2_COMM_WORLD_LOCAL_SIZE="2"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("module", SCRIPTS)
def test_mpi_ranks_are_one_group(clean_env, monkeypatch, capsys, module, env):
    """Each MPI rank trained alone. Across machines machine 0's address must be given; on one, loopback."""
    args, processes = layout(module, monkeypatch, dict(env, MASTER_ADDR="node0"))
    assert (args.rank, args.local_rank, args.world_size, args.num_machines, args.machine_id, processes) == (
        3, 1, 4, 2, 1, 2)  # fmt: skip
    assert (
        args.master_addr == "node0"
        and args.launch_note.startswith("mpirun, ")
        and "4 ranks" in args.launch_note
    )
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(SystemExit) as exit:
        layout(module, monkeypatch, {})
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "runs this job on 2 machines: give machine 0's address as --master-addr or MASTER_ADDR" in err
    assert layout(module, monkeypatch, {}, ["--master-addr", "10.0.0.1"])[0].master_addr == "10.0.0.1"
    one_machine = {
        name: value.replace("3", "1").replace("4", "2") for name, value in env.items()
    }  # 2 ranks, both here
    args, processes = layout(module, monkeypatch, one_machine)
    assert (args.master_addr, args.num_machines, args.machine_id, processes) == ("127.0.0.1", 1, 0, 2)


@pytest.mark.parametrize("module", SCRIPTS)
def test_open_mpi_5_launches_are_told_apart(clean_env, monkeypatch, module):
    """Open MPI 5 sets no OMPI_MCA_orte_hnp_uri: two mpirun jobs on one port, with the same flags, had no
    launch id and met as 'rank joined twice'. PMIx's namespace, set by Open MPI 4 and 5, names each mpirun."""
    env = dict(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1",
               OMPI_COMM_WORLD_LOCAL_SIZE="2", PMIX_NAMESPACE="prterun-vm-4242@1")  # fmt: skip
    args, _ = layout(module, monkeypatch, env)
    assert args.launch_id == "prterun-vm-4242@1"
    args, _ = layout(module, monkeypatch, dict(PMIX_NAMESPACE="prterun-vm-4343@1"))
    assert args.launch_id == "prterun-vm-4343@1"


@pytest.mark.parametrize(
    "hosts, sizes, line",
    [
        (["a", "a", "b"], [2, 1], "World size 3 = 2 machines (2 + 1 processes);"),  # -np 3 -H a:2,b:1
        (["a", "b", "a", "b"], [2, 2], "World size 4 = 2 machines x 2 processes;"),  # --map-by node
        (["a", "a", "a", "b"], [3, 1], "World size 4 = 2 machines (3 + 1 processes);"),  # SLURM tasks 3,1
    ],
)
def test_the_roll_call_counts_machines_by_host_under_mpi(clean_env, monkeypatch, hosts, sizes, line):
    """The machine index was rank // local size: under uneven or round-robin placement ranks disagreed on the
    number of machines, or two claimed machine 0. Now rank 0 numbers the machines by host, in the order of
    their first rank, and the first line counts them."""
    env = dict(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE=str(len(hosts)), OMPI_COMM_WORLD_LOCAL_RANK="0",
               OMPI_COMM_WORLD_LOCAL_SIZE=str(sizes[0]), MASTER_ADDR="a")  # fmt: skip
    args, _ = layout(convnet_distributed, monkeypatch, env)
    records = [
        {"rank": r, "host": h, "box": f"{h} boot", "machine": 0, "script": "same", "address": f"10.0.0.{r}"}
        for r, h in enumerate(hosts)
    ]
    machine_of, addresses = convnet_distributed.count_machines(records, args)
    assert machine_of == [sorted(set(hosts)).index(h) for h in hosts]
    assert addresses == [f"10.0.0.{hosts.index(h)}" for h in sorted(set(hosts))]  # its first rank's
    args.machine_sizes = [machine_of.count(m) for m in range(max(machine_of) + 1)]
    assert args.machine_sizes == sizes
    assert convnet_distributed.layout_line(len(hosts), args, "gloo").startswith(line)


def test_two_hosts_of_one_name_are_two_machines_under_mpi(clean_env, monkeypatch):
    """Under MPI the machines were told apart by host name alone: two hosts named alike (containers, cloned
    VMs) counted as one, and their ranks averaged their gradients in a /dev/shm neither shared. The kernel's
    boot and the network namespace tell them apart."""
    env = dict(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="0",
               OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_ADDR="a")  # fmt: skip
    args, _ = layout(convnet_distributed, monkeypatch, env)
    mine = convnet_distributed.roll_call_record(0, 4, args)["box"]
    assert mine.startswith(f"{socket.gethostname()} ") and "net:[" in mine
    boxes = [mine, mine, mine.replace("net:[", "net:[9"), mine.replace("net:[", "net:[9")]
    records = [
        {"rank": r, "host": "node", "box": b, "machine": 0, "script": "same", "address": f"10.0.0.{r}"}
        for r, b in enumerate(boxes)
    ]
    assert convnet_distributed.count_machines(records, args) == ([0, 0, 1, 1], ["10.0.0.0", "10.0.0.2"])


# Open MPI's rank 1 of 4 on node1 under `mpirun -H node0:2,node1:2 --map-by node`: its guessed machine,
# rank // local size, is 0.
MAP_BY_NODE = dict(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="0",
                   OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_ADDR="node0", PMIX_NAMESPACE="4242")  # fmt: skip


def test_under_mpi_only_rank_0s_machine_names_the_checkpoint_on_a_stop(
    clean_env, monkeypatch, capsys, tmp_path
):
    """Under mpirun --map-by node, host node1 (rank 1, local rank 0) took itself for machine 0, and its stop
    line said nothing was saved to a checkpoint that rank 0 alone writes, on node0."""
    monkeypatch.setattr(convnet_distributed, "raise_on_signals", lambda ctrl_c: None)
    for rank, said in (
        ("1", ""),
        ("0", f"; no epoch completed, so nothing was saved to {tmp_path / 'ck.pt'}"),
    ):
        env = dict(MAP_BY_NODE, OMPI_COMM_WORLD_RANK=rank)
        args, _ = layout(convnet_distributed, monkeypatch, env, ["--checkpoint", str(tmp_path / "ck.pt")])
        with pytest.raises(SystemExit), convnet_distributed.exit_on_signal(args):
            raise SystemExit(143)
        assert (
            capsys.readouterr().err == f"Terminated (SIGTERM): every process of this launch stopped{said}\n"
        )


def test_a_port_taken_is_named_by_its_cause_and_no_port_is_offered_only_where_it_means_a_free_one(
    clean_env, monkeypatch
):
    """'another program holds the port' was said for every error, and 'or none for a free one' offered under
    launchers too, where no port means 8892 or SLURM's. By hand on one machine, none: a free one."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        lines = []
        for env in (
            {},
            dict(MAP_BY_NODE, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2", MASTER_ADDR=""),
        ):
            with monkeypatch.context() as patch:
                args, _ = layout(convnet_distributed, patch, env, ["--master-port", str(port)])
                with pytest.raises(SystemExit) as exit:
                    convnet_distributed.claim_port(args)
                lines.append(exit.value.code)
    held = (
        f"error: cannot serve the rendezvous on 127.0.0.1:{port} (Address already in use): another program "
    )
    assert lines == [
        f"{held}holds the port: choose a free --master-port, or none for a free one",
        f"{held}holds the port: choose a free --master-port",  # Open MPI: no port would be 8892
    ]
    if not shutil.which("setpriv"):
        pytest.skip("needs setpriv (util-linux) to take the capability to serve port 80 away")
    script = os.path.join(REPO, "convnet_distributed.py")
    result = subprocess.run(  # a user who may not serve a port below 1024: root without that capability
        ["setpriv", "--bounding-set", "-net_bind_service", sys.executable, script, "--master-port", "80",
         "--check"], capture_output=True, text=True, timeout=60, env=script_env(),
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (1, (
        "error: cannot serve the rendezvous on 127.0.0.1:80 (Permission denied): only root may serve it: "
        "choose a free --master-port, or none for a free one\n"
    ))  # fmt: skip


@pytest.mark.parametrize(
    "env, argv, fix",
    [
        ({}, ["--num-machines", "2"], "start every machine (--num-machines 2) with one --master-addr and "),
        ({}, ["--num-processes", "2"], "this machine started them too slowly: raise --timeout"),
        (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2"), [],
         "the launcher (torchrun) started them all: see its output for the others"),
        (dict(MAP_BY_NODE, OMPI_COMM_WORLD_RANK="0", MASTER_ADDR="127.0.0.1"), [],
         "the launcher (Open MPI) started them all: see its output for the others"),
    ],
)  # fmt: skip
def test_the_roll_calls_timeout_says_what_to_do_for_each_way_of_starting(
    clean_env, monkeypatch, env, argv, fix
):
    """It told torchrun and mpirun users, and one-machine jobs, to "start every machine"."""
    args, _ = layout(convnet_distributed, monkeypatch, env, ["--timeout", "1", *argv])
    args.master_port = free_port()  # the roll call connects there: where this machine reaches machine 0
    store = dist.TCPStore("127.0.0.1", args.master_port, 1, True, wait_for_workers=False)
    with pytest.raises(SystemExit) as exit:
        convnet_distributed.roll_call(store, 0, args.world_size, args)
    line = f"error: only 1 of {args.world_size} processes joined within --timeout 1 s: {fix}"
    assert exit.value.code.startswith(line), exit.value.code


def test_torchrun_restart_is_named_on_the_start_up_line(clean_env, monkeypatch):
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", TORCHELASTIC_RESTART_COUNT="1")
    args, _ = layout(convnet_distributed, monkeypatch, env)
    assert args.launch_note == "torchrun, restart 1"
    assert convnet_distributed.layout_line(1, args, "gloo").endswith(
        "; gradients averaged over Gloo (torchrun, restart 1)"
    )


def test_plain_rank_and_world_size_take_the_first_gpu_of_their_own(clean_env, monkeypatch):
    """RANK and WORLD_SIZE with no local rank: each launch is a machine of its own (a Kubeflow pod, its own
    GPUs), so local rank 0, cuda:0 of the GPUs it sees. rank % GPU count would be wrong across machines: it
    assumes one process per GPU on each, in blocks. A launcher's local rank wins (torchrun, srun, mpirun)."""
    args, processes = layout(convnet_distributed_cuda, monkeypatch, dict(RANK="5", WORLD_SIZE="8"))
    assert (args.local_rank, processes, args.machine_id) == (0, 1, 5)
    args, _ = layout(convnet_distributed_cuda, monkeypatch, dict(LOCAL_RANK="3", LOCAL_WORLD_SIZE="4"))
    assert args.local_rank == 3


def test_compressed_slurm_host_lists_and_counts_expand(clean_env, monkeypatch):
    """Machine 0 is the step's first node: of SLURM's compressed host list, its first host."""

    def first(nodes):
        args, _ = layout(convnet_distributed, monkeypatch, dict(SRUN_2X2, SLURM_STEP_NODELIST=nodes))
        return args.master_addr

    assert first("node[01-04,07]") == "node01"
    assert first("gpu3,node[9-11],login") == "gpu3" and first("node[9-11],login") == "node9"
    assert first("rack[1-2]-n[0-1]") == "rack1-n0"
    assert first("single") == "single"
    counts = dict(SRUN_2X2, SLURM_STEP_TASKS_PER_NODE="2(x3),1", SLURM_STEP_NUM_NODES="4",
                  SLURM_STEP_NUM_TASKS="7", SLURM_LOCALID="0")  # fmt: skip
    processes = []  # node n's tasks: n's of SLURM's compressed counts
    for node in range(4):
        env = dict(counts, SLURM_NODEID=str(node), SLURM_PROCID=str(2 * node))
        processes.append(layout(convnet_distributed, monkeypatch, env)[1])
    assert processes == [2, 2, 2, 1]  # 2(x3),1 is 2 2 2 1


def test_a_launcher_variable_that_is_not_a_number_is_one_line(clean_env, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit:
        layout(convnet_distributed, monkeypatch, dict(SRUN_2X2, SLURM_PROCID="three"))
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "SLURM set SLURM_PROCID='three', which is not a whole number" in err, err


# The rendezvous: launches on this host that cannot make one job. Each ends within seconds, not --timeout.
# Those that form no group run with --check, which makes the group as a real run would but loads no data.
TIMEOUT = 60  # the launches' --timeout: every mistake below must be named long before it
WITHIN = 30  # seconds from start to the last exit (start-up and data loading included; about 5 s on 2 cores)


def one_line_each(results, *phrases):
    for r in results:
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, r.stderr
        assert lines[0].startswith("error: ") and all(p in lines[0] for p in phrases), lines[0]
        assert "epoch: " not in r.stdout


def run_together(procs):
    start = time.monotonic()
    results = [finish(p, timeout=WITHIN + 60) for p in procs]
    seconds = time.monotonic() - start
    assert all(left_running(p.pid) == [] for p in procs)
    return results, seconds


@pytest.mark.timeout(WITHIN + 120)
def test_a_machine_id_given_twice_stops_every_machine_with_one_line(data_dir):
    """Two launches as machine 1 of 3: the count of arrivals was met (or would have been); machine 0 blamed
    the network after --timeout. Now the second claim of rank 1 stops the job, each machine saying why."""
    port = free_port()
    procs = [
        job(data_dir, "--check", processes=1, machines=3, machine=m, port=port, timeout=TIMEOUT)
        for m in (0, 1, 1)
    ]
    results, seconds = run_together(procs)
    one_line_each(
        results, "error: rank 1 joined twice, from machine 1 on ", "give each machine its own --machine-id"
    )
    assert seconds < WITHIN, seconds


@pytest.mark.timeout(WITHIN + 120)
@pytest.mark.parametrize("flags", [("--num-processes", 1), ("--num-machines", 3)])
def test_machines_that_disagree_on_the_layout_stop_with_one_line(data_dir, flags):
    """Machine 1 started with another --num-processes (or --num-machines): the side with the smaller world
    went ahead and the other waited. Now both stop at once, naming the flag that differs."""
    port = free_port()
    machine0 = job(data_dir, "--check", processes=2, machines=2, machine=0, port=port, timeout=TIMEOUT)
    machine1 = launch(
        "convnet_distributed.py", "--data-dir", data_dir, "--num-processes", 2, "--num-machines", 2,
        "--machine-id", 1, "--batch-size", 32, "--log-interval", 1, "--master-port", port,
        "--timeout", TIMEOUT, "--check", *flags,
    )  # fmt: skip
    results, seconds = run_together([machine0, machine1])
    one_line_each(results, "error: the machines disagree on world size, ", flags[0], "; machine 1 ")
    assert seconds < WITHIN, seconds


@pytest.mark.timeout(3 * WITHIN + 120)
def test_two_jobs_started_at_once_on_one_port_one_trains_the_other_stops(data_dir, tmp_path):
    """A parameter sweep started two jobs on one host and the default port: the losing job's rank 0 stopped,
    but its rank 1 could join the winner's rendezvous. Now one trains; the other stops with one line."""
    port = free_port()
    procs = [
        job(
            data_dir,
            "--metrics-json",
            tmp_path / f"{lr}.json",
            "--lr",
            lr,
            "--epochs",
            1,
            port=port,
            timeout=TIMEOUT,
        )
        for lr in ("0.5", "0.4")
    ]
    results = [finish(p, timeout=3 * WITHIN + 60) for p in procs]
    assert all(left_running(p.pid) == [] for p in procs)
    assert sorted(r.returncode for r in results) == [0, 1], [r.stderr for r in results]
    winner, loser = sorted(results, key=lambda r: r.returncode)
    assert loser.stderr.strip().count("\n") == 0 and loser.stderr.startswith("error: "), loser.stderr
    assert f"127.0.0.1:{port}" in loser.stderr and "--master-port" in loser.stderr, loser.stderr
    assert "epoch: " not in loser.stdout and winner.stderr == "", winner.stderr
    (metrics,) = [read_json(p) for p in tmp_path.glob("*.json")]
    assert metrics["world_size"] == 2 and metrics["test_samples"] == N_TEST and metrics["test_accuracy"] > 0.8


@pytest.mark.timeout(3 * WITHIN + 120)
def test_a_process_of_another_job_never_joins_a_waiting_job(data_dir, tmp_path):
    """The same, made certain: job A's machine 0 serves the port and waits for its machine 1; then a process
    of another job (rank 1 of RANK/WORLD_SIZE launches, another --lr) comes, and after it A's machine 1. The
    stranger used to count as A's missing process, and A formed its group with it. Now it stops with one line,
    and A forms its group of 2 (--check: the group is what is tested here; the test above trains)."""
    port = free_port()
    a0 = job(data_dir, "--check", processes=1, machines=2, machine=0, port=port, timeout=TIMEOUT)
    deadline = time.monotonic() + WITHIN + 30
    while (
        time.monotonic() < deadline and a0.poll() is None
    ):  # until A's rank 0 has claimed the job in its store
        with contextlib.suppress(OSError, RuntimeError):  # refused until the store listens
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=WITHIN))
            if store.check(["job"]):
                break
        time.sleep(0.1)
    env = script_env(RANK="1", WORLD_SIZE="2", MASTER_PORT=str(port))
    stranger = job(data_dir, "--check", "--lr", "0.4", processes=1, machines=2, machine=1, timeout=TIMEOUT,
                   port=port, env=env)  # fmt: skip
    stranger_result = finish(stranger, timeout=WITHIN + 30)
    a1 = job(data_dir, "--check", processes=1, machines=2, machine=1, port=port, timeout=TIMEOUT)
    results = [finish(p, timeout=3 * WITHIN + 60) for p in (a0, a1)] + [stranger_result]
    assert all(left_running(p.pid) == [] for p in (a0, a1, stranger))
    assert [r.returncode for r in results] == [0, 0, 1], [r.stderr for r in results]
    lines = results[2].stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: 127.0.0.1:{port} is another job's rendezvous"), (
        lines
    )
    assert "has --lr 0.5; machine 1 (" in lines[0] and lines[0].endswith(
        "has --lr 0.4): choose another --master-port"
    ), lines
    assert "Check passed: 2 processes on 2 machines reached each other" in results[0].stdout, results[
        0
    ].stdout
    assert results[2].stdout == ""


MPI_SECONDS = 120  # one mpirun job of 2 ranks; about 10 s on 2 cores


@pytest.mark.timeout(MPI_SECONDS + 60)
def test_mpirun_np_2_on_one_host_trains_as_one_group(data_dir, tmp_path):
    """Open MPI's mpirun -np 2 (Debian's openmpi-bin): each rank trained alone. Now one group of 2, no MPI
    library loaded, machine 0 on loopback."""
    if not shutil.which("mpirun"):
        pytest.skip("needs mpirun (Debian: apt-get install openmpi-bin)")
    env = script_env(
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1"
    )
    argv = ["mpirun", "-np", "2", sys.executable, os.path.join(REPO, "convnet_distributed.py")]
    argv += ["--data-dir", data_dir, "--batch-size", 64, "--master-port", free_port(), "--threads", 1]
    argv += ["--log-interval", 1000, "--metrics-json", tmp_path / "m.json", "--timeout", 60]
    proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path, start_new_session=True)  # fmt: skip
    result = finish(proc, timeout=MPI_SECONDS)
    assert result.returncode == 0, result.stderr
    layout_line = next(line for line in result.stdout.splitlines() if line.startswith("World size"))
    assert layout_line.startswith("World size 2 = 1 machine x 2 processes;"), layout_line
    assert layout_line.endswith("(mpirun, Open MPI: 2 ranks)"), layout_line
    m = read_json(tmp_path / "m.json")
    assert m["world_size"] == 2 and m["test_samples"] == N_TEST and m["test_accuracy"] > 0.8
    assert m["allreduce"] == "shared-memory"  # both ranks on this machine
    assert result.stdout.count("Finished training in") == 1  # one log for the job, not one per rank
    assert left_running(proc.pid) == []


# torchrun allows another --nproc-per-node on each node: 3 + 2, 2 + 3 and 1 + 1 + 3 processes.
NODE_COUNTS = [(3, 2), (2, 3), (1, 1, 3)]


def torchrun_env(counts, node, local_rank):
    """What torchrun's agent on node sets for a worker when the nodes run counts processes."""
    rank, world_size = sum(counts[:node]) + local_rank, sum(counts)
    return dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(counts[node]), GROUP_RANK=str(node), GROUP_WORLD_SIZE=str(len(counts)),
                TORCHELASTIC_RUN_ID="none", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # fmt: skip


@pytest.mark.parametrize("counts", NODE_COUNTS)
def test_torchrun_nodes_may_run_different_process_counts(clean_env, monkeypatch, counts):
    """The machines were the world size over the local size, rounded up: node 2 of 1 + 1 + 3 stopped with
    "--machine-id must be in 0-1 for 2 machines", and 3 + 2 counted 3 machines on node 1. torchrun's
    GROUP_WORLD_SIZE counts them; the roll call then counts each machine's processes."""
    for node, n in enumerate(counts):
        for local_rank in range(n):
            args, processes = layout(convnet_distributed, monkeypatch, torchrun_env(counts, node, local_rank))
            assert (args.num_machines, args.machine_id, processes) == (len(counts), node, n)
            assert (args.rank, args.local_rank, args.world_size) == (
                sum(counts[:node]) + local_rank, local_rank, sum(counts))  # fmt: skip


def torchrun_command(*flags, script=("convnet_distributed.py",)):
    return [sys.executable, "-m", "torch.distributed.run", *map(str, flags), *script]


@pytest.mark.timeout(240)
def test_torchrun_nodes_of_1_1_and_3_processes_train_as_one_group(tmp_path):
    """Three torchrun agents on this host play three nodes (static rendezvous: the node ranks are fixed), the
    third with 3 processes: it stopped with "--machine-id must be in 0-1 for 2 machines". Now the 5 train as
    one group, and the layout line counts each machine's processes. The test above checks every order's
    environments; this one runs the order that failed, with tiny data."""
    data = write_dataset(str(tmp_path / "data"), n_train=320, n_test=100)
    port, counts = free_port(), NODE_COUNTS[2]
    script = [os.path.join(REPO, "convnet_distributed.py"), "--data-dir", data, "--batch-size", 16,
              "--log-interval", 1000, "--timeout", 120]  # fmt: skip
    procs = []
    for node, n in enumerate(counts):
        flags = ["--nnodes", 3, "--node-rank", node, "--nproc-per-node", n, "--master-addr", "127.0.0.1"]
        metrics = ["--metrics-json", tmp_path / f"m{node}.json"]
        command = torchrun_command(*flags, "--master-port", port, script=[*map(str, script + metrics)])
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=script_env(), start_new_session=True))  # fmt: skip
    results = [finish(p, 200) for p in procs]
    assert [r.returncode for r in results] == [0, 0, 0], [r.stderr[-2000:] for r in results]
    assert read_json(tmp_path / "m0.json")["world_size"] == 5
    assert not (tmp_path / "m1.json").exists() and not (tmp_path / "m2.json").exists()
    assert "World size 5 = 3 machines (1 + 1 + 3 processes);" in results[0].stdout, results[0].stdout
    assert all(left_running(p.pid) == [] for p in procs)


def test_srun_cpus_per_task_are_each_tasks_own(clean_env, monkeypatch):
    """srun --ntasks-per-node 4 --cpus-per-task 8: SLURM_CPUS_PER_TASK is per task, but it was divided by the
    tasks again: 2 threads a rank on its 8 cores, "from SLURM_CPUS_PER_TASK". A task's CPUs are its own,
    whether SLURM pins it to them (a mask of 8 cores) or not (the node's 32); the processes the script starts
    inside one task share it."""
    env = dict(SRUN_2X2, SLURM_PROCID="5", SLURM_STEP_NUM_TASKS="8", SLURM_STEP_TASKS_PER_NODE="4(x2)",
               SLURM_CPUS_PER_TASK="8")  # fmt: skip
    args, processes = layout(convnet_distributed, monkeypatch, env)  # pinned: 8 cores
    assert (args.rank, processes, args.threads, args.threads_from) == (5, 4, 8, "")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))  # not pinned
    args = convnet_distributed.parse_args([])
    assert (args.threads, args.threads_from) == (8, "SLURM_CPUS_PER_TASK")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x2)")  # one task a node, 4 processes of the script's
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    args = convnet_distributed.parse_args(["--num-processes", "4"])
    assert (args.rank, args.threads, args.threads_from) == (None, 2, "SLURM_CPUS_PER_TASK")


# torchrun's worker, the script run as __main__ on a machine that seems to have 16 cores.
ON_16_CORES = """
import os, runpy, sys
os.sched_getaffinity = lambda pid: set(range(16))
sys.argv.pop(0)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("user_omp", [None, "1"])
def test_torchrun_default_of_one_thread_is_not_taken_for_the_users(tmp_path, user_omp):
    """torchrun --nproc-per-node 2 sets OMP_NUM_THREADS=1 where the user set none: on 16 cores each process
    ran 1 thread, 8 times fewer than the cores allow, and nothing said so. torchrun's own start-up
    environment tells who set it: torchrun, 8 threads each and the layout line says why; the user, 1."""
    (tmp_path / "on_16_cores.py").write_text(ON_16_CORES)
    data = write_dataset(str(tmp_path / "data"), n_train=256, n_test=100)
    script = [tmp_path / "on_16_cores.py", os.path.join(REPO, "convnet_distributed.py"), "--data-dir", data,
              "--batch-size", 16, "--log-interval", 1000, "--metrics-json", tmp_path / "m.json"]  # fmt: skip
    command = torchrun_command("--standalone", "--nproc-per-node", 2, script=map(str, script))
    env = script_env(**({"OMP_NUM_THREADS": user_omp} if user_omp else {}))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    result = finish(proc, 200)
    assert result.returncode == 0, result.stderr
    layout_line = next(line for line in result.stdout.splitlines() if line.startswith("World size"))
    if user_omp:
        assert "; 1 thread per process; " in layout_line, layout_line
    else:
        why = "; 8 threads per process, from the usable cores, not torchrun's default OMP_NUM_THREADS=1; "
        assert why in layout_line, layout_line
    assert read_json(tmp_path / "m.json")["threads"] == (1 if user_omp else 8)
