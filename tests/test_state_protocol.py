"""One state protocol: a checkpoint holds exactly the components registered by name.

Fast, no process group beyond a world of one: registration and restore order, reserved names,
late registration, and a checkpoint written by the previous release (format 1) resuming bitwise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise_equal, load_weights, tiny_config

import ddpkit
from ddpkit.checkpoint.components import Components, Progress, read_checkpoint
from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint
from ddpkit.errors import CheckpointError

V1_DIR = Path(__file__).parent / "data" / "checkpoint_v1"


def v1_config(out: Path) -> dict:
    """The config that wrote tests/data/checkpoint_v1 (a 6-step MLP run, checkpoints every 3 steps)."""
    return tiny_config(
        out,
        data={"kwargs": {"num_train": 64, "num_val": 16, "image_size": 6}, "batch_size": 16},
        model={"kwargs": {"in_features": 36, "hidden": [8]}},
        sched={"name": "cosine", "warmup_steps": 2},
        train={"epochs": None, "max_steps": 6, "log_every": 2, "eval_every": 3},
        checkpoint={"every_steps": 3, "keep_last": 2, "best": {"metric": "val_loss", "mode": "min"}},
    )


class Counter:
    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_a_checkpoint_holds_exactly_the_registered_names():
    components = Components()
    components.register("progress", Progress(step=7))
    components.register("counter", Counter(3))
    components.register("scheduler", None)  # nothing to save: not in the schema
    state = components.capture(metadata={"world_size": 1})
    assert state["schema"] == ["progress", "counter"]
    assert state["counter"] == {"value": 3} and state["progress"]["step"] == 7

    fresh, counter, spare = Components(), Counter(), Counter(5)
    progress = Progress()
    fresh.register("progress", progress)
    fresh.register("counter", counter)
    fresh.register("spare", spare)  # not in the checkpoint: keeps its state as built
    fresh.restore(state)
    assert progress.step == 7  # restored in place: everyone holding the object sees it
    assert counter.value == 3 and spare.value == 5
    with pytest.raises(ValueError, match="reserved"):
        fresh.register("world_size", Counter())


def test_a_file_without_the_required_parts_is_refused_with_the_fix():
    with pytest.raises(CheckpointError, match="lacks .*model.*checkpoint.resume=none"):
        read_checkpoint(
            {"schema": [], "rng": [], "world_size": 1, "config": {}, "config_hash": "", "versions": {}}, path="x.pt"
        )


def test_a_format_1_checkpoint_reads_into_the_current_layout():
    state = read_checkpoint(load_checkpoint(V1_DIR / "step-000000003.pt"), path="v1")
    # no scaler: fp32
    assert state["schema"] == ["model", "optimizer", "scheduler", "progress", "early_stopping", "best", "sinks"]
    assert state["progress"]["step"] == 3 and "components" not in state


def test_a_checkpoint_of_the_previous_release_resumes_to_the_same_bits(tmp_path):
    cfg = v1_config(tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for name in ("step-000000003.pt", "step-000000003.json"):
        shutil.copy(V1_DIR / name, checkpoints / name)
    metrics = ddpkit.Trainer(cfg).fit()
    assert metrics["step"] == 6
    resumed = load_weights(tmp_path / "run" / "model.pt")
    # The same state written in today's format resumes to exactly the same bits on this machine.
    state = read_checkpoint(load_checkpoint(V1_DIR / "step-000000003.pt"), path="v1")
    meta = {
        key: value
        for key, value in json.loads((V1_DIR / "step-000000003.json").read_text()).items()
        if key in ("epoch", "config_hash", "versions")
    }
    save_checkpoint(state, tmp_path / "today" / "run" / "checkpoints", step=3, meta=meta)
    ddpkit.Trainer(v1_config(tmp_path / "today")).fit()
    assert_bitwise_equal(resumed, load_weights(tmp_path / "today" / "run" / "model.pt"))
    for out in (tmp_path, tmp_path / "today"):  # both resumed at step 3 (a fresh run would log step 2 too)
        records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "train_loss" in r] == [4, 6]
    # The old release's own step-6 weights were computed on an Intel CPU, whose MKL kernels sum in
    # another order than on other CPUs (AVX2 kernels on an AMD EPYC): the same bits there, float32
    # rounding apart elsewhere (1.5e-8 seen).
    reference = load_weights(V1_DIR / "model-step-6.pt")
    assert reference.keys() == resumed.keys()
    for key, value in reference.items():
        assert torch.allclose(resumed[key], value, rtol=0, atol=1e-6), key
    newest = load_checkpoint(checkpoints / "step-000000006.pt")
    # The schema is the registered names (fp32: no scaler), each saved under its own key.
    assert {"progress", "best", "model", "optimizer", "scheduler", "sinks"} <= set(newest["schema"])
    assert "early_stopping" not in newest["schema"]  # registered only when train.early_stopping is configured
    assert "scaler" not in newest["schema"] and all(name in newest for name in newest["schema"])
    assert torch.is_tensor(newest["model"]["net.1.weight"]) and "components" not in newest


V2_DIR = Path(__file__).parent / "data" / "checkpoint_v2"


def test_a_checkpoint_of_the_release_before_the_state_owner_resumes_to_the_same_bits(tmp_path):
    """Format 2 (commit 4371f48): the RNG streams beside the schema, not in it; restored all the same."""
    raw = load_checkpoint(V2_DIR / "step-000000003.pt")
    assert "rng" in raw and "rng" not in raw["schema"]
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for name in ("step-000000003.pt", "step-000000003.json"):
        shutil.copy(V2_DIR / name, checkpoints / name)
    assert ddpkit.Trainer(v1_config(tmp_path)).fit()["step"] == 6
    resumed = load_weights(tmp_path / "run" / "model.pt")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [4, 6]  # resumed at step 3
    # The same state re-saved in today's format (rng now a component in the schema) resumes to the same bits.
    state = read_checkpoint(raw, path="v2")
    meta = {
        key: value
        for key, value in json.loads((V2_DIR / "step-000000003.json").read_text()).items()
        if key in ("epoch", "config_hash", "versions")
    }
    save_checkpoint(
        {**state, "schema": [*state["schema"], "rng"]}, tmp_path / "today" / "run" / "checkpoints", step=3, meta=meta
    )
    ddpkit.Trainer(v1_config(tmp_path / "today")).fit()
    assert_bitwise_equal(resumed, load_weights(tmp_path / "today" / "run" / "model.pt"))
    # the old release's own end (another CPU may round apart)
    for key, value in load_weights(V2_DIR / "model-step-6.pt").items():
        assert torch.allclose(resumed[key], value, rtol=0, atol=1e-6), key
    newest = load_checkpoint(checkpoints / "step-000000006.pt")
    assert "rng" in newest["schema"] and len(newest["rng"]) == 1  # today: a registered part, one stream set per rank


def test_rng_streams_outside_the_schema_of_an_older_checkpoint_are_restored():
    components, streams = Components(), Counter()
    components.register("rng", streams)
    components.restore({"schema": [], "rng": {"value": 9}})  # format 2: rng beside the schema
    assert streams.value == 9
