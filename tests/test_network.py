"""Networks on one host: names that do not resolve, IPv6 literals, torchrun's c10d rendezvous, --check, and
machines that share one --data-dir and download into it at once. Two-host cases are in test_multihost.py."""

import gzip
import hashlib
import http.server
import os
import subprocess
import sys
import threading
import time
import types

import pytest
import torch.distributed as dist

import convnet_distributed
from conftest import FILES, REPO, finish, free_port, read_json, run_script, script_env, write_dataset
from test_training import torchrun


def test_master_addr_takes_ipv6_literals_with_or_without_brackets(clean_env):
    for given in ("[fd00::1]", "fd00::1"):
        assert convnet_distributed.parse_args(["--master-addr", given]).master_addr == "fd00::1"


def test_loopback_is_told_apart_from_reachable_addresses():
    for address in ("127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.1.1"):
        assert convnet_distributed.is_loopback(address), address
    for address in ("10.0.0.1", "198.18.0.1", "fd00::1", "fe80::1"):
        assert not convnet_distributed.is_loopback(address), address


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interface addresses are read on Linux only")
def test_interface_addresses_lists_ipv4_before_ipv6():
    addresses = convnet_distributed.interface_addresses()
    assert addresses["lo"][0] == "127.0.0.1"  # IPv4 first: the one Gloo takes from an interface with both
    assert all(not a.startswith("fe80") for a in addresses["lo"])


@pytest.mark.parametrize(
    "value", [b"node1", b"99999 node1", b"\xff\xfe node1", b"1 " + b"x" * 300, b"10.0.0.2 4242 node1"]
)
def test_a_bad_value_for_the_reachability_check_is_one_line(clean_env, value):
    """What machine 1 published for the check, read by machine 0, is not a port and a host (another program
    wrote it): one line naming the key, machine 1's, never a traceback. An address there is one too: each
    machine probes the address the roll call gave it (any writer of the store could send it anywhere)."""
    port = free_port()
    args = convnet_distributed.parse_args(
        ["--num-machines", "2", "--num-processes", "1", "--master-port", str(port)]
    )
    args.addresses = ["127.0.0.1", "127.0.0.1"]  # the roll call's
    store = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    store.set("probe/1", value)
    with pytest.raises(SystemExit) as exited:
        convnet_distributed.reach_every_machine(store, 0, args)
    line = str(exited.value)
    assert line.startswith("error: rank 0: another program wrote probe/1 = b")
    assert line.endswith(": use another --master-port")
    assert len(line) < 300 and "\n" not in line


def test_a_master_addr_that_does_not_resolve_is_one_line(data_dir):
    """A name no resolver knows: one line naming it, after a short wait (DNS records can come late), never a
    traceback, and never --timeout's minutes of 'no answer'."""
    start = time.monotonic()
    result = run_script(
        "convnet_distributed.py",
        *["--num-machines", 2, "--machine-id", 1, "--master-addr", "no-such-host.invalid"],
        *["--master-port", free_port(), "--timeout", 3, "--data-dir", data_dir],
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert (
        result.stderr.strip().splitlines() == [result.stderr.strip()]
        and "--master-addr no-such-host.invalid does not resolve" in result.stderr
    ), result.stderr
    assert time.monotonic() - start < 30  # --timeout 3 bounds the wait for the name


@pytest.mark.timeout(240)
def test_torchrun_c10d_rendezvous_on_one_node(data_dir, tmp_path):
    """The rendezvous PyTorch recommends, on one node with 2 processes: one group of 2 that trains."""
    proc = torchrun(
        *[
            "--nnodes",
            1,
            "--nproc-per-node",
            2,
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
        ],
        script_args=["--batch-size", 64, "--data-dir", data_dir, "--metrics-json", tmp_path / "m.json"],
    )
    result = finish(proc, 180)
    assert result.returncode == 0, result.stderr
    m = read_json(tmp_path / "m.json")
    assert m["world_size"] == 2 and m["test_accuracy"] > 0.8


@pytest.mark.timeout(120)
def test_check_under_torchrun_makes_the_group_and_exits(tmp_path):
    """--check with torchrun's launch: the group is made and averages once; no data needed, nothing trains."""
    proc = torchrun(
        "--standalone",
        "--nproc-per-node",
        2,
        script_args=[
            "--check",
            "--data-dir",
            tmp_path / "no-data-here",
            "--metrics-json",
            tmp_path / "m.json",
        ],
    )
    result = finish(proc, 90)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Machine 0 (") and ": 2 processes, Gloo on " in lines[0], (
        lines
    )
    assert lines[1] == "Check passed: 2 processes on 1 machine reached each other"
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "no-data-here").exists()


