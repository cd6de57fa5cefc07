"""Activation checkpointing's cost and saving: peak memory and step time with and without it.

    python -m benchmarks.activation_checkpointing                                   # gpt2 (124M) at context 1,024, CPU
    python -m benchmarks.activation_checkpointing --dim 64 --depth 2 --heads 2 --seq-len 128 --rounds 2   # a quick look
    python -m benchmarks.activation_checkpointing --device cuda --batch 8           # on a GPU

Each (variant, round) runs in a fresh process, the variants alternating in order from round to
round, so neither inherits the other's allocator state: the built-in ``gpt`` (``--preset gpt2`` by
default, or the shape given) trains ``--steps`` AdamW steps on random tokens of ``--batch`` x
``--seq-len`` after one warm-up step, with ``train.activation_checkpointing`` off and on
(:func:`ddpkit.parallel.activation_checkpointing.apply_activation_checkpointing`, as the Trainer
applies it).

Columns: ``ms/step`` (median over steps, then over rounds) and its ratio to ``off``; ``kept MiB``:
what autograd keeps for the backward pass during one forward (a ``saved_tensors_hooks`` count, exact
and the same on every machine: the activation memory checkpointing removes); ``peak MiB``: the
process's peak resident memory (``ru_maxrss``; on CUDA, ``torch.cuda.max_memory_allocated``), which
also holds the weights, the optimizer state and the interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch.nn import functional as F

from ddpkit.models.gpt import gpt
from ddpkit.parallel.activation_checkpointing import apply_activation_checkpointing

VARIANTS = ("off", "on")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2", help="a gpt preset (default gpt2); shape flags override it")
    for flag in ("--dim", "--depth", "--heads", "--vocab-size"):
        parser.add_argument(flag, type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _child(args: argparse.Namespace) -> dict:
    """One variant in this process: step times, bytes kept for backward, peak memory."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = gpt(
        args.preset, dim=args.dim, depth=args.depth, heads=args.heads, vocab_size=args.vocab_size, max_len=args.seq_len
    ).to(device)
    apply_activation_checkpointing(model, args.child == "on")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, model.vocab_size, (args.batch, args.seq_len + 1), device=device)
    kept: list[int] = []
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: kept.append(t.numel() * t.element_size()) or t, lambda t: t
        )
        with hooks if step == 0 else contextlib.nullcontext():  # count what the first forward keeps
            logits = model(x[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:  # step 0 is the warm-up
            times.append((time.perf_counter() - start) * 1e3)
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {"ms": statistics.median(times), "kept_mib": sum(kept) / 2**20, "peak_mib": peak / 2**20}


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return
    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    passed = list(argv if argv is not None else sys.argv[1:])  # each child gets the same flags
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            command = [sys.executable, "-m", "benchmarks.activation_checkpointing", *passed, "--child", variant]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            rows[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r} {variant}: {rows[variant][-1]}", file=sys.stderr)
    base = statistics.median(row["ms"] for row in rows["off"])
    shape = f"preset {args.preset}, dim {args.dim}, depth {args.depth}, heads {args.heads}" if args.dim else args.preset
    print(
        f"activation checkpointing, {shape}, batch {args.batch} x seq_len {args.seq_len}, {args.device}, "
        f"{args.rounds} rounds of {args.steps} steps"
    )
    print(f"{'variant':8} {'ms/step':>10} {'x off':>7} {'kept MiB':>10} {'peak MiB':>10}")
    for variant, results in rows.items():
        ms = statistics.median(row["ms"] for row in results)
        print(
            f"{variant:8} {ms:10.1f} {ms / base:7.2f} {results[0]['kept_mib']:10.1f} "
            f"{statistics.median(row['peak_mib'] for row in results):10.1f}"
        )


if __name__ == "__main__":
    main()
