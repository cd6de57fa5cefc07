"""Resume across layouts with the same global batch (issue 68): pp x dp x tp, mode, schedule, microbatches.

A checkpoint keeps the epoch's position in global samples (``ddpkit.data.position``), so a run that splits the same
16 samples a step another way (2 pipeline stages x 4 microbatches of 4, DDP on 2 ranks of 8, one rank of 16) trains
on the same samples from the resume step on. Each end-to-end test runs one layout uninterrupted for 6 steps (it
checkpoints at step 3), resumes that step-3 checkpoint in another layout, and holds the resumed steps 4..6 (losses
and final weights) against the uninterrupted ones: bitwise where the arithmetic is the same (interleaved -> 1f1b),
1e-6 relative where the same sums are added in another order (``loss_normalization: tokens``), 1e-5 under tensor
parallelism. Measured: 0 to 3e-7 on the weights, 0 to 1.1e-7 on the losses.

    .venv/bin/pytest -q tests/test_resume_layouts.py
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import RaggedSequences, assert_bitwise_equal, run_in_pool

import ddpkit
from ddpkit.checkpoint.components import Components
from ddpkit.checkpoint.resume import check_compatible, note_allowed_position, with_sample_position
from ddpkit.config.loader import load_config
from ddpkit.config.serialize import config_to_dict
from ddpkit.config.split import Split
from ddpkit.data.position import SamplePosition
from ddpkit.errors import CheckpointError

pytestmark = pytest.mark.timeout(300)


class Recording(ddpkit.Trainer):
    """A tiny tied GPT on ragged token sequences (targets -100 past each length), recording each step's loss."""

    def build_datasets(self):
        return RaggedSequences(n=128), None

    def on_fit_start(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, metrics: dict[str, float]) -> None:
        self.losses[int(metrics["step"])] = metrics["train_loss"]


def _config(out: Path, *, parallel: dict | None = None, resume: str = "auto", **train: Any) -> dict:
    """Global batch 16 (8 steps an epoch), a checkpoint at step 3, 6 steps; the layout from ``parallel``."""
    return {
        "run": {"name": "layouts", "output_dir": str(out), "seed": 3},
        "data": {"global_batch_size": 16, "order": "index_free"},
        "model": {"name": "gpt", "kwargs": {"vocab_size": 50, "dim": 32, "depth": 4, "heads": 2, "max_len": 16}},
        "optim": {"name": "sgd", "lr": 0.5, "momentum": 0.9},
        "train": {"max_steps": 6, "log_every": 1, "loss_normalization": "tokens", **train},
        "parallel": parallel or {},
        "checkpoint": {"every_epochs": None, "every_steps": 3, "resume": resume},
        "log": {"progress_bar": False},
    }


def _fit(cfg: dict) -> dict:
    """Fit on every rank; each rank's losses and its parameters, whole (a DTensor's full tensor, a collective)."""
    trainer = Recording(cfg)
    trainer.fit()
    weights = {}
    for name, value in trainer.placed.held.state_dict().items():
        weights[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
    return {"losses": trainer.losses, "weights": weights, "batch_in_epoch": trainer.progress.batch_in_epoch}


def _with(cfg: dict, sections: dict) -> dict:
    return {**cfg, **{name: {**cfg[name], **keys} for name, keys in sections.items()}}


def _merged(results: list[dict]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        merged.update(result["weights"])
    return merged


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)) for k in a)


def _resume_elsewhere(
    tmp: Path,
    before: tuple[int, dict],
    after: tuple[int, dict],
    *,
    limit: float,
    per_rank: tuple[dict, dict] = ({}, {}),
) -> None:
    """``before``'s layout uninterrupted (6 steps, a checkpoint at step 3) against its step 3 resumed in ``after``'s:
    the same losses at steps 4..6 and the same final weights, within ``limit`` (relative; 0: bitwise).
    ``per_rank``: sections that replace ``data`` and ``train`` keys before and after (per-rank batches)."""
    ranks, parallel = before
    straight_cfg = _with(_config(tmp / "straight", parallel=parallel), per_rank[0])
    straight = run_in_pool(_fit, ranks, args=(straight_cfg,), timeout=180)
    step3 = str(next((tmp / "straight/checkpoints").glob("step-*3*")))
    ranks_after, parallel_after = after
    resumed_cfg = _with(_config(tmp / "resumed", parallel=parallel_after, resume=step3), per_rank[1])
    resumed = run_in_pool(_fit, ranks_after, args=(resumed_cfg,), timeout=180)
    expected = straight[0]["losses"]
    assert sorted(resumed[0]["losses"]) == [4, 5, 6]
    if limit == 0:
        # the same arithmetic: bitwise
        assert resumed[0]["losses"] == {step: expected[step] for step in (4, 5, 6)}
        assert_bitwise_equal(_merged(resumed), _merged(straight))
        return
    for step, loss in resumed[0]["losses"].items():
        assert loss == pytest.approx(expected[step], rel=limit), step
    assert _relative(_merged(resumed), _merged(straight)) < limit


