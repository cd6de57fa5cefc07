"""What a hang report says: which ranks are stuck, which wait for them, and every thread's stack.

    beats = {0: {"step": 3, "phase": "backward", ...}, 1: {"step": 3, "phase": "forward", ...}}
    verdict = classify(beats, silent={})          # Verdict(stuck=[1], waiting=[0], silent=[])
    text = format_report(verdict, beats, silent, stacks={0: "...", 1: "..."}, stalled_for=15.2, limit=15)

Pure functions on the heartbeats the watchdog (:mod:`ddpkit.watchdog.heartbeat`) gathered through the store:
no store, no threads, no collectives, so each rule is tested without processes.

Deciding who is stuck. Every rank's heartbeat carries its optimizer step and phase. In one step
the phases run in :data:`PHASE_ORDER`; DDP ranks move in lockstep, so the ranks whose
``(step, phase)`` is behind the furthest one are the stuck ones: the others went on to the next
collective (the gradient allreduce in ``backward``, a barrier, a metric reduction) and wait
there. When every live rank is at the same place, a non-collective phase (data, forward, a hook,
validation) means all of them are stuck in it; a collective phase means all of them wait, for a
rank with no heartbeat or for a collective only some ranks call.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from ddpkit.config.layout import mesh_coordinates, rank_place

__all__ = [
    "PHASE_ORDER",
    "SLOW_PHASES",
    "Verdict",
    "classify",
    "format_report",
    "summary_line",
    "thread_stacks",
    "stack_signature",
    "layout_coordinate",
]
#: Ranks of each kind named in the summary line (100,000 waiting ranks do not fit in one)
NAMED = 8
#: Ranks with a stack section even without stacks; beyond, only those whose stacks came
SECTIONS = 64

#: Where each phase falls in an optimizer step. After ``optimizer`` the step count goes up, so the
#: hooks, validation and checkpoint of step s come before the data, forward and backward of step
#: s + 1. ``loop`` is the loop's own code between spans (hooks, logging), ``setup`` before the first step.
PHASE_ORDER = {
    "setup": -1,
    "loop": 0,
    "hook": 0,
    "evaluation": 1,
    "validation": 1,
    "checkpoint": 2,
    "compile": 3,
    "data": 3,
    "forward": 4,
    "backward": 5,
    "optimizer": 6,
}
#: Phases in which a rank that reached them waits for the others inside a collective.
COLLECTIVE_PHASES = frozenset({"backward", "barrier"})
#: Phases that may legitimately run long without visible progress (``dist.slow_phase_timeout``).
SLOW_PHASES = frozenset({"setup", "compile", "checkpoint"})


@dataclass
class Verdict:
    """Ranks in the order a report names them: stuck first, then waiting, then silent."""

    stuck: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    silent: list[int] = field(default_factory=list)


def _position(beat: dict[str, Any]) -> tuple[int, int, int]:
    phase = beat.get("phase", "loop")
    # Inside validation, batches done is a position too: the rank with fewer is behind.
    inner = beat.get("phase_ticks", 0) if phase in ("evaluation", "validation") else 0
    return int(beat.get("step", 0)), PHASE_ORDER.get(phase, 0), inner


def classify(beats: dict[int, dict[str, Any] | None], silent: dict[int, float]) -> Verdict:
    """Split ranks into stuck, waiting and silent (no heartbeat since ``silent[rank]``, a wall time)."""
    live = {
        rank: beat
        for rank, beat in beats.items()
        if beat is not None and rank not in silent and beat.get("phase") != "done"
    }
    verdict = Verdict(silent=sorted(silent))
    if not live:
        return verdict
    furthest = max(_position(beat) for beat in live.values())
    behind = sorted(rank for rank, beat in live.items() if _position(beat) < furthest)
    if behind:
        verdict.stuck = behind
        verdict.waiting = sorted(set(live) - set(behind))
    elif silent or any(beat.get("phase") in COLLECTIVE_PHASES for beat in live.values()):
        # Everyone is in the same collective, waiting for someone
        verdict.waiting = sorted(live)
    else:
        # Everyone is in the same non-collective phase: all stuck there
        verdict.stuck = sorted(live)
    return verdict


def layout_coordinate(rank: int, *, world_size: int, pipeline: int, tensor: int = 1) -> str | None:
    """Where ``rank`` sits in a pipeline: ``"stage k of replica r"`` (``", tensor rank t"`` with ``tensor`` > 1), from
    the layout's mesh order ``(pp, dp, tp)`` (ddpkit.parallel.layout); None without a pipeline."""
    if pipeline <= 1 or world_size % (pipeline * tensor):
        return None
    stage, replica, tensor_rank = mesh_coordinates(rank, world_size=world_size, pipeline=pipeline, tensor=tensor)
    return rank_place(pp_rank=stage, dp_rank=replica, tp_rank=tensor_rank, pipeline=pipeline, tensor=tensor)


