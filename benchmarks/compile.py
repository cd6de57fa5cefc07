"""torch.compile side by side: hand-written eager / compiled DDP loops against ddpkit eager / `train.compile: true`.

    python -m benchmarks.compile                                   # mnist_cnn and resnet18, 3 rounds
    python -m benchmarks.compile --workloads resnet18 --rounds 2 --variants hand-eager,ddpkit-compiled
    python -m benchmarks.compile --accuracy 0.95 --rounds 2        # time to 95% on the digits data
    python -m benchmarks.compile --variants hand-eager,ddpkit-eager,ddpkit-cl,ddpkit-compiled-cl   # channels_last
    python -m benchmarks.compile --page-faults --rounds 5          # glibc's defaults vs train.keep_host_memory

Each workload runs as one job of 2 Gloo ranks (one thread each) started through torch's
launcher; inside it every variant trains the same model on the same data (``benchmarks.workloads``:
per-rank batch 64, SGD lr 0.01 momentum 0.9, same seed) in alternating rounds:

* ``hand-eager``: the plain DDP loop (``benchmarks.workloads.train_by_hand``), the reference;
* ``hand-compiled``: the same loop on ``torch.compile(DDP(model))`` (the order torch's DDP notes give);
* ``ddpkit-eager``, ``ddpkit-compiled``: ``ddpkit.Trainer`` with its defaults, ``train.compile: false`` / ``true``;
* ``ddpkit-cl``, ``ddpkit-compiled-cl``: the same with ``train.channels_last: true``.

Columns: steady ``ms/step`` (mean over the steps after the warm-up, median over rounds, and its
range), the paired ratio to ``hand-eager`` and to ``hand-compiled`` (median of per-round ratios,
and its range), ``CPU ms/step`` of the training thread (``time.thread_time``: blind to time spent
descheduled by other jobs or waiting for the other rank, so much steadier on a shared machine)
and its paired ratio to the first variant, and ``compile s``: the first step's time beyond a steady step, which is the
compilation (Dynamo, AOTAutograd, Inductor) plus one-time costs every variant pays. Inductor
caches compiled kernels on disk (``/tmp/torchinductor_$USER``), so rounds after the first compile
faster: the column shows the median; the first round's value is printed with the progress lines.

``--accuracy A`` measures instead the wall time from the start of a run (model built, loader,
compile included) until the validation accuracy on the digits data (12,000 training / 2,000
validation images) first reaches ``A``, checked every 25 steps, for the MNIST CNN (batch 64 per
rank, SGD lr 0.05 momentum 0.9).

``--page-faults`` runs the MNIST CNN's training step (batch 64, one process, one thread) in fresh
processes, alternating glibc malloc's defaults with ``ddpkit.training.allocator.keep_freed_host_memory()``
(what ``train.keep_host_memory`` does), and reports minor page faults, kernel time and CPU time
per step: the cause of the CNN's run-to-run 0.98x..1.16x paired ratios in ``benchmarks.overhead``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import (
    BATCH,
    MOMENTUM,
    SEED,
    WORKLOADS,
    accuracy,
    build,
    load_printed,
    loader_for,
    paired,
    rotated,
    run_module_workers,
    strided_loader,
    table,
    train_by_hand,
    trainer_config,
)
from ddpkit.bench.report import Stats, progress
from ddpkit.bench.timed import StepClock, TimedTrainer, median_step_ms, steady_ms_per_step
from ddpkit.bench.worker import serve
from ddpkit.data.datasets import digits
from ddpkit.distributed.process_group import Runtime
from ddpkit.registry import MODELS

STEPS = {"mnist_cnn": (60, 10), "resnet18": (10, 3)}  # timed steps, warm-up steps (the first includes compiling)
EVAL_EVERY, ACC_LR, ACC_MAX_STEPS = 25, 0.05, 2000


# --- the step-time variants ----------------------------------------------------------------------


def hand(w: dict[str, Any], steps: int, rank: int, world_size: int, *, compiled: bool) -> StepClock:
    torch.manual_seed(SEED)
    train_set, model = build(w, steps)
    clock = StepClock()
    loader = loader_for(train_set, rank, world_size)
    train_by_hand(
        model,
        loader,
        rank=rank,
        world_size=world_size,
        max_steps=steps,
        compiled=compiled,
        on_step=lambda step: clock.tick(),
    )
    return clock


def ddpkit_run(w: dict[str, Any], steps: int, world_size: int, workdir: Path, **train: Any) -> StepClock:
    trainer = TimedTrainer(trainer_config(w, steps, world_size, workdir, name="compile", train=train))
    with contextlib.redirect_stderr(io.StringIO()):  # the progress bar stays on, but off the screen
        trainer.fit()
    return trainer.clock


VARIANTS = {
    "hand-eager": lambda w, s, r, n, d: hand(w, s, r, n, compiled=False),
    "hand-compiled": lambda w, s, r, n, d: hand(w, s, r, n, compiled=True),
    "ddpkit-eager": lambda w, s, r, n, d: ddpkit_run(w, s, n, d),
    "ddpkit-compiled": lambda w, s, r, n, d: ddpkit_run(w, s, n, d, compile=True),
    "ddpkit-cl": lambda w, s, r, n, d: ddpkit_run(w, s, n, d, channels_last=True),
    "ddpkit-compiled-cl": lambda w, s, r, n, d: ddpkit_run(w, s, n, d, compile=True, channels_last=True),
}
DEFAULT_VARIANTS = ["hand-eager", "hand-compiled", "ddpkit-eager", "ddpkit-compiled"]


def steps_worker(params: dict[str, Any], *, runtime: Runtime, workdir: Path) -> dict[str, Any]:
    w, (steps, warmup) = WORKLOADS[params["workload"]], STEPS[params["workload"]]
    rank, world_size, variants = runtime.env.rank, runtime.env.world_size, params["variants"]
    runs: dict[str, dict[str, list[float]]] = {v: {"ms": [], "cpu_ms": [], "compile_s": []} for v in variants}
    for r in range(params["rounds"]):
        for name in rotated(variants, r):
            torch._dynamo.reset()  # every compiled variant compiles, as a fresh process would (disk caches stay)
            clock = VARIANTS[name](w, warmup + steps, rank, world_size, workdir / f"r{r}-{name}")
            ms = steady_ms_per_step(clock.wall, warmup=warmup)
            first = clock.wall[1] - clock.wall[0]
            runs[name]["ms"].append(ms)
            runs[name]["cpu_ms"].append(steady_ms_per_step(clock.cpu, warmup=warmup))
            runs[name]["compile_s"].append(max(first - median_step_ms(clock.wall, warmup=warmup) / 1000, 0.0))
            if rank == 0:
                progress(
                    f"[compile] {params['workload']} round {r + 1} {name}: {ms:.1f} ms/step, first step {first:.1f} s"
                )
    return {"runs": runs, "steps": steps, "warmup": warmup}


def report_steps(workload: str, result: dict[str, Any]) -> str:
    runs = result["runs"]
    rows = []
    for name, run in runs.items():
        ms = Stats.of(run["ms"])
        cells = [name, f"{ms.median:.1f}", ms.spread(1)]
        for ref in ("hand-eager", "hand-compiled"):
            if ref in runs:
                ratio = paired(run["ms"], runs[ref]["ms"])
                cells += [f"{ratio.median:.3f}", ratio.spread(3)]
            else:
                cells += ["-", "-"]
        cpu = paired(run["cpu_ms"], runs[next(iter(runs))]["cpu_ms"])
        cells += [
            f"{statistics.median(run['cpu_ms']):.1f}",
            f"{cpu.median:.3f}",
            cpu.spread(3),
            f"{statistics.median(run['compile_s']):.1f}",
        ]
        rows.append(cells)
    title = (
        f"{workload}: 2 ranks x 1 thread, batch {BATCH}/rank, {result['steps']} timed steps after "
        f"{result['warmup']} warm-up, {len(next(iter(runs.values()))['ms'])} rounds"
    )
    headers = [
        "variant",
        "ms/step",
        "min..max",
        "x hand-eager",
        "min..max",
        "x hand-compiled",
        "min..max",
        "CPU ms/step",
        f"CPU x {next(iter(runs))}",
        "min..max",
        "compile s",
    ]
    return table(title, headers, rows)


# --- time to accuracy on the digits data ------------------------------------------------------------


class _UntilAccurate(TimedTrainer):
    target = 1.0

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        if metrics.get("val_accuracy", 0.0) >= self.target:
            self.request_stop()


def ddpkit_to_accuracy(target: float, workdir: Path, **train: Any) -> tuple[float, int]:
    started = time.perf_counter()
    trainer = _UntilAccurate(
        {
            "run": {"name": "accuracy", "output_dir": str(workdir), "seed": SEED},
            "data": {"name": "digits", "batch_size": BATCH},
            "model": {"name": "mnist_cnn"},
            "optim": {"name": "sgd", "lr": ACC_LR, "momentum": MOMENTUM},
            "train": {"epochs": None, "max_steps": ACC_MAX_STEPS, "eval_every": EVAL_EVERY, **train},
            "checkpoint": {"every_epochs": None, "resume": "none"},
        }
    )
    trainer.target = target
    with contextlib.redirect_stderr(io.StringIO()):
        metrics = trainer.fit()
    return time.perf_counter() - started, int(metrics["step"])


def hand_to_accuracy(target: float, rank: int, world_size: int, *, compiled: bool) -> tuple[float, int]:
    started = time.perf_counter()
    torch.manual_seed(SEED)
    train_set, val_set = digits()
    model = MODELS.build("mnist_cnn", key="model.name", kwargs={})
    evaluator = torch.compile(model) if compiled else model  # the bare module: no collective per batch
    val = strided_loader(val_set, rank, world_size)

    def reached(step: int) -> bool:
        return step > 0 and step % EVAL_EVERY == 0 and accuracy(evaluator, val) >= target

    loader = loader_for(train_set, rank, world_size)
    steps = train_by_hand(
        model,
        loader,
        rank=rank,
        world_size=world_size,
        max_steps=ACC_MAX_STEPS,
        lr=ACC_LR,
        compiled=compiled,
        on_step=reached,
    )
    return time.perf_counter() - started, steps


ACCURACY_VARIANTS = {
    "hand-eager": lambda t, r, n, d: hand_to_accuracy(t, r, n, compiled=False),
    "hand-compiled": lambda t, r, n, d: hand_to_accuracy(t, r, n, compiled=True),
    "ddpkit-eager": lambda t, r, n, d: ddpkit_to_accuracy(t, d),
    "ddpkit-compiled": lambda t, r, n, d: ddpkit_to_accuracy(t, d, compile=True),
    "ddpkit-cl": lambda t, r, n, d: ddpkit_to_accuracy(t, d, channels_last=True),
    "ddpkit-compiled-cl": lambda t, r, n, d: ddpkit_to_accuracy(t, d, compile=True, channels_last=True),
}


def accuracy_worker(params: dict[str, Any], *, runtime: Runtime, workdir: Path) -> dict[str, Any]:
    rank, world_size, variants = runtime.env.rank, runtime.env.world_size, params["variants"]
    runs: dict[str, dict[str, list[float]]] = {v: {"s": [], "steps": []} for v in variants}
    for r in range(params["rounds"]):
        for name in rotated(variants, r):
            torch._dynamo.reset()
            seconds, steps = ACCURACY_VARIANTS[name](params["target"], rank, world_size, workdir / f"r{r}-{name}")
            runs[name]["s"].append(seconds)
            runs[name]["steps"].append(steps)
            if rank == 0:
                progress(f"[accuracy] round {r + 1} {name}: {seconds:.1f} s, {steps} steps")
    return {"runs": runs}


def report_accuracy(target: float, result: dict[str, Any]) -> str:
    runs, rows = result["runs"], []
    for name, run in runs.items():
        s = Stats.of(run["s"])
        ratio = paired(run["s"], runs["hand-eager"]["s"])
        rows.append(
            [
                name,
                f"{s.median:.1f}",
                s.spread(1),
                f"{ratio.median:.3f}",
                ratio.spread(3),
                ", ".join(str(n) for n in run["steps"]),
            ]
        )
    title = f"time to {target:.0%} validation accuracy, MNIST CNN on digits, 2 ranks x 1 thread, batch {BATCH}/rank"
    return table(title, ["variant", "seconds", "min..max", "x hand-eager", "min..max", "steps"], rows)


# --- page faults per step: malloc's defaults vs kept host memory ------------------------------------------

_FAULTS = r"""
import resource, sys, time, torch, torch.nn.functional as F
from ddpkit.training.allocator import keep_freed_host_memory
from ddpkit.registry import MODELS
torch.set_num_threads(1)
if sys.argv[1] == "kept":
    keep_freed_host_memory()
