"""What each fault cost, split: from the last trained step before it to the first trained step after it.

    with torchrun_adapter.observe_faults(fault_recorder("runs/exp")):   # ddpkit run's launcher, around the agent
        ...
    for cost in fault_costs(read_ledger("runs/exp")):                   # ddpkit goodput's "faults" table
        cost.kind, cost.parts["detection"], cost.steps_lost

The launcher's agent writes one ``agent_fault`` line per failed attempt into ``goodput.jsonl``: when its monitor
saw a worker fail (``detected``), when the attempt's last worker was gone (``t``), each worker's exit code and the
fault's kind read from them (:func:`fault_kind`). With the lines the workers write (the failed attempt's last
step; the next attempt's process start, restore and first step), each fault splits into consecutive parts:

* ``detection``: the last trained step until the agent saw a worker gone (it polls every ``--monitor-interval``,
  0.02 s under ``ddpkit run``); it also holds the moments between that step and the fault itself;
* ``teardown``: until every worker of the attempt was gone (a survivor's crash save, the agent's SIGTERM);
* ``restart``: until the next attempt's worker process started (rendezvous, then a fork or a new interpreter);
* ``startup``: until the checkpoint load began (imports, process group, data and model build);
* ``load``: the checkpoint load; ``first step``: until the first step after it completed.

``total`` is their sum; ``steps_lost`` the steps trained before the fault and again after it. The last step
before a fault is exact when a worker lived to write it (the ``end`` line of a failed attempt, any rank). When
every worker died at once the last record is a ``progress`` mark or a snapshot, up to a second early: the parts
are then measured from it (detection overstated by up to that second), and the steps lost are estimated
(``exact`` False): the attempt's step rate carried on from that record until the agent saw the workers gone.
A run without ``ddpkit run`` (a plain ``torchrun``) has no ``agent_fault`` lines: its faults have no detection
or teardown part, only a restart from the last step.
"""

from __future__ import annotations

import os
import signal
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddpkit.goodput.ledger import append_event
from ddpkit.goodput.reading import Attempt, analyse, step_times

__all__ = ["AGENT_EVENT", "PARTS", "FaultCost", "fault_kind", "fault_recorder", "fault_costs", "medians"]

AGENT_EVENT = "agent_fault"
PARTS = ("detection", "teardown", "restart", "startup", "load", "first step")


def fault_kind(codes: dict[int, int], *, requeue_exit_code: int) -> str:
    """The kind of a fault, from its workers' exit codes (-N: killed by signal N): a stop signal (a worker
    exited ``requeue_exit_code`` after the agreed save), every worker killed, a worker killed, a worker failed."""
    values = list(codes.values())
    if requeue_exit_code in values:
        return "stop signal"
    # A SIGTERM is what the agent sends the survivors: it names no cause unless nothing else does.
    killed = [code for code in values if code < 0 and code != -signal.SIGTERM]
    if killed:
        name = _signal_name(killed[0])
        return f"every worker killed ({name})" if len(killed) == len(values) else f"worker killed ({name})"
    failed = [code for code in values if code > 0]
    if failed:
        return f"worker failed (exit {failed[0]})"
    return "worker terminated (SIGTERM)" if values else "worker failed"


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def fault_recorder(output_dir: str | os.PathLike, *, requeue_exit_code: int) -> Callable[..., None]:
    """A listener for :func:`ddpkit.launch.torchrun_adapter.observe_faults` that writes one ``agent_fault`` line."""

    def record(*, detected: float, stopped: float, attempt: int, codes: dict[int, int]) -> None:
        kind = fault_kind(codes, requeue_exit_code=requeue_exit_code)
        append_event(
            output_dir,
            AGENT_EVENT,
            t=stopped,
            detected=detected,
            attempt=attempt,
            rank=-1,
            kind=kind,
            codes={str(rank): code for rank, code in codes.items()},
        )

    return record


@dataclass
class FaultCost:
    """One fault: where it happened, its kind, its parts in seconds (None: not recorded) and the steps it cost."""

    attempt: str
    kind: str
    steps_lost: int
    exact: bool
    parts: dict[str, float | None] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(v for v in self.parts.values() if v is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "kind": self.kind,
            "steps_lost": self.steps_lost,
            "exact": self.exact,
            **self.parts,
            "total": self.total,
        }


def fault_costs(records: list[dict[str, Any]]) -> list[FaultCost]:
    """One :class:`FaultCost` per attempt that failed or stopped and was followed by another in its session."""
    report = analyse(records)
    lines = {(r["session"], int(r["attempt"])): r for r in records if r["event"] == AGENT_EVENT}
    costs = []
    for failed, next_ in zip(report.attempts, report.attempts[1:]):
        if failed.session == next_.session and failed.status != "FINISHED" and next_.first("start"):
            costs.append(_cost(failed, next_, lines.get((failed.session, failed.attempt))))
    return costs


def _last_step(a: Attempt) -> tuple[int, float, bool]:
    """The attempt's last recorded step, when it completed, and whether a worker wrote it (else: a progress mark)."""
    points = step_times(a)
    step = max(points)[0]
    exact = any(r["event"] == "end" and int(r.get("step", -1)) == step for r in a.records)
    return step, max(t for s, t in points if s == step), exact


def _estimated_step(a: Attempt, step: int, last_t: float, until: float) -> int:
    """``step`` carried on at the attempt's step rate (from its restore to ``last_t``) until ``until``."""
    first_step, first_t = min(step_times(a))
    rate = (step - first_step) / (last_t - first_t) if last_t > first_t else 0.0
    return step + int(rate * max(0.0, until - last_t))


def _cost(failed: Attempt, next_: Attempt, line: dict[str, Any] | None) -> FaultCost:
    step, last_t, exact = _last_step(failed)
    start = next_.first("start")
    restore = next_.first("restore")
    first = next_.first("first_step")
    marks: list[float | None] = [last_t]
    if line is not None:
        marks += [float(line["detected"]), float(line["t"])]
    else:
        marks += [None, None]
    marks += [
        float(start["t"]) if start else None,
        float(restore["began"]) if restore else None,
        float(restore["t"]) if restore else None,
        float(first["t"]) if first else None,
    ]
    parts: dict[str, float | None] = {}
    previous = last_t
    for name, mark in zip(PARTS, marks[1:]):
        parts[name] = None if mark is None else max(0.0, mark - previous)
        previous = previous if mark is None else mark
    kind = line["kind"] if line is not None else ("stop signal" if failed.status == "STOPPED" else "worker failed")
    # Every worker died: their last step lies between that record and the agent's
    if not exact and line is not None:
        step = _estimated_step(failed, step, last_t, float(line["detected"]))
    lost = max(0, step - int(restore["step"])) if restore else 0
    return FaultCost(attempt=failed.label, kind=kind, steps_lost=lost, exact=exact, parts=parts)


def medians(costs: list[FaultCost]) -> dict[str, dict[str, float]]:
    """Per kind: the median of each part, of the total and of the steps lost, and the count."""
    out: dict[str, dict[str, float]] = {}
    for kind in dict.fromkeys(c.kind for c in costs):
        rows = [c for c in costs if c.kind == kind]
        values = {name: [c.parts[name] for c in rows if c.parts.get(name) is not None] for name in PARTS}
        out[kind] = {
            "n": len(rows),
            **{k: statistics.median(v) for k, v in values.items() if v},
            "total": statistics.median(c.total for c in rows),
            "steps_lost": statistics.median(c.steps_lost for c in rows),
        }
    return out
