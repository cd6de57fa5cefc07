"""``ddpkit goodput RUN_DIR``: where a run's wall time went, from its ``goodput.jsonl``.

    $ ddpkit goodput runs/exp
    wall 31.2s  productive 9.4s  goodput 0.30
    badput: startup 9.1s  restore 0.3s  checkpoint 0.4s  validation 0.6s  lost 4.2s  recovery 7.2s  shutdown 0.0s

    attempt      status    steps     wall  productive  startup  restore  ...
    3f2a9c1e#0   FAILED     0-41     8.1s        3.0s     1.9s     0.0s
    ...

    $ ddpkit goodput runs/exp --json      # the same numbers as JSON

The categories (see :mod:`ddpkit.goodput.reading` and docs/goodput.md) partition the wall
time, so productive time plus the badput adds up to it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ddpkit.errors import exit_code_of
from ddpkit.goodput.reading import CATEGORIES, Report, analyse, read_ledger

__all__ = ["main", "goodput_of", "format_report"]


def goodput_of(run_dir: str) -> Report:
    """The analysed ledger of ``run_dir`` (raises DdpkitError when there is none)."""
    return analyse(read_ledger(run_dir))


def _s(seconds: float) -> str:
    return f"{seconds:.1f}s"


def format_report(report: Report) -> str:
    """The text ``ddpkit goodput`` prints: totals, badput by category, one row per attempt."""
    lines = [
        f"wall {_s(report.wall_s)}  productive {_s(report.productive_s)}  goodput {report.goodput:.2f}",
        "badput: " + "  ".join(f"{c} {_s(v)}" for c, v in report.badput.items()),
        "",
    ]
    columns = ["attempt", "status", "steps", "wall", "productive", *CATEGORIES]
    rows = [columns]
    for a in report.attempts:
        steps = f"{a.restored_step}-{a.last_step}" if a.restored_step is not None else "-"
        rows.append([a.label, a.status, steps, _s(a.wall_s), *(_s(a.seconds.get(c, 0.0)) for c in ("productive", *CATEGORIES))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddpkit goodput", description="Where a run's wall time went: productive training and badput by category.")
    parser.add_argument("run_dir", help="a run's output directory (holding goodput.jsonl)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    try:
        args = parser.parse_args(list(argv or []))
    except SystemExit as exc:  # argparse already printed usage or help
        return int(exc.code or 0)

    def run() -> int:
        report = goodput_of(args.run_dir)
        print(json.dumps(report.to_dict(), indent=1) if args.json else format_report(report))
        return 0

    return exit_code_of(run, command="ddpkit goodput")


if __name__ == "__main__":
    sys.exit(main())
