"""Built-in optimizers (``sgd``, ``adam``, ``adamw``) and the learning-rate schedules.

    optim: {name: sgd, lr: 0.1, momentum: 0.9, weight_decay: 5.0e-4, kwargs: {nesterov: true}}
    sched: {name: cosine, warmup_steps: 100, min_lr: 0.0}

:class:`OptimizerStep` is what the training loop runs once per optimizer step: the backward of
each micro-batch (scaled for fp16, divided over accumulated micro-batches), then gradient
clipping, the step, zeroing gradients and the schedule, with the autocast context for forward
passes. The loop itself stays a few readable lines.

An optimizer builder is called as ``builder(params, lr=, momentum=, weight_decay=, **kwargs)``, ``params``
being torch's param groups when ``optim.decay`` / ``optim.groups`` make more than one (a list of dicts);
register your own with ``@ddpkit.register_optimizer("name")``. Schedules are a ``LambdaLR``
stepped once per optimizer step: linear warmup from 0 to ``optim.lr``, then constant, cosine or
linear decay to ``min_lr``, or step decay.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from ddpkit.config.schema import OptimConfig, SchedConfig, TrainConfig
from ddpkit.distributed.gradient_norm import gradient_norm
from ddpkit.errors import ConfigError
from ddpkit.registry import OPTIMIZERS, register_optimizer
from ddpkit.training.param_groups import accept_one_group, param_groups
from ddpkit.training.precision import autocast, check_precision, grad_scaler
from ddpkit.training.token_loss import TokenCount, split_loss

__all__ = ["build_optimizer", "build_scheduler", "lr_factor", "OptimizerStep"]


@register_optimizer("sgd")
def sgd(
    params: Iterable[Any], *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, **kwargs: Any
) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **kwargs)


@register_optimizer("adam")
def adam(
    params: Iterable[Any], *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, **kwargs: Any
) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, **kwargs)


@register_optimizer("adamw")
def adamw(
    params: Iterable[Any], *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, **kwargs: Any
) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **kwargs)


def build_optimizer(model: torch.nn.Module | Iterable[Any], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg.name`` over ``model``'s parameters, in the groups ``optim`` configures.

    ``model`` is the (bare or FSDP2-sharded) module, whose parameter names ``optim.groups`` patterns
    select; bare parameters are accepted too, for the ``optim.decay`` rule alone. The builder gets
    torch's param groups (a list of dicts) unless they come to one plain group (no weight decay, no
    ``optim.groups``): then the parameters themselves, as before groups existed. See
    :mod:`ddpkit.training.param_groups`, which also lets a one-group checkpoint of an earlier release load.
    """
    named = list(model.named_parameters()) if isinstance(model, torch.nn.Module) else [(None, p) for p in model]
    groups = param_groups(named, cfg)
    plain = len(groups) == 1 and set(groups[0]) == {"params", "weight_decay"}
    plain = plain and groups[0]["weight_decay"] == cfg.weight_decay
    builder = OPTIMIZERS.get(cfg.name, key="optim.name")
    try:
        optimizer = builder(
            groups[0]["params"] if plain else groups,
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            **cfg.kwargs,
        )
    except TypeError as exc:
        # An unknown keyword in optim.kwargs.
        raise ConfigError(f"optim.kwargs: {exc} (optimizer {cfg.name!r})") from None
    except ValueError as exc:
        # torch's own range checks, e.g. "Invalid beta parameter".
        raise ConfigError(f"optim: {exc} (optimizer {cfg.name!r})") from None
    if len(optimizer.param_groups) > 1:
        accept_one_group(optimizer, [p for _, p in named])
    return optimizer


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


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedConfig, *, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A ``LambdaLR`` implementing ``cfg`` over ``total_steps`` optimizer steps; None for a constant rate.

    None rather than a scheduler that multiplies by 1.0: it saves the scheduler's per-step cost.
    """
    if cfg.name == "constant" and cfg.warmup_steps == 0:
        return None
    # min_lr is optim.lr's floor; a group with its own lr ends at the same fraction of it
    base_lr = optimizer.defaults.get("lr", optimizer.param_groups[0]["lr"])
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, base_lr=base_lr, total_steps=total_steps)
    )


class StepHealth(Protocol):
    """What the optimizer step asks the run's health checks (:class:`ddpkit.training.health.TrainingHealth`)."""

    def watch_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def record(self, losses: list[torch.Tensor]) -> None: ...

    def allow_step(self, norm: torch.Tensor, *, scaled: bool = False) -> bool: ...


