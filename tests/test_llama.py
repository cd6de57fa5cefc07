"""The Llama family in ddpkit's own model (issue 59): shapes, presets, grouped-query KV cache, document masks,
activation checkpointing, FSDP2's units, compile, the names a tensor plan and peft target.

.venv/bin/pytest tests/test_llama.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ddpkit.data.tokens import BYTE_EOT
from ddpkit.errors import ConfigError
from ddpkit.models.generation import generate
from ddpkit.models.gpt import GPT, gpt
from ddpkit.models.llama import LLAMA_PRESETS, Llama, LlamaBlock, LlamaShape
from ddpkit.parallel.activation_checkpointing import apply_activation_checkpointing
from ddpkit.parallel.fsdp import fsdp_blocks

pytestmark = pytest.mark.timeout(120)

#: Published parameter counts of the presets' models (their model cards / safetensors headers).
PUBLISHED = {
    "smollm2-135m": 134_515_008,
    "llama3.2-1b": 1_235_814_400,
    "qwen2.5-0.5b": 494_032_768,
    "qwen3-0.6b": 596_049_920,
}


def small(**options) -> Llama:
    torch.manual_seed(0)
    return gpt(arch="llama", **{"dim": 64, "depth": 2, "heads": 4, "kv_heads": 2, "max_len": 64, **options}).eval()


def test_the_builder_picks_the_family_and_resolves_the_widths():
    assert isinstance(gpt(), GPT) and isinstance(gpt(arch="llama"), Llama)
    model = small(qk_norm=True, qkv_bias=True, head_dim=32, tied=False)
    attn = model.blocks[0].attn
    assert (attn.q_proj.weight.shape, attn.k_proj.weight.shape, attn.o_proj.weight.shape) == (
        (128, 64),
        (64, 64),
        (64, 128),
    )
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None and attn.q_norm.weight.shape == (32,)
    assert model.blocks[0].mlp.gate_proj.weight.shape == (192, 64)  # 2/3 of 4 x 64, up to a multiple of 64
    assert model.head.weight is not model.embed.weight
    tied = small()
    assert tied.head.weight is tied.embed.weight


@pytest.mark.parametrize("preset", list(LLAMA_PRESETS))
def test_every_preset_builds_on_the_meta_device_with_its_published_size(preset):
    with torch.device("meta"):
        model = gpt(preset=preset)
    total = sum(p.numel() for p in model.parameters())
    assert total == PUBLISHED.get(preset, total)
    assert gpt(preset=preset, depth=1, dim=64, heads=4, kv_heads=2, head_dim=16, mlp_dim=32).depth == 1


def test_logits_are_causal_and_a_loss_near_log_vocab_at_init():
    model = small()
    x = torch.randint(0, 257, (2, 32))
    y = x.clone()
    y[:, 20] = (y[:, 20] + 1) % 257
    with torch.no_grad():
        a, b = model(x), model(y)
    assert a.shape == (2, 32, 257)
    assert torch.equal(a[:, :20], b[:, :20]) and not torch.equal(a[:, 20:], b[:, 20:])
    targets = torch.randint(0, 257, (2, 32))
    loss = F.cross_entropy(a.flatten(0, 1), targets.flatten())
    assert abs(loss.item() - torch.log(torch.tensor(257.0)).item()) < 0.2


@pytest.mark.parametrize("options", [{}, {"kv_heads": 1, "qk_norm": True}, {"kv_heads": 4, "qkv_bias": True}])
def test_greedy_is_identical_with_and_without_the_grouped_cache(options):
    model = small(**options)
    prompt = list(range(10, 20))
    cached = list(generate(model, prompt, max_new_tokens=30, temperature=0))
    plain = list(generate(model, prompt, max_new_tokens=30, temperature=0, use_cache=False))
    assert cached == plain and len(cached) == 30
    cache = model.make_cache(1)
    with torch.no_grad():
        model(torch.tensor([prompt]), cache=cache)
    assert cache.layers[0].keys.shape == (1, model.kv_heads, 64, 16)  # kv_heads, grown to what was needed


def test_a_document_packed_after_another_gets_its_logits_alone():
    model = small()
    model.use_documents(eot=BYTE_EOT, restart_positions=True)
    first, second = torch.randint(0, 256, (1, 20)), torch.randint(0, 256, (1, 25))
    packed = torch.cat([first, torch.tensor([[BYTE_EOT]]), second], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(packed)[:, 21:], model(second), rtol=0, atol=1e-5)


def test_activation_checkpointing_keeps_the_loss_and_gradients_bitwise():
    x = torch.randint(0, 257, (2, 32))
    runs = []
    for checkpointed in (False, True):
        model = small(dropout=0.0).train()
        assert apply_activation_checkpointing(model, checkpointed) == (2 if checkpointed else 0)
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0]) and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_the_parts_a_pipeline_and_a_tensor_plan_cut_along():
    model = small(tied=False)
    assert fsdp_blocks(model, None) == list(model.blocks) and all(isinstance(b, LlamaBlock) for b in model.blocks)
    assert [name for name, _ in model.named_children()] == ["embed", "rope", "drop", "blocks", "norm", "head"]
    linear = {name.rsplit(".", 1)[-1] for name, m in model.blocks.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linear == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    x = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        h = model.embed(x)
        rope = model.rotation(x)
        for block in model.blocks:
            h = block(h, rope)
        assert torch.equal(model.logits(h), model(x))
    assert not any("inv_freq" in key for key in model.state_dict())


def test_flops_per_token_counts_the_head_and_the_query_heads():
    model = small(tied=False)
    n = sum(p.numel() for p in model.parameters()) - model.embed.weight.numel()
    assert model.num_params() == n
    assert model.flops_per_token(32) == 6 * n + 12 * 2 * 4 * 16 * 32


def test_shape_errors_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"model.kwargs.kv_heads: 3 does not divide heads 4; .*1, 2, 4"):
        LlamaShape(heads=4, kv_heads=3)
    with pytest.raises(ConfigError, match=r"model.kwargs.heads: dim 30 is not divisible by heads 4"):
        gpt(arch="llama", dim=30)
    with pytest.raises(ConfigError, match=r"model.kwargs.head_dim: 15 is odd"):
        gpt(arch="llama", head_dim=15)
    with pytest.raises(ConfigError, match=r"RoPE scaling rule 'dynamic' is not supported"):
        gpt(arch="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ConfigError, match=r"the llama3 RoPE rule needs low_freq_factor"):
        gpt(arch="llama", rope_scaling={"rope_type": "llama3", "factor": 2.0})
    with pytest.raises(ConfigError, match=r"unexpected keyword argument 'kv_head' for model 'gpt'; it accepts"):
        gpt(arch="llama", kv_head=2)
    with pytest.raises(ConfigError, match=r"'kv_heads' for model 'gpt'.*add model.kwargs.arch: llama"):
        gpt(kv_heads=2)
    with pytest.raises(ConfigError, match=r"unknown preset 'llama9'; choose one of gpt2, smollm2-135m"):
        gpt(preset="llama9")
    with pytest.raises(ConfigError, match=r"model.kwargs.arch: 'gpt2' contradicts preset qwen3-0.6b"):
        gpt(preset="qwen3-0.6b", arch="gpt2")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_forward_and_backward_equal_eager():
    model = small(qk_norm=True).train()
    x = torch.randint(0, 257, (2, 32))
    eager = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    compiled = F.cross_entropy(torch.compile(model)(x).flatten(0, 1), x.flatten())
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    compiled.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
