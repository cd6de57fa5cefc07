"""Restart to the first step after a SIGKILL, split into parts: a new interpreter vs a warm standby.

    python -m benchmarks.restart            # CUDA when available (GPT-2 124M), else a small GPT on the CPU; 5 rounds
    python -m benchmarks.restart --device cuda --preset gpt2 --rounds 5 --json restart.json
    python -m benchmarks.restart --device cpu --rounds 1 --every-steps 2 --torchrun    # also torchrun's own path
    python -m benchmarks.restart --preload  # a standby with torch and ddpkit only (default: torch._dynamo too)

A GPT (``ddpkit.models.gpt``) on the ``stdlib`` token corpus trains with the ddpkit ``Trainer``
as a world of one, checkpointing every ``--every-steps`` steps, in a child process; once its first
checkpoint is on disk it is SIGKILLed. Then, over ``--rounds`` alternated rounds, the same job
restarts from that checkpoint (``checkpoint.resume: <its path>``, a fresh ``output_dir`` each time),
trains exactly one step and exits, started two ways:

- **new interpreter**: ``python -m benchmarks.restart --worker SPEC``, what torchrun starts for a
  world of one (``--torchrun`` adds torchrun itself, ``python -m torch.distributed.run --standalone
  --nproc-per-node 1``, as a third arm);
- **warm standby**: ``python -m benchmarks.restart --standby READY``, started ahead of the round,
  has imported torch and ddpkit and then waits on its stdin; the restart request is one line
  there, and it runs the same code from the checkpoint. It has no CUDA context (one made ahead
  would not survive a fork, so a forkserver-style standby cannot have one either). It also imports
  ``--preload MODULE ...``, by default ``torch._dynamo``, as ``ddpkit run``'s forked CPU workers find
  it preloaded (``ddpkit.launch.forked.PRELOADED``).

The parts, from ``time.time()`` stamps (one clock for every process on the machine) taken inside
the restarted process, each ending at its stamp:

1. *interpreter up*: from the request (the parent starts the process or writes the standby's line)
   to this module's first line (a standby: to its return from reading the request);
2. *imports*: torch and ddpkit (n/a for the standby: done ahead);
3. *CUDA context*: ``torch.empty(1, device="cuda")`` and a synchronize (n/a on the CPU);
4. *process group*: to the first build hook, ``build_datasets``: it also holds the config's
   validation in ``Trainer(config)``, the run lock, the watchdog, the goodput ledger, logging's setup
   and the setup seed, all in ``fit()`` before the build;
5. *build*: to the moment the checkpoint starts loading (the ``restore`` line of the restarted run's
   ``goodput.jsonl``, ``began``): the datasets, model, loaders, optimizer, schedule, and what
   ``_setup`` does after the last build hook (``build_scheduler``): the model's views, the reporter,
   the health checks, the registration of the state. It also holds imports that only the build
   makes: constructing AdamW imports ``torch._dynamo`` (about 0.85 s of a 2-core CPU), which the
   standby has done ahead (unless started with an empty ``--preload``);
6. *load*: reading the checkpoint and loading every part of the state (that ledger line's ``t``);
7. *first step*: to the end of ``on_step_end`` of the first step after a ``torch.cuda.synchronize()``
   on CUDA; it holds the reporter's start, ``on_fit_start`` and the first batch's loading.

The parts add up to the total (request -> first step). The restarted run must resume at the
checkpoint's step and report step + 1 as its first step, or the benchmark fails. After the first
step the worker writes its stamps and leaves with ``os._exit(0)``: the final save, the model file and
the validation that ``fit()`` would still do are not part of a restart, and cost seconds on the
124M model. Printed: a table per arm (median and min..max over rounds), the paired ratio warm /
new of the total, the device, torch's version and the load average before and after;
``--json PATH`` writes every round's stamps and parts. No ``torch.compile`` (its first step would
be compilation). Workers find the ``benchmarks`` package through ``PYTHONPATH``
(``benchmarks.workloads.child_env``).
"""

