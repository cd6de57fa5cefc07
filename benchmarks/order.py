"""Epoch orders side by side: memory and time to the first batch at 10^6 / 10^8 / 10^9 samples, and batches/s.

    python -m benchmarks.order [--sizes 1e6 1e8 1e9] [--rounds 5] [--skip-old-above 1e8]

Three samplers of rank 0 of 2, batches of 64 (``torch.utils.data.BatchSampler``):

* ``old``: ``torch.utils.data.DistributedSampler`` (what ddpkit used before ``data.order``):
  ``randperm(N).tolist()`` every epoch;
* ``randperm``: ddpkit's ResumableDistributedSampler with ``data.order=randperm`` (the same order,
  kept as an int64 array: 8 bytes a sample);
* ``index_free``: ``data.order=index_free`` (a keyed Feistel permutation per position).

Memory: each (sampler, N) runs in a fresh subprocess that reports its peak resident memory
(``VmHWM``) growth from before the sampler to its first batch, and how long that first batch
took. Throughput: batches/s over 2000 batches after the first, the three samplers alternating
for ``--rounds`` rounds in one process at N = 10^6; medians and ratios to ``old``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from torch.utils.data import BatchSampler, DistributedSampler

from benchmarks.workloads import child_env, load_average
from ddpkit.data.samplers import ResumableDistributedSampler

KINDS = ("old", "randperm", "index_free")


class Length:
    """A dataset that is only a length (samplers never index it)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def sampler(kind: str, n: int):
    if kind == "old":
        made = DistributedSampler(Length(n), num_replicas=2, rank=0, seed=0)
    else:
        made = ResumableDistributedSampler(Length(n), num_replicas=2, rank=0, seed=0, order=kind)
    made.set_epoch(1)
    return BatchSampler(made, batch_size=64, drop_last=True)


def _status_kb(field: str) -> int:
    return next(
        int(line.split()[1])
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith(field + ":")
    )


def first_batch(kind: str, n: int) -> None:
    """In a subprocess: peak RSS growth (MB) and seconds to the first batch."""
    before, start = _status_kb("VmHWM"), time.perf_counter()
    next(iter(sampler(kind, n)))
    print(f"{(time.perf_counter() - start):.3f} {(_status_kb('VmHWM') - before) / 1024:.1f}")


def batches_per_second(kind: str, n: int, count: int = 2000) -> float:
    batches = iter(sampler(kind, n))
    next(batches)
    start = time.perf_counter()
    for _ in range(count):
        next(batches)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e8, 1e9])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--skip-old-above", type=float, default=1e8, help="old/randperm above this need > 8 GB (10^9: ~44 GB)"
    )
    args = parser.parse_args()
    print(f"load average before: {load_average()}", flush=True)
    print(f"{'N':>6} {'sampler':>11} {'first batch s':>14} {'peak RSS +MB':>13}")
    for n in map(int, args.sizes):
        for kind in KINDS:
            if kind != "index_free" and n > args.skip_old_above:
                print(
                    f"{n:>6.0e} {kind:>11} "
                    f"{'(not run: 8 GB tensor' + (' + ~36 GB list)' if kind == 'old' else ')'):>28}"
                )
                continue
            argv = [sys.executable, "-m", __spec__.name, "--first-batch", kind, str(n)]
            out = subprocess.run(argv, capture_output=True, text=True, check=True, env=child_env()).stdout.split()
            print(f"{n:>6.0e} {kind:>11} {float(out[0]):>14.3f} {float(out[1]):>13.1f}")
    rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):  # alternating rounds: the load on a shared machine hits every sampler alike
        for kind in KINDS:
            rates[kind].append(batches_per_second(kind, 10**6))
    old = statistics.median(rates["old"])
    for kind in KINDS:
        median = statistics.median(rates[kind])
        print(
            f"batches/s at N=1e6, {kind:>10}: median {median:>9.0f} "
            f"over {args.rounds} rounds, x{median / old:.2f} of old"
        )
    print(f"load average after: {load_average()}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--first-batch":
        first_batch(sys.argv[2], int(sys.argv[3]))
    else:
        main()
