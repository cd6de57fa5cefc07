"""A language model side by side: ddpkit's Trainer against a hand-written nanoGPT-style DDP loop.

    python -m benchmarks.lm                      # 2 Gloo ranks, 5 alternating rounds of 60 timed steps
    python -m benchmarks.lm --rounds 7 --steps 100 --json benchmarks/lm.json

(From the repository root, as every benchmark: see ``benchmarks/__init__.py``.)

One job of 2 Gloo ranks (one thread each) trains the same GPT (``model: {name: gpt}``: dim 128,
4 blocks, 4 heads, context 128, vocab 257) on the same token windows (the stdlib byte corpus,
``data.kwargs.corpus: stdlib``), with the same seed, AdamW (lr 3e-3, weight decay 0.1 on matrices and
embeddings), gradient clipping at 1.0 and per-rank batch (16 x 128 tokens), in alternating rounds:

* ``hand-written``: nanoGPT's loop under DDP: ``DistributedSampler``, ``logits = net(x)``,
  ``F.cross_entropy(logits.flatten(0, 1), y.flatten())``, backward, ``clip_grad_norm_``, step;
* ``ddpkit``: the config-driven Trainer with every default on (progress bar, health checks,
  crash save, memory snapshots, the loss reduced every 50 steps, ``tokens_per_s`` in each record).

Columns: ms/step (mean over the timed steps, median over rounds, range), tokens/s (global), the
paired ratio to the hand-written loop (the same round), and whether the final weights are
bitwise equal to the hand-written loop's (SHA-256 of every tensor).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.workloads import (
    SEED,
    load_printed,
    loader_for,
    paired,
    rotated,
    run_module_workers,
    table,
    weights_digest,
)
from ddpkit.bench.report import Stats, progress
from ddpkit.bench.timed import StepClock, TimedTrainer, steady_ms_per_step
from ddpkit.bench.worker import serve
from ddpkit.distributed.process_group import Runtime

MODEL = {"vocab_size": 257, "dim": 128, "depth": 4, "heads": 4, "max_len": 128}
SEQ_LEN, BATCH, LR, WEIGHT_DECAY, CLIP, WARMUP = 128, 16, 3e-3, 0.1, 1.0, 10


def hand_written(steps: int, rank: int, world_size: int, *, workdir: Path) -> tuple[StepClock, dict]:
    """nanoGPT's training loop under DDP, in the Trainer's setup order (so the weights can be bitwise equal)."""
    from ddpkit.data.tokens import tokens
    from ddpkit.models.gpt import GPT

    torch.manual_seed(SEED)
    train_set, _ = tokens(corpus="stdlib", seq_len=SEQ_LEN)  # the data, then the model: the Trainer's order
    model = GPT(**MODEL)
    net = DDP(model) if world_size > 1 else model
    decay = [p for p in model.parameters() if p.dim() >= 2]  # nanoGPT's groups: matrices and embeddings decay
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR)
    torch.manual_seed(SEED + rank)
    net.train()
    clock = StepClock()
    clock.tick()
    for step, (x, y) in enumerate(loader_for(train_set, rank, world_size, batch_size=BATCH), start=1):
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
        if step == steps:
            break
    return clock, model.state_dict()


def ddpkit_trainer(steps: int, rank: int, world_size: int, *, workdir: Path) -> tuple[StepClock, dict]:
    config = {
        "run": {"name": "lm", "output_dir": str(workdir / "ddpkit"), "seed": SEED},
        "data": {"name": "tokens", "batch_size": BATCH, "kwargs": {"corpus": "stdlib", "seq_len": SEQ_LEN}},
        "model": {"name": "gpt", "kwargs": MODEL},
        "optim": {"name": "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY},
        "train": {"max_steps": steps, "clip_grad_norm": CLIP},
        "checkpoint": {"resume": "none"},
    }
    trainer = TimedTrainer(config)
    with contextlib.redirect_stderr(io.StringIO()):  # the progress bar stays on, but off the screen
        trainer.fit()
    return trainer.clock, trainer.unwrapped_model.state_dict()


VARIANTS = {"hand-written": hand_written, "ddpkit": ddpkit_trainer}


def lm_worker(params: dict[str, Any], *, runtime: Runtime, workdir: Path) -> dict[str, Any]:
    rank, world_size, steps = runtime.env.rank, runtime.env.world_size, params["steps"] + WARMUP
    runs: dict[str, dict[str, list]] = {name: {"wall": [], "weights": []} for name in VARIANTS}
    for r in range(params["rounds"]):
        for name in rotated(list(VARIANTS), r):
            clock, final = VARIANTS[name](steps, rank, world_size, workdir=workdir / f"r{r}")
            runs[name]["wall"].append(steady_ms_per_step(clock.wall, warmup=WARMUP))
            runs[name]["weights"].append(weights_digest(final))
            if rank == 0:
                progress(f"[lm] round {r + 1} {name}: {runs[name]['wall'][-1]:.1f} ms/step")
    return {"runs": runs, "steps": params["steps"], "world_size": world_size}


def report(result: dict[str, Any]) -> str:
    runs, hand = result["runs"], result["runs"]["hand-written"]
    tokens_per_step = BATCH * SEQ_LEN * result["world_size"]
    rows = []
    for name, run in runs.items():
        wall, ratio = Stats.of(run["wall"]), paired(run["wall"], hand["wall"])
        same = [mine == theirs for mine, theirs in zip(run["weights"], hand["weights"])]
        rows.append(
            [
                name,
                f"{wall.median:.1f}",
                wall.spread(1),
                f"{tokens_per_step / wall.median * 1000:.0f}",
                f"{ratio.median:.3f}",
                ratio.spread(3),
                f"{'yes' if all(same) else 'NO'} ({sum(same)}/{len(same)})",
            ]
        )
    title = (
        f"GPT dim {MODEL['dim']} x {MODEL['depth']} blocks on the stdlib bytes: {result['world_size']} Gloo "
        f"ranks, {BATCH} x {SEQ_LEN} tokens/rank, {result['steps']} timed steps after {WARMUP}, "
        f"{len(hand['wall'])} rounds"
    )
    return table(
        title, ["variant", "ms/step", "min..max", "tokens/s", "x hand", "x hand min..max", "bitwise = hand"], rows
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return serve(argv[1], {"lm": lm_worker})
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    parser.add_argument(
        "--steps", type=int, default=60, help="timed steps per run, after 10 warm-up steps (default 60)"
    )
    parser.add_argument("--json", default=None, help="also write all measurements here")
    args = parser.parse_args(argv)
    with load_printed():
        result = run_module_workers(__spec__.name, "lm", {"rounds": args.rounds, "steps": args.steps}, nproc=2)
        print(report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
