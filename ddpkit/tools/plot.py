"""Draw the ``metrics.jsonl`` of one or more runs: ``ddpkit plot RUN_DIR [RUN_DIR ...] [-o out.png]``.

    ddpkit plot runs/quickstart                              # writes runs/quickstart/metrics.png
    ddpkit plot runs/lr0.05 runs/lr0.1 -o lr_sweep.png       # several runs overlaid, one colour each
    ddpkit plot --goodput runs/quickstart                    # where the wall time went, per attempt

One figure, one panel per quantity, all against the optimizer step:

* loss: training loss (solid) and validation loss (dashed, with markers);
* every other validation metric (``val_accuracy``, ...), one panel each;
* learning rate, and throughput in samples per second (all ranks together).

Each run's legend entry is its directory name. The figure is drawn with matplotlib's Agg
canvas (no display, no GUI toolkit, no global pyplot state), so it works on headless nodes.
matplotlib is an optional extra: ``pip install 'ddpkit[plot]'``.

How the records are read: ``metrics.jsonl`` holds one JSON object per line. Training records
have ``step, epoch, train_loss, lr, samples_per_s, time``; evaluation records have ``step,
epoch, val_<metric>..., time``. A resumed or restarted run appends to the same file, so when a
step appears more than once the last record wins (the history of the run that continued). A
line cut short by a crash is skipped with a warning.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.errors import DdpkitError, exit_code_of
from ddpkit.goodput.plot import plot_goodput
from ddpkit.reporting.log import EPOCH, LR, METRICS_FILE, SAMPLES_PER_S, STEP, TIME, TRAIN_LOSS, VAL_PREFIX

__all__ = ["main", "RunMetrics", "load_metrics", "plot_runs"]


@dataclass
class RunMetrics:
    """One run's history: ``series[key]`` is a step-sorted list of ``(step, value)`` pairs."""

    name: str
    path: Path
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    skipped_lines: int = 0

    def val_metrics(self) -> list[str]:
        """Validation metrics other than the loss, in a stable order."""
        return sorted(k for k in self.series if k.startswith(VAL_PREFIX) and k != f"{VAL_PREFIX}loss")


def load_metrics(run_dir: str | Path, *, name: str | None = None) -> RunMetrics:
    """Read ``RUN_DIR/metrics.jsonl`` (or a ``.jsonl`` file given directly).

    Raises:
        DdpkitError: the directory or file does not exist, or holds no usable records.
    """
    path = Path(run_dir)
    if not path.exists():
        raise DdpkitError(f"run directory {path} does not exist; pass a run's output_dir (e.g. runs/quickstart)")
    file = path if path.is_file() else path / METRICS_FILE
    if not file.is_file():
        raise DdpkitError(
            f"{path} has no {METRICS_FILE}; pass a run's output_dir, which rank 0 fills while training "
            "(has this run logged a step yet? see train.log_every)"
        )
    # Last record per (step, key): a resumed run replays steps after its checkpoint.
    latest: dict[str, dict[int, float]] = {}
    skipped = 0
    with open(file, encoding="utf-8") as lines:
        for line in lines:
            record = _parse(line)
            if record is None:
                skipped += line.strip() != ""
                continue
            step = record[STEP]
            for key, value in record.items():
                if key in (STEP, EPOCH, TIME) or isinstance(value, bool):
                    continue
                if value is None or isinstance(value, (int, float)):
                    latest.setdefault(key, {})[step] = math.nan if value is None else float(value)
    if not latest:
        raise DdpkitError(f"{file} holds no metric records yet; has the run logged a step (train.log_every)?")
    series = {key: sorted(points.items()) for key, points in latest.items()}
    return RunMetrics(name=name or _default_name(file), path=file, series=series, skipped_lines=skipped)


def _parse(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get(STEP), int):
        return None
    return record


def _default_name(file: Path) -> str:
    run_dir = file.parent if file.name == METRICS_FILE else file.with_suffix("")
    return run_dir.resolve().name


def _unique_names(paths: Sequence[Path]) -> list[str]:
    """Directory names, lengthened with parent directories until no two runs share a label."""
    resolved = [p.resolve() for p in paths]
    for depth in range(1, 8):
        names = ["/".join(p.parts[-depth:]) for p in resolved]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]


# --- drawing -------------------------------------------------------------------------------------

# (y-axis label, panel title) for the quantities ddpkit logs.
_LR = ("learning rate", "Learning rate")
_THROUGHPUT = ("samples / s (all ranks)", "Throughput")


def plot_runs(runs: Sequence[RunMetrics], output: str | Path, *, title: str | None = None, dpi: int = 120) -> Path:
    """Draw ``runs`` overlaid into a PNG (or any format matplotlib knows by the suffix) at ``output``.

    Raises:
        DdpkitError: matplotlib is not installed.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    panels = _panels(runs)
    columns = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(6.4 * columns, 3.6 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, draw in zip(axes, panels):
        draw(ax, runs, colors)
        ax.set_xlabel("optimizer step")
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="x", style="plain")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    # The run legend heads the figure; a title, if any, heads the legend (a separate suptitle
    # would overlap it under the constrained layout).
    fig.legend(
        handles=[_run_handle(color, run.name) for color, run in zip(colors, runs)],
        loc="outside upper center",
        ncols=min(len(runs), 4),
        frameon=False,
        title=title,
        title_fontproperties={"size": "large", "weight": "bold"},
    )
    output = Path(output)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(output, dpi=dpi)
    except ValueError as exc:
        # matplotlib: "Format 'xyz' is not supported ..."
        raise DdpkitError(f"cannot write {output}: {exc}; use a .png, .svg or .pdf name") from None
    except OSError as exc:
        raise DdpkitError(f"cannot write {output}: {exc.strerror or exc}") from None
    return output


def _matplotlib() -> tuple[Any, Any]:
    """matplotlib's Figure and Agg canvas, or a DdpkitError saying how to install it."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DdpkitError("ddpkit plot needs matplotlib, which is not installed: pip install 'ddpkit[plot]'") from None
    # The figure legend placed "outside" the axes needs matplotlib 3.7.
    if tuple(int(p) for p in matplotlib.__version__.split(".")[:2] if p.isdigit()) < (3, 7):
        raise DdpkitError(
            f"ddpkit plot needs matplotlib>=3.7 (found {matplotlib.__version__}): pip install -U 'matplotlib>=3.7'"
        )
    return Figure, FigureCanvasAgg


