"""Peer: the ConvNet recipe written the way Lightning 2.x users write it.

A LightningModule, a LightningDataModule (torchvision dataset, ToTensor + Normalize per image) and
Trainer(accelerator="cpu", devices=2, strategy="ddp" or "ddp_spawn"); Lightning adds the
DistributedSampler, starts the processes and sets their threads. Logging, checkpointing and the
progress bar are off: the project's scripts do none of them, and the comparison is of training.
It is deliberately left as its users write it, not tuned: it is what this project is compared with.

    python bench/peers/lightning_ddp.py --strategy ddp --dataset fashion-mnist --data-dir data

--batch-size is per process (64 x 2 processes = a global batch of 128).
"""

import argparse
import atexit
import json
import time

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader
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


class LitConvNet(L.LightningModule):
    def __init__(self, lr: float = 0.5, log_interval: int = 10):
        super().__init__()
        self.save_hyperparameters()
        self.model = ConvNet()

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.nll_loss(self(x), y)
        if batch_idx % self.hparams.log_interval == 0:
            batches = self.trainer.num_training_batches
            # self.print prints on global rank 0 only.
            self.print(
                f"epoch: {self.current_epoch} [{batch_idx}/{batches} ({100.0 * batch_idx / batches:.0f}%)]\t"
                f" training loss: {loss.item():.6f}"
            )
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        output = self(x)
        # sync_dist: the epoch's figures are averaged over the processes, each weighted by its batch sizes.
        self.log("test_loss", F.nll_loss(output, y), sync_dist=True)
        self.log("test_acc", (output.argmax(dim=1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return optim.Adadelta(self.parameters(), lr=self.hparams.lr)


class MNISTDataModule(L.LightningDataModule):
    def __init__(self, dataset: str, data_dir: str, batch_size: int, test_batch_size: int):
        super().__init__()
        self.cls, mean, std = DATASETS[dataset]
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.test_batch_size = test_batch_size
        self.transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((mean,), (std,))])

    def prepare_data(self):
        # Lightning calls this on one process per machine: download once.
        self.cls(self.data_dir, train=True, download=True)
        self.cls(self.data_dir, train=False, download=True)

    def setup(self, stage: str):
        if stage == "fit":
            self.train_set = self.cls(self.data_dir, train=True, transform=self.transform)
        if stage == "test":
            self.test_set = self.cls(self.data_dir, train=False, transform=self.transform)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.test_batch_size)


class LoopTimer(L.Callback):
    """Seconds spent in the training epochs (the slowest process's), and the threads a process trains
    with, logged as metrics: under ddp_spawn the metrics are what comes back from the worker processes
    to the one that launched them."""

    def __init__(self):
        self.seconds = 0.0

    def on_train_epoch_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        self.seconds += time.perf_counter() - self.start
        pl_module.log("train_seconds", self.seconds, sync_dist=True, reduce_fx="max")
        pl_module.log("threads", float(torch.get_num_threads()), sync_dist=True, reduce_fx="max")


class DestroyGroupAtExit(L.Callback):
    """Frees the Gloo group before the interpreter's teardown in every process. Lightning does so for NCCL
    only; a Gloo group left to the teardown aborts the process now and then ("terminate called without an
    active exception", pytorch/pytorch#190489), which failed the benchmark. The measured loop is untouched."""

    def setup(self, trainer, pl_module, stage):
        if torch.distributed.is_initialized() and not getattr(DestroyGroupAtExit, "registered", False):
            atexit.register(
                lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group()
            )
            DestroyGroupAtExit.registered = True


def main(args):
    L.seed_everything(args.seed)
    model = LitConvNet(lr=args.lr, log_interval=args.log_interval)
    datamodule = MNISTDataModule(args.dataset, args.data_dir, args.batch_size, args.test_batch_size)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[LoopTimer(), DestroyGroupAtExit()],
    )
    trainer.fit(model, datamodule=datamodule)
    train_seconds = float(trainer.callback_metrics["train_seconds"])
    threads = int(trainer.callback_metrics["threads"])
    results = trainer.test(model, datamodule=datamodule, verbose=False)[0]
    if trainer.is_global_zero:
        count = len(datamodule.cls(args.data_dir, train=False))
        print(
            f"Test set, epoch {args.epochs - 1}: average loss {results['test_loss']:.4f}, accuracy "
            f"{round(results['test_acc'] * count)}/{count} ({100.0 * results['test_acc']:.2f}%)",
            flush=True,
        )
        if args.metrics_json:
            metrics = {
                "script": "bench/peers/lightning_ddp.py",
                "strategy": args.strategy,
                "lightning": L.__version__,
                "dataset": args.dataset,
                "world_size": trainer.world_size,
                "epochs": args.epochs,
                "batch_size": args.batch_size,
                "global_batch_size": args.batch_size * trainer.world_size,
                "threads": threads,
                "train_seconds": train_seconds,
                "test_loss": results["test_loss"],
                "test_accuracy": results["test_acc"],
            }
            with open(args.metrics_json, "w") as f:
                json.dump(metrics, f, indent=2)
        print(f"Finished training in {train_seconds:.2f} secs", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="ConvNet on MNIST with Lightning DDP on CPUs")
    parser.add_argument("--strategy", choices=["ddp", "ddp_spawn"], default="ddp", help="Lightning strategy")
    parser.add_argument("--devices", type=int, default=2, help="processes (default: 2)")
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
