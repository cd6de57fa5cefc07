"""Time to 95% validation accuracy on the digits data, whole process: launch to exit, save included.

    python -m benchmarks.time_to_accuracy                    # 5 alternated rounds (~1.5 min on 2 cores)
    python -m benchmarks.time_to_accuracy --rounds 1 --json tta.json

Issue 25's budget: ddpkit within 1.05x of the hand-written script. Three variants, each launched as
a fresh process tree, timed with ``time.time()`` from just before the launch to the launcher's exit,
in alternating order (a round's first variant alternates), after one untimed warm-up of each:

* ``hand-written``: ``python -m torch.distributed.run --standalone --nproc-per-node 2
  -m benchmarks.tta_hand DATA OUT`` (torch only; see its docstring);
* ``ddpkit``: ``python -m ddpkit run CONFIG --nproc-per-node 2``, with the same job as a config
  (``CONFIG`` below) and every other default on: progress bar, watchdog, signals, health checks,
  checkpoint every epoch and at the end, crash save, memory snapshots; its workers forked from the
  launcher with torch imported (the default on the CPU);
* ``ddpkit, new interpreters``: the same with ``--start-method subprocess``, workers started as
  torchrun starts them (``python -u -m ddpkit train CONFIG``).

The job: the MNIST CNN (``model.name=mnist_cnn``) on ddpkit's ``digits`` dataset with its defaults,
2 Gloo ranks, one thread each (``OMP_NUM_THREADS=1``), batch 64 per rank, SGD lr 0.05 momentum 0.9,
seed 0, an exact evaluation every 25 steps, stop at the first with ``val_accuracy >= 0.95``, then
rank 0 writes ``model.pt``. Both seed as the Trainer does, so the runs are meant to be bitwise
alike: the two step counts are reported, and whether the two ``model.pt`` of a round are bitwise equal.

The data, fairly: the bench renders the tensors once (``make_digits`` with the arguments
``ddpkit.data.datasets.digits`` uses by default) and ``torch.save``s them to its temp dir; the hand
script loads that file. ddpkit's ``digits`` reads the same tensors from its disk cache
(``ddpkit.data.cache``, ``DDPKIT_CACHE_DIR`` unset: ``~/.cache/ddpkit``), which the warm-up run
fills when it is empty. So both variants read the data from disk; neither renders it in a timed run.

The parts (medians; each is the time between two consecutive marks, wall clock):

=================  ============================================  ===============================================
mark               hand-written (rank 0's JSON line)             ddpkit (``<output_dir>/goodput.jsonl``)
=================  ============================================  ===============================================
launch             the bench, just before starting the launcher  the same
imports done       after ``import torch`` and the rest           ``start.imported``: ``ddpkit.goodput.ledger``
                                                                 imported (torch and most of ddpkit loaded)
group ready        after ``init_process_group``                  ``start.ready``: the process group is up
data+model built   data, model, DDP, optimizer, loader, seeds    ``restore.began``: all built, before resume
first step         end of the first optimizer step               ``first_step``
target reached     end of the evaluation that reached 0.95       end (``t``) of the last ``validation`` event
saved              ``model.pt`` written                          ``end``: final checkpoint, ``model.pt``, the
                                                                 end-of-training barrier, the reporter closed
exit               the launcher exited                           the same
=================  ============================================  ===============================================

The step at which ddpkit stopped is the ``end`` event's; the log's ``early stopping: ... >= target``
line is checked too. ``--json PATH`` writes every mark of every run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import child_env, paired, summary
from ddpkit.bench.report import format_table, progress
from ddpkit.data.datasets import digits, make_digits
from ddpkit.goodput.reading import read_ledger

HAND = "benchmarks.tta_hand"
VARIANTS = ("hand-written", "ddpkit", "ddpkit, new interpreters")
START = {"ddpkit": "fork", "ddpkit, new interpreters": "subprocess"}  # `ddpkit run --start-method`
MARKS = ("launch", "imported", "ready", "built", "first_step", "target", "saved", "exit")
PARTS = [f"{a}->{b}" for a, b in zip(MARKS, MARKS[1:])]
TIMEOUT = 900  # seconds a run may take before the bench gives up on it
CONFIG = """\
run: {{name: tta, output_dir: {output_dir}, seed: 0}}
data: {{name: digits, batch_size: 64}}
model: {{name: mnist_cnn}}
optim: {{name: sgd, lr: 0.05, momentum: 0.9}}
train:
  epochs: null
  max_steps: 2000
  eval_every: 25
  early_stopping: {{metric: val_accuracy, mode: max, target: 0.95}}
