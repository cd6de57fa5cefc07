"""How long a checkpoint save stalls the training loop: synchronous vs ``checkpoint.async: true``.

    python -m benchmarks.checkpoint                         # wide MLP, ~80 MB checkpoints, 5 rounds
    python -m benchmarks.checkpoint --hidden 1024,1024 --rounds 3 --every 5 --steps 20

One job of 2 Gloo ranks (one thread each) started through torch's launcher runs the Trainer
three ways in alternating rounds (the order rotates each round), same model, data and seed:
without checkpoints, with synchronous saves every ``--every`` steps, and with asynchronous saves
(``checkpoint.async: true``). Two measures per save, medians over all saves and rounds:

* **stall**: the ``checkpoint`` span of the Trainer's timeline (``train.timeline: true``) on rank 0:
  the time the step loop is held up by a save. Synchronous: gathering RNG states, serializing,
  hashing, writing and fsyncing the file, and the barrier. Asynchronous: the copy of the state to
  CPU memory (and waiting for the previous write, if it is still in flight); the file is written
  by a background thread.
* **cost**: (loop time of the run with saves - loop time of the run without, same round) / saves.
  Unlike the stall, it includes a background write slowing down the steps that overlap it (on a
  2-core machine the writer thread competes with training for the CPU).

The checkpoint holds the model and the SGD momentum buffers (``--hidden`` sets the MLP's widths;
the default, 784-2048-4096-10, gives about 80 MB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks.workloads import load_printed, rotated, run_module_workers
from ddpkit.bench.report import Stats, format_table, progress
from ddpkit.bench.timed import TimedTrainer, steady_ms_per_step
from ddpkit.bench.worker import serve
from ddpkit.distributed.collectives import barrier
from ddpkit.distributed.process_group import Runtime

VARIANTS = {"none": None, "sync": False, "async": True}  # name -> checkpoint.async (None: no saves)
BATCH, WARMUP = 32, 2


def run_variant(name: str, params: dict[str, Any], runtime: Runtime, out: Path) -> dict[str, Any]:
    every, steps = params["every"], params["steps"]
    trainer = TimedTrainer(
        {
            "run": {"name": "ckpt-bench", "output_dir": str(out), "seed": 0},
            "data": {
                "name": "synthetic",
                "batch_size": BATCH,
                "kwargs": {"size": steps * BATCH * runtime.env.world_size, "shape": [1, 28, 28]},
            },
            "model": {"name": "mlp", "kwargs": {"hidden": params["hidden"]}},
            "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
            "train": {"epochs": 1, "max_steps": steps, "timeline": True},
            "checkpoint": {
                "every_steps": every if VARIANTS[name] is not None else None,
                "every_epochs": None,
                "resume": "none",
                "async": bool(VARIANTS[name]),
                "keep_last": 2,
            },
            "log": {"progress_bar": False},
        }
    )
    trainer.fit()
    result = {
        "loop_s": trainer.clock.wall[-1] - trainer.clock.wall[WARMUP],
        "ms_per_step": steady_ms_per_step(trainer.clock.wall, warmup=WARMUP),
    }
    if runtime.env.rank == 0:
        events = json.loads((out / "timeline.json").read_text())["traceEvents"]
        # Saves whose stall falls inside the timed window: after the warm-up, before the last step.
        spans = [e["dur"] / 1000 for e in events if e.get("tid") == 0 and e["name"] == "checkpoint"]
        before = len(range(every, WARMUP, every))  # saves during the warm-up, if any
        result["stalls_ms"] = spans[before : before + params["saves"]]
        files = list((out / "checkpoints").glob("step-*.pt"))
        result["checkpoint_mb"] = max((f.stat().st_size for f in files), default=0) / 2**20
    barrier()
    if runtime.env.rank == 0:
        shutil.rmtree(out, ignore_errors=True)  # ~90 MB per save: do not let the rounds pile up
    return result


def checkpoint_worker(params: dict[str, Any], *, runtime: Runtime, workdir: Path) -> dict[str, Any]:
    names, rounds = list(VARIANTS), params["rounds"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            runs[name].append(run_variant(name, params, runtime, workdir / f"r{r}-{name}"))
            if runtime.env.rank == 0:
                last = runs[name][-1]
                stalls = ", ".join(f"{s:.0f}" for s in last.get("stalls_ms", []))
                progress(
                    f"[checkpoint] round {r + 1}/{rounds} {name}: "
                    f"{last['ms_per_step']:.1f} ms/step, stalls [{stalls}] ms"
                )
    return {"runs": runs}


def report(result: dict[str, Any], params: dict[str, Any]) -> str:
    runs, saves = result["runs"], params["saves"]
    base = [run["loop_s"] for run in runs["none"]]
    rows, stall_medians = [], {}
    for name in ("sync", "async"):
        stall = Stats.of([s for run in runs[name] for s in run["stalls_ms"]])
        cost = Stats.of([(run["loop_s"] - b) * 1000 / saves for run, b in zip(runs[name], base)])
        stall_medians[name] = stall.median
        steps = Stats.of([run["ms_per_step"] for run in runs[name]])
        rows.append(
            [name, f"{stall.median:.1f}", stall.spread(1), f"{cost.median:.1f}", cost.spread(1), f"{steps.median:.1f}"]
        )
    none_steps = Stats.of([run["ms_per_step"] for run in runs["none"]])
    rows.append(["none", "-", "-", "-", "-", f"{none_steps.median:.1f}"])
    size = max(run.get("checkpoint_mb", 0) for run in runs["sync"])
    return (
        f"checkpoint stall: MLP 784-{'-'.join(map(str, params['hidden']))}-10, "
        f"{size:.0f} MB per checkpoint, 2 ranks x 1 thread, "
        f"batch {BATCH}/rank, save every {params['every']} steps, {saves} saves per run, {params['rounds']} rounds\n"
        + format_table(
            ["saves", "stall ms/save", "min..max", "cost ms/save (vs none)", "min..max", "ms/step (mean)"], rows
        )
        + f"\nasync stall / sync stall = {stall_medians['async'] / stall_medians['sync']:.3f} "
        f"({stall_medians['sync'] / stall_medians['async']:.1f}x shorter)"
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        return serve(argv[1], {"checkpoint": checkpoint_worker})
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hidden", default="2048,4096", help="MLP hidden widths (default 2048,4096: ~80 MB checkpoints)"
    )
    parser.add_argument("--every", type=int, default=8, help="save every this many steps (default 8)")
    parser.add_argument("--steps", type=int, default=34, help="steps per run (default 34)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    parser.add_argument("--json", default=None, help="also write all measurements here")
    args = parser.parse_args(argv)
    # A save after step s stalls the gap s -> s+1: inside the timed window for WARMUP <= s < steps.
    saves = len([s for s in range(WARMUP, args.steps) if s % args.every == 0])
    if saves < 1:
        parser.error(f"--steps {args.steps} with --every {args.every} leaves no save inside the timed window")
    params = {
        "hidden": [int(h) for h in args.hidden.split(",")],
        "every": args.every,
        "steps": args.steps,
        "rounds": args.rounds,
        "saves": saves,
    }
    with load_printed():
        result = run_module_workers(__spec__.name, "checkpoint", params, nproc=2)
        print(report(result, params), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"params": params, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
