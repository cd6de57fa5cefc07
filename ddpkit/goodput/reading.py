"""Read ``goodput.jsonl`` into a partition of the run's wall time by category.

    report = analyse(read_ledger("runs/exp"))
    report.wall_s, report.productive_s, report.goodput, report.badput   # badput: {category: seconds}
    report.attempts                                                     # one row per attempt

The time axis of each session (one ``ddpkit run`` invocation, or one torchrun job) is cut into
consecutive pieces, each given one category, so the categories add up to the wall time:

* ``startup``: from the launch (or the process start) until the restore begins: launcher,
  interpreter, ``import torch``, process group, data and model build.
* ``restore``: choosing and loading the checkpoint.
* ``productive``: training steps whose result the run kept.
* ``checkpoint``: training blocked by a save (disk, memory snapshot, the crash save's own time
  counts as recovery).
* ``validation``: evaluation.
* ``lost``: work after the step the next attempt resumed from (re-done, so paid twice),
  including the saves and evaluations inside it.
* ``recovery``: from the last completed step of a failed attempt to the next attempt's process
  start: failure detection, the survivors' save and exit, torchrun's restart.
* ``shutdown``: after the last step of a finished attempt (final model write, launcher exit).

A session whose attempt 0 restored nothing starts the run afresh: the report covers the last such
session and those after it (a run directory reused with ``checkpoint.resume=none``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.errors import DdpkitError

__all__ = ["CATEGORIES", "Attempt", "Report", "read_ledger", "analyse", "step_times"]

LEDGER_FILE = "goodput.jsonl"
CATEGORIES = ("startup", "restore", "checkpoint", "validation", "lost", "recovery", "shutdown")


@dataclass
class Attempt:
    """One attempt's records and, once analysed, its seconds per category."""

    session: str
    attempt: int
    records: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    status: str = "FAILED"
    restored_step: int | None = None
    last_step: int = 0

    def first(self, event: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r["event"] == event), None)

    def all(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == event]

    @property
    def label(self) -> str:
        return f"{self.session[:8]}#{self.attempt}"

    @property
    def wall_s(self) -> float:
        return sum(self.seconds.values())


@dataclass
class Report:
    """The run's wall time split by category, in total and per attempt."""

    attempts: list[Attempt]
    wall_s: float
    seconds: dict[str, float]

    @property
    def productive_s(self) -> float:
        return self.seconds.get("productive", 0.0)

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def badput(self) -> dict[str, float]:
        return {c: self.seconds.get(c, 0.0) for c in CATEGORIES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall_s,
            "productive_s": self.productive_s,
            "goodput": self.goodput,
            "badput": self.badput,
            "attempts": [
                {
                    "attempt": a.label,
                    "status": a.status,
                    "restored_step": a.restored_step,
                    "last_step": a.last_step,
                    "wall_s": a.wall_s,
                    **a.seconds,
                }
                for a in self.attempts
            ],
        }


