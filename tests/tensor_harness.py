"""What the tensor-parallel tests share: the small models they split, the batches they train on, and how they compare
a split run with a world of one (tests/test_tensor_parallel.py, test_sequence_parallel.py, test_tensor_lora.py).

    model = tiny_model("gqa")                    # the same weights on every rank (seeded), split afterwards
    run = train_counted(split, steps=4, clip=0.5)    # AdamW on fixed_batch(step), the collectives counted
    assert relative_l2(run["weights"], train_counted(tiny_model("gqa"), 4, clip=0.5)["weights"]) < 1e-5

Each test file keeps what it varies itself (its clip value, its plans, LoRA); only these are the same everywhere.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn import functional as F

from ddpkit.models.gpt import GPT
from ddpkit.models.llama import Llama, LlamaShape

VOCAB = 64
#: Grouped-query attention (4 query heads, 2 key/value heads), an untied head.
GQA = dict(vocab_size=VOCAB, dim=32, depth=2, heads=4, kv_heads=2, mlp_dim=64, max_len=16, tied=False)
#: Qwen-like: q/k/v biases, per-head q/k RMSNorms (their weights see every head: an all-reduce each), tied head.
QWEN = {**GQA, "tied": True, "qkv_bias": True, "qk_norm": True}
GPT2 = dict(vocab_size=VOCAB, dim=32, depth=2, heads=4, max_len=16)


def tiny_model(kind: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``kind`` (``gpt2``, ``gqa`` or ``qwen``) built under seed 0, in ``dtype``: the same bits on every rank."""
    torch.manual_seed(0)
    model = GPT(**GPT2) if kind == "gpt2" else Llama(LlamaShape(**(GQA if kind == "gqa" else QWEN)))
    return model.to(dtype)


def fixed_batch(step: int) -> torch.Tensor:
    """One of four fixed batches of 8 sequences of 17 tokens (inputs 16, which split over 2 or 4 ranks; the targets
    shifted by one)."""
    return torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(step % 4))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective on its mesh: every rank of it calls this), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def relative_l2(a: list[float] | dict, b: list[float] | dict) -> float:
    """Per loss and norm, and per weight tensor in L2 norms (``|a - b| / |b|``): the largest difference relative to
    the world of one's ``b``. AdamW's per-element normalisation lets a few elements' rounding grow; this measure
    reports them at their share of the tensor, the elementwise maximum (:func:`relative_max`) at their size."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in a)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def relative_max(a: list[float] | dict, b: list[float] | dict) -> float:
    """Per loss and norm, and per weight tensor elementwise: the largest difference relative to the size of the
    world of one's tensor (its largest entry)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def next_token_loss(model: nn.Module, x: torch.Tensor, *, tokens: int | None = None) -> torch.Tensor:
    """The mean next-token loss of the batch ``x``, or with ``tokens`` the token-weighted one: the sum over counted
    targets (every fifth is ignored) divided by the whole batch's count, as ``train.loss_normalization: tokens``."""
    logits = model(x[:, :-1]).flatten(0, 1)
    targets = x[:, 1:].flatten()
    if tokens is None:
        return F.cross_entropy(logits, targets)
    targets = targets.masked_fill(torch.arange(targets.numel()) % 5 == 0, -100)
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / tokens


def train_counted(
    model: nn.Module,
    steps: int,
    *,
    clip: float,
    microbatches: int = 1,
    vocab_parallel: bool = False,
    token_loss: bool = False,
) -> dict:
    """``steps`` of AdamW (lr 1e-3, weight decay 0.1) on the parameters that train, their gradient clipped at
    ``clip`` over all of them, each step on :func:`fixed_batch` in ``microbatches``; the first step's collectives
    counted (DTensor's ``CommDebugMode``).

    ``vocab_parallel``: the logits are sharded on the vocabulary, so the loss and its backward run under torch's
    ``loss_parallel()``; ``token_loss``: the token-weighted loss (:func:`next_token_loss`). Returns each step's
    loss and gradient norm, the counts, and the trained parameters whole (``weights``)."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.1)
    # fixed_batch's 8 x 16 targets less the fifth ignored
    tokens = 8 * 16 - (8 * 16 + 4) // 5 if token_loss else None
    losses, norms, counts = [], [], None
    for step in range(steps):
        with CommDebugMode() as comm:
            total = 0.0
            for x in fixed_batch(step).chunk(microbatches):
                with loss_parallel() if vocab_parallel else contextlib.nullcontext():
                    loss = next_token_loss(model, x, tokens=tokens) / microbatches
                    loss.backward()
                total += whole(loss).item()
            norm = torch.nn.utils.clip_grad_norm_(trainable, clip)
            optimizer.step()
            optimizer.zero_grad()
        counts = counts if counts is not None else {str(op): n for op, n in comm.get_comm_counts().items()}
        losses.append(total)
        norms.append(whole(norm).item())
    weights = {name: whole(p.detach()).clone() for name, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "norms": norms, "counts": counts, "weights": weights}


def assert_like_a_world_of_one(name: str, run: dict, *, clip: float) -> None:
    """``run``'s distances from a world of one (``losses``, ``norms``, ``weights``: :func:`relative_l2` of two
    :func:`train_counted` runs) within 1e-5, or 1e-12 for a ``*float64`` run; and its clipping acted (``first_norm``,
    the world of one's first gradient norm, above ``clip``), so the norm it clipped was the whole model's."""
    assert run["first_norm"] > clip, name
    tolerance = 1e-12 if name.endswith("float64") else 1e-5
    assert run["losses"] < tolerance, (name, run)
    assert run["norms"] < tolerance, (name, run)
    assert run["weights"] < tolerance, (name, run)
