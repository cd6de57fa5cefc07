"""Measure, on one rank, what the scaling model needs: compute per phase and DDP's buckets in firing order.

    with process_group(read_dist_env()) as runtime:          # usually a world of one (Gloo on the CPU)
        profile = measure_profile(load_config("my.yaml"), runtime, iters=20, warmup=3)
    profile.buckets    # (bytes, launch time after backward began), in the order DDP fires them

The config is built as the Trainer builds it (registry model and dataset, ``train.channels_last``
and ``train.keep_host_memory``, the optimizer from ``optim``, the sharded training loader,
``wrap_model`` with the config's ``ddp`` section; ``train.compile`` is refused), and two
copies of the step run in alternation, so a busy machine slows both alike:

* the bare model: what a world of one runs (the Trainer does not wrap it in DDP), timed as a
  whole step: ``single_step_s``;
* the DDP-wrapped model on the same group, timed per phase (data, forward, backward,
  optimizer). A communication hook that returns each bucket unchanged records when DDP launches
  it and its size, and a post-accumulate-grad hook on every parameter records when its gradient
  is ready, so :func:`ddpkit.bench.scaling_model.assign_buckets` can regroup them for other
  ``bucket_cap_mb`` values.

Run as N one-rank processes at once (each measuring on its own, nothing communicated), it
measures compute as it runs when N ranks share one machine: how ``--validate`` checks the model
on a CPU box with fewer cores than ranks. Each quantity is the median over the timed iterations;
the first ``warmup`` (DDP rebuilds its buckets after the first) are left out. The default
``training_step`` (cross-entropy on ``(x, y)``) is what runs, as for ``ddpkit run``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ddpkit.bench.scaling_model import Bucket, Param, Profile
from ddpkit.bench.units import BenchUsageError
from ddpkit.config.schema import Config
from ddpkit.data.loaders import build_train_loader, move_to_device
from ddpkit.distributed.collectives import barrier
from ddpkit.distributed.ddp import wrap_model
from ddpkit.distributed.process_group import Runtime
from ddpkit.parallel.model_views import to_channels_last
from ddpkit.registry import DATASETS, MODELS
from ddpkit.training.allocator import apply_host_memory
from ddpkit.training.optim import build_optimizer
from ddpkit.training.precision import autocast, check_precision
from ddpkit.training.rng import seed_everything

__all__ = ["COMM_FACTOR", "check_profiled_config", "measure_profile"]

#: Bytes on the wire per gradient byte for each ``ddp.comm_hook`` the model can represent.
COMM_FACTOR = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}


class _Recorder:
    """Per iteration: bucket launches from the comm hook and gradient-ready times from param hooks."""

    def __init__(self) -> None:
        self.start = 0.0
        self.buckets: list[tuple[int, float]] = []
        self.params: dict[int, float] = {}

    def begin(self) -> None:
        self.start = time.perf_counter()
        self.buckets = []
        self.params = {}

    def hook(self, bucket: Any) -> torch.futures.Future:
        buffer = bucket.buffer()
        self.buckets.append((buffer.numel() * buffer.element_size(), time.perf_counter() - self.start))
        future: torch.futures.Future = torch.futures.Future()
        # No communication: only compute is timed; the model adds the allreduce
        future.set_result(buffer)
        return future

    def param_hook(self, index: int) -> Any:
        def ready(_: torch.Tensor) -> None:
            self.params[index] = time.perf_counter() - self.start

        return ready


def check_profiled_config(cfg: Config) -> None:
    """Refuse, with the override that fixes it, a config whose step the profile cannot time faithfully."""
    if cfg.ddp.comm_hook not in COMM_FACTOR:
        raise BenchUsageError(
            f"ddp.comm_hook={cfg.ddp.comm_hook}: the scaling model cannot "
            "predict PowerSGD's traffic; override ddp.comm_hook=none"
        )
    if cfg.train.compile is not False:
        raise BenchUsageError(
            "train.compile: the scaling profile times the eager step (a hook on every gradient); "
            "override train.compile=false (compiled compute is usually "
            "faster, so the prediction errs on the slow side)"
        )


def measure_profile(cfg: Config, runtime: Runtime, *, iters: int, warmup: int) -> Profile:
    """Time the config's step on this rank: bare model and DDP-wrapped, alternating.

    On a group of several ranks, each rank measures on its own (the recording hook communicates
    nothing): compute as it runs while that many ranks share the machine. Rank 0's is returned.
    """
    check_profiled_config(cfg)
    check_precision(cfg.train.precision, runtime.device)
    # As the Trainer does (DDP: every rank holds the whole model): without it a CPU step here measured 1.4x slower
    apply_host_memory(cfg.train.keep_host_memory, splits_model=False)
    seed_everything(cfg.run.seed)
    train_set, _ = DATASETS.build(cfg.data.name, key="data.name", kwargs=cfg.data.kwargs)
    loader = build_train_loader(
        train_set,
        env=runtime.env,
        batch_size=cfg.data.batch_size,
        num_workers=cfg.data.num_workers,
        shuffle=cfg.data.shuffle,
        drop_last=cfg.data.drop_last,
        seed=cfg.run.seed,
    )
    bare, unwrapped = (_build_model(cfg, runtime) for _ in range(2))
    wrapped, recorder = _wrap_recorded(cfg, runtime, unwrapped)
    variants = [
        (bare, build_optimizer(bare.parameters(), cfg.optim)),
        (wrapped, build_optimizer(wrapped.parameters(), cfg.optim)),
    ]
    batches = _batches(loader, runtime.device)
    samples = []
    for i in range(warmup + iters):
        for model, optimizer in variants:
            sample = _step(cfg, model, optimizer, batches, recorder if model is wrapped else None)
            if i >= warmup:
                samples.append((model is wrapped, sample))
    profile = _summarise(cfg, wrapped, [s for w, s in samples if w], [s for w, s in samples if not w])
    # Free DDP (its reducer holds the process group) while the group is alive, every rank done
    # first: a reducer left to the interpreter's exit aborted a 2-rank profile ("terminate called").
    if runtime.env.world_size > 1:
        barrier()
    del variants, wrapped
    gc.collect()
    return profile


def _build_model(cfg: Config, runtime: Runtime) -> nn.Module:
    """The config's model on the device, in channels_last if the config asks (as the Trainer builds it)."""
    model = MODELS.build(cfg.model.name, key="model.name", kwargs=cfg.model.kwargs).to(runtime.device)
    return to_channels_last(model) if cfg.train.channels_last else model


