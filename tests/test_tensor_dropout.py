"""Dropout under tensor parallelism: refused on the CPU with its reason, allowed on CUDA where DTensor's RNG tracker
draws the masks (GPT-2, LoRA's adapters), refused for the Llama family's attention on every device; a replica's
tensor ranks seeded alike; the residual dropouts in the plans, so their masks are DTensor ops.

    .venv/bin/pytest -q tests/test_tensor_dropout.py

No GPU runs here: the CUDA side is the checks' and the seeds', judged in one process.
"""

from __future__ import annotations

import pytest
from torch import nn

from ddpkit.config.loader import load_config
from ddpkit.config.lora_section import LoraConfig
from ddpkit.config.schema import ModelConfig
from ddpkit.errors import ConfigError
from ddpkit.models.gpt import GPT
from ddpkit.models.llama import Llama, LlamaShape
from ddpkit.models.lora import apply_lora
from ddpkit.models.tensor_plans import Replicated
from ddpkit.parallel.parallelize import check_tensor_degree
from ddpkit.parallel.tensor_plan import check_tensor_plan, tensor_plan
from ddpkit.training.rng import STAGE_STRIDE, rank_seed

GQA = dict(vocab_size=64, dim=32, depth=2, heads=4, kv_heads=2, mlp_dim=64, max_len=16)
GPT2 = {"vocab_size": 64, "dim": 32, "depth": 2, "heads": 4, "max_len": 16}


def test_dropout_under_tensor_parallelism_is_refused_on_the_cpu_with_its_reason():
    for model in (GPT2 | {"dropout": 0.1}, GPT(**GPT2, dropout=0.1), LlamaShape(**GQA, dropout=0.1)):
        with pytest.raises(ConfigError, match=r"dropout 0.1 cannot run tensor-parallel on the cpu: .*RNGTracker"):
            check_tensor_plan(model, 2, device="cpu")


def test_on_cuda_gpt2s_dropout_runs_tensor_parallel_and_the_llama_familys_attention_dropout_does_not():
    # GPT-2's attention is whole on every rank, its residual dropouts DTensor ops: nothing is refused
    check_tensor_plan(GPT2 | {"dropout": 0.1}, 2, device="cuda")
    check_tensor_plan(GPT(**GPT2, dropout=0.1), 2, device="cuda")
    # a user's model brings its own plan; its dropout is its own
    check_tensor_plan(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2)), 2, device="cuda")
    with pytest.raises(ConfigError, match=r"model.kwargs.dropout 0.1 cannot run tensor-parallel: the Llama family"):
        check_tensor_plan(LlamaShape(**GQA, dropout=0.1), 2, device="cuda")
    # a LoRA adapter's dropout acts on its layer's input, a DTensor: on CUDA it runs, on a Llama too
    adapted = apply_lora(Llama(LlamaShape(**GQA)), ModelConfig(name="gpt", lora=LoraConfig(r=2, alpha=4, dropout=0.1)))
    check_tensor_plan(adapted, 2, device="cuda")
    with pytest.raises(ConfigError, match=r"model.lora.dropout 0.1 cannot run tensor-parallel on the cpu"):
        check_tensor_plan(adapted, 2, device="cpu")


def test_the_trainers_check_takes_the_configs_device():
    def config(device: str) -> object:
        return load_config(
            {
                "model": {"name": "gpt", "kwargs": GPT2 | {"dropout": 0.1}},
                "parallel": {"tensor": 2, "mode": "ddp"},
                "dist": {"device": device},
            }
        )

    with pytest.raises(ConfigError, match=r"cannot run tensor-parallel on the cpu"):
        check_tensor_degree(config("cpu"))
    # what a GPU run's constructor checks, before any process group
    check_tensor_degree(config("cuda"))


def test_a_replicas_tensor_ranks_share_a_seed_and_replicas_and_stages_do_not():
    # tp2 x dp2: ranks 0-1 one replica, 2-3 the other (the mesh's tensor dimension innermost)
    assert [rank_seed(7, rank=r, world_size=4, tensor=2) for r in range(4)] == [7, 7, 8, 8]
    # pp2 x tp2: each stage's two tensor ranks alike, the stages apart
    seeds = [rank_seed(7, rank=r, world_size=4, stage=r // 2, stages=2, tensor=2) for r in range(4)]
    assert seeds == [7, 7, 7 + STAGE_STRIDE, 7 + STAGE_STRIDE]
    # no tensor parallelism: seed + rank, as it always was
    assert [rank_seed(7, rank=r, world_size=4) for r in range(4)] == [7, 8, 9, 10]


def test_the_plans_put_the_residual_dropouts_on_dtensors():
    llama = tensor_plan(Llama(LlamaShape(**GQA)))
    assert isinstance(llama["drop"], Replicated) and isinstance(llama["blocks.1.drop"], Replicated)
    split = tensor_plan(Llama(LlamaShape(**GQA)), sequence_parallel=True)
    assert "Shard(dim=1)" in repr(split["blocks.0.drop"])
    gpt2 = tensor_plan(GPT(**GPT2))
    assert isinstance(gpt2["drop"], Replicated) and isinstance(gpt2["blocks.0.drop"], Replicated)
