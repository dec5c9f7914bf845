"""Run one command as a user would, bounded in time, and record the peak memory of its processes.

Memory is the resident set size (RSS) of each process of the launched tree, sampled every
SAMPLE_SECONDS with psutil: a peak shorter than that can be missed. RSS counts the shared pages
a process has touched, so the ranks of one launch, which share one copy of the data set, each
count it.
"""
import os
import resource
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import psutil

SAMPLE_SECONDS = 0.1
TAIL_LINES = 25


@dataclass
class RunResult:
    argv: list
    returncode: int  # None where the run was killed for overrunning its timeout
    wall_seconds: float
    launcher_peak_rss: int  # bytes
    rank_peak_rss: list  # bytes, one per rank; [launcher's] where the launcher trains itself
    stdout_tail: str
    stderr_tail: str
    other_cpu: float  # cores, on average, that programs other than this run and its monitor kept busy


def busy_cpu_seconds():
    """CPU time all processes of the machine have used: everything but idle (guest time is already in user)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0) - getattr(t, "guest", 0) - getattr(t, "guest_nice", 0)


def own_cpu_seconds():
    """CPU time of this process and of its finished children, theirs included (the launcher waits for its ranks)."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


@dataclass
class TreeMonitor:
    """Peak RSS of a process and of every process below it, sampled by calling sample()."""
    root: psutil.Process
    root_peak: int = 0
    rank_peaks: dict = field(default_factory=dict)  # pid: peak bytes, for the ranks mp.spawn started

    def sample(self):
        self.root_peak = max(self.root_peak, rss(self.root))
        try:
            children = self.root.children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            # Checked at every sample, not once: just after fork a child still shows the parent's command line.
            if child.pid in self.rank_peaks or is_rank(child):
                self.rank_peaks[child.pid] = max(self.rank_peaks.get(child.pid, 0), rss(child))

    def ranks(self):
        """Peak RSS per rank. No spawned ranks: the launcher itself trained (one process)."""
        return list(self.rank_peaks.values()) or [self.root_peak]


def rss(proc):
    try:
        return proc.memory_info().rss
    except psutil.Error:  # it has just exited
        return 0


def is_rank(proc):
    """A worker that multiprocessing's spawn started, not its resource tracker or another helper."""
    try:
        return "spawn_main" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def tail(f):
    f.seek(0)
    lines = f.read().decode(errors="replace").splitlines()
    return "\n".join(lines[-TAIL_LINES:])


def run_monitored(argv, timeout, cwd=None, env=None):
    """Run argv to the end (or kill its whole process group after timeout seconds) while sampling memory."""
    # Output goes to files, not pipes: nobody reads a pipe while we sample, and a full pipe would block the run.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # CPU used by others during the run tells whether the machine was quiet enough to trust the timing.
        start, busy_before, own_before = time.monotonic(), busy_cpu_seconds(), own_cpu_seconds()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=cwd, env=env, start_new_session=True)
        monitor = TreeMonitor(psutil.Process(proc.pid))
        returncode = None
        try:
            while time.monotonic() - start < timeout:
                monitor.sample()
                try:
                    returncode = proc.wait(timeout=SAMPLE_SECONDS)  # returns as soon as it exits
                    break
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if returncode is None:  # overran, or we were interrupted: leave no rank behind
                kill_group(proc)
        wall = time.monotonic() - start
        other = (busy_cpu_seconds() - busy_before) - (own_cpu_seconds() - own_before)
        return RunResult(argv, returncode, wall, monitor.root_peak, monitor.ranks(), tail(out), tail(err),
                         max(0.0, other / wall))


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks share the launcher's new session and group
    except ProcessLookupError:
        pass
    proc.wait()
