"""``ddpkit bench``: the Horovod synthetic-benchmark and nccl-tests habits, for torch users.

    ddpkit bench throughput --model resnet18 --batch-size 32 --nproc-per-node 1,2 [--steps 20] [--precision bf16]
    ddpkit bench allreduce --nproc-per-node 2 --sizes 1KB..256MB [--json] [-o results.json]
    ddpkit bench autotune configs/quickstart.yaml [key=value ...] [--steps 20]
    ddpkit bench scaling configs/quickstart.yaml --predict 8,64,512,1024 [--link 100Gbit] [--latency 5us]

* ``throughput`` (:mod:`ddpkit.bench.throughput`): samples/s per world size on synthetic data
  and the scaling efficiency ``throughput_N / (N x throughput_1)``.
* ``allreduce`` (:mod:`ddpkit.bench.allreduce`): time, algbw and busbw per message size, with
  nccl-tests' definitions, on NCCL or Gloo.
* ``autotune`` (:mod:`ddpkit.bench.autotune`): the fastest ``ddp.bucket_cap_mb`` /
  ``ddp.gradient_as_bucket_view`` for your own config, and the override that selects it.
* ``scaling`` (:mod:`ddpkit.bench.scaling`): the step time and scaling efficiency predicted at 8..1024
  ranks from a one-rank profile of your config and a link model (bandwidth, latency).

Their parts: ``launching`` (a worker on N processes through torch's launcher) and ``worker`` (what
it runs); ``timed`` (a Trainer that timestamps every step); ``scaling_profile`` / ``scaling_model``
(one-rank measurements, and the cost model that predicts from them); ``report`` / ``units`` (tables,
medians, parsing sizes); ``plotting`` / ``scaling_plot`` (the optional matplotlib figures).

Every measurement runs in worker processes started through torch's launcher
(``torch.distributed.run``); tables go to stdout, progress to stderr; with ``--json`` the results go
to stdout as JSON and the tables to stderr, and ``-o FILE.json`` writes them to a file. Exit codes
(ddpkit.errors): 0 success, 1 a failed benchmark, 2 a usage error. The spellings of the previous
release (``--config FILE``, ``--nproc``, ``--json FILE.json``) still work, with a deprecation line.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence

from ddpkit.config.cli_args import OLD_SPELLINGS, plain_text, renamed
from ddpkit.errors import EXIT_CONFIG, EXIT_OK, exit_code_of

__all__ = ["main"]

_COMMANDS = {
    "throughput": "samples/s and scaling efficiency per world size, on synthetic data",
    "allreduce": "allreduce time, algbw and busbw per message size (nccl-tests style)",
    "autotune": "fastest ddp.bucket_cap_mb / gradient_as_bucket_view for your config",
    "scaling": "predicted step time and efficiency at 8..1024 ranks, from a one-rank profile",
}


def main(argv: Sequence[str]) -> int:
    """Run ``ddpkit bench BENCHMARK ...``; return the exit code (argparse exits 2 on bad options)."""
    import importlib

    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        listing = "\n".join(f"  {name:<11} {text}" for name, text in _COMMANDS.items())
        summary = plain_text(__doc__.split("\n\n")[0])
        usage = (
            f"usage: ddpkit bench BENCHMARK [options]\n\n{summary}\n\nbenchmarks:\n{listing}\n\n"
            "`ddpkit bench BENCHMARK -h` shows a benchmark's options."
        )
        # asked for help: stdout, exit 0; no benchmark named: exit 2
        print(usage, file=sys.stdout if argv else sys.stderr)
        return EXIT_OK if argv else EXIT_CONFIG
    name = argv[0]
    if name not in _COMMANDS:
        print(f"ddpkit bench: error: unknown benchmark {name!r}; choose from {', '.join(_COMMANDS)}", file=sys.stderr)
        return EXIT_CONFIG
    module = importlib.import_module(f"ddpkit.bench.{name}")
    parser = argparse.ArgumentParser(
        prog=f"ddpkit bench {name}",
        description=plain_text(module.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    # Intermixed: autotune's key=value overrides may come before, between or after the options.
    args = parser.parse_intermixed_args(renamed(argv[1:], OLD_SPELLINGS, prog=f"ddpkit bench {name}"))
    if not args.json:
        return exit_code_of(lambda: module.run(args), command=f"ddpkit bench {name}")
    # report.emit_results prints the JSON there; the tables go to stderr
    args.json_stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        return exit_code_of(lambda: module.run(args), command=f"ddpkit bench {name}")
