"""LoRA under tensor parallelism (ddpkit.models.lora_tensor) on real Gloo ranks: the adapters split with their base
layers, T = 2 against a world of one (losses, clipping norms, the adapter's weights), the collectives a step costs,
and the layouts of each adapter's A and B.

    .venv/bin/pytest -q tests/test_tensor_lora.py

The adapters' B start non-zero (as after some training) so that their path carries the gradient from the first
step; only A and B train, with AdamW and clipping over the whole (adapter) model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import RaggedSequences, run_in_pool
from tensor_harness import GQA, assert_like_a_world_of_one, relative_l2, tiny_model, train_counted, whole
from torch import nn

import ddpkit
from ddpkit.config.lora_section import LoraConfig
from ddpkit.config.schema import ModelConfig
from ddpkit.errors import ConfigError
from ddpkit.models.llama import Llama, LlamaShape
from ddpkit.models.lora import LoraLinear, apply_lora
from ddpkit.parallel.tensor_plan import apply_tensor_parallel, check_tensor_plan, tensor_plan

pytestmark = pytest.mark.timeout(200)

CLIP = 0.01


def _model(kind: str, dtype: torch.dtype = torch.float32, targets: Any = "all-linear") -> nn.Module:
    model = apply_lora(tiny_model(kind, dtype), ModelConfig(name="gpt", lora=LoraConfig(r=4, alpha=8, targets=targets)))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLinear):
                module.lora_B.weight.normal_(0, 0.05)
    return model


def _against_one(kind: str, steps: int, dtype: torch.dtype, targets: Any = "all-linear") -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = apply_tensor_parallel(_model(kind, dtype, targets), mesh, tensor_plan(_model(kind, dtype, targets)))
    placements = {name: str(p.placements) for name, p in model.named_parameters() if ".lora_" in name}
    tp = train_counted(model, steps, clip=CLIP)
    one = train_counted(_model(kind, dtype, targets), steps, clip=CLIP)
    return {
        "losses": relative_l2(tp["losses"], one["losses"]),
        "norms": relative_l2(tp["norms"], one["norms"]),
        # the adapter alone: the only parameters that train
        "weights": relative_l2(tp["weights"], one["weights"]),
        "first_norm": one["norms"][0],
        "counts": tp["counts"],
        "placements": placements,
        "frozen": sorted(name for name, p in model.named_parameters() if not p.requires_grad)[:3],
    }


def _runs() -> dict:
    """Several comparisons in one spawn (each spawn costs seconds)."""
    return {
        "gqa": _against_one("gqa", 4, torch.float32),
        "qwen": _against_one("qwen", 4, torch.float32),
        "gpt2": _against_one("gpt2", 4, torch.float32),
        "qwen_float64": _against_one("qwen", 4, torch.float64),
    }


@pytest.mark.multiprocess
def test_a_colwise_and_a_rowwise_adapter_under_tp2_match_a_world_of_one_and_count_their_collectives():
    results = run_in_pool(_against_one, world_size=2, args=("gqa", 3, torch.float32, ["q_proj", "down_proj"]))
    assert results[0] == results[1]
    run = results[0]
    assert_like_a_world_of_one("gqa", run, clip=CLIP)
    # the adapters follow their base: colwise q_proj keeps A whole and splits B's rows as its base's; rowwise
    # down_proj splits A's columns as its base's and keeps B whole
    placements = run["placements"]
    assert placements["blocks.0.attn.q_proj.lora_A.weight"] == "(Replicate(),)"
    assert placements["blocks.0.attn.q_proj.lora_B.weight"] == "(Shard(dim=0),)"
    assert placements["blocks.1.mlp.down_proj.lora_A.weight"] == "(Shard(dim=1),)"
    assert placements["blocks.1.mlp.down_proj.lora_B.weight"] == "(Replicate(),)"
    # a step, the embedding and the head replicated: forward, the base plan's 2 all-reduces a block (o_proj,
    # down_proj), the adapters none of their own; backward, the input gradients of the attention and the MLP but
    # block 0's attention (the frozen embedding below it wants no gradient) and one per adapter (colwise: A's
    # gradient, rowwise: B's); the clipping norm
    assert run["counts"] == {"c10d_functional.all_reduce": 2 * 2 + 3 + 2 * 2 + 1}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_lora_on_every_linear_layer_under_tp2_matches_a_world_of_one():
    results = run_in_pool(_runs, world_size=2, timeout=180)
    assert results[0] == results[1]
    runs = results[0]
    for name, run in runs.items():
        assert_like_a_world_of_one(name, run, clip=CLIP)
    # GPT-2's replicated attention keeps its adapters whole; its MLP's adapters are split
    assert runs["gpt2"]["placements"]["blocks.0.attn.qkv.lora_A.weight"] == "(Replicate(),)"
    assert runs["gpt2"]["placements"]["blocks.0.fc.lora_B.weight"] == "(Shard(dim=0),)"
    # as above with 7 adapters a block (2 for GPT-2's MLP, its attention's replicated); Qwen's q/k norms are frozen,
    # their weights want no gradient to reduce
    assert runs["gqa"]["counts"] == {"c10d_functional.all_reduce": 2 * 2 + 3 + 7 * 2 + 1}
    assert runs["qwen"]["counts"] == {"c10d_functional.all_reduce": 2 * 2 + 3 + 7 * 2 + 1}
    assert runs["gpt2"]["counts"] == {"c10d_functional.all_reduce": 1 * 2 + 2 + 2 * 2 + 1}


def test_a_lora_model_under_tensor_parallelism_refuses_only_the_adapters_dropout_on_the_cpu():
    model = Llama(LlamaShape(**GQA))
    dropped = apply_lora(model, ModelConfig(name="gpt", lora=LoraConfig(r=2, alpha=4, dropout=0.1)))
    with pytest.raises(ConfigError, match=r"model.lora.dropout 0.1 cannot run tensor-parallel on the cpu"):
        check_tensor_plan(dropped, 2)
    check_tensor_plan(_model("gqa"), 2)


def test_a_plan_style_that_cannot_split_an_adapter_is_refused_naming_the_layer():
    from torch.distributed.tensor.parallel import SequenceParallel

    from ddpkit.models.lora_tensor import LoraParallel, lora_plan

    model = _model("gqa", targets=["q_proj"])
    plan = lora_plan(model, tensor_plan(model))
    assert isinstance(plan["blocks.0.attn.q_proj"], LoraParallel)
    assert type(plan["blocks.0.attn.k_proj"]).__name__ == "ColwiseParallel"
    with pytest.raises(ConfigError, match=r"adapted layer blocks.0.attn.q_proj a SequenceParallel"):
        lora_plan(model, {"blocks.0.attn.q_proj": SequenceParallel()})


class _RaggedTrainer(ddpkit.Trainer):
    def build_datasets(self):
        return RaggedSequences(n=64), None


def _fit(cfg: dict) -> dict:
    """A Trainer's run: its final metrics and the adapter's state made whole (the state_dict holds nothing else)."""
    trainer = _RaggedTrainer(cfg)
    metrics = trainer.fit()
    state = trainer.placed.held.state_dict()
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return {"metrics": metrics, "adapter": {k: whole(v).detach().clone() for k, v in tensors.items()}}


def _lora_config(out: Path, **parallel: Any) -> dict:
    llama = {"arch": "llama", "vocab_size": 50, "dim": 32, "depth": 2, "heads": 4, "kv_heads": 2, "mlp_dim": 64}
    return {
        "run": {"name": "lora-tp", "output_dir": str(out), "seed": 3},
        "data": {"global_batch_size": 8, "order": "index_free"},
        "model": {
            "name": "gpt",
            "kwargs": {**llama, "max_len": 16, "tied": False},
            "lora": {"r": 4, "alpha": 8, "targets": "all-linear"},
        },
        "optim": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1},
        "train": {"max_steps": 6, "log_every": 2, "clip_grad_norm": 0.5, "loss_normalization": "tokens"},
        "parallel": parallel,
        "checkpoint": {"every_epochs": None, "every_steps": 3},
        "log": {"progress_bar": False},
    }


@pytest.mark.multiprocess
def test_a_lora_run_under_tp2_trains_its_adapter_like_a_world_of_one(tmp_path):
    reference = run_in_pool(_fit, 1, args=(_lora_config(tmp_path / "one"),), timeout=120)[0]
    results = run_in_pool(_fit, 2, args=(_lora_config(tmp_path / "tp", tensor=2),), timeout=120)
    assert set(reference["adapter"]) == set(results[0]["adapter"])
    assert all(".lora_A." in k or ".lora_B." in k for k in reference["adapter"])
    for result in results:
        assert result["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], rel=1e-5)
        assert relative_l2(result["adapter"], reference["adapter"]) < 1e-5
    # the adapter moved (B starts at zero): the comparison is not of two untrained adapters
    assert max(float(v.abs().max()) for k, v in reference["adapter"].items() if ".lora_B." in k) > 1e-3


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "parallel",
    [{"mode": "fsdp2", "tensor": 2}, {"pipeline": 2, "microbatches": 2, "tensor": 2}],
    ids=["fsdp2_dp2_x_tp2", "pp2_x_tp2"],
)
def test_a_lora_run_over_4_ranks_with_tensor_parallelism_trains_its_adapter_like_a_world_of_one(tmp_path, parallel):
    reference = run_in_pool(_fit, 1, args=(_lora_config(tmp_path / "one"),), timeout=120)[0]
    results = run_in_pool(_fit, 4, args=(_lora_config(tmp_path / "four", **parallel),), timeout=300)
    # under a pipeline each stage holds its own blocks' adapters
    merged = {k: v for result in results for k, v in result["adapter"].items()}
    assert merged.keys() == reference["adapter"].keys()
    assert relative_l2(merged, reference["adapter"]) < 1e-5
    for result in results:
        assert result["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], rel=1e-5)
