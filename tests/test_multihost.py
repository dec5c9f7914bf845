"""Two "machines" that really are two: network namespaces joined by a veth pair, each with its own address,
its own host name (a UTS namespace) and its own hosts file (/etc/netns/NAME/hosts, which `ip netns exec`
mounts over /etc/hosts).

Over loopback (tests/test_training.py) every process shares 127.0.0.1, so a job can pass there and still fail
between real hosts. The common such failure: machine 0's hosts file maps its own name to loopback (Debian and
Ubuntu write `127.0.1.1 HOSTNAME`), Gloo binds its sockets to the address the host name resolves to, and the
peers are told to connect to it: `Gloo connectFullMesh failed ... Connection refused, remote=[127.0.1.1]`.
Here machine 0 ("node0") maps its own name to 127.0.1.1, machine 1 ("node1") maps node0 to machine 0's veth
address, as two freshly installed hosts on one network would, and every launch names machine 0 by name.
Needs root and iproute2 (`ip netns`) and util-linux (`unshare`); skipped otherwise.
"""

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from conftest import N_TEST, REPO, read_json, script_env

# On one pytest-xdist worker, one test at a time: the bounds on each wait were set with one such test running.
pytestmark = pytest.mark.xdist_group("multihost")

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
    """Two namespaces joined by a veth pair: machine 0 ("node0") in a, machine 1 ("node1") in b."""

    ns_a: str
    ns_b: str
    if_a: str
    if_b: str
    addr_a: str
    addr_b: str

    def pids(self):
        return netns_pids(self.ns_a) + netns_pids(self.ns_b)

    def hosts_files(self):
        """Each machine maps its own name to 127.0.1.1 (Debian's default), the other's to its veth address."""
        loopback = "127.0.0.1 localhost\n::1 localhost ip6-localhost\n"
        return {
            self.ns_a: f"{loopback}127.0.1.1 node0\n{self.addr_b} node1\n",
            self.ns_b: f"{loopback}127.0.1.1 node1\n{self.addr_a} node0\n",
        }


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


def make_network(ipv6=False):
    """The two namespaces, with IPv4 addresses or IPv6 only; removed, and checked empty, after."""
    if not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("needs the `ip` command (iproute2) and `unshare` (util-linux) to make the two hosts")
    if os.geteuid() != 0:
        pytest.skip("needs root to make network namespaces (ip netns add)")
    base = f"dpt{os.getpid()}{secrets.token_hex(4)}"[:12]  # unique to this run; +a/b keeps names <= 15 chars
    if ipv6:  # a random unique local prefix (fd00::/8), no IPv4 on the veth pair
        prefix, length = f"fd{secrets.token_hex(1)}:{secrets.token_hex(2)}::", 64
    else:  # the benchmarking range 198.18.0.0/15
        prefix, length = f"198.{18 + secrets.randbelow(2)}.{secrets.randbelow(256)}.", 24
    # In the form the scripts print (fd12:0abc:: is fd12:abc::), which a random group may not have.
    addr0, addr1 = (str(ipaddress.ip_address(f"{prefix}{n}")) for n in (1, 2))
    net = Network(f"{base}a", f"{base}b", f"{base}a", f"{base}b", addr0, addr1)
    made = []
    try:
        for ns in (net.ns_a, net.ns_b):
            result = ip("netns", "add", ns, check=False)
            if result.returncode != 0:
                pytest.skip(f"cannot make a network namespace (ip netns add {ns}): {result.stderr.strip()}")
            made.append(ns)
        steps = [
            (
                "link",
                "add",
                net.if_a,
                "netns",
                net.ns_a,
                "type",
                "veth",
                "peer",
                "name",
                net.if_b,
                "netns",
                net.ns_b,
            )
        ]
        for ns, name, addr in ((net.ns_a, net.if_a, net.addr_a), (net.ns_b, net.if_b, net.addr_b)):
            steps += [
                ("-n", ns, "addr", "add", f"{addr}/{length}", "dev", name, *(["nodad"] if ipv6 else [])),
                ("-n", ns, "link", "set", "lo", "up"),
                ("-n", ns, "link", "set", name, "up"),
            ]
        for step in steps:
            result = ip(*step, check=False)
            if result.returncode != 0:
                pytest.skip(f"cannot set up the veth pair (ip {' '.join(step)}): {result.stderr.strip()}")
        for ns, hosts in net.hosts_files().items():
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts)
        yield net
    finally:
        problems = remove_namespaces(made)
        for ns in made:
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if problems:
            pytest.fail("cleaning up the namespaces: " + "; ".join(problems))


@pytest.fixture
def network():
    yield from make_network()


