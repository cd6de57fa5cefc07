"""One GPU with the data already on it: a hand-written loop against ddpkit, eager and compiled.

    python -m benchmarks.gpu_bound                                   # GPT-2 124M, eager and compiled, 2 x 30 s an arm
    python -m benchmarks.gpu_bound --workload resnet50 --mode eager --rounds 3 --seconds 20
    python -m benchmarks.gpu_bound --stall --every 100               # checkpoint stall: none / sync / async saves
    python -m benchmarks.gpu_bound --tiny --device cpu --seconds 2   # the same code path on any machine, tiny shapes
    python -m benchmarks.gpu_bound --workload llama1b --mode eager --variants full,lora --batch-size 4
    python -m benchmarks.gpu_bound --workload llama1b --mode eager --variants documents --batch-size 4
    python -m benchmarks.gpu_bound --workload llama1b --variants full,lora,documents --tiny --device cpu --seconds 1

What it answers: is ddpkit's step as fast as the loop a user would write when the GPU, not the
host's data path, is the limit? The batches are made once and kept on the GPU (``benchmarks.gpu``
reads images through a DataLoader instead, and is bound by the host). World size 1: one process,
no DDP on either side (the Trainer wraps nothing in a world of one either).

Workloads (``--workload``):

* ``gpt2``: GPT-2 124M (``ddpkit.models.gpt``, preset ``gpt2``: 12 layers, 12 heads, width 768,
  vocabulary 50,304, context 1,024) on random token windows, AdamW (lr 6e-4, betas 0.9/0.95,
  weight decay 0.1 on matrices only, ``fused=True`` on CUDA), gradient clipping at 1.0, bf16 autocast;
  tokens/s and MFU (``flops_per_token``, PaLM's formula, against the GPU's dense bf16 peak from
  ``ddpkit.reporting.throughput.PEAK_TFLOPS``).
* ``resnet50``: torchvision's ResNet-50 (1,000 classes) on random 224x224 images, SGD with
  momentum, bf16 autocast, channels_last; images/s.
* ``llama1b``: ddpkit's Llama family at Llama 3.2 1B's shape (``model: {name: gpt, kwargs: {preset:
  llama3.2-1b}}``: 16 blocks, 32 query and 8 key/value heads of 64, width 2,048, SwiGLU 8,192, vocabulary
  128,256, tied; 1.24B parameters), random weights, context 2,048, AdamW (lr 3e-4, the rest as GPT-2's,
  fused on CUDA), clipping at 1.0, bf16 autocast; tokens/s and MFU as for GPT-2.

Variants (``--variants``, token windows only; each beside the plain model, ``full``, in the same rounds):
``lora``, the model with ``model.lora: {r: 16, targets: all-linear}`` (the hand-written side adds the same
adapter with ``ddpkit.models.lora.apply_lora``, as the Trainer does, so the two differ in their loops
only); ``documents``, the document mask (``data.kwargs.document_mask``: the dataset's ``documents``, which
the Trainer hands the model, and the hand-written side hands it by ``model.use_documents``; FlexAttention on
a GPU), the windows holding documents of ``--doc-len`` tokens on average in every variant (the same
samples). The table adds ``x full``: the paired ratio to the same side's full arm (LoRA's speed-up; the
document mask's cost). MFU counts the causal step's FLOPs for ``documents`` and is not given for ``lora``.
``--sides ddpkit`` (or ``hand``) runs one side's arms only, where the question is the variant's cost.

Arms, alternated over ``--rounds`` (the order rotates each round; ``--mode`` picks eager, compiled
or both): ``hand-eager`` / ``hand-compiled``, the nanoGPT-style loop (``logits = net(x)``, the loss
under autocast, backward, ``clip_grad_norm_``, ``step``, ``zero_grad(set_to_none=True)``, each batch
an ``index_select`` of the on-GPU data by an on-GPU index), ``torch.compile(model)`` for compiled;
and ``ddpkit-eager`` / ``ddpkit-compiled``, the real ``Trainer`` from a config with its defaults on
(progress bar, health checks, watchdog, the in-memory crash snapshots, ``train.compile`` for
compiled), the on-GPU tensors handed over by ``build_datasets``. Neither side saves checkpoints
(``checkpoint.every_epochs: null``); ``--stall`` measures saves on their own. Both draw the same
batch order (torch's ``DistributedSampler``, seed 0) from the same seed, so their first losses
agree: the table shows the largest difference over the first 20 steps, a check that both train the
same job.

An arm that fails (out of memory, a kernel the installed torch lacks) is reported as failed, the others
still run, and the exit status is 1; ``--json`` is rewritten after every arm, so a run stopped by a time
limit keeps what it measured (``"complete": false``).

Timing: ``--warmup`` steps first (compilation included: Dynamo is reset between arms so every
compiled arm compiles, from Inductor's warm on-disk cache after the first round), then steps until
``--seconds`` of host time have passed. One CUDA event is recorded after each optimizer step (no
host sync inside the loop, so the host runs ahead as in training); step times are the gaps between
events, read once at the end. Reported: tokens/s (or images/s) over the timed steps, MFU, p50 and
p95 ms a step, peak ``max_memory_allocated``, and the paired ratio of ddpkit's throughput to the
hand-written loop's in the same round and mode.

``--batch-size auto`` (the default on CUDA) takes the largest of 64, 48, 32, 24, 16, 12, 8 (llama1b:
16, 8, 4, 2, 1) with
which three steps of the eager hand-written loop (eager needs more memory than compiled) peak
below 90% of the GPU's memory, leaving ddpkit its small extra.

``--stall`` runs the ddpkit arm three ways (no saves, synchronous saves, ``checkpoint.async``;
the in-memory snapshots off in all three, so only the saves differ) with a save every ``--every``
steps and reports per save (:func:`save_costs`) how long it held the loop up: *blocked*, the step
after the save beyond the run's median step away from saves, in seconds and in steps (the goal for
``checkpoint.async``: under one step); *lost*, the same summed over the ``--after`` steps after it
(a background write slowing its neighbours); and the p95 step time of those steps against every
step of the run without saves.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, TensorDataset

from benchmarks.workloads import load_printed, paired, rotated, summary, table
from ddpkit.bench.report import progress
from ddpkit.config.loader import load_config
from ddpkit.models.lora import apply_lora
from ddpkit.trainer import Trainer

SEED, LOSSES_KEPT = 0, 20
CANDIDATE_BATCHES = (64, 48, 32, 24, 16, 12, 8)


@dataclass(frozen=True)
class Workload:
    """One model, its data and optimizer: what both sides train."""

    name: str
    model: dict[str, Any]  # ddpkit's ``model`` section: a registered name and kwargs
    optim: dict[str, Any]  # ddpkit's ``optim`` section
    samples: int  # made once, kept on the device; an epoch is samples // batch steps
    seq_len: int | None = None  # token windows (the unit is tokens) or images (None)
    image: tuple[int, ...] = (3, 224, 224)
    classes: int = 1000
    clip: float | None = None
    channels_last: bool = False
    #: The end-of-text id the ``documents`` variant separates documents with (token windows only).
    eot: int | None = None
    #: ``--batch-size auto``'s candidates, largest first.
    batches: tuple[int, ...] = CANDIDATE_BATCHES

    @property
    def unit(self) -> str:
        return "tokens" if self.seq_len else "images"


GPT2 = Workload(
    "gpt2",
    {"name": "gpt", "kwargs": {"preset": "gpt2"}},
    {"name": "adamw", "lr": 6e-4, "weight_decay": 0.1, "kwargs": {"betas": [0.9, 0.95]}},
    samples=64 * 64,
    seq_len=1024,
    clip=1.0,
)
RESNET50 = Workload(
    "resnet50",
    {"name": "resnet50", "kwargs": {"num_classes": 1000}},
    {"name": "sgd", "lr": 0.01, "momentum": 0.9},
    samples=8 * 256,
    channels_last=True,
)
#: Llama 3.2 1B's shape (``preset: llama3.2-1b``: 16 blocks, 32 query and 8 key/value heads of 64, width 2,048,
#: SwiGLU 8,192, vocabulary 128,256, tied), random weights, at a context of 2,048; the end-of-text is Llama 3's.
LLAMA1B = Workload(
    "llama1b",
    {"name": "gpt", "kwargs": {"preset": "llama3.2-1b", "vocab_size": 128256, "max_len": 2048}},
    {"name": "adamw", "lr": 3e-4, "weight_decay": 0.1, "kwargs": {"betas": [0.9, 0.95]}},
    samples=1024,
    seq_len=2048,
    clip=1.0,
    eot=128001,
    batches=(16, 8, 4, 2, 1),
)
WORKLOADS = {"gpt2": GPT2, "resnet50": RESNET50, "llama1b": LLAMA1B}
#: Shapes small enough for a CPU: the same code path in seconds (``--tiny``).
TINY = {
    "gpt2": replace(
        GPT2,
        model={"name": "gpt", "kwargs": {"vocab_size": 257, "dim": 32, "depth": 1, "heads": 2, "max_len": 32}},
        samples=64,
        seq_len=32,
    ),
    "resnet50": replace(
        RESNET50, model={"name": "resnet50", "kwargs": {"num_classes": 10}}, samples=32, image=(3, 32, 32), classes=10
    ),
    "llama1b": replace(
        LLAMA1B,
        model={
            "name": "gpt",
            "kwargs": {
                "arch": "llama",
                "vocab_size": 257,
                "dim": 32,
                "depth": 1,
                "heads": 2,
                "kv_heads": 1,
                "max_len": 32,
            },
        },
        samples=64,
        seq_len=32,
        eot=256,
    ),
}
#: ``--variants``: what an arm trains beside the plain model (``full``): the ``model.lora`` section both sides apply
#: (ddpkit's ``apply_lora``), or the document mask (``data.kwargs.document_mask``: the dataset's ``documents``).
LORA = {"r": 16, "targets": "all-linear"}
VARIANTS = ("full", "lora", "documents")


# --- the data, made once and kept on the device ----------------------------------------------------


class OnDevice(TensorDataset):
    """Inputs and targets already on the device; ``seq_len`` tells ddpkit's throughput report the tokens per sample,
    ``documents`` (``{eot, restart_positions}``, as a token file with ``data.kwargs.document_mask`` has it) turns the
    document mask on: the Trainer hands it to the model (``ddpkit.data.tokens.require_vocab_of``)."""

    def __init__(self, *tensors: torch.Tensor, seq_len: int | None = None, documents: dict[str, Any] | None = None):
        super().__init__(*tensors)
        if seq_len:
            self.seq_len = seq_len
        if documents:
            self.documents = documents


def make_data(w: Workload, device: torch.device, *, doc_len: int | None = None) -> OnDevice:
    """The samples; with ``doc_len``, token windows hold documents of that mean length (``w.eot`` between them)."""
    generator = torch.Generator(device).manual_seed(SEED)
    if w.seq_len:
        vocab = w.model["kwargs"].get("vocab_size", 50304)
        windows = torch.randint(0, vocab, (w.samples, w.seq_len + 1), device=device, generator=generator)
        if doc_len:
            # An end-of-text at each position with probability 1 / doc_len: documents of that mean length.
            windows[torch.rand(windows.shape, device=device, generator=generator) < 1 / doc_len] = w.eot
        return OnDevice(windows[:, :-1], windows[:, 1:], seq_len=w.seq_len)
    images = torch.randn(w.samples, *w.image, device=device, generator=generator)
    return OnDevice(images, torch.randint(0, w.classes, (w.samples,), device=device, generator=generator))


# --- timing: one event per optimizer step ----------------------------------------------------------


class StepTimer:
    """Marks each optimizer step (a CUDA event, or the host clock on the CPU) and says when the time is up."""

    def __init__(self, device: torch.device, *, warmup: int, seconds: float):
        self.cuda, self.warmup, self.seconds = device.type == "cuda", warmup, seconds
        self.marks: list[Any] = []
        self.losses: list[torch.Tensor] = []
        self.host_start = 0.0
        self.warmup_seconds = time.perf_counter()

    def keep(self, loss: torch.Tensor) -> None:
        """Keep the first losses (detached, no sync) to compare the two sides."""
        if len(self.losses) < LOSSES_KEPT:
            self.losses.append(loss.detach().float())

    def tick(self) -> bool:
        """After an optimizer step; True once ``seconds`` of host time have passed since the warm-up."""
        if self.cuda:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        self.marks.append(mark)
        if len(self.marks) == self.warmup:  # the mark after the last warm-up step starts the clock
            if self.cuda:
                torch.cuda.synchronize()
            self.host_start = time.perf_counter()
            self.warmup_seconds = self.host_start - self.warmup_seconds
        return len(self.marks) > self.warmup and time.perf_counter() - self.host_start >= self.seconds

    def step_ms(self) -> list[float]:
        """Milliseconds of each timed step: steps ``warmup + 1``, ``warmup + 2``, ... (the gaps between their marks)."""
        if self.cuda:
            torch.cuda.synchronize()
            gap = lambda a, b: a.elapsed_time(b)  # noqa: E731
        else:
            gap = lambda a, b: (b - a) * 1000  # noqa: E731
        timed = self.marks[self.warmup - 1 :]
        return [gap(a, b) for a, b in zip(timed, timed[1:])]


# --- the two sides ---------------------------------------------------------------------------------


def hand_written(
    w: Workload, data: OnDevice, *, device: torch.device, batch: int, compiled: bool, timer: StepTimer, bf16: bool
) -> None:
    """nanoGPT's loop on data already on the device, in the Trainer's setup order (seed, model, optimizer, seed)."""
    from ddpkit.registry import MODELS

    torch.manual_seed(SEED)
    memory_format = torch.channels_last if w.channels_last else torch.preserve_format
    model = MODELS.build(w.model["name"], key="model.name", kwargs=w.model["kwargs"])
    if "lora" in w.model:
        # ddpkit's adapter, added as the Trainer adds it: the two sides differ in their loops, not in their models
        model = apply_lora(model, load_config({"model": w.model}).model)
    if getattr(data, "documents", None):
        # what ddpkit.data.tokens.require_vocab_of hands the model for data.kwargs.document_mask
        model.use_documents(**data.documents)
    model = model.to(device, memory_format=memory_format)
    net = torch.compile(model) if compiled else model
    optimizer = _optimizer(w, model, device)
    torch.manual_seed(SEED)  # the Trainer seeds seed + rank once everything is built
    params = list(model.parameters())
    precision = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED, drop_last=True)
    x_all, y_all = data.tensors
    net.train()
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), device=device)
        for index in order[: len(order) // batch * batch].view(-1, batch):
            x, y = torch.index_select(x_all, 0, index), torch.index_select(y_all, 0, index)
            if w.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with precision:
                loss = _loss(net(x), y)
            timer.keep(loss)
            loss.backward()
            if w.clip:
                torch.nn.utils.clip_grad_norm_(params, w.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if timer.tick():
                return


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) if logits.dim() == 3 else F.cross_entropy(logits, y)


def _optimizer(w: Workload, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    o = w.optim
    if o["name"] == "adamw":  # nanoGPT's groups: decay on matrices and embeddings only, as ddpkit's default
        params = list(model.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": o["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=o["lr"], betas=tuple(o["kwargs"]["betas"]), fused=device.type == "cuda")
    return torch.optim.SGD(model.parameters(), lr=o["lr"], momentum=o["momentum"])


class TimedOnDevice(Trainer):
    """The Trainer with its defaults, fed the on-device data; ticks the timer after each step and stops when it says
    so."""

    timer: StepTimer
    data: OnDevice

    def build_datasets(self) -> tuple[OnDevice, None]:
        return self.data, None

    def training_step(self, batch: Any) -> Any:
        loss = super().training_step(batch)
        self.timer.keep(loss)
        return loss

    def on_step_end(self, step: int) -> None:
        if self.timer.tick():
            self.request_stop()


def ddpkit_config(
    w: Workload, *, device: torch.device, batch: int, compiled: bool, workdir: Path, bf16: bool, **checkpoint: Any
) -> dict:
    optim = {
        **w.optim,
        "kwargs": {
            **w.optim.get("kwargs", {}),
            **({"fused": True} if device.type == "cuda" and w.optim["name"] == "adamw" else {}),
        },
    }
    return {
        "run": {"name": f"gpu-bound-{w.name}", "output_dir": str(workdir), "seed": SEED},
        "data": {"batch_size": batch, "num_workers": 0},
        "model": w.model,
        "optim": optim,
        "train": {
            "epochs": None,
            "max_steps": 10**9,
            "precision": "bf16" if bf16 else "fp32",
            "compile": compiled,
            "channels_last": w.channels_last,
            "clip_grad_norm": w.clip,
        },
        "checkpoint": {"every_epochs": None, **checkpoint},
        "dist": {"device": device.type},
    }


def ddpkit_trainer(
    w: Workload,
    data: OnDevice,
    *,
    device: torch.device,
    batch: int,
    compiled: bool,
    timer: StepTimer,
    bf16: bool,
    workdir: Path,
    checkpoint: dict[str, Any] | None = None,
) -> None:
    trainer = TimedOnDevice(
        ddpkit_config(
            w, device=device, batch=batch, compiled=compiled, workdir=workdir, bf16=bf16, **(checkpoint or {})
        )
    )
    trainer.timer, trainer.data = timer, data
    with contextlib.redirect_stderr(io.StringIO()):  # the progress bar stays on, off the screen
        trainer.fit()


# --- one arm: build, warm up, time, measure, clean up ----------------------------------------------


def run_arm(
    side: str,
    w: Workload,
    data: OnDevice,
    args: argparse.Namespace,
    *,
    compiled: bool,
    workdir: Path,
    checkpoint: dict[str, Any] | None = None,
) -> dict[str, Any]:
    device = torch.device(args.device)
    _fresh(device)
    timer = StepTimer(device, warmup=args.warmup, seconds=args.seconds)
    common = dict(device=device, batch=args.batch_size, compiled=compiled, timer=timer, bf16=args.bf16)
    if side == "hand":
        hand_written(w, data, **common)
    else:
        ddpkit_trainer(w, data, workdir=workdir, checkpoint=checkpoint, **common)
    ms = timer.step_ms()
    units = args.batch_size * (w.seq_len or 1) * len(ms)
    result = {
        "step_ms": ms,
        "per_s": units / (sum(ms) / 1000),
        "warmup_s": timer.warmup_seconds,
        "losses": [float(v) for v in torch.stack(timer.losses).cpu()],
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    _fresh(device)
    return result


def _fresh(device: torch.device) -> None:
    """Forget the previous arm: its compiled graphs, its memory, its peak."""
    if "torch._dynamo" in sys.modules:  # imported by the first compiled arm (or the Trainer's compile setting)
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def largest_batch(w: Workload, data: OnDevice, args: argparse.Namespace) -> int:
    """The largest candidate batch whose eager hand-written steps peak below 90% of the GPU's memory."""
    device = torch.device(args.device)
    total = torch.cuda.get_device_properties(device).total_memory
    for batch in w.batches:
        probe = argparse.Namespace(**{**vars(args), "batch_size": batch, "warmup": 2, "seconds": 0.0})
        try:
            peak = run_arm("hand", w, data, probe, compiled=False, workdir=Path())["peak_bytes"]
        except torch.cuda.OutOfMemoryError:
            peak = None
        _fresh(device)
        progress(
            f"[gpu_bound] batch {batch}: "
            f"{'out of memory' if peak is None else f'peak {peak / 2**30:.1f} GiB of {total / 2**30:.0f}'}"
        )
        if peak is not None and peak < 0.9 * total:
            return batch
    raise SystemExit(f"gpu_bound: not even a batch of {w.batches[-1]} fits on this GPU")


