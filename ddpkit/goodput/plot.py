"""Draw where runs' wall time went: ``ddpkit plot --goodput RUN_DIR [RUN_DIR ...] [-o goodput.png]``.

One horizontal stacked bar per run (productive time, then each badput category, in seconds), and
below it one bar per attempt of each run, so a fault's lost work and recovery stand out. Numbers
come from ``goodput.jsonl`` (:mod:`ddpkit.goodput.reading`). Needs matplotlib (``ddpkit[plot]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ddpkit.errors import DdpkitError
from ddpkit.goodput.reading import CATEGORIES, analyse, read_ledger

__all__ = ["plot_goodput"]

_COLORS = {
    "productive": "#2ca02c",
    "startup": "#7f7f7f",
    "restore": "#17becf",
    "checkpoint": "#1f77b4",
    "validation": "#9467bd",
    "lost": "#d62728",
    "recovery": "#ff7f0e",
    "shutdown": "#bcbd22",
}


def _bars(run_dirs: Sequence[str | Path], names: Sequence[str]) -> list[tuple[str, dict[str, float]]]:
    bars = []
    for run_dir, name in zip(run_dirs, names):
        report = analyse(read_ledger(run_dir))
        bars.append((f"{name}  (goodput {report.goodput:.2f})", {"productive": report.productive_s, **report.badput}))
        bars += [
            (f"  attempt {a.attempt} {a.status}", {c: a.seconds.get(c, 0.0) for c in ("productive", *CATEGORIES)})
            for a in report.attempts
        ]
    return bars


def plot_goodput(
    run_dirs: Sequence[str | Path],
    names: Sequence[str],
    output: str | Path,
    *,
    title: str | None = None,
    dpi: int = 120,
) -> Path:
    """Write the breakdown figure to ``output``; DdpkitError without matplotlib or a ledger."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DdpkitError(
            "ddpkit plot --goodput needs matplotlib, which is not installed: pip install 'ddpkit[plot]'"
        ) from None
    bars = _bars(run_dirs, names)
    fig = Figure(figsize=(9, 0.45 * len(bars) + 1.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = [label for label, _ in reversed(bars)]
    order = list(_COLORS)
    for category, color in _COLORS.items():
        rows = [seconds for _, seconds in reversed(bars)]
        lefts = [sum(v for c, v in seconds.items() if order.index(c) < order.index(category)) for seconds in rows]
        ax.barh(labels, [seconds.get(category, 0.0) for seconds in rows], left=lefts, color=color, label=category)
    ax.set_xlabel("wall time (s)")
    ax.set_title(title or "Where the wall time went")
    fig.legend(loc="outside lower center", ncols=4, fontsize="small", frameon=False)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=dpi)
    return output
