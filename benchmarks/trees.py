"""Two checkouts of ddpkit side by side: did a change make the loop faster? (fresh processes, alternating)

    git worktree add /tmp/before HEAD~3
    python scripts/bench_trees.py --rounds 10 hand=.:hand-written after=.:ddpkit before=/tmp/before:ddpkit
    python scripts/bench_trees.py --workload mnist_cnn --steps 300 hand=.:hand-written after=.:ddpkit before=/tmp/before:ddpkit

Each entry is ``LABEL=TREE:VARIANT``: a variant of ``scripts/bench_overhead.py`` (``hand-written``,
``ddpkit``, ``ddpkit-bare``, ...) run with ``TREE`` first on ``PYTHONPATH``, so ``ddpkit`` is imported
from that checkout. Every entry of every round is a 2-rank Gloo job of its own (``torchrun``, one
thread per rank), the order rotating each round; the table gives ms/step (median, range), the ratio
to the first entry paired within each round, the extra CPU microseconds per step of the training
thread, and in how many rounds the final weights equal the first entry's bit for bit. Run it on a
quiet machine: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def worker(tree: str, variant: str, steps: int, workload: str) -> None:
    """One rank of one job: run the variant from ``tree``'s bench_overhead; rank 0 prints its numbers."""
    sys.path.insert(0, str(Path(tree).resolve() / "scripts"))
    import bench_overhead as bench
    import torch

    from ddpkit.bench.timed import steady_ms_per_step
    from ddpkit.distributed.env import read_dist_env
    from ddpkit.distributed.process_group import process_group

    env, w = read_dist_env(), bench.WORKLOADS[workload]
    workdir = Path(tempfile.gettempdir()) / f"bench-trees-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"
    with process_group(env):
        extra = {"workdir": workdir} if variant.startswith("ddpkit") else {}
        clock, final = bench.VARIANTS[variant](w, w["warmup"] + steps, env.rank, env.world_size, **extra)
    if env.rank == 0:
        sha = hashlib.sha256()
        for name, value in sorted(final.items()):
            sha.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
        wall, cpu = (steady_ms_per_step(times, warmup=w["warmup"]) for times in (clock.wall, clock.cpu))
        print(f"RESULT {wall} {cpu} {sha.hexdigest()[:16]}", flush=True)


def run_job(tree: str, variant: str, steps: int, workload: str) -> tuple[float, float, str]:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve()), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(Path(__file__).resolve()), "--worker", tree, variant, str(steps), workload]
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
    parser.add_argument("--workload", default="mlp", help="a workload of scripts/bench_overhead.py (default mlp)")
    args = parser.parse_args(argv)
    entries = []
    for entry in args.entries:
        label, _, spec = entry.partition("=")
        tree, _, variant = spec.rpartition(":")
        if not (label and tree and variant):
            parser.error(f"{entry!r}: expected LABEL=TREE:VARIANT, e.g. after=.:ddpkit")
        entries.append((label, tree, variant))
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    runs: dict[str, list[tuple[float, float, str]]] = {label: [] for label, _, _ in entries}
    for r in range(args.rounds):
        for label, tree, variant in entries[r % len(entries):] + entries[:r % len(entries)]:
            runs[label].append(run_job(tree, variant, args.steps, args.workload))
            print(f"[trees] round {r + 1}/{args.rounds} {label}: {runs[label][-1][0]:.3f} ms/step", file=sys.stderr, flush=True)
    ref = runs[entries[0][0]]
    print(f"{args.workload}: {args.rounds} rounds x {args.steps} steps, each a fresh 2-rank job; "
          f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{'entry':>14}  {'ms/step':>8}  {'min..max':>13}  {'x ref':>6}  {'x ref min..max':>14}  {'CPU us/step vs ref':>18}  bitwise = ref")
    for label, own in runs.items():
        walls = [wall for wall, _, _ in own]
        ratios = [wall / ref_wall for (wall, _, _), (ref_wall, _, _) in zip(own, ref)]
        extra_cpu = [(cpu - ref_cpu) * 1000 for (_, cpu, _), (_, ref_cpu, _) in zip(own, ref)]
        same = sum(digest == ref_digest for (_, _, digest), (_, _, ref_digest) in zip(own, ref))
        print(f"{label:>14}  {statistics.median(walls):8.3f}  {min(walls):6.3f}..{max(walls):6.3f}  {statistics.median(ratios):6.3f}  "
              f"{min(ratios):6.3f}..{max(ratios):6.3f}  {statistics.median(extra_cpu):+18.1f}  {same}/{len(own)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
