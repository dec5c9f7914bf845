#!/usr/bin/env python3
"""Training of a small ConvNet on MNIST in one process: the baseline for the distributed scripts.

One process, all of this machine's cores:
    python convnet_undistributed.py --epochs 1
Fashion-MNIST, bfloat16 autocast, a checkpoint after every epoch that a rerun continues from:
    python convnet_undistributed.py --dataset fashion-mnist --amp --epochs 3 --checkpoint ck.pt --resume
"""

import argparse
import contextlib
import ctypes
import gzip
import io
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback

LAUNCH_TIME = time.time()  # before the heavy imports: total_seconds counts them, as a user waits for them
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torchvision import datasets

# ---- 1. Constants -------------------------------------------------------------------------------------------

CHECKPOINT_FORMAT = "convnet-mnist-checkpoint-v1"
# Test images per forward pass: on a CPU a small batch keeps its activations in cache, and evaluation
# stays below training in memory.
TEST_BATCH_SIZE = 128
# --dataset: torchvision class, and mean and std of its training pixels scaled to [0, 1].
DATASETS = {
    "mnist": (datasets.MNIST, 0.1302, 0.3069),
    "fashion-mnist": (datasets.FashionMNIST, 0.2860, 0.3530),
}


# ---- 2. The model -------------------------------------------------------------------------------------------


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
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


# ---- 3. Data ------------------------------------------------------------------------------------------------


def unpack(path):
    """Unpack path.gz into path; a half-unpacked file never takes the real name. The temporary name is unique
    (mkstemp): launches that share --data-dir may unpack at once, and in containers each may be PID 1."""
    part = None
    try:
        fd, part = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}-")
        with os.fdopen(fd, "wb") as dst, gzip.open(path + ".gz", "rb") as src:
            shutil.copyfileobj(src, dst)
        os.chmod(part, plain_file_mode(path))
        os.replace(part, path)
    except BaseException as e:  # Ctrl-C and SIGTERM (Terminated) too: the half-unpacked file (47 MB) goes
        if part and os.path.exists(part):
            os.unlink(part)
        if not isinstance(e, Exception):
            raise  # a stop, not a damaged file: the run stops as it would anywhere else
        sys.exit(f"error: cannot unpack {path}.gz ({type(e).__name__}: {e}): replace it")


def prepare_data(args):
    """Make the four files readable: unpack .gz files placed by hand, else download them."""
    folder = raw_folder(args)
    names = [os.path.splitext(name)[0] for name, _ in DATASETS[args.dataset][0].resources]
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path) and os.path.isfile(path + ".gz"):
            unpack(path)
    if all(os.path.isfile(os.path.join(folder, name)) for name in names):
        return
    download(args, names)


def download(args, names):
    """Download the data set into a folder of this process's own, then rename each file into place: machines
    that share --data-dir (NFS) and download at once never see a half-written file under its real name."""
    cls, folder = DATASETS[args.dataset][0], raw_folder(args)
    os.makedirs(folder, exist_ok=True)
    private = tempfile.mkdtemp(prefix=".download-", dir=args.data_dir)
    socket.setdefaulttimeout(30)  # a network that drops packets fails in seconds, not minutes
    try:
        cls(private, download=True)
        for name in names:  # a rename within one file system is atomic, NFS included
            os.replace(os.path.join(private, cls.__name__, "raw", name), os.path.join(folder, name))
    except Exception as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        sys.exit(
            f"error: {args.dataset} is not in {folder}/ and downloading it failed ({reason}); "
            f"put the four files {', '.join(names)} there (gzipped or not) and run again"
        )
    finally:
        socket.setdefaulttimeout(None)
        shutil.rmtree(private, ignore_errors=True)


def raw_folder(args):
    """Where the data set's files are, in torchvision's layout: DIR/MNIST/raw, DIR/FashionMNIST/raw."""
    return os.path.join(args.data_dir, DATASETS[args.dataset][0].__name__, "raw")


