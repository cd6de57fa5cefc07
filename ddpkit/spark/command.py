"""``ddpkit spark``: a run as Spark barrier stages from the command line (``ddpkit.spark.run`` underneath).

    ddpkit spark CONFIG [key=value ...] --num-processes N [--max-restarts K] [--script train.py]
                 [--master URL] [--use-gpu auto|yes|no] [--json]
    spark-submit --master spark://host:7077 $(which ddpkit) spark CONFIG --num-processes 8   # the cluster's session
    ddpkit spark configs/quickstart.yaml --num-processes 2 --master 'local-cluster[2,1,1024]'

Without ``--script``, the ranks run the YAML-driven Trainer (``python -m ddpkit train CONFIG ...``), as
``ddpkit run`` does. ``--num-processes`` is the world size (Spark's tasks, TorchDistributor's
``num_processes``), not a count per node: Spark places the tasks. The final metrics go to stdout
(``--json``: one JSON object), the ranks' lines to stderr; the exit code is the job's (``ddpkit.errors``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from ddpkit.config.cli_args import add_config_arguments, plain_text
from ddpkit.errors import EXIT_OK, exit_code_of, exit_code_table

__all__ = ["main"]

USE_GPU = {"auto": None, "yes": True, "no": False}


def main(argv: Sequence[str]) -> int:
    """``ddpkit spark ...``; returns the exit code (2 for a usage error, else the job's)."""
    parser = argparse.ArgumentParser(
        prog="ddpkit spark",
        description=plain_text(__doc__.split("\n\n")[0]),
        epilog=f"exit codes (the job's, from its ranks'):\n{exit_code_table(indent='  ')}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--num-processes", type=int, required=True, help="the world size: one Spark barrier task (and GPU) per rank"
    )
    parser.add_argument("--max-restarts", type=int, default=0, help="start the stage again this many times, resuming")
    parser.add_argument("--script", default=None, help="run this training script instead of the YAML-driven Trainer")
    parser.add_argument("--master", default=None, help="Spark master URL (default: spark-submit's, or Spark's own)")
    parser.add_argument(
        "--use-gpu", choices=tuple(USE_GPU), default="auto", help="one GPU per rank (auto: as Spark schedules)"
    )
    parser.add_argument("--json", action="store_true", help="print the final metrics as JSON on stdout")
    try:
        args = parser.parse_intermixed_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    return exit_code_of(lambda: _spark(args), command="ddpkit spark")


def _spark(args: argparse.Namespace) -> int:
    from ddpkit.config.loader import load_config
    from ddpkit.spark.driver import run_program, session

    load_config(args.config, args.overrides)  # refused here, before a Spark session starts
    program = [args.script] if args.script else ["-m", "ddpkit", "train"]
    spark = session(args.master)
    try:
        metrics = run_program(
            [*program, args.config, *args.overrides],
            num_processes=args.num_processes,
            max_restarts=args.max_restarts,
            use_gpu=USE_GPU[args.use_gpu],
            spark=spark,
        )
    finally:
        spark.stop()
    text = " ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
    print(json.dumps(metrics) if args.json else f"ddpkit spark: done: {text}")
    return EXIT_OK
