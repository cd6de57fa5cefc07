"""``ddpkit bench throughput``: samples/s per world size and the scaling efficiency, on synthetic data.

    ddpkit bench throughput --model resnet18 --batch-size 32 --nproc-per-node 1,2 [--steps 20] [--precision bf16]
    ddpkit bench throughput --model mnist_cnn --batch-size 64 --nproc-per-node 1,2 --plot scaling.png

Horovod's synthetic benchmark, for the ddpkit Trainer: every world size N is a separate job
started through torch's launcher; each rank trains ``--model`` on random in-memory tensors
(the ``synthetic`` dataset: data loading costs nothing) at ``--batch-size`` samples per rank
for ``--warmup`` + ``--steps`` optimizer steps. Reported per N: milliseconds per step (mean over
the timed steps), samples/s = N x batch / step time, and

    scaling efficiency = throughput_N / (N x throughput_1)

(1.0 is perfect scaling; only defined when N=1 is measured too). On the CPU each rank runs one
thread (``--threads-per-rank``), so N ranks use N cores. With ``--rounds R`` the world sizes are
measured in alternation R times and medians are reported, for machines shared with other work.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ddpkit.bench.launching import run_workers
from ddpkit.bench.report import Stats, emit_results, fmt, format_table, progress
from ddpkit.bench.timed import TimedTrainer, benchmark_overrides, steady_ms_per_step
from ddpkit.bench.units import BenchUsageError, parse_nproc
from ddpkit.config.cli_args import add_output_arguments
from ddpkit.distributed.process_group import Runtime

__all__ = ["add_arguments", "run", "worker", "efficiency_rows"]

#: Input shapes of the built-in models; torchvision models get ImageNet-sized images.
_DEFAULT_SHAPES = {"mlp": (1, 28, 28), "mnist_cnn": (1, 28, 28)}
_IMAGE_SHAPE = (3, 224, 224)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="a registered model (mlp, mnist_cnn) or any torchvision model (resnet18, ...)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument(
        "--nproc-per-node", default="1,2", help="comma-separated world sizes to run, one node (default 1,2)"
    )
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    parser.add_argument(
        "--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="autocast precision (fp16: CUDA only)"
    )
    parser.add_argument(
        "--input-shape",
        default=None,
        help="per-sample shape, e.g. 3,32,32 (default: 1,28,28 for mlp/mnist_cnn, else 3,224,224)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure every world size this many times, alternating; report medians"
    )
    parser.add_argument("--threads-per-rank", type=int, default=1, help="OMP threads per rank on the CPU (default 1)")
    parser.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="also plot scaling efficiency vs world size (needs matplotlib: ddpkit[plot])",
    )
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Validate the options, run each world size through torch's launcher, print the table."""
    counts = _check(args)
    shape = _input_shape(args.input_shape, args.model)
    params = {
        "model": args.model,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "precision": args.precision,
        "shape": list(shape),
    }
    runs: dict[int, list[float]] = {n: [] for n in counts}
    for round_index in range(args.rounds):
        order = counts if round_index % 2 == 0 else counts[::-1]
        for n in order:
            progress(
                f"[throughput] round {round_index + 1}/{args.rounds}: {args.model} "
                f"on {n} process(es), {args.warmup}+{args.steps} steps ..."
            )
            result = run_workers("throughput", params, nproc=n, threads=args.threads_per_rank)
            runs[n].append(result["ms_per_step"])
            progress(f"[throughput]   {n} process(es): {result['ms_per_step']:.2f} ms/step")
    rows = efficiency_rows({n: Stats.of(ms) for n, ms in runs.items()}, batch_size=args.batch_size)
    print(
        f"throughput: {args.model}, batch {args.batch_size} per rank, {args.precision}, input "
        f"{'x'.join(map(str, shape))}, {args.steps} timed steps, median of {args.rounds} round(s)"
    )
    print(
        format_table(
            ["nproc", "global batch", "ms/step", "min..max", "samples/s", "efficiency"],
            [
                [
                    str(r["nproc"]),
                    str(r["global_batch"]),
                    fmt(r["ms_per_step"]),
                    r["spread"],
                    fmt(r["samples_per_s"]),
                    "-" if r["efficiency"] is None else f"{r['efficiency']:.3f}",
                ]
                for r in rows
            ],
        )
    )
    emit_results(args, {"params": params, "rounds": {str(n): ms for n, ms in runs.items()}, "rows": rows})
    if args.plot:
        from ddpkit.bench.plotting import plot_scaling

        plot_scaling(rows, args.plot, title=f"{args.model}, batch {args.batch_size}/rank")
        print(f"wrote {args.plot}")
    return 0


