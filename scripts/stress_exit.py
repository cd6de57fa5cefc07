"""Stress the way 2-rank runs end: many short launches back to back under CPU load, counting
wrong exit codes and C++ aborts at interpreter exit.

    .venv/bin/python scripts/stress_exit.py --runs 200 --mode finish --load 2
    .venv/bin/python scripts/stress_exit.py --runs 20 --mode preempt --load 2       # SIGTERM to the launcher: exit 75
    .venv/bin/python scripts/stress_exit.py --runs 20 --mode config-error --load 2  # a key the workers check: exit 2
    .venv/bin/python scripts/stress_exit.py --runs 20 --mode hang --load 2          # the hang watchdog: exit 3

Each run is ``ddpkit run configs/quickstart.yaml --nproc-per-node 2`` with overrides that make it a
few seconds long (a CNN on 1,024 generated digits, ``data.num_workers=0``), writing to a fresh
temporary directory that is also its working directory (a core dump lands there). Meanwhile
``--load`` busy-loop processes keep the cores busy: load exposes races at shutdown that a quiet
machine hides (issue 28: 4 aborts in 40 finished runs with both cores busy, none without load).
The load processes are killed at the end, however the script ends.

A run fails when its exit code is not the mode's (0, 75, 2, 3) or its output contains a sign of a
C++ abort (``terminate called``, ``Aborted``, ``SIGABRT``, ``Fatal Python error``). Failed runs'
output is kept (``--keep``: every run's) and their paths printed. ``--faulthandler`` sets
``PYTHONFAULTHANDLER=1`` in the workers, so an abort prints every Python thread's stack;
``--core`` lets them dump core (``gdb .venv/bin/python DIR/core -batch -ex 'thread apply all bt'``).
``--cpus 0`` pins the runs and the load to one core; ``--launcher torchrun`` starts the same run
with plain torchrun and ``examples/train.py`` (the store then lives in torchrun's agent, not in
rank 0). Exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ABORT_SIGNS = ("terminate called", "Aborted", "SIGABRT", "Fatal Python error")
EXPECTED = {"finish": 0, "preempt": 75, "config-error": 2, "hang": 3}
# The quickstart as a new user runs it (checkpoint every epoch, model.pt at the end), on less data.
SHORT = [
    "data.num_workers=0",
    "data.kwargs.num_train=1024",
    "data.kwargs.num_val=256",
    "train.epochs=2",
    "dist.timeout=120",
]
MODE_ARGS = {
    "finish": [],
    # Long enough to be signalled mid-run; the first logged step says training is under way.
    "preempt": ["train.epochs=200", "train.log_every=2"],
    # The model's keyword arguments are checked when the workers build it, not by the launcher.
    "config-error": ["model.kwargs.bogus=1"],
    "hang": ["--script", str(REPO / "tests" / "scripts" / "hang_trainer.py"), "dist.hang_timeout=4", "train.epochs=20"],
}
MODE_ENV = {"hang": {"HANG_WHERE": "step", "HANG_RANK": "1", "HANG_STEP": "3"}}


@dataclass
class Result:
    code: int | None
    seconds: float
    aborts: list[str]
    directory: Path

    def failed(self, expected: int) -> bool:
        return self.code != expected or bool(self.aborts)


@dataclass
class Load:
    """``count`` busy-loop processes, bounded by the script's lifetime (stopped in ``stop``)."""

    count: int
    procs: list[multiprocessing.Process] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)

    def start(self, cpus: set[int] | None = None) -> None:
        for _ in range(self.count):
            proc = multiprocessing.Process(target=_spin, args=(cpus,), daemon=True)
            proc.start()
            self.procs.append(proc)

    def sample(self) -> None:
        self.samples.append(os.getloadavg()[0])

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.join()


def _spin(cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    while True:
        pass


def _command(mode: str, out: Path, launcher: str) -> list[str]:
    config = str(REPO / "configs" / "quickstart.yaml")
    overrides = [f"run.output_dir={out}", *SHORT, *MODE_ARGS[mode]]
    if launcher == "torchrun":  # the same run under plain torchrun: the store lives in torchrun's agent
        script = str(REPO / "examples" / "train.py")
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            script,
            config,
            *overrides,
        ]
    return [str(Path(sys.executable).with_name("ddpkit")), "run", config, "--nproc-per-node", "2", *overrides]


def _env(mode: str, directory: Path, faulthandler: bool) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **MODE_ENV.get(mode, {})}
    if mode == "hang":
        env["HANG_STAMP"] = str(directory / "hang-time")
    if faulthandler:
        env["PYTHONFAULTHANDLER"] = "1"
    return env


def _preexec(*, core: bool, cpus: set[int] | None) -> Callable[[], None]:
    """What the launcher (and so every worker) gets before it starts: core dumps on, a CPU set."""

    def prepare() -> None:
        if core:
            resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        if cpus:
            os.sched_setaffinity(0, cpus)

    return prepare


