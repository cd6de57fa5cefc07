"""``ddpkit runs [DIR]``: one table of the runs under a directory (default ``runs/``).

    $ ddpkit runs
    name        status    steps  val_accuracy  val_loss  best                          wall   goodput
    quickstart  FINISHED    935        0.9905    0.0301  step 935 val_loss 0.0301      41s       0.81
    lr0.1       KILLED      374        0.9812    0.0622  -                             2m03s     0.64
    sweep-3     CRASHED     120             -         -  -                             15s          -

    $ ddpkit runs runs/ --json          # the same rows as JSON, for scripts

Each row is read from the run's own files, nothing else: ``status.json`` (status, attempts and
wall time, kept by the trainer), ``metrics.jsonl`` (last step, last ``val_*`` values, and the
best value of ``checkpoint.best.metric`` from ``config.yaml``), ``checkpoints/best.json`` (the
step the best checkpoint was taken at), ``model.pt`` and ``goodput.jsonl`` (productive / wall
time). A run whose ``status.json`` still says RUNNING although its process on this host is gone
is shown as CRASHED (killed outright, e.g. out of memory, before it could record how it ended).
Runs written before ``status.json`` existed show FINISHED when they have a ``model.pt``, else ``-``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.distributed.processes import is_alive
from ddpkit.errors import DdpkitError, exit_code_of
from ddpkit.goodput.reading import analyse, read_ledger
from ddpkit.reporting.console import format_duration
from ddpkit.reporting.log import METRICS_FILE, VAL_PREFIX
from ddpkit.reporting.sinks import read_status
from ddpkit.tools.plot import load_metrics

__all__ = ["main", "RunSummary", "summarize_run", "find_runs"]


@dataclass
class RunSummary:
    """One row of the table."""

    name: str
    path: str
    status: str = "-"
    steps: int | None = None
    val: dict[str, float] = field(default_factory=dict)
    best: str = "-"
    wall_s: float | None = None
    attempts: int | None = None
    #: Productive / wall time, from goodput.jsonl (ddpkit goodput).
    goodput: float | None = None


def find_runs(directory: str | os.PathLike) -> list[Path]:
    """Run directories: ``directory`` itself if it is one, else its subdirectories that are."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DdpkitError(f"no such directory: {directory}; pass the directory that holds your runs (default runs/)")
    if _is_run(directory):
        return [directory]
    return sorted(p for p in directory.iterdir() if p.is_dir() and _is_run(p))


def _is_run(path: Path) -> bool:
    return any((path / name).exists() for name in ("config.yaml", METRICS_FILE, "status.json"))


def summarize_run(run_dir: str | os.PathLike) -> RunSummary:
    """Read one run directory into a row."""
    run_dir = Path(run_dir)
    row = RunSummary(name=run_dir.name, path=str(run_dir))
    series = _series(run_dir)
    steps = [step for values in series.values() for step, _ in values]
    row.steps = max(steps) if steps else None
    row.val = {k: values[-1][1] for k, values in sorted(series.items()) if k.startswith(VAL_PREFIX) and values}
    row.best = _best(run_dir, series)
    row.goodput = _goodput(run_dir)
    status = read_status(run_dir)
    if status is not None:
        row.status = _status_word(status)
        row.attempts = status.get("attempts")
        row.wall_s = status.get("wall_s")
        if status.get("status") == "RUNNING" and row.wall_s is not None:
            row.wall_s += max(0.0, time.time() - status.get("attempt_started", time.time()))
    else:
        row.status = "FINISHED" if (run_dir / "model.pt").exists() else "-"
        times = _times(run_dir)
        row.wall_s = times[-1] - times[0] if len(times) > 1 else None
    return row


def _goodput(run_dir: Path) -> float | None:
    try:
        return analyse(read_ledger(run_dir)).goodput
    except DdpkitError:
        # No ledger (an older run), or nothing in it yet
        return None


def _series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    if not (run_dir / METRICS_FILE).exists():
        return {}
    try:
        return load_metrics(run_dir).series
    except DdpkitError:
        # An empty or unreadable metrics.jsonl: show the run anyway
        return {}


def _times(run_dir: Path) -> list[float]:
    times = []
    try:
        with open(run_dir / METRICS_FILE, encoding="utf-8") as f:
            for line in f:
                try:
                    times.append(float(json.loads(line)["time"]))
                except (ValueError, KeyError, TypeError):
                    continue
    except OSError:
        pass
    return times


def _status_word(status: dict[str, Any]) -> str:
    word = str(status.get("status", "-"))
    if word == "RUNNING" and status.get("host") == socket.gethostname() and not is_alive(status.get("pid")):
        return "CRASHED"
    return word


def _best(run_dir: Path, series: dict[str, list[tuple[int, float]]]) -> str:
    """``step 935 val_loss 0.0301`` for the best checkpoint, from its manifest and metrics.jsonl."""
    try:
        manifest = json.loads((run_dir / "checkpoints" / "best.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "-"
    step = manifest.get("step")
    metric = _best_metric(run_dir)
    value = dict(series.get(metric, [])).get(step) if metric else None
    return f"step {step} {metric} {value:.4f}" if value is not None else f"step {step}"


def _best_metric(run_dir: Path) -> str | None:
    try:
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        return config["checkpoint"]["best"]["metric"]
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None


def format_table(rows: Sequence[RunSummary]) -> str:
    """Aligned columns: text left, numbers right; one column per ``val_*`` metric seen."""
    metrics = sorted({k for row in rows for k in row.val})
    header = ["name", "status", "steps", *metrics, "best", "wall", "goodput"]
    lines = [header]
    for row in rows:
        wall = format_duration(row.wall_s) if row.wall_s is not None else "-"
        values = [_number(row.val.get(m)) for m in metrics]
        goodput = "-" if row.goodput is None else f"{row.goodput:.2f}"
        lines.append(
            [row.name, row.status, "-" if row.steps is None else str(row.steps), *values, row.best, wall, goodput]
        )
    numeric = {2, *range(3, 3 + len(metrics)), len(header) - 1}
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i in numeric else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))
        ).rstrip()
        for line in lines
    )


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return "nan" if math.isnan(value) else f"{value:.4f}"


def main(argv: Sequence[str]) -> int:
    """``ddpkit runs [DIR] [--json]``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="ddpkit runs", description="A table of the runs under DIR (default runs/), read from each run's own files."
    )
    parser.add_argument(
        "directory",
        nargs="?",
        default="runs",
        help="a directory of run directories, or one run directory (default: runs)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of a table")
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:
        # argparse already printed usage or help
        return int(exc.code or 0)
    return exit_code_of(lambda: _show(args), command="ddpkit runs")


def _show(args: argparse.Namespace) -> int:
    rows = [summarize_run(path) for path in find_runs(args.directory)]
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=1))
    elif rows:
        print(format_table(rows))
    else:
        print(f"no runs under {args.directory} (a run directory holds config.yaml and metrics.jsonl)", file=sys.stderr)
    return 0
