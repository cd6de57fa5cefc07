"""Two checkouts of ddpkit side by side: did a change make the loop faster? (fresh processes, alternating)

    git worktree add /tmp/before HEAD~3
    python -m benchmarks.trees --rounds 10 hand=.:hand-written after=.:ddpkit before=/tmp/before:ddpkit
    python -m benchmarks.trees --workload mnist_cnn --steps 300 \\
        hand=.:hand-written after=.:ddpkit before=/tmp/before:ddpkit

Each entry is ``LABEL=TREE:VARIANT``: a variant of ``benchmarks.overhead`` (``hand-written``,
``ddpkit``, ``ddpkit-bare``, ...) run with ``TREE`` first on ``PYTHONPATH``, so ``ddpkit`` (and
``benchmarks``) are imported from that checkout; a checkout from before ``benchmarks/`` was a
package runs its ``scripts/bench_overhead.py`` (``scripts/`` put on the workers' ``PYTHONPATH``).
Every entry of every round is a 2-rank Gloo job of its own (``torchrun``, one thread per rank), the
order rotating each round; the table gives ms/step (median, range), the ratio to the first entry
paired within each round, the extra CPU microseconds per step of the training thread, and in how
many rounds the final weights equal the first entry's bit for bit (``benchmarks.workloads.weights_digest``).
Run it on a quiet machine: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.workloads import REPO, load_printed, paired, rotated, summary, table, weights_digest


def worker(module: str, variant: str, steps: int, workload: str) -> None:
    """One rank of one job: run the variant of ``module`` (the tree's overhead benchmark); rank 0 prints its numbers."""
    from ddpkit.bench.timed import steady_ms_per_step
    from ddpkit.distributed.env import read_dist_env
    from ddpkit.distributed.process_group import process_group

    bench = importlib.import_module(module)
    env, w = read_dist_env(), bench.WORKLOADS[workload]
    workdir = Path(tempfile.gettempdir()) / f"bench-trees-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"
    with process_group(env):
        extra = {"workdir": workdir} if variant.startswith("ddpkit") else {}
        clock, final = bench.VARIANTS[variant](w, w["warmup"] + steps, env.rank, env.world_size, **extra)
    if env.rank == 0:
        wall, cpu = (steady_ms_per_step(times, warmup=w["warmup"]) for times in (clock.wall, clock.cpu))
        print(f"RESULT {wall} {cpu} {weights_digest(final)[:16]}", flush=True)


def run_job(tree: str, variant: str, steps: int, workload: str) -> tuple[float, float, str]:
    root = Path(tree).resolve()
    old_layout = not (root / "benchmarks" / "overhead.py").exists()
    module = "bench_overhead" if old_layout else "benchmarks.overhead"
    # The tree first (its ddpkit, its benchmarks); this checkout after it, for this module when the tree predates it.
    path = [str(root), *([str(root / "scripts")] if old_layout else []), str(REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        __spec__.name,
        "--worker",
        module,
        variant,
        str(steps),
        workload,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tree)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"{variant} from {tree} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    _, wall, cpu, digest = lines[0].split()
    return float(wall), float(cpu), digest


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2], int(argv[3]), argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("entries", nargs="+", help="LABEL=TREE:VARIANT; the first is the reference")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per job (default 1000)")
    parser.add_argument("--workload", default="mlp", help="a workload of benchmarks.workloads (default mlp)")
    args = parser.parse_args(argv)
    entries = []
    for entry in args.entries:
        label, _, spec = entry.partition("=")
        tree, _, variant = spec.rpartition(":")
        if not (label and tree and variant):
            parser.error(f"{entry!r}: expected LABEL=TREE:VARIANT, e.g. after=.:ddpkit")
        entries.append((label, tree, variant))
    runs: dict[str, list[tuple[float, float, str]]] = {label: [] for label, _, _ in entries}
    with load_printed():
        for r in range(args.rounds):
            for label, tree, variant in rotated(entries, r):
                runs[label].append(run_job(tree, variant, args.steps, args.workload))
                print(
                    f"[trees] round {r + 1}/{args.rounds} {label}: {runs[label][-1][0]:.3f} ms/step",
                    file=sys.stderr,
                    flush=True,
                )
        ref, rows = runs[entries[0][0]], []
        for label, own in runs.items():
            walls, cpus, digests = zip(*own)
            ref_walls, ref_cpus, ref_digests = zip(*ref)
            wall, ratio = summary(walls), paired(walls, ref_walls)
            extra_cpu = paired(cpus, ref_cpus, scale=1000, difference=True)
            same = sum(a == b for a, b in zip(digests, ref_digests))
            rows.append(
                [
                    label,
                    f"{wall.median:.3f}",
                    wall.spread(3),
                    f"{ratio.median:.3f}",
                    ratio.spread(3),
                    f"{extra_cpu.median:+.1f}",
                    f"{same}/{len(own)}",
                ]
            )
        print(
            table(
                f"{args.workload}: {args.rounds} rounds x {args.steps} steps, each a fresh 2-rank job",
                ["entry", "ms/step", "min..max", "x ref", "x ref min..max", "CPU us/step vs ref", "bitwise = ref"],
                rows,
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
