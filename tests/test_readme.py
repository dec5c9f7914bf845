"""The documented commands work: every script command in README.md, docs/ and bench/README.md parses, CI
runs the README's test command, the README stays short and every relative link leads somewhere."""

import glob
import os
import re
import shlex

import pytest

import convnet_distributed
import convnet_distributed_cuda
import convnet_undistributed
from conftest import REPO

MODULES = {
    m.__name__ + ".py": m for m in (convnet_undistributed, convnet_distributed, convnet_distributed_cuda)
}
README_MAX_LINES = 160


def read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def readme():
    return read("README.md")


def pages():
    """Every page that shows commands or links: README.md, docs/*.md, bench/README.md (relative to REPO)."""
    docs = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
    return ["README.md", *docs, os.path.join("bench", "README.md")]


def section(text, heading):
    """The text under `heading` (a whole line, "## ..."), up to the next heading of its level or higher."""
    level = heading.split(" ")[0]
    parts = re.split(rf"^{re.escape(heading)}$", text, flags=re.M)
    assert len(parts) == 2, f"one {heading!r} expected"
    return re.split(rf"^#{{1,{len(level)}}} ", parts[1], flags=re.M)[0]


def commands():
    """Every `python convnet_*.py ...` command in the pages and in the scripts' docstrings."""
    texts = [read(page) for page in pages()] + [m.__doc__ for m in MODULES.values()]
    found = []
    for text in texts:
        for line in text.splitlines():
            match = re.search(r"(?:python|torchrun [^c]*) (convnet_\w+\.py)(.*)", line)
            if match:  # SLURM's per-task variables as one task of 2 nodes would read them
                flags = match[2].split("#")[0].replace("'", "").replace("$SLURM_NNODES", "2")
                found.append((match[1], flags.replace("$SLURM_NODEID", "1").strip()))
    return found


def test_pages_and_docstrings_have_the_launch_commands():
    scripts = {script for script, _ in commands()}
    assert scripts == set(MODULES)
    assert len(commands()) > 20


@pytest.mark.parametrize("script,flags", commands())
def test_every_documented_command_parses(script, flags, clean_env, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    MODULES[script].parse_args(shlex.split(flags))


def test_ci_runs_exactly_the_readme_test_command():
    test_command = next(
        line.strip() for line in readme().splitlines() if "pytest" in line and "pip install" in line
    )
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = [line.strip() for line in f]
    assert test_command in ci


def test_several_machines_section_runs_what_the_namespace_tests_run():
    """The two-machine commands (the README's section and docs/launching.md but its GPU section, whose script
    tests/test_multihost.py does not launch) use only the flags tests/test_multihost.py launches with."""
    launching = read(os.path.join("docs", "launching.md"))
    sections = [section(readme(), "## Two machines"), launching.replace(section(launching, "## GPUs"), "")]
    with open(os.path.join(REPO, "tests", "test_multihost.py")) as f:
        tested = set(re.findall(r'"(--[a-z-]+)"', f.read()))
    checked = 0
    for line in "\n".join(sections).splitlines():
        if ("convnet_distributed.py" in line and "--nnodes" in line) or "--num-machines 2" in line:
            used = set(re.findall(r"(--[a-z-]+)", line)) - {
                "--epochs",
                "--checkpoint",
                "--resume",
                "--max-restarts",
            }
            assert used <= tested, (line, used - tested)
            checked += 1
    assert checked >= 6  # the README's --check and real run, its two torchrun lines, restarts, elastic, SLURM


def test_readme_is_short():
    lines = readme().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move details to docs/"


def slug(heading):
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    found, in_fence = set(), False
    for line in read(path).splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        heading = re.match(r"#{1,6} (.*)", line)
        if heading and not in_fence:
            base = slug(heading[1])
            name, n = base, 0
            while name in found:  # GitHub numbers repeated headings: name, name-1, name-2...
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def links():
    """(page, target) for every relative link or image in README.md and docs/*.md, code spans left out."""
    found = []
    for page in pages()[:-1]:
        text = re.sub(r"`[^`\n]*`", "", read(page))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+:", target):
                found.append((page, target))
    return found


def test_pages_have_links():
    assert {page for page, _ in links()} == set(pages()[:-1])


@pytest.mark.parametrize("page,target", links())
def test_every_relative_link_leads_somewhere(page, target):
    path, _, anchor = target.partition("#")
    path = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    assert os.path.exists(os.path.join(REPO, path)), f"{page}: {target}: no {path}"
    if anchor and path.endswith(".md"):
        assert anchor in anchors(path), f"{page}: {target}: no heading #{anchor} in {path}"
