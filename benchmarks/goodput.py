"""Goodput under faults through ``ddpkit run``, and what each kind of fault costs, on a script importing scikit-learn.

    .venv/bin/python -m benchmarks.goodput --rounds 3 --faults 6 --epochs 25      # the issue-47 figures (~20 s a run)
    .venv/bin/python -m benchmarks.goodput --rounds 1 --faults 3 --epochs 3 --variants warm   # a smoke run (~15 s)

Each run is a 2-rank ``ddpkit run --max-restarts`` of ``tests/scripts/sklearn_trainer.py`` (scikit-learn imported
at its top, its data made by ``make_classification``), with ``--faults`` faults injected from outside, in turn:
SIGKILL of one worker, SIGTERM of one worker (the agreed stop and save), SIGKILL of every worker, each 1 to
``--max-delay`` s after an attempt's first step. Variants, alternated round by round:

- ``warm``: the defaults: workers forked from the launcher, which imported the script's libraries too;
- ``no preload``: forked, ``DDPKIT_PRELOAD=off`` (torch and ddpkit preloaded, scikit-learn imported per worker);
- ``new interpreters``: ``--worker-start subprocess``, what ``torchrun`` does;
- ``warm, snapshot every step`` (not run unless named): ``warm`` with ``checkpoint.memory_every_steps: 1``, what a
  SIGKILL of every worker needs to re-train no step, and what a snapshot per step costs.

Printed per variant: the median goodput (``ddpkit goodput``) and the ledger's wall against the measured one;
per fault kind the median, over every fault of that kind, of ``kill->step`` (from the signal, sent here, to the
next attempt's first trained step), of each part of ``ddpkit goodput``'s split (:mod:`ddpkit.goodput.faults`) and
of the steps trained twice (from the per-rank step logs). One JSON line per run goes to stdout as it ends, and
``--json PATH`` keeps every run. The load average is printed before and after: on a shared machine the absolute
times are noise, so quote them with it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.workloads import REPO, load_average

SCRIPT = "tests/scripts/sklearn_trainer.py"
#: variant: (worker start, DDPKIT_PRELOAD, checkpoint.memory_every_steps)
VARIANTS = {
    "warm": ("fork", "auto", "auto"),
    "no preload": ("fork", "off", "auto"),
    "new interpreters": ("subprocess", "auto", "auto"),
    "warm, snapshot every step": ("fork", "auto", 1),
}
DEFAULT_VARIANTS = ["warm", "no preload", "new interpreters"]
KINDS = ["kill-one", "term-one", "kill-all"]
PARTS = ("detection", "teardown", "restart", "startup", "load", "first step")


def config(out: Path, epochs: int, memory_every_steps: int | str = "auto") -> Path:
    cfg = {
        "run": {"name": "chaos", "output_dir": str(out / "run"), "seed": 0},
        "data": {"batch_size": 64},
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"epochs": epochs, "log_every": 100},
        # mtbf_hours: the rate faults come at here, so `auto` spaces snapshots for it
        "checkpoint": {"every_epochs": 5, "mtbf_hours": 0.002, "memory_every_steps": memory_every_steps},
        "log": {"progress_bar": False},
    }
    path = out / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def workers(launcher: int) -> list[int]:
    """The launcher's children that run the training script (a forked one shows torchrun's command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if entry.name.isdigit() and parent == launcher and SCRIPT.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(found)


def ledger(out: Path) -> list[dict]:
    path = out / "run" / "goodput.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def inject(proc: subprocess.Popen, out: Path, faults: int, rng: random.Random, max_delay: float) -> list[dict]:
    """Wait for each attempt's first step, then hit it; return what was done and when."""
    done = []
    for i in range(faults):
        while proc.poll() is None and not any(r["event"] == "first_step" and r["attempt"] == i for r in ledger(out)):
            time.sleep(0.02)
        time.sleep(rng.uniform(1.0, max_delay))
        pids = workers(proc.pid)
        if proc.poll() is not None or len(pids) < 2:
            break
        kind = KINDS[i % len(KINDS)]
        t = time.time()
        for pid in pids if kind == "kill-all" else [rng.choice(pids)]:
            os.kill(pid, signal.SIGTERM if kind == "term-one" else signal.SIGKILL)
        done.append({"kind": kind, "t": t, "attempt": i})
    return done


