"""`ddpkit runs`: the table of runs, read from each run's own files."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import run_cli, tiny_config

from ddpkit.reporting.sinks import StatusSink
from ddpkit.tools.runs import find_runs, format_table, main, summarize_run


def write_run(
    root: Path,
    name: str,
    records: list[dict],
    *,
    status: dict | None = None,
    best_step: int | None = None,
    best_metric: str | None = None,
    model: bool = False,
) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(
        f"run:\n  name: {name}\ncheckpoint:\n  best:\n    metric: {best_metric}\n    mode: max\n"
        if best_metric
        else f"run:\n  name: {name}\n"
    )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if status is not None:
        (run / "status.json").write_text(json.dumps(status))
    if best_step is not None:
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "best.json").write_text(json.dumps({"step": best_step, "file": "best.pt"}))
    if model:
        (run / "model.pt").write_bytes(b"w")
    return run


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_table_rows_from_each_runs_files(tmp_path, capsys):
    t0 = 1_700_000_000.0
    records = [
        {"step": 10, "epoch": 0, "train_loss": 1.0, "time": t0},
        {"step": 20, "epoch": 0, "val_accuracy": 0.9, "val_loss": 0.3, "time": t0 + 5},
        {"step": 40, "epoch": 1, "val_accuracy": 0.8, "val_loss": 0.4, "time": t0 + 10},
    ]
    host = socket.gethostname()
    write_run(
        tmp_path,
        "done",
        records,
        status={"status": "FINISHED", "wall_s": 125.0, "attempts": 2, "host": host, "pid": 1},
        best_step=20,
        best_metric="val_accuracy",
    )
    write_run(
        tmp_path,
        "killed-hard",
        records[:1],
        status={
            "status": "RUNNING",
            "wall_s": 3.0,
            "attempts": 1,
            "host": host,
            "pid": dead_pid(),
            "attempt_started": time.time(),
        },
    )
    write_run(tmp_path, "old", records[:2], model=True)
    (tmp_path / "not-a-run").mkdir()

    assert [p.name for p in find_runs(tmp_path)] == ["done", "killed-hard", "old"]
    done = summarize_run(tmp_path / "done")
    assert (done.status, done.steps, done.val, done.wall_s, done.attempts) == (
        "FINISHED",
        40,
        {"val_accuracy": 0.8, "val_loss": 0.4},
        125.0,
        2,
    )
    assert done.best == "step 20 val_accuracy 0.9000"
    assert summarize_run(tmp_path / "killed-hard").status == "CRASHED"  # RUNNING, but its process is gone
    old = summarize_run(tmp_path / "old")
    assert (old.status, old.steps, old.wall_s, old.best) == ("FINISHED", 20, 5.0, "-")

    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "status", "steps", "val_accuracy", "val_loss", "best", "wall", "goodput"]
    # no goodput.jsonl
    assert lines[1].split() == [
        "done",
        "FINISHED",
        "40",
        "0.8000",
        "0.4000",
        "step",
        "20",
        "val_accuracy",
        "0.9000",
        "2m05s",
        "-",
    ]
    assert lines[2].split()[:5] == ["killed-hard", "CRASHED", "10", "-", "-"]
    assert lines[3].split() == ["old", "FINISHED", "20", "0.9000", "0.3000", "-", "5s", "-"]
    assert len({line.index("steps") if i == 0 else None for i, line in enumerate(lines)}) == 2  # one header

    assert main([str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["done", "killed-hard", "old"] and rows[0]["val"]["val_loss"] == 0.4


def test_a_run_directory_itself_and_a_live_run(tmp_path, capsys):
    run = write_run(tmp_path, "live", [{"step": 5, "train_loss": 0.5, "time": 1.0}])
    sink = StatusSink(run)
    sink.start({}, resumed={"wall_s": 60.0, "attempts": 1, "started": 1.0})  # this process: alive
    row = summarize_run(run)
    assert row.status == "RUNNING" and row.attempts == 2 and row.wall_s >= 60.0
    assert main([str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["live", "RUNNING", "5"]


def test_errors_are_one_line_with_the_fix(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 1
    assert "no such directory" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 0
    assert "no runs under" in capsys.readouterr().err
    assert format_table([]).startswith("name")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ddpkit_runs_after_a_real_run(tmp_path):
    """What a user sees: the table `ddpkit runs` prints on stdout for the directory a real `ddpkit run` left."""
    import yaml

    cfg = tiny_config(
        tmp_path,
        run={"name": "real", "output_dir": str(tmp_path / "runs" / "real")},
        checkpoint={"every_epochs": 1, "best": {"metric": "val_accuracy", "mode": "max"}},
    )
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    done = run_cli("run", str(tmp_path / "c.yaml"), "--nproc-per-node", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    table = run_cli("runs", str(tmp_path / "runs"), timeout=60)
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()
    assert header.split()[:5] == ["name", "status", "steps", "val_accuracy", "val_loss"]
    cells = row.split()
    assert cells[:3] == ["real", "FINISHED", "16"] and cells[5] == "step"  # 256 samples / (16 x 2) = 8 steps x 2 epochs
    status = json.loads((tmp_path / "runs" / "real" / "status.json").read_text())
    assert status["status"] == "FINISHED" and status["attempts"] == 1