torch.manual_seed(0)
model = MODELS.build("mnist_cnn", key="model.name", kwargs={})
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y, bookkeeping = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)), []
def step(i):
    F.cross_entropy(model(x), y).backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
    if i % 10 == 0:
        bookkeeping.append(torch.zeros(10))  # small long-lived blocks, as any loop's logging makes
for i in range(20):
    step(i)
r0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
for i in range(200):
    step(i)
r1, c1 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
print((r1.ru_minflt - r0.ru_minflt) / 200, (r1.ru_stime - r0.ru_stime) / 200 * 1000, (c1 - c0) / 200 * 1000)
"""


def page_faults(rounds: int) -> str:
    import subprocess

    rows: dict[str, list[list[float]]] = {"malloc defaults": [], "kept (train.keep_host_memory)": []}
    for r in range(rounds):
        variants = (("malloc defaults", "defaults"), ("kept (train.keep_host_memory)", "kept"))
        for name, arg in variants[:: 1 if r % 2 == 0 else -1]:
            out = subprocess.run(
                [sys.executable, "-c", _FAULTS, arg],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            rows[name].append([float(v) for v in out.stdout.split()])
            progress(f"[page faults] round {r + 1} {name}: {out.stdout.strip()}")
    columns = ((0, 0), (1, 2), (2, 1))  # (index, decimals) of faults, kernel ms and CPU ms
    rows_out = [
        [name, *(", ".join(f"{run[i]:.{d}f}" for run in runs) for i, d in columns)] for name, runs in rows.items()
    ]
    title = (
        f"MNIST CNN training step, batch 64, 1 process x 1 thread, 200 steps per run, {rounds} runs each "
        "(fresh processes, alternating)"
    )
    return table(title, ["malloc", "minor faults/step", "kernel ms/step", "CPU ms/step"], rows_out)


# --- the driver --------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return serve(argv[1], {"compile_steps": steps_worker, "compile_accuracy": accuracy_worker})
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mnist_cnn,resnet18", help="comma list of mnist_cnn, resnet18")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--accuracy", type=float, default=None, help="measure time to this validation accuracy instead")
    parser.add_argument("--page-faults", action="store_true", help="measure page faults per step instead (see above)")
    parser.add_argument("--json", default=None, help="also write all measurements here")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants + args.workloads.split(",") if v not in VARIANTS and v not in STEPS]
    if unknown:
        parser.error(f"unknown variant or workload {unknown[0]!r}")
    results: dict[str, Any] = {}
    with load_printed():
        if args.page_faults:
            print(page_faults(args.rounds), flush=True)
        elif args.accuracy is not None:
            params = {
                "variants": ["hand-eager", *[v for v in variants if v != "hand-eager"]],
                "rounds": args.rounds,
                "target": args.accuracy,
                "timeout": 1800,
            }
            results["accuracy"] = run_module_workers(__spec__.name, "compile_accuracy", params, nproc=2)
            print(report_accuracy(args.accuracy, results["accuracy"]), flush=True)
        else:
            for workload in args.workloads.split(","):
                params = {"workload": workload, "variants": variants, "rounds": args.rounds, "timeout": 1800}
                progress(f"[compile] {workload}: {', '.join(variants)} x {args.rounds} rounds ...")
                results[workload] = run_module_workers(__spec__.name, "compile_steps", params, nproc=2)
                print(report_steps(workload, results[workload]), flush=True)
    if args.json and results:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
