r"""Peer: the ConvNet recipe written the way the PyTorch tutorials write a torchrun + DDP script.

Modelled on pytorch/examples distributed/ddp-tutorial-series/multinode.py: the process group from
torchrun's environment, a Trainer class, a DataLoader with a DistributedSampler (set_epoch every
epoch), DistributedDataParallel; the data and transforms of pytorch/examples mnist/main.py
(torchvision dataset, ToTensor + Normalize per image). Gloo instead of NCCL: this runs on CPUs.
It is deliberately left as its users write it, not tuned: it is what this project is compared with.

    torchrun --standalone --nproc-per-node 2 bench/peers/tutorial_ddp.py \
        --dataset fashion-mnist --data-dir data

--batch-size is per process (64 x 2 processes = a global batch of 128).
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed import all_reduce, barrier, destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

# --dataset: torchvision class, mean and std of its training pixels (the same as the project's scripts).
DATASETS = {
    "mnist": (datasets.MNIST, 0.1302, 0.3069),
    "fashion-mnist": (datasets.FashionMNIST, 0.2860, 0.3530),
}


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1)
        self.dropout1 = nn.Dropout(0.10)
        self.dropout2 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(4608, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def ddp_setup():
    # torchrun sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE; the default init method reads them.
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, test_data, optimizer, log_interval):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.train_data = train_data
        self.test_data = test_data
        self.optimizer = optimizer
        self.log_interval = log_interval
        self.model = DDP(model)
        self.train_seconds = 0.0

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.nll_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch):
        self.model.train()
        self.train_data.sampler.set_epoch(epoch)
        for batch_idx, (source, targets) in enumerate(self.train_data):
            loss = self._run_batch(source, targets)
            if self.global_rank == 0 and batch_idx % self.log_interval == 0:
                print(
                    f"epoch: {epoch} [{batch_idx}/{len(self.train_data)} "
                    f"({100.0 * batch_idx / len(self.train_data):.0f}%)]\t training loss: {loss.item():.6f}",
                    flush=True,
                )

    def test(self, epoch):
        # Each rank scores its shard of the test set; the sums are added up over the ranks.
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, images
        with torch.no_grad():
            for source, targets in self.test_data:
                output = self.model(source)
                totals[0] += F.nll_loss(output, targets, reduction="sum").item()
                totals[1] += output.argmax(dim=1).eq(targets).sum().item()
                totals[2] += len(targets)
        all_reduce(totals)
        loss_sum, correct, count = totals.tolist()
        if self.global_rank == 0:
            print(
                f"Test set, epoch {epoch}: average loss {loss_sum / count:.4f}, accuracy "
                f"{int(correct)}/{int(count)} ({100.0 * correct / count:.2f}%)",
                flush=True,
            )
        return loss_sum / count, correct / count

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            start = time.perf_counter()
            self._run_epoch(epoch)
            self.train_seconds += time.perf_counter() - start
            self.test_loss, self.test_accuracy = self.test(epoch)


def load_train_objs(args):
    cls, mean, std = DATASETS[args.dataset]
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((mean,), (std,))])
    # One process per machine downloads; the others wait for it and then find the files in place.
    if int(os.environ["LOCAL_RANK"]) == 0:
        cls(args.data_dir, train=True, download=True)
        cls(args.data_dir, train=False, download=True)
    barrier()
    train_set = cls(args.data_dir, train=True, transform=transform)
    test_set = cls(args.data_dir, train=False, transform=transform)
    torch.manual_seed(args.seed)
    model = ConvNet()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    return train_set, test_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int, shuffle: bool = True):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        sampler=DistributedSampler(dataset, shuffle=shuffle),
    )


def main(args):
    ddp_setup()
    train_set, test_set, model, optimizer = load_train_objs(args)
    train_data = prepare_dataloader(train_set, args.batch_size)
    test_data = prepare_dataloader(test_set, args.test_batch_size, shuffle=False)
    trainer = Trainer(model, train_data, test_data, optimizer, args.log_interval)
    trainer.train(args.epochs)
    if trainer.global_rank == 0:
        if args.metrics_json:
            metrics = {
                "script": "bench/peers/tutorial_ddp.py",
                "dataset": args.dataset,
                "world_size": trainer.world_size,
                "epochs": args.epochs,
                "batch_size": args.batch_size,
                "global_batch_size": args.batch_size * trainer.world_size,
                "threads": torch.get_num_threads(),
                "train_seconds": trainer.train_seconds,
                "test_loss": trainer.test_loss,
                "test_accuracy": trainer.test_accuracy,
            }
            with open(args.metrics_json, "w") as f:
                json.dump(metrics, f, indent=2)
        print(f"Finished training in {trainer.train_seconds:.2f} secs", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="ConvNet on MNIST with torchrun + DDP, tutorial style")
    parser.add_argument("--epochs", type=int, default=1, help="epochs to train (default: 1)")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="input batch size on each process (default: 64)"
    )
    parser.add_argument("--test-batch-size", type=int, default=1000, help="test batch size (default: 1000)")
    parser.add_argument("--lr", type=float, default=0.5, help="Adadelta learning rate (default: 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--dataset", choices=sorted(DATASETS), default="mnist", help="data set (default: mnist)"
    )
    parser.add_argument("--data-dir", default="./data", help="data folder (default: ./data)")
    parser.add_argument(
        "--log-interval", type=int, default=10, help="batches between progress lines (default: 10)"
    )
    parser.add_argument("--metrics-json", help="write the run's figures here as JSON (default: none)")
    main(parser.parse_args())
