"""--compress: local SGD (torch's post-local-SGD hook; the copies averaged every few steps), checked
in-process on the first steps and through a checkpoint and resume, and on the command line; --compress auto,
the link's timing and the epoch line's wait, across two hosts on a shaped link."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

import convnet_distributed
import convnet_distributed_cuda
from conftest import REPO, finish, free_port, launch, read_json, script_env, spawn_bounded, tensors

# On one pytest-xdist worker: the module's one pair of processes (ranks) serves all its tests.
pytestmark = pytest.mark.xdist_group("compress")
PERIOD = 3  # the copies averaged every 3 steps here (the scripts: LOCAL_SGD_PERIOD, 64)
STEPS = PERIOD + 1  # the last one starts from an average
RESUME_AT, RESUME_STEPS = 4, 3  # the resume check: steps before the checkpoint, and after it


def exercise(rank, world_size, port, out):
    """In one pair of processes (a spawn costs seconds): STEPS steps of local SGD, and a checkpoint taken and
    resumed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    convnet_distributed.LOCAL_SGD_PERIOD = PERIOD
    results = {"steps": first_steps(rank, world_size)}
    results["resume"] = resumed_steps(rank, world_size, os.path.join(out, "ck.pt"))
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def set_up(rank, world_size, *flags, dropout=False):
    """The script's model, optimizer and DDP over Gloo, with --compress local-sgd; this rank's batches."""
    args = convnet_distributed.parse_args(
        ["--batch-size", "64", "--allreduce", "gloo", "--compress", "local-sgd", *flags]
    )
    torch.manual_seed(0)
    model = convnet_distributed.ConvNet().to(memory_format=torch.channels_last)
    convnet_distributed.keep_pool_gradient_channels_last(model)
    if not dropout:
        model.dropout1.p = model.dropout2.p = 0.0
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    labels = tensors()[1]
    sampler = DistributedSampler(labels, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    ddp_model, _, clock = convnet_distributed.data_parallel(model, rank, world_size, args)
    batches = convnet_distributed.epoch_batches(sampler, 0, args.batch_size)
    return args, model, optimizer, ddp_model, clock, batches


def first_steps(rank, world_size):
    """STEPS steps, dropout off, recording for each the weights it starts from (after the forward, which may
    average them), this rank's own gradient, the one DDP hands the optimizer, and the weights after."""
    images, labels, _, _ = tensors()
    args, model, optimizer, ddp_model, clock, batches = set_up(rank, world_size)
    steps = []
    for idx in batches[:STEPS]:
        x, y = convnet_distributed.to_input(images[idx], "mnist"), labels[idx]
        optimizer.zero_grad(set_to_none=True)
        output = ddp_model(x)
        weights = [p.detach().clone(memory_format=torch.preserve_format) for p in model.parameters()]
        own = torch.autograd.grad(F.nll_loss(model(x), y), list(model.parameters()))
        F.nll_loss(output, y).backward()
        optimizer.step()
        after = [p.detach().clone() for p in model.parameters()]
        steps.append({"weights": weights, "own": own, "used": [p.grad.clone() for p in model.parameters()]})
        steps[-1]["after"] = after
    convnet_distributed.evaluate(model, *tensors()[2:], rank, world_size, args)  # the copies are apart
    evaluated = [p.detach().clone() for p in model.parameters()]
    return {"steps": steps, "waited": clock.waited, "evaluated": evaluated}


def resumed_steps(rank, world_size, checkpoint):
    """The script's train_epoch, save_checkpoint and resume, dropout on: RESUME_AT steps (the copies apart by
    then), a checkpoint, RESUME_STEPS more; a fresh model resumed from the checkpoint takes the same steps."""
    images, labels, _, _ = tensors()
    flags = ("--checkpoint", checkpoint, "--resume")
    args, model, optimizer, ddp_model, _, batches = set_up(rank, world_size, *flags, dropout=True)
    convnet_distributed.train_epoch(ddp_model, optimizer, images, labels, batches[:RESUME_AT], 0, args)
    convnet_distributed.save_checkpoint(model, optimizer, 0, args)
    saved = [p.detach().clone() for p in model.parameters()]
    args, model, optimizer, ddp_model, _, _ = set_up(rank, world_size, *flags, dropout=True)
    convnet_distributed.resume(model, optimizer, args)
    loaded = [p.detach().clone() for p in model.parameters()]
    later = batches[RESUME_AT : RESUME_AT + RESUME_STEPS]
    convnet_distributed.train_epoch(ddp_model, optimizer, images, labels, later, 0, args)
    return {"saved": saved, "loaded": loaded}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("compress")
    spawn_bounded(exercise, (2, free_port(), str(out)), nprocs=2, timeout=300)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)], out


