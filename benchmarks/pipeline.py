"""Pipeline parallelism on 2 Gloo ranks: the bubble against (P-1)/(M+P-1), throughput against a world of one and
against ddp, and the activations each stage holds under GPipe and 1F1B (issue 57).

    .venv/bin/python -m benchmarks.pipeline                      # 5 rounds x 10 timed steps at M = 2, 4, 8
    .venv/bin/python -m benchmarks.pipeline --quick              # 1 round x 3 timed steps: does it run
    .venv/bin/python -m benchmarks.pipeline --rounds 9 --steps 20 --microbatches 4,8
    .venv/bin/python -m benchmarks.pipeline 2>/dev/null          # the tables alone (the ranks log to stderr)

The model: ``nn.Sequential`` of 8 equal blocks ``Linear(1024, 1024) + ReLU``, cut in the middle by
``parallel.split_points: ["4"]`` (two stages of 4.2M parameters each), microbatches of 32 rows. A
microbatch's forward and backward through one stage is about 10 ms of one core, against 0.1 ms for
Gloo to pass its 128 KiB activation to the other rank on an idle machine (a 0.2 ms round trip,
measured): compute dominates, as the theory assumes. Every variant trains through the real
:class:`ddpkit.Trainer` (``ddpkit.testing.run_on_ranks``, one thread a rank), the same global batch of
``32 x M`` rows a step, plain SGD:

- ``gpipe``, ``1f1b``: ``parallel: {pipeline: 2, microbatches: M, schedule: ..., split_points: ["4"]}``;
- ``one``: a world of one, the whole model, ``train.grad_accum_steps: M`` (the same 32-row microbatches)
  on one thread: the one device the issue's ideal ``2M / (M + 1)`` is a multiple of;
- ``ddp``: 2 ranks, the whole model on each, ``grad_accum_steps: M / 2`` (32 rows again), one
  all-reduce of the 8.4M gradients (34 MB over Gloo) a step.

**Step time**: from ``on_step_end`` timestamps (the previous step's end to this one's), so it is the
Trainer's whole step: loading, the schedule or the accumulation, the update, its per-step
bookkeeping. The median over the timed steps after ``WARMUP`` (torch's schedule infers shapes on its
first step); a 2-rank variant's time is its slower rank's median. Throughput ratios are paired by round
(``one``'s step time over the variant's: the same global batch, so the ratio of samples per second).

**Bubble**: measured inside the real pipelined run. The benchmark wraps the methods of each rank's
torch ``PipelineStage`` that compute (``forward_one_chunk``, ``backward_one_chunk``,
``perform_reduce_grad``, and the schedule's loss call on the last stage) with ``time.perf_counter``,
and stamps each rank's entry into and exit from ``schedule.step`` with ``time.monotonic()``
(CLOCK_MONOTONIC: one clock for all processes of a machine). The pipeline's span of a step runs from
the first stage entering ``schedule.step`` to the last one leaving it, and a stage's bubble is
``1 - busy / span`` summed over the timed steps: the share of the pipeline's step in which this stage
computed nothing, which is what (P-1)/(M+P-1) predicts for balanced stages and free communication. (A
stage's own ``schedule.step`` would not do: the last stage leaves it after its last backward while
stage 0 still runs its own, so the drain would fall outside.) What counts as idle: waiting for the
other stage (the fill and drain, and any imbalance), the receives and sends, and Gloo's threads
waiting for a core (two busy ranks on two cores); ``in p2p ms`` says how much of it the stage spent
inside torch's ``_batch_p2p`` and ``_wait_batch_p2p`` (posting its sends and receives, waiting for
them), the rest being the schedule's own Python and the part of the pipeline's span outside this
stage's own ``schedule.step``. Why not only time each stage alone and divide: on this machine two busy
ranks compute slower than one rank alone (shared caches and memory bandwidth, the other rank's Gloo
threads), and that slowdown would count as bubble too; both are printed (``1-alone/span``, and
``busy/alone``, the slowdown itself), so the reader sees which part is which.
The stages are equal in blocks, not quite in work: stage 0 computes no gradient for its input, the
last stage computes the loss (``alone ms`` shows both), so stage 0 waits a little more than the theory
says. Outside the schedule (the update, loading, logging) is neither busy nor idle: ``sched ms``
against ``step ms`` shows how much of the step the schedule is. The wrappers reach torch's stage
through ``Pipeline.schedule._stage``, its p2p helpers as module attributes of
``torch.distributed.pipelining.schedules``, and ddpkit's pipeline through ``Trainer.placed.pipeline`` (ddpkit's own
``stage<k>_busy_s`` in metrics.jsonl, since 6bdf326, times the stage's compute but neither the p2p calls nor
the cross-process stamps this benchmark needs); the short test run in
``tests/test_benchmark_pipeline.py`` fails if a torch release moves them.

**Activations held**: on one extra step after the timed ones, ``torch.autograd.graph.saved_tensors_hooks``
around the schedule counts every tensor autograd saves for the backward pass, each storage once while
any saved reference to it lives (a ReLU's output is also the next Linear's input), parameters
excluded; the peak of those live bytes over the step is the stage's activation memory. Divided by
one microbatch's share (everything saved in the step / M) it is the microbatches held at once: GPipe
runs every forward before any backward, so M; 1F1B at most ``P - stage`` (2 on stage 0, 1 on stage 1).
Exact and the same on every machine (it counts tensors, not the allocator's pages; the process's
resident memory would bury 1 MiB of activations under the interpreter and the weights).

Printed: two tables (step time and throughput; bubble and activations) with medians over rounds
(min..max where it matters), what each column means, and the load average before and after. The raw
per-step numbers of every fit go to ``benchmarks/data/<UTC date>/pipeline.json``
(``pipeline-quick.json`` with ``--quick``; ``--output`` elsewhere). Each round alternates the order of
the microbatch counts, of the variants within one, and of the 2-rank and the 1-rank spawn, so drifting
load hits every variant alike. Absolute times on a shared 2-core machine are noise: read the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from benchmarks.workloads import REPO, load_average, rotated, table
from ddpkit.bench.report import progress
from ddpkit.parallel.pipeline import bubble_fraction
from ddpkit.testing import run_on_ranks

WIDTH = 1024
BLOCKS = 8
ROWS = 32
STAGES = 2
#: Steps before the timed ones: the schedule's shape inference, the allocator's first pages.
WARMUP = 3
SCHEDULES = ("gpipe", "1f1b")
#: The variants that run on 2 ranks (one spawn), then the world of one (another).
TWO_RANKS = (*SCHEDULES, "ddp")
#: The Trainer's variants; ``alone`` (each stage's compute with nothing else running) is measured beside ``one``.
VARIANTS = (*TWO_RANKS, "one")
ONE_RANK = ("one", "alone")
#: torch's module-level helpers every schedule posts its sends and receives through, and waits on them with
#: (looked up by name at each call, so :class:`StageClock` can time them); the originals, whatever wraps them later.
P2P_CALLS = {name: getattr(torch_schedules, name) for name in ("_batch_p2p", "_wait_batch_p2p")}


# --- what theory says ---------------------------------------------------------------------------------------------


def ideal_speedup(stages: int, microbatches: int) -> float:
    """Throughput of P balanced stages over one device's: P x (1 - bubble) = P M / (M + P - 1); 2M / (M + 1) at P 2."""
    return stages * (1 - bubble_fraction(stages, microbatches))