# ruff: noqa: E402  (the stamp below is the worker's first line: the imports come after it)
from __future__ import annotations

import time

# a new interpreter's first line of this worker ("interpreter up"); `-m` imported the bare `benchmarks` package first
UP = time.time()

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# Not benchmarks.workloads at the top: it imports torch, which a worker's "imports" part must hold.

SEED = 0
NEW, WARM, TORCHRUN = "new interpreter", "warm standby", "torchrun"
#: Each part and the stamp that ends it (the previous part's stamp begins it; see the docstring).
PARTS = {
    "interpreter up": "up",
    "imports": "imported",
    "CUDA context": "cuda",
    "process group": "group",
    "build": "restore_began",
    "load": "restore_end",
    "first step": "first_step",
}
#: The model and batch: a small byte-level GPT for the CPU, GPT-2 124M for a GPU (bf16 there).
PRESETS = {
    "small": {
        "model": {"vocab_size": 257, "dim": 64, "depth": 2, "heads": 2, "max_len": 64},
        "seq_len": 64,
        "batch_size": 8,
    },
    "gpt2": {"model": {"preset": "gpt2"}, "seq_len": 1024, "batch_size": 8},
}


# --- the worker: the killed job, a restarted one, a standby ------------------------------------------


def restart_trainer() -> type:
    """The Trainer that stamps the parts from its public hooks; with ``result`` set it writes them after its first
    step and exits."""
    import torch

    import ddpkit

    class RestartTrainer(ddpkit.Trainer):
        stamps: dict[str, Any]
        result: str | None = None  # None: the job that gets killed, which trains on

        def build_datasets(self):
            self.stamps["group"] = time.time()  # fit() opened the group (worker_scope) just before
            return super().build_datasets()

        def build_scheduler(self, optimizer, total_steps):
            scheduler = super().build_scheduler(optimizer, total_steps)
            self.stamps["built"] = time.time()  # raw data only: _setup builds more after this hook (see the docstring)
            return scheduler

        def on_fit_start(self) -> None:
            self.stamps.update(fit_start=time.time(), resumed_step=self.progress.step)

        def on_step_end(self, step: int) -> None:
            if self.result is None:
                return
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.stamps.update(first_step=time.time(), step=step)
            Path(self.result).write_text(json.dumps(self.stamps))
            sys.stdout.flush()
            os._exit(0)  # the rest of fit() is no part of a restart (see the module docstring)

    return RestartTrainer


def serve(mode: str, path: str, *preload: str) -> None:
    """``--worker SPEC``: run SPEC now; ``--standby READY [MODULE ...]``: import (and preload), write READY, run the
    spec whose path comes on stdin."""
    import importlib

    stamps: dict[str, Any] = {"up": UP}
    trainer_class = restart_trainer()  # torch and ddpkit
    stamps["imported"] = time.time()
    if mode == "--standby":
        for module in preload:
            importlib.import_module(module)
        Path(path).write_text("ready")
        path = sys.stdin.readline().strip()
        # woken; its interpreter and imports were ready before the request
        stamps = {"up": time.time(), "imported": None}
    spec = json.loads(Path(path).read_text())
    if spec["device"] == "cuda":
        import torch

        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
        stamps["cuda"] = time.time()
    trainer = trainer_class(spec["config"])
    trainer.stamps, trainer.result = stamps, spec["result"]
    trainer.fit()
    raise SystemExit(
        f"{path}: fit() returned; a restart exits after its first step and the killed job should not finish"
    )


# --- the driver ------------------------------------------------------------------------------------------


