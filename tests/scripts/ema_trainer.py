r"""A Trainer subclass that adds its own state to every checkpoint: an EMA copy of the weights and a counter.

    KILL_RANK=1 KILL_AT_STEP=5 ddpkit run CONFIG --nproc-per-node 2 --max-restarts 1 \
        --script tests/scripts/ema_trainer.py

``KILL_RANK`` / ``KILL_AT_STEP``: that rank SIGKILLs itself after that optimizer step, in the first attempt
only. At the end rank 0 writes ``<run.output_dir>/ema.pt``: the EMA weights and the counter, for the test
to compare with an uninterrupted run's, bitwise.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

import ddpkit


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter as one plain tensor (FSDP2's shards gathered: a collective, so every rank calls it)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class EMA:
    """An exponential moving average of the model's weights, kept as plain tensors."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9):
        self.decay = decay
        self.shadow = {name: _whole(p.detach()).clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for name, p in model.named_parameters():
            self.shadow[name].mul_(self.decay).add_(_whole(p.detach()), alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = {name: tensor.clone() for name, tensor in state["shadow"].items()}


class Counter:
    """How many optimizer steps this run took, across restarts."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = int(state["value"])


class EmaTrainer(ddpkit.Trainer):
    def checkpoint_parts(self) -> dict[str, Any]:
        self.ema, self.counter = EMA(self.unwrapped_model), Counter()
        return {"ema": self.ema, "steps_counted": self.counter}

    def on_step_end(self, step: int) -> None:
        self.ema.update(self.unwrapped_model)
        self.counter.value += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (
            first_attempt
            and str(self.rank) == os.environ.get("KILL_RANK")
            and str(step) == os.environ.get("KILL_AT_STEP")
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_end(self, metrics: dict[str, float]) -> None:
        if self.is_main:
            torch.save({"ema": self.ema.shadow, "count": self.counter.value}, self.output_dir / "ema.pt")


if __name__ == "__main__":
    EmaTrainer.main()
