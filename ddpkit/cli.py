"""The ``ddpkit`` command line (also ``python -m ddpkit``).

    ddpkit run CONFIG [key=value ...] [--nproc-per-node N] [--max-restarts K]   # launch a training run
    ddpkit run CONFIG --worker-start subprocess      # new interpreters per worker
                                                     # (default on the CPU: forked, torch imported)
    ddpkit run CONFIG --nnodes 2 --node-rank 0 --master-addr HOST [--master-port P]
    ddpkit run CONFIG --nnodes 2 --rdzv-endpoint HOST:PORT [--rdzv-id ID]       # elastic rendezvous
    ddpkit run CONFIG -- --local-ranks-filter 0 --log-dir logs   # after `--`: torchrun's own options, unchanged
    ddpkit train CONFIG [key=value ...]      # one worker; what `run` starts (torchrun -m ddpkit train ...)
    ddpkit config CONFIG [key=value ...]     # print the resolved config
    ddpkit config --schema [-o FILE.json]    # the config's JSON Schema, for editors (yaml-language-server)
    ddpkit export CHECKPOINT OUT.safetensors # model weights for inference: safetensors,
                                             # or a torch state_dict for OUT.pt
    ddpkit export RUN_OR_CHECKPOINT DIR --format hf   # a gpt model as a Hugging Face directory (--merge: LoRA)
    ddpkit export RUN_OR_CHECKPOINT DIR --format peft # a LoRA run's adapter, for peft.PeftModel.from_pretrained
    ddpkit generate RUN_OR_CHECKPOINT --prompt TEXT    # sample text from a trained language model, streamed
    ddpkit bench {throughput,allreduce,autotune,scaling} ...
    ddpkit plot RUN_DIR [RUN_DIR ...] [-o out.png]
    ddpkit runs [DIR] [--json]               # table of the runs under DIR (default runs/)
    ddpkit estimate CONFIG --nproc-per-node N [--mode M]   # bytes per rank of ddp / zero1 / fsdp2, before a run
    ddpkit goodput RUN_DIR [--json]          # where the run's wall time went: productive, badput by category
    ddpkit tokenize INPUT... -o FILE.bin [--tokenizer tokenizer.json]   # text files to a token file (data.name=tokens)
    ddpkit tokenize --chat FILE.jsonl -o sft.bin [--skip-bad]   # chat lines to tokens + sft.mask (trained tokens)
    ddpkit env [--json]                      # versions, devices, variables and extras, for a bug report
    ddpkit spark CONFIG [key=value ...] --num-processes N [--max-restarts K] [--master URL]   # Spark barrier stages
    ddpkit --version

One style throughout: CONFIG is the first argument, ``--nproc-per-node`` counts processes, ``--json``
prints JSON on stdout and ``-o`` writes a file, usage errors go to stderr with exit code 2. The previous
release's spellings (``--start-method``, ``--nproc``, ``bench --config``, ``bench --json FILE``) still work
for one release, with a deprecation line (:mod:`ddpkit.config.cli_args`).

``run`` validates the config, then starts the workers through torch's own launcher
(``torch.distributed.run``, i.e. torchrun): a free port is chosen by default, ``--max-restarts``
restarts the whole group after a failure (the Trainer resumes from the newest valid
checkpoint), and a failing rank's traceback appears in the launcher's summary. Everything after
``--`` goes to torchrun as it is, after torchrun's own parser accepted it (a typo exits 2 with its message).
Exit codes (``ddpkit.errors.EXIT_CODES``; the same from ``ddpkit run``, a worker and ``ddpkit train``):

    0    success                                         done
    1    failed: a crash, a lost peer, I/O               retry (resumes)
    2    refused: invalid config, data, usage or launch  fail: fix it
    3    the hang watchdog stopped the job               retry (resumes)
    4    unhealthy: NaN/Inf steps, diverged replicas     fail: would repeat
    75   stopped by a signal after saving                requeue (resumes); run.requeue_exit_code sets it
    130  interrupted with Ctrl-C                         stop
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ddpkit._version import __version__
from ddpkit.config.cli_args import OLD_SPELLINGS, add_config_arguments, plain_text, renamed
from ddpkit.errors import EXIT_CONFIG, EXIT_OK, ConfigError, check_requeue_exit_code, exit_code_of, exit_code_table
from ddpkit.launch.launcher import default_nproc, exit_at_once, launch, preflight, torchrun_argv

if TYPE_CHECKING:
    from ddpkit.config.schema import Config

__all__ = ["main", "torchrun_args"]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``ddpkit`` console script."""
    # A process of its own: `ddpkit run` may then skip the interpreter's teardown.
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        # Asked for: stdout, exit 0; no command: a usage error.
        parser.print_help(file=sys.stdout if argv else sys.stderr)
        sys.exit(EXIT_OK if argv else EXIT_CONFIG)
    if argv[0] in ("--version", "-V"):
        print(f"ddpkit {__version__}")
        sys.exit(EXIT_OK)
    if argv[0] not in commands:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(commands)}")
    if argv[0] in OWN_PARSERS:
        args = argparse.Namespace(command=argv[0], rest=argv[1:])
    else:
        # Intermixed: options may come before, between or after the key=value overrides;
        # `--` ends them (run: torchrun's follow).
        rest, passthrough = _split_at_dashes(argv[1:]) if argv[0] == "run" else (argv[1:], [])
        rest = renamed(rest, OLD_SPELLINGS, prog=f"ddpkit {argv[0]}")
        args = commands[argv[0]].parse_intermixed_args(rest)
        args.command = argv[0]
        args.torchrun = passthrough
    code = exit_code_of(lambda: _COMMANDS[args.command](args), command=f"ddpkit {args.command}")
    if from_command_line and args.command == "run":
        # torch's teardown in the launcher took seconds after the workers had ended.
        exit_at_once(code)
    sys.exit(code)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="ddpkit",
        description=plain_text(__doc__.split("\n\n")[0]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"exit codes (ddpkit.errors.EXIT_CODES):\n{exit_code_table(indent='  ')}",
    )
    parser.add_argument("-V", "--version", action="version", version=f"ddpkit {__version__}")
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser(
        "run", help=RUN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter, usage=RUN_USAGE, epilog=RUN_EPILOG
    )
    _add_config_args(run)
    _add_run_args(run)

    train = sub.add_parser("train", help="run one training worker (what `ddpkit run` launches)")
    _add_config_args(train)

    config = sub.add_parser(
        "config", usage=CONFIG_USAGE, help="print the resolved config (file + overrides + defaults), or its JSON Schema"
    )
    config.add_argument("config", nargs="?", metavar="CONFIG", help="YAML config file")
    config.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optim.lr=0.1 train.epochs=3"
    )
    config.add_argument(
        "--schema", action="store_true", help="print the JSON Schema of every config (for editors) instead"
    )
    config.add_argument(
        "-o", "--output", default=None, metavar="FILE.json", help="with --schema: write it to this file"
    )

    export = sub.add_parser(
        "export",
        help="write a checkpoint's model weights: safetensors (OUT.safetensors) or a torch state_dict (OUT.pt)",
    )
    _add_export_args(export)

    commands = {"run": run, "train": train, "config": config, "export": export}
    commands.update({name: sub.add_parser(name, help=text) for name, text in OWN_PARSERS.items()})
    for name, subparser in commands.items():
        subparser.prog = f"ddpkit {name}"
    return parser, commands


