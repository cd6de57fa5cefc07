"""Samples/s of a sharded stream against the same data map-style, and the cost of the agreed stop.

    python -m benchmarks.streaming                          # 1 and 2 ranks x 0 and 2 workers, 5 rounds
    python -m benchmarks.streaming --rounds 9 --num-train 24000 --json /tmp/bench_streaming.json

``throughput``: each rank count runs as one job of Gloo ranks (one thread each, a ``FileStore``,
``ddpkit.testing.run_on_ranks``). Inside it, every round reads one whole epoch of the embedded
digits data (1x28x28 images, per-rank batch 64) through

* ``map``: a ``TensorDataset`` through ddpkit's ``build_train_loader`` (``DistributedSampler``);
* ``stream``: the same tensors as a plain ``IterableDataset`` (no ``len()``, reshuffled by
  ``set_epoch``) through ``build_stream_loader`` + ``StreamEpochs`` (round-robin over ranks and
  workers, one ``all_reduce(MIN)`` per window of ``data.stream_window`` = 8 steps);

for 0 and 2 workers, in alternating order (the order flips every round). The time is the slowest
rank's, from ``iter()`` (worker start included) to the epoch's end; samples/s counts the samples
the epoch used on all ranks. Each batch is touched (``x.sum()``) and nothing else: the loader is
all that is measured, which is the worst case for any difference.

``agreement``: 2 ranks, 0 workers: microseconds per batch of the same stream read by the loader
alone (no read-ahead, no collective) and by ``StreamEpochs`` with a window of 8 steps (the
default: one ``all_reduce`` per 8 batches) and of 1 (one per batch); and the time of one
``all_reduce(MIN)`` of one integer on its own (median of 2000).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, TensorDataset

from benchmarks.workloads import load_printed
from ddpkit.data.datasets import make_digits
from ddpkit.data.epochs import start_epoch
from ddpkit.data.loaders import build_train_loader
from ddpkit.data.streaming import build_stream_loader
from ddpkit.distributed.env import read_dist_env
from ddpkit.testing import run_on_ranks


class TensorStream(IterableDataset):
    """The rows of ``tensors`` in an order drawn from the epoch: a plain stream, no len(), no sharding."""

    def __init__(self, *tensors: torch.Tensor):
        self.tensors, self.epoch = tensors, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for i in torch.randperm(len(self.tensors[0]), generator=torch.Generator().manual_seed(self.epoch)).tolist():
            yield tuple(t[i] for t in self.tensors)


def _epoch(
    variant: str, data: tuple[torch.Tensor, ...], workers: int, epoch: int, window: int = 8
) -> tuple[float, int]:
    """Seconds for one epoch on this rank (slowest rank's, after an all_reduce) and samples used on all ranks."""
    env = read_dist_env()
    dist.barrier()
    started = time.perf_counter()
    if variant == "map":
        loader = build_train_loader(TensorDataset(*data), env=env, batch_size=64, num_workers=workers)
        start_epoch(loader, epoch)
        batches = loader
    else:
        loader = build_stream_loader(
            TensorStream(*data), env=env, batch_size=64, num_workers=workers, window_steps=window
        )
        batches = loader.stream_epochs
        batches.start_epoch(epoch)
    count = 0
    for x, _ in batches:
        x.sum()
        count += len(x)
    elapsed = torch.tensor([time.perf_counter() - started, float(count)], dtype=torch.float64)
    dist.all_reduce(elapsed[:1], op=dist.ReduceOp.MAX)
    dist.all_reduce(elapsed[1:])
    return float(elapsed[0]), int(elapsed[1])


def _throughput_job(rounds: int, num_train: int) -> dict[str, list[float]]:
    multiprocessing.set_start_method("fork", force=True)  # DataLoader workers: fork, as under torchrun
    data = make_digits(num_train, seed=1234)
    results: dict[str, list[float]] = {}
    for r in range(rounds):
        for variant in ("map", "stream") if r % 2 == 0 else ("stream", "map"):
            for workers in (0, 2):
                seconds, samples = _epoch(variant, data, workers, epoch=r)
                results.setdefault(f"{variant}/{workers}", []).append(samples / seconds)
    return results


def _agreement_job(rounds: int, num_train: int) -> dict[str, list[float]]:
    """Per-batch wall time of the same stream read with no agreement, or one all_reduce per 8 or per 1 steps."""
    data = make_digits(num_train, seed=1234)
    env, results = read_dist_env(), {}
    for r in range(rounds):
        for window in (0, 8, 1) if r % 2 == 0 else (1, 8, 0):
            loader = build_stream_loader(TensorStream(*data), env=env, batch_size=64, window_steps=window or 1)
            batches = loader.stream_epochs
            batches.start_epoch(r)
            # the loader itself: the same batches (less the workers' end-of-share markers), no collective
            if not window:
                batches = (item for item in loader if isinstance(item, (list, tuple)))
            dist.barrier()
            started, count = time.perf_counter(), 0
            for x, _ in batches:
                x.sum()
                count += 1
            name = f"window {window}" if window else "no agreement"
            results.setdefault(name, []).append((time.perf_counter() - started) / count * 1e6)
    box = torch.zeros(1, dtype=torch.int64)
    for _ in range(2000):
        started = time.perf_counter()
        dist.all_reduce(box, op=dist.ReduceOp.MIN)
        results.setdefault("one all_reduce(MIN)", []).append((time.perf_counter() - started) * 1e6)
    return results


def _summary(name: str, values: list[float]) -> dict[str, Any]:
    return {"name": name, "median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-train", type=int, default=12000)
    parser.add_argument("--parts", default="throughput,agreement", help="which measurements, comma-separated")
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args()
    with load_printed():
        measure(args)


def measure(args: argparse.Namespace) -> None:
    report: dict[str, Any] = {"throughput": {}, "agreement": {}}
    if "throughput" in args.parts:
        print(
            f"samples/s, one epoch of {args.num_train} digits, per-rank "
            f"batch 64; median (min..max) of {args.rounds} rounds"
        )
        print(f"{'ranks':>5} {'workers':>7} {'map':>22} {'stream':>22} {'stream/map':>20}")
    for ranks in (1, 2) if "throughput" in args.parts else ():
        job = run_on_ranks(_throughput_job, world_size=ranks, args=(args.rounds, args.num_train), timeout=3600)[0]
        for workers in (0, 2):
            m, s = job[f"map/{workers}"], job[f"stream/{workers}"]
            ratios = [b / a for a, b in zip(m, s)]
            report["throughput"][f"{ranks}x{workers}"] = [
                _summary("map", m),
                _summary("stream", s),
                _summary("ratio", ratios),
            ]
            print(f"{ranks:>5} {workers:>7} {_fmt(m, 0):>22} {_fmt(s, 0):>22} {_fmt(ratios, 3):>20}")
    job = {}
    if "agreement" in args.parts:
        job = run_on_ranks(_agreement_job, world_size=2, args=(args.rounds, args.num_train), timeout=3600)[0]
    print(
        "\nus per batch, 2 ranks, 0 workers: the loader alone, and StreamEpochs agreeing every data.stream_window steps"
    )
    for name, values in job.items():
        report["agreement"][name] = _summary(name, values)
        paired = [v / b for v, b in zip(values, job["no agreement"])] if name.startswith("window") else None
        print(f"{name:>19}: {_fmt(values, 1)}" + (f"   x loader alone (paired): {_fmt(paired, 3)}" if paired else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def _fmt(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})"


if __name__ == "__main__":
    main()