@pytest.fixture
def network6():
    yield from make_network(ipv6=True)


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

    def __init__(self, label, ns, argv, env, folder, hostname):
        self.label = label
        self.out, self.err = folder / f"{label}.stdout", folder / f"{label}.stderr"
        named = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *named, *map(str, argv)],
                stdout=out,
                stderr=err,
                env=env,
                cwd=folder,
                start_new_session=True,
            )
        self.start = time.monotonic()

    def result(self):
        return Result(
            self.label,
            self.proc.returncode,
            self.out.read_text(),
            self.err.read_text(),
            time.monotonic() - self.start,
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
        pytest.fail(
            f"{', '.join(m.label for m in overran)} still running after {timeout} s\n{describe(results)}"
        )
    return results


def assert_namespaces_empty(net):
    """Nothing outlives the job: no worker, torchrun agent or resource tracker (given a moment to exit)."""
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


def launch_machines(net, folder, env, argv_of, label="machine"):
    """One launch per machine: argv_of(i) is machine i's command, run in its namespace under its host name.
    env is one environment for both, or a list of one per machine."""
    envs = env if isinstance(env, list) else [env, env]
    return [
        Machine(f"{label}{i}", ns, argv_of(i), envs[i], folder, f"node{i}")
        for i, ns in enumerate((net.ns_a, net.ns_b))
    ]


def script_machines(net, port, data_dir, folder, env, timeout=PEER_TIMEOUT, master_addr="node0", extra=()):
    """The script's own two-machine launch, the README's command: 2 processes on each of node0 and node1, and
    --metrics-json on machine 0 alone, as users give it. master_addr is one for both machines, or a list."""
    addrs = master_addr if isinstance(master_addr, list) else [master_addr, master_addr]
    return launch_machines(
        net,
        folder,
        env,
        lambda i: [
            *[sys.executable, SCRIPT, "--num-machines", 2, "--machine-id", i, "--num-processes", 2],
            *["--master-addr", addrs[i], "--master-port", port, *common_args(data_dir, timeout)],
            *(["--metrics-json", folder / "m0.json"] if i == 0 else []),
            *extra,
        ],
    )


def torchrun_machines(net, data_dir, folder, rendezvous, metrics_on=(0,)):
    """torchrun on each machine, 2 processes each, with the given rendezvous flags; the machines in metrics_on
    are given --metrics-json (machine 0 alone, as users do, where it is known to host rank 0)."""
    return launch_machines(
        net,
        folder,
        env_without_interface(),
        lambda i: [
            *[sys.executable, "-m", "torch.distributed.run", "--nnodes", 2, "--nproc-per-node", 2],
            *rendezvous(i),
            *[SCRIPT, *common_args(data_dir)],
            *(["--metrics-json", folder / f"m{i}.json"] if i in metrics_on else []),
        ],
        label="torchrun",
    )


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


def machine_lines(net):
    """What rank 0 prints for each machine: its host name, processes, and the interface and address Gloo uses:
    the veth, never loopback, though machine 0's own name resolves to 127.0.1.1 there."""
    return [
        f"Machine 0 (node0): 2 processes, Gloo on {net.if_a} {net.addr_a}",
        f"Machine 1 (node1): 2 processes, Gloo on {net.if_b} {net.addr_b}",
    ]


def check_trained_together(net, results, folder):
    """One group of 4 trained; rank 0 lives on machine 0, which alone prints results; nothing is left."""
    assert [r.returncode for r in results] == [0, 0], describe(results)
    check_metrics(folder / "m0.json", 4)
    assert "Finished training in" in results[0].stdout
    lines = results[0].stdout.splitlines()
    for line in machine_lines(net):
        assert line in lines, describe(results)
    assert not any(
        line.startswith(("epoch: ", "Test set", "Finished training"))
        for line in results[1].stdout.splitlines()
    ), results[1].stdout
    assert not (folder / "m1.json").exists()
    assert_namespaces_empty(net)


@pytest.mark.timeout(RUN_SECONDS + 60)
def test_script_launch_across_two_hosts_by_name(network, data_dir, tmp_path):
    """The script's own launch, once per machine, --master-addr node0: one group of 4 ranks, though node0 maps
    its own name to 127.0.1.1. GLOO_SOCKET_IFNAME is not set: the script finds each machine's interface."""
    machines = script_machines(network, random_port(), data_dir, tmp_path, env_without_interface())
    check_trained_together(network, finish_all(machines, RUN_SECONDS), tmp_path)


@pytest.mark.timeout(RUN_SECONDS + 60)
def test_torchrun_static_across_two_hosts_by_name(network, data_dir, tmp_path):
    """torchrun on each machine, static rendezvous on node0's TCPStore at --master-addr:--master-port."""
    port = random_port()
    machines = torchrun_machines(
        network,
        data_dir,
        tmp_path,
        lambda i: ["--node-rank", i, "--master-addr", "node0", "--master-port", port],
    )
    check_trained_together(network, finish_all(machines, RUN_SECONDS), tmp_path)


@pytest.mark.timeout(RUN_SECONDS + 60)
def test_torchrun_c10d_across_two_hosts(network, data_dir, tmp_path):
    """torchrun's c10d rendezvous, the one PyTorch recommends for several nodes: the same command on both,
    the node ranks are torchrun's to give. Rank 0 may land on either machine."""
    endpoint, job = f"node0:{random_port()}", secrets.token_hex(4)
    machines = torchrun_machines(
        network,
        data_dir,
        tmp_path,
        lambda i: ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job],
        metrics_on=(0, 1),  # rank 0 may land on either machine: each writes its own file if it hosts rank 0
    )
    results = finish_all(machines, RUN_SECONDS)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    first = 0 if (tmp_path / "m0.json").exists() else 1  # the machine that got rank 0
    assert not (tmp_path / f"m{1 - first}.json").exists()
    check_metrics(tmp_path / f"m{first}.json", 4)
    lines = results[first].stdout.splitlines()
    for host, interface, address in (
        ("node0", network.if_a, network.addr_a),
        ("node1", network.if_b, network.addr_b),
    ):
        assert any(f"({host}): 2 processes, Gloo on {interface} {address}" in line for line in lines), (
            describe(results)
        )
    assert_namespaces_empty(network)


