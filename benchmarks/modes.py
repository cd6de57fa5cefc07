"""Step time and per-rank bytes of parallel.mode ddp / zero1 / fsdp2 on 2 Gloo ranks, in paired rounds.

    .venv/bin/python -m benchmarks.modes                      # 5 rounds, MLP and the GPT
    .venv/bin/python -m benchmarks.modes --rounds 9 --steps 20

Each round runs every (model, mode) pair in the same two processes, the mode order rotating from
round to round, so load on a shared machine hits all modes alike. A pair builds the model as the
Trainer does (``shard_model``, ``shard_optimizer``, ``wrap_for_mode``), takes 3 warm-up steps, then
times ``--steps`` Adam steps (forward, backward, step) between barriers. Printed: the median step
time per pair, its ratio to ddp (median of the per-round ratios), and the bytes each rank holds
(parameters, gradients, optimizer state: measured tensor storage, the largest rank), with the load
average before and after.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from benchmarks.workloads import load_average
from ddpkit.testing import run_on_ranks

MODELS = {
    "mlp": (
        {"name": "mlp", "kwargs": {"in_features": 784, "hidden": [1024, 1024]}},
        lambda g: (torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)),
    ),
    "gpt": (
        {"name": "gpt", "kwargs": {"vocab_size": 512, "dim": 256, "depth": 4, "heads": 4, "max_len": 64}},
        # next-token targets
        lambda g: (lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, 512, (16, 65), generator=g)),
    ),
}
MODES = ("ddp", "zero1", "fsdp2")


def _pair(model_name: str, mode: str, steps: int) -> tuple[float, tuple[int, int, int]]:
    import torch.distributed as dist

    from ddpkit.config.loader import load_config
    from ddpkit.distributed.env import read_dist_env
    from ddpkit.distributed.memory import rank_bytes
    from ddpkit.distributed.process_group import Runtime
    from ddpkit.parallel.layout import data_parallel_for
    from ddpkit.registry import build_model
    from ddpkit.training.optim import build_optimizer

    spec, batch = MODELS[model_name]
    cfg = load_config(
        {"model": spec, "optim": {"name": "adam", "lr": 1e-3}, "train": {"epochs": 1}, "parallel": {"mode": mode}}
    )
    torch.manual_seed(0)
    runtime = Runtime(env=read_dist_env(), device=torch.device("cpu"), backend="gloo")
    way = data_parallel_for(cfg.parallel)
    model = way.shard(build_model(cfg.model), mesh=None, runtime=runtime)
    optimizer = way.shard_optimizer(build_optimizer(model.parameters(), cfg.optim))
    wrapped = way.wrap(model, runtime, cfg.ddp)
    x, y = batch(torch.Generator().manual_seed(dist.get_rank()))
    for i in range(3 + steps):
        if i == 3:
            dist.barrier()
            began = time.perf_counter()
        F.cross_entropy(wrapped(x).flatten(0, -2), y.flatten()).backward()  # the GPT's [B, T, V] logits as B*T rows
        optimizer.step()
        held = rank_bytes(model, optimizer) if i == 3 + steps - 1 else None  # gradients still allocated here
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return (time.perf_counter() - began) / steps, (held.parameters, held.gradients, held.optimizer)


def _rounds(rounds: int, steps: int) -> list[dict]:
    results = []
    for r in range(rounds):
        order = MODES[r % 3 :] + MODES[: r % 3]
        for model_name in MODELS:
            for mode in order:
                seconds, held = _pair(model_name, mode, steps)
                results.append({"round": r, "model": model_name, "mode": mode, "seconds": seconds, "held": held})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    load_before = load_average()
    per_rank = run_on_ranks(_rounds, 2, args=(args.rounds, args.steps), timeout=3600)
    load_after = load_average()
    print(
        f"2 Gloo ranks on CPU, {args.rounds} rounds x {args.steps} timed Adam "
        f"steps; load average before {load_before}, after {load_after}"
    )
    print(
        f"{'model':<8} {'mode':<6} {'median step':>12} {'vs ddp':>7} "
        f"{'params/rank':>12} {'grads/rank':>11} {'optim/rank':>11}"
    )
    for model_name in MODELS:
        rows = {m: [x for x in per_rank[0] if x["model"] == model_name and x["mode"] == m] for m in MODES}
        for mode in MODES:
            ratios = [a["seconds"] / b["seconds"] for a, b in zip(rows[mode], rows["ddp"])]  # the same round: paired
            # the same (round, model, mode) sits at the same index on every rank
            last = per_rank[0].index(rows[mode][-1])
            held = [max(rank[last]["held"][k] for rank in per_rank) for k in range(3)]
            print(
                f"{model_name:<8} {mode:<6} {statistics.median(x['seconds'] for x in rows[mode]) * 1e3:>9.1f} ms "
                f"{statistics.median(ratios):>7.2f} {held[0] / 2**20:>8.2f} "
                f"MiB {held[1] / 2**20:>7.2f} MiB {held[2] / 2**20:>7.2f} MiB"
            )


if __name__ == "__main__":
    main()
