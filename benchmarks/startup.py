"""What ddpkit costs before training starts: import time and time to the first step.

    python -m benchmarks.startup                    # both parts, 5 alternated rounds (~3 min on 2 cores)
    python -m benchmarks.startup --rounds 3 --skip-first-step

1. **Import time.** ``python -X importtime -c "import torch"`` and ``... "import ddpkit"`` in
   alternation. Reported: the cumulative import time of ``ddpkit`` minus that of ``torch`` inside
   the same ``import ddpkit`` process (what ddpkit adds; the issue's budget is 100 ms), the
   difference between the two processes' totals, and the modules ``import ddpkit`` loads that
   ``import torch`` does not, by their own import time.
2. **Time to first step.** The same small job (a classic MNIST-style CNN on random 28x28 data, 2
   Gloo ranks, batch 64 per rank, SGD) written as a plain hand-written DDP script and as a ddpkit
   Trainer script, each started by the same launcher (``python -m torch.distributed.run
   --standalone --nproc-per-node 2``), plus the ddpkit script started by ``ddpkit run CONFIG
   --script``. Measured: seconds from starting the launcher to the end of rank 0's first
   optimizer step. The issue's budget: ddpkit within 1 s of the hand-written script.

This module is also the worker: launched with ``BENCH_STARTUP_VARIANT`` set it trains, and the
hand-written variant imports nothing from ddpkit (``benchmarks.workloads.train_by_hand`` loads torch
only). Workers find the ``benchmarks`` package through ``PYTHONPATH`` (``benchmarks.workloads.child_env``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# torch only: see its docstring
from benchmarks.workloads import child_env, load_printed, loader_for, paired, summary, table, train_by_hand

SEED, BATCH, STEPS = 0, 64, 3


# --- the two training scripts (worker side) -------------------------------------------------------


def make_model():  # the classic MNIST CNN, as a user would write it
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 10, 5),
        nn.MaxPool2d(2),
        nn.ReLU(),
        nn.Conv2d(10, 20, 5),
        nn.Dropout2d(),
        nn.MaxPool2d(2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(320, 50),
        nn.ReLU(),
        nn.Dropout(),
        nn.Linear(50, 10),
    )


def make_data(world_size: int):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(SEED)
    count = 8 * BATCH * world_size
    return TensorDataset(torch.randn(count, 1, 28, 28, generator=g), torch.randint(0, 10, (count,), generator=g))


def first_step_done() -> None:
    Path(os.environ["BENCH_STARTUP_OUT"]).write_text(repr(time.time()))


def hand_written() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    train_set, model = make_data(world_size), make_model()

    def first_step(step: int) -> None:
        if step == 1 and rank == 0:
            first_step_done()

    train_by_hand(
        model,
        loader_for(train_set, rank, world_size),
        rank=rank,
        world_size=world_size,
        max_steps=STEPS,
        on_step=first_step,
    )
    dist.destroy_process_group()


def ddpkit_script() -> None:
    import ddpkit

    class StartupTrainer(ddpkit.Trainer):
        def build_model(self):
            return make_model()

        def build_datasets(self):
            return make_data(self.world_size), None

        def on_step_end(self, step: int) -> None:
            if step == 1 and self.is_main:
                first_step_done()

    StartupTrainer.main()


# --- the driver --------------------------------------------------------------------------------------


CONFIG = f"""\
run: {{name: startup, seed: {SEED}}}
data: {{batch_size: {BATCH}}}
optim: {{name: sgd, lr: 0.01, momentum: 0.9}}
train: {{epochs: 1, max_steps: {STEPS}}}
checkpoint: {{every_epochs: null, resume: none}}
log: {{progress_bar: false}}
"""


def import_times(python: str, rounds: int) -> dict[str, list]:
    """Per round: ddpkit's cumulative minus torch's inside ``import ddpkit``, the two totals, CPU times."""
    out: dict[str, list] = {"added_ms": [], "torch_ms": [], "ddpkit_ms": [], "cpu_added_ms": [], "extra_modules": {}}
    for r in range(rounds):
        order = ["torch", "ddpkit"] if r % 2 == 0 else ["ddpkit", "torch"]
        runs = {name: _importtime(python, name) for name in order}
        (ddpkit_run, ddpkit_cpu), (torch_run, torch_cpu) = runs["ddpkit"], runs["torch"]
        out["added_ms"].append((ddpkit_run["ddpkit"][1] - ddpkit_run["torch"][1]) / 1000)
        out["torch_ms"].append(torch_run["torch"][1] / 1000)
        out["ddpkit_ms"].append(ddpkit_run["ddpkit"][1] / 1000)
        out["cpu_added_ms"].append((ddpkit_cpu - torch_cpu) * 1000)
        for name, (self_us, _) in ddpkit_run.items():
            if name not in torch_run:
                out["extra_modules"].setdefault(name, []).append(self_us / 1000)
    return out


def _importtime(python: str, module: str) -> tuple[dict[str, tuple[int, int]], float]:
    """``{module: (self_us, cumulative_us)}`` from ``python -X importtime -c "import MODULE"``, and its CPU seconds."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [python, "-X", "importtime", "-c", f"import {module}"], capture_output=True, text=True, check=True
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    table = {}
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "self [us]" not in line:
            self_us, cumulative_us, name = line[len("import time:") :].split("|")
            table[name.strip()] = (int(self_us), int(cumulative_us))
    return table, cpu


