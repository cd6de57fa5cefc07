"""A hang watchdog on every rank: names the stuck rank with its Python stacks, then stops the job.

    with Watchdog.for_run(config, runtime, progress=progress, key=key, position=events.position) as watchdog:
        events.add(watchdog)          # on_phase: the long spans only (checkpoint, ...); the phase: events.position
        Evaluation(models, loader, device=device, autocast=autocast, ticking=watchdog.ticking)  # each batch: progress

The training thread only writes attributes (its spans write the phase and an edge count into the events'
:class:`~ddpkit.reporting.events.Position`, the Trainer the step); a daemon thread makes a heartbeat
of them twice a second, at a cost that does not grow with the job (docs/scaling.md, "The control plane"):

* Every rank writes its heartbeat (step, phase, counters, pid) into its slot of its node's board,
  a file in shared memory (:mod:`ddpkit.watchdog.node_board`): no store call.
* One rank per node leads it (local rank 0 while it beats, :mod:`ddpkit.watchdog.node`): it reads
  its node-mates' slots and, through the job's key-value store (torchrun's TCPStore; never a
  collective) under ``ddpkit/watchdog/<n>/``, sets ``progress`` when a rank of its node made
  progress, ``slow`` while one is in a slow phase and, every few seconds, ``node/<n>`` (the node's
  beats and silent ranks); it polls ``alarm`` and relays what it reads to its node-mates.
  "Progress" is any change of a rank's step, phase or counter, or its main thread running code it
  has not run since the last change (so a minutes-long ``torch.compile`` is progress, while a thread
  blocked on a lock, a queue or a collective is not).
* Rank 0 judges (:mod:`ddpkit.watchdog.monitor`): it reads ``progress`` and ``slow``, two keys. With
  no progress for ``dist.hang_timeout`` seconds (``dist.slow_phase_timeout`` while a rank is in setup,
  compile, a checkpoint or its first batch), it raises the alarm. A deputy (the first rank of node 1,
  or rank 1 on one node) watches rank 0's own record, ``judge``, and raises it when rank 0 goes silent.
* ``alarm``: the first alarm wins (``compare_set``). The rank that raised it reads every node's record,
  classifies the ranks (:mod:`ddpkit.watchdog.report`), asks the suspects for their stacks (``want``;
  every live rank in a job of up to 64), writes ``<output_dir>/logs/hang-<YYYYmmdd-HHMMSS>.txt``, prints
  it to stderr (the launcher's output) and every rank exits with :data:`HANG_EXIT_CODE` (3).
  ``failed`` alarms come from a rank whose ``fit`` raised (:meth:`Watchdog.stop`): ranks on other
  nodes, which under NCCL could wait for ``dist.timeout``, exit with code 1 naming it within
  seconds (ranks on the failing rank's node are stopped by torchrun first). A rank frozen in C code
  that keeps the GIL stops this thread too: then :mod:`ddpkit.watchdog.backstop` has its stacks and step.

The store may live in a rank (``ddpkit run`` hosts it in rank 0), so every store call runs on a
helper thread with a short deadline: a frozen rank 0 makes calls time out, and a node whose leader
cannot reach the store for ``dist.hang_timeout`` writes reports of its own and exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddpkit.config.checks import hang_timeout_seconds
from ddpkit.config.schema import Config
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import EXIT_FAILURE, first_line
from ddpkit.progress import Progress
from ddpkit.reporting.events import Position
from ddpkit.watchdog.backstop import NO_BACKSTOP, open_backstop
from ddpkit.watchdog.failure import announce
from ddpkit.watchdog.monitor import HANG_EXIT_CODE, Monitor, report_alone
from ddpkit.watchdog.node import Node
from ddpkit.watchdog.node_board import NodeBoard, board_name
from ddpkit.watchdog.report import SLOW_PHASES, layout_coordinate, stack_signature
from ddpkit.watchdog.store_io import StoreClient, StoreDown, own_client, terminate, write_error_file

__all__ = ["Watchdog", "HANG_EXIT_CODE", "FAILED_PEER_EXIT_CODE", "announce_failure"]

#: Exit code of a rank stopped because another rank failed (1)
FAILED_PEER_EXIT_CODE = EXIT_FAILURE
#: Seconds between heartbeats
INTERVAL = 0.5
#: A store call with no answer by then counts as "the store is not responding"
STORE_DEADLINE = 5.0
#: stop(): the thread's last round of store calls, each within the deadline
JOIN_WAIT = 2 * STORE_DEADLINE + INTERVAL
#: On the failed rank's host: let torchrun stop its node-mates first
FAILURE_GRACE = 3.0
#: Watchdogs started in this process: a fresh key prefix for each fit() of a group
_generation = 0
#: The running watchdog, for announce_failure()
_current: Watchdog | None = None


class Watchdog:
    """Heartbeats and hang detection for one rank of one ``fit()``; see the module docstring."""

    enabled = True

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        world_size: int,
        hang_timeout: float,
        slow_timeout: float,
        log_dir: Path,
        progress: Progress | None = None,
        local_world_size: int = 1,
        key: bytes | None = None,
        position: Position | None = None,
        coordinate: str | None = None,
    ):
        global _generation
        _generation += 1
        prefix = f"ddpkit/watchdog/{_generation}"
        self.client = StoreClient(dist.PrefixStore(prefix, own_client(store)), STORE_DEADLINE, key=key)
        self.rank = rank
        self.world_size = world_size
        self.log_dir = Path(log_dir)
        # The loop's counter: its step is read from this thread in each heartbeat.
        self.progress = progress if progress is not None else Progress()
        self.hang_timeout = hang_timeout
        self.slow_timeout = max(slow_timeout, hang_timeout)
        # Written by the training thread, read by the watchdog thread: where it is (the events' spans write it)
        self.position = position if position is not None else Position()
        #: Under a pipeline, where this rank sits ("stage 1 of replica 0"): in every beat, so a report names it.
        self.coordinate = coordinate
        # Progress inside a phase, counted by tick() and ticking(): validation batches
        self.ticks = 0
        self.phase_ticks = 0
        # The step fit() started from: its data phase may be slow
        self._first_step: int | None = None
        self.backstop: Any = NO_BACKSTOP
        self._stopped = threading.Event()
        self.handling_hang = False
        self.published_failure = False
        # See _count_failure_seen
        self._seen_lock = threading.Lock()
        self._counted_failure = False
        self._thread = threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True)
        self._host = socket.gethostname()
        self._seq = 0
        self._novel = 0
        self._seen_stacks = set()
        self._last_local: tuple[Any, ...] = ()
        self._since = time.time()
        self.last_beat: dict[str, Any] = {}
        local = local_world_size if local_world_size > 0 and world_size % local_world_size == 0 else 1
        self.local_world_size = local
        self.nodes = world_size // local
        self._prefix = prefix
        # start() opens the node's board: a watchdog never started leaves nothing in /dev/shm
        self.node: Node
        self._monitor = Monitor(self)

    @classmethod
    def for_run(
        cls,
        config: Config,
        runtime: Runtime,
        *,
        progress: Progress,
        key: bytes | None = None,
        position: Position | None = None,
    ) -> Watchdog | _Off:
        """The watchdog ``config.dist`` asks for, or a no-op one (off, a world of one, no store); ``key``: the job's
        (the worker's), which tags what it writes and must tag what it reads (ddpkit.distributed.control_auth);
        ``position``: the events' (where the training thread is)."""
        d = config.dist
        hang = hang_timeout_seconds(config.dist)
        if hang is None or runtime.env.world_size == 1 or runtime.store is None:
            return _Off()
        slow = d.slow_phase_timeout if d.slow_phase_timeout is not None else 0.9 * d.timeout
        return cls(
            runtime.store,
            rank=runtime.env.rank,
            world_size=runtime.env.world_size,
            hang_timeout=hang,
            slow_timeout=slow,
            log_dir=Path(config.output_dir) / "logs",
            progress=progress,
            local_world_size=runtime.env.local_world_size,
            key=key,
            position=position,
            coordinate=layout_coordinate(
                runtime.env.rank,
                world_size=runtime.env.world_size,
                pipeline=config.parallel.pipeline,
                tensor=config.parallel.tensor,
            ),
        )

    # --- the training thread's side: attribute writes only -----------------------------------

    #: The spans :meth:`on_phase` hears: the long ones, not the step's (the phase itself is read from ``position``);
    #: "sample" is train.sample's generation.
    phases = ("checkpoint", "evaluation", "compile", "sample")

    def on_phase(self, name: str | None) -> None:
        """One of :attr:`phases` starts (its name) or ends (None)."""
        if name is not None:
            # Validation batches counted from here
            self.phase_ticks = 0
            # A GIL-frozen rank's page: this phase, or "loop" once a step ends (at_step)
            self.backstop.at_phase(name)

    def on_fit_start(self) -> None:
        # The step resumed from: its first batch may be slow
        self._first_step = self.progress.step
        self.backstop.at_step(self._first_step)

    def on_step_end(self, step: int) -> None:
        # The page says this step and "loop" in one write: heartbeats go twice a second, and a hundred steps may
        # pass between two
        self.backstop.at_step(step)

    def tick(self) -> None:
        """Progress inside a phase (one validation batch): a long validation is not a hang."""
        self.ticks += 1
        self.phase_ticks += 1

    def ticking(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` that also counts as progress each time it is called (e.g. ``validation_step``)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            self.ticks += 1
            self.phase_ticks += 1
            return fn(*args, **kwargs)

        return call

    # --- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.stop(exc if isinstance(exc, Exception) else None)

    def start(self) -> Watchdog:
        global _current
        if _current is not None and _current is not self and _current._stopped.is_set():
            # A failed watchdog keeps its client open for announce_failure(); once replaced, no one announces
            # it, and its thread would wait for requests for the rest of the process.
            _current.client.close()
        _current = self
        self.backstop = open_backstop(
            self.log_dir, rank=self.rank, hang_timeout=self.hang_timeout, step=self.progress.step
        )
        local = self.local_world_size
        name = board_name(self.client.key, self._prefix, node=self.rank // local)
        board = NodeBoard.open(name, slots=local, index=self.rank % local)
        self.node = Node(
            board, self.client, rank=self.rank, local_world_size=local, nodes=self.nodes, interval=INTERVAL
        )
        # A first beat now: a rank frozen before the thread's first is still named
        with contextlib.suppress(StoreDown):
            self._publish()
            # The keys rank 0 reads exist from the start
            if self.rank == 0:
                self.client("set", "progress", "start")
                self.client("set", "slow", "start")
        self._thread.start()
        return self

    def stop(self, error: BaseException | None = None) -> None:
        """Stop watching. With ``error``, first tell the other ranks that this rank failed and why.

        Without one, the threads end first and the client closes after saying "done": called
        before the process group is destroyed, so no thread of the watchdog is in a store call when
        the group and then the interpreter go (see :class:`StoreClient`). After a failure the
        process exits at once; the client stays open for :func:`announce_failure`, which closes it.
        """
        # Never started: only the store client's thread to end
        if not hasattr(self, "node"):
            return self.client.close()
        if self._stopped.is_set():
            return
        # A new object: the events' own position is left as it is
        self.position = Position("done", self.position.edges)
        self._stopped.set()
        if (
            error is None
            and not self.handling_hang
            and self._thread.is_alive()
            and self._thread is not threading.current_thread()
        ):
            # Its last round of store calls (a thread reporting a hang ends the process)
            self._thread.join(JOIN_WAIT)
        try:
            if error is not None and not self.handling_hang:
                message = f"{type(error).__name__}: {first_line(error)}"
                alarm = {"kind": "failed", "rank": self.rank, "host": self._host, "message": message}
                mine = json.dumps(alarm)
                self.published_failure = self.client("compare_set", "alarm", "", mine).decode() == mine
                # Another rank failed first: this rank has seen its failure
                if not self.published_failure:
                    self._count_failure_seen()
            else:
                # Phase "done": not counted as silent, and no longer leading its node
                self._publish()
        except StoreDown:
            # The store is gone: the job is ending anyway
            pass
        # Nothing stays armed after fit()
        self.backstop.close()
        self.node.board.close()
        if error is None:
            self.client.close()

    # --- the watchdog thread ----------------------------------------------------------------------

    def _run(self) -> None:
        store_ok = time.monotonic()
        problem = ""
        while not self._stopped.wait(INTERVAL):
            try:
                # Its timer fires only if this thread stops running
                self.backstop.arm()
                news = self.node.step(self.beat())
                # The store was last heard of when the old leader last beat
                if self.node.took_over_at is not None:
                    store_ok = min(store_ok, time.monotonic() - max(0.0, time.time() - self.node.took_over_at))
                    self.node.took_over_at = None
                if news.get("alone"):
                    return self._alone(news["alone"]["problem"], news["alone"]["since"])
                if news.get("alarm"):
                    return self._respond(news["alarm"])
                self._monitor.check()
                store_ok = time.monotonic()
                problem = ""
            except StoreDown as exc:
                # The first symptom says most
                problem = problem or str(exc)
                if time.monotonic() - store_ok > self.hang_timeout and not self._stopped.is_set():
                    return self._alone(problem, time.time() - (time.monotonic() - store_ok))
            except Exception as exc:
                # A bug here must never take the training run down
                print(
                    f"ddpkit: watchdog on rank {self.rank} stopped: {type(exc).__name__}: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
                return

    def beat(self) -> dict[str, Any]:
        """This rank's heartbeat, read from the training thread's attributes (watchdog thread)."""
        position = self.position
        phase = position.phase
        local = (self.progress.step, phase, position.edges + self.ticks, self.phase_ticks)
        # Visible progress: no need to walk the stacks (a training step changes it)
        if local != self._last_local:
            self._last_local = local
            self._since = time.time()
            self._seen_stacks = set()
        else:
            signature = stack_signature()
            if signature not in self._seen_stacks and len(self._seen_stacks) < 10_000:
                # The first signature after a change is the baseline
                self._novel += len(self._seen_stacks) > 0
                self._seen_stacks.add(signature)
        self._seq += 1
        first_batch = phase == "data" and local[0] == self._first_step
        self.last_beat = {
            "rank": self.rank,
            "seq": self._seq,
            "step": local[0],
            "phase": phase,
            "ticks": local[2],
            "phase_ticks": local[3],
            "novel": self._novel,
            "since": self._since,
            "host": self._host,
            "pid": os.getpid(),
            "slow": phase in SLOW_PHASES or first_batch,
            "t": time.time(),
        }
        if self.coordinate is not None:
            self.last_beat["where"] = self.coordinate
        return self.last_beat

    def _publish(self) -> None:
        """One beat outside the thread's loop (start, stop): the board, the node's record, rank 0's ``judge``."""
        self.node.step(self.beat())
        if self.node.leading:
            beats, silent = self.node.survey(time.time())
            self.node.record(beats, silent, time.time(), None)
        if self.rank == 0:
            self.client("set", "judge", json.dumps(self.last_beat))

    def _respond(self, alarm: dict[str, Any]) -> None:
        if self._stopped.is_set():
            return
        # Relayed to the node-mates, if this rank leads
        self.node.news["alarm"] = alarm
        if alarm["kind"] == "failed":
            return self._peer_failed(alarm)
        # From here this thread ends the process; the main thread must not race it
        self.handling_hang = True
        # This rank is live and tells its node so: no dump meanwhile
        self.backstop.close()
        if alarm["by"] == self.rank:
            return self._monitor.report(alarm)
        self._monitor.serve(alarm)

    def _peer_failed(self, alarm: dict[str, Any]) -> None:
        # Relay the failure to the node-mates before this thread waits
        self.node.step(self.beat())
        self._try(self._count_failure_seen)
        # On the failed rank's node torchrun's agent stops this rank itself (its summary then names
        # the failed rank first); elsewhere no agent knows, so go now.
        if self._stopped.wait(FAILURE_GRACE if alarm["host"] == self._host else 0.0):
            # This rank is ending by itself (its own error, or torchrun stopped it)
            return
        message = f"rank {alarm['rank']} (host {alarm['host']}) failed: {alarm['message']}"
        print(f"ddpkit: rank {self.rank}: stopping because {message}", file=sys.stderr, flush=True)
        write_error_file(f"stopped because {message}", when=time.time() + 1, code=FAILED_PEER_EXIT_CODE)
        terminate(FAILED_PEER_EXIT_CODE)

    def _count_failure_seen(self) -> None:
        """Add this rank to ``failed_seen`` once, whichever thread (watchdog or training) hears first."""
        with self._seen_lock:
            if not self._counted_failure:
                self._counted_failure = True
                self.client("add", "failed_seen", 1)

    def _alone(self, problem: str, since: float) -> None:
        """The store stopped answering: report this rank alone (no other rank can be reached) and exit; a rank
        that leads its node tells its node-mates first, which do the same."""
        if self.node.leading:
            self.node.news["alone"] = {"problem": problem, "since": since}
            # No store call reaches the store, but the relay through the node's board goes out
            self._try(lambda: self.node.step(self.beat()))
        report_alone(self, problem, since)

    def _try(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except StoreDown:
            return None


class _Off:
    """The watchdog when it is off: same methods, no thread, nothing published; no ``on_phase``, so as a listener
    it hears nothing and Reporter.span stays free."""

    enabled = False

    def tick(self) -> None: ...

    def ticking(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    def start(self) -> _Off:
        return self

    def stop(self, error: BaseException | None = None) -> None: ...

    __enter__ = start

    def __exit__(self, *exc: object) -> None: ...


def announce_failure(*, wait: float = 2.0) -> None:
    """After a failed ``fit()``: give the other ranks up to ``wait`` s to read this rank's failure.

    The failure was published by :meth:`Watchdog.stop`; a rank that hosts the store (rank 0 under
    ``ddpkit run``) takes it with it when it exits, so the publisher waits until every other rank
    has seen it (a rank that failed too counts as having seen it) and then sets ``failed_done``.
    Rank 0, when another rank published first, waits for ``failed_done`` before it exits.
    """
    wd = _current
    if wd is None or not wd._stopped.is_set():
        return
    try:
        announce(wd, wait)
    finally:
        wd.client.close()