@pytest.mark.timeout(RUN_SECONDS + 60)
def test_ipv6_only_hosts(network6, data_dir, tmp_path):
    """Hosts with IPv6 addresses only: machine 0 is given its address in brackets, machine 1 a name that
    resolves to IPv6 only."""
    machines = script_machines(
        network6,
        random_port(),
        data_dir,
        tmp_path,
        env_without_interface(),
        master_addr=[f"[{network6.addr_a}]", "node0"],
    )
    check_trained_together(network6, finish_all(machines, RUN_SECONDS), tmp_path)


CHECK_SECONDS = 60  # a check makes the group and averages once: seconds, not an epoch


@pytest.mark.timeout(CHECK_SECONDS + 60)
def test_check_makes_the_group_and_reports_each_machine(network, data_dir, tmp_path):
    """--check with the launch commands of a real run: one line per machine, then exit 0, no training."""
    machines = script_machines(
        network, random_port(), data_dir, tmp_path, env_without_interface(), extra=["--check"]
    )
    results = finish_all(machines, CHECK_SECONDS)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    lines = results[0].stdout.splitlines()
    assert lines[:-1] == [
        *machine_lines(network),
        "Check passed: 4 processes on 2 machines reached each other",
    ], lines
    assert lines[-1].startswith("Network: averaging the gradients (1.2 MB) took ~"), lines  # a step's cost
    assert results[1].stdout == ""
    assert not any((tmp_path / f"m{i}.json").exists() for i in range(2))  # nothing trained
    assert_namespaces_empty(network)


WRONG_IFNAME_SECONDS = 60  # well under the peers' --timeout: a bad name is reported, not waited out


@pytest.mark.timeout(WRONG_IFNAME_SECONDS + 60)
@pytest.mark.parametrize("ifname", ["nosuchif0", "noaddr0"])
def test_wrong_gloo_socket_ifname_is_a_clear_error(network, data_dir, tmp_path, ifname):
    """GLOO_SOCKET_IFNAME naming no interface, or one without an address: each machine stops soon, saying
    which setting is wrong and which interfaces it has."""
    for ns in (network.ns_a, network.ns_b):  # an interface that is up but has no address
        ip("-n", ns, "link", "add", "noaddr0", "type", "veth", "peer", "name", "noaddr1")
        ip("-n", ns, "link", "set", "noaddr0", "up")
    env = env_without_interface()
    env["GLOO_SOCKET_IFNAME"] = ifname
    machines = script_machines(
        network, random_port(), data_dir, tmp_path, env, timeout=2 * WRONG_IFNAME_SECONDS
    )
    results = finish_all(machines, WRONG_IFNAME_SECONDS)
    for r, interface in zip(results, (network.if_a, network.if_b)):
        assert r.returncode == 1, describe(results)
        errors = r.stderr.strip().splitlines()
        assert errors == [errors[0]] and errors[0].startswith(f"error: GLOO_SOCKET_IFNAME={ifname}: "), (
            describe([r])
        )
        assert interface in errors[0], describe([r])  # names the interfaces it could have used
        assert "epoch: " not in r.stdout
    assert not (tmp_path / "m0.json").exists()
    assert_namespaces_empty(network)


REFUSED_TIMEOUT = (
    60  # the peers' --timeout here: Gloo on machine 0 would wait 5 x that for connections that never come
)


@pytest.mark.timeout(RUN_SECONDS + 60)
def test_gloo_connection_refused_is_one_line_on_every_machine(network, data_dir, tmp_path):
    """Machine 0 told to use loopback (GLOO_SOCKET_IFNAME=lo): machine 1's Gloo connections are refused at
    once. Machine 0's Gloo waited 5 x --timeout for machine 1's processes, long gone; now both machines end
    within seconds with machine 1's line, one per machine, no traceback, nothing left running."""
    env0, env1 = env_without_interface(), env_without_interface()
    env0["GLOO_SOCKET_IFNAME"] = "lo"
    machines = script_machines(
        network, random_port(), data_dir, tmp_path, [env0, env1], timeout=REFUSED_TIMEOUT
    )
    results = finish_all(machines, RUN_SECONDS)
    for r in results:
        assert r.returncode == 1 and r.seconds < REFUSED_TIMEOUT, describe(results)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: rank "), describe([r])
        assert (
            "Gloo cannot connect the processes" in lines[0] and "GLOO_SOCKET_IFNAME" in lines[0]
        )  # what to do
        assert "epoch: " not in r.stdout
    assert_namespaces_empty(network)


FIREWALL_SECONDS = (
    30  # start-up, the roll call and a few seconds' check; Gloo waited out the SYN retries: 139 s
)