def time_to_first_step(python: str, script: Path, rounds: int, workdir: Path) -> dict[str, list[float]]:
    """Seconds from starting the launcher to rank 0's first optimizer step, per variant and round."""
    config = workdir / "startup.yaml"
    config.write_text(
        CONFIG.replace(
            "run: {name: startup, seed: 0}", f"run: {{name: startup, seed: {SEED}, output_dir: {workdir / 'run'}}}"
        )
    )
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    commands = {
        "hand-written (torchrun)": ("hand", [*torchrun, "-m", __spec__.name]),
        "ddpkit Trainer (torchrun)": ("ddpkit", [*torchrun, "-m", __spec__.name, str(config)]),
        "ddpkit Trainer (ddpkit run --script)": (
            "ddpkit",
            [python, "-m", "ddpkit", "run", str(config), "--nproc-per-node", "2", "--script", str(script)],
        ),
    }
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    names = list(commands)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            variant, argv = commands[name]
            marker = workdir / "first-step.txt"
            marker.unlink(missing_ok=True)
            env = child_env(BENCH_STARTUP_VARIANT=variant, BENCH_STARTUP_OUT=str(marker), OMP_NUM_THREADS="1")
            start = time.time()
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            if done.returncode != 0 or not marker.exists():
                raise SystemExit(
                    f"{name} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
                )
            seconds[name].append(float(marker.read_text()) - start)
            print(
                f"[startup] round {r + 1}/{rounds} {name}: first step after {seconds[name][-1]:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    return seconds


def import_report(python: str, rounds: int) -> str:
    t = import_times(python, rounds)
    keys = ("added_ms", "torch_ms", "ddpkit_ms", "cpu_added_ms")
    added, torch_ms, ddpkit_ms, cpu_added = (summary(t[k]) for k in keys)
    extra = sorted(((summary(v).median, k) for k, v in t["extra_modules"].items()), reverse=True)
    return table(
        f"import time, {rounds} alternated rounds (python -X importtime):",
        ["measure", "median ms", "min..max"],
        [
            ["import torch (alone)", f"{torch_ms.median:.1f}", torch_ms.spread(1)],
            ["import ddpkit (total)", f"{ddpkit_ms.median:.1f}", ddpkit_ms.spread(1)],
            ["ddpkit minus torch, same process", f"{added.median:.1f}", added.spread(1)],
            ["process CPU time, ddpkit minus torch (paired)", f"{cpu_added.median:.1f}", cpu_added.spread(1)],
        ],
    ) + (
        f"\nbudget: ddpkit adds <= 100 ms: {'met' if added.median <= 100 else 'NOT met'}; "
        f"{len(extra)} modules not imported by torch, largest self times: "
        + ", ".join(f"{name} {ms:.1f} ms" for ms, name in extra[:8])
    )


def first_step_report(python: str, rounds: int) -> str:
    with tempfile.TemporaryDirectory(prefix="ddpkit-startup-") as tmp:
        seconds = time_to_first_step(python, Path(__file__).resolve(), rounds, Path(tmp))
    hand, rows = seconds["hand-written (torchrun)"], []
    for name, values in seconds.items():
        s, diff = summary(values), paired(values, hand, difference=True)
        rows.append([name, f"{s.median:.2f}", s.spread(2), f"{diff.median:+.2f}", diff.spread(2)])
    title = f"\ntime to first step (launcher start -> end of rank 0's first step), 2 ranks, {rounds} alternated rounds:"
    return table(title, ["script", "median s", "min..max", "vs hand (paired) s", "vs hand min..max"], rows)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    parser.add_argument("--skip-imports", action="store_true", help="skip the import-time part")
    parser.add_argument("--skip-first-step", action="store_true", help="skip the time-to-first-step part")
    args = parser.parse_args(argv)
    with load_printed():
        if not args.skip_imports:
            print(import_report(sys.executable, args.rounds), flush=True)
        if not args.skip_first_step:
            print(first_step_report(sys.executable, args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    variant = os.environ.get("BENCH_STARTUP_VARIANT")
    if variant == "hand":
        hand_written()
    elif variant == "ddpkit":
        ddpkit_script()
    else:
        sys.exit(main(sys.argv[1:]))
