"""The watchdog's judge: decides that a job hangs, gathers every rank's stacks, writes the report.

    monitor = Monitor(watchdog)   # one per Watchdog; its thread calls monitor.check() twice a second
    monitor.check()               # rank 0: reads every heartbeat; others: rank 0's only

Rank 0 watches everyone. Any other rank takes over when rank 0's own heartbeat stops (rank 0
frozen while the store still answers, e.g. the store lives in torchrun's agent). The rank whose
alarm won the ``compare_set`` writes the report; the others post their stacks and exit first, so
torchrun's summary names the earliest failure: the stuck rank, whose error file is dated to the
start of the hang.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ddpkit.errors import EXIT_HANG
from ddpkit.watchdog.backstop import backstop_path, read_backstop
from ddpkit.watchdog.report import classify, format_report, summary_line
from ddpkit.watchdog.store_io import StoreDown, kill_frozen_sibling, terminate, write_error_file, write_text

__all__ = ["Monitor", "HANG_EXIT_CODE", "SILENT_AFTER"]

HANG_EXIT_CODE = EXIT_HANG  #: every rank's exit code when the watchdog stops a hung job (3)
SILENT_AFTER = 10.0  # a heartbeat older than this: the rank is frozen, stopped or gone
GATHER_WAIT = 6.0  # how long the reporting rank waits for the others' stacks


class Monitor:
    """Decides that the job hangs (rank 0, or any rank once rank 0 is silent) and writes the report."""

    def __init__(self, watchdog: Any):
        self.wd = watchdog
        self.start = self.last_progress = time.monotonic()
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (seq, monotonic time it changed)
        self.progress: dict[int, tuple[Any, ...]] = {}
        self.beats: dict[int, dict[str, Any] | None] = {}

    def check(self) -> None:
        wd = self.wd
        if wd.rank != 0:
            raw = wd.client.get_if_set("hb/0")
            self._update({0: json.loads(raw) if raw else None})
            rank0 = self.beats.get(0) or {}
            limit = wd.slow_timeout if rank0.get("slow") else wd.hang_timeout  # e.g. a long load holding the GIL
            if rank0.get("phase") == "done" or self._silent_for(0) <= limit:
                return  # rank 0 watches everyone while its heartbeat lives
            self.read_all()  # rank 0 is frozen or gone: this rank reports
            return self._declare(self._silent_for(0), limit)
        self.read_all()
        live = [b for r, b in self.beats.items() if b and b.get("phase") != "done" and self._silent_for(r) <= SILENT_AFTER]
        limit = wd.slow_timeout if any(b.get("slow") for b in live) else wd.hang_timeout
        if time.monotonic() - self.last_progress > limit:
            self._declare(time.monotonic() - self.last_progress, limit)

    def _declare(self, stalled: float, limit: float) -> None:
        """Raise the alarm (the first one wins) and answer whichever alarm won."""
        wd = self.wd
        path = wd.log_dir / f"hang-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        alarm = {"kind": "hang", "by": wd.rank, "path": str(path), "stalled": stalled, "limit": limit}
        won = wd.client("compare_set", "alarm", "", json.dumps(alarm)).decode()
        wd._respond(json.loads(won))

    def read_all(self) -> None:
        keys = [f"hb/{r}" for r in range(self.wd.world_size)]
        present = [k for k in keys if int(k[3:]) in self.beats and self.beats[int(k[3:])] is not None or self.wd.client("check", [k])]
        values = self.wd.client("multi_get", present) if present else []
        self._update({int(k[3:]): json.loads(v) for k, v in zip(present, values) if v is not None})  # None: no valid tag

    def _update(self, beats: dict[int, dict[str, Any] | None]) -> None:
        now = time.monotonic()
        for rank, beat in beats.items():
            if beat is None:
                continue
            if self.seen.get(rank, (None,))[0] != beat["seq"]:
                self.seen[rank] = (beat["seq"], now)
            progress = (beat["step"], beat["phase"], beat["ticks"], beat["novel"])
            if self.progress.get(rank) != progress:
                self.progress[rank], self.last_progress = progress, now
            self.beats[rank] = beat

    def _silent_for(self, rank: int) -> float:
        return time.monotonic() - self.seen.get(rank, (None, self.start))[1]

    def silent(self) -> dict[int, float]:
        """Ranks without a fresh heartbeat -> wall time of their last one (or of the watchdog's start)."""
        out = {}
        for rank in range(self.wd.world_size):
            if (self.beats.get(rank) or {}).get("phase") != "done" and (age := self._silent_for(rank)) > SILENT_AFTER:
                out[rank] = time.time() - age
        return out

    def report(self, alarm: dict[str, Any]) -> None:
        """Gather every live rank's stacks, write and print the report, then stop this rank last."""
        wd = self.wd
        self._try_read_all()
        silent = self.silent()
        expected = [r for r in range(wd.world_size) if r not in silent and (self.beats.get(r) or {}).get("phase") != "done"]
        stacks = self._gather(expected)
        if len(stacks) < len(expected):  # a rank that sent no stacks may have gone stale meanwhile: frozen, not waiting
            self._try_read_all()
            silent = {r: t for r, t in self.silent().items() if r not in stacks}
        beats = self._last_words(silent, stacks)
        verdict = classify(beats, silent)
        stalled = alarm["stalled"]
        text = format_report(verdict, beats, silent, stacks, stalled_for=stalled, limit=alarm["limit"])
        path = write_text(Path(alarm["path"]), text)
        summary = summary_line(verdict, beats, silent, stalled_for=stalled)
        print(f"{text}\nddpkit: {summary}; report: {path}", file=sys.stderr, flush=True)
        hang_start = time.time() - stalled
        stuck = verdict.stuck or verdict.silent
        write_error_file(f"{summary} (report: {path})", when=hang_start if wd.rank in stuck else time.time(), code=HANG_EXIT_CODE)
        done = {"summary": summary, "stuck": stuck, "since": hang_start}
        wd._try(lambda: wd.client("set", "done", json.dumps(done)))
        deadline = time.monotonic() + 3  # let the others exit first: torchrun names the earliest failure
        while time.monotonic() < deadline and int(wd._try(lambda: wd.client("add", "exited", 0)) or 0) < len(expected) - 1:
            time.sleep(0.1)
        self._kill_frozen(verdict.silent, f"{summary} (report: {path})", hang_start)  # last: torchrun sees this rank's 3 with its -9
        terminate(HANG_EXIT_CODE)

    def _kill_frozen(self, silent: list[int], summary: str, hang_start: float) -> None:
        """Frozen ranks on this node would hold the job until the agent's SIGKILL (30 s after its SIGTERM):
        kill them now, each with its torchrun error file written for it (the hang's summary, dated to its start)."""
        for rank in silent:
            beat = self.beats.get(rank) or {}
            if beat.get("host") != socket.gethostname() or not beat.get("pid"):
                continue
            local_rank = rank - self.wd.rank + int(os.environ.get("LOCAL_RANK", "0"))  # a node's ranks are contiguous under torchrun
            write_error_file(summary, when=hang_start, code=HANG_EXIT_CODE, local_rank=local_rank, pid=int(beat["pid"]))
            if kill_frozen_sibling(int(beat["pid"])):
                print(f"ddpkit: killed frozen rank {rank} (pid {beat['pid']})", file=sys.stderr, flush=True)

    def _gather(self, expected: list[int]) -> dict[int, str]:
        """The stacks the ``expected`` ranks post, for up to ``GATHER_WAIT`` seconds."""
        wd, stacks = self.wd, {}
        deadline = time.monotonic() + GATHER_WAIT
        while time.monotonic() < deadline and len(stacks) < len(expected):
            for rank in expected:
                if rank not in stacks and (text := wd._try(lambda r=rank: wd.client.get_if_set(f"stacks/{r}"))) is not None:
                    stacks[rank] = text
            time.sleep(0.2)
        return stacks

    def _last_words(self, silent: dict[int, float], stacks: dict[int, str]) -> dict[int, dict[str, Any] | None]:
        """The heartbeats, with each silent rank's own record (:mod:`ddpkit.watchdog.backstop`) of where it
        stopped, to the step (its last heartbeat may be many steps older); its faulthandler dump goes in ``stacks``."""
        beats = dict(self.beats)
        for rank in silent:
            beat, found = beats.get(rank) or {}, read_backstop(self.wd.log_dir, rank)
            if found is None:
                elsewhere = f" (look on its host, {beat['host']})" if beat.get("host", socket.gethostname()) != socket.gethostname() else ""
                stacks[rank] = f"(no stacks received from this rank, and no faulthandler dump at {backstop_path(self.wd.log_dir, rank)}{elsewhere})"
                continue
            step, phase, dump = found
            beats[rank] = {**beat, "step": max(step, int(beat.get("step", 0))), "phase": phase}
            stacks[rank] = dump or "(no stacks received from this rank, and faulthandler's timer did not fire in it: stopped by a signal, or gone)"
        return beats

    def _try_read_all(self) -> None:
        try:
            self.read_all()
        except StoreDown:
            pass
