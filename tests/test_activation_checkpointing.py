"""Activation checkpointing (``train.activation_checkpointing``): same loss and weights, less kept, every mode.

.venv/bin/pytest tests/test_activation_checkpointing.py -q
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_in_pool
from torch.nn import functional as F

import ddpkit
from ddpkit.models.gpt import GPT
from ddpkit.parallel.activation_checkpointing import apply_activation_checkpointing


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """Bytes autograd keeps for the backward pass during ``model(x)``, the loss, and the gradients."""
    kept = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), x.roll(-1, 1).flatten())
    loss.backward()
    return sum(kept), loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_checkpointed_blocks_keep_less_and_give_the_same_loss_and_gradients_bitwise():
    x = torch.randint(0, 257, (4, 64))
    torch.manual_seed(0)
    plain = GPT(dim=64, depth=3, heads=4, max_len=64)
    torch.manual_seed(0)
    checkpointed = GPT(dim=64, depth=3, heads=4, max_len=64)
    assert apply_activation_checkpointing(checkpointed, True) == 3
    assert list(checkpointed.state_dict()) == list(plain.state_dict())  # names unchanged: checkpoints interchangeable
    plain_bytes, plain_loss, plain_grads = _saved_bytes(plain, x)
    ckpt_bytes, ckpt_loss, ckpt_grads = _saved_bytes(checkpointed, x)
    assert ckpt_bytes < plain_bytes / 3
    assert torch.equal(plain_loss, ckpt_loss)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, ckpt_grads))
    with torch.no_grad():
        assert torch.equal(plain(x), checkpointed(x))


def test_named_classes_and_the_errors():
    model = GPT(dim=32, depth=2, heads=2, max_len=16)
    assert apply_activation_checkpointing(model, ["GPTBlock", "CausalSelfAttention"]) == 2  # blocks hold the attention
    assert apply_activation_checkpointing(GPT(dim=32, depth=2, heads=2, max_len=16), False) == 0
    with pytest.raises(
        ddpkit.ConfigError,
        match=r"train.activation_checkpointing: the model has no module of class "
        r"Block; "
        r"name the block classes to checkpoint, e\.g\. \[.*\] \(its classes: .*GPTBlock",
    ):
        apply_activation_checkpointing(model, ["Block"])


def test_a_hugging_face_model_uses_its_own_non_reentrant_switch():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    assert apply_activation_checkpointing(model, True) == 1
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing


def _fit_each_mode(tmp: str) -> dict:
    """On every rank: the final weights of ddp, zero1, fsdp2 and compiled ddp runs, with and without checkpointing."""
    results = {}
    corpus = Path(tmp) / "corpus.bin"
    for mode, compile_ in (("ddp", False), ("zero1", False), ("fsdp2", False), ("ddp", {"backend": "aot_eager"})):
        for ac in (False, True):
            cfg = {
                "run": {"name": "ac", "output_dir": str(Path(tmp) / f"{mode}-{bool(compile_)}-{ac}"), "seed": 0},
                "data": {"name": "tokens", "batch_size": 4, "kwargs": {"path": str(corpus), "seq_len": 32}},
                "model": {"name": "gpt", "kwargs": {"dim": 32, "depth": 2, "heads": 2, "max_len": 32}},
                "optim": {"name": "adamw", "lr": 0.01},
                "train": {"max_steps": 3, "log_every": 1, "activation_checkpointing": ac, "compile": compile_},
                "parallel": {"mode": mode},
                "checkpoint": {"every_steps": None},
                "log": {"progress_bar": False},
            }
            trainer = ddpkit.Trainer(cfg)
            metrics = trainer.fit()
            params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in trainer.unwrapped_model.parameters()]
            results[mode, bool(compile_), ac] = (metrics["train_loss"], [p.detach().clone() for p in params])
    return results


def test_the_same_training_under_ddp_zero1_fsdp2_and_compile(tmp_path):
    np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint16).tofile(tmp_path / "corpus.bin")
    results = run_in_pool(_fit_each_mode, world_size=2, args=(str(tmp_path),), timeout=600)[0]
    for mode, compiled in (("ddp", False), ("zero1", False), ("fsdp2", False), ("ddp", True)):
        (loss, weights), (ac_loss, ac_weights) = results[mode, compiled, False], results[mode, compiled, True]
        assert ac_loss == pytest.approx(loss, rel=1e-6, abs=1e-7), (mode, compiled)
        for a, b in zip(weights, ac_weights):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_applying_twice_wraps_once_and_a_deep_copy_checkpoints_its_own_blocks():
    import copy

    model = GPT(dim=32, depth=2, heads=2, max_len=16)
    apply_activation_checkpointing(model, True)
    apply_activation_checkpointing(model, True)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    x = torch.randint(0, 257, (2, 16))
    _, loss, _ = _saved_bytes(twin, x)
    assert not torch.equal(loss, _saved_bytes(model, x)[1])  # the copy runs its own weights, not the original's
    assert all(p.grad is not None for p in twin.parameters())
