"""Attention that stays inside each document of a packed window (``data.kwargs.document_mask: true``).

    data: {name: tokens, kwargs: {path: data/train.bin, seq_len: 1024, document_mask: true}}
    data: {name: tokens, kwargs: {..., document_mask: true, restart_positions: true, eot: 50256}}

A token file packs documents back to back with an end-of-text token between them, so a window of
``seq_len`` tokens often holds the end of one document and the start of the next; plain causal
attention lets the second attend to the first. With ``document_mask`` each token attends only to
the earlier tokens of its own document: the end-of-text closes its document, and the token after
it starts a new one. With ``restart_positions`` the position embedding also restarts at 0 in each
document, so a document in a packed window gets exactly the logits it gets alone (within float
rounding: ``tests/test_document_mask.py`` checks 1e-5).

Kernels: on a GPU with ``torch.nn.attention.flex_attention`` (torch 2.5+) a compiled FlexAttention
with a block mask, which skips the blocks the mask empties; elsewhere (the CPU, older torch)
``scaled_dot_product_attention`` with a boolean ``[B, 1, T, T]`` mask. ``benchmarks/document_mask.py``
measures the cost per step against plain causal attention.

The model learns the setting from the dataset: :func:`ddpkit.data.tokens.require_vocab_of`, which the
Trainer calls with the model and its datasets, hands a model that has ``use_documents`` (the
built-in ``gpt``) the dataset's end-of-text id and position rule.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.nn import functional as F

__all__ = ["Documents", "documents_of", "document_attention"]


class Documents:
    """The documents of a batch of windows: ``ids[b, t]`` (which document token ``t`` is in) and positions."""

    def __init__(self, tokens: torch.Tensor, *, eot: int, restart_positions: bool):
        ends = tokens == eot
        # The end-of-text belongs to the document it closes.
        self.ids = torch.cumsum(ends, dim=1) - ends.long()
        index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        if restart_positions:
            first = torch.ones_like(ends)
            # A document starts at the window's start or right after an end-of-text.
            first[:, 1:] = ends[:, :-1]
            self.positions = index - torch.where(first, index, 0).cummax(dim=1).values
        else:
            self.positions = index
        self._mask: torch.Tensor | None = None
        self._block_mask: Any = None

    def mask(self) -> torch.Tensor:
        """``[B, 1, T, T]`` booleans, True where query ``i`` may attend to key ``j``: causal and same document."""
        if self._mask is None:
            length = self.ids.shape[1]
            causal = torch.ones(length, length, dtype=torch.bool, device=self.ids.device).tril()
            self._mask = (causal & (self.ids[:, :, None] == self.ids[:, None, :]))[:, None]
        return self._mask

    def block_mask(self) -> Any:
        """FlexAttention's block mask of the same rule (built once per batch, shared by every layer)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            ids = self.ids

            def same_document(b: Any, h: Any, q: Any, kv: Any) -> Any:
                return (q >= kv) & (ids[b, q] == ids[b, kv])

            batch, length = ids.shape
            self._block_mask = create_block_mask(same_document, batch, None, length, length, device=ids.device)
        return self._block_mask


def documents_of(tokens: torch.Tensor, *, eot: int, restart_positions: bool = False) -> Documents:
    """The documents of ``tokens`` ``[B, T]``, separated by ``eot``."""
    return Documents(tokens, eot=eot, restart_positions=restart_positions)


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: Documents,
    *,
    dropout: float = 0.0,
    kernel: str = "auto",
) -> torch.Tensor:
    """Attention of ``q, k, v`` ``[B, heads, T, head_dim]`` within each document, causally.

    ``kernel``: ``auto`` (FlexAttention on a GPU when torch has it, else SDPA with a mask), ``flex`` or ``sdpa``.
    """
    flex = _flex() if kernel == "flex" or (kernel == "auto" and q.is_cuda and not dropout) else None
    if flex is not None:
        return flex(q, k, v, block_mask=documents.block_mask())
    return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask(), dropout_p=dropout)


@functools.cache
def _flex() -> Any:
    """FlexAttention, compiled once (uncompiled it is a slow reference implementation); None without it."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False)
