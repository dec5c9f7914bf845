"""What data parallelism promises, checked in-process with Gloo: the sampler's shards, and DDP's averaging."""

import contextlib
import copy
import os
import platform
import secrets
import time
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

import convnet_distributed
import convnet_undistributed
from conftest import free_port, spawn_bounded, tensors

# On one pytest-xdist worker: the module's spawned ranks (a fixture) serve several tests.
pytestmark = pytest.mark.xdist_group("spawned")


def shards(world_size, epoch, n=1000, batch_size=10):
    """Every rank's indices for one epoch, through the script's own epoch_batches."""
    labels = torch.zeros(n)
    return [
        torch.cat(
            convnet_distributed.epoch_batches(
                DistributedSampler(labels, num_replicas=world_size, rank=r, shuffle=True, seed=0),
                epoch,
                batch_size,
            )
        ).tolist()
        for r in range(world_size)
    ]


@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_never_overlap_and_change_every_epoch(world_size):
    """The article never called set_epoch: every epoch replayed the first epoch's order."""
    epoch0, epoch1 = shards(world_size, 0), shards(world_size, 1)
    for ranks in (epoch0, epoch1):
        assert sorted(i for shard in ranks for i in shard) == list(range(1000))  # disjoint, and all covered
    for r in range(world_size):
        assert epoch0[r] != epoch1[r]
        assert set(epoch0[r]) != set(epoch1[r])


def test_baseline_and_one_process_draw_the_same_batches():
    n, batch_size = 1000, 128
    sampler = DistributedSampler(torch.zeros(n), num_replicas=1, rank=0, shuffle=True, seed=7)
    for epoch in (0, 3):
        baseline = convnet_undistributed.epoch_batches(n, epoch, batch_size, seed=7)
        distributed = convnet_distributed.epoch_batches(sampler, epoch, batch_size)
        assert [b.tolist() for b in baseline] == [b.tolist() for b in distributed]


# The script averages in shared memory on x86-64 alone, in /dev/shm.
SHARED_MEMORY = platform.machine() in ("x86_64", "AMD64")
DEV_SHM = os.path.isdir("/dev/shm")


