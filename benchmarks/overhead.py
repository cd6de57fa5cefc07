"""Per-step overhead of the ddpkit Trainer against a plain hand-written DDP loop.

    python -m benchmarks.overhead                        # step-cost, mlp, mnist_cnn, resnet18; 7 rounds
    python -m benchmarks.overhead --workloads mlp --rounds 3
    python -m benchmarks.overhead --json benchmarks/overhead.json
    python -m benchmarks.overhead --workloads mlp --fresh      # each variant of each round in new processes
    valgrind --tool=cachegrind --cache-sim=no python -m benchmarks.overhead --single ddpkit 450   # instructions

(From the repository root, as every benchmark: see ``benchmarks/__init__.py``.)

Each workload runs as one job of 2 Gloo ranks (one thread each; ``step-cost`` and ``mlp-1``: one process)
started through torch's launcher. Inside that job every variant trains the same model on the same data with the same
seed, optimizer (SGD, lr 0.01, momentum 0.9), per-rank batch (64) and number of steps, in
alternating rounds (the order rotates each round, so every variant runs in every position):

* ``hand-written``: the plain loop (``benchmarks.workloads.train_by_hand``: ``DistributedSampler``,
  ``DDP``, forward, backward, step), the reference;
* ``ddpkit``: the config-driven ``ddpkit.Trainer`` with its defaults (progress bar on, loss
  reduced every 50 steps);
* ``ddpkit+timeline``: the same with ``train.timeline: true`` (the cost of recording spans);
* ``fabric``, ``lightning``, ``accelerate``: the same workload in Lightning Fabric, the Lightning
  Trainer and Hugging Face Accelerate, when they are importable (else reported as skipped).

Columns, per variant:

* ``ms/step``, ``min..max``: wall-clock mean over the steps after the warm-up (see
  ``ddpkit.bench.timed``), median over the rounds, and its range;
* ``x hand``, ``x hand min..max``: the ratio to the hand-written loop, paired (both measured in
  the same round), median and range over the rounds;
* ``x hand (best rounds)``: the ratio of the best (lowest) per-run median step times: on a
  machine shared with other work, noise only ever adds time, so the best runs are the cleanest;
* ``CPU us/step vs hand``: extra CPU microseconds per step of the training thread
  (``time.thread_time``, blind to time spent descheduled), paired median: the loop's own cost;
* ``bitwise = hand``: final weights equal to the hand-written loop's exactly, in how many rounds.

With ``--fresh`` every variant of every round is a 2-rank job of its own (new processes, the
order still rotating): no variant inherits the heap and caches an earlier one left, which in one
long-lived process moves a step by tens to hundreds of microseconds. Slower (a few seconds of
start-up per job); the final weights are compared by their SHA-256 across the jobs.

Timing cannot resolve a few microseconds per step on a shared machine; instruction counts can.
``--single VARIANT STEPS [LOG_EVERY]`` runs one variant of ``step-cost`` in this process and
nothing else, for ``valgrind --tool=cachegrind``: run it for two step counts, and the difference
of the instruction totals divided by the difference of the steps is the loop's instructions per
step, with start-up cancelled out.

The hand-written loop mirrors the Trainer's setup order, which is what makes the weights
bitwise equal (``benchmarks.workloads`` says how).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.workloads import (
    BATCH,
    LR,
    MOMENTUM,
    SEED,
    WORKLOADS,
    build,
    loader_for,
    paired,
    rotated,
    run_module_workers,
    table,
    train_by_hand,
    trainer_config,
    weights_digest,
)
from ddpkit.bench.report import Stats, progress
from ddpkit.bench.timed import StepClock, TimedTrainer, median_step_ms, steady_ms_per_step
from ddpkit.bench.worker import serve
from ddpkit.distributed.process_group import Runtime
from ddpkit.training.allocator import keep_freed_host_memory

FRAMEWORKS = {"fabric": "lightning", "lightning": "lightning", "accelerate": "accelerate"}


# --- the variants: each returns (its StepClock, final state_dict of the bare model) -------------


def hand_written(
    w: dict[str, Any],
    steps: int,
    rank: int,
    world_size: int,
    *,
    checks: bool = False,
    batched: bool = False,
) -> tuple[StepClock, dict]:
    """``checks``: also the Trainer's NaN guard on the loss and the gradient norm read each step (health's
    per-step work); ``batched``: the data read a batch at a time, as the Trainer reads a TensorDataset
    (what is left is the loop's own cost)."""
    torch.manual_seed(SEED)
    train_set, model = build(w, steps)
    clock = StepClock()
    loader = loader_for(train_set, rank, world_size, batched=batched)
    train_by_hand(
        model,
        loader,
        rank=rank,
        world_size=world_size,
        max_steps=steps,
        checks=checks,
        on_step=lambda step: clock.tick(),
    )
    return clock, model.state_dict()


def ddpkit_trainer(
    w: dict[str, Any],
    steps: int,
    rank: int,
    world_size: int,
    *,
    workdir: Path,
    timeline: bool = False,
    log_every: int = 50,
    without: dict[str, dict[str, Any]] | None = None,
) -> tuple[StepClock, dict]:
    config = trainer_config(
        w, steps, world_size, workdir / "ddpkit", name="overhead", train={"timeline": timeline, "log_every": log_every}
    )
    for section, values in (without or {}).items():  # an ablation: some default switched off
        config[section] = {**config.get(section, {}), **values}
    trainer = TimedTrainer(config)
    with contextlib.redirect_stderr(io.StringIO()):  # the progress bar stays on, but off the screen
        trainer.fit()
    return trainer.clock, trainer.unwrapped_model.state_dict()


def wrapped_loop(
    w: dict[str, Any], steps: int, rank: int, world_size: int, *, setup: Any, backward: Any
) -> tuple[StepClock, dict]:
    """The hand-written loop with a framework's ``setup(model, optimizer)`` and ``backward(loss)``."""
    torch.manual_seed(SEED)
    train_set, model = build(w, steps)
    wrapped, optimizer = setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    loader = loader_for(train_set, rank, world_size)  # our sampler: the same order as the others
    torch.manual_seed(SEED + rank)
    wrapped.train()
    clock = StepClock()
    clock.tick()
    for x, y in loader:
        backward(F.cross_entropy(wrapped(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
    return clock, model.state_dict()


def fabric(w: dict[str, Any], steps: int, rank: int, world_size: int) -> tuple[StepClock, dict]:
    from lightning.fabric import Fabric

    runner = Fabric(accelerator="cpu", devices=world_size, strategy="ddp" if world_size > 1 else "auto")
    runner.launch()  # under torchrun: no new processes; the existing process group is reused
    return wrapped_loop(w, steps, rank, world_size, setup=runner.setup, backward=runner.backward)


def lightning(w: dict[str, Any], steps: int, rank: int, world_size: int) -> tuple[StepClock, dict]:
    import lightning as L

    clock = StepClock()

    class Module(L.LightningModule):
        def __init__(self, net: torch.nn.Module):
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

        def on_train_start(self) -> None:
            torch.manual_seed(SEED + rank)
            clock.tick()

        def on_train_batch_end(self, *args: Any) -> None:
            clock.tick()

    for name in ("lightning.pytorch", "lightning.fabric"):  # banners and tips go through logging
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.manual_seed(SEED)
    train_set, model = build(w, steps)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # banners, progress bar
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy="ddp" if world_size > 1 else "auto",
            max_steps=steps,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(Module(model), train_dataloaders=loader_for(train_set, rank, world_size))
    return clock, model.state_dict()


def accelerate(w: dict[str, Any], steps: int, rank: int, world_size: int) -> tuple[StepClock, dict]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    return wrapped_loop(w, steps, rank, world_size, setup=accelerator.prepare, backward=accelerator.backward)


#: What each ablation switches off (config sections), and ``bare``: all of them and the periodic loss reduction.
ABLATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "health": {"health": {"straggler": None, "check_replicas_every": None}},
    "watchdog": {"dist": {"hang_timeout": None}},
    "signals": {"checkpoint": {"save_on_signals": []}},
    "recovery": {"checkpoint": {"crash_save": False, "memory_every_steps": None}},
    "progress": {"log": {"progress_bar": False}},
}
ABLATIONS["bare"] = {
    section: {k: v for off in ABLATIONS.values() for k, v in off.get(section, {}).items()}
    for section in ("health", "dist", "checkpoint", "log")
}
ABLATIONS["bare"]["train"] = {"log_every": 10**9}

VARIANTS = {
    "hand-written": hand_written,
    "hand-written+checks": functools.partial(hand_written, checks=True),  # not run by default
    "hand-written+batched-reads": functools.partial(hand_written, batched=True),  # not run by default
    # --single only: mallopt is per process
    "hand-written+host-memory": lambda *a, **kw: (keep_freed_host_memory(), hand_written(*a, **kw))[1],
    "ddpkit": ddpkit_trainer,
    "ddpkit+timeline": lambda *a, **kw: ddpkit_trainer(*a, **kw, timeline=True),
    # Not run by default: the Trainer with no loss reduction inside the run (log_every past the end).
    "ddpkit-nolog": lambda *a, **kw: ddpkit_trainer(*a, **{**kw, "log_every": 10**9}),
    # Ablations, not run by default: the Trainer with one group of defaults switched off, to say
    # what each costs per step (the difference to `ddpkit` in the same round).
    **{
        f"ddpkit-{'' if name == 'bare' else 'no-'}{name}": functools.partial(ddpkit_trainer, without=off)
        for name, off in ABLATIONS.items()
    },
    # Not run by default: the gradients as torch's DDP keeps them by default (copied out of the buckets),
    # and the gradient norm per parameter: ddpkit before ddp.gradient_as_bucket_view became true.
    "ddpkit-no-bucket-view": functools.partial(ddpkit_trainer, without={"ddp": {"gradient_as_bucket_view": False}}),
    "fabric": fabric,
    "lightning": lightning,
    "accelerate": accelerate,
}


# --- the worker: every variant, round after round, in one process group -------------------------


def overhead_worker(params: dict[str, Any], *, runtime: Runtime, workdir: Path) -> dict[str, Any]:
    w, variants, rounds = WORKLOADS[params["workload"]], params["variants"], params["rounds"]
    steps = params.get("steps") or w["steps"]
    warmup = min(w["warmup"], steps // 3)
    rank, world_size = runtime.env.rank, runtime.env.world_size
    runs: dict[str, dict[str, list]] = {v: {"wall": [], "step_median": [], "cpu": [], "weights": []} for v in variants}
    first_round = params.get("first_round", 0)  # --fresh: one round of one variant per job, numbered by the driver
    for r in range(first_round, first_round + rounds):
        for name in rotated(variants, r):
            extra = {"workdir": workdir / f"r{r}"} if name.startswith("ddpkit") else {}
            clock, final = VARIANTS[name](w, warmup + steps, rank, world_size, **extra)
            run = runs[name]
            run["wall"].append(steady_ms_per_step(clock.wall, warmup=warmup))
            run["step_median"].append(median_step_ms(clock.wall, warmup=warmup))
            run["cpu"].append(steady_ms_per_step(clock.cpu, warmup=warmup))
            run["weights"].append(weights_digest(final))
            if rank == 0:
                progress(
                    f"[overhead] {params['workload']} round {r + 1} {name}: "
                    f"{run['wall'][-1]:.3f} ms/step, {run['cpu'][-1]:.3f} CPU ms/step"
                )
    return {"runs": runs, "steps": steps, "warmup": warmup}


def run_fresh(workload: str, variants: list[str], rounds: int, steps: int | None) -> dict[str, Any]:
    """Every variant of every round in a job of its own (new processes, the order rotating each round).

    In one long-lived process each variant inherits the heap and caches the previous ones left, which
    moves a step by tens to hundreds of microseconds; fresh processes measure each loop as users run it."""
    merged: dict[str, Any] = {}
    for r in range(rounds):
        for name in rotated(variants, r):
            params = {"workload": workload, "variants": [name], "rounds": 1, "steps": steps, "first_round": r}
            result = run_module_workers(__spec__.name, "overhead", params, nproc=WORKLOADS[workload]["nproc"])
            merged.setdefault("runs", {}).setdefault(name, {k: [] for k in result["runs"][name]})
            for key, values in result["runs"][name].items():
                merged["runs"][name][key] += values
            merged.update(steps=result["steps"], warmup=result["warmup"])
    merged["runs"] = {name: merged["runs"][name] for name in variants}  # hand-written first, as in one job
    return merged


def mark_bitwise(result: dict[str, Any]) -> None:
    """Per round, whether each variant's final weights equal the hand-written loop's exactly."""
    hand = result["runs"]["hand-written"]["weights"]
    for run in result["runs"].values():
        run["bitwise"] = [mine == theirs for mine, theirs in zip(run["weights"], hand)]


# --- the driver ------------------------------------------------------------------------------------


def report(workload: str, result: dict[str, Any]) -> str:
    runs, hand = result["runs"], result["runs"]["hand-written"]
    rows = []
    for name, run in runs.items():
        wall, same = Stats.of(run["wall"]), run["bitwise"]
        ratio = paired(run["wall"], hand["wall"])
        of_mins = min(run["step_median"]) / min(hand["step_median"])
        extra_us = paired(run["cpu"], hand["cpu"], scale=1000, difference=True).median
        rows.append(
            [
                name,
                f"{wall.median:.3f}",
                wall.spread(3),
                f"{ratio.median:.3f}",
                ratio.spread(3),
                f"{of_mins:.3f}",
                f"{extra_us:+.1f}",
                f"{'yes' if all(same) else 'NO'} ({sum(same)}/{len(same)})",
            ]
        )
    w = WORKLOADS[workload]
    title = (
        f"{workload}: {w['nproc']} rank(s) x 1 thread, batch {BATCH}/rank, {result['steps']} timed steps after "
        f"{result['warmup']} warm-up, {len(hand['wall'])} rounds"
    )
    headers = [
        "variant",
        "ms/step",
        "min..max",
        "x hand",
        "x hand min..max",
        "x hand (best rounds)",
        "CPU us/step vs hand",
        "bitwise = hand",
    ]
    return table(title, headers, rows)


def run_single(variant: str, steps: int, log_every: int, workload: str = "step-cost") -> None:
    """One variant of one workload in this process, nothing else: for instruction counts (``step-cost``, a
    world of one) or a sampling profiler (``torchrun --nproc-per-node 2 ... --single ddpkit 5000 50 mlp``)."""
    import tempfile

    from ddpkit.distributed.env import read_dist_env
    from ddpkit.distributed.process_group import process_group

    extra = {"log_every": log_every} if variant.startswith("ddpkit") else {}
    env = read_dist_env()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")  # every rank's Trainer must see the same output_dir
    with tempfile.TemporaryDirectory(prefix=f"bench-single-{run_id}-rank{env.rank}-") as tmp, process_group(env):
        if variant.startswith("ddpkit"):
            shared = Path(tempfile.gettempdir()) / f"bench-single-{run_id}"
            extra["workdir"] = shared if env.world_size > 1 else Path(tmp)
        VARIANTS[variant](WORKLOADS[workload], steps, env.rank, env.world_size, **extra)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return serve(argv[1], {"overhead": overhead_worker})
    if argv[:1] == ["--single"]:  # --single VARIANT STEPS [LOG_EVERY [WORKLOAD]]
        run_single(argv[1], int(argv[2]), int(argv[3]) if len(argv) > 3 else 50, *argv[4:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads", default="step-cost,mlp,mnist_cnn,resnet18", help=f"comma list of {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--rounds", type=int, default=7, help="alternated rounds per workload (default 7)")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per run (default: per workload, 1000/300/100/12)"
    )
    parser.add_argument("--no-timeline", action="store_true", help="skip the ddpkit+timeline variant")
    parser.add_argument(
        "--variants", default=None, help=f"comma list instead of the defaults, from {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--fresh", action="store_true", help="each variant of each round in new processes (slower, no shared heap)"
    )
    parser.add_argument("--json", default=None, help="also write all measurements here")
    args = parser.parse_args(argv)
    variants = ["hand-written", "ddpkit"] + ([] if args.no_timeline else ["ddpkit+timeline"]) + list(FRAMEWORKS)
    if args.variants:
        variants = ["hand-written", *[v for v in args.variants.split(",") if v != "hand-written"]]
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            parser.error(f"--variants: unknown {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    for name, module in FRAMEWORKS.items():
        if name in variants and importlib.util.find_spec(module) is None:
            variants.remove(name)
            print(f"skipped {name}: the {module!r} package is not importable here")
    results = {}
    for workload in args.workloads.split(","):
        if workload not in WORKLOADS:
            parser.error(f"--workloads: unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
        params = {"workload": workload, "variants": variants, "rounds": args.rounds, "steps": args.steps}
        progress(f"[overhead] {workload}: {', '.join(variants)} x {args.rounds} rounds ...")
        if args.fresh:
            results[workload] = run_fresh(workload, variants, args.rounds, args.steps)
        else:
            nproc = WORKLOADS[workload]["nproc"]
            results[workload] = run_module_workers(__spec__.name, "overhead", params, nproc=nproc)
        mark_bitwise(results[workload])
        print(report(workload, results[workload]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
