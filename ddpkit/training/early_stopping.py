"""Early stopping: end the run when a validation metric stops improving or reaches a target.

    train:
      early_stopping: {metric: val_loss, mode: min, patience: 3, min_delta: 0.001}   # or target: 0.2

    early = EarlyStopping.for_run(config, progress=progress)      # None when train.early_stopping.metric is not set
    events.add(early)                          # on_validation_end(metrics): decide
    early.triggered                            # the loop ends after this step when True

The metrics are rank-reduced, so every rank decides the same at the same step. Its counters are part
of the checkpoint (registered as ``early_stopping``), so patience continues across a restart.
"""

from __future__ import annotations

from typing import Any

from ddpkit.config.schema import Config
from ddpkit.progress import Progress
from ddpkit.reporting.log import log
from ddpkit.training.metrics import BestTracker

__all__ = ["EarlyStopping"]


class EarlyStopping:
    """A listener that sets :attr:`triggered` at a reached target or when patience runs out."""

    def __init__(self, config: Config, *, progress: Progress):
        self._progress = progress
        early = self.settings = config.train.early_stopping
        self.tracker = BestTracker(
            early.metric,
            early.mode,
            patience=early.patience,
            min_delta=early.min_delta,
            target=early.target,
            key="train.early_stopping.metric",
        )
        self.triggered = False

    @classmethod
    def for_run(cls, config: Config, *, progress: Progress) -> EarlyStopping | None:
        return cls(config, progress=progress) if config.train.early_stopping.metric is not None else None

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        tracker = self.tracker
        early = self.settings
        tracker.update(metrics)
        if tracker.reached:
            log.info(
                "early stopping: %s %.4f %s train.early_stopping.target=%g (mode %s) at step %d",
                early.metric,
                tracker.last,
                "<=" if early.mode == "min" else ">=",
                early.target,
                early.mode,
                self._progress.step,
            )
            self.triggered = True
        elif tracker.exhausted:
            log.info("early stopping: %s has not improved for %d evaluations", early.metric, early.patience)
            self.triggered = True

    def state_dict(self) -> dict[str, Any]:
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state)
