#!/usr/bin/env python3
"""Data-parallel training of a small ConvNet on MNIST, on GPUs: one process per GPU, NCCL.

Each machine runs this script once; it starts one worker per GPU, each training a copy of the model on its
shard while DDP averages the gradients. --batch-size is per process: the global batch is it x world size.
    python convnet_distributed_cuda.py --batch-size 64
Two machines, one launch each, both naming machine 0's address:
    python convnet_distributed_cuda.py --num-machines 2 --machine-id 0 --master-addr 10.0.0.1
    python convnet_distributed_cuda.py --num-machines 2 --machine-id 1 --master-addr 10.0.0.1
Under torchrun, which starts the processes:
    torchrun --nproc-per-node 8 convnet_distributed_cuda.py
Without a GPU, use convnet_distributed.py.
Reading it: the story comes first, in the order a run goes: join_group (the store, the group), data_parallel
(DDP), train (the sampler, set_epoch, the loop), evaluate, worker (leaving the group), main (the launch).
"""

import _thread
import argparse
import contextlib
import ctypes
import gzip
import hashlib
import importlib
import io
import ipaddress
import itertools
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections import namedtuple
from datetime import timedelta
from multiprocessing import resource_tracker

LAUNCH_TIME = time.time()  # before torch's import: total_seconds counts it
# c10d logs failures in C++ with stack traces; the script reports each in one line.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

# ---- 1. Constants
CHECKPOINT_FORMAT = "convnet-mnist-checkpoint-v1"
BACKEND = "NCCL"  # as failure lines name it
TEST_BATCH_SIZE = 1000  # large: a GPU does it in about the time of a small one
START_METHOD = "spawn"  # CUDA cannot run in a forked child of a process that has used it
# Each --dataset's folder, and the mean and std of its training pixels in [0, 1]; then the files in it.
# Folder and file names are torchvision's, which downloads them (FILES unpacked).
DATASETS = {"mnist": ("MNIST", 0.1302, 0.3069), "fashion-mnist": ("FashionMNIST", 0.2860, 0.3530)}
FILES = [f"{split}-{kind}-ubyte" for split in ("train", "t10k") for kind in ("images-idx3", "labels-idx1")]


def print0(message):
    """Rank 0 speaks for the job: one line, not one a process."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


# ---- 2. The model
class ConvNet(nn.Module):
    """Two 3x3 convolutions, max-pool, two linear layers; log-probabilities of 10 classes."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1)
        self.dropout1 = nn.Dropout(0.10)
        self.dropout2 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(4608, 64)  # 32 channels x 12 x 12 after the pool
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


# ---- 3. Data
def raw_folder(args):
    return os.path.join(args.data_dir, DATASETS[args.dataset][0], "raw")


def load_data(args):
    """Both splits: uint8 images [N, 28, 28], int64 labels [N]."""
    tensors = []
    for path, dims in zip([os.path.join(raw_folder(args), name) for name in FILES], [3, 1, 3, 1]):
        try:  # idx: 0, 0, 8 (bytes), dims, each size (big-endian int32), the data
            with open(path, "rb") as f:
                data = bytearray(f.read())  # writable, as torch.frombuffer wants
            if data[:4] != bytes([0, 0, 8, dims]):
                raise ValueError("not an idx file of bytes")
            shape = [int.from_bytes(data[i : i + 4], "big") for i in range(4, 4 + 4 * dims, 4)]
            tensors.append(torch.frombuffer(data, dtype=torch.uint8, offset=4 + 4 * dims).view(shape))
        except Exception as e:
            sys.exit(f"error: cannot read {args.dataset} from {path} ({type(e).__name__}: {e}): replace it")
    return [t.long() if t.dim() == 1 else t for t in tensors]


def to_input(images, dataset):
    """uint8 [B, 28, 28] to float [B, 1, 28, 28], as ToTensor() then Normalize() give."""
    _, mean, std = DATASETS[dataset]
    return images.unsqueeze(1).float().div_(255).sub_(mean).div_(std)


# ---- 4. Join the process group
# Every process runs worker(): it joins the group and trains its own copy of the model on its shard;
# DistributedDataParallel averages the gradients in backward(), so every copy takes the same step.
def join_group(rank, world_size, args, listener=None):
    """Join the process group over NCCL: every process of every machine meets at machine 0's store."""
    # Rank 0 (under torchrun, its agent) serves a key-value store at --master-addr:--master-port; every
    # process connects to it, as init_method="env://" would.
    is_master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    timeout = timedelta(seconds=args.timeout)  # how long to wait for the others, in collectives too
    with rendezvous(rank, is_master, args, listener) as options:  # a failure: one line on every machine
        store = dist.TCPStore(args.master_addr, args.master_port, world_size, is_master, **options)
        store, job = roll_call(store, rank, world_size, args)  # every process checks in, or all stop
        importlib.import_module("torch._dynamo")  # as DDP would, but before the group (docs/compat.md)
        # With device_id, NCCL connects inside init_process_group, not at DDP's first step.
        gpu = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=gpu
        )
    return job


# ---- 5. Wrap the model in DDP
def data_parallel(model, args):
    """DDP around model, with the hooks on its gradients: local SGD's average, else DDP's own."""
    device = next(model.parameters()).device
    # DDP broadcasts rank 0's weights: all copies start equal. device_ids: this process's GPU (None on a
    # CPU, where the tests run).
    ddp_model = DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device.index])
    hook_gradients(ddp_model, args)
    return ddp_model


# ---- 6. Train and evaluate
def train(model, optimizer, data, rank, world_size, args):
    """Each epoch: train on this rank's shard, evaluate, checkpoint; then report."""
    device = next(model.parameters()).device
    train_images, train_labels, test_images, test_labels = (t.to(device) for t in data)
    ddp_model = data_parallel(model, args)
    start_epoch = resume(model, optimizer, args) if args.resume else 0
    print0(layout_line(world_size, args, "gloo" if device.type == "cpu" else "nccl"))
    sampler = DistributedSampler(train_labels, num_replicas=world_size, rank=rank, seed=args.seed)
    seconds, history = 0.0, []
    for epoch in range(start_epoch, args.epochs):
        # Each rank draws its own dropout masks, and a resumed run draws those of an unbroken one.
        torch.manual_seed(args.seed + epoch * world_size + rank)
        batches = epoch_batches(sampler, epoch, args.batch_size, device)
        # Ranks in step here: DDP's set-up and each evaluation synchronise them.
        start = time.perf_counter()
        train_loss = train_epoch(ddp_model, optimizer, train_images, train_labels, batches, epoch, args)
        seconds += time.perf_counter() - start
        dist.all_reduce(train_loss)  # the sum of the ranks' mean losses
        test_loss, accuracy, n_test = evaluate(model, test_images, test_labels, rank, world_size, args)
        correct = f"{round(accuracy * n_test)}/{n_test} ({accuracy:.2%})"
        print0(f"Test set, epoch {epoch}: average loss {test_loss:.4f}, accuracy {correct}")
        loss = train_loss.item() / world_size
        history.append(dict(epoch=epoch, train_loss=loss, test_loss=test_loss, test_accuracy=accuracy))
        if args.checkpoint:
            save_checkpoint(model, optimizer, epoch, args)
    if not history:
        print0(f"Nothing to train: the checkpoint already holds {start_epoch} epoch(s)")
        test_loss, accuracy, n_test = evaluate(model, test_images, test_labels, rank, world_size, args)
    test = test_loss, accuracy, n_test
    report(args, device, history, seconds, len(train_labels), test, compress=args.compress)


def epoch_batches(sampler, epoch, batch_size, device):
    """This rank's batches, as index tensors: a DataLoader's with this sampler, minus per-image work."""
    sampler.set_epoch(epoch)  # else every epoch repeats the first one's order
    return torch.tensor(list(sampler), device=device).split(batch_size)  # one copy to the GPU per epoch