def load_data(args):
    """Both splits as uint8 images [N, 28, 28] and int64 labels [N]: batches are sliced out of them."""
    cls = DATASETS[args.dataset][0]
    try:
        train, test = cls(args.data_dir, train=True), cls(args.data_dir, train=False)
    except Exception as e:
        sys.exit(
            f"error: cannot read {args.dataset} from {raw_folder(args)}/ ({type(e).__name__}: {e}); "
            "a file there is damaged: replace it"
        )
    return train.data, train.targets, test.data, test.targets


def to_input(images, dataset):
    """uint8 [B, 28, 28] to normalised float [B, 1, 28, 28]: the values of ToTensor() then Normalize()."""
    _, mean, std = DATASETS[dataset]
    return images.unsqueeze(1).float().div_(255).sub_(mean).div_(std)


def epoch_batches(num_samples, epoch, batch_size, seed):
    """The batches of an epoch, as index tensors, in a new order each epoch: the order a
    DistributedSampler of one process draws, so both scripts see the same batches."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    return order.split(batch_size)


# ---- 4. Train and evaluate ----------------------------------------------------------------------------------


def train(model, optimizer, data, args):
    """The epochs: train, evaluate on the whole test set, checkpoint; then the metrics."""
    device = next(model.parameters()).device
    train_images, train_labels, test_images, test_labels = (t.to(device) for t in data)
    start_epoch = resume(model, optimizer, args) if args.resume else 0
    threads = plural(torch.get_num_threads(), "thread") + (f", from {args.threads_from}" if args.threads_from else "")
    print(f"World size 1 = 1 process; batch {args.batch_size}; {threads}; no gradient averaging", flush=True)
    train_seconds, history = 0.0, []
    for epoch in range(start_epoch, args.epochs):
        torch.manual_seed(args.seed + epoch)  # a resumed run draws the same dropout masks as an unbroken run
        batches = epoch_batches(len(train_labels), epoch, args.batch_size, args.seed)
        start = time.perf_counter()
        train_loss = train_epoch(model, optimizer, train_images, train_labels, batches, epoch, args)
        train_seconds += time.perf_counter() - start
        test_loss, test_accuracy, test_count = evaluate(model, test_images, test_labels, args)
        release_freed_memory()
        accuracy = f"{round(test_accuracy * test_count)}/{test_count} ({100 * test_accuracy:.2f}%)"
        print(f"Test set, epoch {epoch}: average loss {test_loss:.4f}, accuracy {accuracy}")
        history.append(
            {"epoch": epoch, "train_loss": train_loss.item(), "test_loss": test_loss, "test_accuracy": test_accuracy}
        )
        if args.checkpoint:
            save_checkpoint(model, optimizer, epoch, args)
    if not history:
        print(f"Nothing to train: the checkpoint already holds {start_epoch} epoch(s)")
        test_loss, test_accuracy, test_count = evaluate(model, test_images, test_labels, args)
    metrics = {
        "script": os.path.basename(__file__), "dataset": args.dataset, "device": str(device),
        "world_size": 1, "epochs": args.epochs, "epochs_trained": len(history),
        "batch_size": args.batch_size, "global_batch_size": args.batch_size,
        "threads": torch.get_num_threads(), "amp": args.amp,
        "train_seconds": train_seconds, "total_seconds": time.time() - LAUNCH_TIME,
        "samples_per_second": len(history) * len(train_labels) / train_seconds if train_seconds else None,
        "final_train_loss": history[-1]["train_loss"] if history else None,
        "test_loss": test_loss, "test_accuracy": test_accuracy, "test_samples": test_count,
        "peak_rss_mib": peak_memory_mib(), "history": history,
    }  # fmt: skip
    report(metrics, args)


def train_epoch(model, optimizer, images, labels, batches, epoch, args):
    """One pass over the batches; returns the mean training loss (a tensor)."""
    model.train()
    loss_sum = torch.zeros((), device=images.device)
    for i, idx in enumerate(batches):
        x, y = to_input(images[idx], args.dataset), labels[idx]
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = F.nll_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
        if i % args.log_interval == 0:
            progress = f"[{i}/{len(batches)} ({100.0 * i / len(batches):.0f}%)]"
            print(f"epoch: {epoch} {progress}\t training loss: {loss.item():.6f}", flush=True)
    return loss_sum / len(batches)


def evaluate(model, images, labels, args):
    """Loss and accuracy over the whole test set."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=images.device)  # loss sum, correct, images
    with torch.no_grad(), torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=args.amp):
        for idx in torch.arange(len(labels), device=images.device).split(TEST_BATCH_SIZE):
            output, y = model(to_input(images[idx], args.dataset)), labels[idx]
            totals[0] += F.nll_loss(output, y, reduction="sum")
            totals[1] += (output.argmax(1) == y).sum()
            totals[2] += len(idx)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


def plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}es" if word.endswith("s") else f"{n} {word}s"


# ---- 5. Checkpoint and metrics ------------------------------------------------------------------------------


def save_checkpoint(model, optimizer, epoch, args):
    state = {
        "format": CHECKPOINT_FORMAT,
        "epoch": epoch,
        "dataset": args.dataset,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
    }
    save_atomically(args.checkpoint, lambda f: torch.save(state, f))


def save_atomically(path, write):
    """Write path whole, or stop with one line saying why (write_atomically): the file there before stays whole."""
    error = write_atomically(path, write)
    if error:
        sys.exit(error)


def resume(model, optimizer, args):
    """Load --checkpoint into model and optimizer; returns the epoch to start from."""
    try:
        state = read_checkpoint(args)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError) as e:
        sys.exit(f"error: --resume: {args.checkpoint} does not fit this model ({' '.join(str(e).split())})")
    except ValueError as e:
        sys.exit(f"error: --resume: {e}")
    if state is None:
        print(f"No checkpoint at {args.checkpoint} yet: starting from epoch 0")
        return 0
    print(f"Resuming from {args.checkpoint}: epoch {state['epoch']} done, starting epoch {state['epoch'] + 1}")
    # load_state_dict restored the checkpoint's learning rate, while the run's args (saved in the next checkpoint)
    # say --lr: --lr wins, as every other flag of a resumed run does.
    saved_lr = optimizer.param_groups[0]["lr"]
    for group in optimizer.param_groups:
        group["lr"] = args.lr
    if saved_lr != args.lr:
        print(f"Learning rate {args.lr:g} from --lr (the checkpoint had {saved_lr:g})")
    return state["epoch"] + 1


def read_checkpoint(args):
    """The checkpoint to resume from, or None where there is none yet; anything else is an error."""
    if not os.path.exists(args.checkpoint):
        return None
    try:
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"cannot read {args.checkpoint} ({type(e).__name__}): truncated or not a checkpoint") from e
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{args.checkpoint} is not a checkpoint of these scripts")
    if state["dataset"] != args.dataset:
        raise ValueError(f"{args.checkpoint} was trained on {state['dataset']}, not --dataset {args.dataset}")
    return state


def report(metrics, args):
    """Print the run's speed and write its figures to --metrics-json."""
    print(
        f"Train loop {metrics['train_seconds']:.2f} s ({metrics['samples_per_second'] or 0:.0f} samples/s); "
        f"launch to end {metrics['total_seconds']:.2f} s"
    )
    if args.metrics_json:
        save_atomically(args.metrics_json, lambda f: f.write(json.dumps(metrics, indent=2).encode() + b"\n"))
    print(f"Finished training in {metrics['train_seconds']:.2f} secs")


def peak_memory_mib():
    """The largest resident set this process has had so far, in MiB (getrusage(2)); None on Windows."""
    try:
        import resource  # Unix only
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / (1 << 10)  # macOS counts bytes, Linux KiB


