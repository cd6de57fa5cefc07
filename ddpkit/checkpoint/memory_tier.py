"""In-memory snapshots: a copy of the run's state in ``/dev/shm`` every K steps, so losing every
worker of a host at once (a SIGKILL to all, a node-level OOM kill) costs at most K steps.

    checkpoint:
      memory_every_steps: 10        # or auto (the default); ddpkit run exp.yaml --max-restarts 3

    snapshots = MemorySnapshots.arm(config, runtime, checkpointer, ledger=ledger)   # once, after resume
    newest_snapshot(config)         # what a restart compares with the newest disk checkpoint

Every ``memory_every_steps`` optimizer steps, at the step boundary after the step (``on_step_start``: the
step is then complete on every rank, its validation and disk checkpoint included), every rank joins
the checkpointer's ``capture`` (one small all-gather of the RNG states), rank 0 copies the state to new
CPU tensors and a background thread writes it with the same crash-safe writer as disk
checkpoints (temporary file, rename, manifest with size and SHA-256 last) into
``/dev/shm/ddpkit-<run>/``. ``/dev/shm`` is memory: the copy outlives the processes, not the
host (or a reboot), which is what disk checkpoints are for.

``memory_every_steps: auto`` (the default) spaces snapshots with the planner that spaces disk checkpoints
under ``checkpoint.every_steps: auto`` (:class:`ddpkit.checkpoint.interval.YoungDaly`): every
``sqrt(2 * checkpoint.mtbf_hours * T_block)`` seconds of training (Young 1974; Daly 2006; ``T_block``: how
long one snapshot blocks training), and never so often that snapshots block more than 1% of it.
A snapshot blocking 8 ms with the default MTBF of 24 h comes every 37 s (0.02% of the time). A job
that fails often says so with a small ``checkpoint.mtbf_hours`` and gets snapshots that often.
The first interval is planned at step 20 from an estimate (:data:`PLAN_STEP`, :func:`estimated_block`),
every later one from the last snapshot's measured blocking time; each choice is logged with its
inputs, and changes by more than 20% are taken. A number is used as given.

A snapshot never misleads a resume: the directory is named by the run (the output directory's
path and inode, so a deleted and recreated directory is another run), a snapshot is used only
when it is valid (manifest, size, checksum) and newer than the newest valid disk checkpoint,
the checkpointer then checks its config like any checkpoint's, and a snapshot at or below the newest disk
checkpoint is stale and removed. A finished run removes its snapshots.

A snapshot that cannot be written (a ``/dev/shm`` smaller than the state: Docker's default is
64 MB) ends the snapshots, with one warning naming the fix, never the run: the disk checkpoints
are its safety, a snapshot only shortens a restart.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any

from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint.components import Capturer, Ledger
from ddpkit.checkpoint.disk_space import human_bytes, short_of_room, state_bytes
from ddpkit.checkpoint.interval import YoungDaly
from ddpkit.checkpoint.metadata import manifest_fields
from ddpkit.config.schema import Config
from ddpkit.distributed.collectives import broadcast_object
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import CheckpointError
from ddpkit.reporting.events import Listener
from ddpkit.reporting.log import log

__all__ = ["MemorySnapshots", "snapshot_dir", "newest_snapshot", "prefer_newer", "remove_stale"]

SHM = Path("/dev/shm")
#: Snapshots kept: the newest complete one (a write in flight makes two for a moment).
KEEP = 1
#: `auto`: a snapshot may block at most this fraction of the training time between two (whatever the MTBF).
BUDGET = 0.01
#: `auto`: the step at which the first interval is planned (the step time is known by then).
PLAN_STEP = 20


def estimated_block(state_bytes: int) -> float:
    """Seconds a snapshot of ``state_bytes`` is expected to block, before one has been measured.

    The capture's all-gather and ``state_dict`` calls (a few ms) plus copying the state at 1 GB/s:
    pessimistic for a CPU's memcpy, so the first interval errs on the short side."""
    return 0.005 + state_bytes / 1e9


