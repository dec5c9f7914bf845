#!/usr/bin/env python3
"""Copy the shared block of convnet_distributed.py into convnet_distributed_cuda.py, byte for byte.

The block runs from its opening banner ("# Shared block:") to its closing one ("# End of the shared block.").
Edit it in convnet_distributed.py only, then run this. With --check (CI), change nothing and exit 1 on any
difference, comments included, or where the banner's list of the names the block takes from its script is
not the list of names it reads and does not define.
    python tools/sync_shared_block.py [--check]
"""

import argparse
import ast
import builtins
import difflib
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE, COPY = "convnet_distributed.py", "convnet_distributed_cuda.py"
START, END, NEEDS = "# Shared block:", "# End of the shared block.", "It needs from its script:"


def read(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def split(text):
    """The text before the block, the block (its banners' rules included), and the text after it."""
    start = text.rindex("\n# ====", 0, text.index(START)) + 1
    end = text.index("\n", text.index("\n# ====", text.index(END)) + 1) + 1
    return text[:start], text[start:end], text[end:]


def names_needed(block, script):
    """Names the block reads but neither binds nor imports, and no builtin: its script must define them."""
    bound = set(dir(builtins))
    for node in ast.walk(ast.parse(script)):  # the script's imports serve the block too
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    tree = ast.parse(block)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    read_names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return {n for n in read_names - bound if not n.startswith("__")}  # __file__: every module has it


def banner_names(block):
    """The names the opening banner lists after NEEDS."""
    banner = " ".join(line.lstrip("# ") for line in block[: block.index("\n# ====", 1)].splitlines())
    listed = banner.partition(NEEDS)[2]
    return set(re.findall(r"\w+", listed)) - {"and"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 on a difference")
    args = parser.parse_args()
    source = read(SOURCE)
    block = split(source)[1]
    needed, listed = names_needed(block, source), banner_names(block)
    if needed != listed:
        add, drop = sorted(needed - listed), sorted(listed - needed)
        sys.exit(f"error: {SOURCE}: the shared block's banner lists the wrong names: add {add}, drop {drop}")
    before, old, after = split(read(COPY))
    if old == block:
        return
    if args.check:
        diff = list(difflib.unified_diff(old.splitlines(True), block.splitlines(True), COPY, SOURCE, n=1))
        sys.stdout.writelines(diff[:200])
        sys.exit(f"error: {COPY}: its shared block differs from {SOURCE}'s: run tools/sync_shared_block.py")
    with open(os.path.join(REPO, COPY), "w", encoding="utf-8") as f:
        f.write(before + block + after)
    print(f"copied the shared block of {SOURCE} into {COPY}")


if __name__ == "__main__":
    main()
