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
"""

import _thread
import argparse
import contextlib
import ctypes
import gzip
import hashlib
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

# torchvision (and with it torch._dynamo) before any process group exists: see docs/compat.md.
from torchvision import datasets

# ---- 1. Constants
CHECKPOINT_FORMAT = "convnet-mnist-checkpoint-v1"
BACKEND = "NCCL"  # as failure lines name it
TEST_BATCH_SIZE = 1000  # large: a GPU does it in about the time of a small one
START_METHOD = "spawn"  # CUDA cannot run in a forked child of a process that has used it
# --dataset: its class, and the mean and std of its training pixels in [0, 1]
DATASETS = {
    "mnist": (datasets.MNIST, 0.1302, 0.3069),
    "fashion-mnist": (datasets.FashionMNIST, 0.2860, 0.3530),
}


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
def load_data(args):
    """Both splits: uint8 images [N, 28, 28], int64 labels [N]."""
    try:
        train, test = (DATASETS[args.dataset][0](args.data_dir, train=t) for t in (True, False))
    except Exception as e:
        where = f"{args.dataset} from {raw_folder(args)}/"
        sys.exit(f"error: cannot read {where} ({type(e).__name__}: {e}); a file there is damaged: replace it")
    return train.data, train.targets, test.data, test.targets


def to_input(images, dataset):
    """uint8 [B, 28, 28] to float [B, 1, 28, 28], as ToTensor() then Normalize() give."""
    _, mean, std = DATASETS[dataset]
    return images.unsqueeze(1).float().div_(255).sub_(mean).div_(std)


def epoch_batches(sampler, epoch, batch_size, device):
    """This rank's batches, as index tensors: a DataLoader's with this sampler, minus per-image work."""
    sampler.set_epoch(epoch)  # else every epoch repeats the first one's order
    return torch.tensor(list(sampler), device=device).split(batch_size)  # one copy to the GPU per epoch


# ---- 4. Train and evaluate
def train(model, optimizer, data, rank, world_size, args):
    """Each epoch: train on this rank's shard, evaluate, checkpoint; then report."""
    device = next(model.parameters()).device
    train_images, train_labels, test_images, test_labels = (t.to(device) for t in data)
    match_gradient_strides(model)
    # DDP broadcasts rank 0's weights: all copies start equal. device_ids: this process's GPU (None on a
    # CPU, where the tests run).
    ddp_model = DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device.index])
    if hook := local_sgd(ddp_model, args):  # else DDP's own average
        ddp_model.register_comm_hook(*hook)
    start_epoch = resume(model, optimizer, args) if args.resume else 0
    print0(layout_line(world_size, args, "gloo" if device.type == "cpu" else "nccl"))
    sampler = DistributedSampler(train_labels, num_replicas=world_size, rank=rank, seed=args.seed)
    seconds, history = 0.0, []
    for epoch in range(start_epoch, args.epochs):
        # Each rank its own dropout masks; a resumed run an unbroken run's.
        torch.manual_seed(args.seed + epoch * world_size + rank)
        batches = epoch_batches(sampler, epoch, args.batch_size, device)
        # Ranks in step here: DDP's set-up and each evaluation synchronise them.
        start = time.perf_counter()
        train_loss = train_epoch(ddp_model, optimizer, train_images, train_labels, batches, epoch, args)
        seconds += time.perf_counter() - start
        dist.all_reduce(train_loss)  # the sum of the ranks' mean losses
        test_loss, accuracy, n_test = evaluate(model, test_images, test_labels, rank, world_size, args)
        release_freed_memory()
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
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


# ---- 5. Process group and DDP
# Every process runs worker(): it joins the group and trains its own copy of the model on its shard;
# DistributedDataParallel averages the gradients in backward(), so every copy takes the same step.
def join_group(rank, world_size, args, listener=None):
    """Join the process group over NCCL: every process of every machine meets at machine 0."""
    # Rank 0 (under torchrun, its agent) serves a key-value store at --master-addr:--master-port; every
    # process connects, as init_method="env://" would.
    is_master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    timeout = timedelta(seconds=args.timeout)  # how long to wait for the others, in collectives too
    with rendezvous(rank, is_master, args, listener) as options:  # waits for machine 0
        store = dist.TCPStore(args.master_addr, args.master_port, world_size, is_master, **options)
    if args.launcher == "torchrun":  # its store outlives a restart: each attempt's keys apart
        store = dist.PrefixStore(torchrun_attempt(), store)
    # One job, one decision: every process checks in, or all stop.
    job = job_record(args, **roll_call(store, rank, world_size, args))
    prepare_nccl(store, rank, world_size, job)  # two processes on one GPU: NCCL would fail obscurely
    # With device_id, NCCL connects inside init_process_group, not at DDP's first step.
    gpu = torch.device("cuda", torch.cuda.current_device())
    with exit_on_abort(store, rank, job):  # a failure: one line on every machine, not NCCL's C++ log
        reach_every_machine(store, rank, job)  # a firewall may let only the rendezvous port through
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=gpu
        )
    return job_record(job, **rank0_files(job))  # every rank follows rank 0's files


def worker(local_rank, args, data, listener=None):
    rank, world_size, _ = placement(args, local_rank)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    device = select_device(local_rank)
    job = join_group(rank, world_size, args, listener)  # args and the roll call's layout
    try:
        job = try_the_group(world_size, device, job)  # across machines: the link timed, --compress auto taken
        if job.check:
            return
        if data is None:  # local rank 0 fetches the files, the others wait
            if local_rank == 0:
                prepare_data(job)
            dist.barrier()
            data = load_data(job)
        check_same_data(data, rank, job)  # else a machine with other files trains on them
        torch.manual_seed(job.seed)  # the baseline script's initial weights
        model = ConvNet().to(device, memory_format=torch.channels_last)  # cuDNN's tensor cores' layout
        keep_pool_gradient_channels_last(model)
        optimizer = optim.Adadelta(model.parameters(), lr=job.lr)
        train(model, optimizer, data, rank, world_size, job)
    except RuntimeError as e:
        exit_if_contact_lost(e, rank, job)  # a lost peer: one line, not a traceback
        raise
    finally:
        GROUPS_KEPT.append(dist.group.WORLD)  # never freed: its destructor can deadlock (docs/compat.md)
        dist.destroy_process_group()


