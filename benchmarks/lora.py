"""LoRA against a full fine-tune, side by side: trainable parameters, optimizer state, checkpoint bytes, step time.

    python -m benchmarks.lora                                   # SmolLM2-135M's shape, random weights, on the CPU
    python -m benchmarks.lora --preset qwen2.5-0.5b --seq-len 512 --rounds 3
    python -m benchmarks.lora --dim 256 --depth 4 --heads 4 --kv-heads 2 --vocab-size 8192 --rounds 2   # a quick look
    python -m benchmarks.lora --device cuda --batch 8            # on a GPU

Each (variant, round) runs in a fresh process, the variants alternating in order from round to round, so
neither inherits the other's allocator or caches. The model is ddpkit's Llama family (``--preset``, or the
shape given) with random weights (nothing downloaded); ``full`` trains every parameter, ``lora`` the
adapter of ``model.lora: {r, alpha, targets}`` (default r 16 on ``all-linear``), applied with
:func:`ddpkit.models.lora.apply_lora` and the optimizer built by :func:`ddpkit.training.build_optimizer`,
as the Trainer does. ``--steps`` AdamW steps on random tokens of ``--batch`` x ``--seq-len`` after one warm-up.

Columns: ``trainable`` parameters; ``optimizer MiB``: the bytes of every tensor in the optimizer's state
after the steps (AdamW: two moments per trained parameter); ``checkpoint MiB``: ``torch.save`` of the
model's and the optimizer's ``state_dict`` as a checkpoint holds them (a LoRA model's leaves its frozen
base out); ``ms/step``: median over steps, then over rounds (and its range over rounds); ``x full``: the median (and
range) of the per-round ratios to ``full``, the two having run back to back; ``peak MiB``: the process's
peak resident memory (``ru_maxrss``; on CUDA ``max_memory_allocated``). The load average before and after
is in the title: on a shared machine the paired ratio holds better than the times.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch.nn import functional as F

from benchmarks.workloads import load_average, paired, summary, table
from ddpkit.config.lora_section import LoraConfig
from ddpkit.config.schema import ModelConfig, OptimConfig
from ddpkit.models.gpt import gpt
from ddpkit.models.lora import apply_lora
from ddpkit.training import build_optimizer

VARIANTS = ("full", "lora")
_SHAPE = ("dim", "depth", "heads", "kv_heads", "vocab_size")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m", help="a Llama-family preset; shape flags override it")
    for flag in _SHAPE:
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--r", type=int, default=16, help="the adapter's rank (model.lora.r)")
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", default="all-linear", help="all-linear, or comma-separated names: q_proj,v_proj")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _model(args: argparse.Namespace) -> torch.nn.Module:
    shape = {key: getattr(args, key) for key in _SHAPE if getattr(args, key) is not None}
    # a width of its own: no preset, the family's rules for what is not given (kv_heads = heads, the MLP width)
    family = {"arch": "llama"} if args.dim is not None else {"preset": args.preset}
    model = gpt(**family, max_len=args.seq_len, **shape)
    if args.child == "lora":
        targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
        lora = LoraConfig(r=args.r, alpha=args.alpha, targets=targets)
        model = apply_lora(model, ModelConfig(name="gpt", kwargs={"preset": args.preset}, lora=lora))
    return model.to(args.device)


def _child(args: argparse.Namespace) -> dict:
    """One variant in this process: parameters, optimizer and checkpoint bytes, step times, peak memory."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = _model(args)
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=1e-4, weight_decay=0.1))
    x = torch.randint(0, model.vocab_size, (args.batch, args.seq_len + 1), device=device)
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        logits = model(x[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:  # step 0 is the warm-up
            times.append((time.perf_counter() - start) * 1e3)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "total": sum(p.numel() for p in model.parameters()),
        "optimizer_mib": sum(t.numel() * t.element_size() for t in state) / 2**20,
        "checkpoint_mib": buffer.getbuffer().nbytes / 2**20,
        "ms": statistics.median(times),
        "peak_mib": peak / 2**20,
    }


def _table(args: argparse.Namespace, rows: dict[str, list[dict]], loads: list[str]) -> str:
    first = rows["full"][0]
    shape = ", ".join(f"{key} {getattr(args, key)}" for key in _SHAPE if getattr(args, key) is not None)
    title = (
        f"LoRA vs full fine-tune, {shape if args.dim else 'preset ' + args.preset} ({first['total']:,} parameters), "
        f"batch {args.batch} x seq_len {args.seq_len}, {args.device}, {args.rounds} rounds of {args.steps} steps; "
        f"lora r={args.r} alpha={args.alpha:g} on {args.targets}; load average before {loads[0]}, after {loads[1]}"
    )
    headers = ["variant", "trainable", "optimizer MiB", "checkpoint MiB", "ms/step", "range", "x full", "peak MiB"]
    full_ms = [row["ms"] for row in rows["full"]]
    lines = []
    for variant, results in rows.items():
        ms = summary([row["ms"] for row in results])
        # the two variants of one round ran back to back: their ratio is the least disturbed by a drifting load
        ratio = paired([row["ms"] for row in results], full_ms)
        row = results[0]
        lines.append(
            [
                variant,
                f"{row['trainable']:,}",
                f"{row['optimizer_mib']:.2f}",
                f"{row['checkpoint_mib']:.2f}",
                f"{ms.median:.1f}",
                ms.spread(1),
                f"{ratio.median:.2f} ({ratio.spread()})",
                f"{summary([r['peak_mib'] for r in results]).median:.1f}",
            ]
        )
    return table(title, headers, lines)


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return
    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    passed = list(argv if argv is not None else sys.argv[1:])  # each child gets the same flags
    loads = [load_average()]
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            command = [sys.executable, "-m", "benchmarks.lora", *passed, "--child", variant]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            rows[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r} {variant}: {rows[variant][-1]}", file=sys.stderr)
    loads.append(load_average())
    print(_table(args, rows, loads))


if __name__ == "__main__":
    main()