# --- the throughput comparison ---------------------------------------------------------------------


def arm_name(side: str, mode: str, variant: str) -> str:
    """``hand-eager``, ``ddpkit-compiled``, ``ddpkit-eager-lora``: the side, the mode, and the variant unless full."""
    return f"{side}-{mode}" + ("" if variant == "full" else f"-{variant}")


def variant_jobs(w: Workload, data: OnDevice, variants: list[str]) -> dict[str, tuple[Workload, OnDevice]]:
    """What each variant trains: the same samples, plus ``model.lora`` or the documents the mask keeps apart."""
    jobs = {"full": (w, data)}
    if "lora" in variants:
        jobs["lora"] = (replace(w, name=f"{w.name}-lora", model={**w.model, "lora": LORA}), data)
    if "documents" in variants:
        documents = {"eot": w.eot, "restart_positions": False}
        jobs["documents"] = (w, OnDevice(*data.tensors, seq_len=w.seq_len, documents=documents))
    return jobs


def compare(
    w: Workload, data: OnDevice, args: argparse.Namespace, workdir: Path, *, saved: Any = None
) -> dict[str, Any]:
    """Every (side, variant) arm of each mode, alternated over the rounds; ``saved(runs)`` after each arm.

    An arm that raises (out of memory, a kernel this torch lacks) is kept as ``{"error": ...}`` and the others
    still run: a lent GPU's few minutes are not lost to one of them."""
    modes = ["eager", "compiled"] if args.mode == "both" else [args.mode]
    jobs = variant_jobs(w, data, args.variants)
    runs: dict[str, list[dict[str, Any]]] = {}
    for mode in modes:
        arms = [(side, variant) for variant in args.variants for side in args.sides]
        for r in range(args.rounds):
            for side, variant in rotated(arms, r):
                arm = arm_name(side, mode, variant)
                job, job_data = jobs[variant]
                try:
                    result = run_arm(
                        side, job, job_data, args, compiled=mode == "compiled", workdir=workdir / f"{arm}-r{r}"
                    )
                    said = (
                        f"{result['per_s']:,.0f} {w.unit}/s, {statistics.median(result['step_ms']):.1f} ms/step, "
                        f"warm-up {result['warmup_s']:.1f} s"
                    )
                except Exception as exc:
                    result = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                    said = f"failed: {result['error'][:300]}"
                if "error" in result:
                    # outside the except block, whose traceback held the arm's frames (its model, its optimizer)
                    _fresh(torch.device(args.device))
                # the Trainer's model.pt (5 GB at 1B parameters): one arm's at a time on the disk
                shutil.rmtree(workdir / f"{arm}-r{r}", ignore_errors=True)
                runs.setdefault(arm, []).append(result)
                progress(f"[gpu_bound] {w.name} round {r + 1}/{args.rounds} {arm}: {said}")
                if saved is not None:
                    saved(runs)
    return runs


