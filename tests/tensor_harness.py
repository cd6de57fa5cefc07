"""What the tensor-parallel tests share: the small models they split, the batches they train on, and how they compare
a split run with a world of one (tests/test_tensor_parallel.py, test_sequence_parallel.py, test_tensor_lora.py).

    model = tiny_model("gqa")                    # the same weights on every rank (seeded), split afterwards
    loss = F.cross_entropy(model(fixed_batch(step)[:, :-1]) ...)
    assert relative_l2(split_weights, reference_weights) < 1e-5

Each test file keeps what it varies itself (its clip value, its loss, LoRA); only these are the same everywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.models.gpt import GPT
from ddpkit.models.llama import Llama, LlamaShape

VOCAB = 64
#: Grouped-query attention (4 query heads, 2 key/value heads), an untied head.
GQA = dict(vocab_size=VOCAB, dim=32, depth=2, heads=4, kv_heads=2, mlp_dim=64, max_len=16, tied=False)
#: Qwen-like: q/k/v biases, per-head q/k RMSNorms (their weights see every head: an all-reduce each), tied head.
QWEN = {**GQA, "tied": True, "qkv_bias": True, "qk_norm": True}
GPT2 = dict(vocab_size=VOCAB, dim=32, depth=2, heads=4, max_len=16)


def tiny_model(kind: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``kind`` (``gpt2``, ``gqa`` or ``qwen``) built under seed 0, in ``dtype``: the same bits on every rank."""
    torch.manual_seed(0)
    model = GPT(**GPT2) if kind == "gpt2" else Llama(LlamaShape(**(GQA if kind == "gqa" else QWEN)))
    return model.to(dtype)


def fixed_batch(step: int) -> torch.Tensor:
    """One of four fixed batches of 8 sequences of 17 tokens (inputs 16, which split over 2 or 4 ranks; the targets
    shifted by one)."""
    return torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(step % 4))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective on its mesh: every rank of it calls this), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def relative_l2(a: list[float] | dict, b: list[float] | dict) -> float:
    """Per loss and norm, and per weight tensor in L2 norms (``|a - b| / |b|``): the largest difference relative to
    the world of one's ``b``. AdamW's per-element normalisation lets a few elements' rounding grow; this measure
    reports them at their share of the tensor, the elementwise maximum (:func:`relative_max`) at their size."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in a)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def relative_max(a: list[float] | dict, b: list[float] | dict) -> float:
    """Per loss and norm, and per weight tensor elementwise: the largest difference relative to the size of the
    world of one's tensor (its largest entry)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
