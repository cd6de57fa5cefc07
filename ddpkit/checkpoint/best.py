"""The best checkpoint: ``best.pt`` is written whenever ``checkpoint.best.metric`` improves.

    checkpoint:
      best: {metric: val_loss, mode: min}

    best = BestCheckpoint.for_run(config, checkpointer=checkpointer, progress=progress)   # None when off
    events.add(best)                   # on_validation_end(metrics): compare, and save "best" when improved
    checkpointer.register(builtin={"best": best, ...})    # the best value so far survives a restart

The metrics are the exact, rank-reduced validation metrics, so every rank decides the same at the
same step and joins the save together. ``best.pt`` is never pruned by ``checkpoint.keep_last``.
"""

from __future__ import annotations

from typing import Any

from ddpkit.checkpoint.checkpointer import Checkpointer
from ddpkit.config.schema import Config
from ddpkit.progress import Progress
from ddpkit.training.metrics import BestTracker

__all__ = ["BestCheckpoint"]


class BestCheckpoint:
    """A listener that saves the checkpoint named "best" when the tracked metric improves."""

    def __init__(self, tracker: BestTracker, *, checkpointer: Checkpointer, progress: Progress):
        self.tracker = tracker
        self._checkpointer = checkpointer
        self._progress = progress

    @classmethod
    def for_run(cls, config: Config, *, checkpointer: Checkpointer, progress: Progress) -> BestCheckpoint | None:
        best = config.checkpoint.best
        if best is None:
            return None
        return cls(
            BestTracker(best.metric, best.mode, key="checkpoint.best.metric"),
            checkpointer=checkpointer,
            progress=progress,
        )

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        if self.tracker.update(metrics):
            self._checkpointer.save(self._progress.step, name="best")

    def state_dict(self) -> dict[str, Any]:
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state)