class SlowFiles(http.server.SimpleHTTPRequestHandler):
    """Serves a folder in small pieces, slowly: two downloads of the same file overlap for seconds."""

    def copyfile(self, source, outputfile):
        while piece := source.read(32 << 10):
            outputfile.write(piece)
            time.sleep(0.02)

    def log_message(self, *args):
        pass


@pytest.mark.timeout(240)
def test_two_machines_downloading_into_one_shared_folder(tmp_path):
    """Two launches download MNIST into one --data-dir at once (machines sharing an NFS folder, at their first
    run), from a local HTTP server standing in for torchvision's mirror. Both train, and no file ever stands
    under its real name half-written: a reader would take it for the data set."""
    served = os.path.join(write_dataset(str(tmp_path / "served"), gz=True), "MNIST", "raw")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: SlowFiles(*a, directory=served))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    files = {}
    for name in FILES:
        with open(os.path.join(served, name + ".gz"), "rb") as f:
            files[name + ".gz"] = f.read()
    resources = [(name, hashlib.md5(data).hexdigest()) for name, data in files.items()]
    shared = tmp_path / "shared"
    # torchvision's mirror list and checksums are the only things that differ from a real first run.
    code = (
        f"import sys; sys.path.insert(0, {REPO!r}); from torchvision import datasets; "
        f"datasets.MNIST.mirrors = ['http://127.0.0.1:{server.server_address[1]}/']; "
        f"datasets.MNIST.resources = {resources!r}; "
        "import convnet_distributed; convnet_distributed.main(sys.argv[1:])"
    )
    sizes = {name: len(data) for name, data in files.items()}
    for name in FILES:
        sizes[name] = len(gzip.decompress(files[name + ".gz"]))
    seen_partial, stop = [], threading.Event()

    def watch():
        folder = shared / "MNIST" / "raw"
        while not stop.is_set():
            for name, size in sizes.items():
                try:
                    found = os.path.getsize(folder / name)
                except OSError:
                    continue
                if found != size:
                    seen_partial.append((name, found, size))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    code,
                    "--data-dir",
                    shared,
                    "--batch-size",
                    "128",
                    "--log-interval",
                    "1000",
                ]
                + ["--master-port", str(free_port()), "--metrics-json", tmp_path / f"m{i}.json"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=script_env(),
                start_new_session=True,
            )
            for i in range(2)
        ]
        results = [finish(p, 180) for p in procs]
    finally:
        stop.set()
        watcher.join()
        server.shutdown()
    for r in results:
        assert r.returncode == 0, r.stderr
    assert not seen_partial, seen_partial[:5]
    for name in FILES:
        assert (shared / "MNIST" / "raw" / name).stat().st_size == sizes[name]
    assert [p for p in os.listdir(shared) if p.startswith(".download-")] == []  # private folders removed
    assert all(read_json(tmp_path / f"m{i}.json")["test_accuracy"] > 0.8 for i in range(2))


def test_a_system_that_cannot_list_its_interfaces_leaves_gloo_its_own_choice(clean_env, monkeypatch):
    """getifaddrs(3) fails where netlink is missing or blocked (a sandbox): an OSError of the interface
    listing once stopped every process before the process group was made."""
    no_netlink = types.SimpleNamespace(getifaddrs=lambda head: -1)  # as glibc's, with errno EAFNOSUPPORT
    monkeypatch.setattr(convnet_distributed.ctypes, "CDLL", lambda name: no_netlink)
    assert convnet_distributed.interface_addresses() is None
    store = {}
    fake_store = type(
        "Store", (), {"set": lambda self, k, v: store.__setitem__(k, v), "get": lambda self, k: store[k]}
    )
    args = convnet_distributed.parse_args(["--master-port", "1"])
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")  # cannot be checked here: Gloo will say
    convnet_distributed.prepare_backend(fake_store(), 0, 1, args)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth9"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    convnet_distributed.prepare_backend(fake_store(), 0, 1, args)
    assert "machine/0" in store and os.environ["GLOO_SOCKET_IFNAME"] == ""  # Gloo's own choice
