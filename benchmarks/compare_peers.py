"""ddpkit against a hand-written DDP loop, Lightning Fabric, Accelerate and the Lightning Trainer.

    python -m benchmarks.compare_peers                       # MLP and MNIST CNN, 2 Gloo ranks, 5 fresh rounds
    python -m benchmarks.compare_peers --workloads mlp --rounds 7 --steps 1000
    python -m benchmarks.compare_peers --in-process          # all systems in one job (faster, shares one heap)

The same workload in every system (model, synthetic data, seed, SGD with momentum, per-rank batch 64,
2 Gloo ranks with one thread each), each with its own defaults, in alternating rounds whose order
rotates; the table gives ms/step (median, range), the ratio to the hand-written loop paired within
each round (median, range), the extra CPU microseconds per step of the training thread, and whether
the final weights equal the hand-written loop's bit for bit. By default every system of every round
runs in new processes, as users run them (``--fresh`` of ``benchmarks.overhead``, which does the
work). The peers are optional: one that is not installed is skipped with a note, e.g.::

    pip install lightning accelerate        # or, beside the project: pip install --target DIR ...; PYTHONPATH=DIR

The machine should be quiet (nothing else running: the load average is printed before and after).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import overhead  # the workloads, the variants and the table
from benchmarks.workloads import load_printed

SYSTEMS = ["ddpkit", "fabric", "accelerate", "lightning"]  # the hand-written loop is always run


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="mlp,mnist_cnn", help="comma list (default mlp,mnist_cnn)")
    parser.add_argument("--rounds", default="5", help="alternated rounds (default 5)")
    parser.add_argument("--steps", default=None, help="timed steps per run (default: the workload's)")
    parser.add_argument(
        "--in-process", action="store_true", help="every system in one job instead of new processes per run"
    )
    args = parser.parse_args(argv)
    forwarded = ["--workloads", args.workloads, "--rounds", args.rounds, "--variants", ",".join(SYSTEMS)]
    forwarded += ["--steps", args.steps] if args.steps else []
    forwarded += [] if args.in_process else ["--fresh"]
    with load_printed():
        return overhead.main(forwarded)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
