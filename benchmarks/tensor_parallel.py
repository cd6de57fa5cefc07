"""Tensor parallelism on 2 Gloo ranks against a world of one and against ddp on 2 ranks (issue 58).

    .venv/bin/python -m benchmarks.tensor_parallel                  # 5 rounds x 10 timed steps
    .venv/bin/python -m benchmarks.tensor_parallel --quick          # 1 round x 2 timed steps: does it run
    .venv/bin/python -m benchmarks.tensor_parallel --json out.json  # the raw step times too
    .venv/bin/python -m benchmarks.tensor_parallel 2>/dev/null      # the table alone (the ranks log to stderr)

The model: a Llama of ddpkit's own (``arch: llama``, dim 256, 4 blocks, 8 heads, SwiGLU width 1024, vocabulary
512, untied head: 4.5M parameters) on random windows of 128 tokens, AdamW, a global batch of 8 windows a step.
Every variant trains through the real :class:`ddpkit.Trainer` (``ddpkit.testing.run_on_ranks``):

- ``one``: a world of one, the whole model, the whole batch on one process;
- ``tp2``: ``parallel.tensor: 2`` on 2 ranks: each rank holds half of every block's heads and MLP width and
  runs the whole batch through its half; four all-reduces of a ``[8, 128, 256]`` activation (1 MiB) per block and
  step (two forward, two backward), and one for the clipping norm;
- ``ddp``: 2 ranks, the whole model on each and half of the batch, one all-reduce of the gradients (17 MiB).

**Step time**: from ``on_step_end`` timestamps (the previous step's end to this one's), the Trainer's whole step;
the median over the timed steps after one warm-up step; a 2-rank variant's time is its slower rank's median.
Ratios are paired by round (``one``'s step time over the variant's: the same global batch, so the ratio of
tokens per second); the variants' order rotates from round to round. **Bytes per rank**: the parameters,
gradients and optimizer state one rank holds (:func:`ddpkit.distributed.memory.rank_bytes`) after the run.

What this machine can show: the CPU has 2 cores, so each rank gets one; tp2 halves each rank's block
arithmetic and adds 17 all-reduces of activations a step, which on Gloo over loopback cost about as much as they
save at this size. What it cannot: NVLink's bandwidth, against which Megatron-style tensor parallelism is
designed (on a GPU node the same all-reduces take microseconds), nor the memory a large model saves: the point
of T > 1 there is that half of each block fits where the whole does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import TensorDataset

import ddpkit
from benchmarks.workloads import load_average, rotated, table
from ddpkit.distributed.memory import format_bytes, rank_bytes
from ddpkit.testing import run_on_ranks

MODEL = {"arch": "llama", "vocab_size": 512, "dim": 256, "depth": 4, "heads": 8, "kv_heads": 8, "mlp_dim": 1024}
SEQ = 128
BATCH = 8
WARMUP = 1
VARIANTS = ("one", "tp2", "ddp")


def run_config(variant: str, *, steps: int, output_dir: str) -> dict[str, Any]:
    """The Trainer config of one variant: the same model, data and global batch in each."""
    cfg: dict[str, Any] = {
        "run": {"name": variant, "output_dir": output_dir, "seed": 0},
        "data": {"global_batch_size": BATCH},
        "model": {"name": "gpt", "kwargs": {**MODEL, "max_len": SEQ, "tied": False}},
        "optim": {"name": "adamw", "lr": 1e-3},
        "train": {"max_steps": steps, "log_every": steps, "clip_grad_norm": 1.0},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }
    if variant == "tp2":
        cfg["parallel"] = {"tensor": 2}
    elif variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return cfg


class TimedTrainer(ddpkit.Trainer):
    """Random token windows, one epoch of exactly ``max_steps`` global batches; each step's end time-stamped."""

    def build_datasets(self) -> tuple[TensorDataset, None]:
        samples = self.config.data.global_batch_size * self.config.train.max_steps
        tokens = torch.randint(0, MODEL["vocab_size"], (samples, SEQ + 1), generator=torch.Generator().manual_seed(0))
        return TensorDataset(tokens[:, :-1], tokens[:, 1:]), None

    def on_fit_start(self) -> None:
        self.seconds: list[float] = []
        self._last_end = time.perf_counter()

    def on_step_end(self, step: int) -> None:
        now = time.perf_counter()
        self.seconds.append(now - self._last_end)
        self._last_end = time.perf_counter()


def _fit(variant: str, steps: int, root: str) -> dict[str, Any]:
    trainer = TimedTrainer(run_config(variant, steps=steps, output_dir=f"{root}/{variant}"))
    trainer.fit()
    held = rank_bytes(trainer.placed.held, trainer.optimizer)
    return {"seconds": trainer.seconds, "bytes": dataclasses.asdict(held)}


def run_rounds(rounds: int, steps: int) -> list[dict[str, Any]]:
    """Every variant in every round (their order rotated), each with its slower rank's median step time."""
    fits = []
    for round_ in range(rounds):
        for variant in rotated(VARIANTS, round_):
            with tempfile.TemporaryDirectory(prefix="ddpkit-tp-bench-") as root:
                world = 1 if variant == "one" else 2
                ranks = run_on_ranks(_fit, world, args=(variant, steps + WARMUP, root), timeout=600)
            medians = [statistics.median(r["seconds"][WARMUP:]) for r in ranks]
            fits.append({"round": round_, "variant": variant, "step_s": max(medians), "ranks": ranks})
    return fits


def summarize(fits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant: the median step time, its ratio to ``one`` paired by round, and rank 0's bytes."""
    one = {fit["round"]: fit["step_s"] for fit in fits if fit["variant"] == "one"}
    rows = []
    for variant in VARIANTS:
        mine = [fit for fit in fits if fit["variant"] == variant]
        ratios = [one[fit["round"]] / fit["step_s"] for fit in mine]
        held = mine[0]["ranks"][0]["bytes"]
        rows.append(
            {
                "variant": variant,
                "step_ms": 1000 * statistics.median(fit["step_s"] for fit in mine),
                "speedup": statistics.median(ratios),
                "parameters": held["parameters"],
                "optimizer": held["optimizer"],
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]], *, rounds: int, steps: int) -> str:
    cells = [
        [
            row["variant"],
            f"{row['step_ms']:.1f}",
            f"{row['speedup']:.2f}",
            format_bytes(row["parameters"], exact=False),
            format_bytes(row["optimizer"], exact=False),
        ]
        for row in rows
    ]
    title = f"tensor parallelism against a world of one: {rounds} rounds x {steps} timed steps, medians"
    return table(title, ["variant", "step ms", "x one", "parameters / rank", "optimizer / rank"], cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per fit (after one warm-up step)")
    parser.add_argument("--quick", action="store_true", help="1 round x 2 timed steps")
    parser.add_argument("--json", help="also write the rows and every fit's step times here")
    args = parser.parse_args()
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.steps)
    load = [load_average()]
    fits = run_rounds(rounds, steps)
    rows = summarize(fits)
    load.append(load_average())
    print(f"load average (1, 5, 15 min) before: {load[0]}; after: {load[1]}")
    print(format_rows(rows, rounds=rounds, steps=steps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "fits": fits, "load": load, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
