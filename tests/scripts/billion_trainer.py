"""Train on 10**9 samples synthesised per index, under an address-space limit no epoch permutation fits.

    python tests/scripts/billion_trainer.py OUT_DIR [STOP_AT_STEP]

The process may map at most 1.5 GB more than it has once torch is imported (``RLIMIT_AS``):
``torch.randperm(10**9)`` alone is 8 GB, so only an index-free order (``data.order: auto``
picks it at this size) lets the run start. Every optimizer step appends ``step index index ...``
to ``OUT_DIR/run/samples.txt``; with ``STOP_AT_STEP`` the run raises right after that step's
checkpoint, and the next call with the same ``OUT_DIR`` resumes from it (``checkpoint.resume: auto``).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

import ddpkit

N = 10**9


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmSize``: the address space mapped so far)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


class PerIndex(Dataset):
    """Sample ``i``: four features computed from ``i`` and its label ``i % 2``; nothing is stored."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(index)
        return torch.rand(4, generator=g) + (index % 2), index % 2, index


class BillionTrainer(ddpkit.Trainer):
    stop_at: int | None = None

    def build_datasets(self):
        return PerIndex(), None

    def training_step(self, batch):
        x, y, index = batch
        self.seen.append(index.tolist())
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def on_step_end(self, step: int) -> None:
        with open(Path(self.config.output_dir) / "samples.txt", "a") as f:
            f.write(f"{step} {' '.join(str(i) for batch in self.seen for i in batch)}\n")
        self.seen.clear()
        if step == self.stop_at:
            raise SystemExit(f"stopped after step {step}")


def main(out: str, stop_at: int | None) -> None:
    cfg = {
        "run": {"name": "billion", "output_dir": str(Path(out) / "run"), "seed": 3},
        "data": {"batch_size": 8},
        "model": {"name": "mlp", "kwargs": {"in_features": 4, "hidden": [8], "num_classes": 2}},
        "optim": {"name": "sgd", "lr": 0.1},
        "train": {"max_steps": 6, "epochs": None, "log_every": 100},
        "checkpoint": {"every_steps": 2, "every_epochs": None},
        "log": {"progress_bar": False},
    }
    limit = _status("VmSize") * 1024 + int(1.5 * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    trainer = BillionTrainer(cfg)
    trainer.seen, trainer.stop_at = [], stop_at
    trainer.fit()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
