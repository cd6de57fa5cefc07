"""Per-document attention's cost per training step against plain causal attention, on the built-in ``gpt``.

    python -m benchmarks.document_mask                                            # gpt2 (124M), context 1,024, CPU
    python -m benchmarks.document_mask --dim 64 --depth 2 --heads 2 --vocab-size 257 --seq-len 256 --rounds 3
    python -m benchmarks.document_mask --device cuda --batch 8 --rounds 5         # a GPU: FlexAttention

Three variants train the same model on the same random windows, in alternating order over
``--rounds`` rounds (``--steps`` AdamW steps each, after one warm-up step per variant):

* ``causal``: plain causal attention (``scaled_dot_product_attention(is_causal=True)``: flash attention on a GPU);
* ``documents``: ``data.kwargs.document_mask`` (:mod:`ddpkit.models.document_mask`): FlexAttention with a
  block mask on a GPU when torch has it, else SDPA with a boolean ``[B, 1, T, T]`` mask;
* ``documents+positions``: the same with ``restart_positions``.

The windows hold documents of random length (mean ``--doc-len`` tokens) separated by the end-of-text
id. Columns: ``ms/step`` (median over rounds of each round's median step) and the ratio to
``causal`` (median of the per-round ratios, so a loaded machine's drift cancels).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from ddpkit.models.gpt import gpt

VARIANTS = {"causal": None, "documents": False, "documents+positions": True}


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2")
    for flag in ("--dim", "--depth", "--heads", "--vocab-size"):
        parser.add_argument(flag, type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--doc-len", type=int, default=256, help="mean document length in tokens")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    start = time.perf_counter()
    logits = model(x[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    args = _args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = gpt(
        args.preset, dim=args.dim, depth=args.depth, heads=args.heads, vocab_size=args.vocab_size, max_len=args.seq_len
    ).to(device)
    eot = min(model.vocab_size - 1, 256) if args.vocab_size else 50256
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, eot, (args.batch, args.seq_len + 1), device=device)
    x[torch.rand(x.shape, device=device) < 1 / args.doc_len] = eot  # documents of mean length doc_len
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for name, restart in VARIANTS.items():  # warm-up: compiles FlexAttention once per mask shape on a GPU
        model.documents = None if restart is None else {"eot": eot, "restart_positions": restart}
        _step(model, optimizer, x)
    for r in range(args.rounds):
        for name in list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]:
            restart = VARIANTS[name]
            model.documents = None if restart is None else {"eot": eot, "restart_positions": restart}
            times[name].append(statistics.median(_step(model, optimizer, x) for _ in range(args.steps)))
    print(
        f"document mask, {args.preset if not args.dim else f'dim {args.dim} depth {args.depth}'}, batch "
        f"{args.batch} x seq_len {args.seq_len}, documents of ~{args.doc_len} tokens, {device.type}, "
        f"{args.rounds} rounds of {args.steps} steps"
    )
    print(f"{'variant':22} {'ms/step':>10} {'x causal':>9}")
    for name, values in times.items():
        ratio = statistics.median(v / c for v, c in zip(values, times["causal"]))
        print(f"{name:22} {statistics.median(values):10.1f} {ratio:9.2f}")


if __name__ == "__main__":
    main()