def expected_held(schedule: str, *, stage: int, stages: int, microbatches: int) -> int:
    """Microbatches whose activations a stage holds at once: GPipe all M, 1F1B at most P - stage (and at most M)."""
    if schedule == "gpipe":
        return microbatches
    return min(stages - stage, microbatches)


def measured_bubble(busy: float, span: float) -> float:
    """The idle share of a schedule's span on one stage: ``1 - busy / span``."""
    if span <= 0:
        raise ValueError(f"a schedule's span must be positive, got {span}")
    return 1.0 - busy / span


# --- the run's configuration and model ----------------------------------------------------------------------------


def run_config(variant: str, microbatches: int, *, steps: int, output_dir: str) -> dict[str, Any]:
    """The Trainer config of one variant: the same global batch (``ROWS x M``) and 32-row microbatches in each."""
    train: dict[str, Any] = {"max_steps": steps, "log_every": steps}
    cfg: dict[str, Any] = {
        "run": {"name": f"{variant}-m{microbatches}", "output_dir": output_dir, "seed": 0},
        "data": {"global_batch_size": ROWS * microbatches},
        "optim": {"name": "sgd", "lr": 0.01},
        "train": train,
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }
    if variant in SCHEDULES:
        split = [str(BLOCKS // STAGES)]
        cfg["parallel"] = {"pipeline": STAGES, "microbatches": microbatches, "schedule": variant, "split_points": split}
    elif variant == "one":
        train["grad_accum_steps"] = microbatches
    elif variant == "ddp":
        if microbatches % 2:
            raise ValueError(f"ddp on 2 ranks splits M microbatches in two: M must be even, got {microbatches}")
        train["grad_accum_steps"] = microbatches // 2
    else:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return cfg


def blocks_model() -> nn.Sequential:
    """``BLOCKS`` equal ``Linear(WIDTH, WIDTH) + ReLU`` blocks, named ``0`` .. ``7`` (``split_points`` cuts by name)."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)])


# --- measuring inside the run -------------------------------------------------------------------------------------


class SavedActivations:
    """What autograd holds for the backward pass, live at once, while :meth:`hooks` is entered.

    Each saved tensor's storage counts once while any saved reference to it lives (a ReLU saves its
    output, the next Linear saves the same tensor as its input); storages of ``excluded`` tensors (the
    parameters: a Linear saves its weight) do not count. ``peak_bytes`` is the most live at once,
    ``packed_bytes`` everything saved. The packed object holds the tensor as autograd would, and its
    release (autograd frees a node's saved tensors after the node's backward) takes the bytes off.
    """

    def __init__(self, excluded: Iterable[torch.Tensor] = ()):
        self._excluded = {tensor.untyped_storage().data_ptr() for tensor in excluded}
        #: storage address -> [saved references alive, the storage's bytes]
        self._alive: dict[int, list[int]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.packed_bytes = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _Saved.unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self._excluded:
            return tensor
        entry = self._alive.get(address)
        if entry is None:
            entry = self._alive[address] = [0, storage.nbytes()]
            self.live_bytes += entry[1]
            self.packed_bytes += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        return _Saved(tensor, functools.partial(self._release, address))

    def _release(self, address: int) -> None:
        entry = self._alive[address]
        entry[0] -= 1
        if entry[0] == 0:
            del self._alive[address]
            self.live_bytes -= entry[1]


class _Saved:
    """One saved reference: the tensor, and what to call when autograd lets go of it."""

    __slots__ = ("tensor", "_release")

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]):
        self.tensor = tensor
        self._release = release

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __del__(self) -> None:
        self._release()


class StageClock:
    """This rank's stage timed inside torch's schedule: ``busy`` (its compute), and when ``schedule.step`` began and
    ended.

    Wraps the schedule's stage's ``forward_one_chunk``, ``backward_one_chunk`` and ``perform_reduce_grad``
    and the schedule's loss call (the last stage's loss is compute too) as busy, and torch's ``_batch_p2p``
    and ``_wait_batch_p2p`` (posting sends and receives, waiting for them) as ``p2p``; the schedule's own
    bookkeeping is the rest. ``schedule.step``'s entry and exit are stamped with ``time.monotonic()``:
    CLOCK_MONOTONIC, one clock for every process of a machine, so the stamps of two ranks compare. With
    ``memory`` set, the next ``schedule.step`` runs under its saved-tensor hooks. :meth:`close` puts torch's
    p2p helpers back.
    """

    def __init__(self, schedule: Any):
        stage = schedule._stage
        self.busy = 0.0
        self.p2p = 0.0
        self.began: float | None = None
        self.ended: float | None = None
        self.memory: SavedActivations | None = None
        for owner, name in (
            (stage, "forward_one_chunk"),
            (stage, "backward_one_chunk"),
            (stage, "perform_reduce_grad"),
            (schedule, "_maybe_compute_loss"),
        ):
            setattr(owner, name, self._counted(getattr(owner, name), "busy"))
        for name, original in P2P_CALLS.items():
            setattr(torch_schedules, name, self._counted(original, "p2p"))
        schedule.step = self._stamped(schedule.step)

    def close(self) -> None:
        for name, original in P2P_CALLS.items():
            setattr(torch_schedules, name, original)

    def _counted(self, method: Callable[..., Any], into: str) -> Callable[..., Any]:
        @functools.wraps(method)
        def counted(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                setattr(self, into, getattr(self, into) + time.perf_counter() - began)

        return counted

    def _stamped(self, step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(step)
        def stamped(*args: Any, **kwargs: Any) -> Any:
            memory = self.memory
            self.began = time.monotonic()
            try:
                if memory is None:
                    return step(*args, **kwargs)
                with memory.hooks():
                    return step(*args, **kwargs)
            finally:
                self.ended = time.monotonic()

        return stamped

    def take(self) -> dict[str, float]:
        """The last step's ``busy`` and ``p2p`` seconds and its ``began`` / ``ended`` stamps (``span``: ended -
        began); then reset."""
        if self.began is None or self.ended is None:
            raise RuntimeError("no schedule.step ran since the last take()")
        taken = {"busy": self.busy, "p2p": self.p2p, "began": self.began, "ended": self.ended}
        taken["span"] = self.ended - self.began
        self.busy = 0.0
        self.p2p = 0.0
        self.began = None
        self.ended = None
        return taken


def stage_alone(stage: int, microbatches: int, *, steps: int) -> list[float]:
    """Seconds per step of one stage's own compute with no pipeline around it: M microbatches' forward and backward
    through its blocks (the input's gradient too, as a stage computes it to send back; the loss on the last stage),
    in this process while nothing else runs. ``steps`` of them, after ``WARMUP`` untimed ones."""
    torch.manual_seed(0)
    per_stage = BLOCKS // STAGES
    blocks = blocks_model()[stage * per_stage : (stage + 1) * per_stage]
    last = stage == STAGES - 1
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(ROWS, WIDTH, generator=generator, requires_grad=stage > 0) for _ in range(microbatches)]
    targets = [torch.randint(0, WIDTH, (ROWS,), generator=generator) for _ in range(microbatches)]
    # The gradient a later stage would send back.
    grad = torch.full((ROWS, WIDTH), 1.0 / ROWS)
    seconds = []
    for _ in range(WARMUP + steps):
        began = time.perf_counter()
        for x, y in zip(inputs, targets):
            out = blocks(x)
            if last:
                F.cross_entropy(out, y).backward()
            else:
                out.backward(grad)
        seconds.append(time.perf_counter() - began)
    return seconds[WARMUP:]


class BlocksTrainer(ddpkit.Trainer):
    """The benchmark's Trainer: the blocks model on random rows, each step's end time-stamped (and, under a
    pipeline, its stage's busy time and ``schedule.step`` stamps); the last step counts the saved activations."""

    def build_model(self) -> nn.Module:
        return blocks_model()

    def build_datasets(self) -> tuple[TensorDataset, None]:
        # One epoch of exactly max_steps global batches.
        samples = self.config.data.global_batch_size * self.config.train.max_steps
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(samples, WIDTH, generator=generator)
        y = torch.randint(0, WIDTH, (samples,), generator=generator)
        return TensorDataset(x, y), None

    def on_fit_start(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.memory: dict[str, int] | None = None
        self.clock = StageClock(self.placed.pipeline.schedule) if self.placed.pipeline is not None else None
        self._last_end = time.perf_counter()

    def on_step_end(self, step: int) -> None:
        now = time.perf_counter()
        record = {"step": step, "seconds": now - self._last_end}
        if self.clock is not None:
            record.update(self.clock.take())
            if self.clock.memory is not None:
                memory = self.clock.memory
                self.memory = {"peak_bytes": memory.peak_bytes, "packed_bytes": memory.packed_bytes}
                self.clock.memory = None
            if step == self.config.train.max_steps - 1:
                # The last step, after the timed ones: count what autograd saves (the hooks slow it).
                self.clock.memory = SavedActivations(excluded=self.placed.pipeline.held.parameters())
        self.steps.append(record)
        # After the bookkeeping: the next step's time starts here.
        self._last_end = time.perf_counter()

    def on_fit_end(self, metrics: dict[str, float]) -> None:
        if self.clock is not None:
            self.clock.close()


def _fits(plan: list[tuple[str, int]], max_steps: int, round_: int, root: str) -> list[dict[str, Any]]:
    """On every rank of this spawn: fit each (variant, M) of ``plan`` in turn under ``root`` (the same directory on
    every rank: the ranks check that they run the same config); the measurements of each."""
    results = []
    for variant, microbatches in plan:
        if variant == "alone":
            seconds = [stage_alone(stage, microbatches, steps=max_steps - WARMUP - 1) for stage in range(STAGES)]
            results.append({"round": round_, "variant": variant, "microbatches": microbatches, "alone_s": seconds})
            continue
        cfg = run_config(variant, microbatches, steps=max_steps, output_dir=f"{root}/{variant}-m{microbatches}")
        trainer = BlocksTrainer(cfg)
        trainer.fit()
        stage = trainer.layout.pp_rank if trainer.layout.pp > 1 else None
        results.append(
            {
                "round": round_,
                "variant": variant,
                "microbatches": microbatches,
                "rank": trainer.rank,
                "stage": stage,
                "steps": trainer.steps,
                "memory": trainer.memory,
            }
        )
    return results


# --- the rounds ---------------------------------------------------------------------------------------------------


def round_plan(round_: int, microbatches: Sequence[int]) -> list[tuple[int, list[tuple[str, int]], int]]:
    """Round ``round_``'s spawns in order, as ``(world_size, [(variant, M), ...], M)``: the microbatch counts
    rotated, for each the 2-rank variants rotated, the 2-rank spawn first in even rounds, the world of one first
    in odd ones."""
    spawns = []
    for m in rotated(microbatches, round_):
        two = [(variant, m) for variant in rotated(TWO_RANKS, round_)]
        pair = [(2, two, m), (1, [(variant, m) for variant in rotated(ONE_RANK, round_)], m)]
        spawns += pair if round_ % 2 == 0 else pair[::-1]
    return spawns


def run_rounds(rounds: int, steps: int, microbatches: Sequence[int]) -> list[dict[str, Any]]:
    """Every fit of every round, each rank's record separately."""
    max_steps = WARMUP + steps + 1
    fits = []
    for round_ in range(rounds):
        for world_size, plan, m in round_plan(round_, microbatches):
            names = ", ".join(variant for variant, _ in plan)
            progress(f"[pipeline] round {round_ + 1}/{rounds}, M={m}: {names} on {world_size} rank(s)")
            # About 40 times what a fit takes on this machine.
            timeout = 120 + 2 * len(plan) * max_steps * m
            with tempfile.TemporaryDirectory(prefix="ddpkit-bench-pipeline-") as root:
                arguments = (plan, max_steps, round_, root)
                for per_rank in run_on_ranks(_fits, world_size, args=arguments, timeout=timeout):
                    fits += per_rank
    return fits


# --- the summary --------------------------------------------------------------------------------------------------


def timed(records: list[dict[str, float]], steps: int) -> list[dict[str, float]]:
    """The timed steps of one fit: after the ``WARMUP`` ones, before the memory-counting last one."""
    return [record for record in records if WARMUP < record["step"] <= WARMUP + steps]


def pipeline_spans(stage_fits: Sequence[dict[str, Any]], steps: int) -> list[float]:
    """Each timed step's pipeline span: from the first stage entering ``schedule.step`` to the last leaving it.

    A stage's own span would miss part of the fill or the drain (under GPipe the last stage leaves its step
    after its last backward, while stage 0 still runs its own); the theory's bubble is idle time within
    the whole pipeline's step, on every stage alike."""
    by_step: dict[int, list[dict[str, float]]] = {}
    for fit in stage_fits:
        for record in timed(fit["steps"], steps):
            by_step.setdefault(record["step"], []).append(record)
    return [
        max(r["ended"] for r in records) - min(r["began"] for r in records)
        for _, records in sorted(by_step.items())
        if len(records) == len(stage_fits)
    ]


def summarize(fits: list[dict[str, Any]], *, steps: int, microbatches: Sequence[int]) -> list[dict[str, Any]]:
    """One row per (M, variant): per round, the step time and the paired throughput ratios, and for the schedules
    the pipeline's span and each stage's bubble, compute and activations held. Pure: from the fits' records."""
    # (round, M, variant) -> the slower rank's median step time
    step_time: dict[tuple[int, int, str], float] = {}
    # (round, M, variant, stage) -> that pipelined rank's fit
    stage_fits: dict[tuple[int, int, str, int], dict[str, Any]] = {}
    # (round, M) -> each stage's median compute alone
    alone: dict[tuple[int, int], list[float]] = {}
    for fit in fits:
        key = (fit["round"], fit["microbatches"], fit["variant"])
        if fit["variant"] == "alone":
            alone[key[:2]] = [statistics.median(seconds) for seconds in fit["alone_s"]]
            continue
        median = statistics.median(record["seconds"] for record in timed(fit["steps"], steps))
        step_time[key] = max(step_time.get(key, 0.0), median)
        if fit["stage"] is not None:
            stage_fits[(*key, fit["stage"])] = fit
    rounds = sorted({fit["round"] for fit in fits})
    rows = []
    for m in microbatches:
        for variant in VARIANTS:
            row: dict[str, Any] = {
                "microbatches": m,
                "variant": variant,
                "step_s": [step_time[(r, m, variant)] for r in rounds],
                "vs_one": [step_time[(r, m, "one")] / step_time[(r, m, variant)] for r in rounds],
                "vs_ddp": [step_time[(r, m, "ddp")] / step_time[(r, m, variant)] for r in rounds],
            }
            if variant in SCHEDULES:
                per_round = [[stage_fits[(r, m, variant, stage)] for stage in range(STAGES)] for r in rounds]
                spans = [pipeline_spans(of_round, steps) for of_round in per_round]
                row["ideal"] = ideal_speedup(STAGES, m)
                row["theory_bubble"] = bubble_fraction(STAGES, m)
                row["span_s"] = [statistics.median(of_round) for of_round in spans]
                row["stages"] = [
                    _stage_row(
                        variant,
                        m,
                        stage,
                        [of_round[stage] for of_round in per_round],
                        spans,
                        [alone[(r, m)][stage] for r in rounds],
                        steps=steps,
                    )
                    for stage in range(STAGES)
                ]
            rows.append(row)
    return rows


def _stage_row(
    variant: str,
    m: int,
    stage: int,
    fits: list[dict[str, Any]],
    spans: list[list[float]],
    alone: list[float],
    *,
    steps: int,
) -> dict[str, Any]:
    """One stage of one schedule, per round: its bubble in the pipeline's spans, its busy time per step, its compute
    alone (and the bubble that would be inferred from it), what it held."""
    row: dict[str, Any] = {"stage": stage, "bubble": [], "busy_s": [], "idle_s": [], "p2p_s": []}
    row.update(alone_s=alone, alone_bubble=[])
    for fit, of_round, seconds in zip(fits, spans, alone):
        records = timed(fit["steps"], steps)
        busy = [record["busy"] for record in records]
        row["bubble"].append(measured_bubble(sum(busy), sum(of_round)))
        row["busy_s"].append(statistics.median(busy))
        row["idle_s"].append(statistics.median(span - b for span, b in zip(of_round, busy)))
        row["p2p_s"].append(statistics.median(record["p2p"] for record in records))
        row["alone_bubble"].append(measured_bubble(seconds, statistics.median(of_round)))
    row["slowdown"] = [busy / seconds for busy, seconds in zip(row["busy_s"], alone)]
    # Saved tensors do not depend on timing: every round counts the same bytes (the JSON keeps each).
    row["peak_bytes"] = [fit["memory"]["peak_bytes"] for fit in fits]
    per_microbatch = fits[0]["memory"]["packed_bytes"] / m
    row["held"] = statistics.median(row["peak_bytes"]) / per_microbatch
    row["expected_held"] = expected_held(variant, stage=stage, stages=STAGES, microbatches=m)
    return row


def spread(values: Sequence[float], digits: int = 2, *, scale: float = 1.0) -> str:
    """``median (min..max)`` of ``values`` times ``scale``, or the one value when there is one."""
    median = statistics.median(values) * scale
    if len(values) == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({min(values) * scale:.{digits}f}..{max(values) * scale:.{digits}f})"


def _throughput_cells(row: dict[str, Any]) -> list[str]:
    variant = row["variant"]
    pipelined = variant in SCHEDULES
    vs_one = statistics.median(row["vs_one"])
    # ddp's ideal: twice a world of one (each rank half the samples, the all-reduce free)
    ideal = row["ideal"] if pipelined else 2.0
    return [
        str(row["microbatches"]),
        variant,
        spread(row["step_s"], 1, scale=1e3),
        spread(row["span_s"], 1, scale=1e3) if pipelined else "-",
        spread(row["vs_one"]) if variant != "one" else "1",
        f"{ideal:.2f}" if variant != "one" else "-",
        f"{vs_one / ideal:.2f}" if variant != "one" else "-",
        f"{statistics.median(row['vs_ddp']):.2f}" if variant != "ddp" else "1",
    ]


def _stage_cells(row: dict[str, Any], stage: dict[str, Any]) -> list[str]:
    percent = [100 * b for b in stage["bubble"]]
    return [
        str(row["microbatches"]),
        row["variant"],
        str(stage["stage"]),
        f"{100 * row['theory_bubble']:.1f}",
        spread(percent, 1),
        f"{statistics.median(stage['bubble']) / row['theory_bubble']:.2f}",
        f"{1e3 * statistics.median(stage['idle_s']):.1f}",
        f"{1e3 * statistics.median(stage['p2p_s']):.1f}",
        f"{100 * statistics.median(stage['alone_bubble']):.1f}",
        spread(stage["alone_s"], 1, scale=1e3),
        f"{statistics.median(stage['slowdown']):.2f}",
        f"{statistics.median(stage['peak_bytes']) / 2**20:.2f}",
        f"{stage['held']:.2f}",
        str(stage["expected_held"]),
    ]


#: What the first table's columns mean, printed under it.
THROUGHPUT_LEGEND = """\
  step ms: the Trainer's step (median over the timed steps, then over rounds: min..max); the same global batch
    of 32 x M rows in every variant. sched ms: the pipeline's span, the first stage entering schedule.step to
    the last one leaving it.
  x one, x ddp: that variant's step time over this one's, paired by round: the throughput ratio.
  ideal: 2M/(M+1) for pp2 (P x (1 - bubble)), 2 for ddp. of ideal: x one / ideal; the goal for pp2 is >= 0.8."""

#: What the second table's columns mean.
STAGE_LEGEND = """\
  bubble %: the stage's idle share of the pipeline's span inside the run, 1 - (its forward, backward, loss and
    gradient scaling) / (the span), summed over the timed steps; theory %: (P-1)/(M+P-1); the goal: within 10%.
  idle ms: the span minus that compute, per step; in p2p ms: the stage's time inside torch's posting of sends
    and receives and its waits for them (the fill and drain's waits are there too). The rest of idle: the
    schedule's own Python, and the part of the span outside this stage's own schedule.step (it may enter after
    the other stage, or leave before it).
  1-alone/span %: the bubble inferred from the stage's compute timed alone instead (counts any slowdown of
    compute as idle). alone ms: that compute, M microbatches with no pipeline and nothing else running (stage 0
    computes no input gradient, the last stage the loss: stage 0 is the lighter one). busy/alone: the compute
    inside the run over alone (two busy ranks on two cores).
  act. MiB: autograd's saved tensors at their peak over one step (parameters excluded); held: that peak in
    microbatches (peak / (everything saved in the step / M)); expected: GPipe M, 1F1B P - stage."""


def report(rows: list[dict[str, Any]], *, meta: dict[str, Any]) -> str:
    """The heading, the two tables and what their columns mean."""
    heading = (
        f"pipeline benchmark: {BLOCKS} x Linear({WIDTH}, {WIDTH}) + ReLU in 2 stages, microbatches of {ROWS} rows; "
        f"{meta['rounds']} round(s) x {meta['steps']} timed steps after {WARMUP} warm-up; Gloo, 1 thread a rank, "
        f"torch {meta['torch']}\nload average before {meta['load_before']}, after {meta['load_after']}"
    )
    first = table(
        "step time and throughput",
        ["M", "variant", "step ms", "sched ms", "x one", "ideal", "of ideal", "x ddp"],
        [_throughput_cells(row) for row in rows],
    )
    second = table(
        "bubble and activations, per stage",
        ["M", "schedule", "stage", "theory %", "bubble %", "x theory", "idle ms", "in p2p ms", "1-alone/span %"]
        + ["alone ms", "busy/alone", "act. MiB", "held", "expected"],
        [_stage_cells(row, stage) for row in rows if row["variant"] in SCHEDULES for stage in row["stages"]],
    )
    return "\n\n".join([heading, first + "\n" + THROUGHPUT_LEGEND, second + "\n" + STAGE_LEGEND])


# --- the command --------------------------------------------------------------------------------------------------


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per fit, after the warm-up ones")
    parser.add_argument("--microbatches", default="2,4,8", help="the values of M, comma-separated (even: ddp)")
    parser.add_argument("--quick", action="store_true", help="1 round x 3 timed steps: a check that it runs")
    parser.add_argument("--output", type=Path, default=None, help="the JSON file (default under benchmarks/data/)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
        args.steps = 3
    args.microbatches = [int(m) for m in args.microbatches.split(",")]
    if any(m < STAGES or m % 2 for m in args.microbatches):
        parser.error(f"--microbatches: even values of at least {STAGES} (1F1B needs M >= P, ddp splits M in two)")
    if args.output is None:
        day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        args.output = REPO / "benchmarks" / "data" / day / ("pipeline-quick.json" if args.quick else "pipeline.json")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    load_before = load_average()
    began = time.perf_counter()
    fits = run_rounds(args.rounds, args.steps, args.microbatches)
    meta = {
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": WARMUP,
        "microbatches": args.microbatches,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_average(),
        "wall_s": round(time.perf_counter() - began, 1),
    }
    rows = summarize(fits, steps=args.steps, microbatches=args.microbatches)
    text = report(rows, meta=meta)
    print(text, flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"meta": meta, "summary": rows, "report": text, "fits": fits}, indent=1) + "\n")
    progress(f"wrote {args.output}")


if __name__ == "__main__":
    main()
