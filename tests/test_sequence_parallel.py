"""Sequence parallelism (``parallel.sequence_parallel``: ddpkit.models.tensor_plans.llama_plan) on real Gloo ranks:
T = 2 against a world of one (losses, clipping norms, weights), the collectives a step costs against the plain
tensor plan's, and the lengths and models that cannot split their sequence.

    .venv/bin/pytest -q tests/test_sequence_parallel.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import RaggedSequences, run_in_pool
from tensor_harness import (
    GQA,
    VOCAB,
    assert_like_a_world_of_one,
    fixed_batch,
    relative_l2,
    tiny_model,
    train_counted,
    whole,
)
from torch import nn

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.models.gpt import GPT
from ddpkit.models.llama import LlamaShape
from ddpkit.parallel.tensor_plan import apply_tensor_parallel, check_tensor_plan, tensor_plan

pytestmark = pytest.mark.timeout(200)

CLIP = 0.5


def _against_one(kind: str, steps: int, dtype: torch.dtype, *, vocab_parallel: bool) -> dict:
    """T = world size with the sequence split, against the same model alone and against the plain tensor plan."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_model(kind, dtype)
    plan = tensor_plan(model, vocab_parallel=vocab_parallel, sequence_parallel=True)
    sp = train_counted(apply_tensor_parallel(model, mesh, plan), steps, clip=CLIP, vocab_parallel=vocab_parallel)
    plain = tiny_model(kind, dtype)
    plain = apply_tensor_parallel(plain, mesh, tensor_plan(plain, vocab_parallel=vocab_parallel))
    tp = train_counted(plain, steps, clip=CLIP, vocab_parallel=vocab_parallel)
    one = train_counted(tiny_model(kind, dtype), steps, clip=CLIP, vocab_parallel=vocab_parallel)
    return {
        "losses": relative_l2(sp["losses"], one["losses"]),
        "norms": relative_l2(sp["norms"], one["norms"]),
        "weights": relative_l2(sp["weights"], one["weights"]),
        # for scale: the plain plan's distance (the same products; the norms' weight gradients are summed in
        # another order, each rank's positions first)
        "plain_weights": relative_l2(tp["weights"], one["weights"]),
        "first_norm": one["norms"][0],
        "counts": sp["counts"],
        "plain_counts": tp["counts"],
        "tied": model.head.weight is model.embed.weight,
    }


def _uneven() -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_model("gqa", torch.float32)
    model = apply_tensor_parallel(model, mesh, tensor_plan(model, sequence_parallel=True))
    try:
        model(fixed_batch(0)[:, :15])
    except ValueError as error:
        return str(error)
    return "no error"


def _gqa_and_uneven() -> dict:
    return {"gqa": _against_one("gqa", 2, torch.float32, vocab_parallel=False), "uneven": _uneven()}


def _qwen() -> dict:
    """Several comparisons in one spawn (each spawn costs seconds)."""
    return {
        "qwen_vocab": _against_one("qwen", 3, torch.float32, vocab_parallel=True),
        "qwen_float64": _against_one("qwen", 3, torch.float64, vocab_parallel=False),
    }


@pytest.mark.multiprocess
def test_sequence_parallel_tp2_matches_a_world_of_one_and_trades_all_reduces_for_gathers_and_scatters():
    results = run_in_pool(_gqa_and_uneven, world_size=2, timeout=180)
    assert results[0] == results[1]
    run = results[0]["gqa"]
    assert_like_a_world_of_one("gqa", run, clip=CLIP)
    # the plain plan (vocabulary replicated): 4 all-reduces a block, one for the clipping norm
    assert run["plain_counts"] == {"c10d_functional.all_reduce": 4 * 2 + 1}
    # the sequence split: each block's attention and MLP all-gather their input and reduce-scatter their output
    # forward, and the same backward (4 + 4 a block, where the plain plan all-reduces 4 times); the head all-gathers
    # the sequence forward, the embedding's slice gathers its gradient backward. The norms now see each rank's
    # positions only: their weight gradients are all-reduced (2 a block and the final norm's, dim-wide each)
    assert run["counts"] == {
        "c10d_functional.all_gather_into_tensor": 4 * 2 + 2,
        "c10d_functional.reduce_scatter_tensor": 4 * 2,
        "c10d_functional.all_reduce": 2 * 2 + 1 + 1,
    }
    assert results[0]["uneven"].startswith("parallel.sequence_parallel: a batch of 15-token sequences")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sequence_parallel_with_the_vocabulary_sharded_and_qk_norms_matches_a_world_of_one():
    results = run_in_pool(_qwen, world_size=2, timeout=180)
    assert results[0] == results[1]
    runs = results[0]
    for name, run in runs.items():
        assert_like_a_world_of_one(name, run, clip=CLIP)
        # a tied head stays one parameter with its embedding
        assert run["tied"], name
    # Qwen's q/k norms add one all-reduce each, as in the plain plan
    assert runs["qwen_float64"]["counts"] == {
        "c10d_functional.all_gather_into_tensor": 4 * 2 + 2,
        "c10d_functional.reduce_scatter_tensor": 4 * 2,
        "c10d_functional.all_reduce": 2 * 2 + 1 + 2 * 2 + 1,
    }
    # the vocabulary sharded: the embedding's lookup is reduce-scattered (not all-reduced), the head's input
    # gradient too; loss_parallel's three all-reduces remain
    assert runs["qwen_vocab"]["plain_counts"] == {"c10d_functional.all_reduce": 6 * 2 + 1 + 5}
    assert runs["qwen_vocab"]["counts"] == {
        "c10d_functional.all_gather_into_tensor": 4 * 2 + 2,
        "c10d_functional.reduce_scatter_tensor": 4 * 2 + 2,
        "c10d_functional.all_reduce": 2 * 2 + 1 + 2 * 2 + 1 + 3,
    }


