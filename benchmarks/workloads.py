"""What the benchmarks share: the workloads, the shared hand-written DDP loop, the weight digest, accuracy, tables.

    from benchmarks.workloads import WORKLOADS, build, loader_for, train_by_hand, weights_digest
    torch.manual_seed(SEED)
    train_set, model = build(WORKLOADS["mlp"], steps)            # the data, then the model: the Trainer's order
    train_by_hand(model, loader_for(train_set, rank, world_size), rank=rank, world_size=world_size, max_steps=steps)
    digest = weights_digest(model.state_dict())                  # equal digests: bitwise-equal weights

Not a benchmark itself (``benchmarks/__init__.py`` lists those). :func:`train_by_hand` is the
reference that ``overhead``, ``compile``, ``gpu``, ``startup`` and ``tta_hand`` divide by, with
parameters for their variants: eager or ``torch.compile`` d, CPU or CUDA (channels_last, bf16
autocast), with or without the Trainer's per-step checks. It is not the only hand-written loop:
seven more live beside the benchmark that needs a different one, ``lm.hand_written`` (nanoGPT's:
AdamW and gradient clipping), ``gpu_bound.hand_written`` (batches indexed on the GPU), ``modes``
(each parallel mode, memory read mid-step), ``feature_cost`` (three bare step loops, each timing
features) and ``compile``'s allocator probe (one process, no group).

:func:`train_by_hand` mirrors the Trainer's setup order, which is what makes the weights bitwise
equal to ddpkit's: ``torch.manual_seed(seed)`` before the data and the model (the caller's part),
a ``DistributedSampler(seed=seed, drop_last=True)``, a ``DataLoader`` with its own
``torch.Generator`` (iterating it never draws from the global RNG), and
``torch.manual_seed(seed + rank)`` once everything is built (dropout masks differ per rank, as they
must).

At import time this module loads torch and the standard library only: the hand-written sides of
``benchmarks.startup`` and ``benchmarks.tta_hand`` time a process that imports nothing from ddpkit,
so the ddpkit parts used here (the model registry, synthetic data, the gradient norm, the table
format) are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

SEED, BATCH, LR, MOMENTUM = 0, 64, 0.01, 0.9
REPO = Path(__file__).resolve().parents[1]

#: model name, model kwargs, input shape, timed steps, warm-up steps, ranks. ``step-cost`` is a
#: near-empty step (a 16 -> 10 linear layer, one process, no DDP): what is left is each loop's
#: own fixed cost per step, in microseconds. ``mlp-1`` is the MLP in one process: the loop's cost on a
#: real model without a peer's scheduling noise (paired ranges of a few us where 2 ranks give 50).
WORKLOADS: dict[str, dict[str, Any]] = {
    "step-cost": {
        "model": "torch.nn:Linear",
        "kwargs": {"in_features": 16, "out_features": 10},
        "shape": [16],
        "steps": 1000,
        "warmup": 100,
        "nproc": 1,
    },
    "mlp": {
        "model": "mlp",
        "kwargs": {"hidden": [128, 128]},
        "shape": [1, 28, 28],
        "steps": 300,
        "warmup": 30,
        "nproc": 2,
    },
    "mlp-1": {
        "model": "mlp",
        "kwargs": {"hidden": [128, 128]},
        "shape": [1, 28, 28],
        "steps": 300,
        "warmup": 30,
        "nproc": 1,
    },
    "mnist_cnn": {"model": "mnist_cnn", "kwargs": {}, "shape": [1, 28, 28], "steps": 100, "warmup": 10, "nproc": 2},
    "resnet18": {
        "model": "resnet18",
        "kwargs": {"num_classes": 10},
        "shape": [3, 32, 32],
        "steps": 12,
        "warmup": 3,
        "nproc": 2,
    },
}


# --- data, model and the Trainer's config for one workload -----------------------------------------


def build(w: dict[str, Any], steps: int, *, world_size: int | None = None) -> tuple[Any, torch.nn.Module]:
    """The training set (exactly ``steps`` batches per rank) and the model, in the Trainer's order."""
    from ddpkit.data.datasets import synthetic
    from ddpkit.registry import MODELS

    world_size = dist.get_world_size() if world_size is None else world_size
    train_set, _ = synthetic(size=steps * BATCH * world_size, shape=w["shape"], num_classes=10)
    return train_set, MODELS.build(w["model"], key="model.name", kwargs=w["kwargs"])


def loader_for(
    train_set: Any,
    rank: int,
    world_size: int,
    *,
    batch_size: int = BATCH,
    batched: bool = False,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """torch's DistributedSampler and DataLoader; ``batched``: with ddpkit's whole-batch reads (ddpkit.data.batched)."""
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED, drop_last=True)
    sampler.set_epoch(0)
    collate = None
    if batched:
        from ddpkit.data.batched import batch_reads

        train_set, collate = batch_reads(train_set)
    return DataLoader(
        train_set,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator(),
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )


def trainer_config(
    w: dict[str, Any], steps: int, world_size: int, output_dir: str | Path, *, name: str, **sections: dict[str, Any]
) -> dict:
    """The ddpkit config of the same job as the hand-written loop; ``sections`` are merged over the defaults."""
    config = {
        "run": {"name": name, "output_dir": str(output_dir), "seed": SEED},
        "data": {
            "name": "synthetic",
            "batch_size": BATCH,
            "kwargs": {"size": steps * BATCH * world_size, "shape": w["shape"], "num_classes": 10},
        },
        "model": {"name": w["model"], "kwargs": w["kwargs"]},
        "optim": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        "train": {"epochs": 1, "max_steps": steps},
        "checkpoint": {"every_epochs": None, "resume": "none"},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    return config


# --- the hand-written loop ------------------------------------------------------------------------


def train_by_hand(
    model: torch.nn.Module,
    loader: DataLoader,
    *,
    rank: int,
    world_size: int,
    max_steps: int,
    on_step: Callable[[int], Any] | None = None,
    lr: float = LR,
    momentum: float = MOMENTUM,
    seed: int = SEED,
    compiled: bool = False,
    device: str = "cpu",
    channels_last: bool = False,
    bf16: bool = False,
    checks: bool = False,
) -> int:
    """The plain DDP loop users write; returns the number of optimizer steps taken.

        model.to(device)        # device="cuda": and channels_last
        net = DDP(model)        # a world of one: the bare model, as the Trainer does
        net = torch.compile(net) if compiled else net
        optimizer = SGD(net.parameters(), lr, momentum); torch.manual_seed(seed + rank)
        on_step(0)              # everything built
        for epoch: loader.sampler.set_epoch(epoch)
            for x, y in loader: loss = cross_entropy(net(x), y)    # bf16: under autocast
                                loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
                                stop if on_step(step) is true or step == max_steps

    ``checks``: also the Trainer's NaN guard on the loss and the gradient norm read each step (health's
    per-step work on the CPU). ``on_step`` is where a benchmark times, marks or evaluates.
    """
    memory_format = torch.channels_last if channels_last else torch.preserve_format
    to_device = device != "cpu" or channels_last
    if to_device:
        model = model.to(device, memory_format=memory_format)
    net = DDP(model) if world_size > 1 else model
    net = torch.compile(net) if compiled else net
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    torch.manual_seed(seed + rank)
    net.train()
    params = list(model.parameters())
    precision = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    on_step = on_step or (lambda step: None)
    on_step(0)
    step = 0
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            if to_device:
                x = x.to(device, non_blocking=True).contiguous(memory_format=memory_format)
                y = y.to(device, non_blocking=True)
            with precision:
                loss = F.cross_entropy(net(x), y)
            if checks and not math.isfinite(loss.detach().item()):  # TrainingHealth.watch_loss on the CPU
                loss = loss * math.nan
            loss.backward()
            if checks and not math.isfinite(_gradient_norm(params)):
                raise FloatingPointError("non-finite gradient norm")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if on_step(step) or step == max_steps:
                return step
    raise AssertionError("unreachable")


def _gradient_norm(params: list[torch.nn.Parameter]) -> float:
    from ddpkit.distributed.gradient_norm import gradient_norm

    return gradient_norm(params)


# --- what a run produced ---------------------------------------------------------------------------


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the final weights' names and bytes: equal digests are bitwise-equal weights, across processes too."""
    import hashlib

    sha = hashlib.sha256()
    for name, value in sorted(state.items()):
        sha.update(name.encode())
        sha.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def strided_loader(dataset: Any, rank: int, world_size: int, *, batch_size: int = BATCH) -> DataLoader:
    """This rank's strided share of an evaluation set (rank, rank + world_size, ...), in order, with its own
    generator."""
    return DataLoader(
        Subset(dataset, range(rank, len(dataset), world_size)), batch_size=batch_size, generator=torch.Generator()
    )


def accuracy(model: torch.nn.Module, val: DataLoader) -> float:
    """Exact accuracy over every rank's share: correct and total summed in float64 (all-reduced in a process group).

    The model is put in eval mode for the pass and back in train mode after it."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in val:
            counts += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


# --- reporting: medians over rounds, paired ratios, the machine's load -----------------------------


def rotated(items: Sequence[Any], round_: int) -> list[Any]:
    """``items`` starting at ``round_ % len(items)``: over rounds, every variant runs in every position."""
    k = round_ % len(items)
    return [*items[k:], *items[:k]]


def summary(values: Sequence[float]) -> Any:
    """Median, min and max of one measurement over rounds (a ``ddpkit.bench.report.Stats``)."""
    from ddpkit.bench.report import Stats

    return Stats.of(values)


def paired(values: Sequence[float], reference: Sequence[float], *, scale: float = 1.0, difference: bool = False) -> Any:
    """Median/min/max (a ``ddpkit.bench.report.Stats``) of the per-round ratios ``value / reference`` (paired: the same
    round), or of the differences ``(value - reference) * scale`` with ``difference``."""
    from ddpkit.bench.report import Stats

    return Stats.of([(v - r) * scale if difference else v / r for v, r in zip(values, reference)])


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A title line over an aligned text table (``ddpkit.bench.report.format_table``)."""
    from ddpkit.bench.report import format_table

    return title + "\n" + format_table(headers, rows)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: on a shared machine, say what the load was next to the numbers."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


@contextlib.contextmanager
def load_printed() -> Iterator[None]:
    """Print the load average before and after the block."""
    print(f"load average before: {load_average()}", flush=True)
    yield
    print(f"load average after: {load_average()}", flush=True)


# --- benchmarks that start processes ----------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH`` (children import ``benchmarks``)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_module_workers(module: str, kind: str, params: dict[str, Any], *, nproc: int) -> dict[str, Any]:
    """``ddpkit.bench.launching.run_workers`` with ``python -m MODULE --worker SPEC`` as each rank's program.

    ``MODULE`` serves its kinds with ``ddpkit.bench.worker.serve``; the repository goes first on the
    workers' ``PYTHONPATH`` (torchrun's workers inherit this process's environment, so it is set here
    for the launch and restored after)."""
    from ddpkit.bench.launching import run_workers

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]
    try:
        return run_workers(kind, params, nproc=nproc, threads=1, entry=["-m", module, "--worker"])
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