class OptimizerStep:
    """Backward passes and optimizer steps as ``train`` configures them (precision, accumulation, clipping).

    ``tokens``: under ``loss_normalization: tokens``, the step's token count (:meth:`TokenCount.for_run`; built here
    when not given). ``health``: sees each loss before backward and the gradient norm before the update, and may
    skip the update. ``stages`` / ``counted``: under a pipeline, its process group and the parameters whose
    gradients the norm counts (:func:`ddpkit.distributed.sharding.gradient_norm`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        *,
        train: TrainConfig,
        device: torch.device,
        world_size: int = 1,
        tokens: TokenCount | None = None,
        health: StepHealth | None = None,
        stages: Any = None,
        counted: list[torch.Tensor] | None = None,
    ):
        check_precision(train.precision, device)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = grad_scaler(train.precision, device)
        self._precision = train.precision
        self._device = device
        self._reusable_autocast = autocast(train.precision, device) if train.precision == "fp32" else None
        self._accum = train.grad_accum_steps
        self._clip = train.clip_grad_norm
        self._parameters = list(model.parameters())
        self.normalization = train.loss_normalization
        #: ``loss_normalization: tokens``: this step's token count, and the gradient scaling it decides.
        if tokens is None:
            tokens = TokenCount.for_run(model, train, device=device, world_size=world_size)
        self.tokens = tokens
        self.health = health
        #: A pipeline's process group and the parameters whose gradients count in its norm (a tied one once).
        self._stages = stages
        self._counted = counted

    def autocast(self) -> Any:
        """The context for forward passes (a reusable no-op in fp32, made once)."""
        return self._reusable_autocast or autocast(self._precision, self._device)

    def loss_of(self, result: Any, *, owner: type) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``training_step``'s return as ``(loss, n_tokens)``; one not fitting ``loss_normalization`` is refused."""
        if self.tokens is None and isinstance(result, torch.Tensor) and result.dim() == 0:
            # The common case (a mean loss), checked without two more calls a step.
            return result, None
        return split_loss(result, normalization=self.normalization, owner=owner)

    def backward(self, loss: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """Backward of one micro-batch's loss: averaged over the accumulated micro-batches, or (``tokens``)
        a loss sum whose gradients :meth:`step` divides by the global token count."""
        if self.health is not None:
            loss = self.health.watch_loss(loss)
        if tokens is not None:
            self.tokens.add(tokens)
        elif self._accum > 1:
            loss = loss / self._accum
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self) -> None:
        """Clip, step (through the scaler in fp16) unless health says skip, zero the gradients, advance the schedule."""
        if self.tokens is not None:
            # The step's one all-reduce of token counts, before any clipping.
            self.tokens.scale_gradients()
        norm = self._gradient_norm()
        applied = self.health is None or self.health.allow_step(norm, scaled=self.scaler is not None)
        if applied:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
        if self.scaler is not None:
            # Also after a skip: it resets the unscale_ bookkeeping.
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if applied and self.scheduler is not None:
            self.scheduler.step()

    def _gradient_norm(self) -> torch.Tensor | None:
        """The global gradient norm, computed once: the clip's when clipping, else only when health needs it
        (unscaled in fp16)."""
        if not self._clip and self.health is None:
            return None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        # FSDP2's shards and a pipeline's stages: one global norm
        return gradient_norm(self._parameters, self._clip or None, stages=self._stages, counted=self._counted)
