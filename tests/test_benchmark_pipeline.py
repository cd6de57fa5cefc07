"""``benchmarks.pipeline``'s own parts: the theory it compares with, the configs that keep the global batch and the
microbatch the same in every variant, the saved-tensor count behind "activations held", the stage clock, the
round plan, the summary and its tables; and one short real run on 2 Gloo ranks (``--quick`` at M = 2).

    .venv/bin/pytest tests/test_benchmark_pipeline.py
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time

import pytest
import torch
from helpers import REPO
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules

from ddpkit.config.layout import check_layout, microbatches_of
from ddpkit.config.loader import load_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def bench():
    # benchmarks/ is not installed with ddpkit: pytest's pythonpath (".") finds it in the checkout.
    return importlib.import_module("benchmarks.pipeline")


def test_the_theory_is_the_issues_formulas(bench):
    for m in (2, 4, 8):
        assert bench.ideal_speedup(2, m) == pytest.approx(2 * m / (m + 1))
    assert bench.ideal_speedup(4, 4) == pytest.approx(4 * 4 / 7)
    assert [bench.expected_held("gpipe", stage=s, stages=2, microbatches=8) for s in (0, 1)] == [8, 8]
    assert [bench.expected_held("1f1b", stage=s, stages=4, microbatches=8) for s in range(4)] == [4, 3, 2, 1]
    assert bench.expected_held("1f1b", stage=0, stages=4, microbatches=2) == 2
    assert bench.measured_bubble(0.75, 1.0) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="must be positive"):
        bench.measured_bubble(1.0, 0.0)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_every_variant_trains_the_same_global_batch_in_microbatches_of_the_same_rows(bench, m, tmp_path):
    for variant in bench.VARIANTS:
        cfg = load_config(bench.run_config(variant, m, steps=5, output_dir=str(tmp_path)))
        world = 1 if variant == "one" else 2
        check_layout(cfg.parallel, world_size=world)
        replicas = world // cfg.parallel.pipeline
        pieces = microbatches_of(cfg.parallel) if cfg.parallel.pipeline > 1 else cfg.train.grad_accum_steps
        assert cfg.data.global_batch_size == bench.ROWS * m, variant
        assert cfg.data.global_batch_size // (replicas * pieces) == bench.ROWS, variant
    with pytest.raises(ValueError, match="M must be even"):
        bench.run_config("ddp", 3, steps=5, output_dir=str(tmp_path))


def _saved_per_microbatch(width: int, rows: int, blocks: int) -> int:
    # the input, then each block's ReLU output (the next Linear's input: one storage)
    return (blocks + 1) * rows * width * 4


def test_saved_activations_count_each_storage_once_and_follow_the_schedules_order(bench):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
    xs = [torch.randn(4, 8) for _ in range(3)]
    one = _saved_per_microbatch(8, 4, 2)

    gpipe = bench.SavedActivations(excluded=model.parameters())
    with gpipe.hooks():
        outputs = [model(x) for x in xs]
    for out in outputs:
        out.sum().backward()
    del outputs, out
    assert (gpipe.peak_bytes, gpipe.packed_bytes, gpipe.live_bytes) == (3 * one, 3 * one, 0)

    interleaved = bench.SavedActivations(excluded=model.parameters())
    with interleaved.hooks():
        for x in xs:
            model(x).sum().backward()
    assert (interleaved.peak_bytes, interleaved.packed_bytes, interleaved.live_bytes) == (one, 3 * one, 0)

    # Not excluding the parameters: the second Linear's weight counts too (its input's gradient needs it); the
    # first's does not (its input, the data, needs no gradient).
    counted = bench.SavedActivations()
    with counted.hooks():
        model(xs[0]).sum().backward()
    assert counted.peak_bytes == one + model[1][0].weight.numel() * 4


class _Stage:
    """A stand-in for torch's PipelineStage: compute that takes known time."""

    def forward_one_chunk(self, seconds: float) -> torch.Tensor:
        time.sleep(seconds)
        x = torch.randn(4, 4, requires_grad=True)
        # x * x saves x twice: one storage of 64 bytes
        return x * x

    def backward_one_chunk(self, seconds: float) -> None:
        time.sleep(seconds)

    def perform_reduce_grad(self, factor: int) -> None:
        pass


class _Schedule:
    """A stand-in for a single-stage schedule: its step computes 20 ms and waits 10 ms."""

    def __init__(self):
        self._stage = _Stage()
        self.saved: torch.Tensor | None = None

    def _maybe_compute_loss(self, *args: object) -> None:
        pass

    def step(self) -> None:
        self.saved = self._stage.forward_one_chunk(0.01)
        # a receive's wait, then torch's own wait on no work (as a schedule calls it)
        time.sleep(0.01)
        torch_schedules._wait_batch_p2p([])
        self._stage.backward_one_chunk(0.01)
        self._maybe_compute_loss()
        self._stage.perform_reduce_grad(1)