def analyse_run(out: Path, injected: list[dict]) -> dict:
    from ddpkit.goodput.faults import fault_costs
    from ddpkit.goodput.reading import analyse

    records = ledger(out)
    report, costs = analyse(records), {int(c.attempt.rsplit("#", 1)[1]): c for c in fault_costs(records)}
    logs = [out / "run" / f"trained-rank{rank}.log" for rank in (0, 1)]
    trained = [line.split() for log in logs for line in log.read_text().splitlines()]
    rows = []
    for fault in injected:
        a, cost = fault["attempt"], costs.get(fault["attempt"])
        first = next((r for r in records if r["event"] == "first_step" and r["attempt"] == a + 1), None)
        restore = next((r for r in records if r["event"] == "restore" and r["attempt"] == a + 1), None)
        if cost is None or first is None or restore is None:
            continue
        last = max(int(s) for at, s, _ in trained if int(at) == a)
        rows.append(
            {
                "kind": fault["kind"],
                "ledger_kind": cost.kind,
                "kill->step": first["t"] - fault["t"],
                "lost_steps": last - int(restore["step"]),
                **{p: cost.parts[p] for p in PARTS},
            }
        )
    return {"goodput": report.goodput, "wall": report.wall_s, "badput": report.badput, "faults": rows}


def one_run(variant: str, args: argparse.Namespace, rng: random.Random) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"chaos-{variant.replace(' ', '-').replace(',', '')}-"))
    start, preload, memory_every_steps = VARIANTS[variant]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDPKIT_PRELOAD": preload, "SKLEARN_SAMPLES": str(args.samples)}
    exp = config(out, args.epochs, memory_every_steps)
    cmd = [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        str(exp),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(args.faults + 1),
        "--script",
        SCRIPT,
        "--worker-start",
        start,
    ]
    began = time.time()
    with open(out / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
        injected = inject(proc, out, args.faults, rng, args.max_delay)
        code = proc.wait()
    measured = time.time() - began  # before the analysis, whose first call imports torch
    return {"variant": variant, **analyse_run(out, injected), "measured_wall": measured, "rc": code, "dir": str(out)}


def summarize(results: dict[str, list[dict]]) -> None:
    for variant, runs in results.items():
        if not runs:
            continue
        ratio = statistics.median(r["wall"] / r["measured_wall"] for r in runs)
        goodputs = ", ".join(f"{r['goodput']:.2f}" for r in runs)
        walls = ", ".join(f"{r['measured_wall']:.1f}" for r in runs)
        print(
            f"\n{variant}: median goodput {statistics.median(r['goodput'] for r in runs):.2f} ({goodputs}; "
            f"walls {walls} s); ledger wall / measured {ratio:.3f}"
        )
        for kind in KINDS:
            rows = [f for r in runs for f in r["faults"] if f["kind"] == kind]
            if rows:
                keys = ["kill->step", *PARTS, "lost_steps"]
                medians = {k: statistics.median(f[k] for f in rows if f[k] is not None) for k in keys}
                print(f"  {kind:9s} n={len(rows):2d} " + " ".join(f"{k}={v:.3f}" for k, v in medians.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--faults", type=int, default=6, help="faults per run, kinds in turn (default 6)")
    parser.add_argument("--epochs", type=int, default=25, help="epochs per run (25: about 12 s of training, quiet)")
    parser.add_argument("--samples", type=int, default=20000, help="the script's SKLEARN_SAMPLES (default 20000)")
    parser.add_argument("--max-delay", type=float, default=2.0, help="a fault comes 1 s to this after a first step")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every run's results here")
    args = parser.parse_args()
    rng, results = random.Random(args.seed), {v: [] for v in args.variants}
    print(f"load average before: {load_average()}", flush=True)
    for round_ in range(args.rounds):
        for variant in args.variants if round_ % 2 == 0 else reversed(args.variants):
            results[variant].append(one_run(variant, args, rng))
            print(json.dumps({"round": round_, **results[variant][-1]}), flush=True)
    print(f"load average after: {load_average()}", flush=True)
    summarize(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
