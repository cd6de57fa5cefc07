"""The examples run as their docstrings say, with shrunk settings (key=value overrides).

All three start at once (most of their time is importing torch) from one module fixture; the
tests then check what each wrote. Dataset choices are also tested in-process, without a group.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils.data import TensorDataset

from ddpkit.errors import DataError
from ddpkit.models.builtin import MnistCNN

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TIMEOUT = 150


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_image_tree(
    root: Path, classes: dict[str, tuple[int, int, int]], *, train: int = 6, val: int = 2, size: int = 16
) -> None:
    """root/{train,val}/<class>/<i>.png: solid-colour images with a little noise, one colour per class."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, count in (("train", train), ("val", val)):
        for name, rgb in classes.items():
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = (torch.tensor(rgb).view(1, 1, 3) + torch.randint(-20, 20, (size, size, 3), generator=g)).clamp(
                    0, 255
                )
                Image.fromarray(pixels.to(torch.uint8).numpy()).save(root / split / name / f"{i}.png")


def write_idx(path: Path, data: torch.Tensor) -> None:
    """An MNIST idx file: magic (unsigned bytes, ndim), the dimensions, then the raw bytes."""
    header = struct.pack(">HBB", 0, 0x08, data.dim()) + struct.pack(f">{data.dim()}I", *data.shape)
    path.write_bytes(header + data.to(torch.uint8).numpy().tobytes())


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
    """Start the three examples together; return {name: (returncode, output, output_dir)}."""
    tmp = tmp_path_factory.mktemp("examples")
    make_image_tree(tmp / "images", {"red": (220, 30, 30), "blue": (30, 30, 220)})
    quiet = ["log.progress_bar=false", "checkpoint.keep_last=1"]
    commands = {
        # The docstring's command: torchrun --nproc-per-node=2 examples/horovod_mnist.py
        "horovod_mnist": [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(EXAMPLES / "horovod_mnist.py"),
            "data.kwargs.num_train=512",
            "data.kwargs.num_val=100",
            "train.epochs=2",
            "train.log_every=2",
            *quiet,
        ],
        "resnet_imagefolder": [
            str(EXAMPLES / "resnet_imagefolder.py"),
            f"data.kwargs.root={tmp / 'images'}",
            "data.kwargs.image_size=16",
            "data.batch_size=4",
            "train.epochs=2",
            "train.log_every=1",
            *quiet,
        ],
        "custom_loop_hooks": [
            str(EXAMPLES / "custom_loop_hooks.py"),
            "--target-accuracy",
            "0.0",
            "model.name=mlp",
            "data.kwargs.num_train=256",
            "data.kwargs.num_val=50",
            "data.batch_size=32",
            "train.epochs=3",
            *quiet,
        ],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("MNIST_ROOT", None)
    procs = {}
    for name, args in commands.items():
        out = tmp / name
        procs[name] = (
            subprocess.Popen(
                [sys.executable, *args, f"run.output_dir={out}"],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
            out,
        )
    results = {}
    try:
        for name, (proc, out) in procs.items():
            results[name] = (proc.communicate(timeout=TIMEOUT)[0], out)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, (output, _) in results.items():
        assert procs[name][0].returncode == 0, f"{name} failed:\n{output}"
    return results


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_horovod_mnist_scales_the_learning_rate_and_checkpoints_on_rank_zero(example_runs):
    """The example as its docstring tells users to run it: `torchrun --nproc-per-node=2 examples/horovod_mnist.py`. In
    the slow set: its module fixture starts the three examples as processes that each import torch and train, and the
    fast set keeps test_horovod_mnist_reads_mnist_from_a_local_root for the example's datasets."""
    output, run_dir = example_runs["horovod_mnist"]
    assert "using the embedded digits dataset" in output
    assert "world_size=2" in output
    assert {r["lr"] for r in records(run_dir) if "lr" in r} == {0.01 * 2}  # Horovod's lr * hvd.size()
    # 512 / (64 x 2) x 2 epochs
    assert [p.name for p in (run_dir / "checkpoints").glob("*.pt")] == ["step-000000008.pt"]
    MnistCNN().load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resnet_imagefolder_builds_one_output_per_class_folder(example_runs):
    """The example as its docstring's world-of-one command runs it, `python examples/resnet_imagefolder.py`, on an image
    folder written here. In the slow set: its module fixture starts the three examples as processes that each import
    torch and train, and the fast set keeps test_resnet_demo_tree_has_train_and_val_class_folders for the example's demo
    images."""
    output, run_dir = example_runs["resnet_imagefolder"]
    assert "2 classes (blue, red), 12 training images, 4 validation images" in output
    weights = torch.load(run_dir / "model.pt", weights_only=True)
    assert weights["fc.weight"].shape == (2, 512)
    assert [r["step"] for r in records(run_dir) if "val_accuracy" in r] == [3, 6]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_custom_loop_hooks_write_a_table_and_stop_at_the_target(example_runs):
    """The example as its docstring's world-of-one command runs it, `python examples/custom_loop_hooks.py`, with its own
    `--target-accuracy` flag on the command line. In the slow set: its module fixture starts the three examples as
    processes that each import torch and train; no fast test runs this example."""
    output, run_dir = example_runs["custom_loop_hooks"]
    assert "epoch train_loss  val_loss  val_acc" in output
    with open(run_dir / "epochs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["epoch"] for row in rows] == ["0"]  # --target-accuracy 0.0: stop after the first validation
    assert float(rows[0]["steps_per_s"]) > 0
    assert "stopped after 8 steps" in output  # 256 / 32 per epoch, one epoch


def test_horovod_mnist_reads_mnist_from_a_local_root(tmp_path, monkeypatch):
    example = load_example("horovod_mnist")
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, n in (("train", 6), ("t10k", 4)):
        write_idx(raw / f"{split}-images-idx3-ubyte", torch.randint(0, 256, (n, 28, 28)))
        write_idx(raw / f"{split}-labels-idx1-ubyte", torch.arange(n) % 10)

    trainer = example.HorovodMnistTrainer({"data": {"kwargs": {"root": str(tmp_path)}}})
    train, val = trainer.build_datasets()
    assert (len(train), len(val)) == (6, 4) and train[0][0].shape == (1, 28, 28)

    monkeypatch.setenv("MNIST_ROOT", str(tmp_path))
    assert len(example.HorovodMnistTrainer({}).build_datasets()[0]) == 6

    monkeypatch.setenv("MNIST_ROOT", str(tmp_path / "elsewhere"))
    with pytest.raises(DataError, match="MNIST files not found"):
        example.HorovodMnistTrainer({}).build_datasets()

    monkeypatch.delenv("MNIST_ROOT")
    train, _ = example.HorovodMnistTrainer({"data": {"kwargs": {"num_train": 20, "num_val": 5}}}).build_datasets()
    assert isinstance(train, TensorDataset) and len(train) == 20  # the embedded digits


def test_resnet_demo_tree_has_train_and_val_class_folders(tmp_path):
    example = load_example("resnet_imagefolder")
    example.draw_demo_tree(tmp_path, per_class=2, val_per_class=1)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.png")) == [
        f"{split}/{shape}/{i}.png"
        for split, n in (("train", 2), ("val", 1))
        for shape in ("circle", "square", "triangle")
        for i in range(n)
    ]
