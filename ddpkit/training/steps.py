"""The Trainer's built-in ``training_step`` and ``validation_step``: cross-entropy for classifiers
(logits ``[B, C]``) and for language models (logits ``[B, T, V]``, one loss per token).

    loss = training_step(model, (x, y), normalization="mean")           # a scalar: the mean over samples or tokens
    loss_sum, n_tokens = training_step(model, (x, y), normalization="tokens")
    metrics = validation_step(model, (x, y))    # {"loss": ..., "accuracy": ...}: one value per sample, or per token

For a language model the targets are token ids ``[B, T]`` (positions to skip hold ``-100``, as in
torch's and Hugging Face's ``ignore_index``), and validation returns one loss per counted token,
so the validation loss is the exact token-weighted mean over the whole validation set on any world
size (:mod:`ddpkit.training.metrics`). Under ``train.loss_normalization: tokens`` a classifier's
sample counts as one token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

# Targets with this value carry no loss (padding, prompt tokens): torch's default ``ignore_index``, defined where
# the token files make them.
from ddpkit.data.tokens import IGNORE_INDEX

__all__ = ["training_step", "validation_step", "loss_of_output", "IGNORE_INDEX"]


def training_step(
    model: torch.nn.Module, batch: Any, *, normalization: str
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch ``(x, y)``: its mean, or ``(sum, count)`` under ``normalization="tokens"``."""
    x, y = batch
    logits = model(x)
    return _cross_entropy(logits, y, normalization=normalization)


def loss_of_output(output: torch.Tensor, target: torch.Tensor, *, normalization: str) -> torch.Tensor:
    """A pipeline's last stage: the loss of one microbatch's ``output`` (the mean, or the token sum under
    ``tokens``, whose count the pipeline step takes from the targets itself)."""
    loss = _cross_entropy(output, target, normalization=normalization)
    return loss[0] if isinstance(loss, tuple) else loss


def _cross_entropy(
    logits: torch.Tensor, y: torch.Tensor, *, normalization: str
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # [B, T, V]: every position predicts the next token.
    if logits.dim() == 3:
        logits = logits.flatten(0, 1)
        y = y.flatten()
    if normalization == "tokens":
        loss = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
        return _plain(loss), (y != IGNORE_INDEX).sum()
    # The mean (ignore_index=-100 is torch's default).
    return _plain(F.cross_entropy(logits, y))


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss of vocabulary-sharded logits (``parallel.vocab_parallel``: a replicated DTensor, computed under the
    step's ``loss_parallel()``) as the plain tensor the loop reports; autograd carries its gradient back."""
    return loss.to_local() if hasattr(loss, "to_local") else loss


def validation_step(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """Per-sample (classifier) or per-token (language model) loss and accuracy of one validation batch."""
    # A mixture's validation set adds each sample's source name (ddpkit.data.mixture).
    x, y, *sources = batch
    logits = model(x)
    if hasattr(logits, "full_tensor"):
        # Vocabulary-sharded logits (parallel.vocab_parallel): made whole for the per-token metrics (an all-gather).
        logits = logits.full_tensor()
    if logits.dim() == 3:
        length = y.shape[1]
        logits = logits.flatten(0, 1)
        y = y.flatten()
        counted = y != IGNORE_INDEX
        losses = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="none")
        metrics = {"loss": losses[counted], "accuracy": (logits.argmax(dim=1) == y).float()[counted]}
        # val_loss/<name>: each source's own tokens.
        for name in dict.fromkeys(sources[0] if sources else ()):
            rows = torch.tensor([n == name for n in sources[0]], device=y.device).repeat_interleave(length)
            metrics[f"loss/{name}"] = losses[counted & rows]
        return metrics
    return {"loss": F.cross_entropy(logits, y, reduction="none"), "accuracy": (logits.argmax(dim=1) == y).float()}
