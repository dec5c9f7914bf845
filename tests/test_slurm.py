"""docs/launching.md's SLURM recipe under a real SLURM: a slurmctld, and one slurmd per "node", each node a
network namespace of its own with its own host name, the two joined by a veth pair.

The batch script is docs/launching.md's, with values for this machine: one CPU per task, one process per node,
a small batch, the generated data, a free master port. One job trains across both nodes; a second one, with
--checkpoint --resume, is scancel'ed mid-epoch, and the same script, resubmitted, resumes from its checkpoint.

How the nodes are made (`ip netns exec` remounts /sys, and slurmd then fails on the cgroup mounts):
`nsenter --net=/var/run/netns/NS unshare -m -u`, then the node's host name, a hosts file over /etc/hosts that
resolves both node names to their veth addresses, and a folder of its own (spool, pid file) bind-mounted over
a path that slurm.conf names for both. The controller runs on node0. One munged, started here with its own
key and socket, serves both nodes. Everything started is stopped at the end, and checked to be gone.
Needs root, iproute2, and Debian's slurm-wlm and munge; skipped, saying why, otherwise.
"""

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import N_TEST, REPO, read_json, script_env

# One cluster for the module, on one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("slurm")

TOOLS = (
    "slurmctld",
    "slurmd",
    "sbatch",
    "scontrol",
    "scancel",
    "sinfo",
    "munged",
    "ip",
    "nsenter",
    "unshare",
)
NODES = ("node0", "node1")
START_SECONDS = 60  # daemons up and both nodes idle; took about 1.5 s on 2 cores
JOB_SECONDS = 150  # one job, submission to end; a good one took 10-15 s on 2 cores
STOP_SECONDS = 15  # a daemon's exit after SIGTERM, or a cancelled job's
KILL_WAIT = 10  # slurm.conf KillWait: seconds from scancel's SIGTERM to SIGKILL
PEER_TIMEOUT = 60  # the script's --timeout: how long a process waits for its peers
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
}

# docs/launching.md's recipe, with this machine's values: both "nodes" share its 2 cores, so one process of
# one thread each (the default, usable cores over processes, would put 2 threads on each: 4 on 2 cores).
BATCH_SCRIPT = """\
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=1
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) MASTER_PORT={port}
srun bash -c 'python convnet_distributed.py --num-machines $SLURM_NNODES --machine-id $SLURM_NODEID \
--num-processes 1 --batch-size {batch_size} --threads 1 {extra}'
"""

SLURM_CONF = """\
ClusterName=dpt
SlurmctldHost=node0({addr0})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={folder}/state
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdSpoolDir={node_folder}/spool
SlurmdPidFile={node_folder}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait={kill_wait}
MinJobAge=3600
NodeName=node0 NodeAddr={addr0} CPUs=2 State=UNKNOWN
NodeName=node1 NodeAddr={addr1} CPUs=2 State=UNKNOWN
PartitionName=test Nodes=node0,node1 Default=YES MaxTime=INFINITE State=UP
"""

# Run inside a node's fresh mount and UTS namespaces: its host name, its hosts file, its own folder.
NODE_SHELL = 'hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" "$4" && shift 4 && exec "$@"'

# Ports below the ephemeral range (32768-60999): no outgoing connection can have taken them first.
FREE_PORTS = """\
import random, socket, sys
ports = []
while len(ports) < int(sys.argv[1]):
    port = random.randrange(20000, 32000)
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            continue
    if port not in ports:
        ports.append(port)
print(*ports)
"""


def run(argv, timeout=30, **kw):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kw)


def netns_pids(ns):
    result = run(["ip", "netns", "pids", ns])
    return {int(p) for p in result.stdout.split()} if result.returncode == 0 else set()


