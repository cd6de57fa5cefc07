"""A hand-written loop against ddpkit on one GPU: resnet50, bf16 autocast, channels_last, side by side.

    python scripts/bench_gpu.py                         # 3 alternating rounds of 60 steps (20 warm-up)
    python scripts/bench_gpu.py --rounds 5 --batch-size 128 --workers 8

One process and one CUDA GPU, so no DDP on either side (a world of one: the Trainer wraps nothing
either). Both train torchvision's resnet50 (1000 classes) from the same seed on the same
in-memory random images (``ddpkit.data.datasets.synthetic``, 16 batches, cycled), with SGD and
momentum, bf16 autocast and a channels_last model and batch, reading through a DataLoader with
pinned memory and ``--workers`` worker processes. ddpkit is the real ``Trainer`` with its defaults
(progress display, health checks, watchdog, recovery state), configured to match.

Timing: the GPU is synchronized after the warm-up steps and after the last step (and nowhere
else, so the host may run ahead as it does in training); images/s is the timed steps' images over
that interval. Rounds alternate the order; the ratio is paired (same round). Needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ddpkit.bench.timed import TimedTrainer
from ddpkit.data.datasets import synthetic
from ddpkit.registry import MODELS

SEED, LR, MOMENTUM, BATCHES = 0, 0.01, 0.9, 16


def hand_written(steps: int, warmup: int, batch: int, workers: int, workdir: Path) -> float:
    """Seconds for the steps after ``warmup``: the loop a user would write."""
    torch.manual_seed(SEED)
    train_set, _ = synthetic(size=BATCHES * batch, shape=(3, 224, 224), num_classes=1000)
    model = MODELS.build("resnet50", key="model.name", kwargs={"num_classes": 1000}).to("cuda", memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loader = DataLoader(train_set, batch_size=batch, shuffle=True, drop_last=True, pin_memory=True, num_workers=workers,
                        persistent_workers=True, generator=torch.Generator().manual_seed(SEED))
    model.train()
    step, started = 0, 0.0
    while step < steps:
        for x, y in loader:
            x = x.to("cuda", non_blocking=True).contiguous(memory_format=torch.channels_last)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y.to("cuda", non_blocking=True))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == warmup:
                torch.cuda.synchronize()
                started = time.perf_counter()
            if step == steps:
                break
    torch.cuda.synchronize()
    return time.perf_counter() - started


class _SyncedTrainer(TimedTrainer):
    """Synchronizes the GPU after the warm-up and the last step only, as the hand-written loop does."""

    warmup, steps, started, elapsed = 0, 0, 0.0, 0.0

    def on_step_end(self, step: int) -> None:
        if step == self.warmup:
            torch.cuda.synchronize()
            self.started = time.perf_counter()
        elif step == self.steps:
            torch.cuda.synchronize()
            self.elapsed = time.perf_counter() - self.started
        super().on_step_end(step)


def ddpkit_trainer(steps: int, warmup: int, batch: int, workers: int, workdir: Path) -> float:
    config = {
        "run": {"name": "gpu", "output_dir": str(workdir / "ddpkit"), "seed": SEED},
        "data": {"name": "synthetic", "batch_size": batch, "num_workers": workers, "pin_memory": True,
                 "kwargs": {"size": BATCHES * batch, "shape": [3, 224, 224], "num_classes": 1000}},
        "model": {"name": "resnet50", "kwargs": {"num_classes": 1000}},
        "optim": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        "train": {"epochs": None, "max_steps": steps, "precision": "bf16", "channels_last": True, "eval_every": 10**9},
        "checkpoint": {"every_epochs": None, "resume": "none"},
        "dist": {"device": "cuda"},
    }
    trainer = _SyncedTrainer(config)
    trainer.warmup, trainer.steps = warmup, steps
    with contextlib.redirect_stderr(io.StringIO()):  # the progress display stays on, off the screen
        trainer.fit()
    return trainer.elapsed


VARIANTS = {"hand-written": hand_written, "ddpkit": ddpkit_trainer}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="steps per run, warm-up included (default 60)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4, help="DataLoader worker processes, both loops (default 4)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: needs a CUDA GPU (none is visible here)", file=sys.stderr)
        return 2
    timed = args.steps - args.warmup
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        for r in range(args.rounds):
            order = list(VARIANTS)[r % 2:] + list(VARIANTS)[:r % 2]
            for name in order:
                s = VARIANTS[name](args.steps, args.warmup, args.batch_size, args.workers, Path(tmp) / f"r{r}")
                seconds[name].append(s)
                print(f"[gpu] round {r + 1}/{args.rounds} {name}: {timed * args.batch_size / s:.0f} images/s", flush=True)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: resnet50, bf16, channels_last, batch {args.batch_size}, {args.workers} workers, "
          f"{timed} timed steps after {args.warmup}, {args.rounds} rounds")
    hand = seconds["hand-written"]
    for name, runs in seconds.items():
        ratios = [s / h for s, h in zip(runs, hand)]
        print(f"{name:>13}: {timed * args.batch_size / statistics.median(runs):8.0f} images/s (median), "
              f"time x hand {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
