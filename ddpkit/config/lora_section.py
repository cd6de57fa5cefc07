"""The ``model.lora`` config section: train a low-rank adapter instead of the whole model (LoRA).

    model:
      name: gpt
      kwargs: {init_from: models/Qwen2.5-0.5B}
      lora: {r: 8, alpha: 16, dropout: 0.0, targets: [q_proj, v_proj]}      # or targets: all-linear

Behaviour lives in :mod:`ddpkit.models.lora`: the adapter is added and every other parameter
frozen before the ddp / zero1 / fsdp2 wrap; checkpoints hold the adapter, its optimizer state and
a fingerprint of the base weights. The keys are peft's (``r``, ``lora_alpha`` as ``alpha``,
``lora_dropout`` as ``dropout``, ``target_modules`` as ``targets``), and so are the target names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ddpkit.config.fields import option

__all__ = ["LoraConfig"]


@dataclass(frozen=True)
class LoraConfig:
    """A LoRA adapter on the model's linear layers: ``W x + (alpha / r) B A x``, only ``A`` and ``B`` trained."""

    r: int = option(8, "The adapter's rank: `A` is `[r, in]`, `B` is `[out, r]`.", ge=1)
    alpha: float = option(16.0, "The update is scaled by `alpha / r` (peft's `lora_alpha`).", gt=0)
    dropout: float = option(0.0, "Dropout on the adapter's input (peft's `lora_dropout`), in [0, 1).", ge=0)
    targets: list[str] | Literal["all-linear"] = option(
        factory=lambda: ["q_proj", "v_proj"],
        doc="The linear layers that get an adapter, by their last name (peft's `target_modules`: `q_proj`, `k_proj`, "
        "`v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj` in the Llama family), or `all-linear`: every "
        "linear layer but the output layer.",
    )
