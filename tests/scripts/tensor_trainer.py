r"""A tensor-parallel Trainer (a tiny Llama on ragged token sequences) that logs each step's targets and can
SIGKILL itself: for tests/test_tensor_training.py.

    PYTHONPATH=tests KILL_RANK=1 KILL_AT_STEP=5 ddpkit run CONFIG --nproc-per-node 2 --max-restarts 1 \
        --script tests/scripts/tensor_trainer.py

Every rank of a tensor-parallel group reads the same batches, so each appends ``attempt step fingerprint`` to
``<output_dir>/trained-rank<r>.log`` after each optimizer step (the fingerprint is the sum of the step's targets,
weighted by position: the sample order before and after a restart compares). The kill happens on the first
attempt only, right after step ``KILL_AT_STEP`` completed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from helpers import RaggedSequences

import ddpkit

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
KILL_RANK = int(os.environ.get("KILL_RANK", "-1"))
KILL_AT_STEP = int(os.environ.get("KILL_AT_STEP", "-1"))


class TensorParallelLlama(ddpkit.Trainer):
    _fingerprint = 0.0

    def build_datasets(self):
        return RaggedSequences(n=64), None

    def training_step(self, batch: Any) -> Any:
        target = batch[1]
        weights = torch.arange(1, target.numel() + 1, dtype=torch.float64).view_as(target)
        self._fingerprint += float((target.double() * weights).sum())
        return super().training_step(batch)

    def on_step_end(self, step: int) -> None:
        with open(Path(self.config.output_dir) / f"trained-rank{self.rank}.log", "a") as f:
            f.write(f"{ATTEMPT} {step} {self._fingerprint!r}\n")
        self._fingerprint = 0.0
        if ATTEMPT == 0 and self.rank == KILL_RANK and step == KILL_AT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    TensorParallelLlama.main()