@pytest.mark.timeout(FIREWALL_SECONDS + 60)
@pytest.mark.parametrize("walled", [(0, 1), (1,)])
def test_a_firewall_open_on_the_rendezvous_port_alone_is_named_within_seconds(
    network, data_dir, tmp_path, walled
):
    """The walled machines drop every new incoming TCP connection but those to machine 0's --master-port, as
    users do when told to "open the port". The rendezvous worked, then Gloo's connections waited out the
    kernel's SYN retries, whatever --timeout. Now each machine names which cannot reach which, and where,
    within seconds of the roll call: where machine 1 alone is walled, machine 0 finds it, and machine 1 says
    machine 0's line, though machine 0 serves the store and goes first."""
    if not shutil.which("iptables"):
        pytest.skip("needs iptables (Debian: apt-get install iptables)")
    port = random_port()
    for ns in ((network.ns_a, network.ns_b)[m] for m in walled):
        rules = [["-i", "lo", "-j", "ACCEPT"], ["-p", "tcp", "--syn", "!", "--dport", port, "-j", "DROP"]]
        for rule in rules:
            subprocess.run(
                ["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", *map(str, rule)], check=True
            )
    machines = script_machines(
        network, port, data_dir, tmp_path, env_without_interface(), timeout=300, extra=["--check"]
    )
    results = finish_all(machines, FIREWALL_SECONDS)
    named = re.compile(
        rf"error: machine (0|1) \(node\1\) cannot reach machine (?!\1)(0|1) \(node\2\) at "
        rf"({re.escape(network.addr_a)}|{re.escape(network.addr_b)}) port \d+ \(timed out\), "
        "though it reaches the rendezvous: open all TCP ports between the machines, or set "
        "GLOO_SOCKET_IFNAME on each to the interface that reaches them"
    )
    for r in results:
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and named.fullmatch(lines[0]), describe(results)
        unreachable = named.fullmatch(lines[0])
        assert int(unreachable[2]) in walled, lines[0]
        assert unreachable[3] == (network.addr_a, network.addr_b)[int(unreachable[2])], lines[0]
        assert "Check passed" not in r.stdout
    if walled == (1,):  # one line, the machine that found it: on both machines
        assert results[0].stderr == results[1].stderr, describe(results)
    assert_namespaces_empty(network)


LARGE_PACKETS_SECONDS = 30  # start-up, the roll call and the check's 5 s wait; a gradient was lost at 60+ s


@pytest.mark.timeout(2 * LARGE_PACKETS_SECONDS + 60)
def test_a_path_that_drops_large_packets_is_named_within_seconds(network, data_dir, tmp_path):
    """Jumbo frames (MTU 9000) on both hosts, and a path that drops every packet over 1,500 bytes, sending no
    ICMP back (a 1,500-byte hop between them): the rendezvous and the reachability check's connections
    passed, --check said "Check passed", and the first gradient never came: "lost contact ... another
    process stopped" 60 s later. Now the check sends a gradient bucket's size each way, and both --check and
    a run stop within seconds, each machine saying the large packets were lost and how to check the MTU."""
    if not shutil.which("iptables"):
        pytest.skip("needs iptables (Debian: apt-get install iptables)")
    for ns, interface in ((network.ns_a, network.if_a), (network.ns_b, network.if_b)):
        ip("-n", ns, "link", "set", interface, "mtu", "9000")
        rule = ["-i", interface, "-m", "length", "--length", "1501:65535", "-j", "DROP"]
        subprocess.run(["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", *rule], check=True)
    for extra in (["--check"], []):
        machines = script_machines(
            network, random_port(), data_dir, tmp_path, env_without_interface(), timeout=300, extra=extra
        )
        results = finish_all(machines, LARGE_PACKETS_SECONDS)
        for r in results:
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 1 and len(lines) == 1, describe(results)
            assert "the path drops large packets: check its MTU (ping -M do -s 1472 " in lines[0], lines[0]
            assert "Check passed" not in r.stdout and "epoch: " not in r.stdout
        assert_namespaces_empty(network)


def listening_addresses(ns):
    """The local address:port of every listening TCP socket in namespace ns."""
    result = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-tlnH"], capture_output=True, text=True, timeout=30
    )
    return {line.split()[3] for line in result.stdout.splitlines() if line.strip()}


@pytest.mark.timeout(RUN_SECONDS + 60)
def test_a_job_on_one_machine_listens_on_loopback_only(network, data_dir, tmp_path):
    """2 processes on one machine whose name resolves to its network address, as on most hosts but Debian's:
    the rendezvous and Gloo, which carry no authentication, listen on loopback only, out of other machines'
    reach. Before, the rendezvous listened on every interface and Gloo on the name's address."""
    with open(f"/etc/netns/{network.ns_a}/hosts", "w") as f:
        f.write(f"127.0.0.1 localhost\n{network.addr_a} node0\n")
    port = random_port()
    argv = [sys.executable, SCRIPT, "--num-processes", 2, "--master-port", port, *common_args(data_dir)]
    machine = Machine("machine0", network.ns_a, argv, env_without_interface(), tmp_path, "node0")
    seen = set()
    while machine.proc.poll() is None and time.monotonic() - machine.start < RUN_SECONDS:
        seen |= listening_addresses(network.ns_a)  # every socket the job listens on, the whole run long
        time.sleep(0.05)
    result = finish_all([machine], 10)[0]
    assert result.returncode == 0 and "Finished training in" in result.stdout, describe([result])
    assert f"127.0.0.1:{port}" in seen, seen  # the rendezvous
    assert len(seen) >= 3, seen  # and Gloo, a port for each of the 2 processes
    assert all(address.startswith("127.0.0.1:") for address in seen), seen
    assert_namespaces_empty(network)


