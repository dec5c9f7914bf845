#!/usr/bin/env python3
"""The floor: one rank's share of a data-parallel epoch, with everything but the arithmetic taken away.

A tight loop over pre-normalised float tensors held in memory: the same ConvNet and Adadelta as the
scripts, no DistributedDataParallel, no sampler, no DataLoader, no logging. With the defaults it
does the work of one rank of a 2-process run at a global batch of 128 (60,000 images: 469 steps of
64 images) on 1 thread. A distributed run cannot be faster than this; bench/scaling.py reports how
close it comes. The timed loop excludes start-up, loading and normalising.

With --copies 2, two such loops run at once, one process each, with no communication: on a machine
whose cores slow each other down (shared caches, memory bandwidth, a hypervisor), that is as fast
as 2 processes can be, and the gap between it and the floor is the machine's, not the scripts'.

    python bench/floor.py --dataset fashion-mnist --data-dir data --metrics-json floor.json
    python bench/floor.py --dataset fashion-mnist --data-dir data --copies 2
"""

import argparse
import math
import os
import sys
import time
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the model and the data loading of the baseline script, not copies of them

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch.optim as optim

from common import write_json
from convnet_undistributed import (
    ConvNet,
    keep_freed_memory,
    keep_pool_gradient_channels_last,
    load_data,
    peak_memory_mib,
    prepare_data,
    to_input,
)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dataset", choices=["mnist", "fashion-mnist"], default="mnist", help="data set (default: mnist)"
    )
    p.add_argument(
        "--data-dir",
        default="./data",
        metavar="DIR",
        help="data folder, torchvision's layout (default: ./data)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=2,
        metavar="N",
        help="processes of the run whose one rank's work is done here (default: 2)",
    )
    p.add_argument("--batch-size", type=int, default=64, metavar="N", help="images per step (default: 64)")
    p.add_argument("--epochs", type=int, default=1, metavar="N", help="passes over the shard (default: 1)")
    p.add_argument("--threads", type=int, default=1, metavar="N", help="intra-op threads (default: 1)")
    p.add_argument(
        "--lr", type=float, default=0.5, metavar="LR", help="Adadelta learning rate (default: 0.5)"
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default: 0)")
    p.add_argument(
        "--copies",
        type=int,
        default=1,
        metavar="N",
        help="run N copies at once, one process each, their loops started together: what N processes "
        "cost each other by sharing the machine, with no communication at all; the time reported "
        "is the slowest copy's (default: 1)",
    )
    p.add_argument("--metrics-json", metavar="PATH", help="write the figures here as JSON (default: none)")
    return p


def shard_batches(args):
    """One rank's shard (a random 1/world-size of the training set), normalised once, cut into batches."""
    images, labels, _, _ = load_data(SimpleNamespace(dataset=args.dataset, data_dir=args.data_dir))
    shard = torch.randperm(len(labels))[: math.ceil(len(labels) / args.world_size)]
    x, y = to_input(images[shard], args.dataset).contiguous(), labels[shard]
    return list(zip(x.split(args.batch_size), y.split(args.batch_size))), len(labels)


def train(model, optimizer, batches, epochs):
    """The timed loop: forward, loss, backward, step; nothing else. Returns (seconds, last loss)."""
    model.train()
    start = time.perf_counter()
    for _ in range(epochs):
        for x, y in batches:
            loss = F.nll_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return time.perf_counter() - start, loss.item()


def one_copy(args, copy, start_together=None, results=None):
    """Load, build, time the loop; (seconds, last loss, shard images, steps, training set size, peak MiB)."""
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the scripts do: the floor gets every advantage they get
    torch.manual_seed(args.seed + copy)
    batches, train_size = shard_batches(args)
    model = ConvNet().to(memory_format=torch.channels_last)  # as the scripts hold it
    keep_pool_gradient_channels_last(model)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    if start_together is not None:
        start_together.wait()  # no copy may run alone while another is still loading
    seconds, last_loss = train(model, optimizer, batches, args.epochs)
    result = (
        seconds,
        last_loss,
        sum(len(y) for _, y in batches),
        len(batches),
        train_size,
        peak_memory_mib(),
    )
    if results is not None:
        results.put(result)
    return result


def run_copies(args):
    """--copies processes at once; every copy's result."""
    ctx = mp.get_context("spawn")
    start_together, results = ctx.Barrier(args.copies), ctx.Queue()
    processes = [
        ctx.Process(target=one_copy, args=(args, c, start_together, results)) for c in range(args.copies)
    ]
    for p in processes:
        p.start()
    done = [results.get() for _ in processes]
    for p in processes:
        p.join()
        if p.exitcode:
            sys.exit(f"error: a copy exited with status {p.exitcode}")
    return done


def main():
    args = build_parser().parse_args()
    prepare_data(
        SimpleNamespace(dataset=args.dataset, data_dir=args.data_dir)
    )  # once, before any copy reads it
    copies = run_copies(args) if args.copies > 1 else [one_copy(args, 0)]
    seconds, last_loss, shard_size, steps, train_size, _ = max(copies)  # the slowest copy
    metrics = {
        "script": "bench/floor.py",
        "dataset": args.dataset,
        "world_size": 1,
        "simulated_world_size": args.world_size,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "steps": steps * args.epochs,
        "copies": args.copies,
        "copy_seconds": [c[0] for c in copies],
        "threads": args.threads,
        "train_size": train_size,
        "train_seconds": seconds,
        # As a rank of the simulated run would count it: the whole set passes while each rank does its shard.
        "samples_per_second": train_size * args.epochs / seconds,
        "shard_samples": shard_size * args.epochs,
        "final_train_loss": last_loss,
        "peak_rss_mib": max(c[5] for c in copies),
    }
    at_once = f", {args.copies} copies at once, the slowest" if args.copies > 1 else ""
    print(
        f"Floor: {metrics['steps']} steps of {args.batch_size} on {metrics['threads']} thread(s){at_once} "
        f"in {seconds:.2f} s"
    )
    if args.metrics_json:
        write_json(args.metrics_json, metrics)


if __name__ == "__main__":
    main()