def job_config(preset: str, *, device: str, every_steps: int, output_dir: Path) -> dict[str, Any]:
    """The killed job's config: a GPT on the stdlib corpus that checkpoints every ``every_steps`` steps and would
    train on."""
    p = PRESETS[preset]
    return {
        "run": {"name": "restart", "output_dir": str(output_dir), "seed": SEED},
        "dist": {"device": device},
        "data": {
            "name": "tokens",
            "batch_size": p["batch_size"],
            "kwargs": {"corpus": "stdlib", "seq_len": p["seq_len"]},
        },
        "model": {"name": "gpt", "kwargs": p["model"]},
        "optim": {"name": "adamw", "lr": 3e-4, "weight_decay": 0.1},
        "train": {"max_steps": 1_000_000, "log_every": 1_000_000, "precision": "bf16" if device == "cuda" else "fp32"},
        "checkpoint": {"every_steps": every_steps, "every_epochs": None, "memory_every_steps": None, "resume": "none"},
        "log": {"progress_bar": False},
    }


def start(argv: list[str], log: Path, **popen: Any) -> subprocess.Popen:
    """``python -m benchmarks.restart ARGV`` (or ARGV itself when it starts with the interpreter), output to ``log``,
    in its own session."""
    from benchmarks.workloads import REPO, child_env

    command = argv if argv[0] == sys.executable else [sys.executable, "-m", __spec__.name, *argv]
    with open(log, "w") as out:
        return subprocess.Popen(
            command, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen
        )


def failed(what: str, log: Path) -> SystemExit:
    tail = log.read_text()[-4000:] if log.exists() else "(no output)"
    return SystemExit(f"[restart] {what}; its output ({log}):\n{tail}")


