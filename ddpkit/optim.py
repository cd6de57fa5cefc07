"""Built-in optimizers (``sgd``, ``adam``, ``adamw``) and the learning-rate schedules.

    optim: {name: sgd, lr: 0.1, momentum: 0.9, weight_decay: 5.0e-4, kwargs: {nesterov: true}}
    sched: {name: cosine, warmup_steps: 100, min_lr: 0.0}

An optimizer builder is called as ``builder(params, lr=, momentum=, weight_decay=, **kwargs)``;
register your own with ``@ddpkit.register_optimizer("name")``. Schedules are a ``LambdaLR``
stepped once per optimizer step: linear warmup from 0 to ``optim.lr``, then constant, cosine or
linear decay to ``min_lr``, or step decay.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ddpkit.config import OptimConfig, SchedConfig
from ddpkit.errors import ConfigError
from ddpkit.registry import OPTIMIZERS, register_optimizer

__all__ = ["build_optimizer", "build_scheduler", "lr_factor"]


@register_optimizer("sgd")
def sgd(params: Iterable[Any], *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, **kwargs: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **kwargs)


@register_optimizer("adam")
def adam(params: Iterable[Any], *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, **kwargs: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, **kwargs)


@register_optimizer("adamw")
def adamw(params: Iterable[Any], *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, **kwargs: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **kwargs)


def build_optimizer(params: Iterable[Any], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg.name`` over ``params``."""
    builder = OPTIMIZERS.get(cfg.name, key="optim.name")
    try:
        return builder(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **cfg.kwargs)
    except TypeError as exc:  # an unknown keyword in optim.kwargs
        raise ConfigError(f"optim.kwargs: {exc} (optimizer {cfg.name!r})") from None
    except ValueError as exc:  # torch's own range checks, e.g. "Invalid beta parameter"
        raise ConfigError(f"optim: {exc} (optimizer {cfg.name!r})") from None


def lr_factor(step: int, cfg: SchedConfig, *, base_lr: float, total_steps: int) -> float:
    """Multiplier of the base learning rate after ``step`` optimizer steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr / base_lr
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.name == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.name == "linear":
        return floor + (1 - floor) * (1 - progress)
    if cfg.name == "step":
        return cfg.gamma ** ((step - cfg.warmup_steps) // cfg.step_size)
    return 1.0


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedConfig, *, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """A ``LambdaLR`` implementing ``cfg`` over ``total_steps`` optimizer steps."""
    base_lr = optimizer.param_groups[0]["lr"]
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, base_lr=base_lr, total_steps=total_steps)
    )
