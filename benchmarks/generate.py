"""Generation with and without the KV cache, and the cost of weight-decay parameter groups (issue 44).

    python -m benchmarks.generate                          # GPT-2 124M shape, CPU, 256 new tokens, 3 rounds
    python -m benchmarks.generate --dim 64 --depth 2 --heads 2 --new-tokens 32 --rounds 2   # a quick check
    python -m benchmarks.generate --json benchmarks/generate.json

(From the repository root, as every benchmark: see ``benchmarks/__init__.py``.)

**Generation.** ddpkit's ``gpt`` with the ``gpt2`` preset's shape (vocab 50,304, dim 768, 12 blocks of
12 heads, context 1,024) and random weights, on the CPU in fp32, continues a 16-token prompt greedily
(``temperature 0``: the two ways give the same tokens, which is checked) for ``--new-tokens`` tokens,
with the KV cache (one token a forward) and without (the whole sequence each forward), the two
alternating over ``--rounds`` rounds. Columns: tokens/s (median over rounds, min..max) and the ratio
cached / uncached (paired, per round). The goal is >= 5x at 256 tokens (nanoGPT#76: 81.6 s -> 11.0 s).

**Decay groups.** One AdamW step over the same model's parameters (random gradients), as one group
(``optim.decay: all``, the earlier rule) and as the two groups of the default ``decay: matrices``,
alternating over ``--steps`` steps per round: ms per step, medians, and the ratio (expected ~1: a
group is a separate ``foreach`` call over fewer tensors, the same arithmetic).

Each run prints the load average before and after: timings on a shared machine are noise, ratios hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from ddpkit.config.loader import load_config
from ddpkit.models.generation import generate
from ddpkit.models.gpt import GPT
from ddpkit.training.optim import build_optimizer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per round for the decay groups")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", help="also write the results here")
    return parser


def tokens_per_s(model: GPT, prompt: list[int], n: int, *, cache: bool) -> tuple[float, list[int]]:
    started = time.perf_counter()
    out = list(generate(model, prompt, max_new_tokens=n, temperature=0, use_cache=cache))
    return len(out) / (time.perf_counter() - started), out


def generation(model: GPT, args: argparse.Namespace) -> dict[str, object]:
    prompt = list(range(16))
    rates: dict[str, list[float]] = {"cache": [], "no_cache": []}
    same = True
    for index in range(args.rounds):
        order = ("cache", "no_cache") if index % 2 == 0 else ("no_cache", "cache")
        outputs = {}
        for way in order:
            rate, outputs[way] = tokens_per_s(model, prompt, args.new_tokens, cache=way == "cache")
            rates[way].append(rate)
        same &= outputs["cache"] == outputs["no_cache"]
    ratios = [c / u for c, u in zip(rates["cache"], rates["no_cache"])]
    return {
        "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "range": rates,
        "ratio_median": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "greedy_identical": same,
    }


def decay_groups(model: GPT, args: argparse.Namespace) -> dict[str, object]:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizers = {
        decay: build_optimizer(
            model, load_config({"optim": {"name": "adamw", "lr": 1e-4, "weight_decay": 0.1, "decay": decay}}).optim
        )
        for decay in ("all", "matrices")
    }
    times: dict[str, list[float]] = {k: [] for k in optimizers}
    for index in range(args.rounds):
        for decay in ("all", "matrices") if index % 2 == 0 else ("matrices", "all"):
            optimizers[decay].step()  # warm: the moments exist
            started = time.perf_counter()
            for _ in range(args.steps):
                optimizers[decay].step()
            times[decay].append((time.perf_counter() - started) / args.steps * 1e3)
    ratios = [m / a for m, a in zip(times["matrices"], times["all"])]
    return {
        "ms_per_step": {k: statistics.median(v) for k, v in times.items()},
        "range": times,
        "groups": {k: len(o.param_groups) for k, o in optimizers.items()},
        "ratio_median": statistics.median(ratios),
    }


def main() -> None:
    args = _parser().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    torch.manual_seed(0)
    model = GPT(vocab_size=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads, max_len=1024).eval()
    gen = generation(model, args)
    groups = decay_groups(model, args)
    result = {
        "shape": vars(args),
        "threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "generation": gen,
        "decay_groups": groups,
    }
    t = gen["tokens_per_s"]
    print(
        f"generation, {args.new_tokens} new tokens, dim {args.dim} x {args.depth} blocks, vocab {args.vocab}, "
        f"{torch.get_num_threads()} threads, load {load_before:.2f} -> {result['load_after']:.2f}"
    )
    for way, label in (("cache", "with the KV cache"), ("no_cache", "without")):
        rounds = ", ".join(f"{r:.1f}" for r in gen["range"][way])
        print(f"  {label:<18} {t[way]:8.1f} tokens/s   (rounds: {rounds})")
    print(
        f"  ratio {gen['ratio_median']:.2f}x (min {gen['ratio_range'][0]:.2f}, max {gen['ratio_range'][1]:.2f}); "
        f"greedy tokens identical: {gen['greedy_identical']}"
    )
    ms = groups["ms_per_step"]
    print(
        f"AdamW step: decay all (1 group) {ms['all']:.2f} ms, decay matrices ({groups['groups']['matrices']} groups) "
        f"{ms['matrices']:.2f} ms, ratio {groups['ratio_median']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
