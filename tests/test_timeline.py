"""``train.timeline: true``: one Chrome-trace file, one row per rank, the loop's spans; off writes nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers import run_in_pool, tiny_config

import ddpkit
from ddpkit.reporting.timeline import Timeline

SPAN_NAMES = ("data", "forward", "backward", "optimizer", "checkpoint", "evaluation")  # the spans the Trainer records

# tiny_config: 256 samples, batch 16 per rank, 2 ranks -> 8 batches per epoch, 2 epochs.
BATCHES, EPOCHS = 8, 2


def _timeline_config(tmp: Path, **train):
    return tiny_config(
        tmp,
        train={"epochs": EPOCHS, "log_every": 4, "eval_every": 5, **train},
        checkpoint={"every_steps": 6, "every_epochs": None},
    )


def _fit_with_and_without_timeline(tmp: Path) -> dict:
    start = time.time_ns()
    ddpkit.Trainer(_timeline_config(tmp / "on", timeline=True)).fit()
    wall_us = (time.time_ns() - start) / 1000
    ddpkit.Trainer(_timeline_config(tmp / "off")).fit()  # the default: no timeline
    return {"wall_us": wall_us}


@pytest.mark.multiprocess
def test_two_ranks_write_one_merged_trace_with_a_row_per_rank(tmp_path):
    results = run_in_pool(_fit_with_and_without_timeline, world_size=2, args=(tmp_path,), timeout=120)
    trace = json.loads((tmp_path / "on/run/timeline.json").read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1} and {e["pid"] for e in events} == {0}

    steps = BATCHES * EPOCHS
    for rank in (0, 1):
        row = sorted((e for e in spans if e["tid"] == rank), key=lambda e: e["ts"])
        count = {name: sum(e["name"] == name for e in row) for name in SPAN_NAMES}
        assert set(count) == set(SPAN_NAMES) and all(count.values()), count
        assert count["data"] == count["forward"] == count["backward"] == steps  # one per micro-batch
        assert count["optimizer"] == steps
        assert count["checkpoint"] == 3  # steps 6 and 12, and the final one at 16
        assert count["evaluation"] == 4  # steps 5, 10 and 15, and the final one at 16
        # Sane durations: non-negative, one thread so never overlapping, all inside the run.
        assert all(e["dur"] >= 0 for e in row)
        for before, after in zip(row, row[1:]):
            assert after["ts"] >= before["ts"] + before["dur"] - 1e-3
        longest_fit = max(r["wall_us"] for r in results)
        assert sum(e["dur"] for e in row) <= longest_fit
        assert row[-1]["ts"] + row[-1]["dur"] <= longest_fit + 1e6  # the ranks' clocks start within a second
    # Both rows are on one clock: the ranks' first spans start within a second of each other.
    firsts = [min(e["ts"] for e in spans if e["tid"] == rank) for rank in (0, 1)]
    assert min(firsts) == 0 and max(firsts) < 1e6

    assert not (tmp_path / "off/run/timeline.json").exists()
    assert (tmp_path / "off/run/model.pt").exists()


def test_off_is_one_shared_no_op_and_writes_nothing(tmp_path):
    timeline = Timeline(enabled=False, rank=0, device=torch.device("cpu"))
    assert timeline.span("forward") is timeline.span("backward")  # nothing allocated per span
    with timeline.span("forward"):
        pass
    assert timeline.events == [] and timeline.write(tmp_path / "t.json") is None
    assert not (tmp_path / "t.json").exists()


def test_on_without_a_process_group_writes_one_row(tmp_path):
    timeline = Timeline(enabled=True, rank=0, device=torch.device("cpu"), max_events=2)
    for name in ("data", "forward", "backward"):  # the third is past max_events: dropped
        with timeline.span(name):
            time.sleep(0.001)
    path = timeline.write(tmp_path / "sub/t.json")
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["data", "forward"] and {e["tid"] for e in events} == {0}
    assert spans[0]["ts"] == 0 and all(e["dur"] >= 1000 for e in spans)  # microseconds
