"""Activation checkpointing: each block recomputes its activations in the backward pass instead of keeping them.

    train: {activation_checkpointing: true}              # the gpt's GPTBlocks; a Hugging Face model's own switch
    train: {activation_checkpointing: [MyBlock, Layer]}  # the module classes to checkpoint, by class name

A block's forward runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: only
its inputs are kept, and the backward pass runs the block's forward again to rebuild what it needs.
Memory for activations falls from every block's intermediates to about one block's, for about one
more forward pass a step. The non-reentrant variant is the one that works under DDP (the reentrant
one fails with "Expected to mark a variable ready only once", accelerate#389), FSDP2 and
``torch.compile``, and gives the same gradients: the loss and the weights equal the run without it
within float rounding (bitwise on the CPU in ``tests/test_activation_checkpointing.py``).

How: the chosen modules' ``forward`` is replaced on the instance, so parameter names, checkpoints and
FSDP2's per-block units stay exactly as without it (a wrapper module would add a name to every
parameter); FSDP2's gather and free hooks stay outside the checkpoint, as torchtitan orders them.
Without gradients (evaluation) the block runs plainly. A Hugging Face ``PreTrainedModel`` is switched
through its own ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``
(``activation_checkpointing_enable`` in transformers 5).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddpkit.errors import ConfigError

__all__ = ["apply_activation_checkpointing", "DEFAULT_BLOCKS"]

log = logging.getLogger("ddpkit")
#: What ``activation_checkpointing: true`` checkpoints in a model that is not a Hugging Face one.
DEFAULT_BLOCKS = ("GPTBlock", "LlamaBlock")


def apply_activation_checkpointing(model: nn.Module, setting: bool | Sequence[str] | None) -> int:
    """Checkpoint ``model``'s blocks as ``train.activation_checkpointing`` says; return how many modules.

    ``false``/``None``: nothing. ``true``: a Hugging Face model through its own switch, else every
    :data:`DEFAULT_BLOCKS` module. A list: every module whose class name is in it (an outer match
    covers the modules inside it). Call it on the bare model, before DDP wraps it or compile traces it.

    Raises:
        ConfigError: no module of the named classes is in the model.
    """
    if not setting:
        return 0
    # Transformers 5's own switch.
    if setting is True and callable(getattr(model, "activation_checkpointing_enable", None)):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        log.info("activation checkpointing: %s's own activation checkpointing (non-reentrant)", type(model).__name__)
        return 1
    # Transformers 4's name for it.
    if setting is True and callable(getattr(model, "gradient_checkpointing_enable", None)):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        log.info("activation checkpointing: %s's own gradient checkpointing (non-reentrant)", type(model).__name__)
        return 1
    names = set(DEFAULT_BLOCKS if setting is True else setting)
    chosen = _outermost(model, names)
    if not chosen:
        classes = sorted({_class_name(m) for m in model.modules()})
        repeated = [_class_name(c[0]) for c in model.modules() if isinstance(c, nn.ModuleList) and len(c)]
        raise ConfigError(
            f"train.activation_checkpointing: the model has no module of class "
            f"{', '.join(sorted(names))}; name the block classes to checkpoint, e.g. "
            f"[{(repeated or classes)[0]}] (its classes: {', '.join(classes)})"
        )
    for module in chosen:
        # Once only: a second call leaves a module already checkpointed as it is.
        if getattr(module.__dict__.get("forward"), "__func__", None) is not _checkpointed_forward:
            # Bound to the instance: deepcopy rebinds it to the copy.
            module.forward = types.MethodType(_checkpointed_forward, module)
    log.info(
        "activation checkpointing: %d %s modules recompute their activations in the backward pass",
        len(chosen),
        "/".join(sorted({type(m).__name__ for m in chosen})),
    )
    return len(chosen)


def _outermost(model: nn.Module, names: set[str]) -> list[nn.Module]:
    """The modules whose class name is in ``names``, without those inside another such module."""
    chosen: list[nn.Module] = []
    inside: set[int] = set()
    # Parents come before their children.
    for module in model.modules():
        if id(module) in inside or _class_name(module) not in names:
            continue
        chosen.append(module)
        inside.update(id(m) for m in module.modules())
    return chosen


def _class_name(module: nn.Module) -> str:
    """The user's class name, also after FSDP2 swapped in its subclass (``FSDPGPTBlock``, based on ``GPTBlock``)."""
    cls = type(module)
    if cls.__name__.startswith("FSDP"):
        cls = next((base for base in cls.__mro__[1:] if base.__name__ == cls.__name__[4:]), cls)
    return cls.__name__


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The class's own ``forward``, under a non-reentrant checkpoint while gradients are recorded."""
    forward = type(self).forward
    # Evaluation: nothing would be kept anyway.
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
