"""A Trainer that signals itself on purpose and records which samples each step trains on, for
tests/test_preemption.py.

    PREEMPT_RANK=1 PREEMPT_STEP=5 PREEMPT_STAMP=/tmp/stamp \\
        ddpkit run CONFIG --nproc-per-node 2 --script tests/scripts/preempt_trainer.py

Environment variables (read once at start):

* ``PREEMPT_SIGNAL`` (default SIGTERM), ``PREEMPT_RANK`` (default 0), ``PREEMPT_STEP`` (default 5):
  that rank sends the signal to its own process after that optimizer step (``on_step_end``), or
  from inside ``validation_step`` with ``PREEMPT_WHERE=validation``. ``PREEMPT_COUNT=2`` sends it
  twice in a row (the second means "stop now").
* ``PREEMPT_STAMP``: a file created when the signal is sent; while it exists no signal is sent,
  so the relaunch of the same command trains on undisturbed. ``time.time()`` is written into it.
* ``SAMPLES_DIR``: each rank appends ``{"step": s, "indices": [...]}`` lines to
  ``SAMPLES_DIR/rank<R>.jsonl``: the dataset indices the optimizer step ``s`` trained on here.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

import ddpkit

SIGNAL = signal.Signals[os.environ.get("PREEMPT_SIGNAL", "SIGTERM")]
SIGNAL_RANK = int(os.environ.get("PREEMPT_RANK", "0"))
SIGNAL_STEP = int(os.environ.get("PREEMPT_STEP", "5"))
WHERE = os.environ.get("PREEMPT_WHERE", "step")
COUNT = int(os.environ.get("PREEMPT_COUNT", "1"))
STAMP = os.environ.get("PREEMPT_STAMP")
SAMPLES_DIR = os.environ.get("SAMPLES_DIR")


class Indexed(Dataset):
    """``(x, y, index)``: the samples say which they are."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        x, y = self.dataset[index]
        return x, y, index


class PreemptTrainer(ddpkit.Trainer):
    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        train, val = super().build_datasets()
        return Indexed(train), val

    def on_fit_start(self) -> None:
        self._seen: list[int] = []

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y, index = batch
        self._seen.extend(index.tolist())
        return F.cross_entropy(self.model(x), y)

    def on_step_end(self, step: int) -> None:
        if SAMPLES_DIR:
            with open(Path(SAMPLES_DIR) / f"rank{self.rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "indices": sorted(self._seen)}) + "\n")
        self._seen = []
        if WHERE == "step" and step == SIGNAL_STEP:
            self._maybe_signal()
        if STAMP and os.path.exists(STAMP):
            # Once signalled, steps take at least 20 ms: the ranks agree on a stop step through the
            # store's poll thread, and a fast machine would otherwise finish the run first.
            time.sleep(0.02)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        if WHERE == "validation" and self.progress.step >= SIGNAL_STEP:
            self._maybe_signal()
        return super().validation_step(batch)

    def _maybe_signal(self) -> None:
        if self.rank != SIGNAL_RANK or not STAMP or os.path.exists(STAMP):
            return
        Path(STAMP).write_text(repr(time.time()))
        for _ in range(COUNT):
            os.kill(os.getpid(), SIGNAL)


if __name__ == "__main__":
    PreemptTrainer.main()