@pytest.mark.multiprocess
def test_a_pipeline_checkpoint_resumes_as_ddp_on_two_ranks_with_the_same_samples(tmp_path):
    """The issue's case: 2 stages x 4 microbatches of 4 (the position: 12 loader batches) as 2 DDP ranks x 1 batch
    of 8 (3 batches). Kept in batches, the resume landed at DDP's step 12, past this epoch's end."""
    pp2 = (2, {"pipeline": 2, "microbatches": 4})
    _resume_elsewhere(tmp_path, pp2, (2, {}), limit=1e-6)


@pytest.mark.multiprocess
def test_a_tied_head_resumes_from_two_stages_in_a_world_of_one(tmp_path):
    """The tied embedding lives on the first and the last stage; a world of one takes one batch of 16 a step."""
    pp2 = (2, {"pipeline": 2, "microbatches": 4})
    _resume_elsewhere(tmp_path, pp2, (1, {}), limit=1e-6)


@pytest.mark.multiprocess
def test_an_interleaved_pipeline_resumes_as_1f1b(tmp_path):
    interleaved = (2, {"pipeline": 2, "microbatches": 4, "schedule": "interleaved_1f1b", "stages_per_rank": 2})
    # The same stages' sums in the same order (measured bitwise): another schedule only reorders the work.
    _resume_elsewhere(tmp_path, interleaved, (2, {"pipeline": 2, "microbatches": 4, "schedule": "1f1b"}), limit=0)


@pytest.mark.multiprocess
def test_tensor_parallel_resumes_as_fsdp2_on_two_ranks(tmp_path):
    _resume_elsewhere(tmp_path, (2, {"tensor": 2}), (2, {"mode": "fsdp2"}), limit=1e-5)


@pytest.mark.multiprocess
def test_per_rank_batches_resume_in_another_split_of_as_many_samples_a_step(tmp_path):
    """Without data.global_batch_size: one rank's batch of 16 as 4 accumulated batches of 4 (the same replicas)."""
    whole = {"data": {"global_batch_size": None, "batch_size": 16}}
    quarters = {"data": {"global_batch_size": None, "batch_size": 4}, "train": {"grad_accum_steps": 4}}
    _resume_elsewhere(tmp_path, (1, {}), (1, {}), limit=1e-6, per_rank=(whole, quarters))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_x_tp2_resumes_as_four_stages(tmp_path):
    before = (4, {"pipeline": 2, "tensor": 2, "microbatches": 4})
    _resume_elsewhere(tmp_path, before, (4, {"pipeline": 4, "microbatches": 4}), limit=1e-5)


# --- the check and the position, without processes ---------------------------------------------------------------


def _state(cfg: dict, *, world_size: int, progress: dict) -> dict:
    return {"config": config_to_dict(load_config(cfg)), "world_size": world_size, "progress": progress}


def _check(state: dict, cfg: dict, *, world_size: int) -> list[str]:
    return check_compatible(state, "ckpt", load_config(cfg), world_size=world_size, components=Components())


def test_the_split_of_the_same_global_batch_may_change_at_resume(tmp_path, caplog):
    pp2 = _config(tmp_path, parallel={"pipeline": 2, "microbatches": 4})
    assert Split.of_config(load_config(pp2), world_size=2) == Split(16, batches_per_step=4, replicas=1)
    saved = _state(pp2, world_size=2, progress={"step": 3, "epoch": 0, "batch_in_epoch": 12})
    ddp = _config(tmp_path)
    one_accumulating = _config(tmp_path, grad_accum_steps=4)
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        assert _check(saved, ddp, world_size=2) == []
        assert _check(saved, one_accumulating, world_size=1) == []
        # 2 replicas x 2 microbatches of 4 as 1 x 4 of 4: the same pieces, summed in another order
        pp2_x_dp2 = _config(tmp_path, parallel={"pipeline": 2, "microbatches": 2})
        assert _check(_state(pp2_x_dp2, world_size=4, progress={}), one_accumulating, world_size=1) == []
    notes = [r.getMessage() for r in caplog.records if "resuming with another" in r.getMessage()]
    # The pipeline's 1 x 4 microbatches of 4 as one rank's 4-way accumulation: the same split, nothing to say.
    assert len(notes) == 2
    assert "1 replica(s) x 4 batch(es) of 4 -> 2 replica(s) x 1 batch(es) of 8" in notes[0]
    assert "loss_normalization: tokens sums alike" in notes[0]
    assert "the same samples and the same microbatches" in notes[1]
    caplog.clear()
    by_mean = _config(tmp_path, loss_normalization="mean")
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        _check(_state(by_mean | {"parallel": pp2["parallel"]}, world_size=2, progress={}), by_mean, world_size=2)
    assert "each of the 2 microbatches' means now counts equally (4 before)" in caplog.text


