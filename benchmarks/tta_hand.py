"""The hand-written side of ``benchmarks.time_to_accuracy``: plain DDP to 95% on the digits data, torch only.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.tta_hand DATA.pt OUT_DIR

``DATA.pt`` holds ``[train_images, train_labels, val_images, val_labels]``, the tensors of ddpkit's
``digits`` dataset with its defaults (the bench writes it). The job: the classic MNIST CNN (the same
layers as ddpkit's ``mnist_cnn``), batch 64 per rank, SGD lr 0.05 momentum 0.9, an exact
evaluation every 25 steps (each rank a strided share of the validation set, correct and total
all-reduced), stop at the first evaluation with accuracy >= 0.95; rank 0 then writes
``OUT_DIR/model.pt`` and prints one JSON line of wall-clock timestamps (``time.time()``).

The loop is ``benchmarks.workloads.train_by_hand`` and the evaluation ``benchmarks.workloads.accuracy``:
seeded as the ddpkit Trainer seeds, so both train bitwise alike. Imports nothing from ddpkit
(``benchmarks.workloads`` loads torch only).
"""

from __future__ import annotations

import time

IMPORTS_STARTED = time.time()

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from benchmarks.workloads import accuracy, loader_for, strided_loader, train_by_hand  # noqa: E402

SEED, BATCH, LR, MOMENTUM, EVAL_EVERY, TARGET, MAX_STEPS = 0, 64, 0.05, 0.9, 25, 0.95, 2000


class MnistCNN(nn.Module):
    """ddpkit.models.builtin.MnistCNN, layer for layer (the same parameter names and RNG draws)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        side = ((image_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(20 * side * side, 50)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, training=self.training)
        return self.fc2(x)


def main(data_path: str, out_dir: str) -> None:
    marks = {"imports_started": IMPORTS_STARTED, "imported": time.time()}
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    marks["ready"] = time.time()
    torch.manual_seed(SEED)
    train_x, train_y, val_x, val_y = torch.load(data_path, weights_only=True)
    train_set, val_set = TensorDataset(train_x, train_y), TensorDataset(val_x, val_y)
    model = MnistCNN()
    val = strided_loader(val_set, rank, world_size, batch_size=BATCH)

    def mark(step: int) -> bool:  # 0: all built; 1: the first step done; then stop at the first evaluation on target
        if step <= 1:
            marks["built" if step == 0 else "first_step"] = time.time()
            return False
        if step % EVAL_EVERY or accuracy(model, val) < TARGET:
            return False
        marks["target"] = time.time()
        return True

    loader = loader_for(train_set, rank, world_size, batch_size=BATCH)
    step = train_by_hand(
        model,
        loader,
        rank=rank,
        world_size=world_size,
        max_steps=MAX_STEPS,
        lr=LR,
        momentum=MOMENTUM,
        seed=SEED,
        on_step=mark,
    )
    if rank == 0:
        torch.save(model.state_dict(), Path(out_dir) / "model.pt")
        marks["saved"] = time.time()
    dist.barrier()  # the others wait for the file, as a script that reads it next would
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({**marks, "step": step}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
