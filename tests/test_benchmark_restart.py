"""``python -m benchmarks.restart`` on the CPU with its smallest settings: a tiny GPT is SIGKILLed after its first
checkpoint, restarted once by a new interpreter and once by a warm standby, and each restart is split into parts.

    .venv/bin/pytest tests/test_benchmark_restart.py
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


@pytest.mark.slow
def test_restart_benchmark_resumes_both_ways_and_its_parts_add_up_to_the_total(tmp_path):
    """In the slow set: the benchmark trains a tiny GPT, SIGKILLs it and restarts it twice in new processes; no fast
    test runs it."""
    out = tmp_path / "restart.json"
    # the stdlib corpus, built once for the three processes
    env = {**os.environ, "DDPKIT_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.restart",
            "--device",
            "cpu",
            "--rounds",
            "1",
            "--every-steps",
            "2",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (
        "new interpreter: restart request -> first step" in done.stdout
        and "warm standby / new interpreter, total (paired)" in done.stdout
    )

    result = json.loads(out.read_text())
    runs = {run["arm"]: run for run in result["runs"]}
    assert sorted(runs) == ["new interpreter", "warm standby"] and len(result["runs"]) == 2
    for arm, run in runs.items():
        parts, stamps = run["parts"], run["stamps"]
        measured = {name: seconds for name, seconds in parts.items() if seconds is not None}
        assert parts["CUDA context"] is None  # the CPU
        assert (parts["imports"] is None) == (arm == "warm standby")  # the standby imported before the request
        assert all(seconds > 0 for seconds in measured.values()), (arm, parts)
        assert math.isclose(sum(v for k, v in measured.items() if k != "total"), parts["total"], abs_tol=1e-6), (
            arm,
            parts,
        )
        assert stamps["resumed_step"] == stamps["restored_step"] == result["checkpoint_step"] >= 2
        assert stamps["step"] == result["checkpoint_step"] + 1
