"""``parallel.tensor`` in the Trainer on real Gloo ranks: tp2 against a world of one (losses, weights, model.pt),
composed with fsdp2 (dp2 x tp2) and with a pipeline (pp2 x tp2), checkpoints across layouts, and the layouts
that cannot work, refused before any process group.

    .venv/bin/pytest -q tests/test_tensor_training.py

The model is a tiny Llama (grouped-query attention, untied head, 50 ids: under tp2 the vocabulary is sharded unless
a test sets ``vocab_parallel: false``) on ragged token sequences, AdamW with clipping:
tensor parallelism splits each block's sums in two, so the runs agree to rounding, not bitwise. The measure is
each weight tensor's relative error ``|a - b| / |b|`` (L2 norms) and the loss's: within 1e-5 in float32 over 50
steps. Elementwise the largest difference is larger (4.6e-5 of the tensor's largest weight at 50 steps, in a
SwiGLU's down projection): AdamW divides each update by the root of its own squared gradients, so a unit whose
gradient is tiny moves by as much as any other and its rounding with it. The same runs in float64 agree to 1e-11,
elementwise: what differs is rounding and nothing else. (Measured: 4.9e-12 at 50 steps, in block 0's MLP, from one
step whose weight gradients there differ by 3.5e-11 of their largest while the weights differed by 1e-15; the same
bits with torch's RowwiseParallel embedding in place of ddpkit's. 6e-16 while the embedding's gradient was still
held whole on each tensor rank, before the run kept its gradient hooks.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    assert_bitwise_equal,
    assert_same_samples_after_restart,
    launch_with_a_restart,
    load_weights,
    run_in_pool,
)
from torch import nn
from trainer_layouts import (
    BOUND,
    LLAMA,
    RaggedTrainer,
    assert_close_to,
    fit,
    fit_alone,
    fit_first_half,
    fit_validated,
    layout_config,
    relative_error,
)

import ddpkit
from ddpkit.config.layout import check_layout
from ddpkit.config.loader import load_config
from ddpkit.errors import ConfigError
from ddpkit.tools.estimate import estimate

pytestmark = pytest.mark.timeout(300)

SCRIPT = "tests/scripts/tensor_trainer.py"


class Float64Trainer(RaggedTrainer):
    def build_model(self):
        return super().build_model().double()


def _elementwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of one weight, relative to its tensor's largest weight."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)) for k in a)


def _fit_float64(cfg: dict) -> dict:
    return fit(cfg, Float64Trainer)


class PlacementWatch(RaggedTrainer):
    """Records, as each gradient is accumulated, whether it is placed as its parameter (a post-accumulate hook,
    which runs after the tensor plan's own hooks)."""

    def on_fit_start(self) -> None:
        self.placed_as_parameter: dict[str, list[bool]] = {}
        for name, param in self.placed.held.named_parameters():
            seen = self.placed_as_parameter.setdefault(name, [])
            param.register_post_accumulate_grad_hook(
                lambda p, seen=seen: seen.append(p.grad.placements == p.placements)
            )


def _gradient_placements(cfg: dict) -> dict[str, list[bool]]:
    trainer = PlacementWatch(cfg)
    trainer.fit()
    return trainer.placed_as_parameter


def _batch_report(cfg: dict) -> dict:
    """What the reporter says of the global batch after one step, and what the training loader gave this rank."""
    trainer = RaggedTrainer(cfg)
    trainer.fit()
    first = next(iter(trainer.train_loader))
    reporter = trainer.reporter
    return {
        "samples_per_step": reporter.samples_per_step,
        "line": reporter._batch_line(),
        "loader_batch": len(first[0]) if isinstance(first, (list, tuple)) else len(next(iter(first.values()))),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("ranks", "parallel", "line"),
    [
        (2, {"tensor": 2}, "x 1 data-parallel replica(s) x 2 accumulation = global batch 8 (tensor parallel over 2"),
        (2, {"pipeline": 2}, "x 2 microbatches x 1 data-parallel replica(s) = global batch 8 (pipeline of 2 stages)"),
        (
            4,
            {"pipeline": 2, "tensor": 2},
            "x 1 data-parallel replica(s) = global batch 8 (pipeline of 2 stages, tensor",
        ),
        (4, {"tensor": 2, "mode": "fsdp2"}, "x 2 data-parallel replica(s) x 2 accumulation = global batch 8 (tensor"),
    ],
)
def test_the_reported_global_batch_counts_data_parallel_replicas_only(tmp_path, ranks, parallel, line):
    """Issue 66: the ranks of a tensor-parallel group, or of a pipeline, read the same batches. The start-up line,
    samples/s and tokens/s count the data-parallel replicas, not the ranks: a global batch of 8 is 8 here."""
    results = run_in_pool(_batch_report, ranks, args=(layout_config(tmp_path, steps=1, **parallel),), timeout=120)
    dp = ranks // (parallel.get("pipeline", 1) * parallel.get("tensor", 1))
    for report in results:
        assert report["samples_per_step"] == 8, report
        assert line in report["line"], report
        # each replica's (micro-)batch, as its loader yields it: 8 / (replicas x 2 micro-batches)
        assert f"batch {8 // (dp * 2)} x" in report["line"] and report["loader_batch"] == 8 // (dp * 2), report


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp2_over_50_adamw_steps_stays_within_1e_5_of_a_world_of_one_and_within_1e_11_in_float64(tmp_path):
    reference = fit_alone(tmp_path / "one", steps=50)
    results = run_in_pool(fit, 2, args=(layout_config(tmp_path / "tp", steps=50, tensor=2),), timeout=280)
    assert_close_to(results, reference)
    one = run_in_pool(_fit_float64, 1, args=(layout_config(tmp_path / "one64", steps=50),), timeout=120)[0]
    tp = run_in_pool(_fit_float64, 2, args=(layout_config(tmp_path / "tp64", steps=50, tensor=2),), timeout=280)
    assert _elementwise(tp[0]["weights"], one["weights"]) < 1e-11


@pytest.mark.multiprocess
@pytest.mark.parametrize("ranks, parallel", [(2, {"tensor": 2}), (4, {"tensor": 2, "pipeline": 2})])
def test_every_gradient_of_a_tp2_run_is_held_as_its_parameter_is_placed(tmp_path, ranks, parallel):
    """The tensor plan's gradient hooks survive the run's set-up (the meta build makes new parameters, and a
    ``.to()`` swaps DTensors in anew): Qwen3's per-head norms' gradients, ``Partial`` sums of each rank's heads, are
    reduced once as they are accumulated, the vocabulary-sharded embedding's arrive in shards. Under tp2 and under
    pp2 x tp2 (each stage its own parameters)."""
    cfg = layout_config(tmp_path, steps=2, **parallel)
    cfg["model"]["kwargs"] = {**cfg["model"]["kwargs"], "qk_norm": True, "tied": True}
    for placed in run_in_pool(_gradient_placements, ranks, args=(cfg,), timeout=120):
        # 2 steps x 2 micro-batches, every parameter this rank holds
        assert {name: len(seen) for name, seen in placed.items()} == {name: 4 for name in placed}, placed
        assert all(all(seen) for seen in placed.values()), placed
        assert any(name.endswith("attn.q_norm.weight") for name in placed), placed


@pytest.mark.multiprocess
@pytest.mark.parametrize("vocab_parallel", [None, False], ids=["sharded_by_default", "replicated_on_request"])
def test_tp2_with_the_vocabulary_sharded_or_replicated_trains_and_validates_like_a_world_of_one(
    tmp_path, vocab_parallel
):
    cfg = layout_config(tmp_path / "one")
    cfg["train"]["eval_every"] = 4
    reference = run_in_pool(fit_validated, 1, args=(cfg,), timeout=120)[0]
    # the default (null): sharded, the 50 ids dividing by 2
    tp = layout_config(tmp_path / "vocab", tensor=2, vocab_parallel=vocab_parallel)
    tp["train"]["eval_every"] = 4
    results = run_in_pool(fit_validated, 2, args=(tp,), timeout=200)
    assert [r["vocab_parallel"] for r in results] == [vocab_parallel is None] * 2
    assert_close_to(results, reference)
    for result in results:
        # each tensor rank ran the whole batch: its copies of the float64 sums and counts leave the means as they are
        assert result["metrics"]["val_loss"] == pytest.approx(reference["metrics"]["val_loss"], rel=BOUND)
        assert result["metrics"]["val_accuracy"] == reference["metrics"]["val_accuracy"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp2_trains_within_1e_5_of_a_world_of_one_and_writes_the_whole_model(tmp_path):
    reference = fit_alone(tmp_path / "one")
    results = run_in_pool(fit, 2, args=(layout_config(tmp_path / "tp", tensor=2),), timeout=200)
    recomputed = layout_config(tmp_path / "ac", tensor=2)
    recomputed["train"]["activation_checkpointing"] = True
    # activation checkpointing wraps the blocks after the plan: the same bits
    assert_bitwise_equal(run_in_pool(fit, 2, args=(recomputed,), timeout=200)[0]["weights"], results[0]["weights"])
    assert [r["layout"]["tp_rank"] for r in results] == [0, 1]
    assert all(r["layout"]["dp"] == 1 for r in results)
    assert_close_to(results, reference)
    # model.pt: the whole model under its own names, as a world of one writes it
    tp_model = load_weights(tmp_path / "tp/model.pt")
    assert relative_error(tp_model, load_weights(tmp_path / "one/model.pt")) < BOUND
    assert_bitwise_equal(tp_model, results[0]["weights"])
    # `ddpkit estimate` predicts what each tensor rank holds, from the model on the meta device
    predicted = estimate(layout_config(tmp_path / "estimate", tensor=2), nproc=2).per_mode["ddp"]
    assert predicted.parameters == results[0]["bytes"].parameters < reference["bytes"].parameters
    assert predicted.optimizer == results[0]["bytes"].optimizer
    # the checkpoints are DCP directories each tensor rank wrote its shards of
    assert (tmp_path / "tp/checkpoints/step-000000008.dcp").is_dir()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_over_dp2_x_tp2_and_pp2_x_tp2_train_within_1e_5_of_a_world_of_one(tmp_path):
    reference = fit_alone(tmp_path / "one")
    fsdp = run_in_pool(fit, 4, args=(layout_config(tmp_path / "fsdp", tensor=2, mode="fsdp2"),), timeout=280)
    assert [(r["layout"]["dp_rank"], r["layout"]["tp_rank"]) for r in fsdp] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_close_to(fsdp[:1], reference)
    pipelined = run_in_pool(fit, 4, args=(layout_config(tmp_path / "pp", tensor=2, pipeline=2),), timeout=280)
    # ranks 0, 1: stage 0 (tensor ranks 0, 1); ranks 2, 3: stage 1
    assert [(r["layout"]["pp_rank"], r["layout"]["tp_rank"]) for r in pipelined] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert_close_to([pipelined[0], pipelined[2]], reference)
    assert relative_error(load_weights(tmp_path / "pp/model.pt"), reference["weights"]) < BOUND


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_compiled_tp2_trains_like_the_eager_one(tmp_path):
    eager = run_in_pool(fit, 2, args=(layout_config(tmp_path / "eager", tensor=2),), timeout=200)
    compiled = layout_config(tmp_path / "compiled", tensor=2)
    compiled["train"]["compile"] = True
    # Inductor fuses the blocks' elementwise ops (another rounding), so within the bound, not bitwise.
    results = run_in_pool(fit, 2, args=(compiled,), timeout=280)
    assert_close_to(results, eager[0])


class MlpWithAPlan(ddpkit.Trainer):
    """A user's model with its own plan: the hidden layer's pair of Linears split Megatron's way."""

    def build_model(self):
        return nn.Sequential(nn.Flatten(), nn.Linear(144, 64), nn.ReLU(), nn.Linear(64, 10))

    def tensor_plan(self, model):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"1": ColwiseParallel(), "3": RowwiseParallel()}


def _fit_mlp(tensor: int, out: str) -> dict:
    cfg = {
        "run": {"name": "mlp", "output_dir": out, "seed": 0},
        "data": {"name": "digits", "global_batch_size": 32, "kwargs": {"num_train": 256, "image_size": 12}},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": {"max_steps": 6, "log_every": 3},
        "parallel": {"tensor": tensor},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }
    return fit(cfg, MlpWithAPlan)


@pytest.mark.multiprocess
def test_a_user_model_splits_by_its_own_tensor_plan(tmp_path):
    one = run_in_pool(_fit_mlp, 1, args=(1, str(tmp_path / "one")), timeout=120)[0]
    split = run_in_pool(_fit_mlp, 2, args=(2, str(tmp_path / "tp")), timeout=120)
    # the hidden layer's rows on two ranks: the output layer's sum is split in two, rounding only
    assert relative_error(split[0]["weights"], one["weights"]) < BOUND
    assert split[0]["metrics"]["train_loss"] == pytest.approx(one["metrics"]["train_loss"], rel=BOUND)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dp2_x_pp2_x_tp2_on_8_ranks_trains_within_1e_5_of_a_world_of_one(tmp_path):
    reference = fit_alone(tmp_path / "one")
    cfg = layout_config(tmp_path / "3d", tensor=2, pipeline=2, mode="fsdp2")
    results = run_in_pool(fit, 8, args=(cfg,), timeout=280)
    # the mesh's order (pp, dp, tp): rank 5 is stage 1 of replica 0, tensor rank 1
    assert results[5]["layout"] == {"pp_rank": 1, "dp_rank": 0, "tp_rank": 1, "dp": 2}
    assert_close_to([results[0], results[4]], reference)
    assert relative_error(load_weights(tmp_path / "3d/model.pt"), reference["weights"]) < BOUND


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_tp2_checkpoint_resumes_in_a_world_of_one_and_a_ddp_one_as_tp2(tmp_path):
    reference = fit_alone(tmp_path / "one")
    # tp2 for 4 steps, then a world of one from its DCP checkpoint (the same samples from step 5 on)
    run_in_pool(fit_first_half, 2, args=(layout_config(tmp_path / "a", tensor=2),), timeout=200)
    resumed = run_in_pool(fit, 1, args=(layout_config(tmp_path / "a"),), timeout=120)[0]
    assert resumed["metrics"]["step"] == 8
    assert relative_error(resumed["weights"], reference["weights"]) < BOUND
    # a world of one's single-file checkpoint, then tp2: each tensor rank takes its shards of it
    run_in_pool(fit_first_half, 1, args=(layout_config(tmp_path / "b"),), timeout=120)
    as_tp = run_in_pool(fit, 2, args=(layout_config(tmp_path / "b", tensor=2),), timeout=200)
    assert as_tp[0]["metrics"]["step"] == 8
    assert_close_to(as_tp, reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_pp2_x_tp2_checkpoint_resumes_under_ddp_on_2_ranks(tmp_path):
    reference = fit_alone(tmp_path / "one")
    run_in_pool(fit_first_half, 4, args=(layout_config(tmp_path / "run", tensor=2, pipeline=2),), timeout=280)
    resumed = run_in_pool(fit, 2, args=(layout_config(tmp_path / "run"),), timeout=200)
    assert resumed[0]["metrics"]["step"] == 8
    assert_bitwise_equal(resumed[0]["weights"], resumed[1]["weights"])
    assert relative_error(resumed[0]["weights"], reference["weights"]) < BOUND


def test_tensor_layouts_that_cannot_work_are_refused_before_any_group_naming_the_fix(monkeypatch):
    two = load_config({"parallel": {"tensor": 2}})
    with pytest.raises(ConfigError, match=r"parallel.tensor: 2 does not divide the world size 3; valid on 3 ranks"):
        check_layout(two.parallel, world_size=3)
    with pytest.raises(ConfigError, match=r"use parallel.mode=fsdp2 \(it shards over the 2 replicas\)"):
        check_layout(two.parallel, world_size=4)
    check_layout(load_config({"parallel": {"tensor": 2, "mode": "fsdp2"}}).parallel, world_size=4)
    with pytest.raises(ConfigError, match="zero1 does not shard tensor-parallel"):
        load_config({"parallel": {"tensor": 2, "mode": "zero1"}})
    with pytest.raises(ConfigError, match="train.sample: generation's KV cache holds the whole model's"):
        load_config({"parallel": {"tensor": 2}, "train": {"sample": {"every_steps": 10}}})
    with pytest.raises(ConfigError, match="only with parallel.tensor > 1"):
        load_config({"parallel": {"vocab_parallel": True}})
    # The model's widths: in the Trainer's constructor (rank 0 of 2 as torchrun starts it; no process group yet)
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**torchrun, "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    model = {"name": "gpt", "kwargs": {**LLAMA, "dim": 48, "heads": 6, "kv_heads": 3}}
    with pytest.raises(ConfigError, match=r"parallel.tensor: 2: model.kwargs.kv_heads 3 is not divisible by 2 \(valid"):
        RaggedTrainer({"model": model, "parallel": {"tensor": 2}})
    dropout = {"name": "gpt", "kwargs": {**LLAMA, "dropout": 0.1}}
    with pytest.raises(ConfigError, match="model.kwargs.dropout 0.1 cannot run tensor-parallel"):
        RaggedTrainer({"model": dropout, "parallel": {"tensor": 2}})
    assert not torch.distributed.is_initialized()


def _launch(out: Path, env: dict[str, str]) -> str:
    cfg = layout_config(out / "run", steps=10, tensor=2)
    # The script imports the tests' RaggedSequences (tests/helpers.py).
    return launch_with_a_restart(out, cfg, script=SCRIPT, nproc=2, env={"PYTHONPATH": "tests", **env}, timeout=280)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp2_killed_resumes_bitwise_with_the_same_samples(tmp_path):
    """`ddpkit run`'s own restart (`--max-restarts 1`) after rank 1 SIGKILLs itself, under tensor parallelism."""
    _launch(tmp_path / "clean", {})
    stderr = _launch(tmp_path / "killed", {"KILL_RANK": "1", "KILL_AT_STEP": "5"})
    assert "crash save and memory snapshots are off under tensor parallelism" in stderr
    for rank in (0, 1):
        # resumed from the step-4 checkpoint (checkpoint.every_steps: 4)
        assert_same_samples_after_restart(tmp_path / "killed/run", tmp_path / "clean/run", rank, resumed_at=5)
    assert_bitwise_equal(load_weights(tmp_path / "killed/run/model.pt"), load_weights(tmp_path / "clean/run/model.pt"))