def train_epoch(model, optimizer, images, labels, batches, epoch, args):
    """One pass over this rank's batches; returns its mean training loss (a tensor)."""
    model.train()
    loss_sum, n = torch.zeros((), device=images.device), len(batches)
    for i, idx in enumerate(batches):
        with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = F.nll_loss(model(to_input(images[idx], args.dataset)), labels[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over all ranks here, bucket by bucket
        optimizer.step()
        loss_sum += loss.detach()
        if i % args.log_interval == 0:
            progress = f"[{i}/{n} ({100.0 * i / n:.0f}%)]"
            print0(f"epoch: {epoch} {progress}\t training loss: {loss.item():.6f}")
    return loss_sum / n


def evaluate(model, images, labels, rank, world_size, args):
    """Loss and accuracy on the test set: rank r takes images r, r + world size, ..., so none counts twice."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=images.device)  # loss sum, correct, images
    with torch.no_grad(), torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=args.amp):
        for idx in torch.arange(rank, len(labels), world_size, device=images.device).split(TEST_BATCH_SIZE):
            output, y = model(to_input(images[idx], args.dataset)), labels[idx]
            totals[0] += F.nll_loss(output, y, reduction="sum")
            totals[1] += (output.argmax(1) == y).sum()
            totals[2] += len(idx)
    dist.all_reduce(totals)
    release_freed_memory()  # the heap kept for the training steps goes back until the next epoch
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


def release_freed_memory():
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing was kept
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def save_checkpoint(model, optimizer, epoch, args):
    state = dict(format=CHECKPOINT_FORMAT, epoch=epoch, dataset=args.dataset, args=vars(args))
    state.update(model=model.state_dict(), optimizer=optimizer.state_dict())
    write_on_rank0(args, args.checkpoint, lambda f: torch.save(state, f))


# ---- 7. The worker: join, train, leave
def worker(local_rank, args, data, listener=None):
    rank, world_size = args.first_rank + local_rank, args.world_size
    torch.set_num_threads(args.threads)
    device = select_device(local_rank)
    job = join_group(rank, world_size, args, listener)  # args and the roll call's layout
    try:
        if data is None and not job.check:  # local rank 0 fetches the files, the others wait
            if local_rank == 0:
                prepare_data(job)
            dist.barrier()
            data = load_data(job)
        job = try_the_group(world_size, device, data, job)  # rank 0's files; the data and the link checked
        if job.check:
            return
        torch.manual_seed(job.seed)  # the baseline script's initial weights
        model = ConvNet().to(device, memory_format=torch.channels_last)  # cuDNN's tensor cores' layout
        optimizer = optim.Adadelta(model.parameters(), lr=job.lr)
        train(model, optimizer, data, rank, world_size, job)
    except RuntimeError as e:
        exit_if_contact_lost(e, rank, job)  # a lost peer: one line, not a traceback
        raise
    finally:
        dist.destroy_process_group()  # leave the group, however the run ends


# ---- 8. Launch
def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU is visible: this script needs one; on CPUs run convnet_distributed.py")
    if args.rank is None and args.num_gpu_processes > torch.cuda.device_count():  # else prepare_backend does
        sys.exit(
            f"error: --num-gpu-processes {args.num_gpu_processes}: "
            f"only {torch.cuda.device_count()} GPU(s) visible"
        )
    with exit_on_signal(args):  # Ctrl-C or SIGTERM stops all this launch's processes, in one line
        if args.rank is not None:  # a launcher started this process as one rank
            return worker(args.local_rank, args, None)
        # Hold rank 0's rendezvous port; a one-machine job given none takes a free one: jobs never meet.
        listener, port = claim_port(args)
        job = argparse.Namespace(**vars(args) | dict(master_port=port))  # a record apart from the command's
        if not args.check:  # once per machine: workers fetching into one folder would race
            prepare_data(args)
        # Each spawned worker loads its own data (as fast as a copy: bench/README.md).
        if args.num_gpu_processes == 1:
            worker(0, job, None, listener)
        else:  # mp.spawn(worker, args=(args, None, listener), nprocs=N), with the signals held
            run_workers(job, None, args.num_gpu_processes, listener)


# ============================================================================================================
# Machinery: what makes the story above fail clearly and run fast; a first reading may skip it.
# M1-M2: this script's own rooms; S1-S9: the block shared with convnet_distributed.py.
# ============================================================================================================


# ---- M1. This script's layout: flags, else the launcher's, else every GPU ----------------------------------
def build_parser():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def add(flag, help, **options):  # the article's --batch_size works too
        if options.get("type") in (int, positive_int):  # --help shows N, not EPOCHS
            options["metavar"] = "N"
        p.add_argument(*dict.fromkeys([flag, "--" + flag[2:].replace("-", "_")]), help=help, **options)

    add("--epochs", "epochs to train (default: 1)", type=positive_int, default=1)
    add("--batch-size", "images per batch, per process (default: 64)", type=positive_int, default=64)
    add("--lr", "Adadelta learning rate (default: 0.5)", type=positive_float, default=0.5)
    add("--seed", "random seed (default: 0)", type=int, default=0)
    add("--dataset", "data set (default: mnist)", choices=sorted(DATASETS), default="mnist")
    add("--data-dir", "data folder, DIR/MNIST/raw (default: ./data)", metavar="DIR", default="./data")
    add("--log-interval", "batches between progress lines (default: 10)", type=positive_int, default=10)
    add("--threads", "threads per process (default: OMP_NUM_THREADS or cores/processes)", type=positive_int)
    add("--amp", "bfloat16 autocast (default: off)", action="store_true")
    add("--checkpoint", "save the model and optimizer each epoch (default: none)", metavar="PATH")
    add("--resume", "continue from --checkpoint if it exists (default: off)", action="store_true")
    add("--metrics-json", "the run's figures as JSON (default: none)", metavar="PATH")
    add("--num-machines", "machines in the job (default: 1)", type=positive_int)
    add("--num-gpu-processes", "processes here, one per GPU from 0 (default: every GPU)", type=positive_int)
    add("--machine-id", "this machine's index, from 0 (default: 0)", type=int)
    add("--master-addr", "machine 0's address (default: MASTER_ADDR, else 127.0.0.1)")
    add("--master-port", "port (default: MASTER_PORT, else 8892; one machine: a free one)", type=port_number)
    compress = "local-sgd: average the model every 64 steps; auto: for slow links (default: none)"
    add("--compress", compress, choices=["none", "local-sgd", "auto"], default="none")
    add("--timeout", "seconds to wait for peers (default: 300)", type=positive_float, default=300)
    add("--check", "make the group, average once, exit (default: off)", action="store_true")
    p.processes = "num_gpu_processes", max(1, torch.cuda.device_count())  # its flag and default
    return p


# ---- M2. GPUs and NCCL -------------------------------------------------------------------------------------
def select_device(local_rank):
    """Made current: NCCL binds the rank to it."""
    keep_freed_memory()
    local_rank %= torch.cuda.device_count()  # srun --gpus-per-task=1 shows a task its GPU as cuda:0
    torch.cuda.set_device(local_rank)
    torch.set_float32_matmul_precision("high")  # TF32, as cuDNN's convolutions
    return torch.device("cuda", local_rank)


def prepare_backend(store, rank, world_size, args):
    """NCCL's unauthenticated bootstrap on loopback in a one-machine job; ranks sharing a GPU stop."""
    if world_size == args.processes_here and not getenv("NCCL_SOCKET_IFNAME"):
        os.environ["NCCL_SOCKET_IFNAME"] = "=lo"  # "=": lo exactly, not lo*
    index = torch.cuda.current_device()
    gpu = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))  # a GPU each process calls cuda:0
    host = socket.gethostname()
    mine = str(rank).encode()
    if gpu and (first := store.compare_set(key := f"gpu/{host} {gpu}", "", mine)) != mine:
        if not first.isdigit():  # the store is unauthenticated
            abort_job(store, rank, args, bad_value(rank, key, first))
        low, high = sorted((int(first), rank))
        line = f"error: ranks {low} and {high} share one GPU (cuda:{index} on {host}): give each its own"
        abort_job(store, rank, args, f"{line} (a launcher's local rank, or CUDA_VISIBLE_DEVICES)")


def averaging_words(allreduce, args):  # tests on CPUs use Gloo
    how = "by NCCL" if allreduce == "nccl" else "over Gloo"
    if args.compress == "local-sgd":
        return f"copies averaged {how} every {LOCAL_SGD_PERIOD} steps (local SGD)"
    return f"gradients averaged {how}"


def hook_gradients(ddp, args):
    match_gradient_strides(ddp.module)
    keep_pool_gradient_channels_last(ddp.module)
    if hook := local_sgd(ddp, args):
        ddp.register_comm_hook(*hook)


def match_gradient_strides(model):
    """cuDNN strides conv1's weight gradient its own way: else DDP copies it ("Grad strides do not match")."""

    def restated(grad, p):  # strides differ only in size-1 dimensions: no element moves
        same = all(a == b for a, b, n in zip(grad.stride(), p.stride(), p.shape) if n > 1)
        return grad.as_strided(p.shape, p.stride()) if same else grad

    for p in model.parameters():
        if 1 in p.shape:
            p.register_hook(lambda grad, p=p: restated(grad, p))


# ============================================================================================================
# Shared block: edited in convnet_distributed.py; `python tools/sync_shared_block.py` copies it into
# convnet_distributed_cuda.py (CI checks). It needs from its script: ConvNet, DATASETS, FILES, BACKEND,
# CHECKPOINT_FORMAT, START_METHOD, LAUNCH_TIME, build_parser, prepare_backend, averaging_words, worker, print0
# and raw_folder.
# ============================================================================================================