@pytest.fixture
def clocked(bench):
    """A stand-in schedule under a StageClock; torch's p2p helpers put back whatever the test does."""
    schedule = _Schedule()
    clock = bench.StageClock(schedule)
    yield schedule, clock
    clock.close()
    assert all(getattr(torch_schedules, name) is original for name, original in bench.P2P_CALLS.items())


def test_stage_clock_times_compute_as_busy_and_the_step_as_span_and_counts_memory_on_request(bench, clocked):
    schedule, clock = clocked
    schedule.step()
    taken = clock.take()
    assert 0.02 <= taken["busy"] < taken["span"] == taken["ended"] - taken["began"] and taken["span"] >= 0.03
    assert 0 < taken["p2p"] < 0.005
    assert bench.measured_bubble(taken["busy"], taken["span"]) == pytest.approx(1 / 3, abs=0.15)
    with pytest.raises(RuntimeError, match="no schedule.step ran"):
        clock.take()
    # the memory step: the hooks are entered around the schedule's step (and only there)
    clock.memory = bench.SavedActivations()
    schedule.step()
    assert (clock.memory.packed_bytes, clock.memory.live_bytes) == (64, 64)
    schedule.saved = None
    assert clock.memory.live_bytes == 0


def test_each_round_alternates_the_order_of_microbatches_variants_and_spawns(bench):
    first, second = bench.round_plan(0, [2, 4, 8]), bench.round_plan(1, [2, 4, 8])
    assert [(world, m) for world, _, m in first] == [(2, 2), (1, 2), (2, 4), (1, 4), (2, 8), (1, 8)]
    assert [(world, m) for world, _, m in second] == [(1, 4), (2, 4), (1, 8), (2, 8), (1, 2), (2, 2)]
    assert [v for v, _ in first[0][1]] == ["gpipe", "1f1b", "ddp"]
    assert [v for v, _ in second[1][1]] == ["1f1b", "ddp", "gpipe"]
    assert [v for v, _ in first[1][1]] == ["one", "alone"] and [v for v, _ in second[0][1]] == ["alone", "one"]


def _records(seconds: float, *, busy: float | None = None, stamps: tuple[float, float] = (0.0, 0.0)) -> list[dict]:
    """WARMUP (3) steps, 2 timed ones, the memory step; the untimed ones are 10x slower and must not count. A step
    runs ``schedule.step`` from ``stamps[0]`` to ``stamps[1]`` seconds after the second it begins at."""
    records = []
    for step in range(1, 7):
        slow = 1 if 4 <= step <= 5 else 10
        record = {"step": step, "seconds": seconds * slow}
        if busy is not None:
            began, ended = 10.0 * step + stamps[0], 10.0 * step + stamps[1] * slow
            record.update(busy=busy * slow, p2p=0.01 * slow, began=began, ended=ended, span=ended - began)
        records.append(record)
    return records


def _synthetic_fits() -> list[dict]:
    """One round at M = 2: one 0.4 s a step, pp2 0.3 s (stage 0 in schedule.step from 0 to 0.25 s, stage 1 from 0.02
    to 0.23 s: a pipeline span of 0.25 s; stage 0 busy 0.15 s, stage 1 0.2 s), ddp 0.2 s on rank 0 and 0.25 s on
    rank 1; stages alone 0.12 s and 0.16 s."""
    # (peak, packed) bytes per stage: GPipe holds both microbatches on each stage, 1F1B's last stage one
    memory = {"gpipe": [(2000, 2000), (2000, 2000)], "1f1b": [(2000, 2000), (1000, 2000)]}
    fits = [{"round": 0, "variant": "alone", "microbatches": 2, "alone_s": [[0.12, 0.12], [0.16, 0.16]]}]
    for rank in range(2):
        fits.append(
            {"round": 0, "variant": "ddp", "microbatches": 2, "rank": rank, "stage": None, "memory": None}
            | {"steps": _records(0.25 if rank else 0.2)}
        )
        for schedule in ("gpipe", "1f1b"):
            peak, packed = memory[schedule][rank]
            fits.append(
                {"round": 0, "variant": schedule, "microbatches": 2, "rank": rank, "stage": rank}
                | {"steps": _records(0.3, busy=0.15 + 0.05 * rank, stamps=[(0.0, 0.25), (0.02, 0.23)][rank])}
                | {"memory": {"peak_bytes": peak, "packed_bytes": packed}}
            )
    fits.append(
        {"round": 0, "variant": "one", "microbatches": 2, "rank": 0, "stage": None, "memory": None}
        | {"steps": _records(0.4)}
    )
    return fits