def _panels(runs: Sequence[RunMetrics]) -> list[Any]:
    """One drawing function per panel, for the quantities at least one run has."""

    def has(key: str) -> bool:
        return any(key in run.series for run in runs)

    panels = []
    if has(TRAIN_LOSS) or has(f"{VAL_PREFIX}loss"):
        panels.append(_draw_loss)
    for metric in sorted({m for run in runs for m in run.val_metrics()}):
        label = metric.removeprefix(VAL_PREFIX).replace("_", " ")
        # ddpkit's accuracies are fractions of samples
        percent = "accuracy" in metric
        panels.append(
            _single(metric, (f"{label} (%)" if percent else label, f"Validation {label}"), marker="o", percent=percent)
        )
    if has(LR):
        panels.append(_single(LR, _LR, scientific=True))
    if has(SAMPLES_PER_S):
        panels.append(_single(SAMPLES_PER_S, _THROUGHPUT, from_zero=True))
    return panels


def _draw_loss(ax: Any, runs: Sequence[RunMetrics], colors: list[str]) -> None:
    from matplotlib.lines import Line2D

    for run, color in zip(runs, colors):
        _line(ax, run.series.get(TRAIN_LOSS), color=color, linestyle="-")
        _line(ax, run.series.get(f"{VAL_PREFIX}loss"), color=color, linestyle="--", marker="o")
    ax.set_title("Loss")
    ax.set_ylabel("loss")
    styles = [
        Line2D([], [], color="0.3", linestyle="-", label="training"),
        Line2D([], [], color="0.3", linestyle="--", marker="o", markersize=4, label="validation"),
    ]
    ax.legend(handles=styles, loc="upper right", fontsize="small")


def _single(
    key: str,
    labels: tuple[str, str],
    *,
    marker: str | None = None,
    scientific: bool = False,
    from_zero: bool = False,
    percent: bool = False,
) -> Any:
    def draw(ax: Any, runs: Sequence[RunMetrics], colors: list[str]) -> None:
        for run, color in zip(runs, colors):
            _line(ax, run.series.get(key), color=color, linestyle="-", marker=marker)
        ax.set_ylabel(labels[0])
        ax.set_title(labels[1])
        if scientific:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
        if from_zero:
            ax.set_ylim(bottom=0)
        if percent:
            from matplotlib.ticker import PercentFormatter

            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))

    return draw


def _line(
    ax: Any, points: list[tuple[int, float]] | None, *, color: str, linestyle: str, marker: str | None = None
) -> None:
    if not points:
        return
    steps, values = zip(*points)
    # A single point draws no line: always mark it.
    marker = marker or ("o" if len(points) == 1 else None)
    ax.plot(steps, values, color=color, linestyle=linestyle, marker=marker, markersize=4, linewidth=1.5)


def _run_handle(color: str, name: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=color, label=name)


# --- command line --------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpkit plot",
        description="Plot loss, validation metrics, learning rate and throughput of one or more runs against the step.",
    )
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="a run's output_dir (holding metrics.jsonl), or a metrics .jsonl file",
    )
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        help="image to write (.png, .svg, .pdf); default RUN_DIR/metrics.png for one run, ./metrics.png for several",
    )
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument("--dpi", type=int, default=120, help="resolution of raster output (default 120)")
    parser.add_argument(
        "--goodput",
        action="store_true",
        help="draw where the wall time went (goodput.jsonl) instead; default output RUN_DIR/goodput.png",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """``ddpkit plot``: returns 0 on success, 1 on a user error (message on stderr), 2 on bad usage."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        # argparse already printed usage or help
        return int(exc.code or 0)
    return exit_code_of(lambda: _plot(args), command="ddpkit plot")


def _plot(args: argparse.Namespace) -> int:
    names = _unique_names([Path(p) for p in args.runs])
    # One stacked bar per run and per attempt (ddpkit.goodput.plot)
    if args.goodput:
        single = len(args.runs) == 1 and Path(args.runs[0]).is_dir()
        output = args.output or (Path(args.runs[0]) / "goodput.png" if single else "goodput.png")
        print(f"wrote {plot_goodput(args.runs, names, output, title=args.title)}")
        return 0
    runs = [load_metrics(path, name=name) for path, name in zip(args.runs, names)]
    for run in runs:
        if run.skipped_lines:
            print(
                f"ddpkit plot: warning: skipped {run.skipped_lines} unreadable line(s) in {run.path}", file=sys.stderr
            )
    output = args.output or (
        Path(args.runs[0]) / "metrics.png" if len(runs) == 1 and Path(args.runs[0]).is_dir() else Path("metrics.png")
    )
    written = plot_runs(runs, output, title=args.title, dpi=args.dpi)
    print(f"wrote {written}")
    return 0
