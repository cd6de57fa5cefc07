"""Summaries and tables for benchmark output: medians over rounds, min/max, aligned text tables.

    s = Stats.of([12.1, 11.8, 12.6])       # s.median, s.min, s.max, s.n
    print(format_table(["size", "time (us)"], [["1KB", "35.2"], ["2KB", "36.0"]]))
    emit_results(args, {"rows": rows})     # --json: on stdout; -o FILE.json: to the file

Benchmarks on a shared machine report the median of several alternated rounds, with min and max
so the reader sees the noise; ratios between things measured side by side are what hold.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddpkit.atomic import write_atomically

__all__ = ["Stats", "format_table", "progress", "fmt", "emit_results", "JSON_STDOUT"]

#: Where ``--json`` prints: the real stdout, kept by ``ddpkit bench`` while the tables go to stderr.
JSON_STDOUT = "json_stdout"


@dataclass(frozen=True)
class Stats:
    """Median, min and max of a list of measurements."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("Stats.of needs at least one value")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def spread(self, digits: int = 2) -> str:
        """``'min..max'`` with ``digits`` decimals."""
        return f"{self.min:.{digits}f}..{self.max:.{digits}f}"


def fmt(value: float, digits: int = 4) -> str:
    """``value`` to ``digits`` significant digits (whole numbers once it has that many integer digits)."""
    magnitude = abs(value)
    if magnitude >= 10 ** (digits - 1) or value == 0:
        return f"{value:.0f}"
    if magnitude < 1e-3:
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits - 1 - math.floor(math.log10(magnitude))}f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: a header, a dashed rule, right-aligned columns separated by two spaces."""
    cells = [list(map(str, headers)), *[list(map(str, row)) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def progress(message: str) -> None:
    """One progress line on stderr (the tables go to stdout, so they can be piped on their own)."""
    print(message, file=sys.stderr, flush=True)


def emit_results(args: argparse.Namespace, results: Any) -> None:
    """A benchmark's results as JSON: to ``-o/--output`` when given, and on stdout with ``--json``."""
    text = json.dumps(results, indent=1)
    if getattr(args, "output", None):
        write_atomically(args.output, text + "\n")
        progress(f"wrote {args.output}")
    if getattr(args, "json", False):
        print(text, file=getattr(args, JSON_STDOUT, None) or sys.stdout, flush=True)
