"""fsdp2 on Gloo: FSDP2's all-gather and reduce-scatter without Gloo's whole-size staging copies
(ddpkit.parallel.gloo_collectives).

    .venv/bin/pytest -q tests/test_fsdp_memory.py

Real Gloo ranks (the session's rank pool). The replacements must give the bytes Gloo's own collectives give, every
one (signed zeros, values over twelve orders of magnitude, 2 and 3 ranks), hold less memory while they run (each
rank's peak resident memory from the OS, ``VmHWM`` reset just before), and be what ``FSDP2.shard`` installs on
every unit, so a training step runs through them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import cpu_runtime, run_in_pool
from torch import nn

from ddpkit.parallel.gloo_collectives import BroadcastAllGather, InPlaceReduceScatter

pytestmark = pytest.mark.multiprocess

MiB = 2**20


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: equal bits, NaNs and signed zeros included."""
    return t.contiguous().view(torch.int32)


def _against_gloos_own(n: int) -> dict[str, bool]:
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(n * world, generator=generator) * torch.logspace(-6, 6, n * world)
    x[::7] = -0.0
    same = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        theirs, ours = torch.empty(n), torch.empty(n)
        dist.reduce_scatter_tensor(theirs, x.clone(), op=op)
        spent = x.clone()
        InPlaceReduceScatter()(output_tensor=ours, input_tensor=spent, group=group, op=op)
        same[f"reduce-scatter {op}"] = torch.equal(_bits(theirs), _bits(ours))
        # its input is freed as the call ends (FSDP2 would hold it through the next unit's backward)
        same[f"reduce-scatter {op} frees its input"] = spent.untyped_storage().nbytes() == 0
    shard = x[:n]
    theirs = torch.empty(n * world)
    dist.all_gather_into_tensor(theirs, shard)
    # FSDP2's way: this rank's shard already in its slot of the output, the input a view of that slot
    ours = torch.full((n * world,), float("nan"))
    ours.view(world, -1)[rank].copy_(shard)
    BroadcastAllGather()(output_tensor=ours, input_tensor=ours.view(world, -1)[rank], group=group)
    same["all-gather, input in its slot"] = torch.equal(_bits(theirs), _bits(ours))
    # any other input is copied into the slot first
    elsewhere = torch.full((n * world,), float("nan"))
    BroadcastAllGather()(output_tensor=elsewhere, input_tensor=shard.clone(), group=group)
    same["all-gather, input elsewhere"] = torch.equal(_bits(theirs), _bits(elsewhere))
    return same


@pytest.mark.parametrize("world", [2, 3])
def test_the_replacements_give_gloos_own_bytes(world):
    for result in run_in_pool(_against_gloos_own, world, args=(1000,)):
        assert all(result.values()), result


def _peak_above_now(run) -> float:
    """MiB by which this process's resident memory peaks above its current level while ``run()`` runs."""

    def status(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(f"{field}:"))
        return int(line.split()[1]) * 1024

    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    run()
    return (status("VmHWM") - before) / MiB


def _staging_memory() -> dict[str, float]:
    group, world = dist.group.WORLD, dist.get_world_size()
    # 64 MiB in, 32 MiB out a rank: blocks this large are mapped and unmapped whatever malloc's settings
    x, out = torch.randn(16 * MiB // 2 * world), torch.empty(16 * MiB // 2)
    # the in-place reduce-scatter frees its input when done
    spent = x.clone()
    return {
        "gloo reduce-scatter": _peak_above_now(lambda: dist.reduce_scatter_tensor(out, x)),
        "in-place reduce-scatter": _peak_above_now(
            lambda: InPlaceReduceScatter()(output_tensor=out, input_tensor=spent, group=group, op=dist.ReduceOp.SUM)
        ),
        "gloo all-gather": _peak_above_now(lambda: dist.all_gather_into_tensor(x, out)),
        "broadcast all-gather": _peak_above_now(
            lambda: BroadcastAllGather()(output_tensor=x, input_tensor=out, group=group)
        ),
    }


def test_the_replacements_hold_no_whole_size_copy_where_gloos_own_do():
    for peaks in run_in_pool(_staging_memory, 2):
        # Gloo's own: a copy of the whole 64 MiB input (reduce-scatter) or output (all-gather)
        assert peaks["gloo reduce-scatter"] > 56 and peaks["gloo all-gather"] > 56, peaks
        # in place: Gloo's few MiB of scratch
        assert peaks["in-place reduce-scatter"] < 12 and peaks["broadcast all-gather"] < 12, peaks


class TwoBlocks(nn.Module):
    """The smallest model fsdp2 shards block by block: two blocks in a ModuleList."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _fsdp2_step_through_the_replacements() -> dict[str, int]:
    from ddpkit.config.parallel import FSDPConfig
    from ddpkit.parallel.fsdp import FSDP2

    calls = {"reduce-scatter": 0, "all-gather": 0}
    reduce_scatter, all_gather = InPlaceReduceScatter.__call__, BroadcastAllGather.__call__

    def counted(name, call):
        def wrapper(self, *args, **kwargs):
            calls[name] += 1
            return call(self, *args, **kwargs)

        return wrapper

    InPlaceReduceScatter.__call__ = counted("reduce-scatter", reduce_scatter)
    BroadcastAllGather.__call__ = counted("all-gather", all_gather)
    try:
        torch.manual_seed(0)
        sharded = FSDP2(FSDPConfig()).shard(TwoBlocks(), mesh=None, runtime=cpu_runtime())
        sharded(torch.randn(4, 8)).sum().backward()
    finally:
        InPlaceReduceScatter.__call__, BroadcastAllGather.__call__ = reduce_scatter, all_gather
    return calls


def test_fsdp2_on_gloo_gathers_and_reduces_every_unit_through_them():
    for calls in run_in_pool(_fsdp2_step_through_the_replacements, 2):
        # two blocks: each gathered for its forward and again for its backward, its gradient reduced once
        assert calls == {"all-gather": 4, "reduce-scatter": 2}, calls