@pytest.mark.timeout(CHECK_SECONDS + 60)
@pytest.mark.parametrize("label", [None, "1"])
def test_machine_0_reached_at_its_secondary_address(network, data_dir, tmp_path, label):
    """Machine 1 reaches machine 0 at a second address of its interface (a cloud's second IP, a keepalived
    floating address), added plainly or under an alias label (ip addr add ... label eth0:1). Only the first
    address of an interface was listed, and machine 0 stopped with a false "a NAT between them?". Gloo
    listens on the first address of the interface, or on the alias's, which GLOO_SOCKET_IFNAME also takes."""
    secondary = str(ipaddress.ip_address(network.addr_a) + 100)
    alias = f"{network.if_a}:{label}" if label else None
    ip(
        "-n",
        network.ns_a,
        "addr",
        "add",
        f"{secondary}/24",
        "dev",
        network.if_a,
        *(["label", alias] if alias else []),
    )
    machines = script_machines(
        network,
        random_port(),
        data_dir,
        tmp_path,
        env_without_interface(),
        master_addr=["node0", secondary],
        extra=["--check"],
    )
    results = finish_all(machines, CHECK_SECONDS)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    machine0 = (
        f"Machine 0 (node0): 2 processes, Gloo on {alias} {secondary}" if alias else machine_lines(network)[0]
    )
    lines = results[0].stdout.splitlines()
    check = [
        machine0,
        machine_lines(network)[1],
        "Check passed: 4 processes on 2 machines reached each other",
    ]
    assert lines[:-1] == check and lines[-1].startswith("Network: averaging the gradients"), lines


ELASTIC_SECONDS = 240  # start, an epoch, the kill, torchrun's restart on the survivor, two more epochs
ELASTIC_EPOCHS = 3


