"""A CPU quota (Docker's --cpus, a Kubernetes CPU limit) caps the default threads: the process still sees
every core of the host, and took a thread per core, each waiting for the quota's time."""

import os
import time
import uuid

import pytest

import convnet_distributed
import convnet_distributed_cuda
import convnet_undistributed
from conftest import read_json, run_script

MODULES = [convnet_undistributed, convnet_distributed, convnet_distributed_cuda]


@pytest.fixture
def cgroup_cpus(monkeypatch, tmp_path):
    """A module's cgroup_cpus(), its open() reading a test's file tree at the absolute paths it asks for."""

    def read(module, files):
        root = tmp_path / uuid.uuid4().hex
        for path, text in files.items():
            (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (root / path.lstrip("/")).write_text(text)
        monkeypatch.setattr(
            module, "open", lambda path, *a, **k: open(root / path.lstrip("/"), *a, **k), False
        )
        return module.cgroup_cpus()

    return read


@pytest.mark.parametrize("module", MODULES)
def test_cgroup_v2_quota_is_the_tightest_of_the_cgroup_and_those_above_rounded_up(cgroup_cpus, module):
    files = {"/proc/self/cgroup": "0::/kubepods/pod1/c1\n", "/sys/fs/cgroup/cpu.max": "max 100000\n"}
    files["/sys/fs/cgroup/kubepods/cpu.max"] = "400000 100000\n"
    files["/sys/fs/cgroup/kubepods/pod1/c1/cpu.max"] = "150000 100000\n"  # 1.5 cores: 2
    assert cgroup_cpus(module, files) == 2
    files["/sys/fs/cgroup/kubepods/pod1/cpu.max"] = "100000 100000\n"  # the pod's limit, tighter still
    assert cgroup_cpus(module, files) == 1


@pytest.mark.parametrize("module", MODULES)
def test_cgroup_v1_quota_and_a_container_that_sees_its_own_cgroup_as_the_root(cgroup_cpus, module):
    """Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names /docker/<id>, while the
    container's /sys/fs/cgroup/cpu is that cgroup itself. Another hierarchy's folder is not read as cpu's."""
    files = {"/proc/self/cgroup": "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n"}
    files["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"], files["/sys/fs/cgroup/cpu/cpu.cfs_period_us"] = (
        "50000\n",
        "100000\n",
    )
    files["/sys/fs/cgroup/docker/abc/cpu.max"] = "max 100000\n"  # a hybrid layout's v2 side: no quota
    assert cgroup_cpus(module, files) == 1
    files["/sys/fs/cgroup/cpu/docker/abc/cpu.max"] = "1 100000\n"  # v2's file in v1's folder: not read
    assert cgroup_cpus(module, files) == 1


@pytest.mark.parametrize("module", MODULES)
def test_no_quota_or_no_cgroups_is_none(cgroup_cpus, module):
    v1 = {"/proc/self/cgroup": "1:cpu:/\n", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n"}
    v1["/sys/fs/cgroup/cpu/cpu.cfs_period_us"] = "100000\n"
    assert cgroup_cpus(module, v1) is None
    assert (
        cgroup_cpus(module, {"/proc/self/cgroup": "0::/a\n", "/sys/fs/cgroup/a/cpu.max": "max 100000\n"})
        is None
    )
    assert cgroup_cpus(module, {}) is None  # no /proc/self/cgroup: not Linux


@pytest.mark.parametrize("module", MODULES)
def test_the_smallest_cap_decides_and_is_named_and_a_count_given_wins(clean_env, monkeypatch, module):
    """Of the affinity mask (8 cores here), the cgroup's quota and SLURM_CPUS_PER_TASK, the smallest decides,
    and the layout line names it; --threads and OMP_NUM_THREADS win. Distributed scripts: 2 processes."""
    processes = {
        convnet_distributed: ["--num-processes", "2"],
        convnet_distributed_cuda: ["--num-gpu-processes", "2"],
    }
    processes = processes.get(module, [])

    def cores(quota, *argv):  # the cores the threads of this machine's processes take, and what capped them
        monkeypatch.setattr(module, "cgroup_cpus", lambda: quota)
        args = module.parse_args([*processes, *argv])
        return args.threads * max(1, len(processes)), args.threads_from

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cores(None) == cores(8) == cores(9) == (8, "")
    assert cores(4) == (4, "the cgroup's CPU quota")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    assert cores(None) == (6, "SLURM_CPUS_PER_TASK") and cores(4) == (4, "the cgroup's CPU quota")
    assert cores(4, "--threads", "3") == (3 * max(1, len(processes)), "")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cores(4) == (5 * max(1, len(processes)), "")


def cgroup_of_one_cpu():
    """A cgroup whose quota is 1 CPU, v1's (the cpu hierarchy) or v2's; returns its folder."""
    name, v1 = f"convnet-test-{uuid.uuid4().hex[:12]}", "/sys/fs/cgroup/cpu"
    if os.path.isfile(f"{v1}/cpu.cfs_quota_us"):
        folder = f"{v1}/{name}"
        os.mkdir(folder)
        with open(f"{folder}/cpu.cfs_period_us") as f, open(f"{folder}/cpu.cfs_quota_us", "w") as quota:
            quota.write(f.read().strip())
        return folder
    with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
        f.write("+cpu")  # cgroup v2: the cpu controller for the cgroups below the root
    os.mkdir(f"/sys/fs/cgroup/{name}")
    with open(f"/sys/fs/cgroup/{name}/cpu.max", "w") as f:
        f.write("100000 100000")
    return f"/sys/fs/cgroup/{name}"


@pytest.fixture
def one_cpu():
    """The cgroup.procs file of a new cgroup allowed 1 CPU; removed after, with anything left in it."""
    try:
        folder = cgroup_of_one_cpu()
    except OSError as e:
        pytest.skip(f"cannot make a cgroup with a CPU quota (needs root, and cgroup v1's cpu or v2's): {e}")
    yield f"{folder}/cgroup.procs"
    with open(f"{folder}/cgroup.procs") as f:
        for pid in f.read().split():
            os.kill(int(pid), 9)
    for tries in reversed(range(50)):
        try:
            os.rmdir(folder)
            break
        except OSError:  # a killed process leaves its cgroup as it exits
            if not tries:
                raise
            time.sleep(0.1)


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("script", ["convnet_undistributed.py", "convnet_distributed.py"])
def test_a_quota_of_one_cpu_gives_one_thread_per_process_unless_told(
    one_cpu, data_dir, tmp_path, script, threads
):
    """In a cgroup allowing 1 CPU, on a host of any size: the baseline, and each of 2 processes, take 1
    thread, and the layout line says why; --threads 2 is taken as given."""
    processes = ["--num-processes", 2, "--batch-size", 64] if script == "convnet_distributed.py" else []
    given = ["--threads", threads] if threads else []
    metrics = tmp_path / "m.json"
    argv = [*processes, *given, "--epochs", 1, "--data-dir", data_dir, "--metrics-json", metrics]
    result = run_script(script, *argv, "--log-interval", 1000, cgroup=one_cpu, timeout=240)
    assert result.returncode == 0, result.stderr
    layout = next(line for line in result.stdout.splitlines() if line.startswith("World size "))
    each = " per process" if processes else ""
    if threads is None:
        assert read_json(metrics)["threads"] == 1
        assert f"; 1 thread{each}, from the cgroup's CPU quota; " in layout, layout
    else:
        assert read_json(metrics)["threads"] == 2
        assert f"; 2 threads{each}; " in layout, layout