# ---- S1. Launchers: who started this process, and the layout it says ---------------------------------------
# The first launcher whose rank, world size and local rank are set started this process (torchrun and
# mpirun pass SLURM's on). Each one's variables in Launcher's order ("-": it sets none), then its launch's.
Launcher = namedtuple("Launcher", "name rank world_size local_rank local_size machine machines launch")
LAUNCHER_VARIABLES = {
    # GROUP_WORLD_SIZE counts the nodes, which may run different numbers of processes.
    "torchrun": "RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE TORCHELASTIC_RUN_ID",
    "Open MPI": "OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_RANK "
    "OMPI_COMM_WORLD_LOCAL_SIZE - - PMIX_NAMESPACE",
    "MPICH": "PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS - -",  # Intel MPI's too: both are Hydra
    "MVAPICH": "MV2_COMM_WORLD_RANK MV2_COMM_WORLD_SIZE MV2_COMM_WORLD_LOCAL_RANK "
    "MV2_COMM_WORLD_LOCAL_SIZE - -",
    # Only srun's tasks have SLURM_STEP_*: a shell inside an allocation is no launch.
    "SLURM": "SLURM_PROCID SLURM_STEP_NUM_TASKS SLURM_LOCALID SLURM_STEP_TASKS_PER_NODE SLURM_NODEID "
    "SLURM_STEP_NUM_NODES SLURM_JOB_ID SLURM_STEP_ID",
    # Kubeflow's PyTorchJob, hand-written env:// jobs: each launch is one process on its own machine.
    "RANK and WORLD_SIZE": "RANK WORLD_SIZE - - RANK WORLD_SIZE",
}
LAUNCHERS = [
    Launcher(name, *[None if v == "-" else v for v in variables.split()[:6]], variables.split()[6:])
    for name, variables in LAUNCHER_VARIABLES.items()
]
BY_HAND = Launcher(None, *[None] * 6, [])