NAMES = [name for name, _ in convnet_distributed.ConvNet().named_parameters()]


def test_local_sgd_steps_each_copy_alone_then_averages_the_copies(ranks):
    """Each rank steps on its own gradient, exactly (DDP averages nothing), and the copies part; before the
    PERIOD-th step, each copy becomes the copies' average, in its own layout (channels-last weights stay
    so)."""
    steps = [r["steps"]["steps"] for r in ranks[0]]
    for step in range(STEPS):
        weights = [s[step]["weights"] for s in steps]
        for i, name in enumerate(NAMES):
            for rank in range(2):
                assert torch.equal(steps[rank][step]["used"][i], steps[rank][step]["own"][i]), (step, name)
            if step in (0, STEPS - 1):  # copies equal: DDP's start, and the average
                torch.testing.assert_close(weights[0][i], weights[1][i], rtol=1e-6, atol=1e-7)
            else:
                assert not torch.equal(weights[0][i], weights[1][i]), (step, name)
        if step == STEPS - 1:  # the average of the copies the step before left, in the copies' layout
            for i, w in enumerate(weights[0]):
                average = (steps[0][step - 1]["after"][i] + steps[1][step - 1]["after"][i]) / 2
                torch.testing.assert_close(w, average, rtol=1e-6, atol=1e-7)
                assert w.dim() != 4 or w.is_contiguous(memory_format=torch.channels_last), NAMES[i]
    assert all(r["steps"]["waited"] > 0 for r in ranks[0])  # the clock counted the average
    # An evaluation sees the job's model: the copies' average, not each rank its own copy.
    evaluated = [r["steps"]["evaluated"] for r in ranks[0]]
    for i, (a, b) in enumerate(zip(*evaluated)):
        average = (steps[0][-1]["after"][i] + steps[1][-1]["after"][i]) / 2
        assert torch.equal(a, b) and torch.allclose(a, average, rtol=1e-6, atol=1e-7), NAMES[i]


def test_resume_under_local_sgd_starts_every_copy_from_rank_0s(ranks):
    """A checkpoint taken between averages holds rank 0's copy (train's comes after an evaluation, which
    averages them); a resumed run starts every copy from it, and trains."""
    results, out = ranks
    for r in results:
        for saved, loaded in zip(results[0]["resume"]["saved"], r["resume"]["loaded"]):
            assert torch.equal(saved, loaded)
    assert not all(torch.equal(a, b) for a, b in zip(*(r["resume"]["saved"] for r in results)))