# ---- 6. Checkpoint
def save_checkpoint(model, optimizer, epoch, args):
    state = dict(format=CHECKPOINT_FORMAT, epoch=epoch, dataset=args.dataset, args=vars(args))
    state.update(model=model.state_dict(), optimizer=optimizer.state_dict())
    on_rank0(write_atomically, args.checkpoint, lambda f: torch.save(state, f))


# ---- 7. Launch and command line
def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU is visible: this script needs one; on CPUs run convnet_distributed.py")
    if args.rank is None and args.num_gpu_processes > torch.cuda.device_count():  # else prepare_nccl checks
        sys.exit(
            f"error: --num-gpu-processes {args.num_gpu_processes}: "
            f"only {torch.cuda.device_count()} GPU(s) visible"
        )
    with exit_on_signal(args):  # Ctrl-C or SIGTERM stops all this launch's processes, in one line
        if args.rank is not None:  # a launcher started this process as one rank
            return worker(args.local_rank, args, None)
        # Hold rank 0's rendezvous port; a one-machine job given none takes a free one: jobs never meet.
        listener, port = claim_port(args)
        job = job_record(args, master_port=port)
        if not args.check:  # once per machine: workers fetching into one folder would race
            prepare_data(args)
        # Each spawned worker loads its own data (as fast as a copy: bench/README.md).
        if args.num_gpu_processes == 1:
            worker(0, job, None, listener)
        else:  # mp.spawn(worker, args=(args, None, listener), nprocs=N), with the signals held
            run_workers(job, None, args.num_gpu_processes, listener)


# ============================================================================================================
# Machinery: what makes the story above fail clearly and run fast; a first reading may skip it.
# M1-M2: this script's own rooms. S1-S9: the shared block, the same code as in convnet_distributed.py.
# ============================================================================================================


# ---- M1. This script's layout: flags, else the launcher's, else every GPU ----------------------------------


def build_parser():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def add(flag, help, **options):  # --batch-size takes the article's --batch_size too
        if options.get("type") in (int, positive_int):  # --help shows N, not the flag's name
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
    add("--compress", "local-sgd: average the model every 64 steps; auto: for slow links (default: none)",
        choices=["none", "local-sgd", "auto"], default="none")  # fmt: skip
    add("--timeout", "seconds to wait for peers (default: 300)", type=positive_float, default=300)
    add("--check", "make the group, average once, exit (default: off)", action="store_true")
    return p


def processes_flag():
    return "num_gpu_processes", max(1, torch.cuda.device_count())  # the flag, and its default


def placement(args, local_rank):
    """(rank, world size, processes on this machine)."""
    rank = args.machine_id * args.num_gpu_processes + local_rank if args.rank is None else args.rank
    return rank, args.world_size, args.num_gpu_processes


# ---- M2. GPUs and NCCL -------------------------------------------------------------------------------------


def select_device(local_rank):
    """Made current: NCCL binds the rank to it."""
    local_rank %= torch.cuda.device_count()  # srun --gpus-per-task=1 shows a task its one GPU as cuda:0
    torch.cuda.set_device(local_rank)
    torch.set_float32_matmul_precision("high")  # TF32, as cuDNN's convolutions
    return torch.device("cuda", local_rank)


def prepare_nccl(store, rank, world_size, args):
    """NCCL's bootstrap, unauthenticated, on loopback for a job on one machine; two ranks on one GPU: one
    line, not NCCL's "Duplicate GPU detected" (the UUID tells apart GPUs each process sees as cuda:0)."""
    if world_size == placement(args, 0)[2] and not getenv("NCCL_SOCKET_IFNAME"):
        os.environ["NCCL_SOCKET_IFNAME"] = "=lo"  # "=": lo exactly, not every name starting with it
    index = torch.cuda.current_device()
    gpu = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    host, mine = socket.gethostname(), str(rank).encode()
    if gpu and (first := store.compare_set(key := f"gpu/{host} {gpu}", "", mine)) != mine:
        if not first.isdigit():  # the store is unauthenticated
            abort_job(store, rank, args, bad_value(rank, key, first, args))
        low, high = sorted((int(first), rank))
        cause = f"error: ranks {low} and {high} share one GPU (cuda:{index} on {host})"
        fix = "give each its own (a launcher's local rank, or CUDA_VISIBLE_DEVICES)"
        abort_job(store, rank, args, f"{cause}: {fix}")


def averaging_words(allreduce, args):  # over Gloo where tests run on CPUs
    how = "by NCCL" if allreduce == "nccl" else "over Gloo"
    if args.compress == "local-sgd":
        return f"copies averaged {how} every {LOCAL_SGD_PERIOD} steps (local SGD)"
    return f"gradients averaged {how}"


def match_gradient_strides(model):
    """cuDNN gives conv1's weight gradient another stride on its size-1 dimension: DDP would warn ("Grad
    strides do not match") and copy it."""

    def restated(grad, p):  # only size-1 dimensions' strides differ: each element keeps its offset
        same = all(a == b for a, b, n in zip(grad.stride(), p.stride(), p.shape) if n > 1)
        return grad.as_strided(p.shape, p.stride()) if same else grad

    for p in model.parameters():
        if 1 in p.shape:
            p.register_hook(lambda grad, p=p: restated(grad, p))


# ============================================================================================================
# Shared block: the same bytes in convnet_distributed.py, where it is edited, and convnet_distributed_cuda.py,
# where `python tools/sync_shared_block.py` copies it (CI checks). It needs from its script: ConvNet,
# DATASETS, BACKEND, CHECKPOINT_FORMAT, START_METHOD, LAUNCH_TIME, build_parser, processes_flag, placement,
# averaging_words and worker.
# ============================================================================================================


