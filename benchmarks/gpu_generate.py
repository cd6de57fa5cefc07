"""Generation on a GPU in bf16, with and without the KV cache, at batch 1 and 8: tokens/s at Llama 3.2 1B's shape.

    python -m benchmarks.gpu_generate                                       # llama3.2-1b, random weights, CUDA
    python -m benchmarks.gpu_generate --batches 1,8 --new-tokens 256 --rounds 2 --json gpu-generate.json
    python -m benchmarks.gpu_generate --device cpu --tiny                   # the same code path, a tiny Llama, seconds
    python -m benchmarks.gpu_generate --device cpu --tiny --weights fp32    # exact: the cache changes no token

ddpkit's ``gpt`` at a Llama preset (``--preset``, default ``llama3.2-1b``: 1.24B parameters; ``--tiny``: two
blocks of width 32) with random weights, built on the device, continues ``--prompt-len`` random tokens
greedily (temperature 0) for ``--new-tokens`` tokens, each way alternating with the others over ``--rounds``:

* ``--weights`` (comma-separated): ``fp32+autocast``, what ``ddpkit generate`` does on a GPU (fp32 weights,
  every forward under bf16 autocast, so each one casts the weights again; the cache is fp32, the weights'
  dtype); ``bf16``, the weights cast to bf16 (``model.to(torch.bfloat16)``; a bf16 cache); ``fp32``, no bf16
  at all (the CPU check's exact way);
* batch 1: ``ddpkit.models.generation.generate`` itself (``use_cache`` on and off); batch B > 1: this
  script's loop over B different prompts, because ``generate`` takes one prompt: the calls ``generate``
  makes (``model.make_cache(B)``, ``model(feed, cache=cache)`` with the new tokens only, or the whole
  sequence without the cache; ``next_token`` at temperature 0; one host sync a token, as ``int(token)``
  is in ``generate``). Before timing, the loop at batch 1 is run against ``generate`` and the cached
  tokens against the uncached ones: ``agree`` says how many leading tokens matched (random weights give
  near-flat logits, so bf16's rounding may flip an argmax on a GPU; in fp32 on the CPU all must match).

Timed: from the prompt's forward to the last token, the device synchronized before and after. Columns:
tokens/s (batch x new tokens over that time; median over rounds, min..max), ms a step (one new token
for every sequence), and ``x no cache``, the paired ratio per round. Needs CUDA unless ``--device cpu``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import load_printed, paired, summary, table
from ddpkit.models.generation import generate, next_token
from ddpkit.models.gpt import gpt

SEED = 0
WEIGHTS = ("fp32+autocast", "bf16", "fp32")
#: ``--tiny``: a Llama small enough for a CPU, with every part the preset has (grouped heads, tied output).
TINY = {"arch": "llama", "vocab_size": 257, "dim": 32, "depth": 2, "heads": 2, "kv_heads": 1, "max_len": 128}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3.2-1b", help="a Llama-family preset (default llama3.2-1b)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama, for a run of the code path on a CPU")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--weights", default="fp32+autocast,bf16", help=f"comma-separated, of {', '.join(WEIGHTS)}")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 16; --tiny: 8)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated (default 256; --tiny: 16)")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds (default 2)")
    parser.add_argument("--json", default=None, help="also write every measurement here (after every round)")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    args.weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    if not args.weights or set(args.weights) - set(WEIGHTS):
        parser.error(f"--weights: choose from {', '.join(WEIGHTS)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 for b in args.batches):
        parser.error("--batches: every batch size must be at least 1")
    args.prompt_len = args.prompt_len or (8 if args.tiny else 16)
    args.new_tokens = args.new_tokens or (16 if args.tiny else 256)
    return args


def build(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    """The model in each ``--weights`` way: one set of random weights, built on the device (no host initialisation)."""
    torch.manual_seed(SEED)
    with torch.device(args.device):
        model = gpt(**TINY) if args.tiny else gpt(args.preset)
    model.eval()
    models = {}
    for way in args.weights:
        models[way] = copy.deepcopy(model).to(torch.bfloat16) if way == "bf16" else model
    return models


def autocast_for(way: str, device: torch.device) -> Callable[[], Any] | None:
    """``generate``'s ``autocast``: bf16 autocast for ``fp32+autocast`` (``ddpkit generate`` on a GPU), else None."""
    if way != "fp32+autocast":
        return None
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


@torch.no_grad()
def batched_greedy(
    model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, *, cache: bool, autocast: Callable[[], Any] | None
) -> torch.Tensor:
    """``[B, new_tokens]`` greedy ids after ``prompts`` ``[B, T]``: ``generate``'s calls for B prompts at once."""
    tokens = prompts
    kv = model.make_cache(prompts.shape[0]) if cache else None
    feed = tokens
    chosen = []
    for _ in range(new_tokens):
        with autocast() if autocast is not None else contextlib.nullcontext():
            logits = model(feed, cache=kv) if kv is not None else model(tokens)
        token = next_token(logits[:, -1], temperature=0, top_k=None, top_p=None, generator=None)
        # generate's int(token): the host reads every token (to stop at an end-of-text)
        chosen.append(token.cpu())
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        feed = token[:, None]
    return torch.stack(chosen, dim=1)


