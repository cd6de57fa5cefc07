"""PSS of an in-memory dataset over 2 ranks x 2 DataLoader workers: a plain Python list vs SharedDataset.

    python -m benchmarks.shared_memory [--records 100000] [--epochs 4]

Each of 2 Gloo ranks (real processes, ddpkit.testing.run_on_ranks) builds the dataset, then reads it
through ddpkit's training loader with 2 forked workers for ``--epochs`` shuffled epochs (every
worker touches most records, as in a real run). With every process still alive, rank 0 sums the
proportional set size (``Pss:`` in ``/proc/<pid>/smaps_rollup``) over the 2 ranks and their 4
workers. The same run with a 100-record dataset is the baseline (torch, the interpreter, the
loaders) and is subtracted. Records are ``{"id": str, "tokens": int32[256], "label": int}``, about
1.2 kB each; "data size" is their pickled size (the shared segment's size).
"""

from __future__ import annotations

import argparse
import gc
import pickle
from pathlib import Path

import numpy as np

from benchmarks.workloads import load_average
from ddpkit.testing import run_on_ranks


def make_records(count: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {"id": f"sample-{i:08d}", "tokens": rng.integers(0, 50_000, 256, dtype=np.int32), "label": i % 10}
        for i in range(count)
    ]


def _collate(batch: list) -> int:
    return len(batch)


def _pss_kb(pid: int) -> int:
    line = next(line for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines() if line.startswith("Pss:"))
    return int(line.split()[1])


def _measure(kind: str, count: int, epochs: int) -> dict | None:
    import torch.distributed as dist

    from ddpkit.data.epochs import start_epoch
    from ddpkit.data.loaders import build_train_loader
    from ddpkit.data.shared import SharedDataset
    from ddpkit.distributed.env import read_dist_env

    env = read_dist_env()
    if kind == "plain":
        dataset = make_records(count)
    else:
        dataset = SharedDataset(lambda: make_records(count), name=f"bench-{kind}-{count}")
    gc.collect()
    loader = build_train_loader(dataset, env=env, batch_size=64, num_workers=2, seed=0, drop_last=False)
    loader.collate_fn = _collate
    for epoch in range(epochs):
        start_epoch(loader, epoch)
        iterator = iter(loader)
        sum(iterator)
    pids = [__import__("os").getpid(), *(w.pid for w in iterator._workers)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pids)
    total = sum(_pss_kb(pid) for group in everyone for pid in group) if env.rank == 0 else 0
    dist.barrier()  # nobody exits before rank 0 has read every process
    size = Path(dataset.path).stat().st_size if kind == "shared" else len(pickle.dumps(dataset[:1000])) * count / 1000
    return {"pss_mb": total / 1024, "processes": sum(map(len, everyone)), "data_mb": size / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    print(f"load average before: {load_average()}", flush=True)
    rows = {}
    for kind in ("plain", "shared"):
        base = run_on_ranks(_measure, world_size=2, args=(kind, 100, args.epochs), timeout=600)[0]
        full = run_on_ranks(_measure, world_size=2, args=(kind, args.records, args.epochs), timeout=600)[0]
        rows[kind] = (full["pss_mb"] - base["pss_mb"], full["data_mb"], full["processes"])
    print(f"{'dataset':<10} {'processes':>9} {'data MB':>8} {'PSS MB (minus baseline)':>24} {'x data':>7}")
    for kind, (pss, data, procs) in rows.items():
        print(f"{kind:<10} {procs:>9} {data:>8.1f} {pss:>24.1f} {pss / data:>7.2f}")
    print(f"load average after: {load_average()}", flush=True)


if __name__ == "__main__":
    main()
