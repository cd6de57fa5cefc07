r"""A pipelined Trainer (an MLP cut by module names) that logs each step's targets and can SIGKILL itself: for
tests/test_pipeline.py.

    KILL_RANK=2 KILL_AT_STEP=5 ddpkit run CONFIG --nproc-per-node 4 --max-restarts 1 \
        --script tests/scripts/pipeline_trainer.py

Under a pipeline only the last stage sees the targets, so the last stage of each replica appends
``attempt step fingerprint`` to ``<output_dir>/trained-rank<r>.log`` after each optimizer step (the fingerprint
is the sum of the step's targets, weighted by position: the sample order before and after a restart compares).
The kill happens on the first attempt only, right after step ``KILL_AT_STEP`` completed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ddpkit

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
KILL_RANK = int(os.environ.get("KILL_RANK", "-1"))
KILL_AT_STEP = int(os.environ.get("KILL_AT_STEP", "-1"))


class PipelinedMlp(ddpkit.Trainer):
    _fingerprints: list[float] = []

    def build_model(self) -> nn.Module:
        layers = [nn.Linear(144, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)]
        return nn.Sequential(nn.Flatten(), *layers)

    def pipeline_loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        weights = torch.arange(1, target.numel() + 1, dtype=torch.float64)
        self._fingerprints.append(float((target.double() * weights).sum()))
        return super().pipeline_loss(output, target)

    def on_step_end(self, step: int) -> None:
        if self.layout.pp_rank == self.layout.pp - 1:
            # The step's M microbatches: the last M calls (a schedule's first step may call the loss once more)
            fingerprint = sum(self._fingerprints[-self.config.parallel.microbatches :])
            with open(Path(self.config.output_dir) / f"trained-rank{self.rank}.log", "a") as f:
                f.write(f"{ATTEMPT} {step} {fingerprint!r}\n")
        self._fingerprints.clear()
        if ATTEMPT == 0 and self.rank == KILL_RANK and step == KILL_AT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    PipelinedMlp.main()
