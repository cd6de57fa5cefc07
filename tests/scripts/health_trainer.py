"""A Trainer subclass that makes training unhealthy on purpose, for tests/test_health.py.

    HEALTH_NAN_RANK=1 HEALTH_NAN_STEPS=3 ddpkit run CONFIG --nproc-per-node 2 --script tests/scripts/health_trainer.py

Environment variables (read when the Trainer is built), steps 1-based optimizer steps:

* ``HEALTH_NAN_RANK``, ``HEALTH_NAN_STEPS`` (comma-separated): that rank's loss is NaN at those
  steps, on the first micro-batch of the step. ``HEALTH_NAN_HOW``: ``add`` (loss + NaN: the
  gradients stay finite, only the loss tells), ``mul`` (loss * NaN: NaN gradients too) or ``grad``
  (a finite loss whose backward makes one weight's gradient NaN: only the gradients tell).
* ``HEALTH_SPIKE_STEPS``: every rank's loss is multiplied by 1000 at those steps.
* ``HEALTH_SLOW_RANK``, ``HEALTH_SLOW_MS``: that rank sleeps this long in every training_step (pipeline_loss).

Under ``parallel.tensor`` use :class:`SequentialHealthTrainer`, under ``parallel.pipeline``
:class:`PipelineHealthTrainer`: the faults go into ``pipeline_loss``, on the last stage's ranks (``HEALTH_NAN_RANK``
must be one of them).
* ``HEALTH_PERTURB_RANK``, ``HEALTH_PERTURB_STEP``: after that step, that rank adds 1e-3 to one
  weight outside the optimizer (``HEALTH_PERTURB_NAN=1``: sets it to NaN instead).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import ddpkit


def _steps(name: str) -> set[int]:
    return {int(s) for s in os.environ.get(name, "").split(",") if s.strip()}


class HealthTrainer(ddpkit.Trainer):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        env = os.environ
        self.nan_rank, self.nan_steps, self.nan_how = (
            int(env.get("HEALTH_NAN_RANK", "-1")),
            _steps("HEALTH_NAN_STEPS"),
            env.get("HEALTH_NAN_HOW", "add"),
        )
        self.spike_steps = _steps("HEALTH_SPIKE_STEPS")
        self.slow_rank, self.slow_s = (
            int(env.get("HEALTH_SLOW_RANK", "-1")),
            float(env.get("HEALTH_SLOW_MS", "0")) / 1000,
        )
        self.perturb_rank, self.perturb_step = (
            int(env.get("HEALTH_PERTURB_RANK", "-1")),
            int(env.get("HEALTH_PERTURB_STEP", "0")),
        )
        self.perturb_nan = env.get("HEALTH_PERTURB_NAN") == "1"
        self._poisoned_step = -1

    def training_step(self, batch: Any) -> torch.Tensor:
        return self._faulty(super().training_step(batch))

    def pipeline_loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """Under a pipeline: the last stage's loss per microbatch, with the same faults."""
        return self._faulty(super().pipeline_loss(output, target))

    def _faulty(self, loss: torch.Tensor) -> torch.Tensor:
        step = self.progress.step + 1  # the optimizer step this micro-batch belongs to
        if self.rank == self.slow_rank:
            time.sleep(self.slow_s)
        if self.rank == self.nan_rank and step in self.nan_steps and self._poisoned_step != step:
            self._poisoned_step = step  # the step's first micro-batch only
            if self.nan_how == "grad":  # sqrt(0) = 0 in the forward; its derivative inf, times 0, is NaN
                loss = loss + torch.sqrt(next(self.model.parameters()).sum() * 0)
            else:
                loss = loss + float("nan") if self.nan_how == "add" else loss * float("nan")
        if step in self.spike_steps:
            loss = loss * 1000
        return loss

    def on_step_end(self, step: int) -> None:
        if self.rank == self.perturb_rank and step == self.perturb_step:
            with torch.no_grad():
                weight = next(self.unwrapped_model.parameters()).view(-1)
                weight[0] = float("nan") if self.perturb_nan else weight[0] + 1e-3


class SequentialHealthTrainer(HealthTrainer):
    """The same faults on an ``nn.Sequential`` MLP that a tensor plan splits (``parallel.tensor=2``) and a pipeline
    cuts by its children's names (``parallel.split_points: ["3"]``)."""

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(144, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
        )

    def tensor_plan(self, model: torch.nn.Module) -> dict[str, Any]:
        """The hidden layer column-wise, the output layer row-wise (Megatron's pair)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"1": ColwiseParallel(), "3": RowwiseParallel()}


class PipelineHealthTrainer(SequentialHealthTrainer):
    """Under ``parallel.pipeline`` the faults go into ``pipeline_loss`` on the last stage (a pipeline refuses a
    Trainer that overrides ``training_step``: the model is never whole on one rank)."""

    training_step = ddpkit.Trainer.training_step


if __name__ == "__main__":
    HealthTrainer.main()