# ---- S1. Launchers: who started this process, and the layout it says ---------------------------------------


# The first launcher whose rank, world size and local rank are set wins (torchrun, mpirun pass SLURM's on).
# Its variables of rank, world size, local rank, local size, machine, machines (-: none); of the launch.
LAUNCHERS = {
    "torchrun": ("RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK -", "TORCHELASTIC_RUN_ID"),
    "Open MPI": ("OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_RANK "
                 "OMPI_COMM_WORLD_LOCAL_SIZE - -", "PMIX_NAMESPACE"),
    "MPICH": ("PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS - -", ""),  # and Intel MPI: Hydra
    "MVAPICH": ("MV2_COMM_WORLD_RANK MV2_COMM_WORLD_SIZE MV2_COMM_WORLD_LOCAL_RANK "
                "MV2_COMM_WORLD_LOCAL_SIZE - -", ""),
    "SLURM": ("SLURM_PROCID SLURM_STEP_NUM_TASKS SLURM_LOCALID SLURM_STEP_TASKS_PER_NODE SLURM_NODEID "
              "SLURM_STEP_NUM_NODES", "SLURM_JOB_ID SLURM_STEP_ID"),  # srun's tasks alone have SLURM_STEP_*
    # Kubeflow's PyTorchJob and hand-written env:// jobs: each launch is one process, a machine of its own.
    "RANK and WORLD_SIZE": ("RANK WORLD_SIZE - - RANK WORLD_SIZE", ""),
}  # fmt: skip


