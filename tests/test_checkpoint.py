"""--checkpoint and --resume: rank 0 saves after each epoch, atomically; a rerun goes on where it stopped."""

import pytest
import torch

import convnet_distributed
from conftest import free_port, read_json, run_script


def train(script, data_dir, tmp_path, *args, name="m.json"):
    extra = ["--master-port", free_port()] if script != "convnet_undistributed.py" else []
    return run_script(
        script, "--data-dir", data_dir, "--batch-size", 64, "--metrics-json", tmp_path / name, *extra, *args
    )


@pytest.mark.parametrize("script,processes", [("convnet_undistributed.py", 1), ("convnet_distributed.py", 2)])
def test_resumed_run_ends_where_an_unbroken_run_ends(data_dir, tmp_path, script, processes):
    procs = ["--num-processes", processes] if processes > 1 else []
    ck = tmp_path / "ck.pt"
    unbroken = train(script, data_dir, tmp_path, "--epochs", 2, *procs, name="unbroken.json")
    assert unbroken.returncode == 0, unbroken.stderr

    first = train(
        script, data_dir, tmp_path, "--epochs", 1, "--checkpoint", ck, "--resume", *procs, name="a.json"
    )
    assert first.returncode == 0, first.stderr
    assert f"No checkpoint at {ck} yet: starting from epoch 0" in first.stdout
    state = torch.load(ck, weights_only=True)
    assert state["epoch"] == 0 and state["dataset"] == "mnist"
    assert set(state["model"]) == set(
        convnet_distributed.ConvNet().state_dict()
    )  # the unwrapped model's keys

    second = train(
        script, data_dir, tmp_path, "--epochs", 2, "--checkpoint", ck, "--resume", *procs, name="b.json"
    )
    assert second.returncode == 0, second.stderr
    assert "Resuming from" in second.stdout and "starting epoch 1" in second.stdout
    assert "epoch: 0 [" not in second.stdout and "epoch: 1 [0/" in second.stdout
    resumed, whole = read_json(tmp_path / "b.json"), read_json(tmp_path / "unbroken.json")
    assert resumed["epochs_trained"] == 1 and torch.load(ck, weights_only=True)["epoch"] == 1
    # Same data order, same dropout masks, same optimizer state: the same numbers.
    assert resumed["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-4)
    assert resumed["final_train_loss"] == pytest.approx(whole["final_train_loss"], rel=1e-4)

    again = train(
        script, data_dir, tmp_path, "--epochs", 2, "--checkpoint", ck, "--resume", *procs, name="c.json"
    )
    assert again.returncode == 0 and "Nothing to train" in again.stdout
    assert read_json(tmp_path / "c.json")["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-4)


@pytest.mark.parametrize(
    "content,processes",
    [(b"", 1), (b"not a checkpoint at all", 1), ("truncated", 1), ("foreign", 1), ("other-dataset", 2)],
)
def test_bad_checkpoint_is_a_clear_error_and_is_left_alone(data_dir, tmp_path, content, processes):
    """Rank 0 reads the file and tells every rank: with 2 processes, rank 1 stops quietly too."""
    ck = tmp_path / "ck.pt"
    if content == "truncated":
        torch.save({"format": convnet_distributed.CHECKPOINT_FORMAT, "w": torch.zeros(10000)}, ck)
        content = ck.read_bytes()[:3000]
    elif content == "foreign":
        torch.save({"weights": torch.zeros(3)}, ck)
        content = ck.read_bytes()
    elif content == "other-dataset":
        torch.save(
            {"format": convnet_distributed.CHECKPOINT_FORMAT, "dataset": "fashion-mnist", "epoch": 0}, ck
        )
        content = ck.read_bytes()
    ck.write_bytes(content)
    result = train(
        "convnet_distributed.py",
        data_dir,
        tmp_path,
        "--num-processes",
        processes,
        "--checkpoint",
        ck,
        "--resume",
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: --resume:") and str(ck) in result.stderr
    assert "epoch: " not in result.stdout
    assert ck.read_bytes() == content  # never silently replaced


def test_checkpoint_of_another_model_does_not_fit(data_dir, tmp_path):
    ck = tmp_path / "ck.pt"
    torch.save(
        {
            "format": convnet_distributed.CHECKPOINT_FORMAT,
            "dataset": "mnist",
            "epoch": 0,
            "model": {"fc.weight": torch.zeros(2)},
            "optimizer": {},
        },
        ck,
    )
    result = train("convnet_undistributed.py", data_dir, tmp_path, "--checkpoint", ck, "--resume")
    assert (
        result.returncode == 1
        and "does not fit this model" in result.stderr
        and "Traceback" not in result.stderr
    )


def test_atomic_save_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "ck.pt"
    assert convnet_distributed.write_atomically(path, lambda f: f.write(b"old")) is None

    def dies_halfway(f):
        f.write(b"half of the new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convnet_distributed.write_atomically(path, dies_halfway)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temporary file left behind


def test_unwritable_checkpoint_folder_is_found_before_training(data_dir, tmp_path):
    result = train(
        "convnet_undistributed.py", data_dir, tmp_path, "--checkpoint", tmp_path / "no" / "such" / "ck.pt"
    )
    assert result.returncode == 2 and "--checkpoint" in result.stderr and "epoch: " not in result.stdout


@pytest.mark.parametrize("script,processes", [("convnet_undistributed.py", 1), ("convnet_distributed.py", 2)])
def test_a_resumed_run_takes_the_learning_rate_of_its_command_line(data_dir, tmp_path, script, processes):
    """The optimizer's state restored the checkpoint's learning rate: `--resume --lr 0.1` trained on at 0.5,
    while the checkpoint's args said 0.1."""
    procs = ["--num-processes", processes] if processes > 1 else []
    ck = tmp_path / "ck.pt"
    first = train(script, data_dir, tmp_path, "--epochs", 1, "--checkpoint", ck, *procs)
    assert first.returncode == 0, first.stderr
    resumed = train(
        script, data_dir, tmp_path, "--epochs", 2, "--checkpoint", ck, "--resume", "--lr", 0.1, *procs
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("Learning rate 0.1 from --lr (the checkpoint had 0.5)\n") == 1, resumed.stdout
    state = torch.load(ck, weights_only=True)
    assert state["epoch"] == 1 and state["args"]["lr"] == 0.1
    assert [group["lr"] for group in state["optimizer"]["param_groups"]] == [0.1]


@pytest.mark.parametrize("script", ["convnet_undistributed.py", "convnet_distributed.py"])
def test_nothing_to_train_names_the_epochs_the_checkpoint_holds(data_dir, tmp_path, script):
    """It named --epochs: a checkpoint of 2 epochs resumed with --epochs 1 "already holds 1 epoch(s)"."""
    ck = tmp_path / "ck.pt"
    first = train(script, data_dir, tmp_path, "--epochs", 2, "--checkpoint", ck)
    assert first.returncode == 0, first.stderr
    again = train(script, data_dir, tmp_path, "--epochs", 1, "--checkpoint", ck, "--resume")
    assert again.returncode == 0, again.stderr
    assert "Nothing to train: the checkpoint already holds 2 epoch(s)\n" in again.stdout, again.stdout