def _layout(beat: dict[str, Any] | None) -> str:
    """A beat's place in the pipeline, as a prefix ("stage 1 of replica 0, "), or nothing."""
    where = (beat or {}).get("where")
    return f"{where}, " if where else ""


def _where(beat: dict[str, Any] | None, now: float) -> str:
    if beat is None:
        return "never sent a heartbeat"
    phase = beat.get("phase", "loop")
    since = beat.get("since", now)
    where = f"host {beat.get('host', '?')}, pid {beat.get('pid', '?')}"
    return f"{_layout(beat)}step {beat.get('step', 0)}, in {phase} for {max(0.0, now - since):.0f}s ({where})"


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))


def _named(items: list[str], total: int) -> str:
    return ", ".join(items) + (f" and {total - len(items)} more" if total > len(items) else "")


def summary_line(
    verdict: Verdict, beats: dict[int, dict[str, Any] | None], silent: dict[int, float], *, stalled_for: float
) -> str:
    """One line naming the suspects first: stuck ranks, else ranks with no heartbeat (the first few of each)."""
    parts = []
    if verdict.stuck:
        where = {r: beats.get(r) or {} for r in verdict.stuck[:NAMED]}
        named = [f"rank {r} ({_layout(b)}step {b.get('step', '?')}, {b.get('phase', '?')})" for r, b in where.items()]
        parts.append("stuck: " + _named(named, len(verdict.stuck)))
    if verdict.silent:
        at = {r: f", at step {beat.get('step', '?')}" if (beat := beats.get(r)) else "" for r in verdict.silent[:NAMED]}
        named = [f"rank {r} (since {_clock(silent[r])}{at[r]})" for r in at]
        parts.append("no heartbeat: " + _named(named, len(verdict.silent)))
    if not verdict.stuck and verdict.silent:
        parts.reverse()
    if verdict.waiting:
        parts.append("waiting: " + _named([f"rank {r}" for r in verdict.waiting[:NAMED]], len(verdict.waiting)))
    return f"hang: no progress on any rank for {stalled_for:.0f}s; " + "; ".join(parts)


def format_report(
    verdict: Verdict,
    beats: dict[int, dict[str, Any] | None],
    silent: dict[int, float],
    stacks: dict[int, str],
    *,
    stalled_for: float,
    limit: float,
) -> str:
    """The whole report: summary, one line per rank (stuck, waiting, silent), then each rank's stacks."""
    now = time.time()
    lines = [
        f"ddpkit hang report, {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(now))}",
        summary_line(verdict, beats, silent, stalled_for=stalled_for),
        f"(no rank changed step or phase, nor ran new code, for {stalled_for:.0f}s; the limit was {limit:g}s)",
        "",
    ]
    for rank in verdict.stuck:
        lines.append(f"STUCK    rank {rank}: {_where(beats.get(rank), now)}")
    for rank in verdict.waiting:
        lines.append(f"waiting  rank {rank}: {_where(beats.get(rank), now)}")
    for rank in verdict.silent:
        beat = beats.get(rank)
        place = f" ({beat['where']})" if beat and beat.get("where") else ""
        last = f", last seen{place} at step {beat.get('step', 0)} in {beat.get('phase', '?')}" if beat else ""
        lines.append(f"silent   rank {rank}: no heartbeat since {_clock(silent[rank])}{last} (frozen, stopped or gone)")
    ranks = [*verdict.stuck, *verdict.waiting, *verdict.silent]
    shown = ranks if len(ranks) <= SECTIONS else [r for r in ranks if r in stacks]
    stuck = set(verdict.stuck)
    waiting = set(verdict.waiting)
    for rank in shown:
        label = "stuck" if rank in stuck else "waiting" if rank in waiting else "no heartbeat"
        text = stacks.get(rank, "(no stacks received from this rank)").rstrip()
        lines += ["", f"=== rank {rank} ({label}): Python stacks of all threads ===", text]
    if len(shown) < len(ranks):
        omitted = len(ranks) - len(shown)
        lines += ["", f"({omitted} other ranks: no stacks asked for; the report asks {SECTIONS} at most)"]
    return "\n".join(lines) + "\n"


def thread_stacks() -> str:
    """The Python stack of every thread of this process, main thread first (callable from any thread).

    Works while the main thread is blocked in C (a collective, a lock, a queue): its frames are
    still there to read. The watchdog's own threads are left out.
    """
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)
    out = []
    for ident, frame in frames:
        if str(names.get(ident, "")).startswith("ddpkit-watchdog"):
            continue
        out.append(f"Thread {names.get(ident, ident)!s}{' (main)' if ident == main else ''}, most recent call last:")
        out.append("".join(traceback.format_stack(frame)).rstrip())
    return "\n".join(out)


def stack_signature() -> tuple[tuple[str, int], ...]:
    """Where the main thread is, as (file, line) pairs: a new signature means it is running new code."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    signature = []
    while frame is not None and len(signature) < 200:
        signature.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return tuple(signature)
