"""What a worker holds for one ``fit()``: its process group, the run directory's lock, its hang watchdog and its goodput ledger.

    with worker_scope(config, env, events, step=lambda: progress.step) as worker:
        worker.runtime        # the process group is up: device, backend, store (ddpkit.distributed)
        worker.watchdog       # heartbeats through the store; a listener of every span
        worker.ledger         # goodput.jsonl: restore, first step, checkpoints, the attempt's end
        worker.barrier("end of training")
    # on the way out: events.failure(error) if the body raised (the crash save), events.exit(status);
    # then, innermost first, the ledger writes the attempt's end, the watchdog stops, and the group
    # is destroyed (or left alone when the process did not create it)

They open and close in this order on every rank, whatever fails in between, so the Trainer
opens them in one line and its ``fit()`` reads as the loop. The lock (:mod:`ddpkit.checkpoint.run_lock`)
comes right after the group, before anything is written into ``output_dir`` or resumed from it: rank 0
takes it and every rank learns whether it did, so a second run on a live run's directory is refused there.
Before it, the ranks agree on the job's key (:mod:`ddpkit.distributed.control_auth`), which tags the
watchdog's and the stop request's messages in the store.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.run_lock import RunLock
from ddpkit.config.schema import Config
from ddpkit.distributed.control_auth import agree_job_key
from ddpkit.distributed.env import DistEnv
from ddpkit.distributed.process_group import Runtime, barrier, group_options, process_group
from ddpkit.goodput.ledger import GoodputLedger
from ddpkit.reporting.events import Events
from ddpkit.watchdog.heartbeat import Watchdog

__all__ = ["Worker", "worker_scope"]


@dataclass
class Worker:
    """One rank's distributed context for a run (see the module docstring)."""

    config: Config
    runtime: Runtime
    watchdog: Watchdog
    ledger: GoodputLedger
    #: What the run opened and the scope closes on the way out, newest first, with the attempt's
    #: status (FINISHED, STOPPED or FAILED): the reporter's sinks, compile's settings, signal handlers.
    closing: list[Any] = field(default_factory=list)

    def close_on_exit(self, *parts: Any) -> None:
        """Call each part's ``close(status)`` when the scope ends, however it ends (before the listeners hear of it)."""
        self.closing.extend(parts)

    def barrier(self, where: str = "", *, note: Callable[..., None] = lambda *_: None) -> None:
        """Wait for every rank; with ``dist.debug`` a monitored barrier names the ranks that never arrive
        (``note``: the debug step log, told ``where`` first)."""
        note("barrier: %s", where)
        barrier(debug=self.config.dist.debug, timeout=self.config.dist.timeout)


@contextlib.contextmanager
def worker_scope(config: Config, env: DistEnv, events: Events, *, step: Callable[[], int]) -> Iterator[Worker]:
    """Open the process group, the watchdog and the ledger for ``config`` (``step``: the last completed step);
    on the way out tell ``events`` how the attempt ended, while all three are still open."""
    group = process_group(env, **group_options(config), trace_dir=Path(config.output_dir) / "logs")
    with (
        group as runtime,
        contextlib.nullcontext(agree_job_key()),  # a collective, once the group is up: before anything uses the store
        RunLock.for_run(config, runtime),  # one writer per run directory: nothing is written before it
        Watchdog.for_run(config, runtime, step=step) as watchdog,
        GoodputLedger.for_run(config, runtime, step=step) as ledger,
    ):
        worker = Worker(config, runtime, watchdog, ledger)
        try:
            yield worker
        except BaseException as error:
            _close(worker, ledger.status_of(error))
            if isinstance(error, Exception):  # not Ctrl-C: nothing to save for a user who asked to stop
                events.failure(error)
            events.exit(ledger.status_of(error))
            raise
        _close(worker, ledger.status_of(None))
        events.exit(ledger.status_of(None))


def _close(worker: Worker, status: str) -> None:
    for part in reversed(worker.closing):
        part.close(status)
