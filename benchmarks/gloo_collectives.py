"""FSDP2's two collectives on Gloo, Gloo's own against ddpkit's in-place ones: time and peak memory, side by side.

    python -m benchmarks.gloo_collectives                  # 2 ranks, 64 MiB shards, 7 rounds
    python -m benchmarks.gloo_collectives --ranks 4 --shard-mb 16

Each round runs the four calls in turn on every rank, a barrier before each: Gloo's ``reduce_scatter_tensor`` and
``all_gather_into_tensor``, and :class:`ddpkit.parallel.gloo_collectives.InPlaceReduceScatter` and
:class:`~ddpkit.parallel.gloo_collectives.BroadcastAllGather` on the same tensors. Printed: rank 0's median
milliseconds, ours over Gloo's (the ratio of the medians, and the median of each round's ratio), and the peak
resident memory each call adds above its input and output (``VmHWM``, reset just before it, the largest rank's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit.parallel.gloo_collectives import BroadcastAllGather, InPlaceReduceScatter

MiB = 2**20


def _status(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def measure(shard_mb: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """One rank: each call's seconds a round and its peak MiB above what it was given."""
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    n = shard_mb * MiB // 4
    whole, shard = torch.randn(n * world), torch.randn(n)
    # the in-place reduce-scatter frees its input as it ends (as FSDP2 drops it): a fresh copy each round, made
    # before the clock and the peak start
    spent = [whole.clone()]
    calls = {
        "gloo reduce-scatter": lambda: dist.reduce_scatter_tensor(shard, whole),
        "in-place reduce-scatter": lambda: InPlaceReduceScatter()(
            output_tensor=shard, input_tensor=spent[0], group=group, op=dist.ReduceOp.SUM
        ),
        "gloo all-gather": lambda: dist.all_gather_into_tensor(whole, shard),
        "broadcast all-gather": lambda: BroadcastAllGather()(
            output_tensor=whole, input_tensor=whole.view(world, -1)[rank], group=group
        ),
    }
    found = {name: {"seconds": [], "peak": []} for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            if name == "in-place reduce-scatter":
                spent[0] = whole.clone()
            dist.barrier()
            before = _status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")
            began = time.perf_counter()
            call()
            found[name]["seconds"].append(time.perf_counter() - began)
            found[name]["peak"].append((_status("VmHWM") - before) / MiB)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--shard-mb", type=int, default=64, help="each rank's shard; the whole is ranks x this")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    from ddpkit.testing import run_on_ranks

    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{args.ranks} Gloo ranks, {args.shard_mb} MiB shards, {args.rounds} rounds (rank 0's times)")
    results = run_on_ranks(measure, args.ranks, args=(args.shard_mb, args.rounds), timeout=600)
    rank0 = results[0]
    median = {name: statistics.median(found["seconds"]) * 1000 for name, found in rank0.items()}
    peak = {name: max(max(r[name]["peak"]) for r in results) for name in rank0}
    print(f"{'call':<25} {'median ms':>10} {'peak above its tensors':>24}")
    for name in rank0:
        print(f"{name:<25} {median[name]:>10.1f} {peak[name]:>22.1f} M")
    pairs = (("in-place reduce-scatter", "gloo reduce-scatter"), ("broadcast all-gather", "gloo all-gather"))
    for ours, theirs in pairs:
        paired = statistics.median(a / b for a, b in zip(rank0[ours]["seconds"], rank0[theirs]["seconds"]))
        print(f"{ours} / {theirs}: {median[ours] / median[theirs]:.2f} (median of paired ratios {paired:.2f})")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
