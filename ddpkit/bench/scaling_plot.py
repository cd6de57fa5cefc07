"""Predicted scaling efficiency vs world size, one line per link: ``ddpkit bench scaling --plot out.png``.

    plot_efficiency(prediction_rows(profile, links, [1, 8, 64, 512]), "scaling.png", title="my.yaml")

Solid lines use the config's ``bucket_cap_mb``; dotted lines of the same colour the best cap the
model found for each world size. matplotlib is the optional extra ``ddpkit[plot]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddpkit.bench.plotting import require_matplotlib

__all__ = ["plot_efficiency"]


def plot_efficiency(rows: list[dict[str, Any]], path: str | Path, *, title: str) -> None:
    """Efficiency (``step_1 / step_N``) against world size on a log axis, one line per link; write ``path``."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    links = list(dict.fromkeys(r["link"] for r in rows))
    for index, link in enumerate(links):
        mine = sorted((r for r in rows if r["link"] == link), key=lambda r: r["ranks"])
        ranks = [r["ranks"] for r in mine]
        color = f"C{index % 10}"
        ax.plot(ranks, [r["efficiency"] for r in mine], "o-", color=color, label=f"{link}")
        ax.plot(ranks, [r["best_efficiency"] for r in mine], ":", color=color, label=f"{link}, best bucket_cap_mb")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("predicted efficiency, step_1 / step_N")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