@pytest.mark.parametrize("script", [convnet_distributed, convnet_distributed_cuda])
def test_a_bad_compress_value_is_one_line(clean_env, capsys, script):
    with pytest.raises(SystemExit) as stop:
        script.parse_args(["--compress", "zip"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --compress: invalid choice: 'zip'" in err, err


def test_check_passes_only_once_a_gradient_sized_average_arrived(clean_env, monkeypatch, capsys):
    """A path that drops large packets (issue 40): a number crosses it, a gradient never does, and the job
    stops as on a lost peer. --check said "Check passed" after its one-number all-reduce, before that."""
    args = convnet_distributed.parse_args(["--check", "--num-processes", "2"])

    def all_reduce(tensor, op=None):  # small messages arrive; the gradients' 1.2 MB does not
        if tensor.numel() > 1000:
            raise dist.DistError("Timed out waiting 60000ms for recv operation to complete")
        tensor.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(dist.DistError):
        convnet_distributed.try_the_group(2, torch.device("cpu"), None, args)
    assert "Check passed" not in capsys.readouterr().out


# --- across two hosts (network namespaces, tests/test_multihost.py), the link shaped by tc ------------------

from test_multihost import (  # noqa: E402
    SCRIPT,
    common_args,
    describe,
    finish_all,
    launch_machines,
    make_network,
    random_port,
    script_machines,
)

BENCH = os.path.join(REPO, "bench", "network.py")


@pytest.fixture
def slow_network():
    """The two hosts of tests/test_multihost.py, joined at 10 Mbit/s in each direction."""
    if not shutil.which("tc"):
        pytest.skip("needs tc (iproute2) to shape the link")
    for net in make_network():
        for ns, interface in ((net.ns_a, net.if_a), (net.ns_b, net.if_b)):
            shape = ["tc", "-n", ns, "qdisc", "add", "dev", interface, "root", "tbf", "rate", "10mbit"]
            subprocess.run([*shape, "burst", "70000", "latency", "100ms"], check=True, timeout=30)
        yield net


# The line that times the link (rank 0's, across machines), and each epoch's split of its training loop
NETWORK = re.compile(
    r"Network: averaging the gradients \(1\.2 MB\) took ~(?P<ms>\d+) ms \(~(?P<mbit>\d+) Mbit/s\), a step's "
    r"computing ~\d+ ms: waiting would take ~(?P<plain>\d+)% of each step"
    r"(, ~(?P<share>\d+)% with --compress (?P<advice>[\w-]+))?( \(--compress auto: (?P<auto>[\w-]+)\))?"
)
EPOCH = re.compile(
    r"Epoch 0 trained in (\d+\.\d+) s: (\d+\.\d+) s computing, (\d+\.\d+) s \((\d+)%\) waiting"
)


def epoch_split(stdout):
    """The epoch line's (loop, computing, waiting) seconds; they add up."""
    loop, computing, waiting, share = EPOCH.search(stdout).groups()
    assert float(computing) + float(waiting) == pytest.approx(float(loop), abs=0.011), stdout
    assert int(share) == round(100 * float(waiting) / float(loop)), stdout
    return float(loop), float(computing), float(waiting)


def link_machines(net, data_dir, folder, *flags):
    """A real run across the two hosts, one process each: 5 steps of 256 images, each a 1.2 MB average."""
    port = random_port()
    return launch_machines(
        net,
        folder,
        script_env(),
        lambda i: [
            *[sys.executable, SCRIPT, "--num-machines", 2, "--machine-id", i, "--master-addr", "node0"],
            *["--master-port", port, *common_args(data_dir), "--batch-size", 256, *flags],
        ],
    )


@pytest.mark.timeout(180)
def test_check_on_a_slow_link_names_the_flag(slow_network, data_dir, tmp_path):
    """--check times an average of the gradients' real size (1.2 MB: about 1 s at 10 Mbit/s) against a step of
    computing: waiting would take most of each step, and --compress local-sgd far less."""
    machines = script_machines(
        slow_network, random_port(), data_dir, tmp_path, script_env(), extra=["--check"]
    )
    results = finish_all(machines, 120)
    assert [r.returncode for r in results] == [0, 0], results
    last = results[0].stdout.splitlines()[-1]
    network = NETWORK.fullmatch(last)
    assert network and network["advice"] == "local-sgd" and network["auto"] is None, results[0].stdout
    assert 700 < int(network["ms"]) < 10_000, last  # 1.2 MB each way at 10 Mbit/s: about 1 s
    assert 1 <= int(network["mbit"]) <= 10 and int(network["share"]) < int(network["plain"]), last


@pytest.mark.timeout(240)
def test_a_slow_link_is_named_and_each_epoch_says_it_waited(slow_network, data_dir, tmp_path):
    """At 10 Mbit/s without --compress: before training, one line gives the link's rate, the share of each
    step it would take, and the --compress that pays; the epoch line then shows the loop mostly waiting."""
    machines = link_machines(slow_network, data_dir, tmp_path, "--metrics-json", tmp_path / "m.json")
    results = finish_all(machines, 200)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    lines = results[0].stdout.splitlines()
    found = [NETWORK.fullmatch(line) for line in lines if line.startswith("Network: ")]
    assert len(found) == 1 and found[0]["advice"] == "local-sgd" and int(found[0]["plain"]) > 50, lines
    assert next(i for i, line in enumerate(lines) if line.startswith("World size ")) > lines.index(
        found[0][0]
    )
    loop, computing, waiting = epoch_split(results[0].stdout)
    assert waiting > 0.5 * loop, lines  # 5 averages of 1.2 MB at 10 Mbit/s: about 1 s each
    (epoch,) = read_json(tmp_path / "m.json")["history"]
    assert epoch["waiting_seconds"] == pytest.approx(waiting, abs=0.006) and epoch["train_seconds"] > 0


@pytest.mark.timeout(240)
def test_compress_auto_compresses_on_a_slow_link_and_says_why(slow_network, data_dir, tmp_path):
    """--compress auto at 10 Mbit/s: the link's line says why, and the layout line that local SGD averages."""
    machines = link_machines(
        slow_network, data_dir, tmp_path, "--compress", "auto", "--metrics-json", tmp_path / "m.json"
    )
    results = finish_all(machines, 200)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    network = NETWORK.search(results[0].stdout)
    assert network and network["advice"] == network["auto"] == "local-sgd", results[0].stdout
    layout = next(line for line in results[0].stdout.splitlines() if line.startswith("World size "))
    assert layout.endswith("; copies averaged over Gloo every 64 steps (local SGD)"), layout
    assert read_json(tmp_path / "m.json")["compress"] == "local-sgd"


def test_compress_auto_keeps_plain_averaging_on_loopback(data_dir, tmp_path):
    """Two machines on one host (127.0.0.1): the link is fast, auto keeps the plain average, and says so."""
    port = free_port()
    flags = ["--num-machines", 2, "--master-port", port, "--compress", "auto", *common_args(data_dir)]
    launches = [launch("convnet_distributed.py", *flags, "--machine-id", i) for i in (1, 0)]
    result1, result0 = (finish(p, 180) for p in launches)
    assert (result0.returncode, result1.returncode) == (0, 0), result0.stderr + result1.stderr
    network = NETWORK.search(result0.stdout)
    assert network and network["auto"] == "none" and network["advice"] is None, result0.stdout
    assert int(network["plain"]) < 25, result0.stdout
    assert "; gradients averaged over Gloo\n" in result0.stdout, result0.stdout


def bench_namespaces():
    """bench/network.py's namespaces (nb...): the tests' own (dpt..., dps...) come and go beside it."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in listed if line.startswith("nb")]


@pytest.mark.timeout(300)
def test_network_benchmark_runs_the_reference_and_each_choice_interleaved(data_dir, tmp_path):
    """bench/network.py, small: 2 hosts at 10 Mbit/s, plain and with --compress auto (which takes local SGD),
    one repeat, the one-host reference before and after each, on the generated data; it writes its table,
    plot and runs, and leaves no namespace behind."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("needs root, ip and tc to make the two hosts")
    before = bench_namespaces()
    out = tmp_path / "results"
    cmd = [sys.executable, BENCH, "--dataset", "mnist", "--data-dir", data_dir, "--links", "10"]
    cmd += ["--compress", "none,auto", "--repeats", "1", "--accuracy-epochs", "0", "--out-dir", out]
    done = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=script_env(), timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = (out / "network.md").read_text()
    for row in ("| one host, Gloo | none |", "| 10 Mbit/s | none |", "| 10 Mbit/s | auto (local-sgd) |"):
        assert row in table, table
    assert "| 10 Mbit/s, --compress auto: throughput ≥ 0.60 of one host |" in table
    assert (
        "| 10 Mbit/s, --compress auto: test accuracy after 1 epoch(s) within 1 point of one host's |" in table
    )
    assert (out / "network.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = json.loads((out / "runs.json").read_text())["runs"]
    reference = (None, "none")
    assert [(r["link_mbit"], r["compress"]) for r in runs] == [
        reference,
        (10, "none"),
        reference,
        (10, "auto"),
        reference,
    ]
    for r in runs:
        m = r["metrics"]
        assert m["world_size"] == 2 and m["allreduce"] == "gloo"
        assert m["compress"] == ("local-sgd" if r["compress"] == "auto" else "none")
        assert m["test_accuracy"] > 0.8 and m["train_seconds"] > 0
        assert all(0 <= h["waiting_seconds"] < h["train_seconds"] for h in m["history"])
    assert bench_namespaces() == before


def test_network_benchmark_takes_each_ratio_against_the_references_beside_the_run():
    """The machine's speed drifts: a run is measured against the references just before and after it (their
    mean), not against one reference per repeat, which may have run minutes earlier at another speed."""
    sys.path.insert(0, os.path.dirname(BENCH))
    import network

    def record(sequence, link, compress, seconds):
        metrics = {"train_seconds": seconds}
        return {
            "sequence": sequence,
            "link_mbit": link,
            "compress": compress,
            "epochs": 1,
            "metrics": metrics,
        }

    # The machine slows from 10 s to 20 s a reference: the run between them took 15 s, as fast as one host.
    records = [record(0, None, "none", 10.0), record(1, 100, "auto", 15.0), record(2, None, "none", 20.0)]
    records += [record(3, 100, "none", 40.0), record(4, None, "none", 20.0)]
    assert network.ratios(records, 100, "auto", 1) == [pytest.approx(1.0)]
    assert network.ratios(records, 100, "none", 1) == [pytest.approx(0.5)]


def test_network_benchmark_without_root_says_so_in_one_line(monkeypatch, tmp_path):
    sys.path.insert(0, os.path.dirname(BENCH))
    import network

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as stop:
        network.main(["--out-dir", str(tmp_path / "out")])
    assert str(stop.value).startswith("bench/network.py needs root") and "\n" not in str(stop.value)
    assert not (tmp_path / "out").exists()  # nothing made
