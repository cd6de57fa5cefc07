"""Scaling-efficiency plot for ``ddpkit bench throughput --plot out.png`` (optional matplotlib).

matplotlib is an optional extra (``pip install 'ddpkit[plot]'``); without it ``--plot`` fails
before any benchmark runs, with a message naming the extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddpkit.bench.units import BenchUsageError

__all__ = ["require_matplotlib", "plot_scaling"]


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or a BenchUsageError naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise BenchUsageError(
            "--plot needs matplotlib, which is not installed: pip install 'ddpkit[plot]' (or leave out --plot)"
        ) from None
    # Write files; never try to open a window
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scaling(rows: list[dict[str, Any]], path: str | Path, *, title: str) -> None:
    """Plot scaling efficiency (and samples/s on a second axis) against world size; write ``path``."""
    plt = require_matplotlib()
    counts = [r["nproc"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    if all(r["efficiency"] is not None for r in rows):
        ax.plot(counts, [r["efficiency"] for r in rows], "o-", label="scaling efficiency")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="perfect scaling")
        ax.set_ylim(0, max(1.1, max(r["efficiency"] for r in rows) * 1.1))
    ax.set_xlabel("world size (processes)")
    ax.set_ylabel("throughput_N / (N x throughput_1)")
    ax.set_xticks(counts)
    ax.set_title(title)
    rate = ax.twinx()
    rate.plot(counts, [r["samples_per_s"] for r in rows], "s:", color="tab:orange", label="samples/s")
    rate.set_ylabel("samples/s")
    rate.set_ylim(0, max(r["samples_per_s"] for r in rows) * 1.15)
    handles = ax.get_legend_handles_labels()[0] + rate.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
