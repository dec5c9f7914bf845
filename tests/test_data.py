"""Data without a network: files placed by hand, a clear line when missing, one download per machine."""

import http.server
import os
import shutil
import subprocess
import sys
import threading

import pytest

from conftest import FILES, N_TEST, REPO, finish, free_port, read_json, run_script, script_env, write_dataset

FASHION = "/usr/share/datasets/fashion-mnist"


def test_gzipped_files_placed_by_hand_are_unpacked_and_used(tmp_path):
    write_dataset(str(tmp_path), gz=True)
    result = run_script(
        "convnet_undistributed.py",
        "--data-dir",
        tmp_path,
        "--batch-size",
        64,
        "--metrics-json",
        tmp_path / "m.json",
    )
    assert result.returncode == 0, result.stderr
    assert read_json(tmp_path / "m.json")["test_samples"] == N_TEST
    assert sorted(os.listdir(tmp_path / "MNIST" / "raw")) == sorted(list(FILES) + [f + ".gz" for f in FILES])


class CountingProxy(http.server.BaseHTTPRequestHandler):
    """An HTTP proxy that counts requests and has nothing: the internet, as seen from an offline machine."""

    requests = []

    def answer(self):
        self.requests.append(self.path)
        self.send_error(404)

    do_GET = do_HEAD = do_CONNECT = answer

    def log_message(self, *args):
        pass


@pytest.fixture
def offline_proxy():
    CountingProxy.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CountingProxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield script_env(
        http_proxy=url, https_proxy=url, HTTP_PROXY=url, HTTPS_PROXY=url, no_proxy="", NO_PROXY=""
    )
    server.shutdown()


@pytest.mark.parametrize("processes", [1, 2])
def test_missing_data_offline_is_one_clear_line_and_one_download_per_machine(
    tmp_path, offline_proxy, processes
):
    """The article had every process download into one folder at once. Here the launching process fetches
    the files before any worker starts, so 2 processes make exactly the requests that 1 makes."""
    result = run_script(
        "convnet_distributed.py",
        "--dataset",
        "fashion-mnist",
        "--data-dir",
        tmp_path,
        "--num-processes",
        processes,
        "--master-port",
        free_port(),
        env=offline_proxy,
        timeout=90,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    folder = os.path.join(str(tmp_path), "FashionMNIST", "raw")
    assert lines[0].startswith("error: fashion-mnist is not in " + folder)
    assert all(name in lines[0] for name in FILES)
    assert "epoch: " not in result.stdout  # nothing started
    # torchvision's one Fashion-MNIST mirror: a HEAD for redirects, then nothing more after the 404
    assert len(CountingProxy.requests) == 1, CountingProxy.requests


@pytest.mark.parametrize(
    "name, damage",
    [
        ("train-images-idx3-ubyte", lambda data: data[:5000]),
        ("train-labels-idx1-ubyte", lambda data: b"\0\0\x0d\x01" + data[4:]),  # an idx file of floats
    ],
    ids=["truncated", "another type"],
)
def test_damaged_data_file_is_a_clear_error(tmp_path, name, damage):
    """A truncated file, or one whose header says another type: one line naming the file. The second trained
    on garbage once the scripts read the idx files themselves, without the magic's check."""
    write_dataset(str(tmp_path))
    path = tmp_path / "MNIST" / "raw" / name
    path.write_bytes(damage(path.read_bytes()))
    result = run_script(
        "convnet_distributed.py", "--data-dir", tmp_path, "--master-port", free_port(), timeout=60
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert f"cannot read mnist from {path}" in result.stderr and "replace it" in result.stderr


def test_data_dir_that_is_a_file_is_a_usage_error(tmp_path):
    (tmp_path / "file").write_text("x")
    result = run_script("convnet_undistributed.py", "--data-dir", tmp_path / "file", timeout=60)
    assert result.returncode == 2 and "--data-dir" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(
    not os.path.isdir(FASHION),
    reason="Debian's dataset-fashion-mnist is not installed "
    "(apt-get install dataset-fashion-mnist); .ci/run installs it",
)
def test_real_fashion_mnist_one_epoch_two_processes(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for name in FILES:  # their checksums differ from torchvision's list: placed by hand, not downloaded
        shutil.copy(os.path.join(FASHION, name + ".gz"), raw)
    result = run_script(
        "convnet_distributed.py",
        "--dataset",
        "fashion-mnist",
        "--data-dir",
        tmp_path,
        "--num-processes",
        2,
        "--batch-size",
        64,
        "--log-interval",
        100,
        "--master-port",
        free_port(),
        "--metrics-json",
        tmp_path / "m.json",
        timeout=400,
    )
    assert result.returncode == 0, result.stderr
    m = read_json(tmp_path / "m.json")
    assert (m["world_size"], m["test_samples"]) == (2, 10000)
    assert "epoch: 0 [400/469 (85%)]" in result.stdout  # 469 batches of 64 per rank: 60,000 images
    assert m["test_accuracy"] > 0.84, m  # measured: 0.87 after one epoch


def test_damaged_gzip_file_is_a_clear_error_and_leaves_nothing_half_written(tmp_path):
    write_dataset(str(tmp_path), gz=True)
    raw = tmp_path / "MNIST" / "raw"
    gz = raw / "t10k-images-idx3-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:2000])
    result = run_script("convnet_undistributed.py", "--data-dir", tmp_path, timeout=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "cannot unpack" in result.stderr and str(gz) in result.stderr
    assert not (raw / "t10k-images-idx3-ubyte").exists()
    assert not [p for p in os.listdir(raw) if ".part" in p]


# Root without its capabilities (setpriv) stands for an ordinary user: file permissions bind it. (A plain user
# cannot run this Python where it lies under /root, a folder of mode 0700.)
AS_A_USER = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", sys.executable]


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_a_data_dir_this_user_may_not_make_is_one_line_on_every_machine(tmp_path):
    """An ordinary user's --data-dir /root/data, no data yet: a PermissionError traceback from prepare_data's
    os.makedirs. Now one line on each machine, in each script (the GPU script's prepare_data is the shared
    block's, called directly: its main stops first where no GPU is)."""
    theirs = tmp_path / "theirs"  # another user's folder, mode 755
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    data, port = theirs / "data", free_port()
    machine = [os.path.join(REPO, "convnet_distributed.py"), "--data-dir", data, "--num-processes", 2,
               "--num-machines", 2, "--master-port", port, "--machine-id"]  # fmt: skip
    call = f"import sys, types; sys.path.insert(0, {REPO!r}); import convnet_distributed_cuda as s; "
    call += f"s.prepare_data(types.SimpleNamespace(data_dir={str(data)!r}, dataset='mnist'))"
    commands = [
        [*machine, 0],
        [*machine, 1],
        [os.path.join(REPO, "convnet_undistributed.py"), "--data-dir", data],
    ]
    procs = [
        subprocess.Popen([*AS_A_USER, *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=script_env(), start_new_session=True)
        for argv in [*commands, ["-c", call]]
    ]  # fmt: skip
    line = f"error: cannot make {data / 'MNIST' / 'raw'}/ (Permission denied): "
    line += "give a --data-dir this user may write to"
    for result in [finish(p, 90) for p in procs]:
        assert result.returncode == 1 and result.stderr == line + "\n", result.stderr
    assert os.listdir(theirs) == []
