"""Helpers the benchmark scripts share: one spelling of each."""

import argparse
import json
import os
import socket

# Variables that would change what the scripts do: the benchmark measures their defaults.
SCRUBBED_ENV = ("OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


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