@pytest.mark.timeout(ELASTIC_SECONDS + 60)
def test_elastic_torchrun_carries_on_without_a_node_that_died(network, data_dir, tmp_path):
    """torchrun --nnodes 1:2 --max-restarts 3 on both hosts, with --checkpoint --resume. After the first
    checkpoint every process of node1 is killed outright: node0's rank notices (its Gloo connection is reset),
    torchrun restarts it in a group of one, which resumes from the last complete epoch, naming the restart."""
    endpoint, job, ck = f"node0:{random_port()}", secrets.token_hex(4), tmp_path / "ck.pt"
    machines = launch_machines(
        network,
        tmp_path,
        env_without_interface(),
        lambda i: [
            *[sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", 1],
            *["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--max-restarts", 3],
            *["--rdzv-conf", "last_call_timeout=1", "--monitor-interval", 0.5],
            *[
                SCRIPT,
                *common_args(data_dir, timeout=30),
                "--epochs",
                ELASTIC_EPOCHS,
                "--checkpoint",
                ck,
                "--resume",
            ],
            *["--metrics-json", tmp_path / "m.json", "--threads", 1],
        ],
        label="torchrun",
    )
    deadline = time.monotonic() + ELASTIC_SECONDS
    while not ck.exists() and time.monotonic() < deadline and all(m.proc.poll() is None for m in machines):
        time.sleep(0.1)
    assert ck.exists(), describe([m.result() for m in machines])
    for pid in netns_pids(network.ns_b):  # node1 dies outright: its agent and its worker
        os.kill(pid, signal.SIGKILL)
    done = torch.load(ck, map_location="cpu", weights_only=True)["epoch"]
    survivor, node1 = finish_all(machines, max(10, deadline - time.monotonic()))
    assert node1.returncode == -signal.SIGKILL
    assert survivor.returncode == 0, describe([survivor, node1])
    assert done < ELASTIC_EPOCHS - 1, f"both nodes finished epoch {done} before the kill"
    lines = survivor.stdout.splitlines()
    restarted = [line for line in lines if line.startswith("World size 1 = 1 machine x 1 process;")]
    assert restarted and restarted[-1].endswith("(torchrun, restart 1)"), describe([survivor])
    resumed = [line for line in lines if line.startswith(f"Resuming from {ck}: epoch ")]
    assert resumed, describe([survivor])
    m = read_json(tmp_path / "m.json")
    assert m["world_size"] == 1 and m["test_samples"] == N_TEST and m["test_accuracy"] > 0.8
    assert m["history"][-1]["epoch"] == ELASTIC_EPOCHS - 1
    assert torch.load(ck, map_location="cpu", weights_only=True)["epoch"] == ELASTIC_EPOCHS - 1
    assert_namespaces_empty(network)


GROW_EPOCHS = 16  # enough that node1 joins while node0 is still training: it joined after node0's 2nd epoch


@pytest.mark.timeout(ELASTIC_SECONDS + 60)
def test_elastic_torchrun_grows_when_a_node_joins(network, data_dir, tmp_path):
    """torchrun --nnodes 1:2 on node0 alone trains in a group of one; node1 starts after the first checkpoint,
    and node0's agent restarts its worker into a group of two, which resumes from the last complete epoch and
    finishes together. A membership change keeps torchrun's restart count, so the group of two must not meet
    the group of one's keys in the store."""
    endpoint, job, ck = f"node0:{random_port()}", secrets.token_hex(4), tmp_path / "ck.pt"

    def argv(i):
        return [
            *[sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", 1],
            *["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--max-restarts", 3],
            *["--rdzv-conf", "last_call_timeout=1", "--monitor-interval", 0.5],
            *[
                SCRIPT,
                *common_args(data_dir, timeout=30),
                "--epochs",
                GROW_EPOCHS,
                "--checkpoint",
                ck,
                "--resume",
            ],
            *["--metrics-json", tmp_path / "m.json", "--threads", 1],
        ]

    # torch's agents share one TCP store and publish machine 0's address only at their first rendezvous: a
    # node joining later waits for it forever (torch 2.14). docs/launching.md sets this for a growing group.
    env = {**env_without_interface(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    node0 = Machine("torchrun0", network.ns_a, argv(0), env, tmp_path, "node0")
    deadline = time.monotonic() + ELASTIC_SECONDS
    while not ck.exists() and time.monotonic() < deadline and node0.proc.poll() is None:
        time.sleep(0.1)
    assert ck.exists(), describe([node0.result()])
    node1 = Machine("torchrun1", network.ns_b, argv(1), env, tmp_path, "node1")
    joined_at = torch.load(ck, map_location="cpu", weights_only=True)["epoch"]
    first, second = finish_all([node0, node1], max(10, deadline - time.monotonic()))
    assert (first.returncode, second.returncode) == (0, 0), describe([first, second])
    lines = first.stdout.splitlines()
    alone = [n for n, line in enumerate(lines) if line.startswith("World size 1 = 1 machine x 1 process;")]
    together = [
        n for n, line in enumerate(lines) if line.startswith("World size 2 = 2 machines x 1 process;")
    ]
    assert alone and together and alone[0] < together[-1], describe([first, second])
    assert lines[together[-1]].endswith("(torchrun)"), describe(
        [first, second]
    )  # grown, not restarted after a failure
    # None of the scripts' lines; torch's agent may log that it could not shut a rendezvous whose host left.
    stderr = (first.stderr + second.stderr).splitlines()
    assert not [line for line in stderr if line.startswith("error") or "Traceback" in line], describe(
        [first, second]
    )
    resumed = [
        line for line in lines[alone[0] : together[-1]] if line.startswith(f"Resuming from {ck}: epoch ")
    ]
    assert resumed, describe([first, second])
    m = read_json(tmp_path / "m.json")
    assert m["world_size"] == 2 and m["test_samples"] == N_TEST and m["test_accuracy"] > 0.8, m
    assert m["history"][-1]["epoch"] == GROW_EPOCHS - 1
    assert joined_at < GROW_EPOCHS - 1, f"node0 had finished epoch {joined_at} when node1 started"
    assert torch.load(ck, map_location="cpu", weights_only=True)["epoch"] == GROW_EPOCHS - 1
    assert_namespaces_empty(network)


COPIED_SECONDS = 40  # start-up and the roll call; well under the --timeout of 120 the launches are given


@pytest.mark.timeout(COPIED_SECONDS + 60)
def test_a_copied_machine_id_is_named_on_every_machine_within_seconds(network, data_dir, tmp_path):
    """Machine 0's command copied to machine 1, --machine-id 0 and all: the count of arrivals was met, and
    machine 0 failed after --timeout, blaming the network. Now each machine says what is wrong in one line."""
    port = random_port()
    machines = launch_machines(
        network,
        tmp_path,
        env_without_interface(),
        lambda i: [
            *[
                sys.executable,
                SCRIPT,
                "--num-machines",
                2,
                "--machine-id",
                0,
                "--num-processes",
                2,
                "--check",
            ],
            *["--master-addr", "node0", "--master-port", port, "--timeout", 120],
        ],
    )
    results = finish_all(machines, COPIED_SECONDS)
    for r in results:
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, describe(results)
        assert lines[0].startswith("error: rank 0 joined twice, from machine 0 on node"), describe(results)
        assert "give each machine its own --machine-id (0 to 1)" in lines[0]
    assert all(r.seconds < COPIED_SECONDS for r in results)
    assert_namespaces_empty(network)


def mpirun_env(net, folder):
    """The environment for mpirun on node0: Open MPI starts node1's daemon through its rsh agent (here a
    script that enters node1's namespace, where a cluster would ssh)."""
    if not shutil.which("mpirun"):
        pytest.skip("needs mpirun (Debian: apt-get install openmpi-bin)")
    agent = folder / "agent.sh"
    agent.write_text(
        "#!/bin/sh\n"
        "# Open MPI's rsh agent, called as: agent HOST COMMAND...; "
        "the host is a namespace with its own name.\n"
        f'case "$1" in node0) ns={net.ns_a};; node1) ns={net.ns_b};; *) exit 1;; esac\n'
        'host="$1"; shift\n'
        'exec ip netns exec "$ns" unshare --uts sh -c "hostname $host; $*"\n'
    )
    agent.chmod(0o755)
    env = script_env(
        OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_plm_rsh_agent=str(agent)
    )
    env.pop("GLOO_SOCKET_IFNAME", None)
    return env


MPI_SECONDS = 120  # one mpirun job of 4 ranks on two hosts; about 20 s on 2 cores


@pytest.mark.timeout(2 * MPI_SECONDS + 60)
def test_mpirun_across_two_hosts(network, data_dir, tmp_path):
    """The mpirun line of docs/launching.md, -H node0:2,node1:2: Open MPI starts node1's daemon through its
    rsh agent (here a script that enters node1's namespace, where a cluster would ssh). Without machine 0's
    address every rank stops with one line, nothing trained; with -x MASTER_ADDR=node0, one group of 4."""
    env = mpirun_env(network, tmp_path)
    port = random_port()

    def mpirun(label, *exports):
        argv = ["mpirun", "-np", 4, "-H", "node0:2,node1:2", *exports, "-x", f"MASTER_PORT={port}"]
        argv += [sys.executable, SCRIPT, *common_args(data_dir), "--metrics-json", tmp_path / f"{label}.json"]
        return finish_all([Machine(label, network.ns_a, argv, env, tmp_path, "node0")], MPI_SECONDS)[0]

    unset = mpirun("unset")
    said = [line for line in unset.stderr.splitlines() if "error" in line]
    # Each rank says it once; mpirun may stop the slower ranks first, and adds its own banner.
    assert unset.returncode == 2 and 1 <= len(said) <= 4, describe([unset])
    assert set(said) == {
        "convnet_distributed.py: error: Open MPI runs this job on 2 machines: give machine 0's address as "
        "--master-addr or MASTER_ADDR (mpirun -x MASTER_ADDR=node0) (see --help)"
    }, describe([unset])
    assert not (tmp_path / "unset.json").exists() and "epoch: " not in unset.stdout
    assert_namespaces_empty(network)

    given = mpirun("given", "-x", "MASTER_ADDR=node0")
    assert given.returncode == 0, describe([given])
    lines = given.stdout.splitlines()
    layout = next(line for line in lines if line.startswith("World size"))
    assert layout.startswith("World size 4 = 2 machines x 2 processes;"), layout
    assert layout.endswith("(mpirun, Open MPI: 4 ranks)"), layout
    for line in machine_lines(network):
        assert line in lines, describe([given])
    assert given.stdout.count("Finished training in") == 1  # rank 0 alone reports
    m = check_metrics(tmp_path / "given.json", 4)
    assert m["allreduce"] == "gloo"  # across machines
    assert_namespaces_empty(network)

    # Uneven slots, then round-robin placement: the machine index was rank // local size, so the ranks
    # disagreed on the machines (a wrong "same --num-machines" line) or two claimed machine 0. Now the roll
    # call counts by host.
    for label, placement, sizes, first in (
        (
            "uneven",
            ["-np", 3, "-H", "node0:2,node1:1"],
            (2, 1),
            "World size 3 = 2 machines (2 + 1 processes);",
        ),
        (
            "cyclic",
            ["-np", 4, "-H", "node0:2,node1:2", "--map-by", "node"],
            (2, 2),
            "World size 4 = 2 machines x 2",
        ),
    ):
        argv = ["mpirun", *placement, "-x", "MASTER_ADDR=node0", "-x", f"MASTER_PORT={port}"]
        argv += [sys.executable, SCRIPT, *common_args(data_dir), "--metrics-json", tmp_path / f"{label}.json"]
        run = finish_all([Machine(label, network.ns_a, argv, env, tmp_path, "node0")], MPI_SECONDS)[0]
        assert run.returncode == 0, describe([run])
        lines = run.stdout.splitlines()
        assert next(line for line in lines if line.startswith("World size")).startswith(first), describe(
            [run]
        )
        for machine, (host, count) in enumerate(zip(("node0", "node1"), sizes)):
            assert any(line.startswith(f"Machine {machine} ({host}): {count} process") for line in lines), (
                lines
            )
        check_metrics(tmp_path / f"{label}.json", sum(sizes))
        assert_namespaces_empty(network)


def mpirun_job(net, folder, env, label, *argv, sh=None, placement=()):
    """An mpirun job of 4 ranks on node0 and node1 (no MASTER_PORT: 8892), started on node0; sh: a shell line
    each rank runs first, the script's command its "$@"."""
    command = [sys.executable, SCRIPT, *argv]
    wrap = ["sh", "-c", f'{sh}; exec "$@"', "sh"] if sh else []
    mpirun = [
        "mpirun",
        "-np",
        4,
        "-H",
        "node0:2,node1:2",
        *placement,
        "-x",
        "MASTER_ADDR=node0",
        *wrap,
        *command,
    ]
    return Machine(label, net.ns_a, mpirun, env, folder, "node0")


def wait_for_text(machine, text, within):
    deadline = time.monotonic() + within
    while text not in machine.out.read_text():
        assert machine.proc.poll() is None and time.monotonic() < deadline, describe([machine.result()])
        time.sleep(0.1)


@pytest.mark.timeout(2 * MPI_SECONDS + 60)
@pytest.mark.parametrize(
    "differs, b_first",
    [
        (["--lr", "0.4"], "if [ $(hostname) = node0 ]; then sleep 600; fi"),  # B's node1 ranks come alone
        (["--checkpoint", "b.pt"], None),  # B's rank 0 finds A holding the port
    ],
)
def test_two_mpirun_jobs_across_the_same_hosts_never_stop_each_other(
    network, data_dir, tmp_path, differs, b_first
):
    """Nothing sets a port under MPI: two mpirun jobs across the same hosts both take 8892, and the launch id
    was compared on machine 0 alone. Job B's ranks on node1 reached job A's store as A formed, and stopped A
    ("the machines disagree on --lr"); where only --checkpoint differed, B's rank 0, whose port A held, did
    ("rank 0 joined twice"). Now a process of another launch (PMIx's namespace) stops alone, naming its own
    cause, and A trains. A's ranks on node1 start once B has ended: A still forms while B comes."""
    env, go = mpirun_env(network, tmp_path), tmp_path / "go"
    a_args = [*common_args(data_dir), "--metrics-json", tmp_path / "a.json"]
    a_first = f"if [ $(hostname) = node1 ]; then while [ ! -e {go} ]; do sleep 0.2; done; fi"
    a = mpirun_job(network, tmp_path, env, "jobA", *a_args, sh=a_first)
    wait_for_text(a, "2 of 4 processes have joined; waiting for ranks 2, 3", MPI_SECONDS)
    b = mpirun_job(network, tmp_path, env, "jobB", *common_args(data_dir), *differs, sh=b_first)
    (job_b,) = finish_all([b], MPI_SECONDS)
    go.touch()
    (job_a,) = finish_all([a], MPI_SECONDS)
    assert job_a.returncode == 0 and "error" not in job_a.stderr, describe([job_a, job_b])
    check_metrics(tmp_path / "a.json", 4)
    said = [line for line in job_b.stderr.splitlines() if line.startswith("error")]
    assert job_b.returncode != 0 and said, describe([job_b])
    own = (
        "error: cannot serve the rendezvous on node0:8892 (Address already in use): another program holds "
        "the port: choose a free --master-port",
        "error: node0:8892 is another job's rendezvous",
    )
    assert all(line.startswith(own) for line in said), describe([job_b])
    assert any(line.startswith(own[1 if b_first else 0]) for line in said), describe([job_b])
    assert not (tmp_path / "b.pt").exists()
    assert_namespaces_empty(network)


@pytest.mark.timeout(MPI_SECONDS + 60)
def test_mpirun_by_node_names_each_rank_by_its_host_not_a_guessed_machine(network, data_dir, tmp_path):
    """mpirun --map-by node puts ranks 1 and 3 on node1; the machine index was guessed as rank // local size,
    and a flag that differs between the hosts (here a shell line picks --lr by host) was said as
    "machine 0 (node1) has --lr 0.4". Under MPI the roll call tells machines by host: the line names ranks."""
    env = mpirun_env(network, tmp_path)
    sh = 'set -- "$@" --lr $(case $(hostname) in node1) echo 0.4;; *) echo 0.5;; esac)'
    run = mpirun_job(network, tmp_path, env, "bynode", *common_args(data_dir), "--check", sh=sh,
                     placement=["--map-by", "node"])  # fmt: skip
    (result,) = finish_all([run], MPI_SECONDS)
    said = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode != 0 and said, describe([result])
    for line in said:
        assert re.fullmatch(
            r"error: the machines disagree on --lr: machine 0 \(node0\) has --lr 0\.5; "
            r"rank [13] \(node1\) has --lr 0\.4: use the same --lr on every machine",
            line,
        ), describe([result])
    assert_namespaces_empty(network)


STOPPED_TIMEOUT = 20  # machine 1's --timeout while machine 0 is stopped


def socket_held(pid):
    """Whether the process holds a socket: machine 0's first is its rendezvous port's."""
    with contextlib.suppress(OSError):
        return any(
            os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:") for fd in os.listdir(f"/proc/{pid}/fd")
        )
    return False


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hosts", ["one host", "two hosts"])
@pytest.mark.parametrize("stopped", ["bound", "serving"])
def test_a_machine_0_stopped_as_it_starts_freezes_no_other_machine(
    network, data_dir, tmp_path, hosts, stopped
):
    """Machine 0 listened from its start, long before its store served: machine 1 connected, and TCPStore's
    client waited in C++ for an answer, deaf to Ctrl-C, SIGTERM and --timeout; with machine 0 stopped
    (SIGSTOP) there, machine 1 ran till killed. Now machine 0's port refuses connections till its store
    serves, and machine 1 waits for the store in Python. Machine 0 stopped once its port is bound, or once its
    store serves: machine 1 stops by itself with one line at --timeout, and at once on Ctrl-C (sent once it
    says it waits: a loaded host's import of torch, where Ctrl-C is Python's traceback, took 8 s)."""
    port, addr = random_port(), "node0" if hosts == "two hosts" else "127.0.0.1"
    env, ns1 = env_without_interface(), network.ns_b if hosts == "two hosts" else network.ns_a

    def argv(machine, timeout):
        return [sys.executable, SCRIPT, "--num-machines", 2, "--machine-id", machine, "--master-addr", addr,
                "--master-port", port, "--check", "--timeout", timeout]  # fmt: skip

    machine0 = Machine("machine0", network.ns_a, argv(0, 120), env, tmp_path, "node0")
    try:
        deadline = time.monotonic() + 60
        while not (socket_held(machine0.proc.pid) if stopped == "bound" else "waiting for machine 1" in
                   machine0.out.read_text()):  # fmt: skip
            assert machine0.proc.poll() is None and time.monotonic() < deadline, describe([machine0.result()])
            time.sleep(0.05)
        time.sleep(0.5 if stopped == "bound" else 0)  # its first socket: bound within microseconds
        os.killpg(machine0.proc.pid, signal.SIGSTOP)
        timed = Machine("timed", ns1, argv(1, STOPPED_TIMEOUT), env, tmp_path, "node1")
        stopped_by_hand = Machine("ctrl-c", ns1, argv(1, 120), env, tmp_path, "node1")
        wait_for_text(stopped_by_hand, "Waiting for machine 0 at ", 60)  # waiting, not importing torch
        time.sleep(max(0, 8 - (time.monotonic() - stopped_by_hand.start)))
        os.killpg(stopped_by_hand.proc.pid, signal.SIGINT)
        (by_hand,) = finish_all([stopped_by_hand], 10)
        (result,) = finish_all([timed], 60 - (time.monotonic() - timed.start))  # its own line, by 60 s
    finally:
        os.killpg(machine0.proc.pid, signal.SIGKILL)
        os.killpg(machine0.proc.pid, signal.SIGCONT)
    errors = by_hand.stderr.splitlines()
    assert by_hand.returncode == 130 and errors in ([], ["Interrupted: every process of this launch stopped"])
    errors = result.stderr.splitlines()
    assert result.returncode == 1 and len(errors) == 1, describe([result])
    assert errors[0].startswith("error: rank 1: ") and f"within --timeout {STOPPED_TIMEOUT} s" in errors[0]
    assert "--master-port" not in errors[0] or stopped == "bound", errors  # not blamed on the port