"""
REACHED = re.compile(
    r"early stopping: val_accuracy (\S+) >= train\.early_stopping\.target=\S+ \(mode max\) at step (\d+)"
)


def environment() -> dict[str, str]:
    """One thread per rank, unbuffered output, ddpkit's default cache directory, ``benchmarks`` importable."""
    env = child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("DDPKIT_CACHE_DIR", None)
    return env


def prepare_data(workdir: Path) -> Path:
    """ddpkit's default ``digits`` tensors (train, then validation), saved for the hand-written script."""
    d = {name: p.default for name, p in inspect.signature(digits).parameters.items()}
    shape = dict(image_size=d["image_size"], noise=d["noise"])
    train = make_digits(d["num_train"], seed=d["seed"], **shape)
    val = make_digits(d["num_val"], seed=d["seed"] + 1, **shape)
    path = workdir / "digits.pt"
    torch.save([*train, *val], path)
    progress(
        f"[tta] data: digits {d['num_train']} train / {d['num_val']} "
        f"val, {d['image_size']}px, seed {d['seed']} -> {path}"
    )
    return path


def launch(argv: list[str], log: Path) -> tuple[float, float, str]:
    """Run ``argv`` to its exit: (launch time, exit time, its stdout); stderr goes to ``log``."""
    with open(log, "w") as err:
        launched = time.time()
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=environment(), timeout=TIMEOUT)
        exited = time.time()
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv)} exited {done.returncode}; its stderr ({log}) ends:\n{log.read_text()[-4000:]}"
        )
    return launched, exited, done.stdout


def run_hand(data: Path, out: Path) -> dict[str, Any]:
    """One hand-written run: its marks and step count."""
    out.mkdir(parents=True)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        HAND,
        str(data),
        str(out),
    ]
    launched, exited, stdout = launch(argv, out / "stderr.txt")
    line = [s for s in stdout.splitlines() if s.startswith("{")][-1]
    marks = json.loads(line)
    return {**marks, "launch": launched, "exit": exited}  # marks: imports_started, imported, ..., saved, step


def run_ddpkit(out: Path, start: str = "fork") -> dict[str, Any]:
    """One ``ddpkit run --start-method START``: its marks from the goodput ledger, its step count from the ledger and
    the log."""
    out.mkdir(parents=True)
    config = out.with_suffix(".yaml")
    config.write_text(CONFIG.format(output_dir=out))
    log = out.parent / f"{out.name}.stderr.txt"
    launched, exited, _ = launch(
        [sys.executable, "-m", "ddpkit", "run", str(config), "--nproc-per-node", "2", "--start-method", start], log
    )
    events: dict[str, list[dict[str, Any]]] = {}
    for record in read_ledger(out):
        if record.get("rank", 0) == 0:
            events.setdefault(record["event"], []).append(record)
    start, end = events["start"][-1], events["end"][-1]
    reached = REACHED.search(log.read_text())
    return {
        "launch": launched,
        "imported": start["imported"],
        "ready": start["ready"],
        "built": events["restore"][-1]["began"],
        "first_step": events["first_step"][-1]["t"],
        "target": events["validation"][-1]["t"],
        "saved": end["t"],
        "exit": exited,
        "step": end["step"],
        "logged_step": int(reached.group(2)) if reached else None,
        "logged_accuracy": float(reached.group(1)) if reached else None,
    }


