"""Parameter groups from the config: weight decay on matrices only, and per-group ``lr`` / ``weight_decay``.

    optim: {name: adamw, lr: 6.0e-4, weight_decay: 0.1}                  # decay on 2-D+ parameters only (the default)
    optim: {name: adamw, lr: 6.0e-4, weight_decay: 0.1, decay: all}      # every parameter, the rule of earlier releases
    optim:
      name: adamw
      lr: 3.0e-4
      weight_decay: 0.1
      groups:
        - {params: ["embed.*", "pos.*"], lr: 1.0e-4}                     # fnmatch patterns of parameter names
        - {params: ['re:^blocks\\.(0|1)\\.'], weight_decay: 0.0}        # or a regular expression after `re:`

:func:`param_groups` turns ``model.named_parameters()`` into the groups torch optimizers take: a
parameter joins the first ``optim.groups`` entry with a pattern matching its name (that entry's
``lr`` / ``weight_decay``, a given ``weight_decay`` applying whatever the shape); every other
parameter is decayed with ``optim.weight_decay`` when it has two or more dimensions (weight matrices,
embeddings), not when it has fewer (biases, LayerNorm weights), unless ``optim.decay: all``. Without
any weight decay and without groups the result is one group, exactly what the optimizer got before.

A checkpoint written before these groups existed holds one group; :func:`accept_one_group` makes the
optimizer take it as it was (one group, the parameters in model order) with one log line, so the
run resumes bitwise where it stopped instead of failing on the group count.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ddpkit.config.schema import OptimConfig
from ddpkit.errors import ConfigError

__all__ = ["param_groups", "optimizer_order", "accept_one_group", "merge_to_one_group"]

log = logging.getLogger(__name__)


def param_groups(named: Sequence[tuple[str | None, torch.Tensor]], cfg: OptimConfig) -> list[dict[str, Any]]:
    """The optimizer's groups for ``named`` parameters (names None when only tensors were given), in a fixed order:
    the decayed defaults, the undecayed defaults, then each ``optim.groups`` entry; empty groups are left out."""
    matchers = [_matchers(i, entry.params) for i, entry in enumerate(cfg.groups)]
    if matchers and any(name is None for name, _ in named):
        raise ConfigError(
            "optim.groups: selecting parameters by name needs the model, not its parameters: build the optimizer "
            "with ddpkit.training.build_optimizer(model, cfg), or drop optim.groups"
        )
    decayed = []
    plain = []
    chosen = [[] for _ in cfg.groups]
    used = [[False] * len(m) for m in matchers]
    for name, param in named:
        index = _first_match(name, matchers, used)
        if index is not None:
            chosen[index].append(param)
        elif cfg.decay == "all" or param.ndim >= 2:
            decayed.append(param)
        else:
            plain.append(param)
    _refuse_unused(cfg, used)
    # Decay or not makes no difference: one group in model order, as before the rule.
    if not cfg.weight_decay:
        ungrouped = {id(p) for p in decayed + plain}
        decayed = [p for _, p in named if id(p) in ungrouped]
        plain = []
    groups = [{"params": decayed, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    for entry, params in zip(cfg.groups, chosen):
        group = {
            "params": params,
            "weight_decay": cfg.weight_decay if entry.weight_decay is None else entry.weight_decay,
        }
        groups.append(group if entry.lr is None else {**group, "lr": entry.lr})
    return [g for g in groups if g["params"]]


def optimizer_order(model: nn.Module, cfg: OptimConfig) -> list[str]:
    """``model``'s parameter names in the order its optimizer holds them (group by group): a single-file
    checkpoint's optimizer state is keyed by that position, so a rank holding only some of the parameters (a
    pipeline's stages) finds its own in it."""
    names = {id(p): name for name, p in model.named_parameters()}
    groups = param_groups(list(model.named_parameters()), cfg)
    return [names[id(p)] for group in groups for p in group["params"]]


def _matchers(index: int, patterns: list[str]) -> list[Any]:
    if not patterns:
        raise ConfigError(
            f"optim.groups[{index}].params: the group selects no parameters; give name patterns, e.g. ['*.bias']"
        )
    out = []
    for pattern in patterns:
        text = pattern[3:] if pattern.startswith("re:") else fnmatch.translate(pattern)
        try:
            out.append(re.compile(text).search if pattern.startswith("re:") else re.compile(text).match)
        except re.error as exc:
            raise ConfigError(
                f"optim.groups[{index}].params: {pattern!r} is not a valid regular expression ({exc}); "
                "write a shell-style pattern without `re:`, or fix the expression"
            ) from None
    return out


def _first_match(name: str | None, matchers: list[list[Any]], used: list[list[bool]]) -> int | None:
    """Index of the first group whose pattern matches ``name`` (marking the pattern used), or None."""
    if name is None:
        return None
    for index, group in enumerate(matchers):
        for j, match in enumerate(group):
            if match(name):
                used[index][j] = True
                return index
    return None


def _refuse_unused(cfg: OptimConfig, used: list[list[bool]]) -> None:
    """A pattern that matched nothing is almost always a typo (``ln1.*`` for ``blocks.0.ln1.weight``): say so."""
    for index, flags in enumerate(used):
        for pattern, hit in zip(cfg.groups[index].params, flags):
            if not hit:
                raise ConfigError(
                    f"optim.groups[{index}].params: {pattern!r} matches no parameter that an earlier group did not "
                    "take; names look like model.named_parameters()'s, e.g. 'blocks.0.attn.qkv.weight' (use '*.qkv.*')"
                )


def accept_one_group(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Let ``optimizer`` load a one-group state dict (a checkpoint written before parameter groups) as one group.

    ``params`` are the parameters in model order, the order the old release gave its one group. The
    optimizer's groups are replaced by one group over them right before such a state loads, so every
    moment estimate lands on its own parameter and training continues exactly as it would have.
    """

    def regroup(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        groups = saved.get("param_groups", [])
        if len(groups) == 1 and len(groups[0]["params"]) == len(params):
            merge_to_one_group(opt, params)

    optimizer.register_load_state_dict_pre_hook(regroup)


def merge_to_one_group(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Make ``optimizer`` one group over ``params`` (model order) if it has several; True, with one warning, if it did.

    For a one-group optimizer state saved by an earlier release: the plain ``load_state_dict`` path calls it
    through :func:`accept_one_group`'s hook; a loader that maps states by parameter name (DCP's
    ``set_optimizer_state_dict``, :mod:`ddpkit.checkpoint.sharded`) calls it before loading.
    """
    if len(optimizer.param_groups) <= 1:
        return False
    # The hyperparameters are the saved ones.
    optimizer.param_groups = [{**optimizer.param_groups[0], "params": list(params)}]
    log.warning(
        "optimizer: the checkpoint holds one parameter group (written before optim.decay / optim.groups); "
        "resuming it as one group, as it was trained. A new run uses the configured groups"
    )
    return True
