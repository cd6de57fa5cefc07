"""A model built on the meta device, then made and initialised only where a rank holds it.

    whole = build_on_meta(trainer.build_model, cfg)     # shapes only; today's whole build where it cannot be
    ...                                                  # the tensor plan, the pipeline cut, fully_shard: on meta
    part = materialize(part, whole, device)              # to_empty on the device, then whole.init_weights(part):
                                                         # drawn by name, or read from init_from's files

torchtitan's order: every rank builds the model on the meta device (no memory, nothing drawn), splits it there, and
only then makes the parameters and shards it holds, directly on its device, and initialises them. ddpkit's models
initialise by parameter name (:mod:`ddpkit.models.init_by_name`), so the weights are the same bits in every layout
and as a world of one builds them.

Which models: those that can initialise a part of themselves, ``init_weights(parts)`` (ddpkit's ``gpt`` and the
Llama family), built by the Trainer's own ``build_model`` from the config, or by a subclass's ``build_model`` that
opts in (``Trainer.build_on_meta = True``: a build that loads or reads weights would lose them on meta, silently).
Another model is built whole on every rank as before, and the start-up log says so in one line, with the fix.

``model.kwargs.init_from`` (a Hugging Face directory) is on meta too: the build only checks the files (every tensor
found, its shape fitting, none truncated; the same verdict on every rank), and ``init_weights(parts)`` reads the
tensors and slices the part holds instead of drawing them (:mod:`ddpkit.models.hf_slices`). ``model.lora`` on
ddpkit's models is on meta too: the base is fingerprinted by its source (the files, or the seed), the adapters
drawn by name where they are made (:mod:`ddpkit.models.lora`, :mod:`ddpkit.models.lora_fingerprint`). A LoRA base
of another model is built whole: its fingerprint hashes its weights.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch
from torch import nn

from ddpkit.config.schema import Config
from ddpkit.models.init_by_name import retie, tied_names
from ddpkit.models.lora import initialize_adapters_of
from ddpkit.models.lora_fingerprint import fingerprinted_by_source

__all__ = ["build_on_meta", "materialize", "initialises_parts"]

log = logging.getLogger("ddpkit")


def build_on_meta(
    build: Callable[[], nn.Module], config: Config, *, custom: bool = False, splits: bool = True
) -> nn.Module:
    """``build()`` under ``torch.device("meta")`` when the model can initialise its parts, else ``build()``.

    ``splits``: the layout splits the model over ranks (a pipeline, a tensor plan, fsdp2); where it does not (ddp,
    zero1: every rank holds the whole model anyway) a model built whole is logged without a fix to make.

    ``custom``: ``build`` is a Trainer's own ``build_model``, not opted in (``Trainer.build_on_meta``): built whole.
    Such a build may load or read weights (``load_state_dict``, a snapshot of the initial state), which on the meta
    device would be lost without an error; the opt-in says it does neither.
    """
    if custom:
        why = (
            "Trainer.build_model is overridden; set build_on_meta = True on the Trainer if it neither loads nor "
            "reads weights"
        )
    else:
        model, why = _on_meta(build)
        if model is not None and config.model.lora is not None and not fingerprinted_by_source(model):
            model, why = None, "model.lora: this base is fingerprinted from its weights, which need real tensors"
        if model is not None:
            log.info("model: built on the meta device; each rank makes and initialises only what it holds")
            return model
    if splits:
        log.info("model: built whole on every rank (%s)", why)
    else:
        log.info("model: built whole on every rank, as this layout holds it (parallel.mode=%s)", config.parallel.mode)
    return build()


def _on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module | None, str | None]:
    """``build()`` on the meta device, or None and why not (the model cannot initialise its parts, or its build
    needs real tensors: a model that moves its halves to devices itself)."""
    # The meta attempt leaves torch's CPU generator as it found it: a retry on the CPU draws the same weights.
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                model = build()
        except Exception as error:
            return None, f"its build needs real tensors ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    if not initialises_parts(model):
        fix = "give it init_weights(parts) that initialises any part of it by parameter name (docs/modes.md)"
        return None, f"{type(model).__name__} has no init_weights(parts); {fix}"
    return model, None


def initialises_parts(model: nn.Module) -> bool:
    """Whether ``model`` has ``init_weights(parts)``: an argument named ``parts``, a part of it under its names.

    The name is the promise: an ``init_weights(m)`` written for ``model.apply`` (one module's own weights) or
    timm's ``init_weights(mode)`` would leave a made part's weights as ``to_empty`` left them, uninitialised.
    """
    init = getattr(model, "init_weights", None)
    if not callable(init):
        return False
    try:
        return "parts" in inspect.signature(init).parameters
    except (TypeError, ValueError):
        return False


def materialize(part: nn.Module, whole: nn.Module, device: torch.device) -> nn.Module:
    """``part`` of the meta-built ``whole``, made on ``device`` (its own shards only) and initialised by name."""
    tied = tied_names(part)
    part.to_empty(device=device)
    # to_empty gives each name its own tensor: a tied head is one parameter again
    retie(part, tied)
    whole.init_weights(parts=part)
    # a LoRA adapter's parameters: drawn by its own rule (ddpkit.models.lora), after the base's
    initialize_adapters_of(part, whole)
    return part
