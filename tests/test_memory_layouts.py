"""Issue 67: a rank holds its part of the model, not the whole, from the build on (benchmarks.memory's measure).

    .venv/bin/pytest -q tests/test_memory_layouts.py

A Llama shape of about 390 MB of fp32 weights, in fresh ranks: each rank's peak resident memory above its own
baseline (before the model is built), up to the first step and over two AdamW steps (the second backward runs
beside the optimizer state the first step made). Before the meta-device build,
every layout's rank peaked at a world of one's at the first step (each built the whole model, then kept its part).
"""

from __future__ import annotations

import pytest

from benchmarks.memory import measure

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

MODEL = {
    "arch": "llama",
    "vocab_size": 4000,
    "dim": 1024,
    "depth": 8,
    "heads": 16,
    "kv_heads": 8,
    "mlp_dim": 2688,
    "max_len": 32,
    "tied": False,
}


def test_pp2_tp2_and_fsdp2_ranks_peak_well_under_a_world_of_one(tmp_path):
    """Each sharded layout's rank peaks at most 0.7 of a world of one's, at the first step and over a step (half
    the model a rank, plus what every rank keeps whole: the norms; tp2 now shards the 4,000-id vocabulary too)."""
    (one,) = measure("one", 1, {}, MODEL, 2, str(tmp_path))
    # the model's 390 MB, and the step's gradients and AdamW state on top
    assert one["setup_peak"] > 370 and one["train_peak"] > 1200, one
    for label, parallel in (("pp2", {"pipeline": 2}), ("tp2", {"tensor": 2}), ("fsdp2", {"mode": "fsdp2"})):
        for rank in measure(label, 2, parallel, MODEL, 2, str(tmp_path)):
            assert rank["setup_peak"] < 0.7 * one["setup_peak"], (label, rank, one)
            assert rank["train_peak"] < 0.7 * one["train_peak"], (label, rank, one)