def _paired_ok(results: list[dict[str, Any]], reference: list[dict[str, Any]]) -> Any:
    """The per-round ratio of throughputs over the rounds where both ran; None when none did."""
    pairs = [(r["per_s"], h["per_s"]) for r, h in zip(results, reference) if "error" not in r and "error" not in h]
    return paired(*zip(*pairs)) if pairs else None


def throughput_table(
    w: Workload,
    runs: dict[str, list[dict[str, Any]]],
    args: argparse.Namespace,
    flops_per_unit: dict[str, float | None],
    peak: float | None,
) -> str:
    """One row an arm; ``flops_per_unit``: training FLOPs a token by variant (None: no MFU)."""
    variants = len(args.variants) > 1
    headers = ["arm", f"{w.unit}/s", "min..max", "MFU", "p50 ms", "p95 ms", "peak GiB", "x hand", "x hand min..max"]
    headers += ["x full", "x full min..max"] if variants else []
    headers.append(f"loss diff (first {LOSSES_KEPT})")
    rows, failures = [], []
    for arm, results in runs.items():
        side, mode, *rest = arm.split("-")
        variant = rest[0] if rest else "full"
        failures += [f"{arm} round {i + 1}: {r['error']}" for i, r in enumerate(results) if "error" in r]
        done = [r for r in results if "error" not in r]
        if not done:
            rows.append([arm, "failed", *[""] * (len(headers) - 2)])
            continue
        hand = runs.get(arm_name("hand", mode, variant), [])
        per_s = summary([r["per_s"] for r in done])
        ratio = _paired_ok(results, hand)
        steps = sorted(itertools.chain.from_iterable(r["step_ms"] for r in done))
        flops = flops_per_unit.get(variant)
        mfu = f"{per_s.median * flops / peak:.1%}" if flops and peak else "n/a"
        diffs = [
            abs(a - b)
            for r, h in zip(results, hand)
            if "error" not in r and "error" not in h
            for a, b in zip(r["losses"], h["losses"])
        ]
        peak_gib = max((r["peak_bytes"] or 0) for r in done) / 2**30
        row = [
            arm,
            f"{per_s.median:,.0f}",
            per_s.spread(0),
            mfu,
            f"{_quantile(steps, 0.5):.1f}",
            f"{_quantile(steps, 0.95):.1f}",
            f"{peak_gib:.1f}" if peak_gib else "n/a",
            f"{ratio.median:.3f}" if ratio else "n/a",
            ratio.spread(3) if ratio else "",
        ]
        if variants:
            # the speed-up over the full model: this side's full arm of the same round and mode
            full = _paired_ok(results, runs.get(arm_name(side, mode, "full"), []))
            row += [f"{full.median:.3f}" if full else "n/a", full.spread(3) if full else ""]
        rows.append([*row, f"{max(diffs):.1e}" if diffs else "n/a"])
    timed = statistics.median(
        [len(r["step_ms"]) for r in itertools.chain.from_iterable(runs.values()) if "error" not in r] or [0]
    )
    described = {
        "lora": f"lora: model.lora {LORA}",
        "documents": f"documents: the document mask, documents of ~{args.doc_len} tokens (eot {w.eot})",
    }
    notes = [described[v] for v in args.variants if v in described]
    return "\n".join(
        [
            table(
                f"{describe(args)}\n{w.name}: batch {args.batch_size}"
                f"{f' x {w.seq_len} tokens' if w.seq_len else ''}, {'bf16 autocast' if args.bf16 else 'fp32'}, "
                f"{args.rounds} rounds of {args.seconds:g} s per arm after {args.warmup} warm-up steps "
                f"(median {timed:.0f} timed steps)" + "".join(f"; {n}" for n in notes),
                headers,
                rows,
            ),
            *(f"failed: {f}" for f in failures),
        ]
    )


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# --- the checkpoint stall --------------------------------------------------------------------------


