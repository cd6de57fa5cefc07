"""Validation under a pipeline (``parallel.pipeline``) on real Gloo ranks: every validation batch forward through
the stages, the metrics on the last one, against a world of one on the same validation set.

    .venv/bin/pytest -q tests/test_pipeline_eval.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import RaggedSequences, run_in_pool
from torch import nn

import ddpkit
from ddpkit.parallel.pipeline_forward import PipelineForward
from ddpkit.parallel.pipeline_split import HeldParts

pytestmark = pytest.mark.timeout(300)


class Recording:
    """Keeps every validation's metrics (the step they were taken at is the list's order)."""

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        self.validations.append(dict(metrics))


class Mlp(Recording, ddpkit.Trainer):
    """A user's model cut by module names (untied: the same arithmetic as one process)."""

    validations: list[dict[str, float]] = []

    def build_model(self):
        layers = [nn.Linear(144, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)]
        return nn.Sequential(nn.Flatten(), *layers)


class TiedGpt(Recording, ddpkit.Trainer):
    """ddpkit's tied GPT on ragged sequences; 21 validation sequences in batches of 3 then 2 per replica."""

    validations: list[dict[str, float]] = []

    def build_datasets(self):
        return RaggedSequences(n=64), RaggedSequences(n=21, vocab=50)


def _mlp(out: Path, *, pipeline: int, schedule: str = "gpipe") -> dict:
    """Digits, global batch 32 as 4 microbatches (or 4-way accumulation), validated at steps 3 and 6 on 50
    samples: batches of 8 and a short last one (another input shape)."""
    cfg = {
        "run": {"name": "mlp", "output_dir": str(out), "seed": 0},
        "data": {
            "name": "digits",
            "global_batch_size": 32,
            "kwargs": {"num_train": 256, "num_val": 50, "image_size": 12},
        },
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": {"max_steps": 6, "log_every": 3, "eval_every": 3},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }
    if pipeline > 1:
        cfg["parallel"] = {"pipeline": 2, "microbatches": 4, "split_points": ["3"], "schedule": schedule}
    else:
        cfg["train"]["grad_accum_steps"] = 4
    return cfg


def _gpt(out: Path, *, pipeline: int) -> dict:
    """The tied GPT as tests/test_pipeline.py trains it, interleaved (two stages a rank), validated twice."""
    cfg = {
        "run": {"name": "gpt", "output_dir": str(out), "seed": 3},
        "data": {"global_batch_size": 8, "order": "index_free", "val_batch_size": 3},
        "model": {"name": "gpt", "kwargs": {"vocab_size": 50, "dim": 32, "depth": 4, "heads": 2, "max_len": 16}},
        "optim": {"name": "sgd", "lr": 0.5},
        "train": {"max_steps": 4, "log_every": 2, "eval_every": 2},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }
    if pipeline > 1:
        cfg["parallel"] = {"pipeline": 2, "microbatches": 4, "schedule": "interleaved_1f1b", "stages_per_rank": 2}
    else:
        cfg["train"]["grad_accum_steps"] = 4
    return cfg


def _validate(trainer_class: type, cfg: dict) -> list[dict[str, float]]:
    trainer_class.validations = []
    trainer = trainer_class(cfg)
    trainer.fit()
    return trainer_class.validations


def _one_of_each(tmp: Path) -> dict:
    return {
        "mlp": _validate(Mlp, _mlp(tmp / "mlp", pipeline=1)),
        "gpt": _validate(TiedGpt, _gpt(tmp / "gpt", pipeline=1)),
    }


def _two_stages(tmp: Path) -> dict:
    return {
        "gpipe": _validate(Mlp, _mlp(tmp / "gpipe", pipeline=2)),
        "1f1b": _validate(Mlp, _mlp(tmp / "1f1b", pipeline=2, schedule="1f1b")),
        "gpt": _validate(TiedGpt, _gpt(tmp / "gpt", pipeline=2)),
    }


def _close(a: list[dict[str, float]], b: list[dict[str, float]], *, rel: float) -> None:
    assert [m.keys() for m in a] == [m.keys() for m in b]
    for got, expected in zip(a, b):
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=rel, abs=0), name


@pytest.mark.multiprocess
def test_validation_under_two_stages_equals_a_world_of_one_on_the_same_validation_set(tmp_path):
    one = run_in_pool(_one_of_each, 1, args=(tmp_path / "one",), timeout=120)[0]
    results = run_in_pool(_two_stages, 2, args=(tmp_path / "pp",), timeout=240)
    assert len(one["mlp"]) == 2 and len(one["gpt"]) == 2
    for rank in results:
        # Every rank reports the same exact means; the untied MLP trains and validates bitwise like one process.
        assert rank["gpipe"] == one["mlp"]
        assert rank["1f1b"] == one["mlp"]
        # The tied GPT trains within 1e-6 (its tied gradients add in another order, docs/modes.md#pipelines).
        _close(rank["gpt"], one["gpt"], rel=1e-6)
        assert rank["gpt"] == results[0]["gpt"]


def _pp2_x_dp2(tmp: Path) -> list[dict[str, float]]:
    return _validate(Mlp, _mlp(tmp, pipeline=2))


@pytest.mark.multiprocess
def test_validation_under_pp2_x_dp2_equals_a_world_of_one(tmp_path):
    one = run_in_pool(_validate, 1, args=(Mlp, _mlp(tmp_path / "one", pipeline=1)), timeout=120)[0]
    # 50 validation samples over 2 replicas: 25 each, batches of 8 and one of 1 (the stages agree on the shapes).
    results = run_in_pool(_pp2_x_dp2, 4, args=(tmp_path / "pp",), timeout=240)
    for rank in results:
        assert rank == results[0]
        # Within 1e-8: the training's gradients are all-reduced over the replicas (another order of addition).
        _close(rank, one, rel=1e-8)


def test_the_held_parts_run_whole_only_inside_validation():
    forward = PipelineForward([nn.Linear(2, 2)], [1], total=2, device=torch.device("cpu"), group=None)
    held = HeldParts([nn.Sequential()], forward=forward)
    x = torch.zeros(1, 2)
    with pytest.raises(RuntimeError, match="call self.model\\(x\\) from validation_step only"):
        held(x)
    with pytest.raises(RuntimeError, match="with the batch's first element x"):
        with forward.expecting(x):
            held(torch.zeros(1, 2))
    with pytest.raises(RuntimeError, match="must call self.model\\(x\\) once per batch"):
        with forward.expecting(x):
            pass
    with pytest.raises(RuntimeError, match="a rank holds only its stages"):
        HeldParts([nn.Sequential()])(x)