def parse_args(argv=None):
    """The flags, else the launcher's layout (LAUNCHERS), else defaults; then what argparse cannot check."""
    parser = build_parser()
    args = parser.parse_args(argv)
    found = (n for n, (v, _) in LAUNCHERS.items() if all(x == "-" or getenv(x) for x in v.split()[:3]))
    name = next(found, None)
    names, launch = (words.split() for words in LAUNCHERS.get(name, ("- - - - - -", "")))

    def number(variable, default, index=0):
        text = getenv(variable)
        try:
            if text is None or text.isdigit():
                return default if text is None else int(text)
            parts = (part.rstrip(")").partition("(x") for part in text.split(","))  # SLURM's 2(x3),1: 2 2 2 1
            return [int(n) for n, _, times in parts for _ in range(int(times or 1))][index]  # this node's
        except (ValueError, IndexError):
            parser.error(f"{name} set {variable}={text!r}, which is not a whole number")

    rank, world_size, local_rank = (number(v, d) for v, d in zip(names, (0, 1, 0)))
    machine = number(names[4], None)
    local_size = number(names[3], 1, index=machine or 0)
    machine = rank // local_size if machine is None else machine
    machines = number(names[5], -(-world_size // local_size))
    own = name == "SLURM" and world_size == machines  # one task per node: this script starts the processes
    mpi = name is not None and names[4] == "-"  # no machine index: the roll call tells machines by host
    addr, port = getenv("MASTER_ADDR", "").strip("[]") or None, getenv("MASTER_PORT")
    args.master_addr = args.master_addr and args.master_addr.strip("[]")  # IPv6 as in URLs: [fd00::1]
    said = {"master_addr": addr, "master_port": port} if names[0] == "RANK" else {}  # env://'s store is there
    if name == "SLURM":  # a step's first node, and a port of its own: steps share nodes
        # Of its compressed host list, rack[07-08]-n[1-2],gpu1, the first host (no scontrol): rack07-n1
        nodes = getenv("SLURM_STEP_NODELIST") or getenv("SLURM_JOB_NODELIST", "localhost")
        first = re.match(r"[^,\[]*(\[[^\]]*\][^,\[]*)*", nodes).group()
        addr = addr or re.sub(r"\[([^,\]-]*)[^\]]*\]", r"\1", first)  # each bracket's first number
        port = port or 15000 + (number("SLURM_JOB_ID", 0) * 97 + number("SLURM_STEP_ID", 0)) % 17000
    if mpi and machines > 1 and not (args.master_addr or addr):
        fix = "give machine 0's address as --master-addr or MASTER_ADDR (mpirun -x MASTER_ADDR=node0)"
        parser.error(f"{name} runs this job on {machines} machines: {fix}")
    processes, default = processes_flag()
    if name:
        said.update({"num_machines": machines, "machine_id": machine, processes: None if own else local_size})
    port = port or (0 if name is None and (args.num_machines or 1) == 1 else 8892)  # 0: free (claim_port)
    defaults = {processes: default, "num_machines": 1, "machine_id": 0, "master_addr": addr or "127.0.0.1"}
    for key, default in {**defaults, "master_port": port}.items():
        given = getattr(args, key)
        if None not in (given, said.get(key)) and str(given) != str(said[key]):
            fix = "unset RANK and WORLD_SIZE" if name == "RANK and WORLD_SIZE" else f"give {name} the same"
            flag = f"--{key.replace('_', '-')} {given}"
            parser.error(f"{flag} disagrees with {name}, which set {said[key]}: drop the flag, or {fix}")
        setattr(args, key, next(v for v in (given, said.get(key), default) if v is not None))
    if not 0 <= args.machine_id < args.num_machines:
        parser.error(f"--machine-id must be in 0-{args.num_machines - 1} for {args.num_machines} machines")
    try:  # MASTER_PORT, unchecked so far
        args.master_port = port_number(str(args.master_port)) if args.master_port else 0
    except (ValueError, argparse.ArgumentTypeError):
        parser.error(f"MASTER_PORT={args.master_port!r} is no port (1-65535): fix it, or pass --master-port")
    launched = name is not None and not own  # this process is one rank of the launcher's
    args.rank, args.local_rank = (rank, local_rank) if launched else (None, 0)
    here = getattr(args, processes)
    args.world_size = world_size if launched else args.num_machines * here
    args.machine_sizes = [here] * args.num_machines  # a launcher's: the roll call counts them
    restart = getenv("TORCHELASTIC_RESTART_COUNT", "0")
    args.launcher, args.by_host, args.launch_note = name, mpi, {
        "torchrun": "torchrun" + (f", restart {restart}" if restart != "0" else ""),
        "SLURM": f"SLURM: {plural(machines, 'node')}, one task each" if own
        else f"SLURM: {plural(world_size, 'task')} on {plural(machines, 'node')}",
    }.get(name, f"mpirun, {name}: {plural(world_size, 'rank')}" if mpi else name)  # fmt: skip
    ids = [getenv(v) for v in launch] if name else [socket.gethostname(), os.getpid(), LAUNCH_TIME]
    args.launch_id = "/".join(map(str, ids)) if ids and None not in ids else None
    # Rank 0's command alone names the job's files (rank0_files): only its machine checks them.
    return check_args(parser, args, here, files=placement(args, 0)[0] == 0)


# ---- S2. The rendezvous: machine 0's port and store --------------------------------------------------------


@contextlib.contextmanager
def rendezvous(rank, is_master, args, listener):
    """Waits for machine 0; yields TCPStore's other options: rank 0 serves on claim_port's socket."""
    resolve(args, rank, connect=not is_master)
    options = dict(timeout=timedelta(seconds=args.timeout), wait_for_workers=False)  # roll_call waits
    if is_master and (listener := listener or claim_port(args)[0]):  # a launcher's rank 0 claims it here
        options.update(master_listen_fd=listener.detach(), use_libuv=torch.__version__ >= "2.8")
    elif listener:
        listener.close()
    try:
        yield options
    except (dist.DistError, OSError) as e:
        where = f"{args.master_addr}:{args.master_port}"
        sys.exit(f"error: rank {rank}: rendezvous at {where} failed ({last_line(e)}): check --master-port")


def claim_port(args):
    """Machine 0's socket on the rendezvous port (or a free one), held against other launches; the port."""
    if args.machine_id != 0:
        return None, args.master_port
    hosts = [address[0] for *_, address in resolve(args, 0, connect=False)]
    # The store is unauthenticated: a one-machine job serves it on loopback (IPv4: ::1 may be off).
    one_host = args.num_machines == 1 and all(map(is_loopback, hosts))
    try:
        listener = listening(args.master_port, min(hosts, key=lambda h: ":" in h) if one_host else "")
    except OSError as e:
        if args.num_machines > 1:  # a copied --machine-id 0 while the job forms: every launch stops
            machine0_twice(args)
        where = f"{args.master_addr}:{args.master_port} ({os.strerror(e.errno)})"
        fix = "choose a free --master-port" + (", or none for a free one" if args.num_machines == 1 else "")
        sys.exit(f"error: cannot serve the rendezvous on {where}: another program holds the port: {fix}")
    if os.name != "posix":  # Windows: TCPStore binds for itself
        with listener:
            return None, listener.getsockname()[1]
    return listener, listener.getsockname()[1]


def listening(port, host=""):
    """Listens on host, or on every address (IPv6 and IPv4 where it can, as TCPStore)."""
    dual = not host and socket.has_dualstack_ipv6()
    family = socket.AF_INET6 if dual or ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, dualstack_ipv6=dual)


def machine0_twice(args):
    """Stops every launch where the port's holder is this job's machine 0 from another launch."""
    me, found = roll_call_record(0, placement(args, 0)[1], args), []

    def ask():  # in a thread: TCPStore waits forever on a server that never answers
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
    addr, port, deadline = args.master_addr, args.master_port, time.monotonic() + args.timeout
    while True:  # not TCPStore's wait: deaf to signals
        try:
            found = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
            if connect:  # this end's address, and machine 0's as this machine reaches it
                with socket.create_connection((addr, port), timeout=5) as s:
                    return [end[0].split("%")[0] for end in (s.getsockname(), s.getpeername())]
            return found
        except socket.gaierror as e:
            why = f"--master-addr {addr} does not resolve ({e.strerror}): give machine 0's address"
        except OSError as e:
            why = f"no answer from machine 0 at {addr}:{port} within --timeout {args.timeout:g} s"
            why += f" ({e.strerror or e}): start it, or check --master-addr, --master-port and the firewall"
        if time.monotonic() > deadline:
            sys.exit(f"error: rank {rank}: {why}")
        time.sleep(0.5)


def is_loopback(address):
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def torchrun_attempt():
    return f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/"


# ---- S3. The roll call: one job, one decision --------------------------------------------------------------


# Flags that must agree on every machine (the first four: the layout), rank 0's alone, each machine's own.
JOB_FLAGS = tuple(
    "world_size num_machines num_processes num_gpu_processes dataset batch_size epochs lr seed amp allreduce "
    "compress check torch model backend".split()
)
RANK0_FLAGS = ("checkpoint", "resume", "metrics_json")
MACHINE_FLAGS = ("data_dir", "log_interval", "threads", "timeout", "machine_id", "master_addr", "master_port")
SCRIPT = os.path.basename(__file__)


def job_record(args, **decided):
    return argparse.Namespace(**{**vars(args), **decided})


def roll_call(store, rank, world_size, args):
    """Every process checks in under its rank; rank 0 counts the machines and says "ready", or all stop."""
    deadline, me = time.monotonic() + args.timeout, roll_call_record(rank, world_size, args)
    mine, keys = json.dumps(me), [f"rank/{r}" for r in range(world_size)]

    def stop(line):  # every process, until the job is ready; then this one alone
        abort_job(None if store.check(["ready"]) else store, rank, args, line)

    def read(raw):  # the store is unauthenticated
        if is_record(found := from_json(raw)):
            return found
        if isinstance(found, dict) and found.get("script", me["script"]) != me["script"]:
            line = f"machine {found.get('machine')} runs another version of {SCRIPT}"
            stop(f"error: {line}: copy one script to every machine")
        stop(bad_value(rank, "a record", raw, args))

    try:
        job = me if rank == 0 else read(store.get("job"))
        if args.machine_id == 0 and rank != 0 and args.launch_id not in (None, job["launch"]):
            time.sleep(2)  # another job holds the port: this machine's rank 0, which could not serve, says so
            sys.exit(1)
        facts = job["job"], me["job"]
        if differ := [k for k in JOB_FLAGS if k in facts[0] and k in facts[1] and facts[0][k] != facts[1][k]]:
            theirs, ours = (", ".join(flag_words(k, f[k]) for k in differ) for f in facts)
            if "model" in differ:  # its first parameter that differs
                pairs = itertools.zip_longest(*(f["model"] for f in facts), fillvalue="none")
                theirs, ours = next(p for p in pairs if p[0] != p[1])
            sides = (f"machine 0 ({job['host']}) has {theirs}; "
                     f"machine {me['machine']} ({me['host']}) has {ours}")  # fmt: skip
            if job["launcher"] != me["launcher"]:  # a job is started one way: this is another job
                line = f"{args.master_addr}:{args.master_port} is another job's rendezvous ({sides})"
                abort_job(None, rank, args, f"error: {line}: choose another --master-port")
            flags = ", ".join(map(flag_words, differ))
            fix = "script and torch version" if {"torch", "model", "backend"} & {*differ} else flags
            stop(f"error: the machines disagree on {flags}: {sides}: use the same {fix} on every machine")
        # "job" before "rank/0": a second rank 0 finds the first there.
        for key in ("job", "rank/0") if rank == 0 else (keys[rank],):
            if (held := store.compare_set(key, "", mine)) != mine.encode():
                stop(claimed_twice(rank, read(held), me, args))
        while not store.check(["ready"]):
            if store.check(["abort"]):
                abort_job(None, rank, args, store.get("abort").decode(errors="replace").strip()[:2000])
            if rank == 0 and store.check(keys):
                records = [read(store.get(key)) for key in keys]
                store.set("ready", json.dumps(count_machines(records, args)))
            elif rank == 0 and time.monotonic() > deadline:
                joined, n = sum(store.check([k]) for k in keys), args.num_machines
                fix = f"start every machine (--num-machines {n}) with one --master-addr and --master-port"
                line = f"only {joined} of {world_size} processes joined within --timeout {args.timeout:g} s"
                abort_job(store, rank, args, f"error: {line}: {fix}")
            time.sleep(0.1)
        machine_of = from_json(ready := store.get("ready"))
    except dist.DistError as e:  # rank 0 gave up, or its machine went away
        abort_job(None, rank, args, f"error: rank {rank}: lost machine 0 while waiting ({last_line(e)})")
    index = {}  # as count_machines numbers them: in the order of their first rank
    ok = isinstance(machine_of, list) and len(machine_of) == world_size
    if not (ok and all(type(m) is int and index.setdefault(m, len(index)) == m for m in machine_of)):
        abort_job(store, rank, args, bad_value(rank, "ready", ready, args))
    sizes = [machine_of.count(m) for m in index]
    return dict(machine_id=machine_of[rank], num_machines=len(sizes), machine_sizes=sizes)


def roll_call_record(rank, world_size, args):
    layout = JOB_FLAGS[1:4] if args.rank is not None else ()  # a launcher's may vary processes per machine
    job = {k: getattr(args, k) for k in JOB_FLAGS if hasattr(args, k) and k not in layout}
    with torch.device("meta"):  # names and shapes only: no memory, no random numbers drawn
        job["model"] = [f"{n} {list(p.shape)}" for n, p in ConvNet().named_parameters()]
    job.update(world_size=world_size, torch=torch.__version__.split("+")[0], backend=f"{BACKEND} ({SCRIPT})")
    box = socket.gethostname()  # under MPI, host names may repeat: the boot and network namespace tell apart
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        box += f" {f.read().strip()} {os.readlink('/proc/self/ns/net')}"
    with open(__file__, "rb") as f:
        script = hashlib.sha256(f.read()).hexdigest()[:12]
    ids = dict(rank=rank, machine=args.machine_id, host=socket.gethostname(), pid=os.getpid(), box=box)
    return dict(ids, launch=args.launch_id, launcher=args.launcher, job=job, script=script)


def is_record(found):
    types = dict(rank=int, machine=int, pid=int, host=str, box=str, job=dict, script=str)
    types.update(launch=str | None, launcher=str | None)
    ok = isinstance(found, dict) and all(k in found and isinstance(found[k], t) for k, t in types.items())
    return ok and isinstance(found["job"].get("model", []), list)


def from_json(raw):
    with contextlib.suppress(ValueError, RecursionError):
        return json.loads(raw) if len(raw) < 1 << 16 else None


def bad_value(rank, key, raw, args):
    return f"error: rank {rank}: another program wrote {key} = {bytes(raw[:60])!r}: use another --master-port"


def flag_words(key, value=True):
    """--lr 0.5, --amp, no --amp, torch 2.5.0; given no value, the name alone."""
    name = "--" + key.replace("_", "-") if key not in ("world_size", "torch", "model", "backend") else key
    name = name.replace("_", " ")
    return name if value is True else f"no {name}" if value is False else f"{name} {value}"


def count_machines(records, args):
    """Each rank's machine, by --machine-id (or a launcher's), else by host; warns where scripts differ."""
    key, index = "box" if args.by_host else "machine", {}
    machine_of = [index.setdefault(r[key], len(index)) for r in records]
    for m in sorted({m for m, r in zip(machine_of, records) if r["script"] != records[0]["script"]}):
        print(f"warning: machine {m} runs another {SCRIPT}: copy one script to all machines", file=sys.stderr)
    return machine_of


def rank0_files(args):
    """Rank 0's file flags, for the others to follow; another machine's own go unused, said once."""
    said = [{k: getattr(args, k) for k in RANK0_FLAGS}]
    dist.broadcast_object_list(said, src=0)  # over the group: the store is unauthenticated
    unused = ", ".join(flag_words(k, v) for k in RANK0_FLAGS if (v := getattr(args, k)) and v != said[0][k])
    if unused and args.machine_id != 0 and local_rank_of(dist.get_rank(), args) == 0:
        line = f"machine {args.machine_id}: {unused} not used here: machine 0's command names the files"
        print(f"warning: {line}", file=sys.stderr)
    return {} if dist.get_rank() == 0 else {k: bool(v) for k, v in said[0].items()}


def claimed_twice(rank, first, second, args):
    twice = " and ".join(f"machine {r['machine']} on {r['host']} (pid {r['pid']})" for r in (first, second))
    fix = f"give each machine its own --machine-id (0 to {args.num_machines - 1}), each process its own rank"
    return f"error: rank {rank} joined twice, from {twice}: {fix}"


def check_same_data(data, rank, args):
    """A collective: a machine whose data differ (a copy that still parses) stops every machine."""
    once = local_rank_of(rank, args) == 0  # one machine's processes hold one copy: hash it once
    mine = [hashlib.sha256(t.contiguous().numpy()).hexdigest() for t in data] if once else []
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (args.machine_id, mine))
    names = ("training images", "training labels", "test images", "test labels")
    for machine, theirs in everyone:
        if differ := ", ".join(n for n, a, b in zip(names, everyone[0][1], theirs) if a != b):
            line = f"error: machine {machine}'s {args.dataset} {differ} differ from machine 0's"
            abort_job(None, rank, args, f"{line}: copy machine 0's files to every --data-dir")


