"""Metric sinks: where rank 0 sends the run's config, metrics and final status.

A sink is four methods. The reporter calls them on rank 0 only, in this order::

    sink.start(config, resumed=state_from_checkpoint_or_None)   # once, after resume is decided
    sink.write({"step": 40, "epoch": 1, "train_loss": 0.31, "lr": 0.05, ...})   # each logged step
    sink.write({"step": 48, "epoch": 1, "val_accuracy": 0.97, "val_loss": 0.09, ...})  # each evaluation
    sink.state_dict()                                            # at each checkpoint, saved in it
    sink.finish("FINISHED", [Path("runs/x/model.pt")])           # or FAILED / KILLED

Write your own in a few lines and add it beside the built-in ones (rank 0 has them all)::

    class PrintSink(ddpkit.Sink):
        name = "print"
        def write(self, record):
            print(record["step"], {k: v for k, v in record.items() if k.startswith("val_")})

    class MyTrainer(ddpkit.Trainer):
        def on_fit_start(self):
            if self.is_main:
                self.reporter.sinks.add(PrintSink())

Built in: ``metrics.jsonl``, ``status.json`` (read by ``ddpkit runs``), TensorBoard (``log.tensorboard``),
and the trackers in :mod:`ddpkit.reporting.trackers` (``log.mlflow``, ``log.wandb``).

A sink that raises is switched off with one warning and training goes on, so a broken tracker
never costs a run; only a sink with ``required = True`` (``metrics.jsonl``, the record of
truth) stops the run when it fails.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ddpkit.atomic import write_atomically
from ddpkit.config.schema import Config
from ddpkit.errors import DdpkitError
from ddpkit.reporting.sink_base import STATUSES, Sink

__all__ = ["SinkGroup", "build_sinks", "MetricsFileSink", "StatusSink", "TensorBoardSink", "read_status", "STATUS_FILE"]

log = logging.getLogger("ddpkit.reporting.sinks")

STATUS_FILE = "status.json"


class SinkGroup:
    """Fans each call out to several sinks; a failing optional sink is dropped with one warning."""

    def __init__(self, sinks: Iterable[Sink]):
        self.sinks = list(sinks)
        self._resumed: dict[str, dict[str, Any]] = {}
        #: The run's config, set by start().
        self._config: dict[str, Any] | None = None
        names = [s.name for s in self.sinks]
        assert len(set(names)) == len(names), f"sink names must be unique, got {names}"

    def load_state_dict(self, state: Mapping[str, dict[str, Any]]) -> None:
        """The group's ``state_dict()`` from the checkpoint this run resumes: each sink's part goes to
        its ``load_state_dict`` and ``start`` (sinks opened later, in :meth:`start`, receive theirs then)."""
        self._resumed = dict(state)

    def extend(self, group: SinkGroup) -> None:
        """Add ``group``'s sinks after this group's own (before :meth:`start`)."""
        for sink in group.sinks:
            self.add(sink)

    def start(self, config: dict[str, Any], *, resumed: Mapping[str, dict[str, Any]] | None = None) -> None:
        """Start every sink; ``resumed`` defaults to what ``load_state_dict`` was given."""
        self._config = config
        resumed = self._resumed if resumed is None else resumed
        for sink in list(self.sinks):
            self._start(sink, resumed.get(sink.name))

    def add(self, sink: Sink) -> None:
        """Add a sink, e.g. from ``Trainer.on_fit_start``; started at once if the group already is."""
        assert sink.name not in {s.name for s in self.sinks}, f"a sink named {sink.name!r} is already in the group"
        self.sinks.append(sink)
        if self._config is not None:
            self._start(sink, self._resumed.get(sink.name))

    def _start(self, sink: Sink, resumed: dict[str, Any] | None) -> None:
        """The sink's state from the resumed checkpoint (if any), then ``start``."""
        if resumed is not None:
            self._call(sink, "load_state_dict", resumed)
        # A failed optional sink was dropped
        if sink in self.sinks:
            self._call(sink, "start", self._config, resumed=resumed)

    def write(self, record: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            self._call(sink, "write", record)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        states = {}
        for sink in list(self.sinks):
            state = self._call(sink, "state_dict")
            if state:
                states[sink.name] = state
        return states

    def finish(self, status: str, artifacts: list[Path]) -> None:
        """Tell every sink how the run ended; a second call does nothing (the run ended once)."""
        assert status in STATUSES, status
        sinks = self.sinks
        self.sinks = []
        for sink in sinks:
            self._call(sink, "finish", status, artifacts)

    def _call(self, sink: Sink, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(sink, method)(*args, **kwargs)
        except Exception as exc:
            if sink.required:
                raise
            # Any exception at all: a tracker's client can raise anything, and no metric is
            # worth the run. metrics.jsonl still has every record.
            log.warning(
                "metric sink %r failed in %s() and is switched off for "
                "this run (metrics.jsonl keeps every record): %s: %s",
                sink.name,
                method,
                type(exc).__name__,
                exc,
            )
            if sink in self.sinks:
                self.sinks.remove(sink)
            return None


def build_sinks(config: Config, *, append: bool, extra: Iterable[Sink] = ()) -> SinkGroup:
    """Rank 0's sinks for a run of ``config`` (a :class:`ddpkit.config.schema.Config`): ``metrics.jsonl``,
    ``status.json``, TensorBoard and the trackers when ``log.tensorboard`` / ``log.mlflow`` / ``log.wandb``
    ask for them, then ``extra`` (your own). ``append=False`` starts ``metrics.jsonl`` afresh (a run that is
    not resumed)."""
    sinks: list[Sink] = [MetricsFileSink(config.output_dir, append=append), StatusSink(config.output_dir)]
    if config.log.tensorboard:
        sinks.append(TensorBoardSink(Path(config.output_dir) / "tensorboard"))
    # mlflow and wandb themselves are imported only inside the tracker sinks
    if config.log.mlflow or config.log.wandb:
        # Imported here, so runs without trackers never load the adapters
        from ddpkit.reporting.trackers import tracker_sinks

        sinks += tracker_sinks(
            mlflow=config.log.mlflow,
            wandb=config.log.wandb,
            output_dir=config.output_dir,
            run_name=config.run.name,
            timeout=config.log.tracker_timeout,
        )
    return SinkGroup([*sinks, *extra])


class MetricsFileSink(Sink):
    """``metrics.jsonl``, the run's record of truth: ``required``.

    A thin adapter over :class:`ddpkit.reporting.log.MetricSinks`, which owns the file format.
    """

    name = "metrics"
    required = True

    def __init__(self, output_dir: str | os.PathLike, *, append: bool = True):
        from ddpkit.reporting.log import MetricSinks

        self._sinks = MetricSinks(output_dir, enabled=True, append=append)

    def write(self, record: dict[str, Any]) -> None:
        self._sinks.write(record)

    def finish(self, status: str, artifacts: list[Path]) -> None:
        self._sinks.close()


class TensorBoardSink(Sink):
    """TensorBoard event files (``torch.utils.tensorboard``, ``pip install 'ddpkit[tensorboard]'``): optional.

    A missing package is a clear error when the run starts (the config asked for it); a writer that
    fails later (a full disk, a broken file) is switched off with one warning, like the trackers.
    """

    name = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise DdpkitError(
                "log.tensorboard=true needs the tensorboard package, which is not installed: "
                "pip install 'ddpkit[tensorboard]' (or set log.tensorboard=false)"
            ) from None
        self._open = SummaryWriter
        self.log_dir = Path(log_dir)
        self._writer = None

    def start(self, config: dict[str, Any], *, resumed: dict[str, Any] | None) -> None:
        self._writer = self._open(log_dir=str(self.log_dir))

    def write(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            # Not "time": TensorBoard stamps each event with wall time itself, and a Unix time
            # stored as a float32 scalar is only accurate to about two minutes.
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, global_step=record["step"])

    def finish(self, status: str, artifacts: list[Path]) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class StatusSink(Sink):
    """Keeps ``<output_dir>/status.json`` up to date: status, start/end times, wall time, steps.

    ``ddpkit runs`` reads it. Wall time adds up over attempts (carried in the checkpoint), and
    the host and pid let a reader tell a run still going from one that was killed outright.
    """

    name = "status"

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / STATUS_FILE
        self._state: dict[str, Any] = {}
        self._started = time.monotonic()
        self._carried = 0.0

    def start(self, config: dict[str, Any], *, resumed: dict[str, Any] | None) -> None:
        self._carried = float((resumed or {}).get("wall_s", 0.0))
        attempts = int((resumed or {}).get("attempts", 0)) + 1
        first = (resumed or {}).get("started", time.time())
        self._state = {
            "status": "RUNNING",
            "started": first,
            "attempt_started": time.time(),
            "ended": None,
            "attempts": attempts,
            "step": 0,
            "wall_s": self._carried,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self._save()

    def write(self, record: dict[str, Any]) -> None:
        self._state["step"] = record.get("step", self._state.get("step", 0))

    def state_dict(self) -> dict[str, Any]:
        return {
            "wall_s": self._wall(),
            "attempts": self._state.get("attempts", 1),
            "started": self._state.get("started"),
        }

    def finish(self, status: str, artifacts: list[Path]) -> None:
        self._state.update(status=status, ended=time.time(), wall_s=self._wall())
        self._save()

    def _wall(self) -> float:
        return self._carried + time.monotonic() - self._started

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A reader never sees half a file
        write_atomically(self.path, json.dumps(self._state, indent=1) + "\n")


def read_status(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``status.json`` of a run directory, or None when it is missing or unreadable."""
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