STALL_VARIANTS = {"no saves": None, "sync": False, "async": True}  # -> checkpoint.async (None: no periodic saves)


def stall(w: Workload, data: OnDevice, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in STALL_VARIANTS}
    for r in range(args.rounds):
        for name in rotated(list(STALL_VARIANTS), r):
            async_save = STALL_VARIANTS[name]
            # Memory snapshots off in all three: their own copies would land in random steps of every variant.
            saves = {} if async_save is None else {"every_steps": args.every, "async": async_save, "keep_last": 1}
            checkpoint = {"memory_every_steps": None, **saves}
            result = run_arm(
                "ddpkit",
                w,
                data,
                args,
                compiled=args.mode == "compiled",
                checkpoint=checkpoint,
                workdir=workdir / f"{name.replace(' ', '-')}-r{r}",
            )
            runs[name].append(result)
            progress(
                f"[gpu_bound] stall round {r + 1}/{args.rounds} {name}: "
                f"{statistics.median(result['step_ms']):.1f} ms/step"
            )
    return runs


def save_costs(step_ms: list[float], *, warmup: int, every: int, after: int) -> dict[str, Any]:
    """What each save in one run cost, from its step times.

    ``step_ms[i]`` is step ``warmup + 1 + i``; a save at step s (a multiple of ``every``) runs after step s's
    mark, so it lands in step s + 1. ``typical``: the median of the steps more than ``after`` steps past a
    save. Per save: ``blocked``, step s + 1's time beyond typical (the loop held up: the stall), and ``lost``,
    the same summed over steps s + 1 .. s + after (a background write slowing the steps beside it too);
    ``near``: the times of those steps.
    """
    steps = {warmup + 1 + i: ms for i, ms in enumerate(step_ms)}
    saves = [s for s in steps if s % every == 0 and s + after in steps]
    near = {s + k for s in saves for k in range(1, after + 1)}
    typical = statistics.median([ms for s, ms in steps.items() if s not in near] or step_ms)
    return {
        "typical": typical,
        "near": [steps[s] for s in sorted(near)],
        "blocked": [(steps[s + 1] - typical) / 1000 for s in saves],
        "lost": [sum(steps[s + k] - typical for k in range(1, after + 1)) / 1000 for s in saves],
    }