def snapshot_dir(config: Config) -> Path:
    """``/dev/shm/ddpkit-<run>``: named by the output directory's path and inode."""
    out = Path(config.output_dir).resolve()
    try:
        inode = out.stat().st_ino
    except OSError:
        inode = 0
    key = hashlib.sha1(f"{out}:{inode}".encode()).hexdigest()[:16]
    return SHM / f"ddpkit-{key}"


def newest_snapshot(config: Config) -> ckpt.CheckpointInfo | None:
    """The newest valid memory snapshot newer than every valid disk checkpoint, else None (stale ones removed)."""
    directory = snapshot_dir(config)
    if not directory.is_dir():
        return None
    disk = ckpt.find_latest_checkpoint(config.checkpoint_dir)
    remove_stale(directory, disk.step if disk else -1)
    snapshot = ckpt.find_latest_checkpoint(directory)
    return snapshot if snapshot is not None and (disk is None or snapshot.step > disk.step) else None


def prefer_newer(disk: ckpt.CheckpointInfo | None, config: Config) -> ckpt.CheckpointInfo | None:
    """What ``checkpoint.resume: auto`` resumes from: ``disk`` (the newest valid disk checkpoint) or a newer
    snapshot."""
    if config.checkpoint.resume != "auto" or not config.checkpoint.memory_every_steps:
        return disk
    return newest_snapshot(config) or disk


def remove_stale(directory: Path, disk_step: int) -> None:
    """Delete snapshots the disk has caught up with (manifest first, like ``files.prune``)."""
    for info in ckpt.list_checkpoints(directory):
        if info.step <= disk_step:
            ckpt.manifest_path(info.path).unlink(missing_ok=True)
            info.path.unlink(missing_ok=True)


