"""The training loss, accumulated on the device and reduced across ranks only when read.

    mean = RunningMean(device)
    mean.add(loss)            # every micro-step: a detached reference, no kernel launch, no host sync
    mean.add(loss_sum, n)     # or a sum and its weight (train.loss_normalization: tokens)
    value = mean.read()       # every train.log_every steps: one all-reduce, the mean over ranks and steps

The loop never calls ``.item()`` on the loss: a host sync per step would stall the GPU's queue.
"""

from __future__ import annotations

import torch

from ddpkit.distributed.collectives import all_reduce_sum

__all__ = ["RunningMean"]


class RunningMean:
    """Mean of a scalar (the training loss) over steps and ranks since the last read: plain, or weighted
    (``add(sum, weight)``: the sum of the sums over the sum of the weights, e.g. a token-weighted loss)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._values: list[torch.Tensor] = []
        self._weights: list[torch.Tensor] = []

    def add(self, value: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Keep a detached reference: no kernel launch, no host sync. With ``weight``, ``value`` is a sum over that
        many."""
        self._values.append(value.detach())
        if weight is not None:
            self._weights.append(weight.detach())

    @property
    def pending(self) -> bool:
        """Whether values were added since the last read (the same on every rank)."""
        return bool(self._values)

    def read(self) -> float:
        """All-reduce, return the mean over ranks and steps (nan if empty), and start over."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self._values:
            totals[0] = torch.stack(self._values).to(torch.float64).sum()
            totals[1] = torch.stack(self._weights).to(torch.float64).sum() if self._weights else len(self._values)
        self._values.clear()
        self._weights.clear()
        total, count = all_reduce_sum(totals).tolist()
        return total / count if count else float("nan")