def _wrap_recorded(cfg: Config, runtime: Runtime, model: nn.Module) -> tuple[nn.Module, _Recorder]:
    """DDP as ``wrap_model`` builds it for several ranks, with hooks that record and communicate nothing.

    Buffers are not broadcast at each forward here: the model adds that broadcast's cost itself.
    """
    # wrap_model leaves a world of one unwrapped; DDP works on it all the same
    if runtime.env.world_size == 1:
        runtime = dataclasses.replace(runtime, env=dataclasses.replace(runtime.env, world_size=2))
    options = dataclasses.replace(cfg.ddp, comm_hook="none", broadcast_buffers=False)
    # unpinned: the recording hook below is the only communication hook
    wrapped = wrap_model(model, runtime, options, pinned=False)
    recorder = _Recorder()
    # A lambda: DDP checks a hook's annotations, which postponed annotations turn into strings.
    wrapped.register_comm_hook(None, lambda state, bucket: recorder.hook(bucket))
    for index, param in enumerate(p for p in wrapped.parameters() if p.requires_grad):
        param.register_post_accumulate_grad_hook(recorder.param_hook(index))
    return wrapped, recorder


def _batches(loader: Any, device: torch.device) -> Iterator[Any]:
    """Batches forever, epoch after epoch, as the Trainer's loop draws them."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            yield move_to_device(batch, device)
        epoch += 1


def _step(
    cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator[Any], recorder: _Recorder | None
) -> dict[str, Any]:
    """One optimizer step (``grad_accum_steps`` micro-steps, the last one synchronising); phase times."""
    accum = cfg.train.grad_accum_steps
    times = {"data": 0.0, "forward": 0.0, "local_backward": 0.0, "backward": 0.0}
    start = time.perf_counter()
    for micro in range(accum):
        last = micro == accum - 1
        t0 = time.perf_counter()
        x, y = next(batches)
        t1 = time.perf_counter()
        sync = model.no_sync() if (not last and hasattr(model, "no_sync")) else contextlib.nullcontext()
        with sync:
            with autocast(cfg.train.precision, x.device):
                loss = F.cross_entropy(model(x), y) / accum
            t2 = time.perf_counter()
            if recorder is not None and last:
                recorder.begin()
            loss.backward()
        t3 = time.perf_counter()
        times["data"] += t1 - t0
        times["forward"] += t2 - t1
        times["backward" if last else "local_backward"] += t3 - t2
    t4 = time.perf_counter()
    if cfg.train.clip_grad_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    end = time.perf_counter()
    times["optimizer"] = end - t4
    times["step"] = end - start
    if recorder is not None:
        times["buckets"] = list(recorder.buckets)
        times["params"] = dict(recorder.params)
    return times


def _summarise(cfg: Config, wrapped: nn.Module, ddp: list[dict[str, Any]], bare: list[dict[str, Any]]) -> Profile:
    """Medians per phase, per bucket and per parameter over the timed iterations; every DDP step's time."""

    def median(key: str, rows: list[dict[str, Any]] = ddp) -> float:
        return statistics.median(row[key] for row in rows)

    # The rebuilt buckets: the same sizes in every timed iteration
    layout = ddp[-1]["buckets"]
    buckets = tuple(
        Bucket(size, statistics.median(row["buckets"][i][1] for row in ddp)) for i, (size, _) in enumerate(layout)
    )
    params = [p for p in wrapped.parameters() if p.requires_grad]
    ready = [
        Param(
            p.numel() * p.element_size(),
            statistics.median(row["params"].get(i, 0.0) for row in ddp),
            str(p.dtype).removeprefix("torch."),
        )
        for i, p in enumerate(params)
    ]
    buffers = sum(b.numel() * b.element_size() for b in wrapped.module.buffers()) if cfg.ddp.broadcast_buffers else 0
    return Profile(
        batch_size=cfg.data.batch_size * cfg.train.grad_accum_steps,
        data_s=median("data"),
        forward_s=median("forward"),
        backward_s=median("backward"),
        optimizer_s=median("optimizer"),
        local_backward_s=median("local_backward"),
        single_step_s=median("step", bare),
        buckets=buckets,
        params=tuple(ready),
        buffer_bytes=buffers,
        comm_factor=COMM_FACTOR[cfg.ddp.comm_hook],
        bucket_cap_mb=cfg.ddp.bucket_cap_mb,
        step_samples_s=tuple(sorted(row["step"] for row in ddp)),
    )
