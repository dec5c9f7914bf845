"""The three scripts hold one model and one data path: the copies must not drift apart."""

import ast
import copy
import difflib
import inspect
import textwrap
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms

import convnet_distributed
import convnet_distributed_cuda
import convnet_undistributed

MODULES = [convnet_undistributed, convnet_distributed, convnet_distributed_cuda]
# Shared logic copied into each script on purpose (each runs alone): the copies' code must stay the same.
# Their docstrings and comments may differ: each file's prose speaks of its own code.
SAME_IN_ALL = [
    "ConvNet",
    "keep_pool_gradient_channels_last",
    "raw_folder",
    "prepare_data",
    "load_data",
    "to_input",
    "read_checkpoint",
    "Parser",
    "positive_int",
    "positive_float",
    "keep_freed_memory",
    "release_freed_memory",
    "peak_memory_mib",
    "exit_at_once",
    "check_args",
    "cgroup_cpus",
    "getenv",
    "plural",
    "raise_on_signals",
    "write_atomically",
    "file_version",
    "stop_line",
]
# The story functions the two distributed scripts share; their machinery is one block, compared whole below.
SAME_IN_DISTRIBUTED = [
    "train_epoch",
    "evaluate",
    "worker",
    "try_the_group",
    "print0",
    "save_checkpoint",
    "resume",
    "report",
    "parse_args",
]


def code(source):
    """What the source does, as the AST's dump: its comments, docstrings and layout left out."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@pytest.mark.parametrize("name", SAME_IN_ALL)
def test_shared_code_is_the_same_in_all_three_scripts(name):
    codes = {m.__name__: code(inspect.getsource(getattr(m, name))) for m in MODULES}
    assert len(set(codes.values())) == 1, f"{name} differs between {sorted(codes)}"


def shared_block(module):
    """The machinery both distributed scripts share, from its opening banner to its closing one."""
    text = inspect.getsource(module)
    return text[text.index("# Shared block:") : text.index("# End of the shared block.")]


def test_the_shared_block_is_the_same_in_both_distributed_scripts():
    """Byte for byte, comments included: tools/sync_shared_block.py copies it (CI runs its --check)."""
    cpu, gpu = (shared_block(m) for m in (convnet_distributed, convnet_distributed_cuda))
    diff = "".join(difflib.unified_diff(cpu.splitlines(True), gpu.splitlines(True), "cpu", "gpu", n=1))
    assert cpu == gpu, f"the shared blocks differ: run python tools/sync_shared_block.py\n{diff[:3000]}"
    assert (
        shared_block(convnet_distributed).count("\ndef ") > 40
    )  # the launchers, rendezvous, files, signals...


def test_code_not_prose_is_compared():
    """A comment or docstring may differ between copies; a changed statement may not."""
    assert code('def f():\n    """Gloo."""\n    return 1  # why\n') == code(
        'def f():\n    """NCCL."""\n    return 1\n'
    )
    assert code("def f():\n    return 1\n") != code("def f():\n    return 2\n")


def test_each_file_speaks_of_its_own_code():
    """The baseline has no process group; the GPU script's group is NCCL's, whose threads are not Gloo's."""
    baseline = inspect.getsource(convnet_undistributed)
    for word in ("Gloo", "NCCL", "leave_group", "MASTER_PORT", "process group"):
        assert word.lower() not in baseline.lower(), word
    assert "Gloo's threads" not in inspect.getsource(convnet_distributed_cuda)


@pytest.mark.parametrize("module", [convnet_distributed, convnet_distributed_cuda])
def test_the_story_shows_ddp_on_at_most_330_lines(module):
    """A learner reads the story above the machinery banner in one sitting, and sees DDP's pieces there."""
    source = inspect.getsource(module)
    story = source[: source.index("\n# ====")]
    assert story.count("\n") + 1 <= 330
    for piece in (
        "TCPStore(",
        "init_process_group(",
        "DistributedSampler(",
        "DistributedDataParallel(",
        "destroy_process_group(",
    ):
        assert piece in story, piece


def test_each_backends_own_code_stays_outside_the_shared_block():
    """The CPU script has no NCCL branch, the GPU script no Gloo-only code: each backend's code is its own."""
    block = shared_block(convnet_distributed)
    for own in (
        "init_process_group(",
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
        "SharedMemoryAverager(",
        "set_device(",
    ):
        assert own not in block, own
    assert convnet_distributed.BACKEND == "Gloo" and convnet_distributed_cuda.BACKEND == "NCCL"
    assert "nccl" not in inspect.getsource(convnet_distributed.time_a_step).lower()


@pytest.mark.parametrize("name", SAME_IN_DISTRIBUTED)
def test_shared_code_is_the_same_in_both_distributed_scripts(name):
    cpu, gpu = (
        code(inspect.getsource(getattr(m, name))) for m in (convnet_distributed, convnet_distributed_cuda)
    )
    assert cpu == gpu, f"{name} differs"


