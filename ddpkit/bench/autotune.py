"""``ddpkit bench autotune``: find the fastest DDP bucket settings for your own config.

    ddpkit bench autotune configs/quickstart.yaml [key=value ...] [--steps 20] [--nproc-per-node 2]
    ddpkit bench autotune my.yaml --bucket-caps 1,4,16,64 --bucket-view both --rounds 3

Like Horovod's autotune for its fusion buffer: the Trainer runs your config (with your
``key=value`` overrides) for ``--warmup`` + ``--steps`` optimizer steps once per candidate
``ddp.bucket_cap_mb`` x ``ddp.gradient_as_bucket_view``, all candidates in one job of
``--nproc-per-node`` ranks started through torch's launcher. The candidates are measured in alternation
for ``--rounds`` rounds (the order reversed every other round), so slow drifts of a shared
machine hit them all alike. The table reports each candidate's median ms/step; the fastest
is printed with the ``key=value`` override that selects it.

Only training steps are timed: checkpoints, resume and mid-run validation are switched off for
these runs, and each run writes to a temporary directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ddpkit.bench.launching import run_workers
from ddpkit.bench.report import Stats, emit_results, fmt, format_table, progress
from ddpkit.bench.timed import TimedTrainer, benchmark_overrides, steady_ms_per_step
from ddpkit.bench.units import BenchUsageError, parse_floats, parse_nproc
from ddpkit.config.cli_args import add_config_arguments, add_output_arguments
from ddpkit.distributed.process_group import Runtime

__all__ = ["add_arguments", "run", "worker", "candidates"]

DEFAULT_BUCKET_CAPS = "1,5,10,25,50,100"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, config_help="your YAML config")
    parser.add_argument(
        "--steps", type=int, default=20, help="timed optimizer steps per candidate and round (default 20)"
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them (default 5)")
    parser.add_argument("--nproc-per-node", default="2", help="ranks to tune for (default 2; DDP needs at least 2)")
    parser.add_argument(
        "--bucket-caps",
        default=DEFAULT_BUCKET_CAPS,
        help=f"ddp.bucket_cap_mb values to try (default {DEFAULT_BUCKET_CAPS}; your config's value is added)",
    )
    parser.add_argument(
        "--bucket-view",
        choices=["both", "true", "false"],
        default="both",
        help="ddp.gradient_as_bucket_view values to try (default both)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds; medians are reported (default 2)")
    add_output_arguments(parser)


def candidates(caps: list[float], views: list[bool]) -> list[tuple[float, bool]]:
    """Every ``(bucket_cap_mb, gradient_as_bucket_view)`` pair, caps ascending."""
    return [(cap, view) for cap in sorted(set(caps)) for view in views]


def run(args: argparse.Namespace) -> int:
    """Validate, run every candidate in one launched job, print the table and the best override."""
    from ddpkit.config.loader import load_config

    # A bad config fails here, before any process starts
    cfg = load_config(args.config, args.overrides)
    (nproc,) = _one(parse_nproc(args.nproc_per_node, minimum=2), "--nproc-per-node")
    for option, value in (("--steps", args.steps), ("--rounds", args.rounds)):
        if value < 1:
            raise BenchUsageError(f"{option}: {value} must be at least 1")
    if args.warmup < 0:
        raise BenchUsageError(f"--warmup: {args.warmup} must be 0 or more")
    views = {"both": [False, True], "true": [True], "false": [False]}[args.bucket_view]
    # ddp.bucket_cap_mb: null is torch's default, 25 MiB per bucket (only its first bucket is smaller).
    config_cap = cfg.ddp.bucket_cap_mb if cfg.ddp.bucket_cap_mb is not None else 25.0
    pairs = candidates([*parse_floats(args.bucket_caps, option="--bucket-caps"), config_cap], views)
    progress(
        f"[autotune] {len(pairs)} candidates x {args.rounds} round(s), "
        f"{args.warmup}+{args.steps} steps each, on {nproc} processes ..."
    )
    params = {
        "config": str(Path(args.config).resolve()),
        "overrides": list(args.overrides),
        "pairs": pairs,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
    }
    result = run_workers("autotune", params, nproc=nproc, threads=None)
    _report(args, pairs, result["ms"], current=(config_cap, cfg.ddp.gradient_as_bucket_view), nproc=nproc)
    return 0


def _report(
    args: argparse.Namespace,
    pairs: list[tuple[float, bool]],
    ms: list[list[float]],
    *,
    current: tuple[float, bool],
    nproc: int,
) -> None:
    """The table of candidates, the fastest one, and the override that selects it (and ``--json`` / ``-o``)."""
    stats = [Stats.of(values) for values in ms]
    best = min(range(len(pairs)), key=lambda i: stats[i].median)
    rows = []
    for i, ((cap, view), s) in enumerate(zip(pairs, stats)):
        note = ", ".join(
            filter(None, ["fastest" if i == best else "", "your config" if (cap, view) == current else ""])
        )
        rows.append(
            [f"{cap:g}", str(view).lower(), fmt(s.median), s.spread(), f"{s.median / stats[best].median:.3f}", note]
        )
    print(
        f"autotune: {args.config}{' ' + ' '.join(args.overrides) if args.overrides else ''}, {nproc} processes, "
        f"{args.steps} timed steps, median of {args.rounds} round(s)"
    )
    print(format_table(["bucket_cap_mb", "gradient_as_bucket_view", "ms/step", "min..max", "vs fastest", ""], rows))
    cap, view = pairs[best]
    override = f"ddp.bucket_cap_mb={cap:g} ddp.gradient_as_bucket_view={str(view).lower()}"
    mine = pairs.index(current) if current in pairs else None
    gain = ""
    if mine == best:
        gain = " (your config's setting already)"
    elif mine is not None:
        gain = f" (your config's setting takes {stats[mine].median / stats[best].median:.3f}x as long per step)"
    print(
        f"fastest: bucket_cap_mb={cap:g}, gradient_as_bucket_view={str(view).lower()}: "
        f"{stats[best].median:.2f} ms/step{gain}"
    )
    print(f"override: {override}")
    emit_results(args, {"pairs": pairs, "ms": ms, "best": pairs[best], "override": override})


def worker(params: dict[str, Any], *, runtime: Runtime, workdir: Path) -> dict[str, Any]:
    """On every rank: train each candidate ``rounds`` times, alternating; return ms/step lists."""
    pairs = [tuple(p) for p in params["pairs"]]
    rounds = params["rounds"]
    ms: list[list[float]] = [[] for _ in pairs]
    for round_index in range(rounds):
        order = list(range(len(pairs)))
        if round_index % 2:
            order.reverse()
        for i in order:
            cap, view = pairs[i]
            trainer = TimedTrainer(
                params["config"],
                overrides=[
                    *params["overrides"],
                    *benchmark_overrides(workdir / f"run{i}", steps=params["warmup"] + params["steps"]),
                    f"ddp.bucket_cap_mb={cap}",
                    f"ddp.gradient_as_bucket_view={str(view).lower()}",
                ],
            )
            trainer.fit()
            ms[i].append(steady_ms_per_step(trainer.step_times, warmup=params["warmup"]))
            if runtime.env.rank == 0:
                setting = f"bucket_cap_mb={cap:g} gradient_as_bucket_view={str(view).lower()}"
                progress(f"[autotune]   round {round_index + 1}/{rounds} {setting}: {ms[i][-1]:.2f} ms/step")
    return {"ms": ms}


def _one(values: list[int], option: str) -> list[int]:
    if len(values) != 1:
        raise BenchUsageError(f"{option}: give one process count for autotune, e.g. {option} 2")
    return values
