"""LoRA's frozen base in the run's precision (issue 67): under ``train.precision: bf16`` the base is stored in bf16
(half its bytes), the adapter in fp32, and the base's fingerprint is the one the fp32 build has.

    .venv/bin/pytest -q tests/test_lora_precision.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from helpers import RaggedSequences, run_in_pool

import ddpkit
from ddpkit.config.loader import load_config
from ddpkit.models.gpt import gpt
from ddpkit.models.lora import apply_lora, base_fingerprint
from ddpkit.models.lora_fingerprint import source_fingerprint

pytestmark = pytest.mark.timeout(300)

# vocab 260: train.sample's byte tokenizer needs 257 ids
MODEL = {"arch": "llama", "vocab_size": 260, "dim": 32, "depth": 2, "heads": 2, "kv_heads": 1, "max_len": 16}
LORA = {"r": 4, "alpha": 8, "targets": "all-linear"}


def _built(precision: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = load_config({"model": {"name": "gpt", "kwargs": MODEL, "lora": LORA}})
    return apply_lora(gpt(**MODEL), cfg.model, precision=precision)


def _whole_tensor_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint as it was first written: each tensor's bytes in one piece."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        tensor = param.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().data if tensor.numel() else b"")
    return digest.hexdigest()


def test_under_bf16_the_frozen_base_is_bf16_the_adapter_fp32_and_the_fingerprint_the_fp32_build_s():
    half, full = _built("bf16"), _built("fp32")
    frozen = {name: p.dtype for name, p in half.named_parameters() if not p.requires_grad}
    adapter = {name: p.dtype for name, p in half.named_parameters() if p.requires_grad}
    # the embedding (the head is tied to it), 2 blocks of 2 norms and 7 linear layers, the final norm
    assert set(frozen.values()) == {torch.bfloat16} and len(frozen) == 1 + 2 * 9 + 1
    assert set(adapter.values()) == {torch.float32} and all(".lora_" in name for name in adapter)
    assert all(p.dtype == torch.float32 for p in full.parameters())
    # the base's fingerprint is taken as built, before the cast: a checkpoint resumes under either precision
    assert half.lora_base.fingerprint == full.lora_base.fingerprint
    # ddpkit's own model is fingerprinted by its source (the seed its weights are drawn from), not its bytes
    torch.manual_seed(0)
    base = gpt(**MODEL)
    assert full.lora_base.fingerprint_of == "source" and full.lora_base.fingerprint == source_fingerprint(base)
    # another model's weights: the same digest as hashing each tensor whole, taken a piece at a time
    assert base_fingerprint(base) == _whole_tensor_fingerprint(base) != source_fingerprint(base)
    # the bf16 base is the fp32 one rounded, parameter by parameter
    full_params = dict(full.named_parameters())
    for name, param in half.named_parameters():
        if not param.requires_grad:
            assert torch.equal(param, full_params[name].detach().to(torch.bfloat16)), name


class Run(ddpkit.Trainer):
    """Keeps the base as it starts and the adapter's B as it starts, to compare with the end."""

    def build_datasets(self):
        return RaggedSequences(n=16, vocab=50), None

    def on_fit_start(self) -> None:
        model = self.unwrapped_model
        self.base_at_start = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

    def on_fit_end(self, metrics: dict[str, float]) -> None:
        model = self.unwrapped_model
        self.report = {
            "base_dtypes": sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad}),
            "adapter_dtypes": sorted({str(p.dtype) for p in model.parameters() if p.requires_grad}),
            "base_unchanged": all(
                torch.equal(p, self.base_at_start[n]) for n, p in model.named_parameters() if not p.requires_grad
            ),
            "adapter_moved": max(float(p.detach().abs().max()) for n, p in model.named_parameters() if "lora_B" in n),
            "fingerprint": model.lora_base.fingerprint,
            "loss": metrics.get("train_loss"),
        }


def _config(out: Path, precision: str) -> dict:
    return {
        "run": {"name": "lora", "output_dir": str(out), "seed": 0},
        "data": {"global_batch_size": 8, "order": "index_free"},
        "model": {"name": "gpt", "kwargs": MODEL, "lora": LORA},
        "optim": {"name": "adamw", "lr": 1e-2},
        "train": {
            "max_steps": 3,
            "precision": precision,
            "loss_normalization": "tokens",
            "sample": {"every_steps": 2, "prompt": "ab", "max_new_tokens": 4, "temperature": 0},
        },
        "checkpoint": {"every_epochs": None, "every_steps": None},
        "log": {"progress_bar": False},
    }


def _fit(out: str, precision: str) -> dict:
    trainer = Run(_config(Path(out), precision))
    trainer.fit()
    return trainer.report


def test_a_bf16_lora_run_trains_the_fp32_adapter_on_a_bf16_base_that_never_moves(tmp_path):
    ranks = run_in_pool(_fit, 2, args=(str(tmp_path), "bf16"), timeout=200)
    for rank, report in enumerate(ranks):
        assert report["base_dtypes"] == ["torch.bfloat16"] and report["adapter_dtypes"] == ["torch.float32"], rank
        assert report["base_unchanged"] and report["adapter_moved"] > 0, rank
        # the fingerprint a checkpoint carries is the fp32 build's, so an fp32 run resumes this adapter and back
        assert report["fingerprint"] == _built("fp32").lora_base.fingerprint, rank
        assert report["loss"] == ranks[0]["loss"] and 0 < report["loss"] < 10, rank
    # train.sample ran on the mixed-dtype model (autocast to bf16) and wrote its samples
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2]
