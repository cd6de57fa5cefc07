"""Dropout under a pipeline: each stage draws from a seed of its own (``ddpkit.training.rng.rank_seed``), the same in
every launch of the same run.

    .venv/bin/pytest -q tests/test_pipeline_seeds.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_in_pool
from torch import nn

import ddpkit
from ddpkit.training.rng import STAGE_STRIDE, RngStreams, capture_rng, rank_seed, restore_rng

pytestmark = pytest.mark.timeout(180)


class DropoutTrainer(ddpkit.Trainer):
    """An MLP with the same dropout in both halves, cut before its second Linear; each training forward's masks kept."""

    def build_model(self) -> nn.Module:
        model = nn.Sequential(
            nn.Flatten(), nn.Linear(144, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 32), nn.Dropout(0.5)
        )
        model.append(nn.Linear(32, 10))
        self.masks: dict[str, list[torch.Tensor]] = {}
        for name, module in model.named_children():
            if isinstance(module, nn.Dropout):
                module.register_forward_hook(self._keep_mask(name))
        return model

    def _keep_mask(self, name: str):
        def keep(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            if module.training:
                self.masks.setdefault(name, []).append(output == 0)

        return keep


def _fit(out: str) -> dict[str, list[torch.Tensor]]:
    cfg = {
        "run": {"name": "seeds", "output_dir": out, "seed": 5},
        "data": {"name": "digits", "batch_size": 8, "kwargs": {"num_train": 64, "image_size": 12}},
        "optim": {"name": "sgd", "lr": 0.1},
        "train": {"max_steps": 2, "log_every": 2},
        "parallel": {"pipeline": 2, "microbatches": 2, "split_points": ["4"]},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }
    trainer = DropoutTrainer(cfg)
    trainer.fit()
    return trainer.masks


@pytest.mark.multiprocess
def test_each_stage_draws_its_own_masks_and_every_launch_the_same(tmp_path: Path):
    first = run_in_pool(_fit, 2, args=(str(tmp_path / "a"),), timeout=120)
    again = run_in_pool(_fit, 2, args=(str(tmp_path / "b"),), timeout=120)
    # Stage 0 holds the first dropout, stage 1 the second: both drop from [8, 32] activations
    assert set(first[0]) == {"2"} and set(first[1]) == {"5"}
    # 2 steps x 2 microbatches after torch's shape inference, whose forward on stage 1 runs on an uninitialised
    # tensor (torch.empty of the received shape): its output, so its zeros, are not the mask's alone
    for masks in (*first, *again):
        (name,) = masks
        assert len(masks[name]) == 5
        del masks[name][0]
    stage0, stage1 = first[0]["2"], first[1]["5"]
    # The same run launched again: the same masks, bit for bit, on every stage
    for rank, name in ((0, "2"), (1, "5")):
        assert all(torch.equal(a, b) for a, b in zip(first[rank][name], again[rank][name], strict=True))
    # The stages' masks are independent draws, not one stream repeated
    assert not any(torch.equal(a, b) for a, b in zip(stage0, stage1))


def test_the_seed_of_a_rank_depends_on_its_stage_and_its_place_in_it():
    # No pipeline: seed + rank, as every run before this rule
    assert [rank_seed(7, rank=r, world_size=4) for r in range(4)] == [7, 8, 9, 10]
    # pp2 x dp2 (ranks 0, 1 stage 0; 2, 3 stage 1) and pp2 alone: stage 1's first replica draws the same stream
    assert rank_seed(7, rank=2, world_size=4, stage=1, stages=2) == rank_seed(
        7, rank=1, world_size=2, stage=1, stages=2
    )
    assert rank_seed(7, rank=3, world_size=4, stage=1, stages=2) == 7 + STAGE_STRIDE + 1
    # No two ranks of a run share a seed
    seeds = [rank_seed(7, rank=r, world_size=8, stage=r // 4, stages=2) for r in range(8)]
    assert len(set(seeds)) == 8


def test_a_resume_on_another_world_size_gives_each_stage_its_own_stream():
    # A world of one's checkpoint resumed as pp2 x dp2 (data.global_batch_size): no rank's own streams were saved
    torch.manual_seed(11)
    saved = [capture_rng()]

    def draws(rank: int, stage: int) -> torch.Tensor:
        RngStreams(rank=rank, world_size=4, stage=stage).load_state_dict(saved)
        return torch.rand(8)

    restore_rng(saved[0])
    continued = torch.rand(8)
    # Stage 0's ranks continue rank 0's streams exactly, as a run without a pipeline does
    assert torch.equal(draws(0, 0), continued) and torch.equal(draws(1, 0), continued)
    # Stage 1's ranks draw a stream of their own, the same in every launch
    assert not torch.equal(draws(2, 1), continued) and torch.equal(draws(2, 1), draws(3, 1))
