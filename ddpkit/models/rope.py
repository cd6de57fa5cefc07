"""Rotary position embeddings (RoPE) in Hugging Face's layout, with the ``llama3`` and ``linear`` scaling rules.

    rope = Rotary(head_dim=64, theta=500000.0, scaling={"rope_type": "llama3", "factor": 32.0, ...})
    cos, sin = rope(positions, dtype=q.dtype)      # positions [T] or [B, T] -> [T, D] or [B, 1, T, D]
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

The layout is Hugging Face's ``rotate_half``: dimension ``i`` of a head is rotated with dimension
``i + D/2`` (not with ``i + 1``, Meta's interleaved original). Checkpoints written by
``save_pretrained`` (Llama, Qwen2, Qwen3, Mistral) are in this layout, so their ``q_proj`` and
``k_proj`` load as they are, with no permutation of rows, and export back the same way.

Frequencies are ``theta ** (-2i / D)``; cos and sin are computed in fp32 from the positions at every
forward (no table of ``max_len`` rows), then cast to the queries' dtype, as transformers does.
``scaling`` (``rope_scaling`` of a 4.x config.json, ``rope_parameters`` of a 5.x one):

- ``default`` (or None): plain RoPE.
- ``linear``: every frequency divided by ``factor`` (position interpolation).
- ``llama3``: Llama 3.1's rule: wavelengths longer than ``original_max_position_embeddings /
  low_freq_factor`` are divided by ``factor``, shorter than ``... / high_freq_factor`` kept, and the
  band between interpolated smoothly.

Any other ``rope_type`` (``yarn``, ``dynamic``, ``longrope``, ...) is refused by name
(:func:`check_scaling`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError

__all__ = ["Rotary", "apply_rotary", "check_scaling", "inverse_frequencies", "SCALING_RULES"]

#: ``rope_type`` values this module computes, with the keys each needs besides ``rope_type``.
SCALING_RULES = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def check_scaling(scaling: dict[str, Any] | None, *, where: str) -> dict[str, Any] | None:
    """``scaling`` normalised (``type`` read as ``rope_type``; ``default`` as None), or a ConfigError naming it."""
    if not scaling:
        return None
    rule = scaling.get("rope_type", scaling.get("type", "default"))
    if rule not in SCALING_RULES:
        raise ConfigError(
            f"{where}: RoPE scaling rule {rule!r} is not supported; ddpkit computes {', '.join(SCALING_RULES)} "
            "(Llama 3's is llama3); train this model through examples/hf_causal_lm.py instead"
        )
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"{where}: partial_rotary_factor={scaling['partial_rotary_factor']!r}; ddpkit rotates whole heads only"
        )
    missing = [key for key in SCALING_RULES[rule] if key not in scaling]
    if missing:
        raise ConfigError(f"{where}: the {rule} RoPE rule needs {', '.join(missing)}; add them")
    if rule == "default":
        return None
    return {"rope_type": rule, **{key: scaling[key] for key in SCALING_RULES[rule]}}


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """The ``head_dim / 2`` rotation frequencies (fp32), scaled by the rule of ``scaling``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: transformers' _compute_llama3_parameters, operation for operation (the same fp32 values)
    old_context = scaling["original_max_position_embeddings"]
    low = scaling["low_freq_factor"]
    high = scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelength < old_context / high) * ~(wavelength > old_context / low)
    return torch.where(between, smoothed, scaled)


class Rotary(nn.Module):
    """cos and sin of each position's rotation; the frequencies are a non-persistent buffer (not in checkpoints)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the frequencies in place (after building on the meta device and ``to_empty``)."""
        self.inv_freq.copy_(inverse_frequencies(self.head_dim, self.theta, self.scaling))

    def forward(self, positions: torch.Tensor, *, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``: ``[T, D]`` for positions ``[T]``, ``[B, 1, T, D]`` for per-sequence ones ``[B, T]``."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device).float()
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos().to(dtype)
        sin = angles.sin().to(dtype)
        if positions.dim() == 2:
            return cos[:, None], sin[:, None]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` rotated: ``x * cos + rotate_half(x) * sin`` (Hugging Face's layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
