"""``ddpkit bench scaling``: will it scale? Predict step time and efficiency at 8 to 1,024 ranks, from one.

    ddpkit bench scaling configs/quickstart.yaml --predict 8,64,512,1024 --link 100Gbit --latency 5us
    ddpkit bench scaling my.yaml --link 10Gbit,100Gbit,400Gbit --latency 5us --plot scaling.png
    ddpkit bench scaling configs/quickstart.yaml --validate 1,2,3 --rounds 3     # check the model here

1. Profile (one rank, started through torch's launcher): the config's step as the Trainer
   builds it, timed per phase (data, forward, backward, optimizer) with DDP's buckets in the
   order its reducer fires them and when each is launched (:mod:`ddpkit.bench.scaling_profile`).
2. Links: each ``--link`` bandwidth (bus bandwidth per rank, as ``ddpkit bench allreduce``
   defines busbw) with ``--latency``; and, unless ``--link`` is given without ``--validate``,
   the latency and bandwidth fitted to ``ddpkit bench allreduce`` on this machine at 2 and 3
   ranks (or to ``--allreduce-json``, that command's ``-o FILE.json`` output).
3. Predict (:mod:`ddpkit.bench.scaling_model`): ring / tree allreduce per bucket, overlapped with
   the rest of the backward as DDP overlaps it, plus the wait for the slowest rank read from
   the profiled step-to-step spread; step time, samples/s, scaling efficiency ``step_1 /
   step_N`` at each ``--predict`` world size, and the best ``ddp.bucket_cap_mb``.
4. ``--validate 1,2,3``: train the config for real at those world sizes on this machine
   (alternating with the profiles for ``--rounds`` rounds) and compare with the prediction on
   the fitted link. For N ranks the compute comes from N one-rank profiles run at once, each
   measuring on its own: on a machine whose cores the ranks (and other jobs) share, that is the
   compute they really get, spread included; the model supplies communication and overlap.

The model's assumptions and limits (flat topology, fixed algorithm, a sampled spread): docs/scaling.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from ddpkit.bench.launching import BenchFailed, run_workers
from ddpkit.bench.report import emit_results, fmt, format_table, progress
from ddpkit.bench.scaling_model import (
    Bucket,
    Link,
    Param,
    Profile,
    best_bucket_cap,
    fit_link,
    parse_bandwidth,
    parse_latency,
    predict,
)
from ddpkit.bench.units import (
    BenchUsageError,
    format_bytes,
    parse_floats,
    parse_nproc,
    parse_sizes,
)
from ddpkit.config.cli_args import add_config_arguments, add_output_arguments
from ddpkit.distributed.process_group import Runtime

__all__ = ["add_arguments", "local_links", "profile_from_dict", "run", "worker"]

ALLREDUCE_SIZES = "4KB..16MB"
#: Seconds for one concurrent profile: generous, for a loaded machine
_PROFILE_TIMEOUT = 900
#: Variables that would make a profile process join a launched job instead of being a world of one.
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_STEP_ID",
    "SLURM_JOB_ID",
)
DEFAULT_CAPS = "1,2,5,10,25,50,100,200"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, config_help="your YAML config (the model, data, optimizer and ddp section to predict)")
    parser.add_argument("--predict", default="8,64,512,1024", help="world sizes to predict (default 8,64,512,1024)")
    parser.add_argument(
        "--link",
        default=None,
        help="bus bandwidth per rank, e.g. 100Gbit, 25GbE, 12.5GB/s; a comma list draws one line each",
    )
    parser.add_argument(
        "--latency",
        default="5us",
        help="latency per allreduce step for --link, e.g. 5us (default), 0.5ms; one, or one per link",
    )
    parser.add_argument(
        "--algorithm",
        choices=["ring", "tree", "best"],
        default="ring",
        help="allreduce algorithm (default ring; best = faster per bucket)",
    )
    parser.add_argument(
        "--bucket-caps",
        default=DEFAULT_CAPS,
        help=f"ddp.bucket_cap_mb values searched for the best (default {DEFAULT_CAPS})",
    )
    parser.add_argument(
        "--validate",
        default=None,
        metavar="N,...",
        help="also train at these world sizes here (e.g. 1,2,3) and compare",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternated rounds of profile and validation runs; medians reported (default 1)",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=20,
        help="timed profile iterations (default 20); validation runs train this many steps",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    parser.add_argument(
        "--allreduce-json",
        default=None,
        metavar="FILE",
        help="fit the local link to this `ddpkit bench allreduce -o FILE.json` output instead of measuring",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="plot predicted efficiency vs world size, one line per link (needs ddpkit[plot])",
    )
    add_output_arguments(parser, what="the profile, links and predictions")


def run(args: argparse.Namespace) -> int:
    """Validate the options, profile (and validate) through torch's launcher, print the tables."""
    from ddpkit.bench.scaling_profile import check_profiled_config
    from ddpkit.config.loader import load_config

    # A bad config fails here, before any process starts
    cfg = load_config(args.config, args.overrides)
    world_sizes, validate, given, caps = _check(args)
    check_profiled_config(cfg)
    if max(validate, default=1) > 1 and cfg.dist.device != "cpu" and torch.cuda.is_available():
        raise BenchUsageError(
            "--validate: on GPUs only 1 rank can be checked for now (the profiles of N > 1 ranks run as worlds of "
            "one and would all share the first GPU); use --validate 1, or dist.device=cpu to check the CPU"
        )
    params = {
        "config": str(Path(args.config).resolve()),
        "overrides": list(args.overrides),
        "iters": args.iters,
        "warmup": args.warmup,
    }
    links = list(given)
    if validate or not given:
        links.insert(0, local_links(_allreduce_points(args.allreduce_json)))
    profiles, measured = _measure(params, validate, rounds=args.rounds)
    # The median round's profile
    profile = sorted(profiles[1], key=lambda p: p.single_step_s)[len(profiles[1]) // 2]
    _print_profile(args.config, profile, cfg.ddp.bucket_cap_mb, rounds=args.rounds)
    rows = prediction_rows(profile, links, world_sizes, algorithm=args.algorithm, caps=caps)
    _print_predictions(rows)
    checks = validation_rows(profiles, measured, links[0], algorithm=args.algorithm) if validate else []
    if checks:
        _print_validation(checks, links[0], rounds=args.rounds)
    emit_results(
        args,
        {
            "profile": asdict(profile),
            "links": [asdict(link) for link in links],
            "predictions": rows,
            "validation": checks,
            "measured_ms": {str(n): v for n, v in measured.items()},
        },
    )
    if args.plot:
        from ddpkit.bench.scaling_plot import plot_efficiency

        plot_efficiency(
            rows, args.plot, title=f"{Path(args.config).name}: predicted scaling ({args.algorithm} allreduce)"
        )
        print(f"wrote {args.plot}")
    return 0


def _check(args: argparse.Namespace) -> tuple[list[int], list[int], list[Link], list[float]]:
    """World sizes to predict and to validate, the given links, the bucket caps; all checked before any process
    starts."""
    world_sizes = parse_nproc(args.predict, option="--predict", maximum=1 << 20)
    caps = parse_floats(args.bucket_caps, option="--bucket-caps")
    validate = parse_nproc(args.validate, option="--validate", maximum=os.cpu_count() * 4) if args.validate else []
    for option, value in (("--rounds", args.rounds), ("--iters", args.iters)):
        if value < 1:
            raise BenchUsageError(f"{option}: {value} must be at least 1")
    if args.warmup < 0:
        raise BenchUsageError(f"--warmup: {args.warmup} must be 0 or more")
    if args.allreduce_json and not Path(args.allreduce_json).is_file():
        raise BenchUsageError(
            f"--allreduce-json: {args.allreduce_json} is not a file; "
            "write one with `ddpkit bench allreduce --nproc-per-node 2,3 -o FILE.json`"
        )
    given: list[Link] = []
    if args.link:
        speeds = [part.strip() for part in args.link.split(",") if part.strip()]
        delays = [part.strip() for part in args.latency.split(",") if part.strip()]
        if len(delays) not in (1, len(speeds)):
            raise BenchUsageError(
                f"--latency: give one latency, or one per --link value ({len(speeds)}), not {len(delays)}"
            )
        delays = delays * len(speeds) if len(delays) == 1 else delays
        given = [Link(parse_bandwidth(s), parse_latency(d), name=f"{s}/{d}") for s, d in zip(speeds, delays)]
    if args.plot:
        from ddpkit.bench.plotting import require_matplotlib

        require_matplotlib()
    return world_sizes, validate, given, caps


def _allreduce_points(path: str | None) -> list[tuple[int, int, float]]:
    """``(bytes, ranks, seconds)`` from ``ddpkit bench allreduce`` at 2 and 3 ranks, measured now or read from its
    JSON."""
    if path:
        try:
            results = json.loads(Path(path).read_text())
            return [(r["bytes"], res["world_size"], r["time_us"] * 1e-6) for res in results for r in res["rows"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise BenchUsageError(
                f"--allreduce-json: {path} is not `ddpkit bench allreduce -o FILE.json` output ({exc})"
            ) from None
    points = []
    for n in (2, 3):
        progress(f"[scaling] fitting the local link: allreduce on {n} ranks, {ALLREDUCE_SIZES} ...")
        result = run_workers(
            "allreduce",
            {"sizes": parse_sizes(ALLREDUCE_SIZES, factor=4), "iters": 20, "warmup": 3, "time_per_size": 0.3},
            nproc=n,
        )
        points += [(r["bytes"], n, r["time_us"] * 1e-6) for r in result["rows"]]
    return points


def local_links(points: list[tuple[int, int, float]]) -> Link:
    """The alpha-beta link fitted to this machine's allreduce measurements."""
    link = fit_link(points, name="this machine")
    progress(
        f"[scaling] fitted: latency {link.latency * 1e6:.1f} us per step, bus bandwidth {link.bandwidth / 1e9:.3f} GB/s"
    )
    return link


def _measure(
    params: dict[str, Any], validate: list[int], *, rounds: int
) -> tuple[dict[int, list[Profile]], dict[int, list[float]]]:
    """Per round: the one-rank profile; per validated N, a profile on N concurrent ranks and a real N-rank run."""
    profiles: dict[int, list[Profile]] = {n: [] for n in {1, *validate}}
    measured: dict[int, list[float]] = {n: [] for n in validate}
    for round_index in range(rounds):
        for n in sorted(profiles) if round_index % 2 == 0 else sorted(profiles, reverse=True):
            progress(
                f"[scaling] round {round_index + 1}/{rounds}: profiling on {n} rank(s) "
                f"at once ({params['warmup']}+{params['iters']} iterations) ..."
            )
            profiles[n].append(_profile(params, n))
            if n in measured:
                measured[n].append(run_workers("scaling", {**params, "mode": "train"}, nproc=n)["ms_per_step"])
                progress(f"[scaling]   trained on {n} rank(s): {measured[n][-1]:.2f} ms/step")
    return profiles, measured


def _profile(params: dict[str, Any], n: int) -> Profile:
    """One rank's profile through torch's launcher; for ``n > 1``, ``n`` independent one-rank profiles at once.

    Of ``n`` concurrent profiles, the phases of the one with the median step are kept, and the
    step times of all ``n`` pooled: with more ranks than cores, some processes share a core and
    step twice as slowly as the others, and which ones changes as the scheduler moves them. The
    pool is that distribution; the model's straggler term (the slowest of ``n`` ranks) reads it.

    Independent worlds of one rather than one world of ``n``: the ranks share only the machine,
    as they should, and no collective or DDP group spans them.
    """
    if n == 1:
        return profile_from_dict(run_workers("scaling", {**params, "mode": "profile"}, nproc=1))
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-scaling-") as tmp:
        procs = []
        results = [Path(tmp) / f"result{i}.json" for i in range(n)]
        for i, result in enumerate(results):
            spec = Path(tmp) / f"spec{i}.json"
            spec.write_text(
                json.dumps(
                    {"kind": "scaling", "params": {**params, "mode": "profile"}, "result": str(result), "workdir": tmp}
                )
            )
            env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "ddpkit.bench.worker", str(spec)], env={**env, "OMP_NUM_THREADS": "1"}
                )
            )
        try:
            codes = [proc.wait(timeout=_PROFILE_TIMEOUT) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        if any(codes) or not all(r.exists() for r in results):
            raise BenchFailed(f"the scaling profile on {n} concurrent processes failed; see their output above")
        profiles = sorted(
            (profile_from_dict(json.loads(r.read_text())) for r in results),
            key=lambda p: statistics.median(p.step_samples_s),
        )
        return replace(profiles[n // 2], step_samples_s=tuple(sorted(s for p in profiles for s in p.step_samples_s)))


def prediction_rows(
    profile: Profile, links: list[Link], world_sizes: list[int], *, algorithm: str, caps: list[float]
) -> list[dict[str, Any]]:
    """One row per link and world size: the config's buckets, and the best bucket cap among ``caps``."""
    rows = []
    for link in links:
        for n in world_sizes:
            p = predict(profile, n, link, algorithm)
            if n > 1:
                cap, best = best_bucket_cap(profile, n, link, caps_mb=caps, algorithm=algorithm)
            else:
                cap = profile.bucket_cap_mb or 25.0
                best = p
            rows.append(
                {
                    "link": link.label(),
                    "ranks": n,
                    "ms": p.step_s * 1e3,
                    "samples_per_s": p.samples_per_s,
                    "efficiency": p.efficiency,
                    "exposed_ms": p.exposed_comm_s * 1e3,
                    "straggler_ms": p.straggler_s * 1e3,
                    "best_cap": cap,
                    "best_efficiency": best.efficiency,
                }
            )
    return rows


def validation_rows(
    profiles: dict[int, list[Profile]], measured: dict[int, list[float]], link: Link, *, algorithm: str
) -> list[dict[str, Any]]:
    """Per validated N: the prediction from each round's N-concurrent-rank profile (median) vs the measured median."""
    rows = []
    for n, values in sorted(measured.items()):
        predicted = statistics.median(predict(p, n, link, algorithm).step_s * 1e3 for p in profiles[n])
        median = statistics.median(values)
        rows.append(
            {
                "ranks": n,
                "predicted_ms": predicted,
                "measured_ms": median,
                "spread": f"{min(values):.2f}..{max(values):.2f}",
                "error": predicted / median - 1,
                "compute_ms": statistics.median(p.single_step_s * 1e3 for p in profiles[n]),
            }
        )
    return rows


def _print_predictions(rows: list[dict[str, Any]]) -> None:
    columns = [
        "link",
        "ranks",
        "ms/step",
        "samples/s",
        "efficiency",
        "exposed comm ms",
        "slowest-rank wait ms",
        "best bucket_cap_mb",
        "its efficiency",
    ]
    print(
        format_table(
            columns,
            [
                [
                    r["link"],
                    str(r["ranks"]),
                    fmt(r["ms"]),
                    fmt(r["samples_per_s"]),
                    f"{r['efficiency']:.3f}",
                    fmt(r["exposed_ms"]),
                    fmt(r["straggler_ms"]),
                    f"{r['best_cap']:g}",
                    f"{r['best_efficiency']:.3f}",
                ]
                for r in rows
            ],
        )
    )


def _print_validation(checks: list[dict[str, Any]], link: Link, *, rounds: int) -> None:
    print(
        f"\nvalidation on this machine ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, "
        f"link {link.label()} fitted): predicted vs measured ms/step, medians of {rounds} round(s); "
        "compute profiled on N ranks at once"
    )
    columns = ["ranks", "predicted", "measured", "min..max", "error", "within 15%", "bare step on N at once"]
    print(
        format_table(
            columns,
            [
                [
                    str(c["ranks"]),
                    fmt(c["predicted_ms"]),
                    fmt(c["measured_ms"]),
                    c["spread"],
                    f"{c['error']:+.1%}",
                    "yes" if abs(c["error"]) <= 0.15 else "NO",
                    fmt(c["compute_ms"]),
                ]
                for c in checks
            ],
        )
    )


def _print_profile(config: str, profile: Profile, cap: float | None, *, rounds: int) -> None:
    print(
        f"scaling: {config}, {profile.batch_size} samples per rank per step, "
        f"bucket_cap_mb={cap if cap is not None else 'default (25, first bucket 1 MiB)'}; "
        f"one-rank profile (median round of {rounds})"
    )
    print(
        f"  one rank, bare model: {profile.single_step_s * 1e3:.3f} ms/step; DDP-wrapped phases: data "
        f"{profile.data_s * 1e3:.3f} ms, forward {profile.forward_s * 1e3:.3f} ms, backward "
        f"{profile.backward_s * 1e3:.3f} ms, optimizer {profile.optimizer_s * 1e3:.3f} ms"
    )
    launches = ", ".join(f"{format_bytes(b.nbytes)}@{b.ready_s * 1e3:.2f}ms" for b in profile.buckets)
    print(
        f"  {len(profile.buckets)} bucket(s), {format_bytes(profile.grad_bytes)} of gradients, "
        f"in firing order (size@launch after backward began): {launches}"
    )
    if profile.comm_factor != 1:
        print(f"  comm hook: {profile.comm_factor:g} bytes on the wire per gradient byte")
    print()


def profile_from_dict(data: dict[str, Any]) -> Profile:
    """The :class:`Profile` a worker sent back as JSON."""
    return replace(
        Profile(**{**data, "buckets": (), "params": ()}),
        buckets=tuple(Bucket(**b) for b in data["buckets"]),
        params=tuple(Param(**p) for p in data["params"]),
        step_samples_s=tuple(data.get("step_samples_s", ())),
    )


def worker(params: dict[str, Any], *, runtime: Runtime, workdir: Path) -> dict[str, Any]:
    """On every rank: ``profile`` (one rank) measures the step's phases; ``train`` times the real Trainer."""
    from ddpkit.config.loader import load_config

    if params["mode"] == "profile":
        from ddpkit.bench.scaling_profile import measure_profile

        return asdict(
            measure_profile(
                load_config(params["config"], params["overrides"]),
                runtime,
                iters=params["iters"],
                warmup=params["warmup"],
            )
        )
    from ddpkit.bench.timed import TimedTrainer, benchmark_overrides, median_step_ms

    overrides = [*params["overrides"], *benchmark_overrides(workdir / "run", steps=params["warmup"] + params["iters"])]
    trainer = TimedTrainer(params["config"], overrides=overrides)
    trainer.fit()
    return {"ms_per_step": median_step_ms(trainer.step_times, warmup=params["warmup"])}