# ---- S4. Stopping together, and reaching every machine -----------------------------------------------------


def abort_job(store, rank, args, line, end=sys.exit):
    """Stops with line, said once per machine; with store, every process of the job stops."""
    if store is not None:
        with contextlib.suppress(RuntimeError):  # the store is gone: the others learn it alone
            store.set("abort", line)
    if store is not None or rank == 0:
        time.sleep(1)  # the others look every 0.5 s: let them read the line first
    if local_rank_of(rank, args) != 0:
        time.sleep(2)  # local rank 0 says the line
        end(1)
    end(line)


@contextlib.contextmanager
def exit_on_abort(store, rank, args):
    """Around a wait in C++: abort_job's line stops this process within a second; a failure to connect is one
    line on every machine, and the backend's C++ log of each try is held back till then."""
    done, real = threading.Event(), os.dup(2)

    def watch():  # a store client of its own: the backend's may be blocked
        with contextlib.suppress(RuntimeError):  # machine 0 went: the backend will say so itself
            own = dist.TCPStore(args.master_addr, args.master_port, timeout=timedelta(seconds=args.timeout))
            own = dist.PrefixStore(torchrun_attempt(), own) if args.launcher == "torchrun" else own
            while not done.wait(0.5):
                if own.check(["abort"]):
                    os.dup2(real, 2)
                    line = own.get("abort").decode(errors="replace").strip()[:2000]
                    abort_job(None, rank, args, line, end=exit_at_once)  # sys.exit ends a thread alone

    watcher = threading.Thread(target=watch, daemon=True)
    sys.stderr.flush()
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            watcher.start()
            try:
                yield
            finally:
                done.set()
                watcher.join(5)
                os.dup2(real, 2)
            held.seek(0)
            sys.stderr.buffer.write(held.read())
            sys.stderr.flush()
    except RuntimeError as e:
        line = f"{BACKEND} cannot connect the processes ({last_line(e)}): open TCP between machines, or set"
        abort_job(store, rank, args, f"error: rank {rank}: {line} {BACKEND.upper()}_SOCKET_IFNAME")
    finally:
        os.close(real)


