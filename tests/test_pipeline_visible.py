"""What a pipeline shows of itself, on real Gloo ranks: each stage's busy and idle time in ``metrics.jsonl`` and in
the timeline, and a hang report that names the stuck stage.

    .venv/bin/pytest -q tests/test_pipeline_visible.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import run_in_pool
from torch import nn

import ddpkit
from ddpkit.testing import RankFailure
from ddpkit.watchdog.report import Verdict, format_report, layout_coordinate, summary_line

pytestmark = pytest.mark.timeout(300)


class Mlp(ddpkit.Trainer):
    """A user's model cut by module names into two stages; rank ``stall_rank`` sleeps after step 1 when set."""

    stall_rank = -1

    def build_model(self):
        layers = [nn.Linear(144, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)]
        return nn.Sequential(nn.Flatten(), *layers)

    def on_step_end(self, step: int) -> None:
        if self.rank == self.stall_rank and step == 1:
            time.sleep(120)


def _config(out: Path, **train) -> dict:
    """pp2, gpipe, 4 microbatches (theory: a bubble of 1/5), 4 steps logged every 2, the timeline on."""
    return {
        "run": {"name": "mlp", "output_dir": str(out), "seed": 0},
        "data": {"name": "digits", "global_batch_size": 32, "kwargs": {"num_train": 256, "image_size": 12}},
        "optim": {"name": "sgd", "lr": 0.1},
        "train": {"max_steps": 4, "log_every": 2, "timeline": True, **train},
        "parallel": {"pipeline": 2, "microbatches": 4, "split_points": ["3"], "schedule": "gpipe"},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }


def _fit(cfg: dict, stall_rank: int = -1) -> dict:
    Mlp.stall_rank = stall_rank
    return Mlp(cfg).fit()


@pytest.mark.multiprocess
def test_each_stage_s_busy_and_idle_time_is_in_metrics_jsonl_and_the_timeline(tmp_path):
    run_in_pool(_fit, 2, args=(_config(tmp_path),), timeout=120)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in training] == [2, 4]
    for record in training:
        assert record["bubble_theory"] == pytest.approx(0.2)
        for stage in (0, 1):
            assert 0 < record[f"stage{stage}_busy_s"] < 10
            assert 0 <= record[f"stage{stage}_idle"] < 1
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    spans = [e for e in trace if e.get("ph") == "X"]
    for rank in (0, 1):
        mine = [e for e in spans if e["tid"] == rank]
        schedules = [e for e in mine if e["name"] == "forward"]
        computed = [e for e in mine if e["name"].startswith("stage ")]
        assert len(schedules) == 4
        # M forwards and M backwards a step on each stage, and the loss of each microbatch on the last (once more in
        # the first step: torch's stage infers its gradients' shapes from a loss of its own).
        names = [e["name"] for e in computed]
        assert names.count("stage forward") == names.count("stage backward") == 16
        assert names.count("stage loss") == (17 if rank == 1 else 0)
        # Each inside one of this rank's schedule spans: the gaps between them are the stage's idle time.
        for e in computed:
            assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1 for s in schedules)
        # The record's busy seconds are these spans' (steps 3 and 4: the second record's window).
        second = [e for e in computed if e["ts"] >= schedules[2]["ts"]]
        busy = sum(e["dur"] for e in second) / 1e6 / 2
        assert training[1][f"stage{rank}_busy_s"] == pytest.approx(busy, rel=1e-3, abs=1e-5)


def test_a_hang_report_names_each_rank_s_stage_and_replica():
    assert [layout_coordinate(r, world_size=4, pipeline=2) for r in range(4)] == [
        "stage 0 of replica 0",
        "stage 0 of replica 1",
        "stage 1 of replica 0",
        "stage 1 of replica 1",
    ]
    assert layout_coordinate(5, world_size=8, pipeline=2, tensor=2) == "stage 1 of replica 0, tensor rank 1"
    assert layout_coordinate(1, world_size=2, pipeline=1) is None
    now = time.time()
    beats = {
        0: {"step": 3, "phase": "forward", "since": now, "where": "stage 0 of replica 0"},
        1: {"step": 2, "phase": "hook", "since": now, "where": "stage 1 of replica 0"},
    }
    verdict = Verdict(stuck=[1], waiting=[0])
    assert "stuck: rank 1 (stage 1 of replica 0, step 2, hook)" in summary_line(verdict, beats, {}, stalled_for=9)
    text = format_report(verdict, beats, {}, {}, stalled_for=9, limit=5)
    assert "STUCK    rank 1: stage 1 of replica 0, step 2, in hook" in text
    assert "waiting  rank 0: stage 0 of replica 0, step 3, in forward" in text


@pytest.mark.multiprocess
def test_the_watchdog_names_the_stuck_stage_of_a_real_pipeline(tmp_path):
    cfg = _config(tmp_path, timeline=False)
    cfg["dist"] = {"hang_timeout": 4, "slow_phase_timeout": 30}
    # The last stage sleeps after step 1; the first goes on into step 2 and waits for it in the schedule.
    with pytest.raises(RankFailure):
        run_in_pool(_fit, 2, args=(cfg, 1), timeout=120)
    (report,) = (tmp_path / "logs").glob("hang-*.txt")
    text = report.read_text()
    assert "stuck: rank 1 (stage 1 of replica 0, step 1, loop); waiting: rank 0" in text
    assert "STUCK    rank 1: stage 1 of replica 0, step 1, in loop" in text
    assert "waiting  rank 0: stage 0 of replica 0, step 1, in forward" in text