def stall_table(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    rows = []
    for name, results in runs.items():
        costs = [save_costs(r["step_ms"], warmup=args.warmup, every=args.every, after=args.after) for r in results]
        step = statistics.median(c["typical"] for c in costs)
        if STALL_VARIANTS[name] is None:
            every_step = sorted(itertools.chain.from_iterable(r["step_ms"] for r in results))
            rows.append([name, "-", "-", "-", "-", f"{_quantile(every_step, 0.95):.1f} (every step)", f"{step:.1f}"])
            continue
        if not any(c["blocked"] for c in costs):
            rows.append([name, "0: raise --seconds or lower --every", "", "", "", "", ""])
            continue
        blocked, lost = summary(sum((c["blocked"] for c in costs), [])), summary(sum((c["lost"] for c in costs), []))
        near = sorted(itertools.chain.from_iterable(c["near"] for c in costs))
        rows.append(
            [
                name,
                str(blocked.n),
                f"{blocked.median:.3f} ({blocked.spread(3)})",
                f"{blocked.median * 1000 / step:.2f}",
                f"{lost.median:.3f}",
                f"{_quantile(near, 0.95):.1f}",
                f"{step:.1f}",
            ]
        )
    return table(
        f"{describe(args)}\ncheckpoint stall, ddpkit {args.mode}, batch {args.batch_size}: a save every "
        f"{args.every} steps, {args.rounds} rounds of {args.seconds:g} s; blocked: the step after a save "
        f"beyond the median step, lost: the same over the {args.after} steps after it",
        [
            "saves",
            "count",
            "blocked s (min..max)",
            "blocked steps",
            f"lost s ({args.after} steps)",
            f"p95 ms, {args.after} steps after saves",
            "p50 ms",
        ],
        rows,
    )


# --- the machine -----------------------------------------------------------------------------------


def describe(args: argparse.Namespace) -> str:
    """The GPU (or CPU), driver, torch version and date: what every figure needs beside it."""
    if args.device == "cuda":
        try:
            driver = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout.strip()
                or "unknown"
            )
        except (OSError, subprocess.SubprocessError):
            driver = "unknown"
        where = f"{torch.cuda.get_device_name(0)}, driver {driver}, CUDA {torch.version.cuda}"
    else:
        where = "CPU"
    return f"{where}, torch {torch.__version__}, {datetime.date.today().isoformat()}"


