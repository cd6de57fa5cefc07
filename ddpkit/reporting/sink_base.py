"""The metric-sink interface (:class:`Sink`) and the small helpers its implementations share.

    class PrintSink(ddpkit.Sink):                 # also ddpkit.reporting.sink_base.Sink
        name = "print"
        def write(self, record):
            print(record["step"], record.get("train_loss"))

The built-in sinks are in :mod:`ddpkit.reporting.sinks` (``metrics.jsonl``, ``status.json``) and
:mod:`ddpkit.reporting.trackers` (MLflow, W&B); both import the base from here, so neither needs the other's module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.config.serialize import flatten

__all__ = ["Sink", "STATUSES", "flatten_config", "as_text"]

#: How a run ended, in MLflow's words: completed, raised, or stopped by a signal (preemption).
STATUSES = ("FINISHED", "FAILED", "KILLED")


class Sink:
    """The metric-sink interface; every method is a no-op, so override only what you need.

    ``name`` keys this sink's state inside a checkpoint: keep it stable across versions.
    """

    name: str = "sink"
    #: True: an exception from this sink stops training. False: warn once, drop the sink, go on.
    required: bool = False

    def start(self, config: dict[str, Any], *, resumed: dict[str, Any] | None) -> None:
        """The resolved config as a nested dict; ``resumed`` is what ``state_dict`` returned
        when the checkpoint this run resumes from was written (None for a fresh run)."""

    def write(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record: ``step`` and ``time`` plus ``train_*`` or ``val_*`` keys."""

    def state_dict(self) -> dict[str, Any]:
        """Small, picklable state saved in every checkpoint (e.g. a tracker's run id)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What ``state_dict`` returned when the resumed checkpoint was written; called just before
        ``start``, which receives the same dict as ``resumed`` (override either)."""

    def finish(self, status: str, artifacts: list[Path]) -> None:
        """The run ended with ``status`` (one of :data:`STATUSES`); ``artifacts`` are files to keep."""


def flatten_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``{"optim": {"lr": 0.05}}`` -> ``{"optim.lr": 0.05}``: the form trackers take params in.

    Leaves keep their type (a tracker that stores text, like MLflow, uses :func:`as_text`); an
    empty section keeps its key with ``{}`` so nothing silently disappears.
    """
    return flatten(config)


def as_text(value: Any) -> str:
    """A config value as YAML-like text: ``0.05``, ``null``, ``true``, ``[64, 64]``, ``{}``."""
    if value is None or isinstance(value, (bool, list, dict, tuple)):
        return json.dumps(value, default=str)
    return str(value)
