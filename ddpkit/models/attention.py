"""The attention kernel every built-in language model calls, the KV cache and the initialisation they share.

    y = causal_attention(q, k, v, cache=layer_cache, documents=documents, dropout=0.0)   # q [B, H, T, D]
    cache = KVCache(model, batch=1)            # the model's depth, kv_heads, head_dim and max_len
    logits = model(prompt, cache=cache)        # the prompt's keys and values are kept
    logits = model(next_token[:, None], cache=cache)   # one token: attends to the prompt and itself

One function picks the kernel for both families (GPT-2's ``GPTBlock`` and the Llama family's
``LlamaBlock``): with a cache, the new keys and values are stored and the queries attend over all of
them; with ``documents`` (``data.kwargs.document_mask``), attention stays inside each packed document
(:mod:`ddpkit.models.document_mask`); otherwise ``scaled_dot_product_attention(is_causal=True)``,
flash attention on GPUs. Grouped-query attention (fewer key/value heads than query heads, Llama 3's
and Qwen's ``num_key_value_heads``) goes to SDPA as it is (``enable_gqa``: query head ``h`` reads
key/value head ``h // (H / H_kv)``, Hugging Face's ``repeat_kv``); the document kernel gets the
key/value heads repeated to match.

The cache keeps ``kv_heads`` heads, not ``heads``: that is the memory GQA saves. It starts empty and
grows (doubling, up to ``max_len``) as tokens arrive, so a model whose context is 131,072 tokens
(Llama 3.2) does not allocate it all to continue a short prompt.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.nn import functional as F

from ddpkit.models.document_mask import Documents, document_attention

__all__ = ["causal_attention", "LayerCache", "KVCache", "CachedModel"]

#: The smallest capacity a layer's cache grows to at its first tokens.
_FIRST_CAPACITY = 64


class CachedModel(Protocol):
    """What :class:`KVCache` reads of a model: its shape and a parameter for the device and dtype."""

    depth: int
    kv_heads: int
    head_dim: int
    max_len: int

    def parameters(self): ...  # noqa: ANN201 - nn.Module's


class LayerCache:
    """One block's keys and values ``[B, kv_heads, capacity, head_dim]``, filled up to ``length``."""

    def __init__(self, shape: tuple[int, int, int], *, max_len: int, device: torch.device, dtype: torch.dtype):
        self.shape = shape
        self.max_len = max_len
        self.device = device
        self.dtype = dtype
        self.keys = self.values = torch.zeros((*shape[:2], 0, shape[2]), device=device, dtype=dtype)
        self.length = 0

    def _reserve(self, end: int) -> None:
        """Room for ``end`` tokens: a larger buffer (twice the old, at most ``max_len``) with the old tokens copied."""
        if end <= self.keys.shape[2]:
            return
        capacity = min(self.max_len, max(end, 2 * self.keys.shape[2], _FIRST_CAPACITY))
        batch, heads, head_dim = self.shape
        for name in ("keys", "values"):
            grown = torch.zeros((batch, heads, capacity, head_dim), device=self.device, dtype=self.dtype)
            grown[:, :, : self.length] = getattr(self, name)[:, :, : self.length]
            setattr(self, name, grown)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the new ``k``, ``v`` after the cached ones; causal attention of ``q`` over all of them."""
        start = self.length
        end = start + q.shape[2]
        self._reserve(end)
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        self.length = end
        keys = self.keys[:, :, :end]
        values = self.values[:, :, :end]
        grouped = keys.shape[1] != q.shape[1]
        if start == 0:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=grouped)
        # query i sits at position start + i and sees the keys up to it (all of them for one new token)
        mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=grouped)


class KVCache:
    """Every block's :class:`LayerCache` for ``batch`` sequences of up to the model's ``max_len`` tokens."""

    def __init__(
        self, model: CachedModel, *, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ):
        weight = next(iter(model.parameters()))
        shape = (batch, model.kv_heads, model.head_dim)
        device = device or weight.device
        dtype = dtype or weight.dtype
        self.layers = [LayerCache(shape, max_len=model.max_len, device=device, dtype=dtype) for _ in range(model.depth)]

    @property
    def length(self) -> int:
        """Tokens cached so far: the position of the next token."""
        return self.layers[0].length


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache: LayerCache | None = None,
    documents: Documents | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[B, H, T, D]`` over ``k``, ``v`` ``[B, H_kv, T, D]`` (``H_kv`` divides ``H``)."""
    if cache is not None:
        return cache.attend(q, k, v)
    grouped = k.shape[1] != q.shape[1]
    if documents is not None:
        if grouped:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return document_attention(q, k, v, documents, dropout=dropout)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=grouped)