def local_rank_of(rank, args):
    return args.local_rank if args.rank is not None else rank - args.machine_id * placement(args, 0)[2]


def reach_every_machine(store, rank, args, listens_on=None):
    """Local rank 0 of each machine connects to every other on a new port, as the backend will."""
    if args.num_machines == 1 or local_rank_of(rank, args) != 0:
        return
    me, others = args.machine_id, [m for m in range(args.num_machines) if m != args.machine_id]
    near, far = resolve(args, rank, connect=True)
    with contextlib.suppress(ValueError):
        near = str(ipaddress.ip_address(listens_on))
    with listening(0) as listener:
        store.set(f"probe/{me}", f"{near} {listener.getsockname()[1]} {socket.gethostname()}")
        try:
            store.wait([f"probe/{m}" for m in others], timedelta(seconds=10))
            for m in others:
                value = store.get(f"probe/{m}")
                address, at, host = value.decode().split() if len(value) < 300 else ()
                address = far if is_loopback(address) else address  # machine 0, as this one reaches it
                socket.create_connection((address, port_number(at)), timeout=5).close()
            store.set(f"probed/{me}", "1")  # listening until the others have tried
            store.wait([f"probed/{m}" for m in others], timedelta(seconds=10))
        except dist.DistError:  # the store went, or a machine took no part: the backend will say
            return
        except (ValueError, argparse.ArgumentTypeError):  # port_number's
            abort_job(store, rank, args, bad_value(rank, f"probe/{m}", value, args))
        except OSError as e:
            abort_job(store, rank, args, (
                f"error: machine {me} ({socket.gethostname()}) cannot reach machine {m} ({host}) at "
                f"{address} port {at} ({e.strerror or e}), though it reaches the rendezvous: open all TCP "
                f"ports between the machines, or set {BACKEND.upper()}_SOCKET_IFNAME on each to the "
                "interface that reaches them"))  # fmt: skip


# ---- S5. --check, the link timed, and local SGD for slow links -------------------------------------------

LOCAL_SGD_PERIOD = 64  # --compress local-sgd: each copy steps alone; the copies are averaged every 64 steps


