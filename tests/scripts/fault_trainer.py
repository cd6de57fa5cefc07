"""A Trainer subclass that fails on purpose on one rank, for tests/test_failures.py.

    FAULT_WHERE=step FAULT_RANK=1 FAULT_STEP=3 FAULT_STAMP=/tmp/stamp \
        ddpkit run CONFIG --nproc-per-node 2 --script tests/scripts/fault_trainer.py

Environment variables (read once at start):

* ``FAULT_WHERE``: where to fail. ``step`` (training_step), ``data`` (the dataset's __getitem__,
  also inside a DataLoader worker), ``hook`` (on_step_end), ``validation`` (validation_step),
  ``save`` (rank 0's checkpoint write raises what ``mkdir`` raises when the checkpoint folder has
  become a file: an error that is not ddpkit's), ``disk_full`` (rank 0's checkpoint write meets ENOSPC, as on a full
  disk: every rank is told, none prints a traceback), or ``none``.
* ``FAULT_RANK``: the rank that fails (default 1). ``FAULT_STEP``: the optimizer step, 1-based,
  at or after which it fails (default 3).
* ``FAULT_STAMP``: a file; ``time.time()`` is written there right before the fault, so the test
  can measure the time from the fault to the exit of the last process.
* ``FAULT_THREAD=1``: the failing rank also starts a non-daemon thread that never ends (like a
  user's metrics uploader), which would keep a normally exiting interpreter alive forever.

The exception message always contains ``injected fault``.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any

import torch
from torch.utils.data import Dataset

import ddpkit

WHERE = os.environ.get("FAULT_WHERE", "none")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "3"))
STAMP = os.environ.get("FAULT_STAMP")
LINGERING_THREAD = os.environ.get("FAULT_THREAD") == "1"
RANK = int(os.environ.get("RANK", "0"))


def stamp() -> None:
    """Record the moment of the fault (once: the first stamp wins)."""
    if STAMP and not os.path.exists(STAMP):
        with open(STAMP, "w") as f:
            f.write(repr(time.time()))


def fail(where: str) -> None:
    stamp()
    raise RuntimeError(f"injected fault in {where} on rank {RANK}")


class FailingDataset(Dataset):
    """Wraps a dataset; on the faulty rank, item ``fail_after`` and later raise."""

    def __init__(self, dataset: Dataset, fail_after: int):
        self.dataset, self.fail_after, self.served = dataset, fail_after, 0

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        self.served += 1
        if self.served > self.fail_after:
            fail("__getitem__")
        return self.dataset[index]


class FaultTrainer(ddpkit.Trainer):
    def _faulty(self, where: str) -> bool:
        return WHERE == where and self.rank == FAULT_RANK

    def on_fit_start(self) -> None:
        if LINGERING_THREAD and self.rank == FAULT_RANK:
            threading.Thread(target=threading.Event().wait, name="uploader", daemon=False).start()

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        train, val = super().build_datasets()
        if self._faulty("data"):
            train = FailingDataset(train, fail_after=(FAULT_STEP - 1) * self.config.data.batch_size)
        return train, val

    def training_step(self, batch: Any) -> torch.Tensor:
        if self._faulty("step") and self.progress.step + 1 >= FAULT_STEP:
            fail("training_step")
        return super().training_step(batch)

    def on_step_end(self, step: int) -> None:
        if self._faulty("hook") and step >= FAULT_STEP:
            fail("on_step_end")
        if self._faulty("save") and step >= FAULT_STEP:
            stamp()
            from ddpkit.checkpoint import files

            def not_a_folder(state: Any, directory: Any, **kwargs: Any) -> Any:
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(directory))

            files.save_checkpoint = not_a_folder  # the checkpoint write that follows this hook
        if self._faulty("disk_full") and step >= FAULT_STEP:
            stamp()
            from ddpkit.checkpoint import files

            def full(path: Any, *args: Any, **kwargs: Any) -> Any:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))

            files.write_atomically = full  # the checkpoint write that follows this hook: no room left

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        if self._faulty("validation"):
            fail("validation_step")
        return super().validation_step(batch)


if __name__ == "__main__":
    FaultTrainer.main()
