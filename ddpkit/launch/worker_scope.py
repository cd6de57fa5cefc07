"""What a worker holds for one ``fit()``: its process group, the run directory's lock, the stop on a signal,
its hang watchdog and its goodput ledger.

    with worker_scope(config, env, events, progress=progress) as worker:
        worker.runtime        # the process group is up: device, backend, store (ddpkit.distributed)
        worker.stop           # checkpoint.save_on_signals: handlers, the agreed stop step, worker.stop.stopped
        worker.watchdog       # heartbeats through the store; reads the phase from events.position
        worker.ledger         # goodput.jsonl: restore, first step, checkpoints, the attempt's end
        worker.barrier("end of training")
    # on the way out: events.failure(error) if the body raised (the crash save), events.exit(status) (every
    # listener's on_exit, in the list's order); then, innermost first, the ledger writes the attempt's end,
    # the watchdog stops, the signal handlers go back, the lock is released and the group is destroyed

They open and close in this order on every rank, whatever fails in between, so the Trainer opens them
in one line and its ``fit()`` reads as the loop. They stay context managers, unlike the run's listeners:
each must outlive every listener's ``on_exit`` (a hang in a listener's cleanup is still caught, the
attempt's end is written after everything). The lock (:mod:`ddpkit.checkpoint.run_lock`) comes right
after the group, before anything is written into ``output_dir`` or resumed from it: rank 0 takes it and
every rank learns whether it did, so a second run on a live run's directory is refused there. Before it,
the ranks agree on the job's key (:mod:`ddpkit.distributed.control_auth`), held here by the worker (no
module keeps it), which the worker hands to the stop on a signal and the watchdog: it tags their messages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ddpkit.checkpoint.preemption import StopOnSignal
from ddpkit.checkpoint.run_lock import RunLock
from ddpkit.config.schema import Config
from ddpkit.distributed.collectives import barrier
from ddpkit.distributed.control_auth import agree_job_key
from ddpkit.distributed.env import DistEnv
from ddpkit.distributed.process_group import Runtime, group_options, process_group
from ddpkit.goodput.ledger import GoodputLedger
from ddpkit.parallel.layout import data_parallel_for
from ddpkit.progress import Progress
from ddpkit.reporting.events import Events
from ddpkit.watchdog.heartbeat import Watchdog

__all__ = ["Worker", "worker_scope"]


@dataclass
class Worker:
    """One rank's distributed context for a run (see the module docstring)."""

    config: Config
    runtime: Runtime
    key: bytes
    stop: StopOnSignal
    watchdog: Watchdog
    ledger: GoodputLedger

    def barrier(self, where: str = "", *, note: Callable[..., None] = lambda *_: None) -> None:
        """Wait for every rank; with ``dist.debug`` a monitored barrier names the ranks that never arrive
        (``note``: the debug step log, told ``where`` first)."""
        note("barrier: %s", where)
        barrier(debug=self.config.dist.debug, timeout=self.config.dist.timeout)


@contextlib.contextmanager
def worker_scope(config: Config, env: DistEnv, events: Events, *, progress: Progress) -> Iterator[Worker]:
    """Open the process group, the lock, the stop, the watchdog and the ledger for ``config`` (``progress``: the
    loop's counter, whose step is the last completed one); on the way out tell ``events`` how the attempt ended,
    while all of them are still open."""
    preload = data_parallel_for(config.parallel).preload
    group = process_group(env, **group_options(config, preload=preload), trace_dir=Path(config.output_dir) / "logs")
    with group as runtime:
        # A collective, once the group is up: before anything uses the store
        key = agree_job_key()
        with (
            # One writer per run directory: nothing is written before it
            RunLock.for_run(config, runtime),
            StopOnSignal.for_run(config, runtime, key=key) as stop,
            Watchdog.for_run(config, runtime, progress=progress, key=key, position=events.position) as watchdog,
            GoodputLedger.for_run(config, runtime, progress=progress, stop=stop) as ledger,
        ):
            worker = Worker(config, runtime, key, stop, watchdog, ledger)
            try:
                yield worker
            except BaseException as error:
                # Not Ctrl-C: nothing to save for a user who asked to stop
                if isinstance(error, Exception):
                    events.failure(error)
                events.exit(ledger.status_of(error))
                raise
            events.exit(ledger.status_of(None))