def test_a_real_change_is_still_refused_naming_the_keys(tmp_path):
    saved = _state(_config(tmp_path), world_size=2, progress={})
    bigger = _config(tmp_path)
    bigger["data"]["global_batch_size"] = 32
    bigger["model"]["kwargs"]["dim"] = 64
    with pytest.raises(CheckpointError) as refused:
        _check(saved, bigger, world_size=2)
    assert "data.global_batch_size: 16 -> 32" in str(refused.value)
    assert "model.kwargs.dim: 32 -> 64" in str(refused.value)
    # Per-rank batches: the samples per step are compared, and the replicas, whose number the order depends on.
    per_rank = _config(tmp_path)
    per_rank["data"] = {"batch_size": 4, "order": "index_free"}
    saved = _state(per_rank, world_size=2, progress={})
    accumulating = per_rank | {"train": {**per_rank["train"], "grad_accum_steps": 2}}
    one_rank_of_8 = per_rank | {"data": {"batch_size": 8, "order": "index_free"}}
    with pytest.raises(CheckpointError, match=r"world size: 2 -> 1 \(data-parallel replicas: 2 -> 1\)"):
        _check(saved, one_rank_of_8, world_size=1)
    with pytest.raises(CheckpointError, match=r"samples per optimizer step: 8 -> 16"):
        _check(saved, accumulating, world_size=2)
    halves = accumulating | {"data": {"batch_size": 2, "order": "index_free"}}
    assert _check(saved, halves, world_size=2) == []
    # A stream keeps its position in its own loader's batches: another split of the same global batch is refused.
    streamed = Components()
    streamed.register("data_position", ddpkit.Progress())
    with pytest.raises(CheckpointError, match=r"a stream resumes only in the split it was checkpointed in"):
        check_compatible(saved, "ckpt", load_config(halves), world_size=2, components=streamed)
    with pytest.raises(CheckpointError, match=r"data-parallel replicas: 1 -> 2: the sample order depends on them"):
        _check(_state(per_rank | {"parallel": {"pipeline": 2}}, world_size=2, progress={}), per_rank, world_size=2)


def test_the_position_is_kept_in_samples_and_old_checkpoints_convert_with_their_own_split(tmp_path, caplog):
    pp2 = _config(tmp_path, parallel={"pipeline": 2, "microbatches": 4})
    pipeline = SamplePosition(ddpkit.Progress(3, 0, 12), Split.of_config(load_config(pp2), world_size=2))
    assert pipeline.state_dict() == {"step": 3, "epoch": 0, "batch_in_epoch": 12, "sample_in_epoch": 48}
    ddp = SamplePosition(ddpkit.Progress(), Split.of_config(load_config(_config(tmp_path)), world_size=2))
    ddp.load_state_dict(pipeline.state_dict())
    # 2 ranks x 1 batch of 8 a step: 3 batches, step 3 of DDP (12 batches was step 12)
    assert (ddp.progress.step, ddp.progress.batch_in_epoch) == (3, 3)
    # A checkpoint from before the sample position: its 12 batches are converted with its own 4 x 4.
    old = _state(pp2, world_size=2, progress={"step": 3, "epoch": 0, "batch_in_epoch": 12})
    assert with_sample_position(old)["progress"]["sample_in_epoch"] == 48
    # Another global batch (only with checkpoint.allow_config_change): back to the step boundary before, said so.
    by_32 = SamplePosition(ddpkit.Progress(), Split(32, batches_per_step=2, replicas=2))
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        by_32.load_state_dict({"step": 3, "epoch": 0, "batch_in_epoch": 12, "sample_in_epoch": 48})
        note_allowed_position(["data.global_batch_size: 16 -> 32"], by_32.progress, by_32.split)
    assert by_32.progress.batch_in_epoch == 2
    assert "goes on from sample 32, so samples 32..47 train again" in caplog.text
    assert "from step 4 the run goes on with samples 32.. of epoch 0's order, 32 a step" in caplog.text
