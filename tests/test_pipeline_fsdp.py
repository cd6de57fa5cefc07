"""fsdp2 inside a pipeline (``parallel.mode: fsdp2`` with ``parallel.pipeline: 2``) on real Gloo ranks: the same
training and validation as a world of one accumulating the same microbatches, and sharded checkpoints that resume on
other layouts with the same samples and optimizer state.

    .venv/bin/pytest -q tests/test_pipeline_fsdp.py            # the 2-rank case; -m slow for the 4-rank ones
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import RaggedSequences, full_state, run_in_pool
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ddpkit
from ddpkit.parallel.gloo_collectives import BroadcastAllGather, InPlaceReduceScatter

pytestmark = pytest.mark.timeout(300)


class TiedGpt(ddpkit.Trainer):
    """ddpkit's tied GPT on ragged sequences, validated on 21 more (batches of 3, then a short one of 2 or 1)."""

    def build_datasets(self):
        return RaggedSequences(n=64), RaggedSequences(n=21)


def _gpt(out: Path, *, pipeline: int, replicas: int = 1, mode: str = "fsdp2") -> dict:
    """Global batch 8, clipped to 0.5 (the norm is 1.2 at the start: every step clips), validated at steps 2 and 4;
    a world of one accumulates the 4 microbatches the replicas' pipelines run."""
    cfg = {
        "run": {"name": "gpt", "output_dir": str(out), "seed": 3},
        "data": {"global_batch_size": 8, "order": "index_free", "val_batch_size": 3},
        "model": {"name": "gpt", "kwargs": {"vocab_size": 50, "dim": 32, "depth": 4, "heads": 2, "max_len": 16}},
        "optim": {"name": "sgd", "lr": 0.5, "momentum": 0.9},
        "train": {"max_steps": 4, "log_every": 2, "eval_every": 2, "clip_grad_norm": 0.5},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }
    if pipeline > 1:
        cfg["parallel"] = {"pipeline": pipeline, "microbatches": 4 // replicas, "mode": mode}
    else:
        cfg["train"]["grad_accum_steps"] = 4
    return cfg


def _trained(cfg: dict) -> dict:
    trainer = TiedGpt(cfg)
    metrics = trainer.fit()
    return {"metrics": metrics, "state": full_state(trainer.placed.held, trainer.optimizer)}


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)) for k in a)


def _against_one(results: list[dict], one: dict) -> None:
    for rank in results:
        # Weights and the momentum buffers, whole: every stage and every shard.
        assert _relative(rank["state"], one["state"]) < 1e-6
        for name in ("train_loss", "val_loss", "val_accuracy"):
            assert rank["metrics"][name] == pytest.approx(one["metrics"][name], rel=1e-6), name


@pytest.mark.multiprocess
def test_fsdp2_inside_two_stages_trains_and_validates_like_a_world_of_one(tmp_path):
    one = run_in_pool(_trained, 1, args=(_gpt(tmp_path / "one", pipeline=1),), timeout=120)[0]
    results = run_in_pool(_trained, 2, args=(_gpt(tmp_path / "pp", pipeline=2),), timeout=180)
    assert set(one["state"]) == set(results[0]["state"])
    _against_one(results, one)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_inside_pp2_x_dp2_trains_and_validates_like_a_world_of_one(tmp_path):
    one = run_in_pool(_trained, 1, args=(_gpt(tmp_path / "one", pipeline=1),), timeout=120)[0]
    results = run_in_pool(_trained, 4, args=(_gpt(tmp_path / "pp", pipeline=2, replicas=2),), timeout=240)
    _against_one(results, one)