# ---- 6. Launch and command line -----------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    before = file_version(args.checkpoint)  # the interrupt line tells whether this launch replaced it
    stop_on_signals(ctrl_c=signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    try:
        prepare_data(args)
        data = load_data(args)
        torch.manual_seed(args.seed)
        # Channels-last is the layout the convolution kernels work in (oneDNN's on CPUs, cuDNN's tensor cores).
        model = ConvNet().to(memory_format=torch.channels_last)
        keep_pool_gradient_channels_last(model)
        optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
        train(model, optimizer, data, args)
    except (KeyboardInterrupt, Terminated) as e:
        how, status = ("Terminated (SIGTERM)", 143) if isinstance(e, Terminated) else ("Interrupted", 130)
        checkpoint = checkpoint_note(args.checkpoint, before)
        print(f"{how}{checkpoint}", file=sys.stderr)
        sys.exit(status)  # 128 + the signal's number, what a shell reports: 130 for Ctrl-C, 143 for SIGTERM


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint PATH")
    for flag, path in (("--checkpoint", args.checkpoint), ("--metrics-json", args.metrics_json)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            parser.error(f"{flag}: cannot write to folder {folder}")
    if os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):
        parser.error(f"--data-dir: {args.data_dir} is not a folder")
    args.threads_from = ""  # what capped the default threads, said in the layout line
    if args.threads is None:
        try:
            args.threads, args.threads_from = default_threads()
        except (ValueError, argparse.ArgumentTypeError):
            parser.error(
                f"OMP_NUM_THREADS={getenv('OMP_NUM_THREADS')!r} in the environment is not a number of threads (1 or "
                "more, or a list per nesting level such as 4,2): fix it, or pass --threads"
            )
    return args


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """A mistake on the command line gets one line naming the flag, not a usage block first."""
        for action in self._actions:  # a flag with two spellings is named by the first: --batch-size
            message = message.replace("/".join(action.option_strings), action.option_strings[0])
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser():
    # Flags of two words take the article's spelling too: --batch_size as well as --batch-size.
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=positive_int, default=1, metavar="N", help="epochs to train (default: 1)")
    p.add_argument(
        "--batch-size",
        "--batch_size",
        type=positive_int,
        default=128,
        metavar="N",
        help="images per batch (default: 128)",
    )
    p.add_argument("--lr", type=positive_float, default=0.5, metavar="LR", help="Adadelta learning rate (default: 0.5)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default: 0)")
    p.add_argument("--dataset", choices=sorted(DATASETS), default="mnist", help="data set (default: mnist)")
    p.add_argument(
        "--data-dir",
        "--data_dir",
        default="./data",
        metavar="DIR",
        help="data folder, torchvision's layout: DIR/MNIST/raw, DIR/FashionMNIST/raw (default: ./data)",
    )
    p.add_argument(
        "--log-interval",
        "--log_interval",
        type=positive_int,
        default=10,
        metavar="N",
        help="batches between progress lines (default: 10)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="intra-op threads (default: OMP_NUM_THREADS if set, else every usable core)",
    )
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast (default: off)")
    p.add_argument(
        "--checkpoint", metavar="PATH", help="save model and optimizer here after every epoch (default: none)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from --checkpoint; start fresh where it does not exist yet (default: off)",
    )
    p.add_argument(
        "--metrics-json", "--metrics_json", metavar="PATH", help="write the run's figures here as JSON (default: none)"
    )
    return p


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def default_threads():
    """Intra-op threads and what capped them: OMP_NUM_THREADS where set, else every core this process may use."""
    if getenv("OMP_NUM_THREADS"):  # OpenMP's list per nesting level (4,2): the first is the outer level's
        return positive_int(getenv("OMP_NUM_THREADS").split(",")[0]), ""
    return usable_cores()