def _add_run_args(run: argparse.ArgumentParser) -> None:
    """``ddpkit run``'s own options (the config arguments come from :func:`_add_config_args`)."""
    run.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        default=None,
        help="processes per node (default: GPUs per node, or 1 on CPU)",
    )
    run.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic runs (default 1)")
    run.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this node's rank (static rendezvous)")
    run.add_argument("--master-addr", "--master_addr", default=None, help="address of node 0 (static rendezvous)")
    run.add_argument(
        "--master-port", "--master_port", type=int, default=None, help="port on node 0 (default: a free port)"
    )
    run.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        help="HOST:PORT of a c10d rendezvous (instead of --master-addr)",
    )
    run.add_argument("--rdzv-id", "--rdzv_id", default="ddpkit", help="rendezvous id shared by all nodes of one job")
    run.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="restart the worker group this many times after a failure",
    )
    run.add_argument("--script", default=None, help="run this training script instead of the YAML-driven Trainer")
    run.add_argument("--worker-start", choices=("auto", "fork", "subprocess"), default="auto", help=WORKER_START_HELP)


def _add_export_args(export: argparse.ArgumentParser) -> None:
    """``ddpkit export``'s arguments: what to read, where to write, and in which format."""
    export.add_argument(
        "checkpoint",
        help="a checkpoint (step-*.pt, or a sharded step-*.dcp directory) or a checkpoint directory (newest valid)",
    )
    export.add_argument(
        "output", help="where to write the weights; the extension picks the format: .safetensors, else torch.save's .pt"
    )
    export.add_argument(
        "--format",
        choices=("auto", "hf", "peft"),
        default="auto",
        help="hf: a gpt model (from a run directory or checkpoint) as a Hugging Face directory OUTPUT; "
        "peft: a LoRA run's adapter as peft's adapter_model.safetensors + adapter_config.json",
    )
    export.add_argument("--merge", action="store_true", help="with --format hf: a LoRA adapter merged into its base")