def test_constants_are_the_same():
    for m in MODULES:
        assert m.DATASETS == convnet_undistributed.DATASETS
        assert m.FILES == convnet_undistributed.FILES
        assert m.CHECKPOINT_FORMAT == convnet_undistributed.CHECKPOINT_FORMAT
    assert convnet_undistributed.TEST_BATCH_SIZE == convnet_distributed.TEST_BATCH_SIZE  # the CPU scripts'
    assert convnet_distributed.LAUNCHERS == convnet_distributed_cuda.LAUNCHERS
    assert convnet_distributed.JOB_FLAGS == convnet_distributed_cuda.JOB_FLAGS


def test_the_three_convnets_compute_the_same_function():
    models = [m.ConvNet() for m in MODULES]
    state = models[0].state_dict()
    for model in models:
        assert [(k, v.shape) for k, v in model.state_dict().items()] == [
            (k, v.shape) for k, v in state.items()
        ]
        model.load_state_dict(state)
        model.eval()
    x = torch.randn(5, 1, 28, 28)
    outputs = [model(x) for model in models]
    assert outputs[0].shape == (5, 10)
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], rtol=0, atol=0)
    assert sum(p.numel() for p in models[0].parameters()) == 160 + 4640 + 4608 * 64 + 64 + 650


def test_convnet_layers_are_the_spec_and_dropout_is_element_wise():
    """The article's distributed model used Dropout2d on a flattened tensor: a warning and another model."""
    model = convnet_distributed.ConvNet()
    kinds = [type(m).__name__ for m in model.children()]
    assert kinds == ["Conv2d", "Conv2d", "Dropout", "Dropout", "Linear", "Linear"]
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)] == [0.10, 0.25]
    assert not any(isinstance(m, torch.nn.Dropout2d) for m in model.modules())
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(torch.randn(4, 1, 28, 28))
    assert torch.allclose(out.exp().sum(1), torch.ones(4), atol=1e-5)  # log-probabilities


def test_channels_last_model_takes_the_same_step_as_a_plain_one():
    """The scripts hand max-pool its gradient in channels-last order (a speed fix): the gradients stay the
    same as those of the model held in the default layout."""
    torch.manual_seed(0)  # unseeded, a rare draw put a gradient past atol (float32 sums in another order)
    plain = convnet_distributed.ConvNet()
    fast = copy.deepcopy(plain).to(memory_format=torch.channels_last)
    convnet_distributed.keep_pool_gradient_channels_last(fast)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    for model in (plain, fast):
        model.eval()  # no dropout: its masks fall differently on the two layouts; the hook acts all the same
        torch.nn.functional.nll_loss(model(x), y).backward()
    for p, q in zip(plain.parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)
    assert fast.conv2.weight.grad.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dataset", ["mnist", "fashion-mnist"])
def test_batch_normalisation_equals_torchvision_transforms_exactly(dataset):
    """The scripts normalise whole uint8 batches: the same bits as ToTensor() then Normalize() per image."""
    _, mean, std = convnet_distributed.DATASETS[dataset]
    images = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (16, 28, 28), dtype=np.uint8))
    pipeline = transforms.Compose([transforms.ToTensor(), transforms.Normalize((mean,), (std,))])
    expected = torch.stack([pipeline(Image.fromarray(img.numpy(), mode="L")) for img in images])
    got = convnet_distributed.to_input(images, dataset)
    assert got.dtype == torch.float32 and got.shape == (16, 1, 28, 28)
    assert torch.equal(got, expected)


def test_fashion_mnist_statistics_are_its_own():
    _, mnist_mean, mnist_std = convnet_distributed.DATASETS["mnist"]
    _, mean, std = convnet_distributed.DATASETS["fashion-mnist"]
    assert (mnist_mean, mnist_std) == (0.1302, 0.3069)
    assert (mean, std) == (0.2860, 0.3530)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_no_function_changes_args_after_parse_args(module):
    """args stays what the command typed, its layout filled in by parse_args:
    the job as decided later (the port taken, the roll call's machines, rank 0's files) is a record apart."""
    changed = []
    for function in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(function, ast.FunctionDef) or function.name in ("parse_args", "check_args"):
            continue
        for node in ast.walk(function):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            stores = [
                t for target in targets if target for t in ast.walk(target) if isinstance(t, ast.Attribute)
            ]
            if any(isinstance(t.value, ast.Name) and t.value.id == "args" for t in stores):
                changed.append(f"{function.name}, line {node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                if getattr(node.args[0], "id", None) == "args":
                    changed.append(f"{function.name}, line {node.lineno}")
    assert not changed, changed
