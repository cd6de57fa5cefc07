"""A Trainer whose data are plain IterableDatasets (no len(), reshuffled by set_epoch), for tests/test_streaming.py.

    ddpkit run CONFIG --nproc-per-node 2 --script tests/scripts/stream_trainer.py data.num_workers=2

The training stream yields ``(image, label, index)`` for the embedded digits data (``data.kwargs``
as for ``data.name=digits``), in an order drawn from ``(run.seed, epoch)``; it does no sharding of
its own, so ddpkit splits it round-robin over ranks and workers. Every rank appends what it
trains on to ``<output_dir>/samples-rank<R>.txt``, one line per micro-batch: ``epoch step
index index ...``. Validation is a stream too and also reports ``val_index`` (the mean sample
index: ``(num_val - 1) / 2`` exactly when every validation sample is counted once).

``KILL_RANK`` / ``KILL_AT_STEP``: that rank SIGKILLs itself after that optimizer step, on the
first attempt only (``TORCHELASTIC_RESTART_COUNT=0``), as a crashed machine would.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import IterableDataset

import ddpkit
from ddpkit.data.datasets import make_digits


class DigitStream(IterableDataset):
    """``(image, label, index)`` samples; ``shuffle``: a new order each epoch from ``(seed, epoch)``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, shuffle: bool, seed: int):
        self.images, self.labels, self.shuffle, self.seed, self.epoch = images, labels, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        n = len(self.labels)
        order = (
            torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
            if self.shuffle
            else torch.arange(n)
        )
        for index in order.tolist():
            yield self.images[index], self.labels[index], index


class StreamTrainer(ddpkit.Trainer):
    def build_datasets(self) -> tuple[IterableDataset, IterableDataset]:
        kw = dict(self.config.data.kwargs)
        num_train, num_val, seed = kw.pop("num_train", 12000), kw.pop("num_val", 2000), kw.pop("seed", 1234)
        train = DigitStream(*make_digits(num_train, seed=seed, **kw), shuffle=True, seed=self.config.run.seed)
        val = DigitStream(*make_digits(num_val, seed=seed + 1, **kw), shuffle=False, seed=0)
        return train, val

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y, index = batch
        with open(Path(self.config.output_dir) / f"samples-rank{self.rank}.txt", "a") as f:
            f.write(f"{self.progress.epoch} {self.progress.step} {' '.join(map(str, index.tolist()))}\n")
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y, index = batch
        logits = self.model(x)
        return {"accuracy": (logits.argmax(1) == y).float(), "index": index.double()}

    def on_step_end(self, step: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (
            first_attempt
            and str(self.rank) == os.environ.get("KILL_RANK")
            and step == int(os.environ.get("KILL_AT_STEP", "-1"))
        ):
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    StreamTrainer.main()
