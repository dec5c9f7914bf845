"""Run one command as a user would, bounded in time, and record the peak memory of its processes.

Memory is the largest resident set size (RSS) that any process of the launched tree reached over its
whole life, as the kernel counts it (wait4(2), what `/usr/bin/time -v` reports): exact, exit included.
RSS counts the shared pages a process has touched, so the forked ranks of one launch, which share the
launcher's copy of the data set, each count it.
"""

import os
import resource
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

import psutil

POLL_SECONDS = 0.05
TAIL_LINES = 25


@dataclass
class RunResult:
    argv: list
    returncode: int  # None where the run was killed for overrunning its timeout
    wall_seconds: float
    peak_rss: int  # bytes: the largest of the launcher and every process below it, over their whole lives
    stdout_tail: str
    stderr_tail: str
    other_cpu: float  # cores, on average, that programs other than this run and its monitor kept busy


def busy_cpu_seconds():
    """CPU time all processes of the machine have used: all but idle (guest time is already in user)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0) - getattr(t, "guest", 0) - getattr(t, "guest_nice", 0)


def own_cpu_seconds():
    """CPU time of this process and its finished children (the launcher waits for its ranks: theirs count)."""
    return sum(
        resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )


def tail(f):
    f.seek(0)
    lines = f.read().decode(errors="replace").splitlines()
    return "\n".join(lines[-TAIL_LINES:])


def run_monitored(argv, timeout, cwd=None, env=None):
    """Run argv to the end (or kill its whole process group after timeout seconds); its peak memory."""
    # Output goes to files, not pipes: nobody reads a pipe while we wait, and a full pipe would block the run.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # CPU used by others during the run tells whether the machine was quiet enough to trust the timing.
        start, busy_before, own_before = time.monotonic(), busy_cpu_seconds(), own_cpu_seconds()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=cwd, env=env, start_new_session=True)
        returncode, peak = None, 0
        try:
            while time.monotonic() - start < timeout:
                # The launcher waited for its ranks, so its usage counts theirs:
                # ru_maxrss is the tree's largest.
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    returncode = proc.returncode = os.waitstatus_to_exitcode(status)
                    peak = usage.ru_maxrss * 1024  # Linux counts KiB
                    break
                time.sleep(POLL_SECONDS)
        finally:
            if returncode is None:  # overran, or we were interrupted: leave no rank behind
                kill_group(proc)
        wall = time.monotonic() - start
        other = (busy_cpu_seconds() - busy_before) - (own_cpu_seconds() - own_before)
        return RunResult(argv, returncode, wall, peak, tail(out), tail(err), max(0.0, other / wall))


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks share the launcher's new session and group
    except ProcessLookupError:
        pass
    proc.wait()
