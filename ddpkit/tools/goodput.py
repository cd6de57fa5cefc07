"""``ddpkit goodput RUN_DIR``: where a run's wall time went, from its ``goodput.jsonl``.

    $ ddpkit goodput runs/exp
    wall 31.2s  productive 9.4s  goodput 0.30
    badput: startup 9.1s  restore 0.3s  checkpoint 0.4s  validation 0.6s  lost 4.2s  recovery 7.2s  shutdown 0.0s

    attempt      status    steps     wall  productive  startup  restore  ...
    3f2a9c1e#0   FAILED     0-41     8.1s        3.0s     1.9s     0.0s
    ...

    faults: seconds from the last step before each one to the first step after it

    fault       kind                     detection  teardown  restart  startup   load  first step  total  steps lost
    a4fcbc23#0  worker killed (SIGKILL)      0.085     0.153    0.080    0.659  0.032       0.068  1.077           0

    $ ddpkit goodput runs/exp --json      # the same numbers as JSON

The categories (see :mod:`ddpkit.goodput.reading` and docs/goodput.md) partition the wall
time, so productive time plus the badput adds up to it. The faults' parts are
:mod:`ddpkit.goodput.faults`'s (the row above: a 2-rank run of a scikit-learn script at load
average 11 on 2 cores); a kind that occurred more than once gets a median row.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ddpkit.errors import exit_code_of
from ddpkit.goodput.faults import PARTS, FaultCost, fault_costs, medians
from ddpkit.goodput.reading import CATEGORIES, Report, analyse, read_ledger

__all__ = ["main", "goodput_of", "format_report"]


def goodput_of(run_dir: str) -> Report:
    """The analysed ledger of ``run_dir`` (raises DdpkitError when there is none)."""
    return analyse(read_ledger(run_dir))


def _s(seconds: float) -> str:
    return f"{seconds:.1f}s"


def format_report(report: Report, faults: Sequence[FaultCost] = ()) -> str:
    """The text ``ddpkit goodput`` prints: totals, badput by category, one row per attempt, one per fault."""
    lines = [
        f"wall {_s(report.wall_s)}  productive {_s(report.productive_s)}  goodput {report.goodput:.2f}",
        "badput: " + "  ".join(f"{c} {_s(v)}" for c, v in report.badput.items()),
        "",
    ]
    columns = ["attempt", "status", "steps", "wall", "productive", *CATEGORIES]
    rows = [columns]
    for a in report.attempts:
        steps = f"{a.restored_step}-{a.last_step}" if a.restored_step is not None else "-"
        seconds = (_s(a.seconds.get(c, 0.0)) for c in ("productive", *CATEGORIES))
        rows.append([a.label, a.status, steps, _s(a.wall_s), *seconds])
    lines += _table(rows, left=2)
    if faults:
        lines += ["", "faults: seconds from the last step before each one to the first step after it", ""]
        rows = [["fault", "kind", *PARTS, "total", "steps lost"]]
        for cost in faults:
            parts = ("-" if cost.parts.get(p) is None else f"{cost.parts[p]:.3f}" for p in PARTS)
            lost = f"{cost.steps_lost}" if cost.exact else f"~{cost.steps_lost}"
            rows.append([cost.attempt, cost.kind, *parts, f"{cost.total:.3f}", lost])
        for kind, m in medians(list(faults)).items():
            if m["n"] > 1:
                parts = ("-" if m.get(p) is None else f"{m[p]:.3f}" for p in PARTS)
                rows.append([f"median of {m['n']:g}", kind, *parts, f"{m['total']:.3f}", f"{m['steps_lost']:g}"])
        lines += _table(rows, left=2)
    return "\n".join(lines)


def _table(rows: list[list[str]], *, left: int) -> list[str]:
    """Aligned columns: the first ``left`` to the left, the rest to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddpkit goodput",
        description="Where a run's wall time went: productive training and badput by category, "
        "and what each fault cost.",
    )
    parser.add_argument("run_dir", help="a run's output directory (holding goodput.jsonl)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    try:
        args = parser.parse_args(list(argv or []))
    except SystemExit as exc:
        # argparse already printed usage or help
        return int(exc.code or 0)

    def run() -> int:
        records = read_ledger(args.run_dir)
        report = analyse(records)
        faults = fault_costs(records)
        as_json = {**report.to_dict(), "faults": [cost.to_dict() for cost in faults]}
        print(json.dumps(as_json, indent=1) if args.json else format_report(report, faults))
        return 0

    return exit_code_of(run, command="ddpkit goodput")


if __name__ == "__main__":
    sys.exit(main())