def _check(args: argparse.Namespace) -> list[int]:
    """The world sizes to run; every option checked before any process starts."""
    from ddpkit.launch.launcher import preflight
    from ddpkit.registry import MODELS

    counts = parse_nproc(args.nproc_per_node)
    for option, value in (
        ("--batch-size", args.batch_size),
        ("--steps", args.steps),
        ("--rounds", args.rounds),
        ("--threads-per-rank", args.threads_per_rank),
    ):
        if value < 1:
            raise BenchUsageError(f"{option}: {value} must be at least 1")
    if args.warmup < 0:
        raise BenchUsageError(f"--warmup: {args.warmup} must be 0 or more")
    # Unknown names fail now, with a suggestion, not in N workers
    MODELS.get(args.model, key="--model")
    # the checks of `ddpkit run`
    preflight(nproc=str(counts[-1]), precision=args.precision, precision_option="--precision ")
    if args.plot:
        from ddpkit.bench.plotting import require_matplotlib

        require_matplotlib()
    return counts


def efficiency_rows(step_ms: dict[int, Stats], *, batch_size: int) -> list[dict[str, Any]]:
    """Per world size: step time, samples/s and ``throughput_N / (N x throughput_1)`` (None without N=1)."""
    rows = []
    for n, stats in sorted(step_ms.items()):
        rows.append(
            {
                "nproc": n,
                "global_batch": n * batch_size,
                "ms_per_step": stats.median,
                "spread": stats.spread(),
                "samples_per_s": n * batch_size * 1000 / stats.median,
            }
        )
    base = next((r["samples_per_s"] for r in rows if r["nproc"] == 1), None)
    for row in rows:
        row["efficiency"] = None if base is None else row["samples_per_s"] / (row["nproc"] * base)
    return rows


def worker(params: dict[str, Any], *, runtime: Runtime, workdir: Path) -> dict[str, Any]:
    """On every rank: train on synthetic data for warmup + steps; return the timing (rank 0's is kept)."""
    batch = params["batch_size"]
    warmup = params["warmup"]
    steps = params["steps"]
    trainer = TimedTrainer(
        {
            "run": {"name": "bench-throughput", "seed": 0},
            # Eight batches per rank, reused epoch after epoch: memory stays small for any step count.
            "data": {
                "name": "synthetic",
                "batch_size": batch,
                "kwargs": {"size": 8 * batch * runtime.env.world_size, "shape": params["shape"]},
            },
            "model": {"name": params["model"]},
            "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
            "train": {"precision": params["precision"]},
        },
        overrides=benchmark_overrides(workdir / "run", steps=warmup + steps),
    )
    trainer.fit()
    return {"world_size": trainer.world_size, "ms_per_step": steady_ms_per_step(trainer.step_times, warmup=warmup)}


def _input_shape(text: str | None, model: str) -> tuple[int, ...]:
    if text is None:
        return _DEFAULT_SHAPES.get(model, _IMAGE_SHAPE)
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise BenchUsageError(f"--input-shape: {text!r} is not a comma-separated list of sizes, e.g. 3,32,32") from None
    if not shape or min(shape) < 1:
        raise BenchUsageError(f"--input-shape: {text!r} must list positive sizes, e.g. 3,32,32")
    return shape