def try_the_group(world_size, device, args):
    """Averages ones of the gradients' size: --check passes once they arrive. Across machines, times that
    against a step's computing and names the --compress a slow link needs, which auto takes (every rank, from
    the same figures). Returns args with the --compress taken."""
    if args.check or args.num_machines > 1:
        compute, network, size = time_a_step(world_size, device, args)
    if args.check:
        machines = plural(args.num_machines, "machine")
        print0(f"Check passed: {plural(world_size, 'process')} on {machines} reached each other")
    if args.num_machines == 1:
        return job_record(args, compress="none" if args.compress == "auto" else args.compress)
    # DDP sends fc1's gradients while the backward computes the rest, about half a step.
    waits = {"none": max(0.0, network - compute / 2), "local-sgd": network / LOCAL_SGD_PERIOD}
    share = {c: wait / (compute + wait) for c, wait in waits.items()}
    best = "local-sgd" if share["none"] > 1 / 4 else "none"
    took = f"~{network:.0f} ms (~{8e-3 * size / network:.0f} Mbit/s), a step's computing ~{compute:.0f} ms"
    advice = f", ~{share[best]:.0%} with --compress {best}" if best != "none" else ""
    line = f"Network: averaging the gradients ({size / 1e6:.1f} MB) took {took}: waiting would take "
    line += f"~{share['none']:.0%} of each step{advice}"
    if args.check or args.compress == "auto" or args.compress == "none" != best:
        print0(line + (f" (--compress auto: {best})" if args.compress == "auto" else ""))
    return job_record(args, compress=best if args.compress == "auto" else args.compress)


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
    # The fastest of 3 (the first sets up); of the ranks, the slowest computing and the average as the last to
    # arrive saw it (the others waited for it too): one maximum, the average negated.
    fastest = torch.tensor(seconds, device=device).min(dim=0).values * torch.tensor([1, -1], device=device)
    dist.all_reduce(fastest, op=dist.ReduceOp.MAX)
    return 1000 * fastest[0].item(), -1000 * fastest[1].item(), 4 * grads.numel()


def local_sgd(ddp_model, args, clock=None):
    """--compress local-sgd: torch's hook that leaves each copy its gradients, and its state (else None); and
    before every LOCAL_SGD_PERIOD-th step the copies' average, copied in (docs/compat.md)."""
    if args.compress != "local-sgd":
        return None
    params, steps = list(ddp_model.parameters()), itertools.count()

    def average(module, inputs):  # before a step's forward
        if (step := next(steps)) and step % LOCAL_SGD_PERIOD == 0:
            start, flat = time.perf_counter(), torch.cat([p.detach().reshape(-1) for p in params])
            dist.all_reduce(flat.div_(dist.get_world_size()))
            for p, mean in zip(params, flat.split([p.numel() for p in params])):
                p.detach().copy_(mean.view_as(p))
            if clock:
                clock.waited += time.perf_counter() - start

    ddp_model.register_forward_pre_hook(average)
    state = post_localSGD_hook.PostLocalSGDState(None, None, 0, post_local_gradient_allreduce=False)
    return state, post_localSGD_hook.post_localSGD_hook


# ---- S6. Files: whole or not at all ------------------------------------------------------------------------


def raw_folder(args):
    return os.path.join(args.data_dir, DATASETS[args.dataset][0].__name__, "raw")


def resume(model, optimizer, args):
    """Rank 0 reads --checkpoint (maybe on machine 0 alone), and sends it or why not to all."""
    state = on_rank0(read_checkpoint, args, model, optimizer)  # loads it into rank 0's model
    if state and dist.get_rank() != 0:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    optimizer.param_groups[0]["lr"] = args.lr  # --lr wins, as every flag of a resumed run does
    return state["epoch"] + 1 if state else 0


def prepare_data(args):
    """Unpack .gz files placed by hand, else download; each file renamed into place whole."""
    cls, folder = DATASETS[args.dataset][0], raw_folder(args)
    paths = [os.path.join(folder, os.path.splitext(name)[0]) for name, _ in cls.resources]
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
    os.makedirs(folder, exist_ok=True)
    socket.setdefaulttimeout(30)  # a lossy network fails in seconds, not minutes
    try:
        with tempfile.TemporaryDirectory(prefix=".download-", dir=args.data_dir) as private:
            cls(private, download=True)
            for path in paths:  # atomic within one file system, NFS included
                os.replace(os.path.join(private, cls.__name__, "raw", os.path.basename(path)), path)
    except Exception as e:
        reason = (str(e).strip() or type(e).__name__).splitlines()[-1]
        names = ", ".join(map(os.path.basename, paths)) + " (gzipped or not)"
        sys.exit(f"error: {args.dataset} is not in {folder}/, download failed ({reason}): put {names} there")
    finally:
        socket.setdefaulttimeout(None)


def read_checkpoint(args, model, optimizer):
    """Load --checkpoint, if there is one, into model and optimizer: its state, None, or why not (a line)."""
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