def test_summary_pairs_the_variants_and_reads_each_stage(bench):
    rows = {row["variant"]: row for row in bench.summarize(_synthetic_fits(), steps=2, microbatches=[2])}
    assert rows["one"]["step_s"] == [pytest.approx(0.4)] and rows["one"]["vs_one"] == [1.0]
    # the slower rank's step time
    assert rows["ddp"]["step_s"] == [pytest.approx(0.25)]
    gpipe = rows["gpipe"]
    # the first stage's entry to the last one's exit, not either stage's own 0.25 s and 0.21 s
    assert gpipe["span_s"] == [pytest.approx(0.25)]
    assert gpipe["vs_one"] == [pytest.approx(0.4 / 0.3)] and gpipe["vs_ddp"] == [pytest.approx(0.25 / 0.3)]
    assert gpipe["ideal"] == pytest.approx(4 / 3) and gpipe["theory_bubble"] == pytest.approx(1 / 3)
    first, last = gpipe["stages"]
    assert first["bubble"] == [pytest.approx(1 - 0.15 / 0.25)] and last["bubble"] == [pytest.approx(1 - 0.2 / 0.25)]
    assert first["alone_bubble"] == [pytest.approx(1 - 0.12 / 0.25)] and first["slowdown"] == [pytest.approx(1.25)]
    assert (first["held"], first["expected_held"]) == (2, 2)
    one_f_one_b = rows["1f1b"]["stages"]
    assert [(s["held"], s["expected_held"]) for s in one_f_one_b] == [(2, 2), (1, 1)]


def test_report_prints_both_tables_with_the_ratios_and_the_load(bench):
    rows = bench.summarize(_synthetic_fits(), steps=2, microbatches=[2])
    meta = {"rounds": 1, "steps": 2, "torch": "x", "load_before": "0.10 0.20 0.30", "load_after": "0.40 0.50 0.60"}
    text = bench.report(rows, meta=meta)
    assert "load average before 0.10 0.20 0.30, after 0.40 0.50 0.60" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.split()[:3] == ["M", "variant", "step"])
    gpipe = next(line for line in lines if line.split()[:2] == ["2", "gpipe"])
    # step ms, sched ms, x one, ideal, of ideal (1.333 / 1.333), x ddp
    assert gpipe.split()[2:] == ["300.0", "250.0", "1.33", "1.33", "1.00", "0.83"]
    assert header.split()[-1] == "ddp"
    stage = next(line for line in lines if line.split()[:3] == ["2", "1f1b", "1"])
    # theory, bubble, x theory, idle ms, in p2p ms, 1-alone/span, alone ms, busy/alone, MiB, held, expected
    cells = ["33.3", "20.0", "0.60", "50.0", "10.0", "36.0", "160.0", "1.25", "0.00", "1.00", "1"]
    assert stage.split()[3:] == cells
    assert "the goal for pp2 is >= 0.8" in text and "1F1B P - stage" in text
    # multi-round medians print their range
    assert bench.spread([1.0, 2.0, 4.0]) == "2.00 (1.00..4.00)" and bench.spread([0.5], 1, scale=10) == "5.0"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_quick_run_on_two_gloo_ranks_measures_every_variant_and_counts_the_held_microbatches_exactly(tmp_path):
    """In the slow set: it runs `benchmarks.pipeline --quick` on two Gloo ranks for every variant, and the fast set
    keeps test_saved_activations_count_each_storage_once_and_follow_the_schedules_order and
    test_report_prints_both_tables_with_the_ratios_and_the_load."""
    out = tmp_path / "pipeline.json"
    command = [sys.executable, "-m", "benchmarks.pipeline", "--quick", "--microbatches", "2", "--output", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step time and throughput" in done.stdout and "bubble and activations, per stage" in done.stdout
    result = json.loads(out.read_text())
    rows = {row["variant"]: row for row in result["summary"]}
    assert sorted(rows) == ["1f1b", "ddp", "gpipe", "one"]
    for schedule in ("gpipe", "1f1b"):
        for stage in rows[schedule]["stages"]:
            # a count of saved tensors: exact whatever the load
            assert stage["held"] == stage["expected_held"], (schedule, stage)
            assert all(0 <= bubble < 1 for bubble in stage["bubble"])
            # torch's schedule still posts and waits through the helpers the clock wraps
            assert all(seconds > 0 for seconds in stage["p2p_s"])
    assert result["meta"]["load_before"] and result["meta"]["load_after"]