def run_cell(
    model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, *, cache: bool, autocast: Callable[[], Any] | None
) -> tuple[float, list[list[int]]]:
    """Seconds for one generation of ``new_tokens`` for every prompt, and the ids: ``generate`` at batch 1."""
    device = prompts.device
    _sync(device)
    started = time.perf_counter()
    if prompts.shape[0] == 1:
        out = [
            list(
                generate(
                    model,
                    prompts[0].tolist(),
                    max_new_tokens=new_tokens,
                    temperature=0,
                    use_cache=cache,
                    autocast=autocast,
                )
            )
        ]
    else:
        out = batched_greedy(model, prompts, new_tokens, cache=cache, autocast=autocast).tolist()
    _sync(device)
    return time.perf_counter() - started, out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _leading_match(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(models: dict[str, torch.nn.Module], prompts: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Leading tokens that match, per way: the batch loop against ``generate`` (batch 1), cache against none."""
    agree = {}
    for way, model in models.items():
        autocast = autocast_for(way, prompts.device)
        one = prompts[:1]
        _, by_generate = run_cell(model, one, args.new_tokens, cache=True, autocast=autocast)
        by_loop = batched_greedy(model, one, args.new_tokens, cache=True, autocast=autocast).tolist()
        _, uncached = run_cell(model, one, args.new_tokens, cache=False, autocast=autocast)
        agree[way] = {
            "tokens": args.new_tokens,
            "loop_vs_generate": _leading_match(by_loop[0], by_generate[0]),
            "cache_vs_none": _leading_match(by_generate[0], uncached[0]),
        }
    return agree


def cell_key(way: str, batch: int, cache: bool) -> str:
    return f"{way} batch {batch} {'cache' if cache else 'no cache'}"


def measure(
    models: dict[str, torch.nn.Module], prompts: torch.Tensor, args: argparse.Namespace, saved: Callable[..., None]
) -> dict[str, list[float]]:
    """tokens/s of every (way, batch, cache) cell over the rounds, the cells' order reversed every other round."""
    cells = [(way, batch, cache) for way in models for batch in args.batches for cache in (True, False)]
    for way, batch, cache in cells:
        # warm: cuBLAS handles, the allocator's blocks, the cache's first buffers
        run_cell(models[way], prompts[:batch], 4, cache=cache, autocast=autocast_for(way, prompts.device))
    rates: dict[str, list[float]] = {cell_key(*cell): [] for cell in cells}
    for r in range(args.rounds):
        for way, batch, cache in cells if r % 2 == 0 else cells[::-1]:
            seconds, _ = run_cell(
                models[way], prompts[:batch], args.new_tokens, cache=cache, autocast=autocast_for(way, prompts.device)
            )
            key = cell_key(way, batch, cache)
            rates[key].append(batch * args.new_tokens / seconds)
            print(f"[gpu_generate] round {r + 1}/{args.rounds} {key}: {rates[key][-1]:,.1f} tokens/s", flush=True)
        saved(rates)
    return rates


def generation_table(rates: dict[str, list[float]], agree: dict[str, Any], args: argparse.Namespace, title: str) -> str:
    rows = []
    for key, values in rates.items():
        way, _, rest = key.partition(" batch ")
        batch = int(rest.split()[0])
        cached = not key.endswith("no cache")
        per_s = summary(values)
        ratio = paired(values, rates[cell_key(way, batch, False)])
        step_ms = 1000 * batch / per_s.median
        matched = agree[way]
        rows.append(
            [
                way,
                str(batch),
                "yes" if cached else "no",
                f"{per_s.median:,.1f}",
                per_s.spread(1),
                f"{step_ms:.2f}",
                f"{ratio.median:.2f}",
                ratio.spread(2),
                f"{matched['loop_vs_generate']}/{matched['tokens']}, {matched['cache_vs_none']}/{matched['tokens']}",
            ]
        )
    headers = ["weights", "batch", "KV cache", "tokens/s", "min..max", "ms/step", "x no cache", "min..max"]
    return table(title, [*headers, "agree: loop=generate, cache=none"], rows)


def describe(device: torch.device) -> str:
    """The GPU (or CPU), CUDA and torch version and date, as beside every figure."""
    where = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if device.type == "cuda" else "CPU"
    return f"{where}, torch {torch.__version__}, {datetime.date.today().isoformat()}"


def main(argv: list[str]) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_generate: --device cuda needs a CUDA GPU; --device cpu --tiny runs the code path", file=sys.stderr)
        return 2
    models = build(args)
    model = next(iter(models.values()))
    vocab = model.vocab_size
    generator = torch.Generator(device).manual_seed(SEED)
    prompts = torch.randint(0, vocab, (max(args.batches), args.prompt_len), device=device, generator=generator)
    params = sum(p.numel() for p in model.parameters())
    title = (
        f"{describe(device)}\n{'tiny Llama' if args.tiny else args.preset} ({params:,} parameters), greedy, prompt "
        f"{args.prompt_len} tokens, {args.new_tokens} new tokens, {args.rounds} rounds"
    )
    agree: dict[str, Any] = {}

    def saved(rates: dict[str, list[float]], *, complete: bool = False) -> None:
        # rewritten after every round: a run cut short by its time limit keeps the rounds it finished
        if args.json:
            written = {"machine": title, "args": vars(args), "complete": complete, "agree": agree, "rates": rates}
            Path(args.json).write_text(json.dumps(written, indent=1))

    with load_printed():
        agree.update(agreement(models, prompts, args))
        print(f"[gpu_generate] leading tokens that agree: {agree}", flush=True)
        rates = measure(models, prompts, args, saved)
        print(generation_table(rates, agree, args, title), flush=True)
    saved(rates, complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
