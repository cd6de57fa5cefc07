"""Initialisation by parameter name: the same initial weights whatever part of the model a rank holds.

    seed = draw_init_seed()                                   # in the model's constructor, before any submodule
    initialize(part, seed=seed, residuals={"blocks.0.proj"}, depth=4)   # every parameter of ``part`` by its name

Each parameter is drawn whole, on the CPU in fp32, from its own generator, seeded by the model's seed and the
parameter's name (GPT-2's scheme: normal(0, 0.02) weights, zero biases, unit norm weights, and the projections that
add to the residual stream normal(0, 0.02 / sqrt(2 * depth))). A rank that holds a shard (a tensor plan's DTensor,
FSDP2's rows, both) keeps its slice of that whole tensor (``distribute_tensor`` with ``src_data_rank=None``: each
rank cuts its own, no collective); a rank that holds a pipeline stage draws only the stage's parameters, under the
whole model's names. So the weights are the same bits in a world of one, in every layout and at every world size,
and in a hand-written loop that builds the same class under the same seed. Only one whole tensor exists at a time.

The seed is drawn from torch's default generator as the first thing the model's constructor does, so a model built
on the meta device (where nothing is drawn) and one built on the CPU under the same ``torch.manual_seed`` agree.
Buffers (RoPE's frequencies) are not initialised but recomputed: every module with buffers of its own and a
``reset_parameters`` method gets it called.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch
from torch import nn

__all__ = [
    "draw_init_seed",
    "initialize",
    "initialize_or_read",
    "recompute_buffers",
    "is_on_meta",
    "tied_names",
    "retie",
    "keep_own_part",
    "name_seed",
    "is_adapter",
]

#: The modules LoRA adds beside a linear layer (ddpkit.models.lora): not the base's, drawn by the adapter's own rule.
ADAPTER_MODULES = ("lora_A", "lora_B")

#: GPT-2's standard deviation for every weight drawn from a normal distribution.
STD = 0.02


def draw_init_seed() -> int:
    """One 63-bit seed from torch's default CPU generator (on the CPU even inside ``torch.device("meta")``)."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64, device="cpu"))


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` belongs to a LoRA adapter (``blocks.0.attn.q.lora_A.weight``), not to the base."""
    return any(part in ADAPTER_MODULES for part in name.split("."))


def is_on_meta(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are on the meta device (shapes only, no memory)."""
    return any(p.is_meta for p in module.parameters())


def initialize(module: nn.Module, *, seed: int, residuals: Iterable[str], depth: int) -> None:
    """Every parameter of ``module`` drawn by its name; ``residuals``: the module names of the residual projections.

    ``module`` is the whole model or any part of it that keeps the whole model's names (a pipeline's held parts,
    a model split by a tensor plan or sharded by FSDP2). Buffers are recomputed. A LoRA adapter's parameters are
    left to its own rule (ddpkit.models.lora.initialize_adapters).
    """
    residual = set(residuals)
    # A tied parameter is drawn once, under its first name (``embed.weight``, not the head's): as the whole model
    # names it, and as a pipeline's last stage, which keeps ``embed`` beside ``head``, names it too.
    seen: set[int] = set()
    for module_name, owner in module.named_modules():
        for key, param in owner.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{key}" if module_name else key
            if is_adapter(name):
                continue
            std = STD / math.sqrt(2 * depth) if module_name in residual else STD
            if _drawn_in_place(param):
                # A whole fp32 CPU parameter takes the draw itself: the same bits, no second copy of it.
                with torch.no_grad():
                    _draw_into(param, owner, key, name=name, seed=seed, std=std)
                continue
            whole = torch.empty(tuple(param.shape))
            _draw_into(whole, owner, key, name=name, seed=seed, std=std)
            keep_own_part(param, whole)
    recompute_buffers(module)


def initialize_or_read(model: nn.Module, parts: nn.Module | None, *, residuals: Iterable[str]) -> None:
    """What ddpkit's models' ``init_weights(parts)`` does: ``parts`` (or the whole ``model``) drawn by name from the
    model's ``init_seed``, or, with ``init_from``, the directory's weights (``model.weights_from``: only the slices
    ``parts`` holds are read, ddpkit.models.hf_slices), the buffers recomputed either way."""
    target = model if parts is None else parts
    if model.weights_from is None:
        initialize(target, seed=model.init_seed, residuals=residuals, depth=model.depth)
        return
    model.weights_from.fill(target)
    recompute_buffers(target)


def recompute_buffers(module: nn.Module) -> None:
    """Each module of ``module`` with buffers of its own (RoPE's frequencies) recomputes them (``reset_parameters``):
    ``to_empty`` left them uninitialised."""
    for owner in module.modules():
        if dict(owner.named_buffers(recurse=False)) and callable(getattr(owner, "reset_parameters", None)):
            owner.reset_parameters()


def _drawn_in_place(param: torch.Tensor) -> bool:
    """Whether ``param`` is whole, fp32, contiguous and on the CPU: drawn into directly."""
    plain = not hasattr(param, "device_mesh")
    return plain and param.device.type == "cpu" and param.dtype == torch.float32 and param.is_contiguous()


def _draw_into(out: torch.Tensor, owner: nn.Module, key: str, *, name: str, seed: int, std: float) -> None:
    """The whole initial value of parameter ``key`` of ``owner`` (named ``name`` in the whole model), into ``out``
    (a whole fp32 CPU tensor of its shape)."""
    if key == "bias":
        out.zero_()
    elif not isinstance(owner, (nn.Linear, nn.Embedding)):
        # a norm's weight (LayerNorm, RMSNorm)
        out.fill_(1.0)
    else:
        out.normal_(0.0, std, generator=torch.Generator().manual_seed(name_seed(seed, name)))


def keep_own_part(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this rank's part of ``whole`` into ``param`` (a plain tensor, or a DTensor's local shard)."""
    with torch.no_grad():
        if hasattr(param, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            local = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(whole)


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed of its own for each parameter name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def tied_names(module: nn.Module) -> list[list[str]]:
    """The names of each parameter held under several names (a head tied to the embedding), longer than one."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(module: nn.Module, tied: list[list[str]]) -> None:
    """Make each group of ``tied`` names one parameter again (``to_empty`` gives each name its own tensor)."""
    for names in tied:
        shared = module.get_parameter(names[0])
        for name in names[1:]:
            owner_name, _, key = name.rpartition(".")
            setattr(module.get_submodule(owner_name), key, shared)
