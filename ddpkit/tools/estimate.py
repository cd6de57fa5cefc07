"""``ddpkit estimate CONFIG --nproc-per-node N [--mode M]``: bytes per rank of each parallel.mode, before a run.

    $ cat lm.yaml
    model: {name: gpt, kwargs: {vocab_size: 257, dim: 256, depth: 4, heads: 4, max_len: 256}}
    data: {name: tokens, batch_size: 16, kwargs: {corpus: stdlib, seq_len: 256}}
    optim: {name: adam, lr: 0.001}
    $ ddpkit estimate lm.yaml --nproc-per-node 2 model.kwargs.depth=12
    model gpt: 9,608,960 parameters (36.66 MiB as 4-byte values)
    optimizer adam: 2 state tensors per parameter; 2 rank(s)
    mode    parameters   gradients   optimizer  activations  total per rank
    ddp      36.66 MiB   36.66 MiB   73.31 MiB   736.27 MiB      882.89 MiB
    zero1    36.66 MiB   36.66 MiB   36.66 MiB   736.27 MiB      846.23 MiB
    fsdp2    18.33 MiB   18.33 MiB   36.66 MiB   736.27 MiB      809.58 MiB
    recommendation: ddp: 882.89 MiB per rank fits in 6.01 GiB (the fastest mode: one all-reduce per step)

The model is built on the meta device (no memory, no weights); the per-rank numbers follow torch's own partition rules
(each way's ``bytes_per_rank``, :mod:`ddpkit.parallel.data_parallel`, computed in :mod:`ddpkit.training.footprint`,
which a run's own fit check shares) and match what the run logs at startup. Activations are the outputs of every
module for one per-rank batch, from a forward pass on the meta device with one sample of the configured dataset (an
upper bound on what autograd keeps; ``n/a`` when the model cannot run on meta). Not counted: DDP's gradient buckets
when ``ddp.gradient_as_bucket_view`` is off (one more gradient copy; on by default, the gradients are the buckets),
FSDP2's all-gathered block during its forward and backward (the largest block's full parameters), allocator slack.
Under ``parallel.pipeline: P`` the numbers are those of the rank holding the largest stage, its parameters replicated
(ddp), its optimizer state sharded (zero1) or everything sharded (fsdp2) over the ``N / P`` data-parallel replicas.
Under ``parallel.tensor: T`` each parameter is counted as the shard its tensor plan leaves a rank (a colwise Linear's
rows / T, a rowwise one's columns / T, the embedding and head by vocabulary where the run would shard them:
``parallel.vocab_parallel``, the rest whole), over ``N / (P x T)`` replicas; ddpkit's own models have their plans,
another model is counted whole. Under HSDP (``parallel.replicate: R``) fsdp2's row is a rank of one of the R replicas,
sharding over ``N / (P x T x R)`` ranks. A frozen parameter (LoRA's base) counts as a parameter only. The
recommendation compares the total with ``--memory-per-rank`` (default: the GPU's memory, or the host's available
memory divided by ``--nproc-per-node``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ddpkit import registry
from ddpkit.config.cli_args import OLD_SPELLINGS, add_config_arguments, renamed
from ddpkit.config.loader import load_config
from ddpkit.config.schema import Config
from ddpkit.distributed.memory import RankBytes, format_bytes
from ddpkit.errors import exit_code_of
from ddpkit.training.footprint import MODES, device_memory_per_rank, footprint

__all__ = ["main", "estimate", "Estimate"]


class Estimate:
    """Per-rank bytes of each mode for one config and world size (the largest rank's numbers), and the activations."""

    def __init__(self, cfg: Config, nproc: int, modes: Sequence[str] = MODES):
        with torch.device("meta"):
            model = registry.build_model(cfg.model)
        held = footprint(model, cfg, nproc=nproc, modes=modes)
        self.count = held.count
        self.stage_count = held.stage_count
        self.element_size = held.element_size
        self.slots = held.slots
        self.per_mode: dict[str, RankBytes] = held.per_mode
        self.stages = cfg.parallel.pipeline
        self.tensor = cfg.parallel.tensor
        self.replicate = cfg.parallel.replicate
        # Under a pipeline a stage holds the activations of up to M microbatches: not estimated (n/a).
        self.activations = _activation_bytes(model, cfg, nproc) if self.stages == 1 else None
        self.nproc = nproc
        self.model_name = cfg.model.name
        self.optim_name = cfg.optim.name

    def total(self, mode: str) -> int:
        return self.per_mode[mode].total + (self.activations or 0)


def _per_rank_batch(cfg: Config, nproc: int) -> int:
    if cfg.data.global_batch_size is not None:
        return max(1, cfg.data.global_batch_size // (nproc * cfg.train.grad_accum_steps))
    return cfg.data.batch_size


def _activation_bytes(model: torch.nn.Module, cfg: Config, nproc: int) -> int | None:
    """Bytes of every module's output for one per-rank batch, from a forward on the meta device."""
    try:
        train_set, _ = registry.build_datasets(cfg.data)
        sample = train_set[0][0] if isinstance(train_set[0], (tuple, list)) else train_set[0]
        batch = torch.empty((_per_rank_batch(cfg, nproc), *sample.shape), dtype=sample.dtype, device="meta")
    except Exception:
        # A dataset that needs files or a network: activations stay unknown
        return None
    total = [0]

    def count(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            total[0] += output.numel() * output.element_size()

    handles = [m.register_forward_hook(count) for m in model.modules() if m is not model]
    try:
        with torch.no_grad():
            model(batch)
    except Exception:
        return None
    finally:
        for handle in handles:
            handle.remove()
    return total[0]


def _memory_per_rank(nproc: int) -> int:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return device_memory_per_rank(device, local_world_size=nproc)


def _fmt(n: int | None) -> str:
    return format_bytes(n, exact=False, unknown="n/a")


def recommendation(est: Estimate, budget: int) -> str:
    """One line: the first mode, cheapest in communication first, whose total fits in ``budget``."""
    reasons = {
        "ddp": "the fastest mode: one all-reduce per step",
        "zero1": "DDP's communication plus one broadcast of the updated parameters; 1/N of the optimizer state",
        "fsdp2": "1/N of parameters, gradients and optimizer state; "
        "all-gathers per block in forward and backward, a reduce-scatter of the gradients",
    }
    for mode in est.per_mode:
        if est.total(mode) <= budget:
            return f"{mode}: {_fmt(est.total(mode))} per rank fits in {_fmt(budget)} ({reasons[mode]})"
    best = min(est.per_mode, key=est.total)
    return (
        f"none fits in {_fmt(budget)} per rank; {best} needs {_fmt(est.total(best))}: "
        "use more ranks, a smaller batch or bf16"
    )


def report(est: Estimate, budget: int) -> str:
    slots = "unknown state size (Adam's 2 assumed)"
    if est.slots is not None:
        slots = f"{est.slots} state tensors per parameter"
    lines = [
        f"model {est.model_name}: {est.count:,} parameters "
        f"({_fmt(est.count * est.element_size)} as {est.element_size}-byte values)",
        f"optimizer {est.optim_name}: {slots}; {est.nproc} rank(s)",
        *_pipeline_line(est),
        f"{'mode':<6} {'parameters':>11} {'gradients':>11} {'optimizer':>11} {'activations':>12} "
        f"{'total per rank':>15}",
    ]
    for mode, b in est.per_mode.items():
        lines.append(
            f"{mode:<6} {_fmt(b.parameters):>11} {_fmt(b.gradients):>11} {_fmt(b.optimizer):>11} "
            f"{_fmt(est.activations):>12} {_fmt(est.total(mode)):>15}"
        )
    lines.append(f"recommendation: {recommendation(est, budget)}")
    return "\n".join(lines)


def _pipeline_line(est: Estimate) -> list[str]:
    replicas = max(1, est.nproc // (est.stages * est.tensor))
    lines = []
    if est.tensor > 1:
        lines.append(
            f"tensor {est.tensor} x data-parallel {replicas}: the bytes below are one tensor rank's shards "
            "(its plan's split Linears / T, the rest whole)"
        )
    if est.replicate > 1 and "fsdp2" in est.per_mode:
        lines.append(
            f"fsdp2 as HSDP: {est.replicate} replicas x {replicas // est.replicate} shards (parallel.replicate): "
            f"fsdp2's row is a rank of one replica, sharding over {replicas // est.replicate} ranks"
        )
    if est.stages > 1:
        lines.append(
            f"pipeline {est.stages} x data-parallel {replicas}: the largest stage holds {est.stage_count:,} of the "
            f"{est.count:,} parameters (the bytes below are its rank's; activations: up to M microbatches', not "
            "estimated)"
        )
    return lines


def estimate(
    config: str | os.PathLike | Mapping[str, Any] | Config,
    overrides: Sequence[str] = (),
    *,
    nproc: int,
    modes: Sequence[str] = MODES,
) -> Estimate:
    """The estimate for a config file or dict with ``key=value`` overrides."""
    return Estimate(load_config(config, list(overrides)), nproc, modes)


def main(argv: Sequence[str]) -> int:
    """``ddpkit estimate CONFIG [key=value ...] --nproc-per-node N [--mode M] [--memory-per-rank GiB]``; returns the
    exit code."""
    parser = argparse.ArgumentParser(
        prog="ddpkit estimate", description="Per-rank bytes of each parallel.mode, from the model on the meta device."
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--nproc-per-node", type=int, required=True, help="number of ranks (processes) to estimate for, on one node"
    )
    parser.add_argument(
        "--mode", choices=MODES, action="append", help="only this mode (repeatable; default: all three)"
    )
    parser.add_argument(
        "--memory-per-rank", type=float, default=None, help="GiB available to each rank (default: detected)"
    )
    try:
        args = parser.parse_intermixed_args(renamed(argv, OLD_SPELLINGS, prog="ddpkit estimate"))
    except SystemExit as exc:
        return int(exc.code or 0)

    def show() -> int:
        est = estimate(args.config, args.overrides, nproc=args.nproc_per_node, modes=args.mode or MODES)
        budget = int(args.memory_per_rank * 2**30) if args.memory_per_rank else _memory_per_rank(args.nproc_per_node)
        print(report(est, budget))
        return 0

    return exit_code_of(show, command="ddpkit estimate")
