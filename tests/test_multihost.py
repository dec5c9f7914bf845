"""Two "machines" that really are two: network namespaces joined by a veth pair, each with its own address.

Over loopback (tests/test_training.py) every process shares 127.0.0.1, so a job can pass there and still fail
between real hosts. A common such failure: the host name resolves to 127.0.0.1 (/etc/hosts: `127.0.0.1 vm`),
Gloo binds its sockets to the address the host name resolves to, and the peers are told to connect to
127.0.0.1: `Gloo connectFullMesh failed ... Connection refused, remote=[127.0.0.1]`. Here machine 0 and
machine 1 live in different namespaces, as on two hosts, and only the veth addresses reach across.
Needs root and iproute2 (`ip netns`); skipped otherwise.
"""

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from conftest import N_TEST, REPO, read_json, script_env

SCRIPT = os.path.join(REPO, "convnet_distributed.py")
RUN_SECONDS = 180  # one two-machine run, start to both exits; a good one took 15-35 s on 2 cores
PEER_TIMEOUT = 60  # the scripts' --timeout: how long a process waits for its peers


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_pids(ns):
    result = ip("netns", "pids", ns, check=False)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


@dataclass
class Network:
    """Two namespaces joined by a veth pair: machine 0 in a, machine 1 in b."""

    ns_a: str
    ns_b: str
    if_a: str
    if_b: str
    addr_a: str
    addr_b: str

    def pids(self):
        return netns_pids(self.ns_a) + netns_pids(self.ns_b)


def remove_namespaces(names):
    """Kill whatever still runs in the namespaces (a hung rank, an orphaned worker), then delete them.
    Deleting a namespace deletes its veth end, and with it the pair."""
    problems = []
    for ns in names:
        for _ in range(20):  # a killed parent's children are listed on the next pass
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
            problems.append(f"processes {netns_pids(ns)} in {ns} survived SIGKILL")
        result = ip("netns", "del", ns, check=False)
        if result.returncode != 0:
            problems.append(f"ip netns del {ns}: {result.stderr.strip()}")
    return problems


@pytest.fixture
def network():
    if not shutil.which("ip"):
        pytest.skip("needs the `ip` command (iproute2) to make network namespaces")
    if os.geteuid() != 0:
        pytest.skip("needs root to make network namespaces (ip netns add)")
    base = f"dpt{os.getpid()}{secrets.token_hex(4)}"[:12]  # unique to this run; +a/b keeps names <= 15 chars
    subnet = f"198.{18 + secrets.randbelow(2)}.{secrets.randbelow(256)}"  # benchmarking range 198.18.0.0/15
    net = Network(f"{base}a", f"{base}b", f"{base}a", f"{base}b", f"{subnet}.1", f"{subnet}.2")
    made = []
    try:
        for ns in (net.ns_a, net.ns_b):
            result = ip("netns", "add", ns, check=False)
            if result.returncode != 0:
                pytest.skip(f"cannot make a network namespace (ip netns add {ns}): {result.stderr.strip()}")
            made.append(ns)
        steps = [
            ("link", "add", net.if_a, "netns", net.ns_a, "type", "veth", "peer", "name", net.if_b, "netns", net.ns_b)
        ]
        for ns, name, addr in ((net.ns_a, net.if_a, net.addr_a), (net.ns_b, net.if_b, net.addr_b)):
            steps += [
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", name),
                ("-n", ns, "link", "set", "lo", "up"),
                ("-n", ns, "link", "set", name, "up"),
            ]
        for step in steps:
            result = ip(*step, check=False)
            if result.returncode != 0:
                pytest.skip(f"cannot set up the veth pair (ip {' '.join(step)}): {result.stderr.strip()}")
        yield net
    finally:
        problems = remove_namespaces(made)
        if problems:
            pytest.fail("cleaning up the namespaces: " + "; ".join(problems))


@dataclass
class Result:
    label: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class Machine:
    """One machine's launch, in its namespace, in its own session (so its process group can be killed).
    Output goes to files: two machines' tracebacks cannot fill a pipe nobody reads."""

    def __init__(self, label, ns, argv, env, folder):
        self.label = label
        self.out, self.err = folder / f"{label}.stdout", folder / f"{label}.stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *map(str, argv)],
                stdout=out,
                stderr=err,
                env=env,
                cwd=folder,
                start_new_session=True,
            )
        self.start = time.monotonic()

    def result(self):
        return Result(
            self.label, self.proc.returncode, self.out.read_text(), self.err.read_text(), time.monotonic() - self.start
        )


def describe(results):
    return "\n".join(
        f"--- {r.label}: exit {r.returncode} after {r.seconds:.1f} s\nstdout:\n{r.stdout[-3000:]}"
        f"\nstderr:\n{r.stderr[-3000:]}"
        for r in results
    )


