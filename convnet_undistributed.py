#!/usr/bin/env python3
"""Training of a small ConvNet on MNIST in one process: the baseline for the distributed scripts.

python convnet_undistributed.py --epochs 1  # on every usable core
python convnet_undistributed.py --dataset fashion-mnist --amp --epochs 3 --checkpoint ck.pt --resume
"""

import argparse
import contextlib
import ctypes
import functools
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

LAUNCH_TIME = time.time()  # before the imports: total_seconds counts them
import torch
import torch.nn as nn
import torch.nn.functional as F

# ---- 1. Constants
CHECKPOINT_FORMAT = "convnet-mnist-checkpoint-v1"
TEST_BATCH_SIZE = 128  # its activations stay in a CPU's cache
# --dataset: its folder, training pixels' mean and std in [0, 1]; the files in it (torchvision's names)
DATASETS = {"mnist": ("MNIST", 0.1302, 0.3069), "fashion-mnist": ("FashionMNIST", 0.2860, 0.3530)}
FILES = [f"{split}-{kind}-ubyte" for split in ("train", "t10k") for kind in ("images-idx3", "labels-idx1")]


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


def epoch_batches(num_samples, epoch, batch_size, seed):
    """An epoch's batches of indices, in a one-process DistributedSampler's order."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))
    return order.split(batch_size)


# ---- 4. Train and evaluate
def train(model, optimizer, data, args):
    """Each epoch: train, evaluate, checkpoint; then the run's figures."""
    train_images, train_labels, test_images, test_labels = data
    start_epoch = resume(model, optimizer, args) if args.resume else 0
    threads = plural(args.threads, "thread") + (args.threads_from and f", from {args.threads_from}")
    print(f"World size 1 = 1 process; batch {args.batch_size}; {threads}; no gradient averaging")
    seconds, history, train_loss = 0.0, [], None
    for epoch in range(start_epoch, args.epochs):
        torch.manual_seed(args.seed + epoch)  # a resumed run's dropout masks: an unbroken run's
        batches = epoch_batches(len(train_labels), epoch, args.batch_size, args.seed)
        start = time.perf_counter()
        train_loss = train_epoch(model, optimizer, train_images, train_labels, batches, epoch, args).item()
        seconds += time.perf_counter() - start
        loss, accuracy = evaluate(model, test_images, test_labels, args)
        release_freed_memory()
        correct = f"{round(accuracy * len(test_labels))}/{len(test_labels)} ({accuracy:.2%})"
        print(f"Test set, epoch {epoch}: average loss {loss:.4f}, accuracy {correct}")
        history.append(dict(epoch=epoch, train_loss=train_loss, test_loss=loss, test_accuracy=accuracy))
        if args.checkpoint:
            state = dict(format=CHECKPOINT_FORMAT, epoch=epoch, dataset=args.dataset, args=vars(args))
            state.update(model=model.state_dict(), optimizer=optimizer.state_dict())
            if error := write_atomically(args.checkpoint, functools.partial(torch.save, state)):
                sys.exit(error)
    if not history:
        print(f"Nothing to train: the checkpoint already holds {start_epoch} epoch(s)")
        loss, accuracy = evaluate(model, test_images, test_labels, args)
    speed = len(history) * len(train_labels) / seconds if seconds else None
    total = time.time() - LAUNCH_TIME
    print(f"Train loop {seconds:.2f} s ({speed or 0:.0f} samples/s); launch to end {total:.2f} s")
    metrics = dict(script=os.path.basename(__file__), dataset=args.dataset, device="cpu", world_size=1)
    metrics.update(epochs=args.epochs, epochs_trained=len(history), batch_size=args.batch_size, amp=args.amp)
    metrics.update(global_batch_size=args.batch_size, threads=args.threads, train_seconds=seconds)
    metrics.update(total_seconds=total, samples_per_second=speed, test_loss=loss, test_accuracy=accuracy)
    metrics.update(final_train_loss=train_loss, test_samples=len(test_labels), peak_rss_mib=peak_memory_mib())
    text = json.dumps(dict(metrics, history=history), indent=2) + "\n"
    if args.metrics_json and (error := write_atomically(args.metrics_json, lambda f: f.write(text.encode()))):
        sys.exit(error)
    print(f"Finished training in {seconds:.2f} secs")