class MemorySnapshots(Listener):
    """Takes a snapshot every ``checkpoint.memory_every_steps`` steps (see the module docstring)."""

    def __init__(
        self, config: Config, runtime: Runtime, checkpointer: Capturer, *, every: int, ledger: Ledger | None = None
    ):
        self.config = config
        self.checkpointer = checkpointer
        self.ledger = ledger
        # `auto`'s planner; a number given is its first guess and is never re-planned.
        self.interval = YoungDaly(config.checkpoint.mtbf_hours, every=every, budget=BUDGET)
        self.is_main = runtime.env.rank == 0
        self.adaptive = False
        self.directory = snapshot_dir(config)
        self._writer = ckpt.AsyncCheckpointWriter()
        self._last = checkpointer.progress.step
        self._last_time = time.perf_counter()
        #: `auto` before its first interval is planned (at PLAN_STEP).
        self.unplanned = False
        #: A write failed (e.g. /dev/shm is smaller than the state): rank 0 writes no more.
        self._failed = False

    @classmethod
    def arm(cls, config: Config, runtime: Runtime, checkpointer: Capturer, *, ledger: Ledger) -> MemorySnapshots | None:
        """The snapshots of this run (a listener for the Trainer's events) when ``checkpoint.memory_every_steps``
        is set and ``/dev/shm`` exists; else None. ``checkpointer`` captures the snapshots."""
        every = config.checkpoint.memory_every_steps
        env = runtime.env
        # one host: every rank reads its /dev/shm
        if every is None or not SHM.is_dir() or env.local_world_size != env.world_size:
            return None
        snapshots = cls(config, runtime, checkpointer, every=PLAN_STEP if every == "auto" else every, ledger=ledger)
        snapshots.adaptive = snapshots.unplanned = every == "auto"
        return snapshots

    @property
    def every(self) -> int:
        """Steps between two snapshots: ``checkpoint.memory_every_steps``, or `auto`'s interval in force."""
        return self.interval.every

    def on_step_start(self, step: int) -> None:
        # A step boundary after `every` updates (steps since the last).
        if step - self._last >= self.every:
            if self.unplanned:
                self._plan(step)
            else:
                self._take(step)

    def _take(self, step: int) -> None:
        began = time.time()
        started = time.perf_counter()
        # Every rank: the all-gather of RNG states.
        state = self.checkpointer.capture()
        # every rank joins capture() and _adapt(): rank 0 alone writes, or has stopped writing
        if self.is_main and not self._failed:
            self._write(state, step, began=began)
        if self.adaptive:
            self._adapt(step, blocked=time.perf_counter() - started, trained=started - self._last_time)
        self._last = step
        self._last_time = time.perf_counter()

    def _write(self, state: dict[str, Any], step: int, *, began: float) -> None:
        """Rank 0: stage the snapshot and start its background write, or stop the snapshots when it cannot be
        written."""
        needed = state_bytes(state)
        if (free := short_of_room(SHM, needed=needed)) is not None:
            return self._stop_writing(
                f"a snapshot needs about {human_bytes(needed)} and {SHM} has {human_bytes(free)} free"
            )
        meta = manifest_fields(state, epoch=self.checkpointer.progress.epoch, memory=True)
        try:
            # reused (pinned) host buffers
            self._writer.stage_and_submit(state, self.directory, step=step, keep_last=KEEP, meta=meta)
        except (CheckpointError, OSError) as exc:
            # the previous snapshot's write failed: say so once, train on without them
            return self._stop_writing(exc)
        if self.ledger is not None:
            self.ledger.checkpoint(began=began, step=step, kind="memory")

    def _stop_writing(self, why: BaseException | str) -> None:
        """A snapshot is an extra, not the run's safety (the disk checkpoints are): a failed write ends the
        snapshots only."""
        self._failed = True
        # A failed write's first clause; the rest is a disk checkpoint's resume advice.
        cause = str(why).split("; ")[0]
        log.warning(
            "memory snapshots stop for the rest of this run: %s. Disk checkpoints are unaffected. "
            "Give %s more room (docker run --shm-size, a Kubernetes emptyDir with medium: Memory) "
            "or set checkpoint.memory_every_steps: null",
            cause,
            SHM,
        )

    def _plan(self, step: int) -> None:
        """`auto`'s first interval, counted from the run's start, from an estimated blocking time (one broadcast)."""
        self.unplanned = False
        model = self.checkpointer.components["model"]
        # parameters and up to 2 optimizer states
        state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
        self._adapt(
            step, blocked=estimated_block(state_bytes), trained=time.perf_counter() - self._last_time, estimated=True
        )

    def _adapt(self, step: int, *, blocked: float, trained: float, estimated: bool = False) -> None:
        """Space snapshots by Young/Daly from the blocking time just measured, within BUDGET of the training.

        Rank 0's measurement decides and is broadcast, so every rank plans the same interval and takes the
        next snapshot (a collective) at the same step."""
        # No early return: every rank must join the broadcast.
        per_step = max(trained / max(1, step - self._last), 1e-9)
        blocked, per_step = broadcast_object((blocked, per_step))
        if self.interval.update(blocked=blocked, step_seconds=per_step):
            log.info(
                "memory snapshots: every %d steps from step %d (one blocks %.1f ms%s, a step takes %.2f ms, "
                "checkpoint.mtbf_hours=%g: Young/Daly sqrt(2*MTBF*T_block) = %.3g s; at most %.0f%% blocked)",
                self.every,
                self._last if estimated else step,
                blocked * 1e3,
                " (estimated)" if estimated else "",
                per_step * 1e3,
                self.config.checkpoint.mtbf_hours,
                self.interval.period(blocked),
                BUDGET * 100,
            )

    def on_exit(self, status: str) -> None:
        """Wait for the write in flight; a finished run removes its snapshots (the disk has the end)."""
        try:
            self._writer.wait()
        except Exception as exc:
            # A full /dev/shm must not fail a run that trained fine.
            if not self._failed:
                self._stop_writing(exc)
        if status == "FINISHED" and self.is_main:
            shutil.rmtree(self.directory, ignore_errors=True)