def finish_all(machines, timeout):
    """Wait for every machine against one deadline; past it, kill their process groups and fail."""
    deadline = time.monotonic() + timeout
    results = {}
    while len(results) < len(machines) and time.monotonic() < deadline:
        for m in machines:
            if m not in results and m.proc.poll() is not None:
                results[m] = m.result()  # taken when it ends: its time is its own, not the slower machine's
        time.sleep(0.1)
    overran = [m for m in machines if m not in results]
    for m in overran:
        try:
            os.killpg(m.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        m.proc.wait()
        results[m] = m.result()
    results = [results[m] for m in machines]
    if overran:
        pytest.fail(f"{', '.join(m.label for m in overran)} still running after {timeout} s\n{describe(results)}")
    return results


def assert_namespaces_empty(net):
    """Nothing outlives the job: no worker, no torchrun agent, no resource tracker (given a moment to exit)."""
    deadline = time.monotonic() + 5
    while net.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = net.pids()
    assert not left, [
        open(f"/proc/{p}/cmdline").read().replace("\0", " ") for p in left if os.path.exists(f"/proc/{p}")
    ]


def env_without_interface():
    """The user's environment (script_env: no MASTER_ADDR, RANK...), less a chosen Gloo interface:
    the script has to find the one that reaches --master-addr itself."""
    env = script_env()
    env.pop("GLOO_SOCKET_IFNAME", None)
    return env


def common_args(data_dir, timeout=PEER_TIMEOUT):
    """Small and quick: the generated data, one epoch, a progress line only for the first batch."""
    return [
        "--batch-size",
        32,
        "--epochs",
        1,
        "--log-interval",
        1000,
        "--dataset",
        "mnist",
        "--data-dir",
        data_dir,
        "--timeout",
        timeout,
    ]


def script_machines(net, port, data_dir, folder, env, timeout=PEER_TIMEOUT):
    """The script's own two-machine launch: machine i in namespace i, both told machine 0's veth address."""
    args = [
        *common_args(data_dir, timeout),
        "--num-machines",
        2,
        "--num-processes",
        2,
        "--master-addr",
        net.addr_a,
        "--master-port",
        port,
    ]
    return [
        Machine(
            f"machine{i}",
            ns,
            [sys.executable, SCRIPT, "--machine-id", i, *args, "--metrics-json", folder / f"m{i}.json"],
            env,
            folder,
        )
        for i, ns in enumerate((net.ns_a, net.ns_b))
    ]


def random_port():
    # Fresh namespaces hold no listening sockets: any port is free there. Below the ephemeral range
    # (32768-60999), so no outgoing connection in the namespace can have taken it first.
    return 20000 + secrets.randbelow(12000)


def check_metrics(path, world_size):
    m = read_json(path)
    assert m["world_size"] == world_size
    assert m["test_samples"] == N_TEST  # every test image counted once, across both machines
    assert m["epochs_trained"] == 1 and len(m["history"]) == 1
    assert m["test_accuracy"] > 0.8  # chance is 0.1
    return m


@pytest.mark.timeout(RUN_SECONDS + 60)
def test_script_launch_across_two_namespaces_forms_one_group(network, data_dir, tmp_path):
    """The script's own launch, once per machine, each told machine 0's veth address: one group of 4 ranks.
    GLOO_SOCKET_IFNAME is not set: the script has to find the interface that reaches --master-addr."""
    env = env_without_interface()
    machines = script_machines(network, random_port(), data_dir, tmp_path, env)
    results = finish_all(machines, RUN_SECONDS)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    check_metrics(tmp_path / "m0.json", 4)
    assert "Finished training in" in results[0].stdout
    assert f"Gloo uses interface {network.if_a} ({network.addr_a})" in results[0].stdout  # rank 0 says which
    # Rank 0 lives on machine 0: machine 1 prints no progress, no results, and writes no metrics.
    assert not any(
        line.startswith(("epoch: ", "Test set", "Finished training")) for line in results[1].stdout.splitlines()
    ), results[1].stdout
    assert not (tmp_path / "m1.json").exists()
    assert_namespaces_empty(network)


@pytest.mark.timeout(RUN_SECONDS + 60)
def test_torchrun_across_two_namespaces_forms_one_group(network, data_dir, tmp_path):
    """torchrun on each machine, static rendezvous on machine 0's TCPStore at --master-addr:--master-port."""
    port = random_port()
    env = env_without_interface()
    machines = [
        Machine(
            f"torchrun{i}",
            ns,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                2,
                "--node-rank",
                i,
                "--master-addr",
                network.addr_a,
                "--master-port",
                port,
                "--nproc-per-node",
                2,
                SCRIPT,
                *common_args(data_dir),
                "--metrics-json",
                tmp_path / f"m{i}.json",
            ],
            env,
            tmp_path,
        )
        for i, ns in enumerate((network.ns_a, network.ns_b))
    ]
    results = finish_all(machines, RUN_SECONDS)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    check_metrics(tmp_path / "m0.json", 4)
    assert f"Gloo uses interface {network.if_a} ({network.addr_a})" in results[0].stdout
    assert not (tmp_path / "m1.json").exists()  # rank 0 is on node 0
    assert_namespaces_empty(network)


WRONG_IFNAME_SECONDS = 60  # well under the peers' --timeout: a bad name is reported, not waited out


@pytest.mark.timeout(WRONG_IFNAME_SECONDS + 60)
def test_wrong_gloo_socket_ifname_is_a_clear_error(network, data_dir, tmp_path):
    """GLOO_SOCKET_IFNAME naming no interface: each machine stops soon, saying which setting is wrong."""
    env = env_without_interface()
    env["GLOO_SOCKET_IFNAME"] = "nosuchif0"
    machines = script_machines(network, random_port(), data_dir, tmp_path, env, timeout=2 * WRONG_IFNAME_SECONDS)
    results = finish_all(machines, WRONG_IFNAME_SECONDS)
    for r in results:
        assert r.returncode != 0, describe(results)
        assert "GLOO_SOCKET_IFNAME" in r.stderr and "nosuchif0" in r.stderr, describe([r])
        assert "Traceback" not in r.stderr, describe([r])
        assert "epoch: " not in r.stdout
    assert not (tmp_path / "m0.json").exists()
    assert_namespaces_empty(network)
