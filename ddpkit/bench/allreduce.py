"""``ddpkit bench allreduce``: allreduce time, algorithm bandwidth and bus bandwidth per message size.

    ddpkit bench allreduce --nproc-per-node 2 --sizes 1KB..256MB
    ddpkit bench allreduce --nproc-per-node 2 --sizes 4KB,1MB,64MB --iters 50

The nccl-tests ``all_reduce_perf`` measurement, through ``torch.distributed`` (NCCL on GPUs, Gloo
on the CPU): for each size, a float32 tensor is summed in place across ``--nproc-per-node`` ranks,
``--warmup`` times untimed and then ``--iters`` times timed; the time reported is the slowest
rank's mean per call. With ``S`` bytes, time ``t`` and ``n`` ranks (nccl-tests' definitions):

    algbw = S / t                     (GB/s, 1 GB = 1e9 bytes)
    busbw = algbw * 2 * (n - 1) / n   (what each link carries in a ring allreduce; compare it
                                       to the hardware's bus bandwidth, whatever n is)

Every size is also checked once for correctness (rank r contributes r + 1 everywhere). Large
sizes run fewer iterations, so no size takes much longer than ``--time-per-size`` seconds.
Sizes are 1024-based: ``1KB`` is 1024 bytes; a range ``A..B`` doubles from A to B.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ddpkit.bench.launching import run_workers
from ddpkit.bench.report import emit_results, fmt, format_table, progress
from ddpkit.bench.units import BenchUsageError, format_bytes, parse_nproc, parse_sizes
from ddpkit.config.cli_args import add_output_arguments
from ddpkit.distributed.process_group import Runtime

__all__ = ["add_arguments", "run", "worker", "bus_factor"]

DEFAULT_SIZES_CPU = "1KB..64MB"
DEFAULT_SIZES_GPU = "1KB..256MB"
#: Bytes per element: the benchmark sends float32
_ELEMENT_BYTES = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc-per-node", default="2", help="ranks on this node (default 2); a list such as 2,4 runs each in turn"
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help=f"MIN..MAX (doubling) or a comma list (default {DEFAULT_SIZES_CPU} on CPU, {DEFAULT_SIZES_GPU} on GPU)",
    )
    parser.add_argument(
        "--step-factor", type=int, default=2, help="multiply the size by this in a MIN..MAX range (default 2)"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed calls per size, at most (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per size first (default 5)")
    parser.add_argument(
        "--time-per-size",
        type=float,
        default=0.5,
        help="seconds of timed calls per size before --iters is cut (default 0.5)",
    )
    add_output_arguments(parser)


def bus_factor(world_size: int) -> float:
    """nccl-tests' allreduce bus-bandwidth factor ``2(n-1)/n``."""
    return 2 * (world_size - 1) / world_size


def run(args: argparse.Namespace) -> int:
    """Validate the options, run the measurement on each world size, print one table per size sweep."""
    import torch

    counts = parse_nproc(args.nproc_per_node)
    sizes = parse_sizes(
        args.sizes or (DEFAULT_SIZES_GPU if torch.cuda.is_available() else DEFAULT_SIZES_CPU), factor=args.step_factor
    )
    if args.iters < 1 or args.warmup < 0 or args.time_per_size <= 0:
        raise BenchUsageError("--iters must be at least 1, --warmup at least 0 and --time-per-size positive")
    bad = [s for s in sizes if s % _ELEMENT_BYTES]
    if bad:
        raise BenchUsageError(f"--sizes: {bad[0]} bytes is not a whole number of float32 elements (4 bytes each)")
    params = {"sizes": sizes, "iters": args.iters, "warmup": args.warmup, "time_per_size": args.time_per_size}
    results = []
    for n in counts:
        progress(
            f"[allreduce] {n} process(es), {len(sizes)} sizes from "
            f"{format_bytes(sizes[0])} to {format_bytes(sizes[-1])} ..."
        )
        result = run_workers("allreduce", params, nproc=n)
        results.append(result)
        print(
            f"allreduce: {result['backend']} on {result['device']}, {n} process(es), float32 sum in place; "
            f"algbw = size/time, busbw = algbw x 2(n-1)/n = algbw x {bus_factor(n):.4g}; GB = 1e9 bytes"
        )
        print(
            format_table(
                ["size", "count", "type", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "iters", "check"],
                [
                    [
                        format_bytes(r["bytes"]),
                        str(r["count"]),
                        "float32",
                        fmt(r["time_us"]),
                        fmt(r["algbw_gbps"]),
                        fmt(r["busbw_gbps"]),
                        str(r["iters"]),
                        "ok" if r["correct"] else "WRONG",
                    ]
                    for r in result["rows"]
                ],
            )
        )
        wrong = [r for r in result["rows"] if not r["correct"]]
        if wrong:
            print(f"error: allreduce returned wrong sums for {len(wrong)} size(s)")
    emit_results(args, results)
    return 1 if any(not r["correct"] for res in results for r in res["rows"]) else 0


def worker(params: dict[str, Any], *, runtime: Runtime, workdir: Path) -> dict[str, Any]:
    """On every rank: time the allreduce of each size; return rows (identical on every rank)."""
    rows = []
    for size in params["sizes"]:
        rows.append(
            _measure(size, runtime, iters=params["iters"], warmup=params["warmup"], budget=params["time_per_size"])
        )
        if runtime.env.rank == 0:
            row = rows[-1]
            progress(
                f"[allreduce]   {format_bytes(size):>7}: {row['time_us']:10.1f} us  busbw {row['busbw_gbps']:.3f} GB/s"
            )
    return {
        "backend": runtime.backend,
        "device": runtime.device.type,
        "world_size": runtime.env.world_size,
        "rows": rows,
    }


def _measure(size: int, runtime: Runtime, *, iters: int, warmup: int, budget: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    n = runtime.env.world_size
    device = runtime.device
    count = size // _ELEMENT_BYTES
    tensor = torch.full((count,), float(runtime.env.rank + 1), dtype=torch.float32, device=device)
    dist.all_reduce(tensor)
    correct = bool(torch.all(tensor == n * (n + 1) / 2))
    # Zeros for timing: the in-place sum keeps them zero, so values never overflow however many calls.
    tensor.zero_()
    for _ in range(warmup):
        dist.all_reduce(tensor)
    # One calibration call decides how many timed calls fit in the budget (the slowest rank's view).
    first = _max_over_ranks(_timed_calls(tensor, 1, device), device)
    iters = max(1, min(iters, int(budget / max(first, 1e-9))))
    seconds = _max_over_ranks(_timed_calls(tensor, iters, device) / iters, device)
    algbw = size / seconds / 1e9
    return {
        "bytes": size,
        "count": count,
        "iters": iters,
        "time_us": seconds * 1e6,
        "algbw_gbps": algbw,
        # a collective: every rank calls it
        "busbw_gbps": algbw * bus_factor(n),
        "correct": _all_ranks_true(correct, device),
    }


def _timed_calls(tensor: Any, iters: int, device: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    _sync(device)
    return time.perf_counter() - start


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(value: float, device: Any) -> float:
    import torch
    import torch.distributed as dist

    box = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def _all_ranks_true(flag: bool, device: Any) -> bool:
    import torch
    import torch.distributed as dist

    box = torch.tensor([0 if flag else 1], dtype=torch.int32, device=device)
    dist.all_reduce(box)
    return int(box.item()) == 0
