"""The ``ddpkit`` command line (also ``python -m ddpkit``).

    ddpkit run CONFIG [key=value ...] [--nproc-per-node N] [--max-restarts K]   # launch a training run
    ddpkit run CONFIG --start-method subprocess      # new interpreters per worker (default on the CPU: forked, torch imported)
    ddpkit run CONFIG --nnodes 2 --node-rank 0 --master-addr HOST [--master-port P]
    ddpkit run CONFIG --nnodes 2 --rdzv-endpoint HOST:PORT [--rdzv-id ID]       # elastic rendezvous
    ddpkit train CONFIG [key=value ...]      # one worker; what `run` starts (torchrun -m ddpkit train ...)
    ddpkit config CONFIG [key=value ...]     # print the resolved config
    ddpkit export CHECKPOINT OUT.pt          # plain model state_dict for inference
    ddpkit bench {throughput,allreduce,autotune,scaling} ...
    ddpkit plot RUN_DIR [RUN_DIR ...] [-o out.png]
    ddpkit runs [DIR] [--json]               # table of the runs under DIR (default runs/)
    ddpkit estimate CONFIG --nproc N [--mode M]   # bytes per rank of ddp / zero1 / fsdp2, before a run
    ddpkit goodput RUN_DIR [--json]          # where the run's wall time went: productive, badput by category
    ddpkit tokenize INPUT... -o FILE.bin [--tokenizer tokenizer.json]   # text files to a token file (data.name=tokens)

``run`` validates the config, then starts the workers through torch's own launcher
(``torch.distributed.run``, i.e. torchrun): a free port is chosen by default, ``--max-restarts``
restarts the whole group after a failure (the Trainer resumes from the newest valid
checkpoint), and a failing rank's traceback appears in the launcher's summary.
Exit codes (defined once, in :mod:`ddpkit.errors`; the same from ``ddpkit run``, a worker and ``ddpkit train``):

    0    success
    1    a run or launch failed (a crash, a data or checkpoint error, a rank stopped because a peer failed)
    2    the config or the command line is invalid (nothing was started, or every worker refused it)
    3    the hang watchdog stopped the job (``dist.hang_timeout``; report in ``<output_dir>/logs/hang-*.txt``)
    75   stopped by a signal after saving (``checkpoint.save_on_signals``): run the same command to resume
    130  interrupted with Ctrl-C
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ddpkit.errors import EXIT_CONFIG, EXIT_OK, DdpkitError, LaunchError, exit_code_of
from ddpkit.launch.launcher import default_nproc, exit_at_once, launch, preflight, torchrun_argv

__all__ = ["main", "torchrun_args"]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``ddpkit`` console script."""
    from_command_line = argv is None  # a process of its own: `ddpkit run` may then skip the interpreter's teardown
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        sys.exit(EXIT_OK if argv else EXIT_CONFIG)
    if argv[0] not in commands:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(commands)}")
    if argv[0] in ("bench", "plot", "runs", "goodput", "estimate", "tokenize"):  # these parse their own options
        args = argparse.Namespace(command=argv[0], rest=argv[1:])
    else:
        # Intermixed: options may come before, between or after the key=value overrides.
        args = commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
    code = exit_code_of(lambda: _COMMANDS[args.command](args), command=f"ddpkit {args.command}")
    if from_command_line and args.command == "run":
        exit_at_once(code)  # torch's teardown in the launcher took seconds after the workers had ended
    sys.exit(code)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="ddpkit", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="launch a training run on N processes through torch's launcher")
    _add_config_args(run)
    run.add_argument("--nproc-per-node", "--nproc_per_node", default=None, help="processes per node (default: GPUs per node, or 1 on CPU)")
    run.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic runs (default 1)")
    run.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this node's rank (static rendezvous)")
    run.add_argument("--master-addr", "--master_addr", default=None, help="address of node 0 (static rendezvous)")
    run.add_argument("--master-port", "--master_port", type=int, default=None, help="port on node 0 (default: a free port)")
    run.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, help="HOST:PORT of a c10d rendezvous (instead of --master-addr)")
    run.add_argument("--rdzv-id", "--rdzv_id", default="ddpkit", help="rendezvous id shared by all nodes of one job")
    run.add_argument("--max-restarts", "--max_restarts", type=int, default=0, help="restart the worker group this many times after a failure")
    run.add_argument("--script", default=None, help="run this training script instead of the YAML-driven Trainer")
    run.add_argument("--start-method", "--start_method", choices=("auto", "fork", "subprocess"), default="auto", help=START_METHOD_HELP)

    train = sub.add_parser("train", help="run one training worker (what `ddpkit run` launches)")
    _add_config_args(train)

    config = sub.add_parser("config", help="print the resolved config (file + overrides + defaults)")
    _add_config_args(config)

    export = sub.add_parser("export", help="write a checkpoint's model weights as a plain state_dict")
    export.add_argument("checkpoint", help="a checkpoint (step-*.pt, or a sharded step-*.dcp directory) or a checkpoint directory (newest valid)")
    export.add_argument("output", help="where to write the state_dict (.pt)")

    bench = sub.add_parser("bench", help="benchmarks: throughput, allreduce, autotune, scaling (see `ddpkit bench -h`)")
    plot = sub.add_parser("plot", help="plot metrics of one or more run directories (see `ddpkit plot -h`)")
    runs = sub.add_parser("runs", help="table of the runs under a directory: status, steps, val metrics, best, wall time")
    estimate = sub.add_parser("estimate", help="bytes per rank of each parallel.mode (ddp, zero1, fsdp2) before a run (see `ddpkit estimate -h`)")
    goodput = sub.add_parser("goodput", help="where a run's wall time went: productive training and badput by category")
    tokenize = sub.add_parser("tokenize", help="text files to a token file for data.name=tokens (see `ddpkit tokenize -h`)")
    commands = {"run": run, "train": train, "config": config, "export": export, "bench": bench, "plot": plot, "runs": runs, "goodput": goodput,
                "estimate": estimate, "tokenize": tokenize}
    for name, subparser in commands.items():
        subparser.prog = f"ddpkit {name}"
    return parser, commands