def train_epoch(model, optimizer, images, labels, batches, epoch, args):
    model.train()
    loss_sum, n = torch.zeros(()), len(batches)
    for i, idx in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
            loss = F.nll_loss(model(to_input(images[idx], args.dataset)), labels[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
        if i % args.log_interval == 0:
            progress = f"[{i}/{n} ({100 * i / n:.0f}%)]"
            print(f"epoch: {epoch} {progress}\t training loss: {loss.item():.6f}", flush=True)
    return loss_sum / n


def evaluate(model, images, labels, args):
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
        output = torch.cat([model(to_input(x, args.dataset)) for x in images.split(TEST_BATCH_SIZE)])
        return F.nll_loss(output, labels).item(), (output.argmax(1) == labels).sum().item() / len(labels)


def plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}es" if word.endswith("s") else f"{n} {word}s"


def peak_memory_mib():
    with contextlib.suppress(ImportError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1 << 20 if sys.platform == "darwin" else 1 << 10)  # bytes on macOS, else KiB


# ---- 5. Checkpoint
def resume(model, optimizer, args):
    """Load --checkpoint; returns the epoch to start from."""
    if isinstance(state := read_checkpoint(args, model, optimizer), str):
        sys.exit(state)
    optimizer.param_groups[0]["lr"] = args.lr  # --lr wins, as every flag of a resumed run does
    return state["epoch"] + 1 if state else 0


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


# ---- 6. Launch and command line
def main(argv=None):
    args = parse_args(argv)
    before = file_version(args.checkpoint)  # a stop's line says if this launch replaced it
    raise_on_signals(ctrl_c=signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    try:
        prepare_data(args)
        torch.manual_seed(args.seed)
        model = ConvNet().to(memory_format=torch.channels_last)  # oneDNN's convolutions' layout
        keep_pool_gradient_channels_last(model)
        train(model, torch.optim.Adadelta(model.parameters(), lr=args.lr), load_data(args), args)
    except SystemExit as e:
        if e.code in (130, 143):  # a stop (raise_on_signals)
            print(stop_line(e, args.checkpoint, before), file=sys.stderr)
        raise


def parse_args(argv=None):
    return check_args(parser := build_parser(), parser.parse_args(argv))


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line naming the flag, not a usage block first."""
        for action in self._actions:  # a flag of two spellings is named by its first: --batch-size
            message = message.replace("/".join(action.option_strings), action.option_strings[0])
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def add(flag, help, **options):  # two words take the article's spelling too: --batch_size
        if options.get("type") in (int, positive_int):  # --help shows N, not the flag's name
            options["metavar"] = "N"
        p.add_argument(*dict.fromkeys([flag, "--" + flag[2:].replace("-", "_")]), help=help, **options)

    add("--epochs", "epochs to train (default: 1)", type=positive_int, default=1)
    add("--batch-size", "images per batch (default: 128)", type=positive_int, default=128)
    add("--lr", "Adadelta learning rate (default: 0.5)", type=positive_float, default=0.5)
    add("--seed", "random seed (default: 0)", type=int, default=0)
    add("--dataset", "data set (default: mnist)", choices=sorted(DATASETS), default="mnist")
    add("--data-dir", "data folder, DIR/MNIST/raw (default: ./data)", metavar="DIR", default="./data")
    add("--log-interval", "batches between progress lines (default: 10)", type=positive_int, default=10)
    add("--threads", "threads (default: OMP_NUM_THREADS, else the usable cores)", type=positive_int)
    add("--amp", "bfloat16 autocast (default: off)", action="store_true")
    add("--checkpoint", "save model and optimizer here each epoch (default: none)", metavar="PATH")
    add("--resume", "continue from --checkpoint if it exists (default: off)", action="store_true")
    add("--metrics-json", "write the run's figures here as JSON (default: none)", metavar="PATH")
    return p


def positive_int(text):
    return positive_float(text, int)


def positive_float(text, kind=float):
    if not (value := kind(text)) > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def getenv(name, default=None):
    """os.environ.get, but `VAR=` (empty) counts as unset."""
    return os.environ.get(name) or default


# ---- Machinery: speed and robustness (a first reading may skip it)
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


def raise_on_signals(ctrl_c):
    """Ctrl-C and SIGTERM raise SystemExit(128 + signal), as shells count; ctrl_c False: Ctrl-C ignored."""

    def stop(signum, frame):
        if not isinstance(sys.exc_info()[1], (SystemExit, KeyboardInterrupt)):  # not cutting an exit short
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop if ctrl_c else signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # where a launcher blocked them
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


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


def exit_at_once(end=0):
    """sys.exit(end), end also what ended the run, without the teardown: it pages torch in to unload it."""
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


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # a failure's line, a stop's status, a bug's traceback
        exit_at_once(e)
    exit_at_once()
