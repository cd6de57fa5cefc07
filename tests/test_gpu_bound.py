"""benchmarks.gpu_bound on the CPU (``--tiny``): both sides train the same job, every arm and the stall mode run.

The figures this benchmark exists for need a GPU (benchmarks/RESULTS.md); here the same code path runs
with tiny shapes, so a session that is lent a GPU finds a benchmark that works.

    .venv/bin/pytest tests/test_gpu_bound.py
"""

from __future__ import annotations

import importlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def _bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "runs.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_bound",
            "--tiny",
            "--device",
            "cpu",
            "--rounds",
            "1",
            "--warmup",
            "2",
            "--json",
            str(out),
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"printed": proc.stdout, **json.loads(out.read_text())}


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["gpt2", "resnet50"])
def test_the_hand_written_loop_and_ddpkit_train_the_same_job_on_on_device_data(tmp_path, workload):
    """In the slow set: each case starts benchmarks.gpu_bound as its own process and trains both arms; no fast test runs
    the two arms."""
    result = _bench(tmp_path, "--workload", workload, "--mode", "eager", "--seconds", "0.3")
    runs = result["runs"]
    assert sorted(runs) == ["ddpkit-eager", "hand-eager"]
    hand, ddpkit = runs["hand-eager"][0], runs["ddpkit-eager"][0]
    # Same seed, same batch order, same model and optimizer: the first losses (up to 20) are bitwise equal on the CPU.
    kept = min(len(hand["losses"]), len(ddpkit["losses"]))
    assert kept >= 3 and hand["losses"][:kept] == ddpkit["losses"][:kept]
    for run in (hand, ddpkit):
        assert run["per_s"] > 0 and all(ms > 0 for ms in run["step_ms"]) and run["step_ms"]
    unit = "tokens/s" if workload == "gpt2" else "images/s"
    assert unit in result["printed"] and "x hand" in result["printed"] and "CPU, torch" in result["machine"]


@pytest.mark.slow
def test_the_stall_mode_saves_synchronously_and_in_the_background(tmp_path):
    """In the slow set: it starts benchmarks.gpu_bound as a process and trains three arms, and the fast set keeps
    test_save_costs_puts_a_save_in_the_step_after_it for how a save's cost is read from the step times."""
    result = _bench(tmp_path, "--stall", "--every", "4", "--after", "2", "--seconds", "1")
    runs = result["runs"]
    assert sorted(runs) == ["async", "no saves", "sync"]
    gpu_bound = importlib.import_module("benchmarks.gpu_bound")
    for name in ("sync", "async"):
        costs = gpu_bound.save_costs(runs[name][0]["step_ms"], warmup=2, every=4, after=2)
        assert costs["blocked"] and len(costs["blocked"]) == len(costs["lost"])  # saves happened and were measured
        # writing, hashing and fsyncing a file holds a ~1 ms step up by several steps: seen where it lands
        if name == "sync":
            assert statistics.median(costs["blocked"]) * 1000 > costs["typical"] / 2, costs
    assert "blocked s" in result["printed"] and "no saves" in result["printed"]


def test_save_costs_puts_a_save_in_the_step_after_it():
    gpu_bound = importlib.import_module("benchmarks.gpu_bound")
    # Steps 3 .. 22 (warm-up 2) of 10 ms; saves at steps 5, 10, 15, 20 cost 40 ms in the step after each.
    step_ms = [10.0 + (40.0 if (3 + i) % 5 == 1 else 0.0) for i in range(20)]
    costs = gpu_bound.save_costs(step_ms, warmup=2, every=5, after=1)
    assert costs["typical"] == 10.0
    assert costs["blocked"] == costs["lost"] == [0.04] * 4
    assert costs["near"] == [50.0] * 4
    later = gpu_bound.save_costs(step_ms, warmup=2, every=5, after=3)  # the save at step 20 has no step 23: not counted
    assert later["lost"] == [0.04] * 3 and later["typical"] == 10.0
