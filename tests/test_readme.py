"""The README's commands are the ones that work: every script command parses, and CI runs its test command."""

import os
import re
import shlex

import pytest

import convnet_distributed
import convnet_distributed_cuda
import convnet_undistributed
from conftest import REPO

MODULES = {m.__name__ + ".py": m for m in (convnet_undistributed, convnet_distributed, convnet_distributed_cuda)}


def readme():
    with open(os.path.join(REPO, "README.md")) as f:
        return f.read()


def commands():
    """Every `python convnet_*.py ...` command in the README and in the scripts' docstrings."""
    texts = [readme()] + [m.__doc__ for m in MODULES.values()]
    found = []
    for text in texts:
        for line in text.splitlines():
            match = re.search(r"(?:python|torchrun [^c]*) (convnet_\w+\.py)(.*)", line)
            if match:  # SLURM's per-task variables as one task of 2 nodes would read them
                flags = match[2].split("#")[0].replace("'", "").replace("$SLURM_NNODES", "2")
                found.append((match[1], flags.replace("$SLURM_NODEID", "1").strip()))
    return found


def test_readme_and_docstrings_have_the_launch_commands():
    scripts = {script for script, _ in commands()}
    assert scripts == set(MODULES)
    assert len(commands()) > 20


@pytest.mark.parametrize("script,flags", commands())
def test_every_documented_command_parses(script, flags, clean_env, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    MODULES[script].parse_args(shlex.split(flags))


def test_ci_runs_exactly_the_readme_test_command():
    test_command = next(line.strip() for line in readme().splitlines() if "pytest" in line and "pip install" in line)
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = [line.strip() for line in f]
    assert test_command in ci


def test_several_machines_section_runs_what_the_namespace_tests_run():
    """The README's two-machine commands use the flags tests/test_multihost.py launches with, and no others."""
    section = readme().split("## Running on several machines")[1].split("\n## ")[0]
    with open(os.path.join(REPO, "tests", "test_multihost.py")) as f:
        tested = set(re.findall(r'"(--[a-z-]+)"', f.read()))
    for line in section.splitlines():
        if ("convnet_distributed.py" in line and "--nnodes" in line) or "--num-machines 2" in line:
            used = set(re.findall(r"(--[a-z-]+)", line)) - {"--epochs", "--checkpoint", "--resume", "--max-restarts"}
            assert used <= tested, (line, used - tested)
