"""Loss weighted by tokens (``train.loss_normalization: tokens``), exact for any split of a global batch.

    def training_step(self, batch):                      # with train.loss_normalization: tokens
        logits = self.model(batch["input_ids"])
        loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
        return loss_sum, (batch["labels"] != -100).sum()  # (the sum over this micro-batch's tokens, their count)

Why: with sequences of different lengths, averaging each micro-batch's mean loss over micro-batches
and ranks weights a token of a short batch more than a token of a long one, so the update depends
on how the global batch was split (the bug torchtitan fixed in PR #2206 and Hugging Face's Trainer
in transformers#37766). The update must be the gradient of ``sum over every token / global token count``.

How, with one all-reduce per optimizer step and none per micro-batch: each micro-batch backpropagates
its plain ``loss_sum`` and adds its token count to a device tensor; before clipping, the count is
summed over ranks and every gradient is multiplied by ``world_size / global_count`` (DDP and FSDP2
have already averaged the gradients over ranks, i.e. divided by ``world_size``). No host sync: the
factor stays on the device. The logged ``train_loss`` is the same token-weighted mean.
"""

from __future__ import annotations

from typing import Any

import torch

from ddpkit.config.train_sections import TrainConfig
from ddpkit.distributed.collectives import all_reduce_sum
from ddpkit.errors import ConfigError

__all__ = ["TokenCount", "split_loss"]


def split_loss(result: Any, *, normalization: str, owner: type) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``training_step``'s return as ``(loss, n_tokens)`` (``n_tokens`` None under ``mean``), or a clear error."""
    if normalization == "tokens":
        if not (isinstance(result, (tuple, list)) and len(result) == 2 and _is_scalar(result[0])):
            raise ConfigError(
                f"train.loss_normalization=tokens: {owner.__name__}.training_step "
                "must return (loss_sum, n_tokens), the summed "
                "loss of the micro-batch's tokens and how many there are, "
                "e.g. `return F.cross_entropy(logits.flatten(0, 1), "
                "labels.flatten(), ignore_index=-100, reduction='sum'), "
                f"(labels != -100).sum()`; it returned {_describe(result)}"
            )
        loss, tokens = result
        return loss, torch.as_tensor(tokens, device=loss.device)
    if not _is_scalar(result):
        hint = ""
        if isinstance(result, (tuple, list)):
            hint = " (a (loss_sum, n_tokens) pair needs train.loss_normalization=tokens)"
        raise ConfigError(
            f"{owner.__name__}.training_step must return a scalar loss tensor, got {_describe(result)}{hint}"
        )
    return result, None


class TokenCount:
    """The tokens of the current optimizer step on this rank, and the gradient scaling they decide."""

    def __init__(
        self, parameters: list[torch.nn.Parameter], *, world_size: int, device: torch.device, group: Any = None
    ):
        self._parameters = parameters
        #: The data-parallel replicas: their count and group (None: every rank). A pipeline's stages are not
        #: replicas: each of them counts the same batch.
        self._world_size = world_size
        self._group = group
        #: This rank, this step.
        self._step = torch.zeros((), dtype=torch.float64, device=device)
        #: Every rank, since the last read.
        self.total = torch.zeros((), dtype=torch.float64, device=device)

    @classmethod
    def for_run(
        cls, model: torch.nn.Module, train: TrainConfig, *, device: torch.device, world_size: int, group: Any = None
    ) -> TokenCount | None:
        """The count of a run with ``train.loss_normalization: tokens``; None under ``mean``. ``world_size`` and
        ``group``: the data-parallel replicas'."""
        if train.loss_normalization != "tokens":
            return None
        return cls(list(model.parameters()), world_size=world_size, device=device, group=group)

    def add(self, n_tokens: torch.Tensor) -> None:
        """One micro-batch's token count (a device add, no sync)."""
        self._step += n_tokens

    def scale_gradients(self) -> None:
        """Make the accumulated gradients those of ``sum of losses / global token count`` (one all-reduce)."""
        count = all_reduce_sum(self._step.clone(), group=self._group)
        self._step.zero_()
        self.total += count
        grads = [p.grad for p in self._parameters if p.grad is not None]
        # An all-padding global batch (count 0) has no loss to learn from: its gradients stay zero.
        if grads:
            factor = (self._world_size / count.clamp(min=1)).to(grads[0].dtype)
            torch._foreach_mul_(grads, factor)

    def read_total(self) -> float:
        """Tokens seen by every rank since the last read (a host read, at log time only)."""
        value = float(self.total)
        self.total = torch.zeros_like(self.total)
        return value


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r:.60}"