class _Collectives(TorchDispatchMode):
    """The c10d collectives run inside it, counted by name, and FSDP2's unit collectives as ``all-gather`` and
    ``reduce-scatter`` (what the all-gathers a step cost are read from): on Gloo ddpkit's replacements
    (ddpkit.parallel.gloo_collectives) run them as broadcasts and an all-reduce, so their calls are counted."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._calls = {"all-gather": BroadcastAllGather, "reduce-scatter": InPlaceReduceScatter}
        self._real = {name: comm.__call__ for name, comm in self._calls.items()}

    def __enter__(self):
        for name, comm in self._calls.items():
            comm.__call__ = self._counting(name, self._real[name])
        return super().__enter__()

    def __exit__(self, *exc):
        for name, comm in self._calls.items():
            comm.__call__ = self._real[name]
        return super().__exit__(*exc)

    def _counting(self, name, call):
        def counted(comm, *args, **kwargs):
            self.counts[name] += 1
            return call(comm, *args, **kwargs)

        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            self.counts[name.split(".")[1].strip("_")] += 1
        return func(*args, **(kwargs or {}))


class CountedGpt(TiedGpt):
    """Each optimizer step's collectives on this rank: the schedule's run, counted."""

    def on_fit_start(self):
        schedule = self.placed.pipeline.schedule
        step = schedule.step
        self.counts: list[Counter[str]] = []

        def counted(*args, **kwargs):
            with _Collectives() as collectives:
                result = step(*args, **kwargs)
            self.counts.append(collectives.counts)
            return result

        schedule.step = counted


def _counted(out: Path) -> dict:
    """Two steps of pp2 x dp2 with fsdp2 inside, 4 microbatches, resharding after forward as configured (null)
    and forced on."""
    counts = {}
    for setting in (None, True):
        cfg = _gpt(out / str(setting), pipeline=2, replicas=2)
        cfg["train"] = {**cfg["train"], "max_steps": 2, "eval_every": None}
        cfg["data"]["global_batch_size"] = 16
        cfg["parallel"].update(microbatches=4, fsdp={"reshard_after_forward": setting})
        trainer = CountedGpt(cfg)
        trainer.fit()
        counts[setting] = trainer.counts
    return counts


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_inside_a_pipeline_gathers_each_unit_once_a_step_not_per_microbatch(tmp_path):
    """Each stage holds 4 units with parameters (fsdp2's default rule): stage 0 its 2 blocks, the embedding and the
    position table; stage 1 its 2 blocks, the final norm, and the stage itself holding the tied head. By default each
    is all-gathered once in a step of 4 microbatches and reduce-scattered once. Resharding after each forward gathers
    a unit for each of the 4 forwards and again for its backward, 5 times, except the stage itself, which FSDP2 never
    reshards, and the two embedding tables, whose backward needs no weight (``set_unshard_in_backward(False)``): 4
    times each, 18 on stage 0, 16 on stage 1. The first step also infers the stages' shapes (a forward and backward
    of its own), so the second is the one counted."""
    for rank, counts in enumerate(run_in_pool(_counted, 4, args=(tmp_path,), timeout=240)):
        kept, resharded = counts[None][1], counts[True][1]
        assert kept["all-gather"] == 4
        assert kept["reduce-scatter"] == resharded["reduce-scatter"] == 4
        # ranks 0 and 1 hold stage 0, ranks 2 and 3 stage 1
        assert resharded["all-gather"] == (18 if rank < 2 else 16)


class Mlp(ddpkit.Trainer):
    """A user's model cut by module names; at the start of fit its whole state (what a resume loaded)."""

    def build_model(self):
        layers = [nn.Linear(144, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)]
        return nn.Sequential(nn.Flatten(), *layers)

    def on_fit_start(self):
        self.loaded = full_state(self.placed.held, self.optimizer)
        self.samples: list[tuple[int, float]] = []


class RecordedMlp(Mlp):
    """Without a pipeline: each step's microbatches, as (step, fingerprint of the targets)."""

    def training_step(self, batch):
        target = batch[1].double()
        self.samples.append((self.progress.step + 1, float((target * torch.arange(1, len(target) + 1)).sum())))
        return super().training_step(batch)