def parse_args(argv=None):
    """The flags, else the launcher's layout, else defaults; then the checks argparse cannot make."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.master_addr = args.master_addr and args.master_addr.strip("[]")  # IPv6 as in URLs: [fd00::1]
    found = (x for x in LAUNCHERS if all(getenv(v) for v in (x.rank, x.world_size, x.local_rank) if v))
    launcher = next(found, BY_HAND)
    args.launcher = launcher.name
    args.by_host = launcher is not BY_HAND and launcher.machine is None
    vars(args).update(layout_flags(parser, args, launcher))  # and the launcher's rank and world size
    launched = args.rank is not None
    args.local_rank = env_number(parser, launcher, launcher.local_rank, 0) if launched else 0
    if not 0 <= args.machine_id < args.num_machines:
        parser.error(f"--machine-id must be in 0-{args.num_machines - 1} for {args.num_machines} machines")
    try:  # MASTER_PORT, unchecked so far
        args.master_port = port_number(str(args.master_port)) if args.master_port else 0
    except (ValueError, argparse.ArgumentTypeError):
        parser.error(f"MASTER_PORT={args.master_port!r} is no port (1-65535): fix it, or pass --master-port")
    args.processes_here = here = getattr(args, parser.processes[0])
    args.first_rank = args.rank - args.local_rank if launched else args.machine_id * here
    args.world_size = args.world_size if launched else args.num_machines * here
    args.machine_sizes = [here] * args.num_machines  # the roll call counts a launcher's
    args.launch_note = launch_note(args)
    ids = [getenv(v) for v in launcher.launch]
    ids = ids if launcher.name else [socket.gethostname(), os.getpid(), LAUNCH_TIME]
    args.launch_id = "/".join(map(str, ids)) if ids and None not in ids else None
    # Where SLURM started each rank as a task, SLURM_CPUS_PER_TASK is the rank's own.
    cpus = launched and launcher.name == "SLURM" and env_number(parser, launcher, "SLURM_CPUS_PER_TASK")
    # Only rank 0's command names the files, so only its machine checks them.
    files = (args.rank if launched else args.first_rank) == 0
    # Where the user set none, torchrun sets OMP_NUM_THREADS=1, absent from its own environment.
    torchrun_omp = False  # not Linux: the user's
    with contextlib.suppress(OSError), open(f"/proc/{os.getppid()}/environ", "rb") as f:
        torchrun_omp = launcher.name == "torchrun" and b"\0OMP_NUM_THREADS=" not in b"\0" + f.read()
    return check_args(parser, args, 1 if cpus else here, files, torchrun_omp and bool(args.launch_id))


def layout_flags(parser, args, launcher):
    """Layout and rendezvous flags: as given (if the launcher agrees), else as it says, else the default."""
    rank = env_number(parser, launcher, launcher.rank, 0)
    world_size = env_number(parser, launcher, launcher.world_size, 1)
    machine = env_number(parser, launcher, launcher.machine)
    local_size = env_number(parser, launcher, launcher.local_size, 1, index=machine or 0)
    machines = env_number(parser, launcher, launcher.machines, -(-world_size // local_size))
    own = launcher.name == "SLURM" and world_size == machines  # a task a node: this script starts the rest
    addr, port = getenv("MASTER_ADDR", "").strip("[]") or None, getenv("MASTER_PORT")
    said = dict(master_addr=addr, master_port=port) if launcher.rank == "RANK" else {}  # env://'s store
    if launcher.name == "SLURM":  # a step's first node, and a port of its own: steps share nodes
        job, step = (env_number(parser, launcher, f"SLURM_{v}_ID", 0) for v in ("JOB", "STEP"))
        port = port or 15000 + (job * 97 + step) % 17000
        # The first host of its compressed list (no scontrol): rack07-n1 of rack[07-08]-n[1-2],gpu1.
        nodes = getenv("SLURM_STEP_NODELIST") or getenv("SLURM_JOB_NODELIST", "localhost")
        first = re.match(r"[^,\[]*(\[[^\]]*\][^,\[]*)*", nodes).group()
        addr = addr or re.sub(r"\[([^,\]-]*)[^\]]*\]", r"\1", first)  # each bracket's first number
    if args.by_host and machines > 1 and not (args.master_addr or addr):
        fix = "give machine 0's address as --master-addr or MASTER_ADDR (mpirun -x MASTER_ADDR=node0)"
        parser.error(f"{launcher.name} runs this job on {machines} machines: {fix}")
    processes, default = parser.processes
    if launcher is not BY_HAND:
        said.update(num_machines=machines, machine_id=rank // local_size if machine is None else machine)
        said[processes] = None if own else local_size
    port = port or (0 if launcher is BY_HAND and (args.num_machines or 1) == 1 else 8892)  # 0: a free one
    defaults = {processes: default, "num_machines": 1, "machine_id": 0, "master_addr": addr or "127.0.0.1"}
    fix = f"give {launcher.name} the same"
    fix = "unset RANK and WORLD_SIZE" if launcher.name == "RANK and WORLD_SIZE" else fix
    taken = dict(rank=None if own or launcher is BY_HAND else rank, world_size=world_size)  # None: no rank
    for key, default in {**defaults, "master_port": port}.items():
        given = getattr(args, key)
        if None not in (given, said.get(key)) and str(given) != str(said[key]):
            flag = f"--{key.replace('_', '-')} {given} disagrees with {launcher.name}"
            parser.error(f"{flag}, which set {said[key]}: drop the flag, or {fix}")
        taken[key] = next(v for v in (given, said.get(key), default) if v is not None)
    return taken


def env_number(parser, launcher, variable, default=None, index=0):
    """An environment variable as a number; of SLURM's counts per node (2(x3),1: 2, 2, 2, 1), this node's."""
    text = getenv(variable) if variable else None
    try:
        if text is None or text.isdigit():
            return default if text is None else int(text)
        parts = (part.rstrip(")").partition("(x") for part in text.split(","))
        return [int(n) for n, _, times in parts for _ in range(int(times or 1))][index]
    except (ValueError, IndexError):
        parser.error(f"{launcher.name} set {variable}={text!r}, which is not a whole number")


def launch_note(args):
    nodes = plural(args.num_machines, "node")
    if args.launcher == "torchrun" and (restart := getenv("TORCHELASTIC_RESTART_COUNT", "0")) != "0":
        return f"torchrun, restart {restart}"
    if args.launcher == "SLURM":
        tasks = plural(args.world_size, "task")
        return f"SLURM: {nodes}, one task each" if args.rank is None else f"SLURM: {tasks} on {nodes}"
    return f"mpirun, {args.launcher}: {plural(args.world_size, 'rank')}" if args.by_host else args.launcher


# ---- S2. The rendezvous: machine 0's port and store --------------------------------------------------------
@contextlib.contextmanager
def rendezvous(rank, is_master, args, listener):
    """Yields TCPStore's options. A failure is one line on every machine; C++'s log waits for the group."""
    options = dict(timeout=timedelta(seconds=args.timeout), wait_for_workers=False)  # roll_call waits
    if is_master and (listener := claim_port(args, listener, serve=True)[0]):  # a launcher's rank 0 claims it
        options.update(master_listen_fd=listener.detach(), use_libuv=torch.__version__ >= "2.8")
    elif listener:
        listener.close()
    if not is_master:  # machine 0's port refuses connections till its store serves
        resolve(args, rank, connect=True)
    own = {}  # the watcher's store client, or its error
    done = threading.Event()
    real = os.dup(2)
    watcher = threading.Thread(target=watch_for_abort, args=(own, done, real, rank, args), daemon=True)
    sys.stderr.flush()
    try:
        with tempfile.TemporaryFile() as held, signals_heard_in_cpp():
            os.dup2(held.fileno(), 2)
            watcher.start()
            try:
                if not is_master:  # TCPStore's client waits in C++, deaf to signals, on a stopped machine 0
                    wait_for_machine0(own, rank, args)
                yield options
            finally:
                done.set()
                watcher.join(5 if "store" in own else 0)  # one that saw the abort line ends the process
                os.dup2(real, 2)
            held.seek(0)
            sys.stderr.buffer.write(held.read())
            sys.stderr.flush()
        GROUPS_KEPT.append(dist.group.WORLD)
    except RuntimeError as e:
        line = f"{BACKEND} cannot connect the processes ({last_line(e)}): open TCP between machines, or set"
        abort_job(own.get("store"), rank, args, f"error: rank {rank}: {line} {BACKEND.upper()}_SOCKET_IFNAME")
    finally:
        os.close(real)


@contextlib.contextmanager
def signals_heard_in_cpp():
    """Ctrl-C and SIGTERM end the process even while a store call, deaf to them, holds the main thread."""
    read, write = os.pipe()
    before = None
    with contextlib.suppress(ValueError, AttributeError):  # not the main thread; Windows: no such pipe
        os.set_blocking(write, False)
        before = signal.set_wakeup_fd(write)  # Python writes each signal here, for the thread
    threading.Thread(target=exit_if_unheard, args=(read,), daemon=True).start()
    try:
        yield
    finally:
        if before is not None:
            signal.set_wakeup_fd(before)
        os.close(write)  # the thread reads the end and returns


def exit_if_unheard(read):
    with open(read, "rb", buffering=0) as pipe:
        if signum := pipe.read(1):
            time.sleep(3)  # where it can, the main thread stops with its own line
            exit_at_once(128 + signum[0])


def wait_for_machine0(own, rank, args):
    line = f"error: rank {rank}: machine 0 at {args.master_addr}:{args.master_port}"
    for _ in waiting(rank, args, lambda: f"Waiting for machine 0 at {args.master_addr}:{args.master_port}"):
        if "store" in own:
            return
        if "error" in own:
            sys.exit(f"{line} went away ({last_line(own['error'])}): see its output")
    sys.exit(f"{line} did not answer within --timeout {args.timeout:g} s: it is stopped or hangs")


def watch_for_abort(own, done, real, rank, args):
    """In a thread, with its own store client (the backend's may be busy): abort_job's line."""
    try:
        store = dist.TCPStore(args.master_addr, args.master_port, timeout=timedelta(seconds=args.timeout))
        own["store"] = attempt_store(store, args)
    except (dist.DistError, OSError) as e:  # machine 0 went away
        own["error"] = e
    with contextlib.suppress(RuntimeError, KeyError):  # machine 0 went: the backend says so
        while not done.wait(0.5):
            if own["store"].check(["abort"]):
                os.dup2(real, 2)
                line = own["store"].get("abort").decode(errors="replace").strip()[:2000]
                abort_job(None, rank, args, line, end=exit_at_once)  # sys.exit would end the thread alone


def claim_port(args, listener=None, serve=False):
    """Machine 0's socket and port (--master-port, or a free one), bound; it listens once rank 0 serves."""
    if args.machine_id != 0:
        return None, args.master_port
    try:
        if listener is None:  # the store is unauthenticated: a one-machine job serves it on loopback
            hosts = [address[0] for *_, address in resolve(args, 0, connect=False)]
            one_host = args.num_machines == 1 and all(map(is_loopback, hosts))
            host = min(hosts, key=lambda h: ":" in h) if one_host else ""  # IPv4 first: ::1 may be off
            listener = bound_socket(args.master_port, host)
        if serve:  # bound by another launch too (SO_REUSEADDR): the first to listen holds it
            listener.listen()
    except OSError as e:
        if args.launcher is None and args.num_machines > 1:  # a copied --machine-id 0 while the job forms
            machine0_twice(args)
        why = "only root may serve it" if isinstance(e, PermissionError) else "another program holds the port"
        free = ", or none for a free one" * (args.launcher is None and args.num_machines == 1)  # else 8892
        where = f"{args.master_addr}:{args.master_port} ({e.strerror})"
        sys.exit(f"error: cannot serve the rendezvous on {where}: {why}: choose a free --master-port{free}")
    if os.name != "posix":  # Windows: TCPStore binds for itself
        with listener:
            return None, listener.getsockname()[1]
    return listener, listener.getsockname()[1]


def bound_socket(port, host=""):
    """A socket bound to host, or to every address (IPv6 and IPv4 where it can, as TCPStore)."""
    dual = not host and socket.has_dualstack_ipv6()
    sock = socket.socket(socket.AF_INET6 if dual or ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, os.name == "posix")  # as socket.create_server
    if dual:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind((host, port))
    return sock


def machine0_twice(args):
    """Stops every launch where the port's holder is this job's machine 0 from another launch."""
    me = roll_call_record(0, args.world_size, args)
    found = []

    def ask():  # in a thread: TCPStore waits forever on a silent server
        with contextlib.suppress(RuntimeError, ValueError):
            store = dist.TCPStore(args.master_addr, args.master_port, timeout=timedelta(seconds=5))
            if store.check(["job"]) and not store.check(["ready"]):
                found.append((store, from_json(store.get("job"))))

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(5)
    for store, first in found:
        same_job = is_record(first) and all(first[k] == me[k] for k in ("job", "launcher"))
        if same_job and first["launch"] != me["launch"]:
            abort_job(store, 0, args, claimed_twice(0, first, me, args))


def resolve(args, rank, connect):
    """--master-addr's addresses; with connect, the ends of a connection to machine 0 once it listens."""
    addr, port = args.master_addr, args.master_port
    for _ in waiting(rank, args, lambda: f"Waiting for machine 0 at {addr}:{port}"):  # TCPStore's is deaf
        try:
            found = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
            if connect:  # this end's address, and machine 0's as seen from here
                with socket.create_connection((addr, port), timeout=5) as s:
                    return [end[0].split("%")[0] for end in (s.getsockname(), s.getpeername())]
            return found
        except socket.gaierror as e:
            why = f"--master-addr {addr} does not resolve ({e.strerror}): give machine 0's address"
        except OSError as e:
            why = f"no answer from machine 0 at {addr}:{port} within --timeout {args.timeout:g} s"
            why += f" ({e.strerror or e}): start it, or check --master-addr, --master-port and the firewall"
    sys.exit(f"error: rank {rank}: {why}")


def waiting(rank, args, what, seconds=None):
    """Yields every 0.1 s for seconds (--timeout); local rank 0 says what() it waits for at 5 s, each 30 s."""
    start, say = time.monotonic(), 5  # when the wait began, when it speaks next
    while (waited := time.monotonic() - start) < (seconds or args.timeout):
        if waited >= say and rank == args.first_rank:
            left = f"{max(0, args.timeout - waited):.0f} s left of --timeout {args.timeout:g} s"
            print(f"{what()} ({left})", flush=True)
            say = waited + 30
        yield
        time.sleep(0.1)


def wait_for_key(store, rank, args, key, who):
    """store.get(key), waited for hearing signals; past --timeout, who stopped after joining."""
    for _ in waiting(rank, args, lambda: f"Waiting for {who}"):
        if store.check([key]):
            return store.get(key)
    line = f"{who} sent nothing within --timeout {args.timeout:g} s: it stopped after joining"
    abort_job(store, rank, args, f"error: rank {rank}: {line} (see its output)")


def is_loopback(address):
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def attempt_store(store, args):
    """torchrun's store outlives a restart: keep each attempt's keys apart."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)
    return dist.PrefixStore(f"attempt-{restart}/", store) if args.launcher == "torchrun" else store


# ---- S3. The roll call: one job, one decision --------------------------------------------------------------
# Flags that must agree on every machine (the first four: the layout), rank 0's alone, each machine's own.
JOB_FLAGS = ("world_size", "num_machines", "num_processes", "num_gpu_processes", "dataset", "batch_size")
JOB_FLAGS += ("epochs", "lr", "seed", "amp", "allreduce", "compress", "check", "torch", "model", "backend")
RANK0_FLAGS = ("checkpoint", "resume", "metrics_json")
MACHINE_FLAGS = ("data_dir", "log_interval", "threads", "timeout", "machine_id", "master_addr", "master_port")
SCRIPT = os.path.basename(__file__)


def roll_call(store, rank, world_size, args):
    """Every process checks in, and rank 0 counts the machines, or all stop; the job's store and record."""
    store = attempt_store(store, args)
    me = roll_call_record(rank, world_size, args)
    me["address"], far = resolve(args, rank, connect=True)  # where the others reach us; where we reach 0
    mine = json.dumps(me)
    try:
        if rank != 0:  # rank 0's record is the job's
            job = read_record(store, rank, args, wait_for_key(store, rank, args, "job", "rank 0"), me)
            check_one_job(store, rank, args, job, me)
        keys = ["job", "rank/0"] if rank == 0 else [f"rank/{rank}"]  # "job" first: a second rank 0 finds it
        for key in keys:
            if (held := store.compare_set(key, "", mine)) != mine.encode():
                first = read_record(store, rank, args, held, me)
                stop_roll_call(store, rank, args, claimed_twice(rank, first, me, args))
        machines = wait_for_ready(store, rank, world_size, args, me, far)
    except dist.DistError as e:  # rank 0 gave up, or its machine went away
        abort_job(None, rank, args, f"error: rank {rank}: lost machine 0 while waiting ({last_line(e)})")
    job = argparse.Namespace(**vars(args) | machines | dict(own_address=me["address"], machine0_address=far))
    prepare_backend(store, rank, world_size, job)
    reach_every_machine(store, rank, job)  # a firewall may let only the rendezvous port through
    return store, job


def check_one_job(store, rank, args, job, me):
    """Stops where machine 0's record is another job's (this process alone) or has other flags (every one)."""
    facts = job["job"], me["job"]
    differ = [k for k in JOB_FLAGS if k in facts[0] and k in facts[1] and facts[0][k] != facts[1][k]]
    theirs, ours = (", ".join(flag_words(k, f[k]) for k in differ) for f in facts)
    if "model" in differ:  # name its first parameter that differs
        pairs = itertools.zip_longest(*(f["model"] for f in facts), fillvalue="none")
        theirs, ours = next(p for p in pairs if p[0] != p[1])
    this = f"rank {rank}" if args.by_host else f"machine {me['machine']}"  # mpirun's: told at "ready"
    sides = f"machine 0 ({job['host']}) has {theirs}; {this} ({me['host']}) has {ours}"
    # A job starts one way, as one launch (by hand: one a machine), or this process stops alone.
    another = job["launch"] != args.launch_id and (args.launcher or args.machine_id == 0)
    if job["launcher"] != args.launcher or another:
        line = f"{args.master_addr}:{args.master_port} is another job's rendezvous"
        line += f" ({sides})" * bool(differ)
        abort_job(None, rank, args, f"error: {line}: choose another --master-port")
    if differ:
        flags = ", ".join(map(flag_words, differ))
        fix = "script and torch version" if {"torch", "model", "backend"} & {*differ} else flags
        line = f"error: the machines disagree on {flags}: {sides}: use the same {fix} on every machine"
        stop_roll_call(store, rank, args, line)


def wait_for_ready(store, rank, world_size, args, me, far):
    """Rank 0's "ready", written once all have checked in: each rank's machine and each machine's address."""
    keys = [f"rank/{r}" for r in range(world_size)]

    def progress():  # rank 0 names who is missing: machines where the layout says (by hand), else ranks
        if rank != 0:
            return f"Waiting for all {world_size} processes to join at {args.master_addr}:{args.master_port}"
        gone = [r for r, key in enumerate(keys) if not store.check([key])]
        who = [*dict.fromkeys(r // args.processes_here if args.rank is None else r for r in gone)]
        kind = ("machine" if args.rank is None else "rank") + "s" * (len(who) > 1)
        names = ", ".join(map(str, who[:8])) + ", ..." * (len(who) > 8)
        return f"{world_size - len(gone)} of {world_size} processes have joined; waiting for {kind} {names}"

    for _ in waiting(rank, args, progress, float("inf") if rank else None):
        if store.check(keys if rank == 0 else ["ready"]):
            if rank == 0:
                records = [read_record(store, rank, args, store.get(key), me) for key in keys]
                mine = json.dumps(count_machines(records, args))
                if (held := store.compare_set("ready", "", mine)) != mine.encode():  # rank 0's word alone
                    abort_job(store, rank, args, bad_value(rank, "ready", held))
            break
    else:  # rank 0 alone: the others wait for its word
        if args.launcher:
            fix = f"the launcher ({args.launcher}) started them all: see its output for the others"
        elif (n := args.num_machines) > 1:
            fix = f"start every machine (--num-machines {n}) with one --master-addr and --master-port"
        else:
            fix = "this machine started them too slowly: raise --timeout"
        line = f"only {sum(store.check([k]) for k in keys)} of {world_size} processes joined within --timeout"
        abort_job(store, rank, args, f"error: {line} {args.timeout:g} s: {fix}")
    ready = store.get("ready")
    with contextlib.suppress(TypeError, ValueError):  # else another program wrote "ready"
        of, ips = from_json(ready)  # machine 0 on loopback (Debian's name): where we reached it
        ips = [far if is_loopback(a) else str(ipaddress.ip_address(a)) for a in ips]
        numbered = list(dict.fromkeys(of)) == list(range(len(ips)))  # in order of first rank
        if len(of) == world_size and numbered and all(type(m) is int for m in of):
            sizes = [of.count(m) for m in range(len(ips))]
            return dict(machine_id=of[rank], num_machines=len(sizes), machine_sizes=sizes, addresses=ips)
    abort_job(store, rank, args, bad_value(rank, "ready", ready))


def stop_roll_call(store, rank, args, line):
    """Stops every process with line until the job is ready; then this one alone."""
    abort_job(None if store.check(["ready"]) else store, rank, args, line)


def read_record(store, rank, args, raw, me):
    """A roll call record from the unauthenticated store; anything else stops the job."""
    if is_record(found := from_json(raw)):
        return found
    if isinstance(found, dict) and found.get("script", me["script"]) != me["script"]:
        line = f"machine {found.get('machine')} runs another version of {SCRIPT}"
        stop_roll_call(store, rank, args, f"error: {line}: copy one script to every machine")
    stop_roll_call(store, rank, args, bad_value(rank, "a record", raw))


def roll_call_record(rank, world_size, args):
    layout = JOB_FLAGS[1:4] if args.rank is not None else ()  # a launcher's may vary processes per machine
    job = {k: getattr(args, k) for k in JOB_FLAGS if hasattr(args, k) and k not in layout}
    with torch.device("meta"):  # meta tensors have shapes but no memory or random numbers
        job["model"] = [f"{n} {list(p.shape)}" for n, p in ConvNet().named_parameters()]
    job.update(world_size=world_size, torch=torch.__version__.split("+")[0], backend=f"{BACKEND} ({SCRIPT})")
    box = host = socket.gethostname()  # MPI may repeat host names: the boot and network namespace tell apart
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        box += f" {f.read().strip()} {os.readlink('/proc/self/ns/net')}"
    with open(__file__, "rb") as f:
        script = hashlib.sha256(f.read()).hexdigest()[:12]
    ids = dict(rank=rank, machine=args.machine_id, host=host, pid=os.getpid(), box=box)
    return dict(ids, launch=args.launch_id, launcher=args.launcher, job=job, script=script)


def is_record(found):
    types = dict(rank=int, machine=int, pid=int, host=str, box=str, job=dict, script=str, address=str)
    types.update(launch=str | None, launcher=str | None)
    ok = isinstance(found, dict) and all(isinstance(found.get(k, ...), t) for k, t in types.items())
    return ok and isinstance(found["job"].get("model", []), list)


def from_json(raw):
    with contextlib.suppress(ValueError, RecursionError):
        return json.loads(raw) if len(raw) < 1 << 24 else None  # "ready" of a million ranks: 9 MB


def bad_value(rank, key, raw):
    return f"error: rank {rank}: another program wrote {key} = {bytes(raw[:60])!r}: use another --master-port"


def flag_words(key, value=True):
    """--lr 0.5, --amp, no --amp, torch 2.5.0; given no value, the name alone."""
    name = "--" + key.replace("_", "-") if key not in ("world_size", "torch", "model", "backend") else key
    name = name.replace("_", " ")
    return name if value is True else f"no {name}" if value is False else f"{name} {value}"


def count_machines(records, args):
    """Each rank's machine (by --machine-id, a launcher's, or host), and each machine's address; warns."""
    key = "box" if args.by_host else "machine"
    index = {}
    machine_of = [index.setdefault(r[key], len(index)) for r in records]
    for m in sorted({m for m, r in zip(machine_of, records) if r["script"] != records[0]["script"]}):
        print(f"warning: machine {m} runs another {SCRIPT}: copy one script to all machines", file=sys.stderr)
    return machine_of, [records[machine_of.index(m)]["address"] for m in range(len(index))]


def with_rank0s_files(args, **decided):
    """A copy of args with the decided values and, on the other ranks, whether rank 0 set each file flag (its
    paths stay on rank 0); another machine's own file flags go unused, said once."""
    said = [{k: getattr(args, k) for k in RANK0_FLAGS}]
    dist.broadcast_object_list(said, src=0)  # over the group: the store is unauthenticated
    unused = ", ".join(flag_words(k, v) for k in RANK0_FLAGS if (v := getattr(args, k)) and v != said[0][k])
    if unused and args.machine_id != 0 and dist.get_rank() == args.first_rank:
        line = f"machine {args.machine_id}: {unused} not used here: machine 0's command names the files"
        print(f"warning: {line}", file=sys.stderr)
    files = {} if dist.get_rank() == 0 else {k: bool(v) for k, v in said[0].items()}
    return argparse.Namespace(**vars(args) | decided | files)


def claimed_twice(rank, first, second, args):
    twice = " and ".join(f"machine {r['machine']} on {r['host']} (pid {r['pid']})" for r in (first, second))
    fix = f"give each machine its own --machine-id (0 to {args.num_machines - 1}), each process its own rank"
    return f"error: rank {rank} joined twice, from {twice}: {fix}"


def check_same_data(data, rank, device, args):
    """A collective: a machine whose data differ (a copy that still parses) stops every machine."""
    rows = torch.zeros(dist.get_world_size(), 5, dtype=torch.long, device=device)  # a rank's machine, digests
    if rank == args.first_rank:  # a machine's one copy; 7 bytes of SHA-256 tell copies apart
        digests = [int.from_bytes(hashlib.sha256(t.contiguous().numpy()).digest()[:7], "big") for t in data]
        rows[rank] = torch.tensor([args.machine_id, *digests])
    dist.all_reduce(rows)  # tensors, not objects: no rank unpickles what another sends
    names = ("training images", "training labels", "test images", "test labels")
    rows = rows.tolist()
    for machine, *theirs in rows:
        if differ := ", ".join(n for n, a, b in zip(names, rows[0][1:], theirs) if b and a != b):
            line = f"error: machine {machine}'s {args.dataset} {differ} differ from machine 0's"
            abort_job(None, rank, args, f"{line}: copy machine 0's files to every --data-dir")


# ---- S4. Stopping together, and reaching every machine -----------------------------------------------------
PROBE_SIZE = 256 << 10  # a gradient bucket's: a path dropping large packets fails the check


def abort_job(store, rank, args, line, end=sys.exit):
    """Stops with line, said once per machine; with store, every process of the job stops."""
    line = printable(line)  # it may carry text from the store, which anyone may write
    if store is not None:
        with contextlib.suppress(RuntimeError):  # the store is gone: the others learn it alone
            store.set("abort", line)
    if store is not None or rank == 0:
        time.sleep(1)  # the others look every 0.5 s: they read it first
    if rank != args.first_rank:
        time.sleep(2)  # local rank 0 says the line
        end(1)
    end(line)


def printable(text):
    """text with its control characters escaped: a terminal shows them, and obeys none."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def reach_every_machine(store, rank, args):
    """Local rank 0 of each machine sends every other, at its roll call address, bytes that must come back."""
    if args.num_machines == 1 or rank != args.first_rank:
        return
    n = args.num_machines  # each probes the next machines first: not all start with machine 0
    others = [(args.machine_id + k) % n for k in range(1, n)]
    # One wait, within --timeout, for both steps: machines arriving apart meet.
    wait = waiting(rank, args, lambda: "Waiting for the other machines at the network check")

    def echo(connection):  # sends the bytes back once all are in
        with connection, contextlib.suppress(OSError):
            connection.settimeout(5)
            connection.sendall(connection.makefile("rb").read(PROBE_SIZE))

    def serve():  # a thread per connection till the listener closes: a stalled one blocks none
        while listener.fileno() != -1:
            with contextlib.suppress(OSError):
                threading.Thread(target=echo, args=(listener.accept()[0],), daemon=True).start()

    with bound_socket(0) as listener:
        listener.listen()
        listener.settimeout(1)  # accept() gives up each second: serve sees the listener closed
        threading.Thread(target=serve, daemon=True).start()
        store.set(f"probe/{args.machine_id}", f"{listener.getsockname()[1]} {socket.gethostname()}")
        try:
            for m in others:
                probe(store, rank, args, m, at_check(store, rank, args, m, "probe", wait))
            store.set(f"probed/{args.machine_id}", "1")  # this machine listens until the others have tried
            for m in others:
                at_check(store, rank, args, m, "probed", wait)
        except dist.DistError as e:  # the store went: machine 0 stopped
            abort_job(None, rank, args, f"error: rank {rank}: lost machine 0 while waiting ({last_line(e)})")


def at_check(store, rank, args, m, key, wait):
    """What machine m wrote as key at the network check; else, past --timeout, the job stops."""
    for _ in itertools.chain(wait, [None]):  # one more look: the shared wait may have ended already
        if store.check([f"{key}/{m}"]):
            return store.get(f"{key}/{m}")
    here = f"error: machine {args.machine_id} ({socket.gethostname()})"
    line = f"machine {m} did not come to the network check within --timeout {args.timeout:g} s"
    abort_job(store, rank, args, f"{here}: {line}: see its output, or raise --timeout")


def probe(store, rank, args, m, value):
    """Sends machine m PROBE_SIZE bytes, which must come back, or the job stops."""
    address = args.addresses[m]
    here = f"error: machine {args.machine_id} ({socket.gethostname()})"
    try:
        at, host = value.decode().split() if len(value) < 300 else ()
        connection = socket.create_connection((address, port_number(at)), timeout=5)
    except (ValueError, argparse.ArgumentTypeError):  # port_number raises the second
        abort_job(store, rank, args, bad_value(rank, f"probe/{m}", value))
    except OSError as e:
        line = f"{here} cannot reach machine {m} ({host}) at {address} port {at} ({e.strerror or e})"
        line += ", though it reaches the rendezvous: open all TCP ports between the machines, or set"
        line += f" {BACKEND.upper()}_SOCKET_IFNAME on each to the interface that reaches them"
        abort_job(store, rank, args, line)
    back = b""
    with connection, contextlib.suppress(OSError):  # connected: now large packets alone can fail
        connection.sendall(bytes(PROBE_SIZE))
        back = connection.makefile("rb").read(PROBE_SIZE)
    if len(back) != PROBE_SIZE:
        lost = f"{here}: {PROBE_SIZE >> 10} KiB sent to machine {m} ({host}) at {address} did not come back"
        lost += f": machine {m} is stopped or overloaded, or the path drops large packets: check its MTU"
        abort_job(store, rank, args, f"{lost} (ping -M do -s 1472 {address}; -s 8972 for 9000-byte frames)")


# ---- S5. --check, the link timed, and local SGD for slow links -------------------------------------------
LOCAL_SGD_PERIOD = 64  # --compress local-sgd: steps each copy takes alone between averages


def try_the_group(world_size, device, data, args):
    """Compares the data, runs --check, times the link for --compress; returns args with rank 0's files and
    the --compress taken (every rank decides it alike, from the same figures)."""
    if data is not None:  # else a machine with other files trains on them
        check_same_data(data, dist.get_rank(), device, args)
    if args.check or args.num_machines > 1:
        compute, network, size = time_a_step(world_size, device, args)
    if args.check:
        machines = plural(args.num_machines, "machine")
        print0(f"Check passed: {plural(world_size, 'process')} on {machines} reached each other")
    best = "none"
    if args.num_machines > 1:
        # DDP sends fc1's gradients during the backward of the rest, about half a step.
        waits = {"none": max(0.0, network - compute / 2), "local-sgd": network / LOCAL_SGD_PERIOD}
        share = {c: wait / (compute + wait) for c, wait in waits.items()}
        best = "local-sgd" if share["none"] > 1 / 4 else "none"
        line = f"Network: averaging the gradients ({size / 1e6:.1f} MB) took ~{network:.0f} ms"
        line += f" (~{8e-3 * size / network:.0f} Mbit/s), a step's computing ~{compute:.0f} ms: waiting would"
        line += f" take ~{share['none']:.0%} of each step"
        line += f", ~{share[best]:.0%} with --compress {best}" if best != "none" else ""
        if args.check or args.compress == "auto" or args.compress == "none" != best:
            print0(line + (f" (--compress auto: {best})" if args.compress == "auto" else ""))
    return with_rank0s_files(args, compress=best if args.compress == "auto" else args.compress)


def time_a_step(world_size, device, args):
    """A step's computing and an average of ones of the gradients' size, in ms; that average's bytes."""
    model = ConvNet().to(device, memory_format=torch.channels_last)
    grads = torch.ones(sum(p.numel() for p in model.parameters()), device=device)
    images, seconds = torch.randn(args.batch_size, 1, 28, 28, device=device), []
    for _ in range(3):  # .item() waits for a GPU
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = model(images).sum()
        loss.backward()
        loss.item()
        computed = time.perf_counter()
        dist.all_reduce(grads.fill_(1))
        grads[0].item()
        seconds.append([computed - start, time.perf_counter() - computed])
    if not grads.eq(world_size).all():
        sys.exit(f"error: the check summed {grads.min():g} over {world_size} processes: {BACKEND} lost some")
    # The fastest of 3 (the first sets up). One MAX over the ranks: the slowest computing, and (negated) the
    # shortest average, the one the last rank to arrive saw.
    fastest = torch.tensor(seconds, device=device).min(dim=0).values * torch.tensor([1, -1], device=device)
    dist.all_reduce(fastest, op=dist.ReduceOp.MAX)
    return 1000 * fastest[0].item(), -1000 * fastest[1].item(), 4 * grads.numel()


def local_sgd(ddp, args, clock=None):
    """--compress local-sgd: torch's hook that leaves each copy its gradients, and its state (else None); the
    copies averaged (docs/compat.md) every LOCAL_SGD_PERIOD steps and before each evaluation: the test set and
    the checkpoint see the job's model, not rank 0's copy."""
    if args.compress != "local-sgd":
        return None
    params, steps = list(ddp.parameters()), itertools.count()
    apart = [False]  # stepped alone since the last average

    def average():
        start = time.perf_counter()
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        dist.all_reduce(flat.div_(dist.get_world_size()))
        for p, mean in zip(params, flat.split([p.numel() for p in params])):
            p.detach().copy_(mean.view_as(p))
        apart[0] = False
        if clock:
            clock.waited += time.perf_counter() - start

    def before_a_step(module, inputs):
        if (step := next(steps)) and step % LOCAL_SGD_PERIOD == 0:
            average()
        apart[0] = True

    def before_an_evaluation(module, inputs):  # every rank evaluates a batch at least
        if apart[0] and not module.training:
            average()

    ddp.register_forward_pre_hook(before_a_step)
    ddp.module.register_forward_pre_hook(before_an_evaluation)
    state = post_localSGD_hook.PostLocalSGDState(None, None, 0, post_local_gradient_allreduce=False)
    return state, post_localSGD_hook.post_localSGD_hook


# ---- S6. Files: whole or not at all ------------------------------------------------------------------------
def resume(model, optimizer, args):
    """Rank 0 reads --checkpoint (maybe on machine 0 alone), and sends it or why not to all."""
    state = on_rank0(args, read_checkpoint, args, model, optimizer)  # loads it into rank 0's model
    if state and dist.get_rank() != 0:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    optimizer.param_groups[0]["lr"] = args.lr  # --lr wins, as every flag of a resumed run does
    return state["epoch"] + 1 if state else 0


def prepare_data(args):
    """Unpack .gz files placed by hand, else download; each file renamed into place whole."""
    folder = raw_folder(args)
    paths = [os.path.join(folder, name) for name in FILES]
    for path in [p for p in paths if not os.path.isfile(p) and os.path.isfile(p + ".gz")]:
        try:  # a stop goes on up
            with gzip.open(path + ".gz") as src:
                error = write_atomically(path, lambda f: shutil.copyfileobj(src, f))
        except Exception as e:
            error = f"error: cannot unpack {path}.gz ({type(e).__name__}: {e}): replace it"
        if error:
            sys.exit(error)
    if all(map(os.path.isfile, paths)):
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:  # another user's folder, a read-only disk
        sys.exit(f"error: cannot make {folder}/ ({e.strerror}): give a --data-dir this user may write to")
    socket.setdefaulttimeout(30)  # a lossy network fails in seconds, not minutes
    try:
        from torchvision import datasets  # only to download: a second to import

        with tempfile.TemporaryDirectory(prefix=".download-", dir=args.data_dir) as private:
            getattr(datasets, DATASETS[args.dataset][0])(private, download=True)
            for path in paths:  # atomic within one file system, NFS included
                os.replace(os.path.join(private, os.path.relpath(path, args.data_dir)), path)
    except Exception as e:
        reason = (str(e).strip() or type(e).__name__).splitlines()[-1]
        names = ", ".join(map(os.path.basename, paths)) + " (gzipped or not)"
        sys.exit(f"error: {args.dataset} is not in {folder}/, download failed ({reason}): put {names} there")
    finally:
        socket.setdefaulttimeout(None)


def read_checkpoint(args, model, optimizer):
    """Loads --checkpoint, if any, into model and optimizer: its state, None, or why not (a line)."""
    path = args.checkpoint
    if not os.path.exists(path):
        print(f"No checkpoint at {path} yet: starting from epoch 0", flush=True)
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        return f"error: --resume: cannot read {path} ({type(e).__name__}): truncated or not a checkpoint"
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        return f"error: --resume: {path} is not a checkpoint of these scripts"
    if state["dataset"] != args.dataset:
        return f"error: --resume: {path} was trained on {state['dataset']}, not --dataset {args.dataset}"
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        return f"error: --resume: {path} does not fit this model ({' '.join(str(e).split())})"
    done, lr = state["epoch"], optimizer.param_groups[0]["lr"]
    print(f"Resuming from {path}: epoch {done} done, starting epoch {done + 1}", flush=True)
    if lr != args.lr:
        print(f"Learning rate {args.lr:g} from --lr (the checkpoint had {lr:g})", flush=True)
    return state


def on_rank0(args, work, *inputs):
    """work(*inputs) on rank 0 alone, its result sent to all; a str (an error line) stops them all."""
    sent = [work(*inputs) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    if isinstance(sent[0], str):
        abort_job(None, dist.get_rank(), args, sent[0])
    return sent[0]


def write_atomically(path, write):
    """Write path whole or not at all, keeping its mode; returns None or why not."""
    buffer, temporary = io.BytesIO(), f"{path}.{os.urandom(8).hex()}.tmp"  # not the PID: pods share disks
    write(buffer)  # a full disk fails below, as an OSError
    try:
        with open(temporary, "xb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            shutil.copymode(path, temporary)
        os.replace(temporary, path)
    except OSError as e:
        return f"error: cannot write {path} ({e.strerror or e}); old file kept: free space or write elsewhere"
    finally:
        with contextlib.suppress(FileNotFoundError):  # gone where renamed
            os.unlink(temporary)


def file_version(path):
    """None if absent; a rename puts a new inode in place."""
    with contextlib.suppress(OSError, TypeError):
        return (found := os.stat(path)).st_ino, found.st_mtime_ns, found.st_size


def stop_line(stop, path, before, stopped=""):
    """A stop's (130, 143) line: the signal, what stopped, what --checkpoint (path) holds against before."""
    line = ("Terminated (SIGTERM)" if stop.code == 143 else "Interrupted") + stopped
    if (now := file_version(path)) is None:
        return line + (f"; no epoch completed, so nothing was saved to {path}" if path else "")
    if now == before:
        return f"{line}; no epoch completed since this launch: {path} is as it was before"
    return f"{line}; {path} holds the last complete epoch"


# ---- S7. Processes, signals and exit -----------------------------------------------------------------------
GROUPS_KEPT = []  # groups never freed: freeing one can deadlock (docs/compat.md)


def run_workers(args, data, nprocs, listener):
    """mp.spawn, with stops blocked as the workers start (fork's bookkeeping lost one) to raise_on_signals."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # the worker's line says why
    ctrl_c = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    if START_METHOD == "spawn" and os.name == "posix":
        resource_tracker.ensure_running()  # spawn would start it, unblocking the signals
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
    try:
        inputs = (args, data, listener, ctrl_c)
        context = mp.start_processes(spawned_worker, inputs, nprocs, join=False, start_method=START_METHOD)
        raise_on_signals(ctrl_c)
        while not context.join():  # one failing, join stops the others
            pass
    except mp.ProcessExitedException as e:
        how = f"was killed by {e.signal_name}" if e.signal_name else f"exited with status {e.exit_code}"
        rank, pid = args.first_rank + e.error_index, getattr(e, "error_pid", None) or e.pid
        line = f"error: rank {rank} (pid {pid}) {how}: the other processes of this machine were stopped"
        status = {1: 1, 130: 130, 143: 143, -signal.SIGTERM: 143}  # 1: it said why; a stop: exit_on_signal
        sys.exit(status.get(e.exit_code, line))
    finally:  # any still running (a stop, a failed start): SIGTERM, then SIGKILL
        workers, deadline = mp.active_children(), time.monotonic() + 10
        for process in workers:
            process.terminate()
        for process in workers:
            process.join(max(0.0, deadline - time.monotonic()))
            process.kill()
            process.join()
        if listener is not None:  # held till now, so users see this launch hold the port
            listener.close()


def spawned_worker(local_rank, args, data, listener, ctrl_c):
    def exit_with_launcher():  # not PR_SET_PDEATHSIG: Linux's alone, and lost under nohup
        launcher = mp.parent_process()  # gone: an orphan's parent id changes; on Windows, its handle ends
        while os.getppid() == launcher.pid and launcher.is_alive():
            time.sleep(0.5)
        _thread.interrupt_main(signal.SIGTERM)  # raises SystemExit(143), as SIGTERM does
        time.sleep(10)
        os._exit(143)  # still here: stuck in a call that never returns to Python

    threading.Thread(target=exit_with_launcher, daemon=True).start()
    try:
        raise_on_signals(ctrl_c)
        worker(local_rank, args, data, listener)
    except BaseException as e:  # not spawn's handler, which tears the group down after a bug
        exit_at_once(e)
    exit_at_once()


@contextlib.contextmanager
def exit_on_signal(args):
    """Ctrl-C or SIGTERM runs every clean-up, then exits 130 or 143 with one line a machine."""
    path = args.checkpoint if args.first_rank == 0 else None  # rank 0's machine says what it holds
    before = file_version(path)
    raise_on_signals(ctrl_c=signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
    try:
        yield
    except SystemExit as e:
        if e.code in (130, 143) and args.local_rank == 0:  # a stop: one line a machine
            print(stop_line(e, path, before, ": every process of this launch stopped"), file=sys.stderr)
        raise


def raise_on_signals(ctrl_c):
    """Ctrl-C and SIGTERM raise SystemExit(128 + signal), as shells count; ctrl_c False: Ctrl-C ignored."""

    def stop(signum, frame):
        if not isinstance(sys.exc_info()[1], (SystemExit, KeyboardInterrupt)):  # not cutting an exit short
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop if ctrl_c else signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # one blocked as the workers started is raised now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


def exit_if_contact_lost(error, rank, args):
    if isinstance(error, dist.DistError) or BACKEND.lower() in str(error).lower():
        time.sleep(2 * (rank != args.first_rank))  # local rank 0's line first; the launcher stops us
        line = f"error: rank {rank} lost contact with the job ({last_line(error)}): another process stopped"
        sys.exit(f"{line}, or did not answer within --timeout {args.timeout:g} s")


def exit_at_once(end=0):
    """sys.exit(end), end also what ended the run, without the teardown: slow, and a kept group can abort."""
    with contextlib.suppress(ValueError):  # not the main thread
        for signum in (signal.SIGINT, signal.SIGTERM):  # a stop must not cut the exit short
            signal.signal(signum, signal.SIG_IGN)
    if isinstance(end, SystemExit):  # a stop's too (130 or 143)
        end = end.code
    elif isinstance(end, KeyboardInterrupt):  # a Ctrl-C before raise_on_signals is a stop too
        end = 130
    elif isinstance(end, BaseException):  # a bug: its traceback, and 1
        end = "".join(traceback.format_exception(end)).rstrip()
    if end is not None and not isinstance(end, int):
        sys.stderr.write(f"{end}\n")  # one write: print's two let another process's line in
        end = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":  # os._exit drops C's stdio buffers: flush them
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).fflush(None)
    os._exit(end or 0)


# ---- S8. Memory, speed-ups and the run's figures -----------------------------------------------------------
def keep_freed_memory():
    """glibc's mallopt(3): keep freed blocks for reuse, not hand each back to be refaulted every step."""
    with contextlib.suppress(OSError):  # not glibc
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 32 MiB blocks from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB


def keep_pool_gradient_channels_last(model):
    """Hand max-pool's backward a channels-last gradient, not flatten's NCHW (two conversions)."""

    def on_pooled(module, inputs):  # dropout1's input: the pool's output
        if inputs[0].requires_grad and inputs[0].is_contiguous(memory_format=torch.channels_last):
            inputs[0].register_hook(lambda grad: grad.contiguous(memory_format=torch.channels_last))

    model.dropout1.register_forward_pre_hook(on_pooled)


def layout_line(world_size, args, allreduce):
    """Rank 0's first line: nobody trains alone or on another layout unawares."""
    sizes = args.machine_sizes  # as the roll call counted them
    each = f"({' + '.join(map(str, sizes))} processes)"
    each = f"x {plural(sizes[0], 'process')}" if len(set(sizes)) == 1 else each
    threads = f", from {args.threads_from}" if args.threads_from else ""
    note = f" ({args.launch_note})" if args.launch_note else ""
    line = f"World size {world_size} = {plural(len(sizes), 'machine')} {each}; "
    line += f"global batch {args.batch_size * world_size} = {world_size} x {args.batch_size}; "
    line += f"{plural(torch.get_num_threads(), 'thread')} per process{threads}; "
    return line + f"{averaging_words(allreduce, args)}{note}"


def report(args, device, history, seconds, samples, test, **averaging):
    """The last lines and --metrics-json; a collective (every rank's peak memory)."""
    world_size = dist.get_world_size()
    peaks = torch.zeros(world_size, dtype=torch.float64, device=device)
    peaks[dist.get_rank()] = peak_memory_mib() or 0  # 0: none measured (Windows)
    dist.all_reduce(peaks)  # a tensor, not objects: no rank unpickles what another sends
    speed = len(history) * samples / seconds if seconds else None
    total = time.time() - LAUNCH_TIME
    print0(f"Train loop {seconds:.2f} s ({speed or 0:.0f} samples/s); launch to end {total:.2f} s")
    figures = dict(script=SCRIPT, dataset=args.dataset, device=str(device), world_size=world_size)
    figures.update(epochs=args.epochs, epochs_trained=len(history), batch_size=args.batch_size)
    figures.update(global_batch_size=args.batch_size * world_size, threads=torch.get_num_threads())
    figures.update(amp=args.amp, **averaging, train_seconds=seconds, total_seconds=total)
    figures.update(samples_per_second=speed, final_train_loss=history[-1]["train_loss"] if history else None)
    figures.update(test_loss=test[0], test_accuracy=test[1], test_samples=test[2])
    figures.update(peak_rss_mib_per_rank=[p or None for p in peaks.tolist()], history=history)
    if args.metrics_json:
        text = json.dumps(figures, indent=2) + "\n"
        write_on_rank0(args, args.metrics_json, lambda f: f.write(text.encode()))
    print0(f"Finished training in {seconds:.2f} secs")


def write_on_rank0(args, path, write):
    on_rank0(args, write_atomically, path, write)


def peak_memory_mib():
    with contextlib.suppress(ImportError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1 << 20 if sys.platform == "darwin" else 1 << 10)  # bytes on macOS, else KiB


# ---- S9. Command-line values and words ---------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line naming the flag, not a usage block first."""
        for action in self._actions:  # a flag of two spellings is named by its first: --batch-size
            message = message.replace("/".join(action.option_strings), action.option_strings[0])
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text):
    return positive_float(text, int)


def positive_float(text, kind=float):
    if not (value := kind(text)) > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def port_number(text):
    if not 1 <= (value := int(text)) <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1-65535, got {value}")
    return value


def check_args(parser, args, processes=1, files=True, torchrun_omp=False):
    """Checks argparse cannot make; --threads: OMP_NUM_THREADS (not torchrun's), else cores per process."""
    if files and args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint PATH")
    for flag, path in ("--checkpoint", args.checkpoint), ("--metrics-json", args.metrics_json):
        folder = os.path.dirname(os.path.abspath(path or "."))
        if files and path and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            parser.error(f"{flag}: cannot write to folder {folder}")
    if os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):
        parser.error(f"--data-dir: {args.data_dir} is not a folder")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    slurm = getenv("SLURM_CPUS_PER_TASK", "")
    slurm = int(slurm) if slurm.isdigit() and int(slurm) > 0 else cores
    caps = [(cores, ""), (cgroup_cpus() or cores, "the cgroup's CPU quota"), (slurm, "SLURM_CPUS_PER_TASK")]
    cores, capped_by = min(caps, key=lambda cap: cap[0])  # of equals the first: named where it decided
    omp = getenv("OMP_NUM_THREADS", "")
    if omp and torchrun_omp:  # no choice of the user's
        omp, capped_by = "", f"{capped_by or 'the usable cores'}, not torchrun's default OMP_NUM_THREADS=1"
    args.threads_from = "" if args.threads or omp else capped_by  # said in the layout line
    try:  # OpenMP's 4,2 (threads per nesting level): the outer 4
        args.threads = args.threads or positive_int(omp.split(",")[0] or max(1, cores // processes))
    except (ValueError, argparse.ArgumentTypeError):
        parser.error(f"OMP_NUM_THREADS={omp!r} in the environment is not a count: fix it, or pass --threads")
    return args


def cgroup_cpus():
    """Cores a CPU quota (docker --cpus, a Kubernetes limit) gives, rounded up: the tightest up the tree."""
    quotas = []
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:  # none: not Linux
        for _, controllers, path in (line.rstrip("\n").split(":", 2) for line in f):  # v2 names no controller
            v1 = "cpu" in controllers.split(",")
            if controllers and not v1:  # another v1 controller's line
                continue
            names = ["cpu.cfs_quota_us", "cpu.cfs_period_us"] if v1 else ["cpu.max"]
            for up in range(path.count("/") + 1):  # its cgroup, and those above
                folder = ("/sys/fs/cgroup/cpu" if v1 else "/sys/fs/cgroup") + path.rsplit("/", up)[0]
                text = ""
                with contextlib.suppress(OSError, ValueError):  # v2's "max" is no quota
                    for name in names:
                        with open(f"{folder}/{name}") as file:
                            text += file.read() + " "
                    quota, period = map(int, text.split())
                    quotas.append(-(-quota // period))
    return min((q for q in quotas if q > 0), default=None)  # v1's -1 is no quota


def getenv(name, default=None):
    """os.environ.get, but `VAR=` (empty) counts as unset."""
    return os.environ.get(name) or default


def plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}es" if word.endswith("s") else f"{n} {word}s"


def last_line(error):
    """A distributed error's gist: its last non-empty line, without the C++ source location."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    gist = re.sub(r"\[[^\]\s]*:\d+\] ?", "", lines[-1])  # [/path/to/file.cpp:311]: where in C++ it was raised
    return re.sub(r"^\[[^\]]*\] ", "", gist).split(". ")[0].rstrip(".")


# ============================================================================================================
# End of the shared block.
# ============================================================================================================


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # a failure's line, a stop's status, a bug's traceback
        exit_at_once(e)
    exit_at_once()