def on_rank0(work, *args):
    """work(*args) on rank 0 alone, its result sent to every rank; a str, its error line, stops them all."""
    sent = [work(*args) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    if isinstance(sent[0], str):
        sys.exit(sent[0] if dist.get_rank() == 0 else 1)
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
        found = os.stat(path)
        return found.st_ino, found.st_mtime_ns, found.st_size


def stop_line(stop, path, before, stopped=""):
    """A stop's (130, 143) line: the signal, what stopped, what --checkpoint (path) holds against before."""
    line, now = ("Terminated (SIGTERM)" if stop.code == 143 else "Interrupted") + stopped, file_version(path)
    if now is None:
        return line + (f"; no epoch completed, so nothing was saved to {path}" if path else "")
    if now == before:
        return f"{line}; no epoch completed since this launch: {path} is as it was before"
    return f"{line}; {path} holds the last complete epoch"


# ---- S7. Processes, signals and exit -----------------------------------------------------------------------

GROUPS_KEPT = []  # worker()'s groups, never freed: freeing one can deadlock (docs/compat.md)


def run_workers(args, data, nprocs, listener):
    """mp.spawn, with stops blocked as the workers start (fork's bookkeeping lost one) to raise_on_signals."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # the worker's line says why
    method, ctrl_c = START_METHOD, signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    if method == "spawn" and os.name == "posix":
        resource_tracker.ensure_running()  # spawn would start it, unblocking the signals
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
    try:
        context = mp.start_processes(
            spawned_worker, (args, data, listener, ctrl_c), nprocs, join=False, start_method=method
        )
        raise_on_signals(ctrl_c)
        while not context.join():  # one failing, join stops the others
            pass
    except mp.ProcessExitedException as e:
        how = f"was killed by {e.signal_name}" if e.signal_name else f"exited with status {e.exit_code}"
        rank, pid = placement(args, e.error_index)[0], getattr(e, "error_pid", None) or e.pid
        line = f"error: rank {rank} (pid {pid}) {how}: the other processes of this machine were stopped"
        status = {1: 1, 130: 130, 143: 143, -signal.SIGTERM: 143}  # 1: it said why; a stop: exit_on_signal
        sys.exit(status.get(e.exit_code, line))
    finally:  # any still running (a stop, a failed start): SIGTERM, then SIGKILL at 10 s
        workers, deadline = mp.active_children(), time.monotonic() + 10
        for process in workers:
            process.terminate()
        for process in workers:
            process.join(max(0.0, deadline - time.monotonic()))
            process.kill()
            process.join()
        if listener is not None:  # held till now: the port's holder, as users see it, is this launch
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
    path = args.checkpoint if args.machine_id == 0 else None  # machine 0's line says what it holds
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
        time.sleep(2 if local_rank_of(rank, args) else 0)  # local rank 0's line first; the launcher stops us
        sys.exit(
            f"error: rank {rank} lost contact with the job ({last_line(error)}): another process stopped, "
            f"or did not answer within --timeout {args.timeout:g} s"
        )


def exit_at_once(end=0):
    """sys.exit(end), end also what ended the run, without the teardown: slow, and a kept group can abort."""
    with contextlib.suppress(ValueError):  # ValueError: not the main thread
        for signum in (signal.SIGINT, signal.SIGTERM):  # a stop must not cut the exit short
            signal.signal(signum, signal.SIG_IGN)
    if isinstance(end, SystemExit):  # a stop's too: 130 or 143 (raise_on_signals)
        end = end.code
    elif isinstance(end, KeyboardInterrupt):  # a Ctrl-C before raise_on_signals: a stop all the same
        end = 130
    elif isinstance(end, BaseException):  # a bug: its traceback, and 1
        end = "".join(traceback.format_exception(end)).rstrip()
    if end is not None and not isinstance(end, int):
        sys.stderr.write(f"{end}\n")  # one write: print's two let another process's line in between
        end = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":  # os._exit drops C's stdio buffers: fflush(NULL) flushes them
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).fflush(None)
    os._exit(end or 0)


# ---- S8. Memory, speed-ups and the run's figures -----------------------------------------------------------


def print0(message):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def keep_freed_memory():
    """glibc's mallopt(3): keep freed blocks for reuse, not hand each back to be refaulted every step."""
    with contextlib.suppress(OSError):  # not glibc
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 32 MiB blocks from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB


def release_freed_memory():
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing was kept
        ctypes.CDLL("libc.so.6").malloc_trim(0)


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
    return (
        f"World size {world_size} = {plural(len(sizes), 'machine')} {each}; "
        f"global batch {args.batch_size * world_size} = {world_size} x {args.batch_size}; "
        f"{plural(torch.get_num_threads(), 'thread')} per process{threads}; "
        f"{averaging_words(allreduce, args)}{note}"
    )


def report(args, device, history, seconds, samples, test, **averaging):
    """The last lines and --metrics-json; a collective (every rank's peak memory)."""
    world_size, peaks = dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_memory_mib())
    speed = len(history) * samples / seconds if seconds else None
    total = time.time() - LAUNCH_TIME
    print0(f"Train loop {seconds:.2f} s ({speed or 0:.0f} samples/s); launch to end {total:.2f} s")
    figures = dict(
        script=os.path.basename(__file__), dataset=args.dataset, device=str(device), world_size=world_size,
        epochs=args.epochs, epochs_trained=len(history), batch_size=args.batch_size,
        global_batch_size=args.batch_size * world_size, threads=torch.get_num_threads(), amp=args.amp,
        **averaging, train_seconds=seconds, total_seconds=total, samples_per_second=speed,
        final_train_loss=history[-1]["train_loss"] if history else None, test_loss=test[0],
        test_accuracy=test[1], test_samples=test[2], peak_rss_mib_per_rank=peaks, history=history,
    )  # fmt: skip
    if args.metrics_json:
        text = json.dumps(figures, indent=2) + "\n"
        on_rank0(write_atomically, args.metrics_json, lambda f: f.write(text.encode()))
    print0(f"Finished training in {seconds:.2f} secs")


def peak_memory_mib():
    """Peak resident set so far, in MiB; None on Windows."""
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


def check_args(parser, args, processes=1, files=True):
    """Checks argparse cannot make; --threads: OMP_NUM_THREADS, else the usable cores per process."""
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
            for up in range(path.count("/") + 1) if v1 or not controllers else ():  # its cgroup, those above
                folder = ("/sys/fs/cgroup/cpu" if v1 else "/sys/fs/cgroup") + path.rsplit("/", up)[0]
                text = ""
                with contextlib.suppress(OSError, ValueError):  # v2's "max" is no quota
                    for name in ["cpu.cfs_quota_us", "cpu.cfs_period_us"] if v1 else ["cpu.max"]:
                        with open(f"{folder}/{name}") as file:
                            text += file.read() + " "
                    quota, period = map(int, text.split())
                    quotas.append(-(-quota // period))
    return min((q for q in quotas if q > 0), default=None)  # v1's -1 is no quota


def getenv(name, default=None):
    """An environment variable, or default where unset or empty: `VAR=` means unset."""
    return os.environ.get(name) or default


def plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}es" if word.endswith("s") else f"{n} {word}s"


def last_line(error):
    """The gist of a distributed error: its last non-empty line, without the C++ source location."""
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
