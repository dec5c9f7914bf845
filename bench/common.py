"""Helpers the benchmark scripts share: one spelling of each."""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import socket
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Variables that would change what the scripts do: the benchmark measures their defaults.
SCRUBBED_ENV = (
    "OMP_NUM_THREADS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)


def free_port():
    """A port free now: a fixed one would collide with a run still closing, or with another user."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_env():
    """This environment without SCRUBBED_ENV, output unbuffered: what a script is launched with."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def positive_int(text):
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def write_json(path, obj):
    """Write obj to path as indented JSON; a reader never sees a half-written file."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def machine_facts(dataset, **extra):
    """What a result was measured on and with, for its report; extra: a benchmark's own facts."""
    return {
        "cpu": cpu_model(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "torchvision": package_version("torchvision"),
        "commit": git_commit(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "dataset": dataset,
        **extra,
    }


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def package_version(name):
    # From the installed metadata: importing torch here would add its memory and threads to the benchmark.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_commit():
    """The commit the scripts were measured at, marked where the working tree differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + (" (modified)" if dirty else "")) or "unknown"