def test_only_the_llama_familys_plan_splits_the_sequence():
    check_tensor_plan(LlamaShape(**GQA), 2, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel: GPT-2's plan keeps its fused attention"):
        check_tensor_plan({"dim": 32, "heads": 4}, 2, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel: GPT-2's plan"):
        tensor_plan(GPT(vocab_size=VOCAB, dim=32, depth=1, heads=4, max_len=16), sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"a user's plan lays out its own modules"):
        check_tensor_plan(nn.Sequential(nn.Linear(4, 4)), 2, sequence_parallel=True)


class _RaggedTrainer(ddpkit.Trainer):
    def build_datasets(self):
        return RaggedSequences(n=64), None


def _fit(cfg: dict) -> dict:
    trainer = _RaggedTrainer(cfg)
    metrics = trainer.fit()
    state = trainer.placed.held.state_dict()
    return {"metrics": metrics, "weights": {k: whole(v).detach().clone() for k, v in state.items()}}


def _config(out: Path, **parallel: Any) -> dict:
    """Sequences padded to 16 tokens (they split over 2 ranks), the token-weighted loss, AdamW clipped."""
    llama = {"arch": "llama", "vocab_size": 50, "dim": 32, "depth": 2, "heads": 4, "kv_heads": 2, "mlp_dim": 64}
    return {
        "run": {"name": "sp", "output_dir": str(out), "seed": 3},
        "data": {"global_batch_size": 8, "order": "index_free"},
        "model": {"name": "gpt", "kwargs": {**llama, "max_len": 16, "tied": False}},
        "optim": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1},
        "train": {"max_steps": 4, "log_every": 2, "clip_grad_norm": 0.5, "loss_normalization": "tokens"},
        "parallel": parallel,
        "checkpoint": {"every_epochs": None, "every_steps": None},
        "log": {"progress_bar": False},
    }


@pytest.mark.multiprocess
def test_a_run_with_parallel_sequence_parallel_trains_like_a_world_of_one(tmp_path):
    reference = run_in_pool(_fit, 1, args=(_config(tmp_path / "one"),), timeout=120)[0]
    results = run_in_pool(_fit, 2, args=(_config(tmp_path / "sp", tensor=2, sequence_parallel=True),), timeout=120)
    for result in results:
        assert result["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], rel=1e-5)
        assert relative_l2(result["weights"], reference["weights"]) < 1e-5


def test_sequence_parallel_without_tensor_parallelism_or_on_gpt2_is_refused_before_any_group(tmp_path):
    from ddpkit.config.loader import load_config
    from ddpkit.parallel.parallelize import check_tensor_degree

    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel: .*only with parallel.tensor > 1"):
        load_config(_config(tmp_path, sequence_parallel=True))
    gpt2 = _config(tmp_path, tensor=2, sequence_parallel=True)
    gpt2["model"]["kwargs"] = {"dim": 32, "heads": 4, "depth": 1, "vocab_size": 50, "max_len": 16}
    # what the Trainer's constructor checks, from model.kwargs
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel: GPT-2's plan"):
        check_tensor_degree(load_config(gpt2))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sequence_parallel_under_fsdp2_over_dp2_x_tp2_trains_like_a_world_of_one(tmp_path):
    reference = run_in_pool(_fit, 1, args=(_config(tmp_path / "one"),), timeout=120)[0]
    parallel = {"mode": "fsdp2", "tensor": 2, "sequence_parallel": True}
    results = run_in_pool(_fit, 4, args=(_config(tmp_path / "dp_sp", **parallel),), timeout=300)
    for result in results:
        assert result["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], rel=1e-5)
        assert relative_l2(result["weights"], reference["weights"]) < 1e-5


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sequence_parallel_inside_a_pipeline_pp2_x_tp2_trains_like_a_world_of_one(tmp_path):
    """Each stage's input is its tensor rank's slice of the sequence (a later stage receives the slice the previous
    one's last block reduce-scattered to it), and its rotary positions are the whole sequence's: the stage reads
    the whole length as the slice's times the tensor degree. Before that, 8 positions' tables met a 16-token
    sequence and the run stopped."""
    reference = run_in_pool(_fit, 1, args=(_config(tmp_path / "one"),), timeout=120)[0]
    parallel = {"pipeline": 2, "microbatches": 2, "tensor": 2, "sequence_parallel": True}
    results = run_in_pool(_fit, 4, args=(_config(tmp_path / "pp_sp", **parallel),), timeout=300)
    held: dict[str, torch.Tensor] = {}
    for result in results:
        assert result["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], rel=1e-5)
        held.update(result["weights"])
    # the two stages together hold every weight of the model, each within 1e-5 of a world of one's
    assert relative_l2(held, reference["weights"]) < 1e-5