def _signal_when_training(proc: subprocess.Popen, out: Path, deadline: float) -> None:
    """SIGTERM the launcher once a training step is logged (as SLURM or Kubernetes would)."""
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count("train_loss") >= 1:
            proc.send_signal(signal.SIGTERM)
            return
        time.sleep(0.05)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and its workers (torchrun starts each worker in a session of its own)."""
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in [proc.pid, *map(int, workers)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_once(
    mode: str, *, launcher: str, timeout: float, faulthandler: bool, core: bool, cpus: set[int] | None
) -> Result:
    directory = Path(tempfile.mkdtemp(prefix=f"stress-{mode}-"))
    log = directory / "output.txt"
    started = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            _command(mode, directory / "run", launcher),
            cwd=directory,
            env=_env(mode, directory, faulthandler),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_preexec(core=core, cpus=cpus),
        )
        try:
            if mode == "preempt":
                _signal_when_training(proc, directory / "run", started + timeout)
            code: int | None = proc.wait(timeout=max(1.0, started + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(proc)
            code = None
        except BaseException:  # interrupted: leave no launcher behind
            _kill(proc)
            raise
    output = log.read_text(errors="replace")
    aborts = [line.strip() for line in output.splitlines() if any(sign in line for sign in ABORT_SIGNS)]
    return Result(code, time.monotonic() - started, aborts, directory)


def _summary(mode: str, results: list[Result], load: Load) -> str:
    expected = EXPECTED[mode]
    codes: dict[str, int] = {}
    for r in results:
        codes[str(r.code)] = codes.get(str(r.code), 0) + 1
    failed = sum(r.failed(expected) for r in results)
    rows = [
        ("mode", mode),
        ("expected exit", str(expected)),
        ("runs", str(len(results))),
        ("failed", str(failed)),
        ("wrong exit code", str(sum(r.code != expected for r in results))),
        ("runs with abort text", str(sum(bool(r.aborts) for r in results))),
        ("exit codes seen", ", ".join(f"{c}: {n}" for c, n in sorted(codes.items()))),
        ("seconds per run (median)", f"{statistics.median(r.seconds for r in results):.1f}" if results else "-"),
        ("busy-loop processes", str(load.count)),
        ("1-min load average (min / median / max)", _spread(load.samples)),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _spread(samples: list[float]) -> str:
    if not samples:
        return "-"
    return f"{min(samples):.2f} / {statistics.median(samples):.2f} / {max(samples):.2f}"


def _report(i: int, runs: int, result: Result, expected: int, keep: bool) -> None:
    bad = result.failed(expected)
    status = "FAIL" if bad else "ok"
    print(
        f"[{i + 1}/{runs}] {status} exit={result.code} {result.seconds:.1f}s load={os.getloadavg()[0]:.2f}", flush=True
    )
    for line in result.aborts[:5]:
        print(f"    abort: {line}", flush=True)
    if bad and not result.aborts:
        tail = (result.directory / "output.txt").read_text(errors="replace").strip().splitlines()[-3:]
        print("".join(f"    | {line}\n" for line in tail), end="", flush=True)
    if bad or keep:
        print(f"    output kept in {result.directory}", flush=True)
    else:
        shutil.rmtree(result.directory, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20, help="launches, back to back (default 20)")
    parser.add_argument("--mode", choices=sorted(EXPECTED), default="finish", help="how each run ends (default finish)")
    parser.add_argument(
        "--launcher",
        choices=["ddpkit", "torchrun"],
        default="ddpkit",
        help="`ddpkit run` (default) or plain torchrun with examples/train.py (finish mode only)",
    )
    parser.add_argument("--load", type=int, default=2, help="busy-loop processes running meanwhile (default 2)")
    parser.add_argument("--cpus", default=None, help="pin the runs and the load to these CPUs, e.g. 0 (default: all)")
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="seconds before a run counts as stuck and is killed"
    )
    parser.add_argument("--keep", action="store_true", help="keep every run's directory, not only failed ones")
    parser.add_argument("--faulthandler", action="store_true", help="PYTHONFAULTHANDLER=1 in the workers")
    parser.add_argument("--core", action="store_true", help="let the workers dump core into the run's directory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = Load(args.load)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` ends it like Ctrl-C: load and launcher stopped
    results: list[Result] = []
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else None
    load.start(cpus)
    if args.launcher == "torchrun" and args.mode != "finish":
        raise SystemExit("--launcher torchrun: only --mode finish (torchrun's own exit codes differ from ddpkit run's)")
    try:
        for i in range(args.runs):
            result = run_once(
                args.mode,
                launcher=args.launcher,
                timeout=args.timeout,
                faulthandler=args.faulthandler,
                core=args.core,
                cpus=cpus,
            )
            load.sample()
            results.append(result)
            _report(i, args.runs, result, EXPECTED[args.mode], args.keep)
    except KeyboardInterrupt:
        print(f"interrupted after {len(results)} runs", flush=True)
    finally:
        load.stop()
    print(_summary(args.mode, results, load))
    return 1 if any(r.failed(EXPECTED[args.mode]) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
