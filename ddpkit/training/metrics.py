"""Metrics that accumulate on the device and are reduced across ranks only when read.

(The training loss's running mean is the reporter's: :mod:`ddpkit.reporting.running_mean`.) Validation sums
per-sample values in float64 and divides by the global sample count, so the result is the exact
mean over the whole validation set however it was sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddpkit.distributed.collectives import all_gather_object, all_reduce_sum
from ddpkit.errors import ConfigError

__all__ = ["ExactMeans", "BestTracker", "evaluate"]


def evaluate(
    model: torch.nn.Module,
    loader: Any,
    step: Callable[[Any], Mapping[str, torch.Tensor]],
    *,
    device: torch.device,
    autocast: Callable[[], Any],
    forwards: int | None = None,
) -> dict[str, float]:
    """``step`` over every batch of ``loader`` with ``model`` in eval mode and no gradients; exact ``val_`` means.

    The model's train/eval mode is restored afterwards. Every rank calls it (the means are reduced).
    ``forwards``: where each forward is a collective (fsdp2 gathering block by block), the count every rank runs;
    a rank with fewer batches runs ``step`` on its last batch again and drops what it returns.
    """
    # Imported here: data's loaders sit above these metrics.
    from ddpkit.data.loaders import batch_size_of, move_to_device

    was_training = model.training
    model.eval()
    means = ExactMeans(device)
    try:
        with torch.no_grad(), autocast():
            seen, batch = 0, None
            for seen, batch in enumerate(loader, start=1):
                batch = move_to_device(batch, device)
                means.add(step(batch), batch_size=batch_size_of(batch))
            for _ in range(seen, forwards or 0):
                step(batch)
    finally:
        model.train(was_training)
    return {f"val_{name}": value for name, value in means.compute().items()}


class ExactMeans:
    """Per-metric means over every validation sample, exact whatever the world size.

    ``add`` takes a batch's metrics: a 1-D tensor holds one value per sample; a 0-d tensor is the
    batch mean and is weighted by ``batch_size``.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, metrics: Mapping[str, torch.Tensor], batch_size: int) -> None:
        for name, value in metrics.items():
            value = value.detach().to(self.device, torch.float64)
            if value.dim() == 0:
                total = value * batch_size
                count = batch_size
            else:
                total = value.sum()
                count = value.numel()
            entry = self._sums.setdefault(name, torch.zeros(2, dtype=torch.float64, device=self.device))
            entry[0] += total
            entry[1] += count

    def compute(self) -> dict[str, float]:
        """Reduce across ranks and return ``{name: mean}``. Every rank must call this."""
        # A rank whose shard was empty has seen no metric names: agree on the union first.
        names = sorted(set().union(*all_gather_object(sorted(self._sums))))
        empty = torch.zeros(2, dtype=torch.float64, device=self.device)
        stacked = torch.stack([self._sums.get(n, empty) for n in names]) if names else empty.new_zeros(0, 2)
        totals = all_reduce_sum(stacked).tolist()
        return {name: (total / count if count else float("nan")) for name, (total, count) in zip(names, totals)}


class BestTracker:
    """Follows one validation metric: was this evaluation a new best, has patience run out, is the target reached?

    Used for early stopping (``train.early_stopping``) and for keeping the best checkpoint
    (``checkpoint.best``). Its decisions come from rank-reduced metrics, so every rank agrees.
    With ``metric=None`` it is switched off: nothing improves, patience never runs out.
    """

    def __init__(
        self,
        metric: str | None,
        mode: str = "min",
        *,
        patience: int | None = None,
        min_delta: float = 0.0,
        target: float | None = None,
        key: str = "metric",
    ):
        self.metric = metric
        self.mode = mode
        self.patience = patience
        self.min_delta = min_delta
        self.target = target
        self.key = key
        self.best: float | None = None
        #: The latest evaluation's value, for the target rule.
        self.last: float | None = None
        self.bad_evals = 0

    def update(self, metrics: Mapping[str, float]) -> bool:
        """Record one evaluation; return whether it is a new best."""
        if self.metric is None:
            return False
        if self.metric not in metrics:
            raise ConfigError(
                f"{self.key}: {self.metric!r} is not a validation metric; available: {', '.join(metrics)}"
            )
        value = self.last = metrics[self.metric]
        sign = 1 if self.mode == "min" else -1
        improved = self.best is None or sign * (self.best - value) > self.min_delta
        if improved:
            self.best = value
            self.bad_evals = 0
        else:
            self.bad_evals += 1
        return improved

    @property
    def exhausted(self) -> bool:
        """True once ``patience`` evaluations in a row brought no improvement."""
        return self.patience is not None and self.metric is not None and self.bad_evals >= self.patience

    @property
    def reached(self) -> bool:
        """True when the latest evaluation met ``target``: ``>=`` it for mode ``max``, ``<=`` for ``min`` (NaN never
        does)."""
        if self.target is None or self.last is None:
            return False
        return self.last >= self.target if self.mode == "max" else self.last <= self.target

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = state.get("best")
        self.bad_evals = state.get("bad_evals", 0)