def parent_and_name(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None, None
    name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
    return int(rest[1]), name


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ").strip()
    except OSError:
        return "(gone)"


def stop(proc, timeout=STOP_SECONDS):
    """SIGTERM, then SIGKILL past the timeout; True where SIGTERM sufficed."""
    if proc.poll() is not None:
        return True
    proc.terminate()
    try:
        proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return False


@dataclass
class Cluster:
    folder: Path
    namespaces: tuple  # node i's network namespace, and its end of the veth pair
    addrs: tuple
    env: dict  # the user's: the sbatch environment, which the job inherits
    slurm_ports: tuple = ()
    daemons: dict = field(default_factory=dict)  # name: Popen; each Popen's pid is the daemon's own

    def ns_path(self, i):
        return f"/var/run/netns/{self.namespaces[i]}"

    def in_node(self, i, argv):
        """argv, run on node i: its network, its host name, its hosts file, its folder."""
        node_args = [NODES[i], self.folder / "hosts", self.folder / NODES[i], self.folder / "node"]
        enter = ["nsenter", f"--net={self.ns_path(i)}", "unshare", "-m", "-u", "sh", "-c", NODE_SHELL, "sh"]
        return [*enter, *node_args, *argv]

    def start(self, name, i, argv):
        with open(self.folder / f"{name}.log", "w") as log:
            argv = [str(a) for a in self.in_node(i, argv)]
            self.daemons[name] = subprocess.Popen(
                argv, stdout=log, stderr=log, env=self.env, cwd=self.folder, start_new_session=True
            )

    def free_port(self):
        """A port for MASTER_PORT: free on node0, and not slurm's."""
        return next(
            p for p in free_ports(self.ns_path(0), len(self.slurm_ports) + 1) if p not in self.slurm_ports
        )

    def client(self, *argv, timeout=30, cwd=None):
        """A slurm command, on node0's network (the controller's address is only reachable there)."""
        return run(
            ["nsenter", f"--net={self.ns_path(0)}", *argv],
            timeout=timeout,
            env=self.env,
            cwd=cwd or self.folder,
        )

    def logs(self):
        return "\n".join(
            f"--- {name}.log:\n{(self.folder / f'{name}.log').read_text()[-3000:]}" for name in self.daemons
        )

    def pids(self):
        return netns_pids(self.namespaces[0]) | netns_pids(self.namespaces[1])

    def strays(self):
        """Processes in the nodes' namespaces other than the daemons (and slurmctld's helper, slurmscriptd):
        a job's slurmstepd, bash or python."""
        daemons = {name: p.pid for name, p in self.daemons.items()}
        helper = (daemons.get("slurmctld"), "slurmscriptd")
        return {
            pid: cmdline(pid) for pid in self.pids() - set(daemons.values()) if parent_and_name(pid) != helper
        }

    def assert_no_strays(self, timeout=STOP_SECONDS):
        deadline = time.monotonic() + timeout
        while self.strays() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not self.strays(), f"left running in the nodes' namespaces: {self.strays()}"

    def node_states(self):
        result = self.client("sinfo", "-h", "-N", "-o", "%N %T")
        return dict(line.split() for line in result.stdout.splitlines() if line.strip())

    def submit(self, script_path, out):
        result = self.client("sbatch", "--parsable", f"--output={out}", script_path, cwd=REPO)
        assert result.returncode == 0, f"sbatch failed: {result.stderr}\n{self.logs()}"
        return result.stdout.strip().split(";")[0]

    def job(self, job_id):
        """The job's fields, from `scontrol show job -o`."""
        result = self.client("scontrol", "show", "job", "-o", job_id)
        assert result.returncode == 0, result.stderr
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout))

    def wait_job(self, job_id, timeout=JOB_SECONDS, out=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields["JobState"] in FINAL_STATES:
                return fields
            time.sleep(0.5)
        self.client("scancel", job_id)
        output = out.read_text() if out and out.exists() else ""
        pytest.fail(f"job {job_id} still {fields['JobState']} after {timeout} s\n{output}\n{self.logs()}")


def setup_namespaces(base):
    """Two network namespaces joined by a veth pair; returns those made, and why not where it failed."""
    subnet = f"198.{18 + secrets.randbelow(2)}.{secrets.randbelow(256)}"  # benchmarking range 198.18.0.0/15
    names = (f"{base}0", f"{base}1")
    addrs = (f"{subnet}.1", f"{subnet}.2")
    made = []
    for ns in names:
        result = run(["ip", "netns", "add", ns])
        if result.returncode != 0:
            return made, f"cannot make a network namespace (ip netns add {ns}): {result.stderr.strip()}"
        made.append(ns)
    steps = [
        [
            "link",
            "add",
            names[0],
            "netns",
            names[0],
            "type",
            "veth",
            "peer",
            "name",
            names[1],
            "netns",
            names[1],
        ]
    ]
    for ns, addr in zip(names, addrs):
        steps += [
            ["-n", ns, "addr", "add", f"{addr}/24", "dev", ns],
            ["-n", ns, "link", "set", "lo", "up"],
            ["-n", ns, "link", "set", ns, "up"],
        ]
    for step in steps:
        result = run(["ip", *step])
        if result.returncode != 0:
            return made, f"cannot set up the veth pair (ip {' '.join(step)}): {result.stderr.strip()}"
    return made, None


def remove_namespaces(names):
    """Kill whatever still runs in the namespaces, then delete them (and with them the veth pair)."""
    problems = []
    for ns in names:
        for _ in range(50):
            pids = netns_pids(ns)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        else:
            problems.append(f"processes {sorted(netns_pids(ns))} in {ns} survived SIGKILL")
        result = run(["ip", "netns", "del", ns])
        if result.returncode != 0:
            problems.append(f"ip netns del {ns}: {result.stderr.strip()}")
    return problems


def free_ports(ns_path, n):
    """n distinct ports that nothing listens on in that network namespace."""
    result = run(["nsenter", f"--net={ns_path}", sys.executable, "-c", FREE_PORTS, n])
    assert result.returncode == 0, result.stderr
    return [int(p) for p in result.stdout.split()]


def start_munged(folder):
    """A munged of this test's own: its key, its socket. Its socket's folder must be reachable by all."""
    key = folder / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    socket_path = folder / "munge.socket"
    with open(folder / "munged.log", "w") as log:
        files = [f"--socket={socket_path}", f"--key-file={key}", f"--pid-file={folder}/munged.pid"]
        argv = ["munged", "--foreground", *files, f"--seed-file={folder}/munged.seed"]
        proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 20
    while not socket_path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc, socket_path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [tool for tool in TOOLS if not shutil.which(tool)]
    if missing:
        pytest.skip(
            f"needs {', '.join(missing)} (Debian: apt-get install slurm-wlm munge iproute2 util-linux)"
        )
    if os.geteuid() != 0:
        pytest.skip("needs root to make network namespaces and run slurmd")
    folder = tmp_path_factory.mktemp("slurm")
    munge_folder = Path(tempfile.mkdtemp(prefix="dpt-munge-"))
    munge_folder.chmod(0o755)  # munged wants its socket's folders executable by all
    base = f"dps{os.getpid()}{secrets.token_hex(4)}"[:14]
    namespaces, problems, munged = [], [], None
    cluster = None
    try:
        namespaces, why = setup_namespaces(base)
        if why:
            pytest.skip(why)
        munged, munge_socket = start_munged(munge_folder)
        if not munge_socket.exists():
            stop(munged)
            pytest.fail(f"munged did not start:\n{(munge_folder / 'munged.log').read_text()}")

        addrs = tuple(
            run(["ip", "-n", ns, "-4", "-o", "addr", "show", "dev", ns]).stdout.split()[3].split("/")[0]
            for ns in namespaces
        )
        bin_folder = folder / "bin"  # `python` in the job is this interpreter, as in the user's environment
        bin_folder.mkdir()
        (bin_folder / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        (bin_folder / "python").chmod(0o755)
        (folder / "hosts").write_text(f"127.0.0.1 localhost\n{addrs[0]} node0\n{addrs[1]} node1\n")
        for name in (*NODES, "node", "state"):
            (folder / name).mkdir()
        env = script_env(SLURM_CONF=str(folder / "slurm.conf"), PATH=f"{bin_folder}:{os.environ['PATH']}")
        env.pop("GLOO_SOCKET_IFNAME", None)  # the script finds the interface that reaches MASTER_ADDR
        ctld_port, slurmd_port = free_ports(f"/var/run/netns/{namespaces[0]}", 2)
        conf = SLURM_CONF.format(
            addr0=addrs[0],
            addr1=addrs[1],
            ctld_port=ctld_port,
            slurmd_port=slurmd_port,
            munge_socket=munge_socket,
            folder=folder,
            node_folder=folder / "node",
            kill_wait=KILL_WAIT,
        )
        (folder / "slurm.conf").write_text(conf)
        cluster = Cluster(folder, tuple(namespaces), addrs, env, (ctld_port, slurmd_port))
        probe = run(cluster.in_node(0, ["true"]), env=env)
        if probe.returncode != 0:
            pytest.skip(f"cannot enter a node (nsenter, unshare -m -u, mount --bind): {probe.stderr.strip()}")
        cluster.start("slurmctld", 0, ["slurmctld", "-D"])
        for i, node in enumerate(NODES):
            cluster.start(f"slurmd-{node}", i, ["slurmd", "-D", "-N", node])

        deadline = time.monotonic() + START_SECONDS
        states = {}
        while time.monotonic() < deadline:
            dead = [name for name, proc in cluster.daemons.items() if proc.poll() is not None]
            if dead:
                pytest.fail(f"{', '.join(dead)} stopped at start-up\n{cluster.logs()}")
            states = cluster.node_states()
            if all(states.get(node) == "idle" for node in NODES):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"nodes not idle after {START_SECONDS} s: {states}\n{cluster.logs()}")
        yield cluster
    finally:
        if cluster is not None:
            cluster.client("scancel", "--full", "--user=root")  # anything a failed test left
            deadline = time.monotonic() + KILL_WAIT + STOP_SECONDS
            while cluster.strays() and time.monotonic() < deadline:
                time.sleep(0.2)
            for name in ("slurmd-node1", "slurmd-node0", "slurmctld"):
                if name in cluster.daemons and not stop(cluster.daemons[name]):
                    problems.append(f"{name} needed SIGKILL")
            left = cluster.pids()
            if left:
                problems.append(f"left running in the nodes' namespaces: {[cmdline(p) for p in left]}")
        problems += remove_namespaces(namespaces)
        if munged is not None:
            if not stop(munged):
                problems.append("munged needed SIGKILL")
            if munged.poll() is None:
                problems.append(f"munged (pid {munged.pid}) still running")
        shutil.rmtree(munge_folder, ignore_errors=True)
        if problems:
            pytest.fail("cleaning up: " + "; ".join(problems))


def write_batch_script(path, port, batch_size, extra):
    """The recipe, the script's further arguments (extra) in its single quotes."""
    assert re.fullmatch(r"[\w./+ -]+", extra), extra
    path.write_text(BATCH_SCRIPT.format(port=port, batch_size=batch_size, extra=extra))
    return path


def check_metrics(path, epochs_trained):
    m = read_json(path)
    assert m["world_size"] == 2  # one process on each node
    assert m["test_samples"] == N_TEST  # every test image counted once, across both nodes
    assert m["epochs_trained"] == epochs_trained
    assert m["test_accuracy"] > 0.8  # chance is 0.1
    return m


@pytest.mark.timeout(START_SECONDS + JOB_SECONDS + 60)
def test_sbatch_the_readme_recipe_across_two_nodes(cluster, data_dir, tmp_path):
    extra = f"--data-dir {data_dir} --epochs 1 --log-interval 1000 --timeout {PEER_TIMEOUT} "
    extra += f"--metrics-json {tmp_path}/m.json"
    script = write_batch_script(tmp_path / "job.sh", cluster.free_port(), 32, extra)
    out = tmp_path / "job.out"
    job_id = cluster.submit(script, out)
    fields = cluster.wait_job(job_id, out=out)
    output = out.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (
        f"{fields}\n{output}\n{cluster.logs()}"
    )
    assert fields["NodeList"] == "node[0-1]", fields
    check_metrics(tmp_path / "m.json", 1)
    assert "Finished training in" in output, output
    # Rank 0 is on node0, and its Gloo reaches node1 over the veth pair.
    for i in range(2):  # rank 0 reports each node: its host name, and Gloo on its veth address
        line = f"Machine {i} (node{i}): 1 process, Gloo on {cluster.namespaces[i]} {cluster.addrs[i]}"
        assert line in output.splitlines(), output
    cluster.assert_no_strays()


CANCEL_EPOCHS = 3


@pytest.mark.timeout(START_SECONDS + 3 * JOB_SECONDS + 60)
def test_scancel_mid_epoch_then_resubmit_resumes(cluster, data_dir, tmp_path):
    """scancel signals every process of the job: nothing is left, the checkpoint of the last complete epoch is
    whole, and the same script submitted again continues from it and finishes."""
    import torch

    import convnet_distributed

    ck = tmp_path / "ckpt" / "ck.pt"
    ck.parent.mkdir()
    # Batch 16: 80 steps an epoch, about 1.5 s on 2 cores, time enough to cancel mid-epoch (and where scancel
    # comes late, the checkpoint says which epoch was whole).
    extra = (
        f"--data-dir {data_dir} --epochs {CANCEL_EPOCHS} --log-interval 5 --timeout {PEER_TIMEOUT} "
        f"--checkpoint {ck} --resume --metrics-json {tmp_path}/m.json"
    )
    script = write_batch_script(tmp_path / "job.sh", cluster.free_port(), 16, extra)
    out = tmp_path / "first.out"
    job_id = cluster.submit(script, out)
    deadline = time.monotonic() + JOB_SECONDS
    while not (ck.exists() and out.exists() and "\nepoch: 1 [" in out.read_text()):
        if cluster.job(job_id)["JobState"] in FINAL_STATES or time.monotonic() > deadline:
            cluster.client("scancel", job_id)
            pytest.fail(f"no progress line of epoch 1 with a checkpoint\n{out.read_text()}\n{cluster.logs()}")
        time.sleep(0.1)
    result = cluster.client("scancel", job_id)
    cancelled_at = time.monotonic()
    assert result.returncode == 0, result.stderr
    fields = cluster.wait_job(job_id, timeout=KILL_WAIT + STOP_SECONDS, out=out)
    stopped_in = time.monotonic() - cancelled_at
    output = out.read_text()
    assert fields["JobState"] == "CANCELLED", f"{fields}\n{output}"
    assert "Finished training" not in output and not (tmp_path / "m.json").exists()
    # Each node's launcher says what happened in one line (status 143, which SLURM reports as the signal).
    stopped = [line for line in output.splitlines() if line.startswith("Terminated (SIGTERM)")]
    assert 1 <= len(stopped) <= 2, output
    # Machine 0, where the checkpoint is written, says what it holds; the other machine only that it stopped.
    plain = "Terminated (SIGTERM): every process of this launch stopped"
    assert set(stopped) <= {plain, f"{plain}; {ck} holds the last complete epoch"}, output
    cluster.assert_no_strays()
    gone_in = time.monotonic() - cancelled_at
    print(
        f"cancelled job {job_id} ended {stopped_in:.1f} s after scancel, "
        f"its last process within {gone_in:.1f} s"
    )

    state = torch.load(ck, map_location="cpu", weights_only=True)  # whole: it loads, and it is ours
    assert state["format"] == convnet_distributed.CHECKPOINT_FORMAT and state["dataset"] == "mnist"
    assert set(state["model"]) == set(convnet_distributed.ConvNet().state_dict())
    done = state["epoch"]
    assert done < CANCEL_EPOCHS - 1, f"the job finished epoch {done} before scancel reached it"
    assert f"epoch: {done + 1} [" in output  # cancelled mid-epoch: that epoch's progress is lost
    assert [p.name for p in ck.parent.iterdir()] == ["ck.pt"]  # no half-written temporary file

    out = tmp_path / "second.out"
    job_id = cluster.submit(script, out)
    fields = cluster.wait_job(job_id, out=out)
    output = out.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (
        f"{fields}\n{output}\n{cluster.logs()}"
    )
    assert f"Resuming from {ck}: epoch {done} done, starting epoch {done + 1}" in output, output
    assert f"epoch: {done} [" not in output and f"epoch: {done + 1} [0/" in output, output
    assert "Finished training in" in output
    check_metrics(tmp_path / "m.json", CANCEL_EPOCHS - 1 - done)
    assert torch.load(ck, map_location="cpu", weights_only=True)["epoch"] == CANCEL_EPOCHS - 1
    cluster.assert_no_strays()


# srun starts every process itself, one task per process, with no MASTER_ADDR, MASTER_PORT or --machine-id:
# machine 0 is the first node of node[0-1], the port one of this job's. Then docs/launching.md's short recipe,
# one task per node. The batch shell is no task: it has the job's variables, none of a step's.
TASKS_SCRIPT = """\
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --cpus-per-task=1
echo "batch shell: SLURM_STEP_NUM_TASKS=${{SLURM_STEP_NUM_TASKS:-unset}}"
srun python convnet_distributed.py --batch-size 16 {common} --metrics-json {folder}/tasks.json
srun --ntasks=2 --ntasks-per-node=1 python convnet_distributed.py --num-processes 2 --batch-size 16 {common} \
--metrics-json {folder}/recipe.json
"""


@pytest.mark.timeout(START_SECONDS + 2 * JOB_SECONDS + 60)
def test_srun_one_task_per_process_and_the_short_recipe(cluster, data_dir, tmp_path):
    """--ntasks-per-node=2 and a plain srun: each task trained alone, four unrelated runs. Now one group of 4
    ranks; the recipe without --num-machines and --machine-id makes it from one task per node."""
    common = f"--threads 1 --data-dir {data_dir} --epochs 1 --log-interval 1000 --timeout {PEER_TIMEOUT}"
    script = tmp_path / "job.sh"
    script.write_text(TASKS_SCRIPT.format(common=common, folder=tmp_path))
    out = tmp_path / "job.out"
    job_id = cluster.submit(script, out)
    fields = cluster.wait_job(job_id, timeout=2 * JOB_SECONDS, out=out)
    output = out.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (
        f"{fields}\n{output}\n{cluster.logs()}"
    )
    assert "batch shell: SLURM_STEP_NUM_TASKS=unset" in output, output
    layouts = [line for line in output.splitlines() if line.startswith("World size")]
    assert len(layouts) == 2, output  # one per step: rank 0 alone prints
    assert layouts[0].startswith("World size 4 = 2 machines x 2 processes;"), layouts
    assert layouts[0].endswith("over Gloo (SLURM: 4 tasks on 2 nodes)"), layouts
    assert layouts[1].endswith("over Gloo (SLURM: 2 nodes, one task each)"), layouts
    for name in ("tasks", "recipe"):
        m = read_json(tmp_path / f"{name}.json")
        assert m["world_size"] == 4 and m["test_samples"] == N_TEST and m["test_accuracy"] > 0.8, m
    for i in range(2):  # each step: machine 0 is node0, the first of node[0-1]
        line = f"Machine {i} (node{i}): 2 processes, Gloo on {cluster.namespaces[i]} {cluster.addrs[i]}"
        assert output.splitlines().count(line) == 2, output
    cluster.assert_no_strays()


# A sweep: two steps of one allocation side by side, each on a node of its own, each a job with its own --lr.
STEPS_SCRIPT = """\
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=2 --cpus-per-task=1
for i in 0 1; do
  srun --nodes=1 --ntasks=2 --relative=$i python convnet_distributed.py \
--batch-size 32 {common} --lr 0.{lr}$i \
--metrics-json {folder}/step$i.json > {folder}/step$i.out 2>&1 &
done
wait
"""


@pytest.mark.timeout(START_SECONDS + JOB_SECONDS + 60)
def test_srun_steps_side_by_side_each_train_as_their_own_group(cluster, data_dir, tmp_path):
    """Machine 0 was the job's first node and the port the job's: the step on node1 went to node0's step, and
    one of the two stopped ('rank 0 joined twice', or 'another job's rendezvous'). Now each step meets on its
    own first node, at a port of its own, and trains as a group of its 2 tasks."""
    common = f"--threads 1 --data-dir {data_dir} --epochs 1 --log-interval 1000 --timeout {PEER_TIMEOUT}"
    script = tmp_path / "job.sh"
    script.write_text(STEPS_SCRIPT.format(common=common, folder=tmp_path, lr=4))
    out = tmp_path / "job.out"
    job_id = cluster.submit(script, out)
    fields = cluster.wait_job(job_id, out=out)
    outputs = [(tmp_path / f"step{i}.out").read_text() for i in range(2)]
    said = "\n".join(outputs) + out.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (
        f"{fields}\n{said}\n{cluster.logs()}"
    )
    for i, output in enumerate(outputs):
        layout = next(line for line in output.splitlines() if line.startswith("World size"))
        assert layout.startswith("World size 2 = 1 machine x 2 processes;"), said
        assert layout.endswith("(SLURM: 2 tasks on 1 node)"), said
        assert "error" not in output and output.count("Finished training in") == 1, said
        m = read_json(tmp_path / f"step{i}.json")
        assert m["world_size"] == 2 and m["test_samples"] == N_TEST and m["test_accuracy"] > 0.8, m
    cluster.assert_no_strays()
