"""Mixed precision: an autocast context and, for fp16, a gradient scaler.

``train.precision``: ``fp32`` (no autocast), ``bf16`` (autocast to bfloat16 on CPU or CUDA; no
scaler needed, bf16 has fp32's range) or ``fp16`` (autocast to float16 plus a ``GradScaler`` that
keeps small gradients from underflowing; CUDA only).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ddpkit.errors import ConfigError

__all__ = ["check_precision", "autocast", "grad_scaler"]


def check_precision(precision: str, device: torch.device, *, option: str = "train.precision=") -> None:
    """Raise a ConfigError for a precision the device cannot run; ``option`` is how the user spelled the setting."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            f"{option}fp16 needs a CUDA device (it relies on a GradScaler and fp16 kernels); "
            f"this run is on the CPU: use {option}bf16 or fp32"
        )


_FULL_PRECISION = contextlib.nullcontext()


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The context that runs forward passes in ``precision`` on ``device`` (reusable for fp32)."""
    if precision == "fp32":
        return _FULL_PRECISION
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16, else None."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