def flops_per_unit(w: Workload) -> dict[str, float | None]:
    """Training FLOPs per token by variant (``flops_per_token``: PaLM's 6N plus attention); empty for images.

    ``documents`` counts the causal step's FLOPs (FlexAttention skips the blocks the mask empties: its MFU is the
    rate of the causal work it stands for); ``lora`` none, 6N counting the weight gradients a LoRA step skips."""
    if not w.seq_len:
        return {}
    from ddpkit.registry import MODELS

    # on the meta device: the shape without 1B parameters' initialisation on the host
    with torch.device("meta"):
        model = MODELS.build(w.model["name"], key="model.name", kwargs=w.model["kwargs"])
    flops = model.flops_per_token(w.seq_len)
    return {"full": flops, "documents": flops, "lora": None}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="gpt2")
    parser.add_argument(
        "--mode", choices=["eager", "compiled", "both"], default="both", help="(--stall: eager or compiled)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds (default 2)")
    parser.add_argument(
        "--seconds",
        type=float,
        default=30.0,
        help="host seconds timed per arm and round, after the warm-up (default 30)",
    )
    parser.add_argument("--warmup", type=int, default=20, help="steps before timing, compilation included (default 20)")
    parser.add_argument(
        "--batch-size", default="auto", help="per-step batch, or auto: the largest that fits (default; 4 without CUDA)"
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, for a run of the code path on a CPU")
    parser.add_argument(
        "--stall", action="store_true", help="checkpoint stall: no saves / sync / async saves, ddpkit only"
    )
    parser.add_argument("--every", type=int, default=100, help="--stall: a save every this many steps (default 100)")
    parser.add_argument(
        "--after", type=int, default=5, help="--stall: steps after a save that its cost is counted in (default 5)"
    )
    parser.add_argument(
        "--variants",
        default="full",
        help=f"comma-separated, of {', '.join(VARIANTS)}: the plain model, model.lora {LORA}, the document mask "
        "(token windows; default full)",
    )
    parser.add_argument(
        "--doc-len", type=int, default=None, help="documents: their mean length in tokens (default 512; --tiny: 8)"
    )
    parser.add_argument(
        "--sides", default="hand,ddpkit", help="comma-separated: hand, ddpkit or both (default hand,ddpkit)"
    )
    parser.add_argument("--json", default=None, help="also write every measurement here (after every arm)")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the mark after the last warm-up step starts the clock")
    args.doc_len = args.doc_len or (8 if args.tiny else 512)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or not args.variants:
        parser.error(f"--variants: {', '.join(unknown) or 'none given'}; choose from {', '.join(VARIANTS)}")
    args.sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    if not args.sides or set(args.sides) - {"hand", "ddpkit"}:
        parser.error("--sides: hand, ddpkit, or hand,ddpkit")
    if "full" not in args.variants:
        # every ratio but x hand is against the full model's arm of the same round
        args.variants.insert(0, "full")
    if args.workload == "resnet50" and set(args.variants) != {"full"}:
        parser.error("--variants lora and documents train a language model: choose --workload gpt2 or llama1b")
    if args.stall and args.variants != ["full"]:
        parser.error("--stall measures saves of the full model: leave --variants out")
    args.bf16 = args.device == "cuda"
    if args.stall and args.mode == "both":
        args.mode = "eager"
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_bound: --device cuda needs a CUDA GPU (none is visible here); --device cpu --tiny runs the code path",
            file=sys.stderr,
        )
        return 2
    w = (TINY if args.tiny else WORKLOADS)[args.workload]
    device = torch.device(args.device)
    data = make_data(w, device, doc_len=args.doc_len if "documents" in args.variants else None)
    if args.batch_size == "auto":
        args.batch_size = largest_batch(w, data, args) if args.device == "cuda" else 4
    args.batch_size = int(args.batch_size)
    if args.batch_size * 2 > w.samples:
        raise SystemExit(
            f"gpu_bound: --batch-size {args.batch_size} leaves fewer than 2 steps an epoch over {w.samples} samples"
        )
    machine = describe(args)

    def saved(runs: dict[str, Any], *, complete: bool = False) -> None:
        # rewritten after every arm: a run cut short by its time limit still leaves the arms it finished
        if args.json:
            written = {"machine": machine, "args": vars(args), "complete": complete, "runs": runs}
            Path(args.json).write_text(json.dumps(written, indent=1))

    with load_printed(), tempfile.TemporaryDirectory(prefix="bench-gpu-bound-") as tmp:
        if args.stall:
            runs = stall(w, data, args, Path(tmp))
            print(stall_table(runs, args), flush=True)
        else:
            runs = compare(w, data, args, Path(tmp), saved=saved)
            peak = None
            if args.device == "cuda":
                from ddpkit.reporting.throughput import peak_flops

                peak = peak_flops(device, "bf16")
            print(throughput_table(w, runs, args, flops_per_unit(w), peak), flush=True)
    saved(runs, complete=True)
    return 1 if any("error" in r for results in runs.values() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
