"""The ``gpt`` model: shapes, causality, tied embeddings, GPT-2's size and initialisation, FLOPs, FSDP2 units, errors.

.venv/bin/pytest tests/test_gpt.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import cpu_runtime
from torch.nn import functional as F

from ddpkit.errors import ConfigError
from ddpkit.models.gpt import GPT, GPTBlock, gpt
from ddpkit.parallel.fsdp import fsdp_blocks
from ddpkit.registry import MODELS

SMALL = {"vocab_size": 61, "dim": 32, "depth": 3, "heads": 4, "max_len": 24}


def _small(**overrides) -> GPT:
    torch.manual_seed(0)
    return MODELS.build("gpt", key="model.name", kwargs={**SMALL, **overrides})


def test_logits_for_every_position_and_a_loss_near_log_vocab_at_init():
    model = _small()
    x = torch.randint(0, 61, (3, 24))
    logits = model(x)
    assert logits.shape == (3, 24, 61) and logits.dtype == torch.float32 and model.vocab_size == 61
    loss = F.cross_entropy(logits.flatten(0, 1), torch.roll(x, -1, 1).flatten())
    assert abs(loss.item() - math.log(61)) < 0.1  # std-0.02 weights: nearly uniform predictions
    assert model(x[:, :5]).shape == (3, 5, 61)  # shorter sequences are fine


def test_a_token_changes_only_the_logits_at_and_after_its_position():
    model = _small().eval()
    x = torch.randint(0, 61, (2, 24))
    changed = x.clone()
    changed[:, 10] = (x[:, 10] + 1) % 61
    before, after = model(x), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=1e-6)
    assert (before[:, 10:] - after[:, 10:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees it


def test_input_and_output_embeddings_are_one_parameter():
    model = _small()
    assert model.head.weight is model.embed.weight
    assert sum(p is model.embed.weight for p in model.parameters()) == 1
    model(torch.randint(0, 61, (2, 8))).sum().backward()
    assert model.embed.weight.grad is not None and model.head.weight.grad is model.embed.weight.grad


def test_gpt2_initialisation_scales_the_residual_projections():
    model = gpt(vocab_size=512, dim=256, depth=8, heads=4, max_len=64)
    residual = torch.cat([p.flatten() for b in model.blocks for p in (b.attn.proj.weight, b.proj.weight)])
    other = torch.cat([p.flatten() for b in model.blocks for p in (b.attn.qkv.weight, b.fc.weight)])
    assert residual.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert other.std().item() == pytest.approx(0.02, rel=0.05) and model.embed.weight.std().item() == pytest.approx(
        0.02, rel=0.05
    )
    assert all(m.bias.eq(0).all() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None)


def test_the_gpt2_preset_is_the_124m_shape_and_kwargs_override_it():
    with torch.device("meta"):  # no memory, no initialisation work
        model = MODELS.build("gpt", key="model.name", kwargs={"preset": "gpt2"})
        shorter = gpt(preset="gpt2", max_len=512)
    v, d, layers, t = 50304, 768, 12, 1024
    # embeddings, blocks (4 matrices, biases, 2 LayerNorms), ln_f
    by_hand = v * d + t * d + layers * (12 * d * d + 13 * d) + 2 * d
    assert model.num_params(non_embedding=False) == by_hand == 124_475_904
    assert (model.vocab_size, model.dim, model.depth, model.heads, model.max_len) == (v, d, layers, 12, t)
    assert shorter.max_len == 512 and shorter.pos.weight.shape == (512, 768) and shorter.dim == 768


def test_flops_per_token_is_the_palm_formula():
    with torch.device("meta"):
        model = gpt(preset="gpt2")
    # every parameter but the position embeddings (the tied token matrix is the output layer)
    n = 124_475_904 - 1024 * 768
    assert model.num_params() == n
    assert model.flops_per_token() == 6 * n + 12 * 12 * 768 * 1024 == 855_383_040
    assert model.flops_per_token(seq_len=256) == 6 * n + 12 * 12 * 768 * 256
    small = _small()
    assert (
        small.flops_per_token(seq_len=10)
        == 6 * (sum(p.numel() for p in small.parameters()) - 24 * 32) + 12 * 3 * 32 * 10
    )


def test_fsdp2_default_rule_shards_each_block():
    model = _small()
    assert fsdp_blocks(model, None) == list(model.blocks) and all(type(b) is GPTBlock for b in model.blocks)
    assert fsdp_blocks(model, ["GPTBlock"]) == list(model.blocks)


def _fsdp2_matches_the_bare_model(_: None) -> tuple[float, float]:
    """Rank r: the loss and gradient norm of a 2-rank fsdp2 GPT, next to the same model unsharded."""
    from ddpkit.config.parallel import ParallelConfig
    from ddpkit.distributed.gradient_norm import gradient_norm
    from ddpkit.parallel.layout import data_parallel_for

    bare, sharded = _small(), _small()
    sharded = data_parallel_for(ParallelConfig(mode="fsdp2")).shard(sharded, mesh=None, runtime=cpu_runtime())
    x = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (bare, sharded):
        loss = F.cross_entropy(model(x).flatten(0, 1), torch.roll(x, -1, 1).flatten())
        loss.backward()
        losses.append((loss.item(), gradient_norm(list(model.parameters())).item()))
    (bare_loss, bare_norm), (loss, norm) = losses
    return bare_loss - loss, bare_norm - norm


@pytest.mark.multiprocess
def test_fsdp2_on_two_ranks_gives_the_bare_models_loss_and_gradients():
    from helpers import run_in_pool

    for loss_gap, norm_gap in run_in_pool(_fsdp2_matches_the_bare_model, 2, args=(None,), timeout=120):
        # both ranks computed the same batch, so no averaging difference
        assert abs(loss_gap) < 1e-5 and abs(norm_gap) < 1e-5


def test_shape_errors_name_the_key_and_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"model.kwargs.heads: dim 30 is not divisible by heads 4; "
        r"choose heads that divide dim \(e.g. 6, 10, 15, 30\)",
    ):
        gpt(dim=30, heads=4)
    with pytest.raises(
        ConfigError,
        match=r"model.kwargs.max_len: the input has 25 tokens per sequence "
        r"but the model's max_len is 24; lower",
    ):
        _small()(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ConfigError, match="model.kwargs.preset: unknown preset 'gpt3'; choose one of gpt2"):
        gpt(preset="gpt3")
    with pytest.raises(ConfigError, match="model.kwargs.depth: expected a positive integer, got 0"):
        gpt(depth=0)
    with pytest.raises(ConfigError, match=r"model.kwargs: .*'vocab'.* for model 'gpt'; it accepts: preset, vocab_size"):
        MODELS.build("gpt", key="model.name", kwargs={"vocab": 64})
