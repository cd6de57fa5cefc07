"""A crashed worker costs zero steps: a surviving rank saves the last completed step on its way out.

    crash_save = CrashSave.arm(config, runtime, checkpointer, ledger=ledger)   # once, after resume
    events.add(crash_save)      # the step boundary events; on_failure(error): save; on_exit: clean up
    # ... if fit() fails (a peer died, torchrun's SIGTERM), the Trainer's events call crash_save.on_failure(error)

Under DDP every rank holds the complete model and optimizer state. When one worker dies (SIGKILL,
a segfault, an OOM kill) the survivors' next collective fails, or torchrun stops them with
SIGTERM; the lowest-ranked survivor on the host then writes the last *completed* optimizer step
through the crash-safe writer (:func:`ddpkit.checkpoint.files.save_checkpoint`: temporary file,
fsync, rename, manifest last), and the restarted group resumes from it. A second failure during
that save leaves the previous checkpoint as the newest valid one.

What is recorded at each step boundary, and why it is enough. Parameters and optimizer state
change only after ``on_update_start``. At the next ``on_step_start`` (before the next step's first
batch), the previous step is complete (its logging, validation and checkpoint included): this module then
copies the progress counters (three ints) and the torch RNG state (5 KB, about 2 us), nothing else,
and publishes that RNG state to the rank's slot file (:mod:`ddpkit.checkpoint.boundary_rng`). A failure
inside data, forward or backward leaves the parameters at that boundary, so the boundary is saved;
a failure between ``on_update_start`` and the next ``on_step_start`` (a half-applied update, or a
step whose validation did not finish) is not saved, and the restart uses the newest periodic
checkpoint as before. Python's and NumPy's generators are compared with
their state at the start of the attempt instead of copied each step (tens of microseconds): if the
loop drew from them the save is skipped, since the boundary's value is unknown.

Choosing the rank without collectives (the dead rank breaks them): every rank writes its pid to
``/dev/shm/ddpkit-pids-<run>/<session>-<attempt>-rank<r>.pid`` (removed when the attempt ends,
or by the next attempt after a kill); a failing rank saves if no lower rank on its host is alive.
Every rank's own torch stream goes into the file, so per-rank dropout resumes bitwise: each rank
writes its boundary state to ``<session>-<attempt>-rank<r>.rng`` in the same directory (two
memory-mapped slots, by step parity; state as the update ends (``on_step_end``) too, for a rank killed
before its next batch), and the saver reads every rank's slot for its boundary step. A rank with no valid
slot there (another host; torn by the kill) gets the saver's stream, logged. Python's and NumPy's
states are the saver's (unchanged since the attempt began). Streams (``data_position``
components) advance mid-step and are not saved this way.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint.boundary_rng import BoundarySlots, read_boundary
from ddpkit.checkpoint.components import Capturer, Ledger
from ddpkit.checkpoint.metadata import manifest_fields
from ddpkit.config.schema import Config
from ddpkit.data.position import SamplePosition
from ddpkit.distributed.process_group import Runtime
from ddpkit.distributed.processes import is_alive
from ddpkit.errors import first_line
from ddpkit.reporting.events import Listener
from ddpkit.reporting.log import log
from ddpkit.training.rng import capture_rng

__all__ = ["CrashSave", "lowest_live_rank"]

SHM = Path("/dev/shm")


def _pid_files(config: Config) -> tuple[Path, str]:
    """The run's pid directory (one per output directory) and this attempt's file-name prefix."""
    key = hashlib.sha1(str(Path(config.output_dir).resolve()).encode()).hexdigest()[:12]
    session = os.environ.get("DDPKIT_GOODPUT_SESSION") or os.environ.get("TORCHELASTIC_RUN_ID", "local")
    base = SHM if SHM.is_dir() else Path(config.output_dir)
    return base / f"ddpkit-pids-{key}", f"{session}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-"


def lowest_live_rank(directory: Path, prefix: str, world_size: int) -> int | None:
    """The lowest rank of this attempt whose recorded pid is alive on this host (None if none recorded)."""
    for rank in range(world_size):
        try:
            pid = int((directory / f"{prefix}rank{rank}.pid").read_text())
        except (OSError, ValueError):
            continue
        if is_alive(pid):
            return rank
    return None


class CrashSave(Listener):
    """Step-boundary bookkeeping on every rank, and the save the lowest survivor makes on failure."""

    def __init__(self, config: Config, runtime: Runtime, checkpointer: Capturer, *, ledger: Ledger | None = None):
        self.config = config
        self.runtime = runtime
        self.checkpointer = checkpointer
        self.ledger = ledger
        self.rank = runtime.env.rank
        self.world_size = runtime.env.world_size
        self.boundary: tuple[tuple[int, int, int], torch.Tensor] | None = None
        #: Parameters equal the boundary's (False from optimizer start to the next data start).
        self._clean = True
        #: From on_update_start to on_step_end, which publishes the provisional RNG state.
        self._updating = False
        #: This rank's torch RNG state as the last update ended.
        self._updated_rng: torch.Tensor | None = None
        self._others = (random.getstate(), _numpy_state())
        self._dir, self._prefix = _pid_files(config)
        self._pid_file: Path | None = self._dir / f"{self._prefix}rank{self.rank}.pid"
        self._slots: BoundarySlots | None = None
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            # Earlier attempts' files: their processes are gone.
            for old in [*self._dir.glob("*.pid"), *self._dir.glob("*.rng")]:
                if not old.name.startswith(self._prefix):
                    old.unlink(missing_ok=True)
            self._pid_file.write_text(str(os.getpid()))
            self._slots = BoundarySlots.create(self._rng_file(self.rank), torch.get_rng_state().numel())
        except OSError:
            self._pid_file = None

    def _rng_file(self, rank: int) -> Path:
        return self._dir / f"{self._prefix}rank{rank}.rng"

    def on_exit(self, status: str) -> None:
        """The attempt ended (any way): remove this rank's pid file, and the directory once empty.

        The RNG slot files are read by the saver after the others fail: a failed rank leaves its
        own while a lower rank (the saver) lives; the saver removes all of them after its save."""
        if self._slots is not None:
            self._slots.close()
        if self._pid_file is not None:
            # First: a higher rank that still sees it knows the glob below is to come.
            self._pid_file.unlink(missing_ok=True)
            lowest = lowest_live_rank(self._dir, self._prefix, self.world_size) if status == "FAILED" else None
            # No lower rank alive: none will read this rank's file later.
            saver = lowest is None or lowest > self.rank
            for path in self._dir.glob(f"{self._prefix}rank*.rng") if saver else ():
                if status == "FAILED" or path == self._rng_file(self.rank):
                    path.unlink(missing_ok=True)
            try:
                self._dir.rmdir()
            except OSError:
                # Another rank's file is still there.
                pass

    @classmethod
    def arm(cls, config: Config, runtime: Runtime, checkpointer: Capturer, *, ledger: Ledger) -> CrashSave | None:
        """The crash save of this run (a listener for the Trainer's events), or None when it cannot help.

        ``checkpointer`` owns what a checkpoint holds and captures it."""
        names = checkpointer.components.names
        if runtime.env.world_size == 1 or not config.checkpoint.crash_save or "data_position" in names:
            return None
        return cls(config, runtime, checkpointer, ledger=ledger)

    def on_update_start(self, step: int) -> None:
        self._clean = False
        self._updating = True

    def on_step_end(self, step: int) -> None:
        """The update ended: a rank killed before its next batch leaves this state for the saver."""
        if self._updating:
            self._updating = False
            self._updated_rng = torch.get_rng_state()
            if self._slots is not None:
                self._slots.write(step, self._updated_rng, final=False)

    def on_step_start(self, step: int) -> None:
        """At the first step boundary after an update, copy it: three ints and 5 KB (about 5 us a step)."""
        if not self._clean or self.boundary is None:
            progress = self.checkpointer.progress
            rng = torch.get_rng_state()
            self.boundary = ((progress.step, progress.epoch, progress.batch_in_epoch), rng)
            if self._slots is not None:
                # For the saver, should this rank die: a memmove, no syscall.
                self._slots.write(progress.step, rng)
            self._clean = True

    def on_failure(self, error: BaseException) -> None:
        """On a failed fit(): save the boundary if it is whole and this is the lowest live rank."""
        why = self._refusal()
        if why is not None:
            log.warning("crash save skipped on rank %d: %s", self.rank, why)
            return
        # torchrun's SIGTERM to the survivors comes at any moment, and the preemption handler is gone
        # by now (fit's cleanup ran): without this the default action ends the process mid-save.
        # Python lets only the main thread install handlers; a loop in another thread (Ray Train's
        # workers) saves without them: the save never depends on a handler.
        main = threading.current_thread() is threading.main_thread()
        held = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
        try:
            self._save(error)
        finally:
            for sig, previous in held.items():
                signal.signal(sig, previous)

    def _save(self, error: BaseException) -> None:
        began = time.time()
        (step, epoch, batch), torch_rng = self.boundary
        progress = {"step": step, "epoch": epoch, "batch_in_epoch": batch}
        latest = ckpt.find_latest_checkpoint(self.config.checkpoint_dir)
        if latest is not None and latest.step >= progress["step"]:
            # That step is on disk already.
            return
        state = self._capture(progress, torch_rng)
        meta = manifest_fields(state, epoch=progress["epoch"], crash_save=True)
        ckpt.save_checkpoint(
            state,
            self.config.checkpoint_dir,
            step=progress["step"],
            keep_last=self.config.checkpoint.keep_last,
            meta=meta,
        )
        cause = first_line(error)
        log.warning("rank %d saved step %d after %s: %s", self.rank, progress["step"], type(error).__name__, cause)
        if self.ledger is not None:
            self.ledger.checkpoint(began=began, step=progress["step"], kind="crash", always=True)

    def _refusal(self) -> str | None:
        if self.boundary is None:
            return "no step completed in this attempt"
        if not self._clean:
            return "the failure came during an optimizer update or the work after it"
        if (random.getstate(), _numpy_state()) != self._others:
            return "the loop drew from Python's or NumPy's generator, whose boundary value is unknown"
        if self._pid_file is None:
            return None if self.rank == 0 else "no pid files to find the lowest live rank: rank 0 saves"
        if lowest_live_rank(self._dir, self._prefix, self.world_size) != self.rank:
            return "a lower rank is alive and saves"
        return None

    def _rank_streams(self, step: int, torch_rng: torch.Tensor) -> list[dict[str, Any]]:
        """Each rank's RNG states at boundary ``step``, in rank order, as the checkpointer's capture writes them.

        The torch stream is each rank's own (its slot file); Python's and NumPy's are this rank's,
        unchanged since the attempt began (checked in ``_refusal``). A rank that died between step
        ``step``'s update and its next batch left only the state as the update ended: it is used
        when this rank drew nothing in that window either (the ranks run the same code). A rank
        whose slot is missing (another host, torn by its death) gets this rank's torch stream."""
        mine = capture_rng()
        streams = []
        missing = []
        quiet = self._updated_rng is not None and torch.equal(self._updated_rng, torch_rng)
        for rank in range(self.world_size):
            found = (torch_rng, True) if rank == self.rank else read_boundary(self._rng_file(rank), step)
            theirs = found[0] if found is not None and (found[1] or quiet) else None
            if theirs is None:
                theirs = torch_rng
                missing.append(rank)
            streams.append({**mine, "torch": theirs})
        if missing:
            log.warning(
                "crash save: no torch RNG state of step %d for rank(s) %s; they continue rank %d's stream",
                step,
                missing,
                self.rank,
            )
        return streams

    def _capture(self, progress: dict[str, int], torch_rng: torch.Tensor) -> dict[str, Any]:
        # Through the state's owner, without its collective (a peer is dead): every rank's RNG
        # streams come from the slot files instead of an all-gather.
        state = self.checkpointer.capture(rng=self._rank_streams(progress["step"], torch_rng))
        # The live counters already count the interrupted step's batch.
        state["progress"] = dict(progress)
        position = self.checkpointer.components["progress"]
        if isinstance(position, SamplePosition):
            # The boundary's position in samples too, as the periodic save writes it.
            state["progress"]["sample_in_epoch"] = progress["batch_in_epoch"] * position.split.samples_per_batch
        return state


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    name, keys, pos, has_gauss, cached = numpy.random.get_state()
    return name, keys.tobytes(), pos, has_gauss, cached