# Commands that parse their own options (main() hands them the rest of argv), with their one-line help.
OWN_PARSERS = {
    "bench": "benchmarks: throughput, allreduce, autotune, scaling (see ddpkit bench -h)",
    "plot": "plot metrics of one or more run directories (see ddpkit plot -h)",
    "runs": "table of the runs under a directory: status, steps, val metrics, best, wall time",
    "estimate": "bytes per rank of each parallel.mode (ddp, zero1, fsdp2) before a run (see ddpkit estimate -h)",
    "goodput": "where a run's wall time went: productive training and badput by category",
    "tokenize": "text files (or --chat lines, with a mask) to a token file for data.name=tokens (ddpkit tokenize -h)",
    "env": "versions, devices, variables and extras, to paste into a bug report",
    "generate": "sample text from a trained language model, printed as it comes (see ddpkit generate -h)",
    "spark": "run on Spark: one barrier task per rank, restarted and resumed after a failure (ddpkit spark -h)",
}
RUN_HELP = "launch a training run on N processes through torch's launcher"
RUN_USAGE = "ddpkit run CONFIG [key=value ...] [options] [-- TORCHRUN_OPTION ...]"
RUN_EPILOG = f"""after `--`: torchrun's own options, passed on unchanged and checked by torchrun's parser; e.g.
  ddpkit run CONFIG --nnodes 2 --rdzv-endpoint HOST:29400 -- --rdzv-conf join_timeout=900 --local-addr 10.0.0.5
  ddpkit run CONFIG --nproc-per-node 4 -- --log-dir logs/torchrun --tee 3 --local-ranks-filter 0

exit codes (ddpkit.errors.EXIT_CODES; README "Exit codes"):
{exit_code_table(indent="  ")}
"""


