#!/usr/bin/env python3
"""The textbook way to train the same model: a torchvision data set with a per-image transform
(ToTensor, Normalize) and a default DataLoader (shuffle, no worker processes). With --device cuda it
is the article's GPU path: pinned host batches copied to the GPU with non_blocking=True.

bench/scaling.py times it next to convnet_undistributed.py, which slices and normalises whole
batches of one uint8 tensor instead, to show what that data path saves. Same model, optimizer,
learning rate, batch, test batch and threads; the timed loop is the training alone, as in the scripts.

    python bench/torchvision_reference.py --dataset fashion-mnist --data-dir data --metrics-json ref.json
    python bench/torchvision_reference.py --dataset fashion-mnist --data-dir data --device cuda
"""

import argparse
import os
import sys
import time
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the baseline script's model, not a copy of it

import torch
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from common import write_json
from convnet_undistributed import (
    DATASETS,
    TEST_BATCH_SIZE,
    ConvNet,
    keep_pool_gradient_channels_last,
    parse_args,
    peak_memory_mib,
    prepare_data,
)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=sorted(DATASETS), default="mnist", help="data set (default: mnist)")
    p.add_argument(
        "--data-dir",
        default="./data",
        metavar="DIR",
        help="data folder, torchvision's layout (default: ./data)",
    )
    p.add_argument("--batch-size", type=int, default=128, metavar="N", help="images per batch (default: 128)")
    p.add_argument("--epochs", type=int, default=1, metavar="N", help="epochs to train (default: 1)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help=(
            "intra-op threads (default: as convnet_undistributed.py: OMP_NUM_THREADS if set, "
            "else every usable core)"
        ),
    )
    p.add_argument(
        "--lr", type=float, default=0.5, metavar="LR", help="Adadelta learning rate (default: 0.5)"
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default: 0)")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where to train; cuda feeds the GPU from pinned memory, as the article does (default: cpu)",
    )
    p.add_argument("--metrics-json", metavar="PATH", help="write the figures here as JSON (default: none)")
    return p


def datasets_for(args):
    name, mean, std = DATASETS[args.dataset]
    cls = getattr(datasets, name)
    prepare_data(
        SimpleNamespace(dataset=args.dataset, data_dir=args.data_dir)
    )  # unpacks .gz files placed by hand
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((mean,), (std,))])
    return (
        cls(args.data_dir, train=True, transform=transform),
        cls(args.data_dir, train=False, transform=transform),
    )


def train_epoch(model, optimizer, loader, device):
    model.train()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.nll_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return loss.item()


def evaluate(model, loader, device):
    model.eval()
    correct = count = 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            correct += (model(x).argmax(1) == y).sum().item()
            count += len(y)
    return correct / count, count


def main():
    args = build_parser().parse_args()
    # The baseline's default: OMP_NUM_THREADS if set, else every usable core
    torch.set_num_threads(args.threads or parse_args(["--data-dir", args.data_dir]).threads)
    train_set, test_set = datasets_for(args)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = ConvNet().to(device, memory_format=torch.channels_last)  # as the scripts hold it
    keep_pool_gradient_channels_last(model)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, pin_memory=device.type == "cuda"
    )
    train_seconds = 0.0
    for _ in range(args.epochs):
        start = time.perf_counter()
        last_loss = train_epoch(model, optimizer, train_loader, device)  # .item() waits for the GPU to finish
        train_seconds += time.perf_counter() - start
    accuracy, test_count = evaluate(model, DataLoader(test_set, batch_size=TEST_BATCH_SIZE), device)
    metrics = {
        "script": "bench/torchvision_reference.py",
        "dataset": args.dataset,
        "world_size": 1,
        "device": str(device),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "train_seconds": train_seconds,
        "samples_per_second": len(train_set) * args.epochs / train_seconds,
        "final_train_loss": last_loss,
        "test_accuracy": accuracy,
        "test_samples": test_count,
        "peak_rss_mib": peak_memory_mib(),
    }
    print(f"torchvision reference: train loop {train_seconds:.2f} s, test accuracy {100 * accuracy:.2f}%")
    if args.metrics_json:
        write_json(args.metrics_json, metrics)


if __name__ == "__main__":
    main()