def _mlp(out: Path, *, layout: str, steps: int = 6) -> dict:
    """SGD with momentum on digits, global batch 32, a checkpoint every 3 steps, in ``layout``: ``one`` (4-way
    accumulation), ``pp2x2-<mode>`` (4 ranks, 4 microbatches a replica) or ``fsdp2`` (2 ranks, 4-way accumulation).
    The accumulation is the same everywhere (a resume refuses another: it changes how the losses add up)."""
    cfg = {
        "run": {"name": "mlp", "output_dir": str(out), "seed": 0},
        "data": {"name": "digits", "global_batch_size": 32, "kwargs": {"num_train": 256, "image_size": 12}},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": {"max_steps": steps, "log_every": 3, "grad_accum_steps": 4},
        "checkpoint": {"every_epochs": None, "every_steps": 3},
        "log": {"progress_bar": False},
    }
    if layout.startswith("pp2"):
        cfg["train"]["grad_accum_steps"] = 1
        cfg["parallel"] = {"pipeline": 2, "microbatches": 4, "split_points": ["3"], "mode": layout.split("-")[1]}
    elif layout == "fsdp2":
        cfg["parallel"] = {"mode": "fsdp2"}
    return cfg


def _fit_mlp(cfg: dict, recorded: bool = False) -> dict:
    trainer = (RecordedMlp if recorded else Mlp)(cfg)
    metrics = trainer.fit()
    state = full_state(trainer.placed.held, trainer.optimizer)
    return {"metrics": metrics, "state": state, "loaded": trainer.loaded, "samples": trainer.samples}


def _write_on_pp2_x_dp2(tmp: Path) -> dict:
    """Three steps under pp2 x dp2, fsdp2 and ddp inside, each leaving its step-3 checkpoint."""
    return {mode: _fit_mlp(_mlp(tmp / mode, layout=f"pp2x2-{mode}", steps=3)) for mode in ("fsdp2", "ddp")}


def _fsdp2_on_two(tmp: Path) -> dict:
    """The ddp pipeline's checkpoint resumed by fsdp2 on 2 ranks, beside a straight fsdp2 run of 6 steps."""
    resumed = _fit_mlp(_mlp(tmp / "ddp", layout="fsdp2"), recorded=True)
    straight = _fit_mlp(_mlp(tmp / "straight-fsdp2", layout="fsdp2"), recorded=True)
    return {"resumed": resumed, "straight": straight}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_x_dp2_checkpoints_resume_in_a_world_of_one_and_under_fsdp2_on_two_ranks(tmp_path):
    written = run_in_pool(_write_on_pp2_x_dp2, 4, args=(tmp_path,), timeout=240)
    straight = run_in_pool(_fit_mlp, 1, args=(_mlp(tmp_path / "straight", layout="one"),), timeout=120)[0]
    # fsdp2 inside the pipeline -> a world of one: it loads the step-3 state exactly, then trains steps 4..6.
    one = run_in_pool(_fit_mlp, 1, args=(_mlp(tmp_path / "fsdp2", layout="one"),), timeout=120)[0]
    assert one["metrics"]["step"] == 6
    assert all(torch.equal(one["loaded"][k], v) for k, v in written[0]["fsdp2"]["state"].items())
    # Within 1e-6, not bitwise: the pipeline's replicas averaged their gradients (another order of addition).
    assert _relative(one["state"], straight["state"]) < 1e-6
    # pp2 x dp2 (ddp) -> fsdp2 on 2 ranks: the same optimizer state, then the same samples as a straight fsdp2 run.
    two = run_in_pool(_fsdp2_on_two, 2, args=(tmp_path,), timeout=180)
    for rank in two:
        resumed = rank["resumed"]
        assert resumed["loaded"].keys() == written[0]["ddp"]["state"].keys()
        assert all(torch.equal(resumed["loaded"][k], v) for k, v in written[0]["ddp"]["state"].items())
        assert resumed["samples"] == [s for s in rank["straight"]["samples"] if s[0] > 3]
        assert resumed["samples"][0][0] == 4
        assert _relative(resumed["state"], rank["straight"]["state"]) < 1e-6