def _split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """``[... , "--", TORCHRUN...]`` -> (what ddpkit parses, torchrun's options as given)."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


WORKER_START_HELP = (
    "how workers start: forked from the launcher with torch imported (about 2 s faster per start and restart; CPU "
    "workers only, CUDA cannot be used in a forked process) or as new interpreters (default auto: fork on the CPU); "
    "was --start-method, which is torchrun's flag for something else"
)
CONFIG_USAGE = "ddpkit config CONFIG [key=value ...]\n       ddpkit config --schema [-o FILE.json]"


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


# --- commands ---------------------------------------------------------------------------------


def _cmd_config(args: argparse.Namespace) -> int:
    from ddpkit.config.loader import load_config
    from ddpkit.config.serialize import dump_config

    if args.schema:
        return _write_schema(args.output)
    if args.config is None:
        raise ConfigError("CONFIG is required (or --schema for the JSON Schema); see ddpkit config -h")
    # The resolved config on stdout; a replaced override's warning line on stderr, as a run would say it.
    print(dump_config(load_config(args.config, args.overrides, log_replaced=True)), end="")
    return EXIT_OK


def _write_schema(output: str | None) -> int:
    import json

    from ddpkit.atomic import write_atomically
    from ddpkit.config.json_schema import config_schema

    text = json.dumps(config_schema(), indent=1) + "\n"
    if output is None:
        print(text, end="")
    else:
        write_atomically(output, text)
        print(f"wrote {output}", file=sys.stderr)
    return EXIT_OK


def _cmd_train(args: argparse.Namespace) -> int:
    from ddpkit.launch.entrypoint import run_trainer
    from ddpkit.trainer import Trainer

    run_trainer(Trainer, args.config, args.overrides)
    return EXIT_OK


def _check_layout_before_spawning(cfg: Config, *, nproc: str, nnodes: str, device: str | None) -> None:
    """The layout's degrees against the world size, the model's widths against the tensor degree, and each rank's
    share of the model against its device's memory, refused here (exit 2, the valid layouts named) rather than in
    every worker once spawned. The world size's checks are skipped when torchrun counts the processes or the node
    count is elastic (``MIN:MAX``): the world size is known only then."""
    import torch

    from ddpkit.config.layout import check_layout
    from ddpkit.parallel.parallelize import check_tensor_degree
    from ddpkit.training.footprint import refuse_before_spawning

    known = nproc.isdigit() and nnodes.isdigit()
    if known:
        check_layout(cfg.parallel, world_size=int(nproc) * int(nnodes))
    check_tensor_degree(cfg)
    if known and device is not None:
        on = torch.device(device, 0) if device == "cuda" else torch.device(device)
        refuse_before_spawning(cfg, world_size=int(nproc) * int(nnodes), local_world_size=int(nproc), device=on)


def _cmd_run(args: argparse.Namespace) -> int:
    from ddpkit.config.loader import load_config
    from ddpkit.goodput.ledger import launch_session

    # Fail fast, before starting N processes.
    cfg = load_config(args.config, args.overrides)
    device = preflight(
        nproc=args.nproc_per_node or str(default_nproc()),
        backend=cfg.dist.backend,
        device=cfg.dist.device,
        precision=cfg.train.precision,
    )
    _check_layout_before_spawning(
        cfg, nproc=args.nproc_per_node or str(default_nproc()), nnodes=args.nnodes, device=device
    )
    # A refused launch (exit 2): a retry will not fix it.
    if args.worker_start == "fork" and device != "cpu":
        raise ConfigError(
            f"--worker-start fork: the workers would use {device or 'the devices torchrun counts'}, "
            "and CUDA cannot be used in a forked process; use --worker-start subprocess (or auto), "
            "or dist.device=cpu"
        )
    # The agent's grace period after a signal: long enough for the workers to agree, save and exit.
    grace = max(cfg.dist.failure_timeout, cfg.checkpoint.stop_timeout)
    # What a signal-stopped, saved run exits with.
    requeue = check_requeue_exit_code(cfg.run.requeue_exit_code)
    # goodput.jsonl: the launcher's start and exit count in the wall time.
    with launch_session(cfg.output_dir):
        return launch(
            torchrun_args(args, failure_timeout=grace, forward_signals=cfg.checkpoint.save_on_signals),
            fork=args.worker_start != "subprocess" and device == "cpu",
            requeue_exit_code=requeue,
        )


def _cmd_export(args: argparse.Namespace) -> int:
    from ddpkit.tools.export import export

    if args.format in ("hf", "peft"):
        from ddpkit.tools.hf_export import export_hf, export_peft

        if args.format == "peft":
            print(export_peft(args.checkpoint, args.output))
        else:
            print(export_hf(args.checkpoint, args.output, merge=args.merge))
        return EXIT_OK

    print(export(args.checkpoint, args.output))
    return EXIT_OK


def _cmd_env(args: argparse.Namespace) -> int:
    from ddpkit.tools.env_report import main as env_main

    return env_main(args.rest)


def _cmd_bench(args: argparse.Namespace) -> int:
    from ddpkit.bench import main as bench_main

    return bench_main(args.rest)


def _cmd_plot(args: argparse.Namespace) -> int:
    from ddpkit.tools.plot import main as plot_main

    return plot_main(args.rest)


def _cmd_runs(args: argparse.Namespace) -> int:
    from ddpkit.tools.runs import main as runs_main

    return runs_main(args.rest)


def _cmd_estimate(args: argparse.Namespace) -> int:
    from ddpkit.tools.estimate import main as estimate_main

    return estimate_main(args.rest)


def _cmd_goodput(args: argparse.Namespace) -> int:
    from ddpkit.tools.goodput import main as goodput_main

    return goodput_main(args.rest)


def _cmd_generate(args: argparse.Namespace) -> int:
    from ddpkit.tools.generate import main as generate_main

    return generate_main(args.rest)


def _cmd_spark(args: argparse.Namespace) -> int:
    from ddpkit.spark.command import main as spark_main

    return spark_main(args.rest)


def _cmd_tokenize(args: argparse.Namespace) -> int:
    from ddpkit.tools.tokenize import main as tokenize_main

    return tokenize_main(args.rest)


_COMMANDS = {
    "run": _cmd_run,
    "train": _cmd_train,
    "config": _cmd_config,
    "export": _cmd_export,
    "bench": _cmd_bench,
    "plot": _cmd_plot,
    "runs": _cmd_runs,
    "goodput": _cmd_goodput,
    "estimate": _cmd_estimate,
    "tokenize": _cmd_tokenize,
    "env": _cmd_env,
    "generate": _cmd_generate,
    "spark": _cmd_spark,
}


# --- launching through torch.distributed.run -------------------------------------------------------


def torchrun_args(
    args: argparse.Namespace, *, failure_timeout: float = 10.0, forward_signals: Sequence[str] = ()
) -> list[str]:
    """The ``torchrun`` argument list equivalent to a ``ddpkit run`` invocation."""
    program = [args.script] if args.script else ["-m", "ddpkit", "train"]
    return torchrun_argv(
        nproc=args.nproc_per_node or str(default_nproc()),
        program=[*program, args.config, *args.overrides],
        nnodes=args.nnodes,
        max_restarts=args.max_restarts,
        shutdown_timeout=failure_timeout,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        forward_signals=forward_signals,
        extra=getattr(args, "torchrun", ()),
    )