def usable_cores():
    """The cores this process may use, and what capped them ("" where nothing did): the cores it may run on
    (os.sched_getaffinity is Linux-only: elsewhere every core), a cgroup's CPU quota (the process still sees every
    core), SLURM_CPUS_PER_TASK (under SLURM's task/none nothing pins a task to the cores it was given)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    slurm = getenv("SLURM_CPUS_PER_TASK", "")
    slurm = int(slurm) if slurm.isdigit() and int(slurm) > 0 else cores
    caps = [(cores, ""), (cgroup_cpus() or cores, "the cgroup's CPU quota"), (slurm, "SLURM_CPUS_PER_TASK")]
    return min(caps, key=lambda cap: cap[0])  # the first of equals: a cap is named only where it decided


def cgroup_cpus():
    """The cores a CPU quota gives this process (Docker's --cpus, a Kubernetes CPU limit), rounded up: the tightest
    of its cgroup's and those above it (a container may see its own cgroup as the root), from cgroup v2's cpu.max
    ("max 100000", or "150000 100000" for 1.5 cores) or v1's cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us."""
    hierarchies, quotas = [], []
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:  # none: not Linux
        hierarchies = [line.rstrip("\n").split(":", 2) for line in f]  # id:controllers:path; v2 names none
    for _, controllers, path in hierarchies:
        v1 = "cpu" in controllers.split(",")
        for up in range(path.count("/") + 1) if v1 or not controllers else ():  # its cgroup, then each above it
            folder = ("/sys/fs/cgroup/cpu" if v1 else "/sys/fs/cgroup") + path.rsplit("/", up)[0]
            files = [f"{folder}/cpu.cfs_quota_us", f"{folder}/cpu.cfs_period_us"] if v1 else [f"{folder}/cpu.max"] * 2
            with contextlib.suppress(OSError, ValueError), open(files[0]) as quota, open(files[1]) as period:
                quotas.append(-(-int(quota.read().split()[0]) // int(period.read().split()[-1])))  # rounded up
    return min((q for q in quotas if q > 0), default=None)  # v1's -1 and v2's "max" are no quota


def getenv(name, default=None):
    """An environment variable, or default where it is unset or empty: `MASTER_PORT=` means unset, as it does
    to torchrun and most launchers."""
    return os.environ.get(name) or default


# ---- Speed and robustness machinery (can be skipped on a first reading) -------------------------------------
# What makes the story above run fast on CPUs: the allocator kept warm, and a layout fix for max-pool's backward;
# and SIGTERM, which stops the run as Ctrl-C does.


def keep_freed_memory():
    """glibc hands every freed block above 128 KiB back to the system, so each training step would map its
    activations afresh and fault their pages in again. Keep freed blocks for reuse instead (mallopt(3);
    jemalloc or tcmalloc do the same)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: its allocator keeps its own counsel
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks up to 32 MiB come from the reusable heap
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap rather than return it


def release_freed_memory():
    """Hand the blocks kept for the training steps back to the system (malloc_trim(3)) once an epoch's
    evaluation is done: checkpointing, the next epoch's start and the exit need not carry them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing was kept


def keep_pool_gradient_channels_last(model):
    """Hand max-pool's backward its gradient in channels-last order. flatten() returns the gradient in NCHW
    order, and max-pool's CPU backward takes the layout of its incoming gradient: on a channels-last model it
    would convert its whole 24x24 gradient to NCHW and back. One conversion of the small 12x12 gradient
    instead. max_pool2d is a function, not a module, so the hook sits on dropout1, whose input is the pool's
    output."""

    def on_pooled(module, inputs):
        pooled = inputs[0]
        if pooled.requires_grad and pooled.is_contiguous(memory_format=torch.channels_last):
            pooled.register_hook(lambda grad: grad.contiguous(memory_format=torch.channels_last))

    model.dropout1.register_forward_pre_hook(on_pooled)


class Terminated(BaseException):
    """SIGTERM (kill, timeout, docker stop, Kubernetes, SLURM's scancel, torchrun), raised where the process
    is, as Ctrl-C raises KeyboardInterrupt: the same clean-up runs, and the run ends with one line."""


def stop_on_signals(ctrl_c):
    """Ctrl-C raises KeyboardInterrupt and SIGTERM raises Terminated, wherever the process is, so that the same
    clean-up runs. The first only: a second (a worker's own Ctrl-C, then its launcher's SIGTERM) is ignored, for
    it must not cut the clean-up short. ctrl_c False: Ctrl-C stays ignored, as a background job's is."""
    stopping = []

    def stop(signum, frame):
        # Not in one already leaving (its error line on the way out): raised there, it would print a traceback.
        if not stopping and not isinstance(sys.exc_info()[1], (SystemExit, KeyboardInterrupt, Terminated)):
            stopping.append(signum)
            raise KeyboardInterrupt if signum == signal.SIGINT else Terminated

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop if ctrl_c else signal.SIG_IGN)


def write_atomically(path, write):
    """Write path whole or not at all, as a plain open() would make it; returns None, or the one line that says
    why it could not (an OSError: a full disk, a quota, a folder gone), the file there before left whole. write(f)
    writes into memory first: torch.save onto a full disk raises "unexpected pos", not the disk's own error. Then
    a temporary file in path's folder, with the mode of the file it replaces, else the one the umask gives
    (mkstemp's 0600 would hide checkpoints from teammates and evaluation jobs), flushed to disk, renamed over
    path, and the folder flushed too, so that the rename survives a power cut. No temporary file stays."""
    buffer, temporary = io.BytesIO(), None
    write(buffer)
    try:
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, plain_file_mode(path))
        os.replace(temporary, path)
        temporary = None
        sync_folder(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        cause = e.strerror or str(e)
        return (
            f"error: cannot write {path} ({cause}); what was there before is unchanged: free space, or write elsewhere"
        )
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    return None


def plain_file_mode(path):
    """The mode of the file at path, else the one open() gives a new file: 0666 less the umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0o022)  # the umask is read by setting it
        os.umask(umask)
        return 0o666 & ~umask


def sync_folder(folder):
    """Flush a folder's list of names to disk, where a rename is recorded (Windows opens no folder as a file)."""
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):  # some file systems cannot sync a folder; the file itself is on disk
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def file_version(path):
    """What tells one version of a file from the next (a rename puts a new file in place), or None where none is."""
    try:
        found = os.stat(path)
    except (OSError, TypeError):
        return None
    return found.st_ino, found.st_mtime_ns, found.st_size


def checkpoint_note(path, before):
    """What the line of an interrupted run says of --checkpoint: what is there now, against its version at launch."""
    if path is None:
        return ""
    now = file_version(path)
    if now is None:
        return f"; no epoch completed, so nothing was saved to {path}"
    if now == before:
        return f"; no epoch completed since this launch: {path} is as it was before"
    return f"; {path} holds the last complete epoch"


def exit_at_once(status=0):
    """Leave without tearing the interpreter down, as sys.exit(status) would end (a message goes to stderr, and
    exits 1). Tearing down pages torch's libraries back in (the CUDA build's above all) only to unload them, for
    about a second, and frees a Gloo group kept to the exit (leave_group), whose threads can abort the process
    ("terminate called without an active exception") as the interpreter goes."""
    with contextlib.suppress(
        ValueError
    ):  # a stop now would only cut the exit short (main thread only: else ValueError)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    if status is not None and not isinstance(status, int):
        sys.stderr.write(f"{status}\n")  # one write: print's two let another process's line in between
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit drops what C code holds in stdio's buffers (NCCL_DEBUG's log written to a file loses its last
    # block): fflush(NULL) flushes every C stream. Skipped on Windows, which has no CDLL(None).
    if os.name == "posix":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).fflush(None)
    os._exit(status or 0)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:  # every failure's one line, and every signal's exit status
        exit_at_once(e.code)
    except Exception:  # a bug: its traceback says where; then out as ever, a Gloo group kept unfreed (leave_group)
        traceback.print_exc()
        exit_at_once(1)
    exit_at_once()
