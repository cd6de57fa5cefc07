"""LoRA: train a low-rank adapter on a frozen model (``model.lora``), with checkpoints of the adapter alone.

    model:
      name: gpt
      kwargs: {init_from: models/Qwen2.5-0.5B}
      lora: {r: 8, alpha: 16, dropout: 0.0, targets: [q_proj, v_proj]}     # or targets: all-linear

    model = apply_lora(build_model(cfg.model), cfg.model)    # before shard_model and the optimizer (the Trainer)
    merged = merge_lora(model)                               # plain nn.Linear layers again, W + alpha/r B A in fp32

Each target ``nn.Linear`` becomes a :class:`LoraLinear`: the same ``weight`` and ``bias`` (frozen,
under the same names), plus ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``; the output is
``x W^T + b + (alpha / r) * B(A(dropout(x)))``. ``A`` starts as ``nn.Linear``'s default (Kaiming
uniform, drawn by its name: the same in every layout, :func:`initialize_adapters`) and ``B`` at zero,
so the model starts as the base: peft's initialisation, names and arithmetic, so ``ddpkit export
--format peft`` is a renaming. Every other parameter is frozen
(``requires_grad=False``) before ``shard_model`` and the optimizer see the model, so DDP reduces,
FSDP2 shards and the optimizer keeps state for the adapter only (AdamW: 2 x its size).

Targets are matched as peft matches ``target_modules``: a name equal to a module's last name (or to
a dotted suffix of it); ``all-linear`` is every ``nn.Linear`` but the output layer (``head``). A name
that matches no linear layer is refused with the model's own linear names.

**Checkpoints hold the adapter.** The model's ``state_dict()`` leaves out the frozen parameters
(a state-dict hook; ``load_state_dict`` does not miss them), so a checkpoint, ``model.pt`` and a
memory snapshot hold the adapter, its optimizer state, and, as the model's extra state
(``lora_base._extra_state``), a fingerprint of the base taken before the adapter is added: for
ddpkit's own models, of what the base's weights come from (the files or the seed), so the base may be
built on the meta device and made a part a rank; for any other model, of every frozen tensor
(:mod:`ddpkit.models.lora_fingerprint`). Under a pipeline, each rank's stages save the same way
(:func:`adapter_only_parts`). The base itself comes from the builder at every start
(``init_from`` or a seeded initialisation). A checkpoint resumed on another base is refused naming
both (:class:`LoraBase`); a run resumes bitwise because the base is rebuilt identically.

A Hugging Face model (``transformers.PreTrainedModel``, e.g. ``examples/hf_causal_lm.py``) gets its
adapter from peft itself (``pip install 'ddpkit[peft]'``): :mod:`ddpkit.models.lora_peft`, with the
same keys, the same adapter-only checkpoints and the same fingerprint.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import skip_init

from ddpkit.config.lora_section import LoraConfig
from ddpkit.config.schema import ModelConfig
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.models.init_by_name import draw_init_seed, is_on_meta, keep_own_part, name_seed
from ddpkit.models.lora_fingerprint import WEIGHTS, base_fingerprint, fingerprint_base

__all__ = [
    "LoraLinear",
    "LoraBase",
    "apply_lora",
    "merge_lora",
    "base_fingerprint",
    "initialize_adapters",
    "lora_targets",
    "adapter_of",
    "adapter_only_parts",
]

log = logging.getLogger(__name__)

#: The output layer ``all-linear`` leaves out (peft leaves out the model's output embedding).
_OUTPUT_LAYERS = ("head", "lm_head")


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` plus a low-rank update: ``x W^T + b + scaling * lora_B(lora_A(dropout(x)))``."""

    def __init__(self, base: nn.Linear, *, r: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        # the base's own parameters, frozen, under the names they had
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.r = r
        self.alpha = alpha
        self.scaling = alpha / r
        self.lora_dropout = nn.Dropout(dropout)
        where = {"device": base.weight.device, "dtype": base.weight.dtype}
        # drawn by name afterwards (initialize_adapters): skip_init leaves them as allocated, drawing nothing
        self.lora_A = skip_init(nn.Linear, base.in_features, r, bias=False, **where)
        self.lora_B = skip_init(nn.Linear, r, base.out_features, bias=False, **where)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` of ``W + scaling * B @ A`` (computed in fp32, stored in the base's dtype)."""
        weight = self.weight.detach().float() + self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=weight.device)
        linear.weight = nn.Parameter(weight.to(self.weight.dtype))
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().clone())
        return linear


class LoraBase(nn.Module):
    """The base an adapter belongs to, kept in the model's state_dict (``lora_base._extra_state``) and checked on load.

    ``base`` names it for people (``init_from``'s directory, or the model's name and kwargs); ``fingerprint`` is
    its sha256 (ddpkit.models.lora_fingerprint), of its ``fingerprint_of`` (``source`` or ``weights``); ``config``
    the adapter's r, alpha and targets. ``adapter_seed``: the seed the adapter's A matrices are drawn from by name
    (:func:`initialize_adapters`; not saved: a checkpoint holds the adapter itself)."""

    def __init__(
        self, *, base: str, fingerprint: str, config: dict[str, Any], fingerprint_of: str = WEIGHTS, adapter_seed: int
    ):
        super().__init__()
        self.base = base
        self.fingerprint = fingerprint
        self.fingerprint_of = fingerprint_of
        self.config = config
        self.adapter_seed = adapter_seed

    def get_extra_state(self) -> dict[str, Any]:
        fingerprint = {"fingerprint": self.fingerprint, "fingerprint_of": self.fingerprint_of}
        return {"base": self.base, **fingerprint, **self.config}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        # an adapter saved before ddpkit fingerprinted its own models by their source carries no fingerprint_of
        theirs = state.get("fingerprint_of", WEIGHTS)
        if theirs != self.fingerprint_of:
            log.warning(
                "lora: the checkpoint's adapter carries a fingerprint of its base's %s (an earlier ddpkit), this run "
                "has one of its base's %s: the two cannot be compared, so the base %s is not checked",
                theirs,
                self.fingerprint_of,
                self.base,
            )
        elif state["fingerprint"] != self.fingerprint:
            raise CheckpointError(
                f"the checkpoint's LoRA adapter was trained on the base {state['base']} (sha256 of its {theirs} "
                f"{state['fingerprint'][:16]}), but this run's base is {self.base} (sha256 of its {theirs} "
                f"{self.fingerprint[:16]}); resume it on the base it was trained on, or start a new run "
                "(checkpoint.resume=none)"
            )
        saved = {key: state.get(key) for key in self.config}
        if saved != self.config:
            raise CheckpointError(
                f"the checkpoint's LoRA adapter is {saved}, this run's model.lora is {self.config}; resume with "
                "the adapter's settings, or start a new run (checkpoint.resume=none)"
            )


def initialize_adapters(module: nn.Module, *, seed: int) -> None:
    """Every adapter of ``module`` (the whole model, or any part of it under its names) at its start: ``lora_A``
    as ``nn.Linear``'s default (Kaiming uniform, peft's), drawn whole from a generator seeded by ``seed`` and its
    name, ``lora_B`` zero. A rank holding a shard (a tensor plan's, FSDP2's) keeps its slice of the whole draw, so
    the adapter starts the same in every layout, built whole or on the meta device."""
    with torch.no_grad():
        for name, owner in module.named_modules():
            if not isinstance(owner, LoraLinear):
                continue
            key = f"{name}.lora_A.weight" if name else "lora_A.weight"
            whole = torch.empty(tuple(owner.lora_A.weight.shape))
            generator = torch.Generator().manual_seed(name_seed(seed, key))
            nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
            keep_own_part(owner.lora_A.weight, whole)
            owner.lora_B.weight.zero_()


def initialize_adapters_of(part: nn.Module, model: nn.Module) -> None:
    """:func:`initialize_adapters` on ``part`` of a LoRA ``model`` made from the meta device (no-op without LoRA)."""
    base = getattr(model, "lora_base", None)
    if isinstance(base, LoraBase):
        initialize_adapters(part, seed=base.adapter_seed)


def lora_targets(model: nn.Module, targets: list[str] | str) -> list[str]:
    """The names of the linear layers ``targets`` selects (peft's matching rule; see the module docstring)."""
    linear = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    if targets == "all-linear":
        return [name for name in linear if name.rsplit(".", 1)[-1] not in _OUTPUT_LAYERS]
    chosen = []
    modules = dict(model.named_modules())
    for target in targets:
        matches = [name for name in modules if name == target or name.endswith("." + target)]
        if not matches:
            known = sorted({name.rsplit(".", 1)[-1] for name in linear})
            raise ConfigError(
                f"model.lora.targets: {target!r} names no module of the model; its linear layers are "
                f"{', '.join(known)} (or targets: all-linear)"
            )
        wrong = [name for name in matches if type(modules[name]) is not nn.Linear]
        if wrong:
            raise ConfigError(
                f"model.lora.targets: {target!r} names {wrong[0]}, a {type(modules[wrong[0]]).__name__}, not an "
                "nn.Linear; name linear layers (e.g. q_proj, v_proj) or use targets: all-linear"
            )
        chosen += [name for name in matches if name not in chosen]
    return chosen


def describe_base(model_cfg: ModelConfig) -> str:
    """How a message names the base: ``init_from``'s directory, else the model and its kwargs."""
    kwargs = model_cfg.kwargs or {}
    for key in ("init_from", "pretrained"):
        if kwargs.get(key):
            return str(kwargs[key])
    shown = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
    return f"{model_cfg.name or 'the model'}({shown})"


def apply_lora(model: nn.Module, model_cfg: ModelConfig, *, precision: str = "fp32") -> nn.Module:
    """``model`` with ``model_cfg.lora``'s adapter and its base frozen (the model itself when ``lora`` is null).

    ``precision``: ``train.precision``; under ``bf16`` the frozen base is stored in bf16 (half its fp32 bytes: the
    autocast computes in bf16 anyway and no update ever touches it), the adapter stays fp32. The fingerprint is the
    base's as built, so a checkpoint resumes under either precision. Call it on the bare model before
    ``shard_model`` and the optimizer (the Trainer does)."""
    cfg = model_cfg.lora
    if cfg is None:
        return model
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout: expected a probability in [0, 1), got {cfg.dropout!r}")
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        raise ConfigError(
            f"model.lora: the model is an {type(model).__name__}, whose children are its layers; give it a module "
            "of its own around them (a LoRA model carries its base's fingerprint as a child, lora_base)"
        )
    # before the adapter exists and before any cast: the base as built, whatever the precision
    fingerprint, fingerprint_of = fingerprint_base(model)
    # ddpkit's models: the seed their weights are drawn from, so the adapter starts alike whether built whole or not
    seed = getattr(model, "init_seed", None)
    adapter_seed = draw_init_seed() if seed is None else int(seed)
    model, names = _add_adapters(model, cfg)
    settings = {"r": cfg.r, "alpha": cfg.alpha, "targets": sorted({n.rsplit(".", 1)[-1] for n in names})}
    model.lora_base = LoraBase(
        base=describe_base(model_cfg),
        fingerprint=fingerprint,
        fingerprint_of=fingerprint_of,
        config=settings,
        adapter_seed=adapter_seed,
    )
    # on the meta device each rank draws the adapter's part it holds when it is made (ddpkit.parallel.meta_build)
    if not _is_hugging_face(model) and not is_on_meta(model):
        initialize_adapters(model, seed=adapter_seed)
    _keep_the_adapter_only(model)
    if precision in _FROZEN_DTYPE:
        _store_frozen_as(model, _FROZEN_DTYPE[precision])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "lora: r=%d, alpha=%g on %d linear layers (%s): %s trainable parameters of %s (%.3f%%); base sha256 %s",
        cfg.r,
        cfg.alpha,
        len(names),
        ", ".join(settings["targets"]),
        f"{trainable:,}",
        f"{total:,}",
        100 * trainable / total,
        fingerprint[:16],
    )
    return model


def _add_adapters(model: nn.Module, cfg: LoraConfig) -> tuple[nn.Module, list[str]]:
    """``model`` with its base frozen and an adapter on each target (peft's for a Hugging Face model, else a
    :class:`LoraLinear` in place of each target ``nn.Linear``), and the targets' names."""
    if _is_hugging_face(model):
        from ddpkit.models.lora_peft import apply_peft

        return apply_peft(model, cfg)
    names = lora_targets(model, cfg.targets)
    model.requires_grad_(False)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, LoraLinear(getattr(owner, leaf), r=cfg.r, alpha=cfg.alpha, dropout=cfg.dropout))
    return model, names


#: The dtype the frozen base is kept in, by ``train.precision`` (fp32 and fp16 keep the base as built).
_FROZEN_DTYPE = {"bf16": torch.bfloat16}


def _store_frozen_as(model: nn.Module, dtype: torch.dtype) -> None:
    """Every frozen floating-point parameter cast to ``dtype`` in place, one at a time (a tied one once): the model
    is never held twice, only one tensor's two copies at once."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _is_hugging_face(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _keep_the_adapter_only(model: nn.Module) -> None:
    """``state_dict()`` without the frozen parameters; ``load_state_dict`` does not count them as missing."""
    # every name of a frozen tensor: a tied output layer is in the state_dict under both of its names
    frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}

    def drop_frozen(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name in frozen:
            state.pop(prefix + name, None)

    def forgive_frozen(module: nn.Module, incompatible: Any) -> None:
        # keys arrive with the prefixes of whatever load_state_dict was called on (DDP's module., compile's _orig_mod.)
        missing = [key for key in incompatible.missing_keys if _bare(key) not in frozen]
        # a state that carries the base itself (a pipeline stage's checkpoint holds its whole part) needs no fingerprint
        if len(missing) == len(incompatible.missing_keys):
            missing = [key for key in missing if _bare(key) != "lora_base._extra_state"]
        incompatible.missing_keys[:] = missing

    model._ddpkit_lora_hooks = (
        model.register_state_dict_post_hook(drop_frozen),
        model.register_load_state_dict_post_hook(forgive_frozen),
    )


def adapter_only_parts(parts: nn.Module, model: nn.Module) -> nn.Module:
    """``parts`` of a LoRA ``model`` (a pipeline rank's stages) saving as the whole model saves: the adapter and the
    base's fingerprint, no frozen tensor; ``parts`` unchanged for a model without an adapter.

    The stages are cut from the model's children, and ``lora_base`` (the fingerprint) is no stage's: every rank's
    parts get it, so each stage's checkpoint is checked against the base it loads onto, and ``model.pt`` holds it.
    """
    base = getattr(model, "lora_base", None)
    if not isinstance(base, LoraBase):
        return parts
    parts.lora_base = base
    _keep_the_adapter_only(parts)
    return parts


def _bare(key: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        while key.startswith(prefix):
            key = key[len(prefix) :]
    return key


def adapter_of(weights: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """``(tensors, base)``: the adapter's tensors of a LoRA model's state_dict and its :class:`LoraBase` state."""
    base = next((value for key, value in weights.items() if key.endswith("lora_base._extra_state")), None)
    tensors = {key: value for key, value in weights.items() if ".lora_A." in key or ".lora_B." in key}
    return tensors, base


def merge_lora(model: nn.Module) -> nn.Module:
    """``model`` with every :class:`LoraLinear` replaced by its merged ``nn.Linear`` and no ``lora_base``."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLinear):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, module.merged())
    if hasattr(model, "lora_base"):
        del model.lora_base
    # the merged model is a plain model again: every parameter in its state_dict
    for hook in getattr(model, "_ddpkit_lora_hooks", ()):
        hook.remove()
    return model.requires_grad_(True)
