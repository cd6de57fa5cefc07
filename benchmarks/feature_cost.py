"""What ddpkit's per-step features cost the training loop, each measured on or off side by side.

    python -m benchmarks.feature_cost --feature health                  # the Trainer's health checks, 2 ranks, 7 rounds
    python -m benchmarks.feature_cost --feature health --rounds 3 --steps 200 --variants off,nonfinite,spike
    python -m benchmarks.feature_cost --feature watchdog                # the hang watchdog on 4 empty spans a step
    python -m benchmarks.feature_cost --feature goodput --rounds 5      # the ledger's and crash save's listeners
    python -m benchmarks.feature_cost --feature step-parts              # each piece of the step's work, thread CPU

Every feature alternates its variants over ``--rounds`` rounds (the order rotating) and reports
medians with the range over rounds and the paired difference or ratio to the feature-free run, with
the load average before and after (absolute times on a shared machine are noise; differences and
ratios of things measured side by side hold).

``health`` (default 7 rounds of 300 steps): the real ``ddpkit.Trainer`` on the MLP workload of
``benchmarks.workloads`` (784-128-128-10, per-rank batch 64), one job of 2 Gloo ranks x 1 thread:

* ``off``: no per-step health work at all (the Trainer detaches health from its OptimizerStep, and
  ``straggler`` / ``check_replicas_every`` are null): the loop as it was before the checks;
* ``nonfinite``: the always-on part: the loss check (on the CPU a read of the loss; elsewhere the
  guard ``loss * (loss * 0 + 1)``), the gradient norm (computed once, from DDP's flat buckets) and
  its host read each step, grad_norm in the records;
* ``+straggler``: plus the straggler watch (phase listener, gradient hooks, one all_reduce every 50 steps);
* ``+replicas``: plus the replica fingerprint every 500 steps (one all_reduce);
* ``defaults``: nonfinite + straggler + replicas, as a run gets them by default;
* ``spike``: the defaults plus ``spike`` (warn): one all_reduce of the loss every step.

Columns: wall ms/step (median over rounds, range), the paired ratio to ``off`` (same round), and the
extra CPU microseconds per step of the training thread vs ``off`` (``time.thread_time``: blind to time
spent descheduled, so it holds on a loaded machine where wall time does not).

``watchdog`` (default 7 rounds of 20000 steps): one step of the Trainer's loop announces four phases
through ``Reporter.span`` (data, forward, backward, optimizer); this runs that skeleton (four spans
around no work) in one process: ``off``, no phase listener, as with ``dist.hang_timeout: null``
(``Reporter.span`` returns the timeline's shared no-op context); ``on``, the watchdog's ``on_phase``
listening and its daemon thread running (a heartbeat to an in-process ``HashStore`` twice a second,
the main thread's stack sampled, the absent other rank's heartbeat read). The difference in
microseconds per step is the watchdog's whole per-step price on the training thread.

``goodput`` (default 2 rounds of 200 steps): in one process, the MLP optimizer step of the chaos run
(``benchmarks.goodput``) bare and with the span listeners the Trainer calls (the goodput ledger's and
the crash save's: 8 span events per step, two RNG copies each also written to the rank's
shared-memory slot file); the crash save's listener alone with and without its slot file; and one
memory snapshot's blocking part (state_dict of model and optimizer copied to new CPU tensors), which
sets ``checkpoint.memory_every_steps``.

``step-parts`` (default 7 rounds of 300 steps): one process, one thread, the MLP (batch 64, SGD with
momentum): the plain step and the same step with one piece of ddpkit's per-step work added, each
exactly as the Trainer runs it: the NaN guard ``loss * (loss.detach() * 0 + 1)``; the NaN check
with a host read (``watch_loss`` on the CPU); ``gradient_norm`` and its host read; a
post-accumulate-grad hook per parameter (the straggler watch); the crash save's two
``torch.get_rng_state()`` copies and slot writes; and the four ``reporter.span()`` contexts with
stand-ins for the five default phase listeners. The cost of a piece is the paired median, over
rounds, of (variant - plain) in thread-CPU microseconds per step.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.workloads import (
    BATCH,
    WORKLOADS,
    load_printed,
    paired,
    rotated,
    run_module_workers,
    table,
    trainer_config,
)
from ddpkit.bench.report import Stats, progress
from ddpkit.bench.timed import TimedTrainer, steady_ms_per_step
from ddpkit.bench.worker import serve
from ddpkit.checkpoint.boundary_rng import BoundarySlots
from ddpkit.checkpoint.crash_save import CrashSave
from ddpkit.checkpoint.staging import to_cpu
from ddpkit.config.loader import load_config
from ddpkit.distributed.env import DistEnv
from ddpkit.distributed.gradient_norm import gradient_norm
from ddpkit.distributed.process_group import Runtime
from ddpkit.goodput.ledger import GoodputLedger
from ddpkit.progress import Progress
from ddpkit.registry import MODELS
from ddpkit.reporting.events import Events, PhaseSpan
from ddpkit.reporting.reporter import Reporter
from ddpkit.watchdog.heartbeat import Watchdog

# --- health: the real Trainer, 2 ranks, each check on vs off -------------------------------------------

NO_HEALTH = {"straggler": None, "check_replicas_every": None}
HEALTH: dict[str, dict[str, Any]] = {
    "off": NO_HEALTH,
    "nonfinite": NO_HEALTH,
    "+straggler": {"check_replicas_every": None},
    "+replicas": {"straggler": None},  # the default interval (500)
    "defaults": {},
    "spike": {"spike": {"action": "warn"}},
}


class _NoStepHealth(TimedTrainer):
    """The ``off`` variant: the OptimizerStep runs without health (no loss guard, no norm, no host read)."""

    def on_fit_start(self) -> None:
        self._parts.update.health = None
        super().on_fit_start()


def _health_run(name: str, w: dict[str, Any], steps: int, world_size: int, workdir: Path) -> Any:
    cls = _NoStepHealth if name == "off" else TimedTrainer
    trainer = cls(trainer_config(w, steps, world_size, workdir, name="health", health=HEALTH[name]))
    with contextlib.redirect_stderr(io.StringIO()):
        trainer.fit()
    return trainer.clock


def health_worker(params: dict[str, Any], *, runtime: Runtime, workdir: Path) -> dict[str, Any]:
    w, variants, rounds, steps = WORKLOADS["mlp"], params["variants"], params["rounds"], params["steps"]
    warmup = min(w["warmup"], steps // 3)
    runs: dict[str, dict[str, list[float]]] = {v: {"wall": [], "cpu": []} for v in variants}
    for r in range(rounds):
        for name in rotated(variants, r):
            clock = _health_run(name, w, warmup + steps, runtime.env.world_size, workdir / f"r{r}-{name}")
            runs[name]["wall"].append(steady_ms_per_step(clock.wall, warmup=warmup))
            runs[name]["cpu"].append(steady_ms_per_step(clock.cpu, warmup=warmup))
            if runtime.env.rank == 0:
                progress(
                    f"[health] round {r + 1}/{rounds} {name}: {runs[name]['wall'][-1]:.3f} "
                    f"ms/step, {runs[name]['cpu'][-1]:.3f} CPU ms/step"
                )
    return {"runs": runs, "steps": steps, "warmup": warmup}


def health(args: argparse.Namespace) -> str:
    variants = ["off", *[v for v in (args.variants or ",".join(HEALTH)).split(",") if v != "off"]]
    unknown = [v for v in variants if v not in HEALTH]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown[0]!r}; choose from {', '.join(HEALTH)}")
    result = run_module_workers(
        __spec__.name, "health", {"variants": variants, "rounds": args.rounds, "steps": args.steps}, nproc=2
    )
    runs, base = result["runs"], result["runs"]["off"]
    rows = []
    for name, run in runs.items():
        wall, ratio = Stats.of(run["wall"]), paired(run["wall"], base["wall"])
        extra_cpu = paired(run["cpu"], base["cpu"], scale=1000, difference=True)
        share = extra_cpu.median / 1000 / Stats.of(base["cpu"]).median
        rows.append(
            [
                name,
                f"{wall.median:.3f}",
                wall.spread(3),
                f"{ratio.median:.3f}",
                ratio.spread(3),
                f"{extra_cpu.median:+.1f}",
                f"{share:+.2%}",
            ]
        )
    title = (
        f"MLP 784-128-128-10, 2 ranks x 1 thread, batch {BATCH}/rank, {result['steps']} timed steps after "
        f"{result['warmup']}, {len(base['wall'])} rounds"
    )
    headers = [
        "variant",
        "ms/step",
        "min..max",
        "x off",
        "x off min..max",
        "CPU us/step vs off",
        "CPU share of the off step",
    ]
    return table(title, headers, rows)


# --- watchdog: four empty spans a step, with and without the watchdog listening ----------------------

PHASES = ("data", "forward", "backward", "optimizer")


def _skeleton(reporter: Reporter, steps: int) -> float:
    """Seconds per step of ``steps`` steps that do nothing but announce their phases."""
    span = reporter.span
    start = time.perf_counter()
    for _ in range(steps):
        for phase in PHASES:
            with span(phase):
                pass
    return (time.perf_counter() - start) / steps


def watchdog(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config({"run": {"output_dir": tmp}, "log": {"progress_bar": False}})
        runtime = Runtime(
            env=DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2),
            device=torch.device("cpu"),
            backend="gloo",
        )
        listening = Events()
        plain = Reporter(cfg, runtime=runtime, total_steps=1, progress=Progress(), events=Events())
        watched = Reporter(cfg, runtime=runtime, total_steps=1, progress=Progress(), events=listening)
        # A limit no round reaches: the absent rank 1 must not end the benchmark as a "hang".
        dog = Watchdog(
            dist.HashStore(),
            rank=0,
            world_size=2,
            hang_timeout=1e6,
            slow_timeout=1e6,
            log_dir=Path(tmp),
            progress=Progress(),
        )
        listening.add(dog)
        times: dict[str, list[float]] = {"off": [], "on": []}
        with dog:
            for r in range(args.rounds):
                for name in rotated(["off", "on"], r):
                    times[name].append(_skeleton(plain if name == "off" else watched, args.steps) * 1e6)
        for reporter in (plain, watched):
            reporter.on_exit("FINISHED")
    rows = []
    for name, us in times.items():
        s, extra = Stats.of(us), paired(us, times["off"], difference=True)
        rows.append([f"watchdog {name}", f"{s.median:.2f}", s.spread(2), f"{extra.median:+.2f}", extra.spread(2)])
    title = f"{args.rounds} rounds x {args.steps} steps of {len(PHASES)} spans each, no work, one process"
    return table(title, ["variant", "us/step (median)", "min..max", "cost us/step vs off (paired)", "min..max"], rows)


# --- goodput: the ledger's and the crash save's span listeners, and one memory snapshot -----------------

SPANS = ("data", None, "forward", None, "backward", None, "optimizer", None)


def _listeners(progress: Progress) -> list:
    ledger = GoodputLedger(None, progress=progress)
    crash = CrashSave.__new__(CrashSave)
    crash.state, crash.boundary, crash._clean = SimpleNamespace(progress=progress), None, True
    crash._updating, crash._updated_rng = False, None
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    crash._slots = BoundarySlots.create(shm / f"bench-goodput-{os.getpid()}.rng", torch.get_rng_state().numel())
    os.unlink(crash._slots.path)  # the mapping stays; nothing is left behind
    return [ledger.on_phase, crash.on_phase]


def _listened_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    n: int,
    listeners: list,
    progress: Progress,
) -> float:
    began = time.perf_counter()
    for _ in range(n):
        for span in SPANS[:6]:
            for listen in listeners:
                listen(span)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for span in SPANS[6:]:
            for listen in listeners:
                listen(span)
        opt.step()
        opt.zero_grad()
        progress.step += 1
    return (time.perf_counter() - began) / n


def _spans_only(listen: Any, progress: Progress, n: int) -> float:
    began = time.perf_counter()
    for _ in range(n):
        for span in SPANS:
            listen(span)
        progress.step += 1
    return (time.perf_counter() - began) / n


def goodput(args: argparse.Namespace) -> str:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(144, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(32, 144), torch.randint(0, 10, (32,))
    progress = Progress()
    runs: dict[str, list[float]] = {"bare step": [], "step with the listeners": [], "snapshot": []}
    _listened_steps(model, opt, x, y, 50, [], progress)  # warm-up
    for r in range(args.rounds):
        for name in rotated(["bare step", "step with the listeners"], r):
            listeners = _listeners(progress) if name != "bare step" else []
            runs[name].append(_listened_steps(model, opt, x, y, args.steps, listeners, progress) * 1e6)
        began = time.perf_counter()
        to_cpu({"model": model.state_dict(), "optimizer": opt.state_dict()})
        runs["snapshot"].append((time.perf_counter() - began) * 1e6)
    # the crash save's listener alone, 20000 spans a round
    with_file, without = _listeners(progress)[1], _listeners(progress)[1]
    without.__self__._slots = None
    runs |= {"crash-save listener, no slot file": [], "crash-save listener, slot file": []}
    for r in range(args.rounds):
        for name in rotated(["crash-save listener, no slot file", "crash-save listener, slot file"], r):
            listeners = with_file if name.endswith(", slot file") else without
            runs[name].append(_spans_only(listeners, progress, 20000) * 1e6)
    bare = runs["bare step"]
    rows = []
    for name, us in runs.items():
        s = Stats.of(us)
        ratio = f"{paired(us, bare).median:.4f}" if name.endswith("step") or name.startswith("step") else "-"
        steps = f"{s.median / statistics.median(bare):.2f}" if name == "snapshot" else "-"
        rows.append([name, f"{s.median:.2f}", s.spread(2), ratio, steps])
    title = (
        f"MLP 144-64-10 step, batch 32, 1 thread, {args.rounds} rounds x {args.steps} steps (listener rows: 8 "
        "spans a step, no training); a snapshot every K steps costs (snapshot in steps)/K of a step"
    )
    return table(title, ["measure", "us (median)", "min..max", "x bare step (paired)", "snapshot in steps"], rows)


# --- step-parts: each piece of the Trainer's per-step work on the MLP's step, thread CPU -----------------


class Listeners:
    """Stand-ins for the five default phase listeners, doing on each span what the real ones do."""

    def __init__(self) -> None:
        self.phases, self.ticks, self.span = ["loop"], 0, []
        self.pending, self.updating, self.grad_ready = False, False, 0.0
        self.started, self.phase, self.own = 0.0, None, 0.0

    def watchdog(self, name: str | None) -> None:
        if name is None:
            if len(self.phases) > 1:
                self.phases.pop()
        else:
            self.phases.append(name)
        self.ticks += 1

    def ledger(self, name: str | None) -> None:
        if name is not None:
            self.span.append(name)
            return
        if (self.span.pop() if self.span else None) == "optimizer":
            self.last = time.time()

    def crash(self, name: str | None) -> None:
        if name == "optimizer":
            self.updating = True
        elif name is None and self.updating:
            self.updating = False

    def snapshots(self, name: str | None) -> None:
        if name == "optimizer":
            self.pending = True
        elif name == "data" and self.pending:
            self.pending = False

    def straggler(self, name: str | None) -> None:
        now = time.perf_counter()
        if name is not None:
            self.phase, self.started = name, now
            return
        if self.phase in ("data", "forward", "backward"):
            self.own += now - self.started
        self.phase = None


def step_parts_variants(model: torch.nn.Module, rng_file: Path) -> dict[str, Any]:
    """name -> (setup, teardown, step(x, y, optimizer)); every step does the plain work plus its piece."""
    params = list(model.parameters())
    slots = BoundarySlots.create(rng_file, torch.get_rng_state().numel())
    listeners = Listeners()
    subscribed = [  # each listener and the spans it asks for, as the Trainer registers them
        (listeners.watchdog, None),
        (listeners.ledger, ("optimizer",)),
        (listeners.crash, ("optimizer", "data")),
        (listeners.snapshots, ("optimizer", "data")),
        (listeners.straggler, ("data", "forward", "backward")),
    ]
    spans = {
        name: PhaseSpan(name, tuple(f for f, names in subscribed if names is None or name in names)) for name in PHASES
    }
    hooks: list[Any] = []
    step_no = [0]

    def plain(x, y, opt, *, guard=False, read=False, norm=False):
        loss = F.cross_entropy(model(x), y)
        if guard:
            detached = loss.detach()
            loss = loss * (detached * 0 + 1)
        if read and not math.isfinite(loss.detach().item()):
            loss = loss * math.nan
        loss.backward()
        if norm:
            float(gradient_norm(params))
        opt.step()
        opt.zero_grad(set_to_none=True)

    def rng(x, y, opt):
        step_no[0] += 1
        slots.write(step_no[0], torch.get_rng_state())
        plain(x, y, opt)
        slots.write(step_no[0], torch.get_rng_state(), final=False)

    def with_spans(x, y, opt):
        with spans["data"]:
            pass
        with spans["forward"]:
            loss = F.cross_entropy(model(x), y)
        with spans["backward"]:
            loss.backward()
        with spans["optimizer"]:
            opt.step()
            opt.zero_grad(set_to_none=True)

    def add_hooks():
        def stamp(_p):
            listeners.grad_ready = time.perf_counter()

        hooks.extend(p.register_post_accumulate_grad_hook(stamp) for p in params)

    def remove_hooks():
        for h in hooks:
            h.remove()
        hooks.clear()

    return {
        "plain": (None, None, plain),
        "nan guard": (None, None, lambda x, y, o: plain(x, y, o, guard=True)),
        "nan check (host read)": (None, None, lambda x, y, o: plain(x, y, o, read=True)),
        "grad norm": (None, None, lambda x, y, o: plain(x, y, o, norm=True)),
        "straggler hooks": (add_hooks, remove_hooks, plain),
        "rng boundary": (None, None, rng),
        "spans (5 listeners)": (None, None, with_spans),
    }


def _thread_us_per_step(
    step: Any, model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], steps: int
) -> float:
    """Thread-CPU microseconds per step over ``steps`` steps (after 20 warm-up steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for x, y in data[:20]:
        step(x, y, opt)
    started = time.thread_time()
    for i in range(steps):
        x, y = data[i % len(data)]
        step(x, y, opt)
    return (time.thread_time() - started) / steps * 1e6


def step_parts(args: argparse.Namespace) -> str:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MODELS.build("mlp", key="model.name", kwargs={"hidden": [128, 128]})
    data = [(torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))) for _ in range(50)]
    with tempfile.TemporaryDirectory() as tmp:
        variants = step_parts_variants(model, Path(tmp) / "rng")
        per: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in rotated(list(variants), r):
                setup, teardown, step = variants[name]
                if setup:
                    setup()
                per[name].append(_thread_us_per_step(step, model, data, args.steps))
                if teardown:
                    teardown()
    plain, rows = per["plain"], []
    for name, us in per.items():
        extra = paired(us, plain, difference=True)
        spread = extra.spread(1) if name != "plain" else "-"
        rows.append(
            [
                name,
                f"{statistics.median(us):.1f}",
                f"{extra.median:+.1f}",
                spread,
                f"{100 * extra.median / statistics.median(plain):+.2f}%",
            ]
        )
    title = (
        f"MLP 784-128-128-10, batch {BATCH}, 1 thread, {args.rounds} rounds x {args.steps} steps; thread-CPU us/step"
    )
    return table(
        title,
        ["piece", "us/step (median)", "extra us/step vs plain (paired median)", "min..max", "% of the plain step"],
        rows,
    )


# --- the driver ----------------------------------------------------------------------------------------

#: feature -> (measure, default rounds, default steps)
FEATURES = {
    "health": (health, 7, 300),
    "watchdog": (watchdog, 7, 20000),
    "goodput": (goodput, 2, 200),
    "step-parts": (step_parts, 7, 300),
}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return serve(argv[1], {"health": health_worker})
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--feature", required=True, choices=list(FEATURES))
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="alternated rounds (default: health 7, watchdog 7, goodput 2, step-parts 7)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per run (default: health 300, watchdog 20000, goodput 200, step-parts 300)",
    )
    parser.add_argument(
        "--variants", default=None, help=f"health only: comma list from {', '.join(HEALTH)} (off is always run)"
    )
    args = parser.parse_args(argv)
    measure, rounds, steps = FEATURES[args.feature]
    args.rounds, args.steps = args.rounds or rounds, args.steps or steps
    with load_printed():
        print(measure(args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