START_METHOD_HELP = (
    "how workers start: forked from the launcher with torch imported (about 2 s faster per start and restart; CPU workers "
    "only, CUDA cannot be used in a forked process) or as new interpreters (default auto: fork on the CPU)"
)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optim.lr=0.1 train.epochs=3")


# --- commands ---------------------------------------------------------------------------------


def _cmd_config(args: argparse.Namespace) -> int:
    from ddpkit.config.loader import dump_config, load_config

    print(dump_config(load_config(args.config, args.overrides)), end="")
    return EXIT_OK


def _cmd_train(args: argparse.Namespace) -> int:
    from ddpkit.launch.entrypoint import run_trainer
    from ddpkit.trainer import Trainer

    run_trainer(Trainer, args.config, args.overrides)
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from ddpkit.config.loader import load_config
    from ddpkit.goodput.ledger import launch_session

    cfg = load_config(args.config, args.overrides)  # fail fast, before starting N processes
    device = preflight(nproc=args.nproc_per_node or str(default_nproc()), backend=cfg.dist.backend, device=cfg.dist.device, precision=cfg.train.precision)
    if args.start_method == "fork" and device != "cpu":
        raise LaunchError(f"--start-method fork: the workers would use {device or 'the devices torchrun counts'}, and CUDA cannot be "
                          "used in a forked process; use --start-method subprocess (or auto), or dist.device=cpu")
    # The agent's grace period after a signal: long enough for the workers to agree, save and exit.
    grace = max(cfg.dist.failure_timeout, cfg.checkpoint.stop_timeout)
    with launch_session(cfg.output_dir):  # goodput.jsonl: the launcher's start and exit count in the wall time
        return launch(torchrun_args(args, failure_timeout=grace, forward_signals=cfg.checkpoint.save_on_signals),
                      fork=args.start_method != "subprocess" and device == "cpu")


def _cmd_export(args: argparse.Namespace) -> int:
    from ddpkit.checkpoint.files import load_checkpoint, save_atomically, validate_checkpoint
    from ddpkit.checkpoint.sharded import export_model, is_sharded_checkpoint
    from ddpkit.distributed.ddp import strip_wrapper_prefixes

    info = validate_checkpoint(args.checkpoint)
    if is_sharded_checkpoint(info.path):  # a DCP directory (parallel.mode zero1 / fsdp2): every rank's shards joined
        model = export_model(info.path)
        save_atomically(model, args.output)
        print(f"wrote {args.output}: {len(model)} tensors from the DCP directory {info.path} (step {info.step})")
        return EXIT_OK
    state = load_checkpoint(info.path)
    if "model" not in state:
        raise DdpkitError(f"{info.path} has no 'model' entry; is it a ddpkit checkpoint?")
    save_atomically(strip_wrapper_prefixes(state["model"]), args.output)  # a file written elsewhere may carry them
    print(f"wrote {args.output}: {len(state['model'])} tensors from {info.path} (step {info.step})")
    return EXIT_OK


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


def _cmd_tokenize(args: argparse.Namespace) -> int:
    from ddpkit.tools.tokenize import main as tokenize_main

    return tokenize_main(args.rest)


_COMMANDS = {
    "run": _cmd_run, "train": _cmd_train, "config": _cmd_config, "export": _cmd_export, "bench": _cmd_bench, "plot": _cmd_plot, "runs": _cmd_runs,
    "goodput": _cmd_goodput, "estimate": _cmd_estimate, "tokenize": _cmd_tokenize,
}


# --- launching through torch.distributed.run -------------------------------------------------------


def torchrun_args(args: argparse.Namespace, *, failure_timeout: float = 10.0, forward_signals: Sequence[str] = ()) -> list[str]:
    """The ``torchrun`` argument list equivalent to a ``ddpkit run`` invocation."""
    program = [args.script] if args.script else ["-m", "ddpkit", "train"]
    return torchrun_argv(
        nproc=args.nproc_per_node or str(default_nproc()), program=[*program, args.config, *args.overrides],
        nnodes=args.nnodes, max_restarts=args.max_restarts, shutdown_timeout=failure_timeout, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        forward_signals=forward_signals,
    )