def read_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/goodput.jsonl`` (or the file itself); a line cut short by a crash is skipped."""
    path = Path(run_dir)
    path = path if path.suffix == ".jsonl" else path / LEDGER_FILE
    if not path.is_file():
        raise DdpkitError(
            f"{path} does not exist: pass a run's output directory (run.output_dir); goodput is recorded by runs of "
            "ddpkit's Trainer, so a run that predates it, or never started, has none"
        )
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "event" in record and "t" in record:
            records.append(record)
    return records


def _sessions(records: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    order: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        order.setdefault(str(record.get("session")), []).append(record)
    sessions = list(order.items())

    def afresh(rs: list[dict[str, Any]]) -> bool:
        return any(r["event"] == "restore" and r.get("attempt") == 0 and r.get("source") == "none" for r in rs)

    fresh = [i for i, (_, rs) in enumerate(sessions) if afresh(rs)]
    return sessions[fresh[-1] :] if fresh else sessions


def _attempts(session: str, records: list[dict[str, Any]]) -> list[Attempt]:
    by_number: dict[int, Attempt] = {}
    for record in records:
        # The launcher's records, not an attempt's
        if record["event"] not in ("launch", "exit", "gone", "agent_fault"):
            number = int(record.get("attempt", 0))
            by_number.setdefault(number, Attempt(session, number)).records.append(record)
    return [by_number[n] for n in sorted(by_number)]


def step_times(a: Attempt) -> list[tuple[int, float]]:
    """(step, time it completed) points of one attempt, for locating a resume step in it."""
    points = [(int(r["step"]), float(r["t"])) for r in a.records if r["event"] in ("restore", "first_step", "progress")]
    saves = [r for r in a.records if r["event"] == "checkpoint" and r.get("kind") != "crash"]
    points += [(int(r["step"]), float(r["began"])) for r in saves]
    points += [(int(r["step"]), float(r["last_step_t"])) for r in a.records if "last_step_t" in r]
    return sorted(set(points))


def _time_of_step(points: list[tuple[int, float]], step: int) -> float:
    """When ``step`` completed: exact at a recorded point, else interpolated between two."""
    before = [p for p in points if p[0] <= step]
    after = [p for p in points if p[0] >= step]
    if not before:
        return points[0][1]
    if not after:
        return points[-1][1]
    s0, t0 = before[-1]
    s1, t1 = after[0]
    return t0 if s1 == s0 else t0 + (t1 - t0) * (step - s0) / (s1 - s0)


def _overlap(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


def _split_attempt(a: Attempt, begin: float, next_restore: int | None) -> float:
    """Fill ``a.seconds`` for [begin, end of attempt]; return the attempt's end time."""
    end_rec = a.first("end")
    restore = a.first("restore")
    a.status = end_rec["status"] if end_rec else "FAILED"
    end = max(float(r["t"]) for r in a.records)
    # Died while starting: all of it was start-up
    if restore is None:
        a.seconds = {"startup": end - begin}
        return end
    a.restored_step = int(restore["step"])
    restored = float(restore["t"])
    points = step_times(a)
    a.last_step, last_t = max(points)
    last_t = max(t for s, t in points if s == a.last_step)
    spans = {
        kind: [(float(r["began"]), float(r["t"])) for r in a.all(event) if r.get("kind") != "crash"]
        for kind, event in (("checkpoint", "checkpoint"), ("validation", "validation"))
    }
    kept_to = last_t
    if a.status == "FAILED" and next_restore is not None:
        kept_to = min(max(_time_of_step(points, next_restore), restored), last_t)
    began = float(restore["began"])
    s = {"startup": began - begin, "restore": restored - began, "lost": last_t - kept_to}
    for kind, kind_spans in spans.items():
        s[kind] = _overlap(kind_spans, restored, kept_to) + _overlap(kind_spans, last_t, end)
    s["productive"] = kept_to - restored - _overlap(spans["checkpoint"] + spans["validation"], restored, kept_to)
    tail = end - last_t - _overlap(spans["checkpoint"] + spans["validation"], last_t, end)
    s["shutdown" if a.status != "FAILED" else "recovery"] = tail
    a.seconds = s
    return end


def analyse(records: list[dict[str, Any]]) -> Report:
    """Split the wall time of the run's sessions by category (see the module docstring)."""
    sessions = _sessions(records)
    attempts = [(name, rs, _attempts(name, rs)) for name, rs in sessions]
    flat = [a for _, _, atts in attempts for a in atts]
    if not flat:
        raise DdpkitError("the goodput ledger holds no attempt of a training run yet")
    restores = [a.first("restore") for a in flat]
    wall = 0.0
    total = {}
    index = 0
    for _, rs, atts in attempts:
        launch = next((float(r["t"]) for r in rs if r["event"] == "launch"), None)
        begin = launch if launch is not None else float(atts[0].records[0]["t"]) if atts else 0.0
        cursor = begin
        for a in atts:
            start = float(a.first("start")["t"]) if a.first("start") else float(a.records[0]["t"])
            gap = max(0.0, start - cursor) if a is not atts[0] else 0.0
            following = next((r for r in restores[index + 1 :] if r is not None), None)
            cursor = _split_attempt(a, cursor if a is atts[0] else start, int(following["step"]) if following else None)
            if gap:
                a.seconds["recovery"] = a.seconds.get("recovery", 0.0) + gap
            index += 1
        exit_t = max((float(r["t"]) for r in rs if r["event"] in ("exit", "gone")), default=None)
        if atts and exit_t is not None and exit_t > cursor:
            atts[-1].seconds["shutdown"] = atts[-1].seconds.get("shutdown", 0.0) + exit_t - cursor
            cursor = exit_t
        wall += cursor - begin
    for a in flat:
        for key, value in a.seconds.items():
            total[key] = total.get(key, 0.0) + value
    return Report(flat, wall, total)
