"""Validation under fsdp2 gathers as training does: one block's full parameters at a time, never the whole model,
on ranks with unequal numbers of validation batches, with exact metrics.

    .venv/bin/pytest -q tests/test_fsdp_validation.py

A rank with fewer validation batches runs its last one again (its metrics dropped) so that every rank runs as many
forwards, each of which all-gathers a block: what a block's forward sees of the other blocks shows whether they are
held whole (plain tensors) or as shards (DTensors).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import RaggedSequences, run_in_pool

import ddpkit

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


class WatchedValidation(ddpkit.Trainer):
    """Validation on 5 sequences in batches of 2: 3 samples (2 batches) on rank 0, 2 (1 batch) on rank 1 of 2.
    Before each block's forward without gradients (validation), how many blocks hold whole parameters."""

    def build_datasets(self):
        return RaggedSequences(n=64), RaggedSequences(n=5)

    def on_fit_start(self) -> None:
        from torch.distributed.tensor import DTensor

        self.whole_blocks: list[int] = []
        blocks = list(self.placed.held.blocks)

        def count(module, args) -> None:
            if not torch.is_grad_enabled():
                whole = sum(not isinstance(next(b.parameters()), DTensor) for b in blocks)
                self.whole_blocks.append(whole)

        for block in blocks:
            block.register_forward_pre_hook(count)


def _config(out: Path, **fsdp) -> dict:
    return {
        "run": {"name": "val", "output_dir": str(out), "seed": 3},
        "data": {"global_batch_size": 8, "order": "index_free", "val_batch_size": 2},
        "model": {"name": "gpt", "kwargs": {"vocab_size": 50, "dim": 32, "depth": 4, "heads": 2, "max_len": 16}},
        "optim": {"name": "sgd", "lr": 0.5},
        "train": {"max_steps": 2, "log_every": 1, "eval_every": 2, "loss_normalization": "tokens"},
        "parallel": {"mode": "fsdp2", "fsdp": fsdp},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }


def _fit(cfg: dict) -> dict:
    trainer = WatchedValidation(cfg)
    metrics = trainer.fit()
    return {"metrics": metrics, "whole_blocks": trainer.whole_blocks}


def _fit_one(cfg: dict) -> dict:
    cfg["parallel"]["mode"] = "ddp"
    trainer = WatchedValidation(cfg)
    return trainer.fit()


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp2_validation_holds_one_block_at_a_time_and_its_metrics_are_exact(tmp_path, reshard_after_forward):
    one = run_in_pool(_fit_one, 1, args=(_config(tmp_path / "one"),), timeout=120)[0]
    cfg = _config(tmp_path / "fsdp2", reshard_after_forward=reshard_after_forward)
    ranks = run_in_pool(_fit, 2, args=(cfg,), timeout=200)
    # 2 validation batches on rank 0 and 1 on rank 1, run again: 2 forwards of 4 blocks on each rank
    for rank in ranks:
        assert len(rank["whole_blocks"]) == 2 * 4
        # whole: the block about to run (FSDP2's own hook ran before this one) and at most one it prefetched,
        # never the whole model as when every block was gathered once for the pass
        assert 1 <= min(rank["whole_blocks"]) and max(rank["whole_blocks"]) <= 2, rank["whole_blocks"]
    for name in ("val_loss", "val_accuracy"):
        assert ranks[0]["metrics"][name] == ranks[1]["metrics"][name] == pytest.approx(one[name], rel=1e-6), name
