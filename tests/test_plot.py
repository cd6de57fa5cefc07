"""`ddpkit plot`: reading metrics.jsonl, drawing overlaid runs, and clear errors."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from helpers import run_cli, tiny_config

import ddpkit.tools.plot
from ddpkit.errors import DdpkitError
from ddpkit.tools.plot import load_metrics, main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# matplotlib is the optional `ddpkit[plot]` extra: drawing tests need it, error tests do not.
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="pip install 'ddpkit[plot]'"
)


def write_run(run_dir: Path, *, steps: int = 20, lr: float = 0.1, extra_lines: str = "") -> Path:
    """A run directory with a metrics.jsonl shaped like the Trainer's."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(5, steps + 1, 5):
        lines.append(
            {
                "step": step,
                "epoch": 0,
                "train_loss": 2.3 / step,
                "lr": lr,
                "samples_per_s": 1000.0 + step,
                "time": 1.0 + step,
            }
        )
        if step % 10 == 0:
            lines.append(
                {"step": step, "epoch": 0, "val_loss": 2.0 / step, "val_accuracy": step / 100, "time": 1.5 + step}
            )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + extra_lines)
    return run_dir


def test_load_metrics_keeps_the_last_record_per_step_and_skips_a_cut_line(tmp_path):
    resumed = json.dumps({"step": 10, "epoch": 0, "train_loss": 9.0, "lr": 0.1, "samples_per_s": None, "time": 3.0})
    run = load_metrics(write_run(tmp_path / "a", extra_lines=resumed + "\n" + '{"step": 15, "train_lo'))

    assert run.name == "a"
    assert run.skipped_lines == 1
    assert [s for s, _ in run.series["train_loss"]] == [5, 10, 15, 20]
    assert dict(run.series["train_loss"])[10] == 9.0  # the resumed run's record wins
    assert math.isnan(dict(run.series["samples_per_s"])[10])  # JSON null (a non-finite value) -> NaN
    assert run.val_metrics() == ["val_accuracy"]
    assert "epoch" not in run.series and "time" not in run.series


def test_load_metrics_errors_name_the_path(tmp_path):
    with pytest.raises(DdpkitError, match="does not exist"):
        load_metrics(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DdpkitError, match="has no metrics.jsonl"):
        load_metrics(tmp_path / "empty")
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(DdpkitError, match="holds no metric records"):
        load_metrics(tmp_path / "empty")


@needs_matplotlib
def test_plot_overlays_runs_into_one_png(tmp_path, capsys):
    from PIL import Image

    a = write_run(tmp_path / "lr0.1")
    b = write_run(tmp_path / "lr0.5", steps=30, lr=0.5)
    out = tmp_path / "figs" / "sweep.png"

    assert main([str(a), str(b), "-o", str(out), "--title", "sweep"]) == 0

    assert out.read_bytes()[:8] == PNG_SIGNATURE
    width, height = Image.open(out).size
    assert width > 1000 and height > 700  # four panels: loss, accuracy, lr, throughput
    assert f"wrote {out}" in capsys.readouterr().out


@needs_matplotlib
def test_one_run_defaults_to_metrics_png_in_its_directory(tmp_path):
    run = write_run(tmp_path / "only")
    assert main([str(run)]) == 0
    assert (run / "metrics.png").read_bytes()[:8] == PNG_SIGNATURE


def test_runs_with_the_same_directory_name_get_distinct_labels(tmp_path):
    from ddpkit.tools.plot import _unique_names

    assert _unique_names([tmp_path / "x" / "run", tmp_path / "y" / "run"]) == ["x/run", "y/run"]


def test_missing_run_is_a_clear_error_without_traceback(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert "ddpkit plot: error: run directory" in err and "does not exist" in err
    assert "Traceback" not in err


@needs_matplotlib
def test_unknown_image_format_is_a_clear_error(tmp_path, capsys):
    assert main([str(write_run(tmp_path / "r")), "-o", str(tmp_path / "plot.xyz")]) == 1
    err = capsys.readouterr().err
    assert "ddpkit plot: error: cannot write" in err and "use a .png, .svg or .pdf name" in err


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    # A None entry in sys.modules makes `import matplotlib...` raise ImportError.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    importlib.reload(ddpkit.tools.plot)  # importing the module itself must not need matplotlib
    assert ddpkit.tools.plot.main([str(write_run(tmp_path / "r")), "-o", str(tmp_path / "x.png")]) == 1

    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install 'ddpkit[plot]'" in err
    assert "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


@needs_matplotlib
@pytest.mark.multiprocess
def test_cli_plots_a_real_run(tmp_path):
    """A real single-process run through `ddpkit train`, then `ddpkit plot` on its directory. Both are commands as a
    user types them: `ddpkit plot` must read what a real `ddpkit train` wrote, and exit 0."""
    import yaml

    cfg = tiny_config(tmp_path, train={"epochs": 2, "log_every": 2, "eval_every": 8})
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg))
    trained = run_cli("train", str(config), timeout=120)
    assert trained.returncode == 0, trained.stderr

    plotted = run_cli("plot", cfg["run"]["output_dir"], "-o", str(tmp_path / "real.png"), timeout=120)
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp_path / "real.png").read_bytes()[:8] == PNG_SIGNATURE