def one_step(rank, world_size, out, allreduce, token):
    """One optimizer step of the script's own DDP set-up and train_epoch, dropout off, on the first batch of
    epoch 0. The shared area is named after token: tests running beside this one make areas of their own."""
    images, labels, _, _ = tensors()
    args = convnet_distributed.parse_args(
        ["--batch-size", str(128 // world_size), "--log-interval", "1000", "--allreduce", allreduce]
    )
    torch.manual_seed(0)
    model = convnet_distributed.ConvNet().to(memory_format=torch.channels_last)  # as the scripts hold it
    convnet_distributed.keep_pool_gradient_channels_last(model)
    model.dropout1.p = model.dropout2.p = 0.0
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    sampler = DistributedSampler(labels, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    first = convnet_distributed.epoch_batches(sampler, 0, args.batch_size)[:1]
    initial = copy.deepcopy(model)
    named = types.SimpleNamespace(uuid4=lambda: types.SimpleNamespace(hex=token))
    with mock.patch.object(convnet_distributed, "uuid", named):
        ddp_model, allreduce, _ = convnet_distributed.data_parallel(model, rank, world_size, args)
    convnet_distributed.train_epoch(ddp_model, optimizer, images, labels, first, 0, args)
    # This rank's own gradient, without the averaging, for contrast.
    own_loss = torch.nn.functional.nll_loss(
        initial(convnet_distributed.to_input(images[first[0]], "mnist")), labels[first[0]]
    )
    torch.save(
        {
            "grads": [p.grad for p in model.parameters()],
            "params": list(model.parameters()),
            "own_grads": torch.autograd.grad(own_loss, list(initial.parameters())),
            "indices": first[0],
            "allreduce": allreduce,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )


def wait_for_a_silent_peer(rank, world_size, out):
    """Rank 0 arrives at a gradient exchange that rank 1 never joins, as average() arrives at it."""
    averager = convnet_distributed.SharedMemoryAverager(
        convnet_distributed.ConvNet(), rank, world_size, timeout=1.0
    )
    if rank == 0:
        averager.calls += 1
        averager.arrived[rank] = averager.calls
        start = time.monotonic()
        try:
            averager.wait_for_all()
            outcome = "returned"
        except dist.DistError as e:
            outcome = str(e)
        torch.save({"outcome": outcome, "seconds": time.monotonic() - start}, os.path.join(out, "rank0.pt"))
    dist.barrier()


def free_running_steps(rank, world_size, out, steps):
    """The script's own DDP set-up and train_epoch for `steps` steps, dropout on (its masks differ between
    ranks, so do the ranks' own gradients), with no synchronisation between the steps but the averaging's own.
    Each rank saves its parameters as they are after every step."""
    images, labels, _, _ = tensors()
    args = convnet_distributed.parse_args(["--batch-size", "16", "--log-interval", "1000"])
    torch.manual_seed(0)
    model = convnet_distributed.ConvNet().to(memory_format=torch.channels_last)
    convnet_distributed.keep_pool_gradient_channels_last(model)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    history = []
    optimizer.register_step_post_hook(
        lambda *_: history.append([p.detach().clone() for p in model.parameters()])
    )
    sampler = DistributedSampler(labels, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    batches = convnet_distributed.epoch_batches(sampler, 0, args.batch_size)[:steps]
    wait_for_all = convnet_distributed.SharedMemoryAverager.wait_for_all
    held = contextlib.nullcontext()
    if rank == world_size - 1:  # held back after every rank has arrived, as a busy core holds a process: the
        # others read the average and run on into the next step first
        slow = lambda self: (wait_for_all(self), time.sleep(0.03))  # noqa: E731
        held = mock.patch.object(convnet_distributed.SharedMemoryAverager, "wait_for_all", slow)
    with held:
        ddp_model, allreduce, _ = convnet_distributed.data_parallel(model, rank, world_size, args)
        torch.manual_seed(rank)
        convnet_distributed.train_epoch(ddp_model, optimizer, images, labels, batches, 0, args)
    torch.save({"allreduce": allreduce, "history": history}, os.path.join(out, f"rank{rank}.pt"))


def in_one_group(rank, world_size, port, jobs):
    """Each job in turn, as (function, arguments after rank and world size), in one process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for function, *args in jobs:
        function(rank, world_size, *args)
    dist.destroy_process_group()


# Free-running steps (test_shared_memory_average_keeps_every_copy_bit_for_bit_equal_step_after_step).
STEPS = 24


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """The module's jobs, in one spawn of 2 ranks and one of 4: each spawned process imports torch and the
    scripts, for seconds. {(world size, job): its folder}; a step's folder holds the token that names its
    shared area (tests running beside it make areas of their own)."""
    plan = {2: ["auto", "gloo"], 4: ["auto"]}
    if DEV_SHM:
        plan[2].append("silent peer")
    if SHARED_MEMORY:
        plan[4].append("free running")
    folders = {}
    for world_size, names in plan.items():
        jobs = []
        for name in names:
            folder = folders[world_size, name] = tmp_path_factory.mktemp(name.replace(" ", "-"))
            if name == "silent peer":
                jobs.append((wait_for_a_silent_peer, str(folder)))
            elif name == "free running":
                jobs.append((free_running_steps, str(folder), STEPS))
            else:
                token = secrets.token_hex(8)
                (folder / "token").write_text(token)
                jobs.append((one_step, str(folder), name, token))
        spawn_bounded(in_one_group, (world_size, free_port(), jobs), nprocs=world_size, timeout=240)
    return folders


@pytest.mark.parametrize(
    "world_size, allreduce, used",
    [(2, "auto", "shared-memory"), (2, "gloo", "gloo"), (4, "auto", "shared-memory")],
)
def test_ranks_sharing_a_batch_of_128_take_the_step_of_one_process_of_128(
    spawned, world_size, allreduce, used
):
    """DDP averages gradients: 2 ranks x 64 images (or 4 x 32) step as the baseline's 128 images do,
    whether the gradients go through shared memory or over Gloo."""
    if used == "shared-memory" and not SHARED_MEMORY:
        used = "gloo"
    images, labels, _, _ = tensors()
    args = convnet_undistributed.parse_args(["--log-interval", "1000"])
    torch.manual_seed(0)
    model = convnet_undistributed.ConvNet().to(memory_format=torch.channels_last)
    convnet_undistributed.keep_pool_gradient_channels_last(model)
    model.dropout1.p = model.dropout2.p = 0.0
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    first = convnet_undistributed.epoch_batches(len(labels), 0, 128, args.seed)[:1]
    convnet_undistributed.train_epoch(model, optimizer, images, labels, first, 0, args)

    folder = spawned[world_size, allreduce]
    ranks = [torch.load(folder / f"rank{r}.pt") for r in range(world_size)]
    assert {r["allreduce"] for r in ranks} == {used}
    token = (folder / "token").read_text()
    assert not os.path.exists(
        f"/dev/shm/convnet-ddp-{token}"
    )  # the shared area's name went once every rank mapped it
    # The shards are the baseline's batch of 128, split between the ranks.
    assert sorted(torch.cat([r["indices"] for r in ranks]).tolist()) == sorted(first[0].tolist())
    for rank in ranks:
        for p, g, p_ddp, g_ddp in zip(
            model.parameters(), (p.grad for p in model.parameters()), rank["params"], rank["grads"]
        ):
            torch.testing.assert_close(g_ddp, g, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(p_ddp, p, rtol=1e-4, atol=1e-6)
        # The equality is the averaging's doing: a rank's own gradient is far from the baseline's.
        assert not torch.allclose(rank["own_grads"][-2], model.fc2.weight.grad, rtol=1e-2, atol=1e-4)


@pytest.mark.skipif(not DEV_SHM, reason="the shared-memory exchange needs /dev/shm")
def test_shared_memory_exchange_gives_up_on_a_silent_peer_after_the_timeout(spawned):
    """The spin-wait is bounded like Gloo's: a rank that never sends gradients is named after --timeout."""
    result = torch.load(spawned[2, "silent peer"] / "rank0.pt")
    assert result["outcome"] == "no gradients from rank(s) [1]"
    assert 1.0 <= result["seconds"] < 10


@pytest.mark.skipif(not SHARED_MEMORY, reason="the script averages in shared memory on x86-64")
def test_shared_memory_average_keeps_every_copy_bit_for_bit_equal_step_after_step(spawned):
    """4 ranks on 2 cores, 24 steps running free: a rank that finishes a step starts the next while others
    still read the last gradients, so the averager's two areas are used in turn, and a slow rank is overtaken.
    After every step every rank holds the same parameters, to the bit: a drifted copy would stay apart."""
    world_size, steps = 4, STEPS
    ranks = [torch.load(spawned[world_size, "free running"] / f"rank{r}.pt") for r in range(world_size)]
    assert {r["allreduce"] for r in ranks} == {"shared-memory"}
    assert all(len(r["history"]) == steps for r in ranks)
    for step in range(steps):
        first = ranks[0]["history"][step]
        for rank, other in enumerate(r["history"][step] for r in ranks):
            differ = [i for i, (a, b) in enumerate(zip(first, other)) if not torch.equal(a, b)]
            assert not differ, f"after step {step}, rank {rank}'s parameters {differ} differ from rank 0's"
        if step:  # the steps did move the model
            assert not torch.equal(first[-2], ranks[0]["history"][step - 1][-2])
