"""Stop on a signal without losing a step: every rank stops after the same optimizer step, rank 0
saves exactly that step, and the process exits with :data:`PREEMPTED_EXIT_CODE`.

    with StopOnSignal.for_run(config, runtime, key=key) as stop:   # the worker's scope: handlers on, then off
        ...                               # the checkpointer, at every optimizer-step boundary:
        if stop.stop_here(step):          # one attribute read until a signal arrives
            ...                           # save this step; the loop sees stop.stopped and ends
        stop.announce(step, saved_in=checkpoint_dir)   # every rank prints its stop line
    stop.raise_if_stopped()               # Preempted: exit code 75, the same command resumes

``stop.stopped`` is the one place a run learns it was stopped on a signal: the loop ends on it, the
attempt ends STOPPED in the goodput ledger on it, and :meth:`StopOnSignal.raise_if_stopped` ends the
process with it.

Clusters stop jobs on purpose: SLURM sends SIGTERM (or ``--signal=USR1@90`` before the time
limit), Kubernetes SIGTERM before evicting a pod, torchrun's agent forwards what it receives. The
first signal means "stop soon and save"; a second one means "stop now" (:class:`Preempted` is
raised at once, and the newest complete checkpoint stays the one to resume from).

How the ranks agree on the stop step, with no collective per step:

1. The signal handler only sets a flag (a rank may be anywhere, even inside a collective). A
   background thread per rank publishes the request to the process group's key-value store and
   polls the store for a request from any other rank (rank 0 alone being signalled stops all).
   The training thread's per-step cost is reading one attribute, :attr:`StopOnSignal.requested`.
2. Once a rank sees the request, at each step boundary it publishes the step it is at (its
   *proposal*, once) and counts the proposals in the store: one store round trip per step, only
   while stopping.
3. When all ranks have proposed, the stop step is ``max(proposals) + 1``. No rank can have gone
   past it: DDP's gradient allreduce keeps ranks within one optimizer step of each other, and
   until the last proposal is written its author has not started the next step, so nobody has
   finished it. Every rank then trains up to the stop step and stops there.

A forked child (a DataLoader worker) inherits the handler and ignores the signal, so the loader
keeps serving the few batches left until the stop step; its parent ends it.

Python lets only the main thread install signal handlers. A loop in another thread (Ray Train runs
the training function in a worker thread) installs none and is stopped by its engine instead (Ray
kills the worker group and restarts it); it still polls the store, so a signal another rank
received stops it at the agreed step too. Nothing that protects completed work depends on a
handler: the crash save (:mod:`ddpkit.checkpoint.crash_save`) and memory snapshots work without.

The request and the proposals carry a tag made with the job's key
(:mod:`ddpkit.distributed.control_auth`): a request someone else wrote to the store is ignored (and
logged once); a proposal without a valid tag counts as not made yet, and every rank writes its own
again at each step boundary until the stop step is agreed.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

from ddpkit.config.schema import Config
from ddpkit.distributed.control_auth import read_signed, sign
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import EXIT_PREEMPTED, DdpkitError, report_error

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "StopOnSignal", "signal_numbers"]

#: Exit code of a worker (and of ``ddpkit run``) stopped by a signal after saving (75, defined in
#: ddpkit.errors with the others). Relaunching the same command resumes.
PREEMPTED_EXIT_CODE = EXIT_PREEMPTED

_REQUEST = "request"
_PROPOSALS = "proposals"


class Preempted(DdpkitError):
    """The run stopped on a signal after saving its state; the same command resumes it.

    Its exit code is ``run.requeue_exit_code`` (75 by default) where the worker entry point knows
    the config (:func:`ddpkit.launch.entrypoint.run_trainer`), else ``exit_code`` or 75."""

    exit_code = PREEMPTED_EXIT_CODE
    label = "stopped"

    def __init__(self, *args: object, exit_code: int | None = None):
        super().__init__(*args)
        if exit_code is not None:
            self.exit_code = exit_code


def signal_numbers(names: Sequence[str]) -> list[signal.Signals]:
    """``["SIGTERM", "USR1"]`` -> signal numbers; an unknown name is a ValueError naming it."""
    numbers = []
    for name in names:
        full = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
        if full in ("SIGKILL", "SIGSTOP") or not hasattr(signal, full):
            raise ValueError(f"{name!r} is not a signal a process can catch (e.g. SIGTERM, SIGUSR1, SIGUSR2, SIGINT)")
        numbers.append(signal.Signals[full])
    return numbers


class StopOnSignal:
    """Signal handlers plus the store protocol that turns one rank's signal into a common stop step."""

    def __init__(
        self, names: Sequence[str], *, store: Any, rank: int, world_size: int, key: bytes, poll_interval: float = 0.1
    ):
        self.rank = rank
        self.world_size = world_size
        # Read by the training thread every step: keep it a plain attribute
        self.requested = False
        # The signal this process got, if any
        self.received: str | None = None
        self.stop_step: int | None = None
        # True from the optimizer step every rank agreed to stop at
        self.stopped = False
        # The stop, once announced on every rank
        self._preempted: Preempted | None = None
        self._store = _prefixed(store, "ddpkit/stop")
        # The job's key (ddpkit.distributed.control_auth): tags what this rank writes and reads
        self._key = key
        self._pid = os.getpid()
        self._proposed = False
        self._published = False
        # The step this rank proposed, once it has
        self._proposal = ""
        # "rank 1 received SIGTERM", read with the proposals
        self._request_text: str | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        numbers = signal_numbers(names)
        # Python only lets the main thread set handlers
        if threading.current_thread() is threading.main_thread():
            for number in numbers:
                self._previous[number] = signal.signal(number, self._on_signal)
        # Without handlers (a loop in a worker thread) this rank still follows another rank's request.
        if numbers and self._store is not None and world_size > 1:
            self._thread = threading.Thread(
                target=self._poll, args=(poll_interval,), name="ddpkit-stop-poll", daemon=True
            )
            self._thread.start()

    @classmethod
    def for_run(cls, config: Config, runtime: Runtime, *, key: bytes) -> StopOnSignal:
        """The stop of this run: handlers for ``checkpoint.save_on_signals``, the store's protocol between ranks."""
        env = runtime.env
        return cls(
            config.checkpoint.save_on_signals, store=runtime.store, rank=env.rank, world_size=env.world_size, key=key
        )

    def __enter__(self) -> StopOnSignal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stop_here(self, step: int) -> bool:
        """At every optimizer-step boundary: True once, at the step every rank agreed to stop at (then
        :attr:`stopped`)."""
        if self.requested and not self.stopped and self.agreed(step):
            self.stopped = True
            return True
        return False

    def announce(self, step: int, *, saved_in: str) -> None:
        """If a signal stopped the run: every rank prints its stop line now, once step ``step`` is saved in
        ``saved_in``."""
        if self.stopped and self._preempted is None:
            self._preempted = Preempted(
                f"{self.describe()}: step {step} is saved in {saved_in}; run the same command again to resume from it"
            )
            report_error(self._preempted, command="ddpkit", rank=self.rank if self.world_size > 1 else None)

    def raise_if_stopped(self) -> None:
        """After the run's last save and flush: end a signal-stopped run with :class:`Preempted` (exit code 75)."""
        if self.stopped:
            raise self._preempted or Preempted(f"{self.describe()}: stopped; run the same command again to resume")

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            # A forked DataLoader worker: its parent decides when to stop
            return
        name = signal.Signals(signum).name
        if self.received is not None:
            raise Preempted(f"a second {name} arrived while stopping: stopped at once, without saving this step")
        self.received = name
        self.requested = True

    def _poll(self, interval: float) -> None:
        """Publish this rank's signal; notice another rank's. Ends on close() or a lost store."""
        try:
            while not self._closed.wait(interval):
                if self.received is not None and not self._published:
                    self._publish()
                elif not self.requested and self._store.check([_REQUEST]) and self._read(_REQUEST) is not None:
                    self.requested = True
        except Exception:
            # The group is going away (a peer failed, or the run ended): nothing to stop
            return

    def _publish(self) -> None:
        """Put this rank's signal in the store, where the other ranks' poll threads find it."""
        self._store.set(_REQUEST, sign(self._key, _REQUEST, f"rank {self.rank} received {self.received}"))
        self._published = True

    def _read(self, name: str, raw: bytes | None = None) -> str | None:
        """The value of ``name`` (read now unless ``raw`` is given), or None without a valid tag (logged once)."""
        return read_signed(self._key, name, self._store.get(name) if raw is None else raw)

    def agreed(self, step: int) -> bool:
        """Call at every optimizer-step boundary once :attr:`requested` is set: True at the agreed stop step."""
        if self.world_size == 1 or self._store is None:
            self.stop_step = step
            return True
        if self.stop_step is None:
            # before the poll thread does: read below, never waited for
            if self.received is not None and not self._published:
                self._publish()
            mine = f"proposal/{self.rank}"
            if not self._proposed:
                self._proposal = str(step)
            # again each step: someone may have overwritten it
            self._store.set(mine, sign(self._key, mine, self._proposal))
            if not self._proposed:
                self._store.add(_PROPOSALS, 1)
                self._proposed = True
            names = [_REQUEST] + [f"proposal/{r}" for r in range(self.world_size)]
            # The count alone could be forged (an `add` carries no tag): check the keys exist, so the read never waits.
            if self._store.add(_PROPOSALS, 0) < self.world_size or not self._store.check(names):
                return False
            # Every rank proposed, so the request is in the store (a rank that received the signal
            # published it before proposing; the others proposed after seeing it). Read now, while
            # all ranks are alive: rank 0 (and the store) may be gone later.
            request, *proposals = (self._read(name, raw) for name, raw in zip(names, self._store.multi_get(names)))
            if any(value is None for value in proposals):
                # Overwritten by someone else: its rank writes it again at its next step boundary
                return False
            self._request_text = request or "a signal on another rank"
            self.stop_step = max(int(value) for value in proposals) + 1
        return step >= self.stop_step

    def describe(self) -> str:
        """``"SIGTERM on rank 1"``: what asked for the stop, for messages."""
        if self.received is not None:
            return f"{self.received} (received by rank {self.rank})"
        return self._request_text or "a signal on another rank"

    def close(self) -> None:
        """Stop the polling thread and put the previous handlers back."""
        self._closed.set()
        if self._thread is not None:
            # Not mid-call into the store when the group is destroyed
            self._thread.join(timeout=2.0)
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()


def _prefixed(store: Any, prefix: str) -> Any:
    if store is None:
        return None
    import torch.distributed as dist

    return dist.PrefixStore(prefix, store)
