"""The pinned DDP bucket layout (ddpkit.distributed.bucket_layout) on 3 real Gloo ranks, in one spawn.

    .venv/bin/pytest -q tests/test_bucket_layout.py

A "resume" here is a fresh DDP around the same model and optimizer halfway through: exactly what a restarted
process builds. Without the pin, its first step reduces in DDP's one-bucket layout and the weights drift; with it,
every step reduces in the layout DDP rebuilds to, which the hook predicts from the gradients' ready order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import run_in_pool
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.config.schema import DDPConfig
from ddpkit.distributed.bucket_layout import PinnedLayout, _pieces_of, pin_bucket_layout

STEPS = 8


def _net() -> nn.Module:
    torch.manual_seed(0)
    # Conv weights become ready after their biases: the ready order is not the reverse of the parameters'.
    return nn.Sequential(
        nn.Conv2d(1, 16, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 6 * 6, 700),
        nn.ReLU(),
        nn.Linear(700, 400),
        nn.ReLU(),
        nn.Linear(400, 10),
    )


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: range, options: DDPConfig | None, accum: int
) -> tuple[DDP, PinnedLayout | None]:
    ddp = DDP(model, bucket_cap_mb=options.bucket_cap_mb if options else None)
    pinned = pin_bucket_layout(ddp, options) if options is not None else None
    for step in steps:
        for micro in range(accum):
            generator = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
            x, y = torch.randn(8, 1, 8, 8, generator=generator), torch.randint(0, 10, (8,), generator=generator)
            context = ddp.no_sync() if micro < accum - 1 else torch.enable_grad()
            with context:
                nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ddp, pinned


def _resumed_against_straight(options: DDPConfig | None, accum: int) -> tuple[float, bool]:
    """Max weight difference between a straight run and one resumed at STEPS // 2; whether the predicted layout
    is the one torch rebuilt (from DDP's own logging data)."""
    straight = _net()
    opt = torch.optim.SGD(straight.parameters(), lr=0.1, momentum=0.9)
    ddp, pinned = _train(straight, opt, range(STEPS), options, accum)
    resumed = _net()
    opt = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    _train(resumed, opt, range(STEPS // 2), options, accum)
    _train(resumed, opt, range(STEPS // 2, STEPS), options, accum)
    diff = max((a - b).abs().max().item() for a, b in zip(straight.parameters(), resumed.parameters()))
    rebuilt = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    predicted = ", ".join(" ".join(map(str, bucket)) for bucket in pinned.layout) if pinned is not None else None
    return diff, predicted == rebuilt


def _every_case() -> dict[str, tuple[float, bool]]:
    return {
        "torch as it is": _resumed_against_straight(None, 1),
        "pinned": _resumed_against_straight(DDPConfig(), 1),
        "pinned, accumulation": _resumed_against_straight(DDPConfig(), 2),
        "pinned, bf16 compression": _resumed_against_straight(DDPConfig(comm_hook="bf16"), 1),
        "pinned, bucket_cap_mb=1": _resumed_against_straight(DDPConfig(bucket_cap_mb=1), 1),
    }


@pytest.mark.multiprocess
def test_a_fresh_ddp_resumes_bitwise_on_three_ranks_only_with_the_layout_pinned():
    results = run_in_pool(_every_case, world_size=3, timeout=180)
    cases = results[0]
    # The cause, shown: torch's first-iteration layout makes the resumed weights drift on 3 ranks.
    assert cases.pop("torch as it is")[0] > 0
    for name, (diff, predicted_is_rebuilt) in cases.items():
        assert diff == 0.0, f"{name}: resumed weights differ by {diff:.3g}"
        assert predicted_is_rebuilt, f"{name}: the predicted layout is not the one DDP rebuilt"
    assert results[1] == results[2] == results[0] | {"torch as it is": results[1]["torch as it is"]}


def test_a_large_bucket_splits_into_the_layouts_pieces_and_nothing_else():
    layout = [[5, 4], [3, 1, 2], [0]]
    assert _pieces_of([0, 1, 2, 3, 4, 5], layout) == layout
    assert _pieces_of([3, 1, 2], layout) == [[3, 1, 2]]
    # A bucket that cuts a piece in two is not made of pieces: the hook then reduces it as it comes.
    assert _pieces_of([0, 1, 2], layout) is None


def test_nothing_is_pinned_where_ddp_never_rebuilds_or_keeps_its_own_state():
    assert pin_bucket_layout(None, DDPConfig(find_unused_parameters=True)) is None
    assert pin_bucket_layout(None, DDPConfig(comm_hook="powersgd")) is None