def one_run(variant: str, data: Path, out: Path) -> dict[str, Any]:
    """Run ``variant`` once into ``out``; add its wall seconds and parts."""
    run = run_hand(data, out) if variant == "hand-written" else run_ddpkit(out, START[variant])
    run["wall_s"] = run["exit"] - run["launch"]
    run["parts_s"] = {p: run[b] - run[a] for p, a, b in zip(PARTS, MARKS, MARKS[1:])}
    run["model"] = str(out / "model.pt")
    return run


def same_weights(a: str, b: str) -> bool:
    """Whether two saved state dicts hold the same names and bitwise equal tensors."""
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def measure(rounds: int, workdir: Path) -> dict[str, list[dict[str, Any]]]:
    """One untimed warm-up of each variant, then ``rounds`` alternated rounds."""
    data = prepare_data(workdir)
    for variant in VARIANTS:
        run = one_run(variant, data, workdir / f"warmup-{variant.replace(', ', '-').replace(' ', '-')}")
        progress(f"[tta] warm-up {variant}: {run['wall_s']:.1f} s, {run['step']} steps")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            run = one_run(variant, data, workdir / f"r{r}-{variant.replace(', ', '-').replace(' ', '-')}")
            runs[variant].append(run)
            progress(f"[tta] round {r + 1}/{rounds} {variant}: {run['wall_s']:.1f} s, {run['step']} steps")
        for variant in START:
            last = runs[variant][-1]
            last["bitwise_equal_to_hand"] = same_weights(last["model"], runs["hand-written"][-1]["model"])
    return runs


def report(runs: dict[str, list[dict[str, Any]]]) -> str:
    """The wall-time table (with the paired ratio) and the table of parts."""
    hand, rows = [r["wall_s"] for r in runs["hand-written"]], []
    for variant, variant_runs in runs.items():
        wall = summary([r["wall_s"] for r in variant_runs])
        ratio = paired([r["wall_s"] for r in variant_runs], hand)
        steps = ", ".join(str(r["step"]) for r in variant_runs)
        rows.append([variant, f"{wall.median:.2f}", wall.spread(2), f"{ratio.median:.3f}", ratio.spread(3), steps])
    equal = min(sum(r["bitwise_equal_to_hand"] for r in runs[v]) for v in START)
    budget = paired([d["wall_s"] for d in runs["ddpkit"]], hand).median
    lines = [
        "time to 95% validation accuracy, launch to exit, MNIST CNN on digits, 2 ranks x 1 thread, "
        f"{len(hand)} rounds:",
        format_table(["variant", "median s", "min..max", "x hand (paired)", "min..max", "steps to target"], rows),
        f"budget: ddpkit within 1.05x of hand-written: {'met' if budget <= 1.05 else 'NOT met'} (median "
        f"{budget:.3f}x); final weights of both ddpkit variants bitwise equal to the same round's hand-written run: "
        f"{equal}/{len(hand)} rounds",
        "",
        "parts, median seconds (launch -> imports done -> group ready -> "
        "data+model built -> first step -> target reached -> saved -> exit):",
    ]
    part_rows = [
        [v, *(f"{summary([r['parts_s'][p] for r in rs]).median:.2f}" for p in PARTS)] for v, rs in runs.items()
    ]
    diffs = [
        [f"{row[0]} - hand", *(f"{float(d) - float(h):+.2f}" for d, h in zip(row[1:], part_rows[0][1:]))]
        for row in part_rows[1:]
    ]
    lines.append(format_table(["variant", *PARTS], [*part_rows, *diffs]))
    logged = [(r["logged_step"], r["step"]) for r in runs["ddpkit"]]
    if any(a != b for a, b in logged):
        lines.append(
            f"note: ddpkit's 'early stopping ... >= target' log line (step) vs its ledger's end step: {logged}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds after the warm-up (default 5)")
    parser.add_argument("--json", type=Path, default=None, help="write every run's marks, parts and steps here")
    args = parser.parse_args(argv)
    before = os.getloadavg()
    print(f"load average before: {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ddpkit-tta-") as tmp:
        runs = measure(args.rounds, Path(tmp))
    after = os.getloadavg()
    print(report(runs))
    print(f"load average after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}", flush=True)
    if args.json is not None:
        record = {"rounds": args.rounds, "load_before": before, "load_after": after, "runs": runs}
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
