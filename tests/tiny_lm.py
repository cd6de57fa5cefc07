"""``TinyLM``: the small sequence classifier the sharding and checkpoint tests wrap (not shipped in ddpkit).

    from tiny_lm import TinyLM
    model = TinyLM(vocab=16, dim=12, depth=2, heads=2, max_len=8)

``tests`` is on pytest's ``pythonpath`` (pyproject.toml), so tests import it as ``tiny_lm``.
"""

from __future__ import annotations

import torch
from torch import nn


class TransformerBlock(nn.Module):
    """Pre-norm block: causal self-attention, then a 4x GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No bias: a key bias gets only rounding noise as gradient.
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A small transformer that reads a sequence and scores one next token.

    ``forward(tokens[B, T])`` returns the logits after the last position, ``[B, vocab]`` (a classifier
    over sequences); for language modelling ddpkit has ``gpt`` (:mod:`ddpkit.models.gpt`), which
    scores every position. The blocks are an ``nn.ModuleList`` of :class:`TransformerBlock`: FSDP2's
    default rule shards each as one unit.
    """

    def __init__(self, vocab: int = 256, dim: int = 128, depth: int = 4, heads: int = 4, max_len: int = 128):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(depth))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, -1]))
