"""Per-document attention in packed windows (``data.kwargs.document_mask``): the same logits as alone, every kernel.

.venv/bin/pytest tests/test_document_mask.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import run_cli

import ddpkit
from ddpkit.data.tokens import BYTE_EOT, require_vocab_of, tokens
from ddpkit.models.document_mask import document_attention, documents_of
from ddpkit.models.gpt import GPT

EOT = BYTE_EOT


def _model(**documents) -> GPT:
    torch.manual_seed(0)
    model = GPT(dim=64, depth=2, heads=4, max_len=64).eval()
    if documents:
        model.use_documents(eot=EOT, **documents)
    return model


def test_document_ids_and_restarted_positions():
    x = torch.tensor([[5, 6, EOT, 7, 8, 9, EOT, EOT, 1]])
    docs = documents_of(x, eot=EOT, restart_positions=True)
    assert docs.ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3]]  # the end-of-text closes its document
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0]]
    assert documents_of(x, eot=EOT).positions.tolist() == [list(range(9))]
    mask = docs.mask()[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False, False]


def test_a_document_packed_after_another_gets_its_logits_alone():
    first, second = torch.randint(0, 256, (1, 20)), torch.randint(0, 256, (1, 25))
    packed = torch.cat([first, torch.tensor([[EOT]]), second], dim=1)
    model = _model(restart_positions=True)
    with torch.no_grad():
        alone, together = model(second), model(packed)
        torch.testing.assert_close(together[:, 21:], alone, rtol=0, atol=1e-5)
        torch.testing.assert_close(together[:, :21], model(packed[:, :21]), rtol=0, atol=1e-5)
        plain = _model()(packed)
    assert (plain[:, 21:] - alone).abs().max() > 1e-3  # without the mask the second document sees the first


def test_the_flex_kernel_agrees_with_the_masked_sdpa():
    pytest.importorskip("torch.nn.attention.flex_attention")
    x = torch.randint(0, 256, (2, 32))
    x[0, 10], x[1, 3], x[1, 20] = EOT, EOT, EOT
    docs = documents_of(x, eot=EOT)
    q, k, v = (torch.randn(2, 2, 32, 16) for _ in range(3))
    torch.testing.assert_close(
        document_attention(q, k, v, docs, kernel="flex"),
        document_attention(q, k, v, docs, kernel="sdpa"),
        rtol=1e-5,
        atol=1e-5,
    )


def test_the_tokens_builder_hands_the_setting_to_the_model_and_training_runs(tmp_path):
    ids = np.random.default_rng(0).integers(0, 256, 2000)
    ids[::37] = EOT
    ids.astype(np.uint16).tofile(tmp_path / "t.bin")
    train, _ = tokens(path=str(tmp_path / "t.bin"), seq_len=32, document_mask=True, restart_positions=True)
    model = GPT(dim=32, depth=1, heads=2, max_len=32)
    require_vocab_of(model, train)
    assert model.documents == {"eot": EOT, "restart_positions": True}
    with pytest.raises(ddpkit.ConfigError, match="data.kwargs.document_mask: Linear has no use_documents"):
        require_vocab_of(torch.nn.Linear(2, 2), train)
    cfg = {
        "run": {"output_dir": str(tmp_path / "run")},
        "data": {
            "name": "tokens",
            "batch_size": 4,
            "kwargs": {"path": str(tmp_path / "t.bin"), "seq_len": 32, "document_mask": True},
        },
        "model": {"name": "gpt", "kwargs": {"dim": 32, "depth": 1, "heads": 2, "max_len": 32}},
        "train": {"max_steps": 3, "log_every": 1},
        "checkpoint": {"every_steps": None},
        "log": {"progress_bar": False},
    }
    trainer = ddpkit.Trainer(cfg)
    assert np.isfinite(trainer.fit()["train_loss"])
    assert trainer.unwrapped_model.documents == {"eot": EOT, "restart_positions": False}


def test_packed_tiny_runs_on_two_ranks(tmp_path):
    """The shipped configs/packed_tiny.yaml as its header tells users to run it, `ddpkit run configs/packed_tiny.yaml
    --nproc-per-node 2`, with overrides on the real command line."""
    done = run_cli(
        "run",
        "configs/packed_tiny.yaml",
        "--nproc-per-node",
        "2",
        "train.max_steps=4",
        "train.log_every=2",
        f"run.output_dir={tmp_path / 'run'}",
        "log.progress_bar=false",
        "data.kwargs.seq_len=64",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "activation checkpointing: 4 GPTBlock modules" in done.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["train_loss"]) for r in records if "train_loss" in r)


def test_a_compiled_gpt_masks_documents_the_same_way():
    x = torch.randint(0, 256, (2, 32))
    x[0, 5], x[1, 17] = EOT, EOT
    model = _model(restart_positions=True)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model)(x), model(x), rtol=1e-5, atol=1e-5)
