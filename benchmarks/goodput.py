"""Goodput under faults, before and after crash saves and memory snapshots; recovery time split.

    .venv/bin/python -m benchmarks.goodput --rounds 2 --faults 5     # alternating variants

What goodput's bookkeeping costs a step (the listeners, a memory snapshot) is measured by
``python -m benchmarks.feature_cost --feature goodput``.

This runs the 2-rank digits CNN (quickstart's model, 2 epochs) under ``ddpkit run --max-restarts`` with ``--faults`` faults
injected from outside at random moments (SIGKILL of one worker, SIGTERM of one worker, SIGKILL
of every worker, in turn), once per variant per round, alternating: ``before`` (crash_save off, no
memory snapshots, workers started as new interpreters: what ddpkit did until this round), ``after``
(the defaults, with ``checkpoint.mtbf_hours`` set to the injected fault rate: workers forked from the
launcher with torch imported) and ``after, new interpreters`` (the same with ``--start-method
subprocess``, to separate the two changes). The workers are the launcher's children whose command
line names the script (a forked worker shows the command line torchrun would have started). It prints, per
variant, the median goodput (``ddpkit goodput``), the steps re-trained per fault kind (from the
per-rank step logs of tests/scripts/goodput_trainer.py) and the recovery time split: failure
detection (kill -> the last worker gone), torchrun's restart (-> the new process starts),
interpreter + imports, process group, data and model build, checkpoint load, first step.

The load average is printed before and after: on a shared machine the absolute times are noise.
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

SCRIPT = "tests/scripts/goodput_trainer.py"
# `after`: the defaults, told the failure rate this bench injects (a fault every few seconds), as a
# user whose job fails that often would, so that memory snapshots are spaced for it (Young/Daly).
VARIANTS = {"before": {"crash_save": False, "memory_every_steps": None}, "after": {"mtbf_hours": 0.002}}
VARIANTS["after, new interpreters"] = VARIANTS["after"]
# How `ddpkit run` starts the workers: forked with torch imported (the default on the CPU), or, for
# `before` (ddpkit until this round) and the comparison row, as new interpreters.
START = {"before": "subprocess", "after, new interpreters": "subprocess", "after": "fork"}
KINDS = ["kill-one", "term-one", "kill-all"]


def config(out: Path, variant: str, epochs: int = 2) -> Path:
    cfg = {
        "run": {"name": "chaos", "output_dir": str(out / "run"), "seed": 0},
        "data": {"name": "digits", "batch_size": 64, "kwargs": {"num_train": 24000, "num_val": 512}},
        "model": {"name": "mnist_cnn"},
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"epochs": epochs, "log_every": 25},
        "checkpoint": {"every_epochs": 1, **VARIANTS[variant]},
        "log": {"progress_bar": False},
    }
    path = out / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def workers(launcher: int) -> list[int]:
    """The launcher's children that run the training script (torchrun runs in the launcher's process)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == launcher and SCRIPT.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(found)


def ledger(out: Path) -> list[dict]:
    path = out / "run" / "goodput.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def inject(proc: subprocess.Popen, out: Path, faults: int, rng: random.Random, args_delay: float) -> list[dict]:
    """Wait for each attempt's first step, then hit it; return what was done and when."""
    done = []
    for i in range(faults):
        while proc.poll() is None and sum(r["event"] == "first_step" and r["attempt"] == i for r in ledger(out)) == 0:
            time.sleep(0.05)
        time.sleep(rng.uniform(1.0, args_delay))
        pids = workers(proc.pid)
        if proc.poll() is not None or len(pids) < 2:
            break
        kind = KINDS[i % len(KINDS)]
        targets = pids if kind == "kill-all" else [rng.choice(pids)]
        t = time.time()
        for pid in targets:
            os.kill(pid, signal.SIGTERM if kind == "term-one" else signal.SIGKILL)
        while any(Path(f"/proc/{pid}").exists() and (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z") for pid in pids):
            time.sleep(0.02)
        done.append({"kind": kind, "t": t, "gone": time.time(), "attempt": i})
    return done


def analyse_run(out: Path, faults: list[dict]) -> dict:
    from ddpkit.goodput.reading import analyse

    records = ledger(out)
    report = analyse(records)
    trained = [line.split() for rank in (0, 1) for line in (out / "run" / f"trained-rank{rank}.log").read_text().splitlines()]
    rows = []
    for fault in faults:
        a = fault["attempt"]
        by = {r["event"]: r for r in records if r["attempt"] == a + 1 and r["event"] in ("start", "restore", "first_step")}
        if len(by) < 3:
            continue
        last = max(int(s) for at, s, _ in trained if int(at) == a)
        rows.append({"kind": fault["kind"], "lost_steps": last - by["restore"]["step"], "detect": fault["gone"] - fault["t"],
                     "restart": by["start"]["t"] - fault["gone"], "imports": by["start"]["imported"] - by["start"]["t"],
                     "group": by["start"]["ready"] - by["start"]["imported"], "build": by["restore"]["began"] - by["start"]["ready"],
                     "load": by["restore"]["t"] - by["restore"]["began"], "first_step": by["first_step"]["t"] - by["restore"]["t"]})
    return {"goodput": report.goodput, "wall": report.wall_s, "badput": report.badput, "faults": rows}


def chaos(args: argparse.Namespace) -> None:
    rng, results = random.Random(args.seed), {v: [] for v in VARIANTS}
    print(f"load average before: {load_average()}", flush=True)
    for round_ in range(args.rounds):
        for variant in (VARIANTS if round_ % 2 == 0 else reversed(list(VARIANTS))):
            out = Path(tempfile.mkdtemp(prefix=f"chaos-{variant.replace(', ', '-').replace(' ', '-')}-"))
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "ddpkit", "run", str(config(out, variant, args.epochs)), "--nproc-per-node", "2",
                   "--max-restarts", str(args.faults + 1), "--script", SCRIPT, "--start-method", START[variant]]
            began = time.time()
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(out / "stderr.txt", "w"))
            faults = inject(proc, out, args.faults, rng, args.max_delay)
            code = proc.wait()
            measured = time.time() - began  # before the analysis, whose first call imports torch
            result = {**analyse_run(out, faults), "measured_wall": measured, "rc": code, "dir": str(out)}
            results[variant].append(result)
            print(json.dumps({"round": round_, "variant": variant, **result}), flush=True)
    print(f"load average after: {load_average()}", flush=True)
    summarize(results)


def summarize(results: dict) -> None:
    for variant, runs in results.items():
        print(f"\n{variant}: median goodput {statistics.median(r['goodput'] for r in runs):.2f} over {len(runs)} run(s); "
              f"ledger wall / measured wall {statistics.median(r['wall'] / r['measured_wall'] for r in runs):.3f}")
        for kind in KINDS:
            rows = [f for r in runs for f in r["faults"] if f["kind"] == kind]
            if rows:
                parts = {k: statistics.median(f[k] for f in rows) for k in rows[0] if k != "kind"}
                print(f"  {kind:9s} n={len(rows)} " + " ".join(f"{k}={v:.2f}" if k != "lost_steps" else f"{k}={v:g}" for k, v in parts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2, help="epochs of the chaos run (2: about 3 s of training on a quiet machine)")
    parser.add_argument("--max-delay", type=float, default=6.0, help="a fault comes 1 s to this many seconds after an attempt's first step")
    args = parser.parse_args()
    chaos(args)


if __name__ == "__main__":
    main()
