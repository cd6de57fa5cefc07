"""Per-step cost of each training-health check (ddpkit.training.health), on vs off, side by side.

    python scripts/bench_health.py                    # MLP 784-128-128-10, 2 Gloo ranks x 1 thread, 7 rounds
    python scripts/bench_health.py --rounds 3 --steps 200
    python scripts/bench_health.py --variants off,nonfinite,spike

Every variant is the real ``ddpkit.Trainer`` on the MLP workload of scripts/bench_overhead.py (same
data, model, optimizer, per-rank batch 64), in one process group, in alternating rounds (the order
rotates each round):

* ``off``: no per-step health work at all (the Trainer detaches health from its OptimizerStep, and
  ``straggler`` / ``check_replicas_every`` are null): the loop as it was before the checks;
* ``nonfinite``: the always-on part: the loss check (on the CPU a read of the loss; elsewhere the
  guard ``loss * (loss * 0 + 1)``), the gradient norm (computed once, from DDP's flat buckets) and
  its host read each step, grad_norm in the records;
* ``+straggler``: plus the straggler watch (phase listener, gradient hooks, one all_reduce every 50 steps);
* ``+replicas``: plus the replica fingerprint every 500 steps (one all_reduce);
* ``defaults``: nonfinite + straggler + replicas, as a run gets them by default;
* ``spike``: the defaults plus ``spike`` (warn): one all_reduce of the loss every step.

Columns: wall ms/step (median over rounds, range), the paired ratio to ``off`` (same round), and
the extra CPU microseconds per step of the training thread vs ``off`` (``time.thread_time``: blind
to time spent descheduled, so it holds on a loaded machine where wall time does not). The load
average is printed before and after: on a shared machine, say what it was.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import BATCH, LR, MOMENTUM, SEED, WORKLOADS  # noqa: E402  the same MLP workload

from ddpkit.bench.launching import run_workers  # noqa: E402
from ddpkit.bench.report import Stats, format_table, progress  # noqa: E402
from ddpkit.bench.timed import TimedTrainer, steady_ms_per_step  # noqa: E402
from ddpkit.bench.worker import serve  # noqa: E402
from ddpkit.distributed.process_group import Runtime  # noqa: E402

NONE = {"straggler": None, "check_replicas_every": None}
VARIANTS: dict[str, dict[str, Any]] = {
    "off": NONE,
    "nonfinite": NONE,
    "+straggler": {"check_replicas_every": None},
    "+replicas": {"straggler": None},  # the default interval (500)
    "defaults": {},
    "spike": {"spike": {"action": "warn"}},
}


class _NoStepHealth(TimedTrainer):
    """The ``off`` variant: the OptimizerStep runs without health (no loss guard, no norm, no host read)."""

    def on_fit_start(self) -> None:
        self._step.health = None
        super().on_fit_start()


def _run(name: str, w: dict[str, Any], steps: int, world_size: int, workdir: Path) -> Any:
    cls = _NoStepHealth if name == "off" else TimedTrainer
    trainer = cls({
        "run": {"name": "health", "output_dir": str(workdir), "seed": SEED},
        "data": {"name": "synthetic", "batch_size": BATCH, "kwargs": {"size": steps * BATCH * world_size, "shape": w["shape"], "num_classes": 10}},
        "model": {"name": w["model"], "kwargs": w["kwargs"]},
        "optim": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        "train": {"epochs": 1, "max_steps": steps},
        "checkpoint": {"every_epochs": None, "resume": "none"},
        "health": VARIANTS[name],
    })
    with contextlib.redirect_stderr(io.StringIO()):
        trainer.fit()
    return trainer.clock


def health_worker(params: dict[str, Any], *, runtime: Runtime, workdir: Path) -> dict[str, Any]:
    w, variants, rounds = WORKLOADS["mlp"], params["variants"], params["rounds"]
    steps = params["steps"]
    warmup = min(w["warmup"], steps // 3)
    runs: dict[str, dict[str, list[float]]] = {v: {"wall": [], "cpu": []} for v in variants}
    for r in range(rounds):
        for name in variants[r % len(variants):] + variants[:r % len(variants)]:
            clock = _run(name, w, warmup + steps, runtime.env.world_size, workdir / f"r{r}-{name}")
            runs[name]["wall"].append(steady_ms_per_step(clock.wall, warmup=warmup))
            runs[name]["cpu"].append(steady_ms_per_step(clock.cpu, warmup=warmup))
            if runtime.env.rank == 0:
                progress(f"[health] round {r + 1}/{rounds} {name}: {runs[name]['wall'][-1]:.3f} ms/step, {runs[name]['cpu'][-1]:.3f} CPU ms/step")
    return {"runs": runs, "steps": steps, "warmup": warmup}


def report(result: dict[str, Any]) -> str:
    runs, base = result["runs"], result["runs"]["off"]
    rows = []
    for name, run in runs.items():
        wall = Stats.of(run["wall"])
        ratio = Stats.of([v / b for v, b in zip(run["wall"], base["wall"])])
        extra_cpu = Stats.of([(v - b) * 1000 for v, b in zip(run["cpu"], base["cpu"])])
        share = extra_cpu.median / 1000 / Stats.of(base["cpu"]).median
        rows.append([name, f"{wall.median:.3f}", wall.spread(3), f"{ratio.median:.3f}", ratio.spread(3), f"{extra_cpu.median:+.1f}", f"{share:+.2%}"])
    title = f"MLP 784-128-128-10, 2 ranks x 1 thread, batch {BATCH}/rank, {result['steps']} timed steps after {result['warmup']}, {len(base['wall'])} rounds"
    headers = ["variant", "ms/step", "min..max", "x off", "x off min..max", "CPU us/step vs off", "CPU share of the off step"]
    return title + "\n" + format_table(headers, rows)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return serve(argv[1], {"health": health_worker})
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run (default 300)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {', '.join(VARIANTS)} (off is always run)")
    args = parser.parse_args(argv)
    variants = ["off", *[v for v in args.variants.split(",") if v != "off"]]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    print("load average before:", Path("/proc/loadavg").read_text().strip(), flush=True)
    params = {"variants": variants, "rounds": args.rounds, "steps": args.steps}
    result = run_workers("health", params, nproc=2, threads=1, entry=[str(Path(__file__).resolve()), "--worker"])
    print(report(result), flush=True)
    print("load average after:", Path("/proc/loadavg").read_text().strip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