def write_spec(directory: Path, config: dict[str, Any], *, device: str, result: Path | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    spec = directory / "spec.json"
    spec.write_text(json.dumps({"config": config, "device": device, "result": result and str(result)}))
    return spec


def killed_job_checkpoint(config: dict[str, Any], workdir: Path, *, device: str, timeout: float) -> Any:
    """Start the job, SIGKILL it (and its session) once a checkpoint is on disk; the newest valid one (a
    ``CheckpointInfo``)."""
    from ddpkit.checkpoint.files import find_latest_checkpoint, list_checkpoints

    log, directory = workdir / "job.log", Path(config["run"]["output_dir"]) / "checkpoints"
    job = start(["--worker", str(write_spec(workdir / "job", config, device=device, result=None))], log)
    deadline = time.time() + timeout
    try:
        while not list_checkpoints(directory):
            if job.poll() is not None:
                raise failed(f"the job exited ({job.returncode}) before its first checkpoint", log)
            if time.time() > deadline:
                raise failed(f"no checkpoint after {timeout:.0f} s", log)
            time.sleep(0.05)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    info = find_latest_checkpoint(directory)
    if info is None:
        raise failed(f"no valid checkpoint in {directory} after the kill", log)
    print(
        f"[restart] the job was SIGKILLed after its checkpoint of step {info.step} "
        f"({info.path.stat().st_size / 1e6:.1f} MB)",
        file=sys.stderr,
        flush=True,
    )
    return info


def start_standby(directory: Path, *, preload: list[str], timeout: float) -> tuple[subprocess.Popen, Path]:
    """A standby with torch, ddpkit and ``preload`` imported, waiting on its stdin (started and waited for outside
    the timed part)."""
    directory.mkdir(parents=True, exist_ok=True)
    ready, log = directory / "ready", directory / "standby.log"
    standby = start(["--standby", str(ready), *preload], log, stdin=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while not ready.exists():
        if standby.poll() is not None or time.time() > deadline:
            raise failed("the standby did not get ready", log)
        time.sleep(0.02)
    return standby, log


def restart(
    arm: str, spec: Path, *, standby: subprocess.Popen, standby_log: Path
) -> tuple[float, subprocess.Popen, Path]:
    """Request the restart of ``spec`` one way; the request's time, the process to wait for and its log."""
    if arm == WARM:
        requested = time.time()
        standby.stdin.write(f"{spec}\n")
        standby.stdin.flush()
        return requested, standby, standby_log
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", __spec__.name]
        if arm == TORCHRUN
        else []
    )
    log = spec.parent / "worker.log"
    requested = time.time()
    return requested, start([*launcher, "--worker", str(spec)] if launcher else ["--worker", str(spec)], log), log


def one_restart(
    arm: str,
    round_: int,
    *,
    config: dict[str, Any],
    checkpoint: Any,
    workdir: Path,
    device: str,
    standby: tuple[subprocess.Popen, Path],
    timeout: float,
) -> dict[str, Any]:
    """Restart from ``checkpoint`` one way, check it resumed there, and return its stamps and parts."""
    out = workdir / f"{arm.replace(' ', '-')}-{round_}"
    restarted = {
        **config,
        "run": {**config["run"], "output_dir": str(out / "run")},
        "checkpoint": {**config["checkpoint"], "resume": str(checkpoint.path)},
    }
    result = out / "stamps.json"
    requested, process, log = restart(
        arm, write_spec(out, restarted, device=device, result=result), standby=standby[0], standby_log=standby[1]
    )
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise failed(f"{arm}: no exit after {timeout:.0f} s", log) from None
    if code != 0 or not result.exists():
        raise failed(f"{arm}: exit {code}, stamps {'written' if result.exists() else 'missing'}", log)
    stamps = {**json.loads(result.read_text()), "requested": requested, **restore_record(out / "run")}
    expected = checkpoint.step
    if (stamps["resumed_step"], stamps["restored_step"], stamps["step"]) != (expected, expected, expected + 1):
        raise SystemExit(
            f"[restart] {arm}, round {round_ + 1}: did not resume from the checkpoint of step {expected}: "
            f"resumed at {stamps['resumed_step']} (ledger: {stamps['restored_step']}), first step "
            f"{stamps['step']}, expected {expected + 1}"
        )
    return {"round": round_, "arm": arm, "stamps": stamps, "parts": parts_of(stamps)}


def restore_record(output_dir: Path) -> dict[str, Any]:
    """When the restarted run's checkpoint load began and ended, and the step it restored, from its
    ``goodput.jsonl``."""
    lines = (output_dir / "goodput.jsonl").read_text().splitlines()
    record = next(r for r in map(json.loads, lines) if r["event"] == "restore")
    return {"restore_began": record["began"], "restore_end": record["t"], "restored_step": record["step"]}


def parts_of(stamps: dict[str, Any]) -> dict[str, float | None]:
    """Each part's seconds (None: n/a), from the request on; they add up to ``total``."""
    parts, last = {}, stamps["requested"]
    for name, key in PARTS.items():
        t = stamps.get(key)
        parts[name] = None if t is None else t - last
        last = last if t is None else t
    return {**parts, "total": stamps["first_step"] - stamps["requested"]}


def measure(args: Any, workdir: Path) -> tuple[Any, list[dict[str, Any]]]:
    """Kill the job once, then restart it ``args.rounds`` times per arm, alternating; the checkpoint and every
    restart."""
    from benchmarks.workloads import rotated

    config = job_config(
        args.preset, device=args.device, every_steps=args.every_steps, output_dir=workdir / "job" / "run"
    )
    checkpoint = killed_job_checkpoint(config, workdir, device=args.device, timeout=args.timeout)
    arms, runs = [NEW, WARM, *([TORCHRUN] if args.torchrun else [])], []
    for r in range(args.rounds):
        standby = start_standby(workdir / f"standby-{r}", preload=args.preload, timeout=args.timeout)
        try:
            for arm in rotated(arms, r):
                runs.append(
                    one_restart(
                        arm,
                        r,
                        config=config,
                        checkpoint=checkpoint,
                        workdir=workdir,
                        device=args.device,
                        standby=standby,
                        timeout=args.timeout,
                    )
                )
                parts = ", ".join(
                    f"{k} {v:.3f}" for k, v in runs[-1]["parts"].items() if v is not None and k != "total"
                )
                print(
                    f"[restart] round {r + 1}/{args.rounds} {arm}: first step "
                    f"{runs[-1]['parts']['total']:.3f} s after the request ({parts})",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            if standby[0].poll() is None:  # a failed round's standby that never got its request
                os.killpg(standby[0].pid, signal.SIGKILL)
                standby[0].wait()
    return checkpoint, runs


def report(runs: list[dict[str, Any]], *, rounds: int) -> str:
    """A table per arm, then the paired ratios of the totals to the new interpreter's."""
    from benchmarks.workloads import paired, summary, table

    arms = list(dict.fromkeys(run["arm"] for run in runs))
    by_arm = {arm: [run["parts"] for run in runs if run["arm"] == arm] for arm in arms}
    out = []
    for arm in arms:
        rows = []
        for name in [*PARTS, "total"]:
            values = [parts[name] for parts in by_arm[arm]]
            s = None if None in values else summary(values)
            rows.append([name, "n/a", ""] if s is None else [name, f"{s.median:.3f}", s.spread(3)])
        out.append(
            table(
                f"\n{arm}: restart request -> first step, {rounds} alternated round(s):",
                ["part", "median s", "min..max"],
                rows,
            )
        )
    new_totals = [parts["total"] for parts in by_arm[NEW]]
    for arm in arms[1:]:
        totals = [parts["total"] for parts in by_arm[arm]]
        ratio, diff = paired(totals, new_totals), paired(totals, new_totals, difference=True)
        out.append(
            f"{arm} / {NEW}, total (paired): median {ratio.median:.3f} "
            f"({ratio.spread(3)}); difference {diff.median:+.3f} s ({diff.spread(3)})"
        )
    return "\n".join(out)


def device_line(device: str) -> str:
    import platform

    import torch

    name = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return f"device: {name}; torch {torch.__version__}; python {platform.python_version()}"


def main(argv: list[str]) -> int:
    import argparse

    import torch

    from benchmarks.workloads import load_printed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="the model: gpt2 (124M, the default on CUDA) or small (the default on the CPU)",
    )
    parser.add_argument(
        "--every-steps", type=int, default=10, help="the killed job's checkpoint.every_steps (default 10)"
    )
    parser.add_argument(
        "--torchrun",
        action="store_true",
        help="a third arm: torchrun --standalone --nproc-per-node 1 starts the worker",
    )
    parser.add_argument(
        "--preload",
        nargs="*",
        default=["torch._dynamo"],
        metavar="MODULE",
        help="modules the standby also imports ahead (default: torch._dynamo, which AdamW's "
        "construction imports in 'build', as ddpkit run's forked CPU workers have it preloaded; "
        "--preload with no module: none)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one process may take (default 600)")
    parser.add_argument("--json", type=Path, help="write every round's stamps and parts here")
    args = parser.parse_args(argv)
    args.preset = args.preset or ("gpt2" if args.device == "cuda" else "small")
    print(
        device_line(args.device) + f"; model preset {args.preset}; "
        f"standby preloads: {', '.join(args.preload) or 'nothing'}",
        flush=True,
    )
    with load_printed(), tempfile.TemporaryDirectory(prefix="ddpkit-restart-") as tmp:
        checkpoint, runs = measure(args, Path(tmp))
        print(f"checkpoint: step {checkpoint.step}, {checkpoint.path.stat().st_size / 1e6:.1f} MB", flush=True)
        print(report(runs, rounds=args.rounds), flush=True)
    if args.json:
        summary = {
            "device": device_line(args.device),
            "torch": torch.__version__,
            "preset": args.preset,
            "preload": args.preload,
            "checkpoint_step": checkpoint.step,
            "runs": runs,
        }
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] in (["--worker"], ["--standby"]):
        serve(*sys.argv[1:])
    else:
        sys.exit(main(sys.argv[1:]))
