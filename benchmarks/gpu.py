"""A hand-written loop against ddpkit on one GPU: resnet50, bf16 autocast, channels_last, side by side.

    python -m benchmarks.gpu                         # 3 alternating rounds of 60 steps (20 warm-up)
    python -m benchmarks.gpu --rounds 5 --batch-size 128 --workers 8

One process and one CUDA GPU, so no DDP on either side (a world of one: the Trainer wraps nothing
either). Both train torchvision's resnet50 (1000 classes) from the same seed on the same
in-memory random images (``ddpkit.data.datasets.synthetic``, 16 batches, cycled), with SGD and
momentum, bf16 autocast and a channels_last model and batch, reading through a DataLoader with
pinned memory and ``--workers`` worker processes. The hand-written side is
``benchmarks.workloads.train_by_hand`` with ``device="cuda"``. ddpkit is the real ``Trainer`` with its defaults
(progress display, health checks, watchdog, recovery state), configured to match.

Timing: the GPU is synchronized after the warm-up steps and after the last step (and nowhere
else, so the host may run ahead as it does in training); images/s is the timed steps' images over
that interval. Rounds alternate the order; the ratio is paired (same round). Needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.workloads import load_printed, loader_for, paired, rotated, table, train_by_hand
from ddpkit.bench.report import Stats
from ddpkit.bench.timed import TimedTrainer
from ddpkit.data.datasets import synthetic
from ddpkit.registry import MODELS

SEED, LR, MOMENTUM, BATCHES = 0, 0.01, 0.9, 16


def hand_written(steps: int, warmup: int, batch: int, workers: int, workdir: Path) -> float:
    """Seconds for the steps after ``warmup``: the loop a user would write."""
    torch.manual_seed(SEED)
    train_set, _ = synthetic(size=BATCHES * batch, shape=(3, 224, 224), num_classes=1000)
    model = MODELS.build("resnet50", key="model.name", kwargs={"num_classes": 1000})
    loader = loader_for(train_set, 0, 1, batch_size=batch, num_workers=workers, pin_memory=True)
    started = [0.0, 0.0]

    def synced(step: int) -> None:  # the GPU synchronized after the warm-up and the last step only
        if step in (warmup, steps):
            torch.cuda.synchronize()
            started[step == steps] = time.perf_counter()

    train_by_hand(
        model,
        loader,
        rank=0,
        world_size=1,
        max_steps=steps,
        lr=LR,
        momentum=MOMENTUM,
        device="cuda",
        channels_last=True,
        bf16=True,
        on_step=synced,
    )
    return started[1] - started[0]


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
        "data": {
            "name": "synthetic",
            "batch_size": batch,
            "num_workers": workers,
            "pin_memory": True,
            "kwargs": {"size": BATCHES * batch, "shape": [3, 224, 224], "num_classes": 1000},
        },
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
    with load_printed(), tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        for r in range(args.rounds):
            for name in rotated(list(VARIANTS), r):
                s = VARIANTS[name](args.steps, args.warmup, args.batch_size, args.workers, Path(tmp) / f"r{r}")
                seconds[name].append(s)
                print(
                    f"[gpu] round {r + 1}/{args.rounds} {name}: {timed * args.batch_size / s:.0f} images/s", flush=True
                )
        rows = []
        for name, runs in seconds.items():
            ratio = paired(runs, seconds["hand-written"])
            rows.append(
                [name, f"{timed * args.batch_size / Stats.of(runs).median:.0f}", f"{ratio.median:.3f}", ratio.spread(3)]
            )
        print(
            table(
                f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: "
                f"resnet50, bf16, channels_last, batch {args.batch_size}, "
                f"{args.workers} workers, {timed} timed steps after {args.warmup}, {args.rounds} rounds",
                ["variant", "images/s (median)", "time x hand (paired)", "min..max"],
                rows,
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
