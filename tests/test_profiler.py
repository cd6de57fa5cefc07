"""train.profile: torch.profiler traces per rank with ProfilerStep spans and ddpkit's phases.

.venv/bin/pytest -q tests/test_profiler.py
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_in_pool, tiny_config

from ddpkit.config.profile_section import ProfileConfig
from ddpkit.config.train_sections import TrainConfig
from ddpkit.reporting.events import Events
from ddpkit.reporting.profiler import PHASE_PREFIX, PROFILE_DIR, Profiler

pytestmark = pytest.mark.timeout(120)


def _span_names(trace: Path) -> set[str]:
    return {event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]}


def _train_listening(profiler: Profiler | None, steps: int) -> None:
    """A few DDP steps of a tiny model, each phase delivered to the listeners as the Reporter does."""
    events = Events()
    events.add(profiler)
    model = (
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
        if dist.is_initialized()
        else torch.nn.Linear(8, 2)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def phase(name, work):
        listeners = events.phase_listeners(name)
        for listener in listeners:
            listener(name)
        result = work()
        for listener in listeners:
            listener(None)
        return result

    events.fit_start()
    for step in range(1, steps + 1):
        x = phase("data", lambda: torch.randn(4, 8))
        loss = phase("forward", lambda: model(x).square().mean())  # noqa: B023 - called at once
        phase("backward", loss.backward)
        phase("optimizer", lambda: (optimizer.step(), optimizer.zero_grad()))
        events.step_end(step)
    events.exit("FINISHED")


def _profile_two_steps(out: Path) -> list[str]:
    rank = dist.get_rank()
    profiler = Profiler(wait=1, warmup=1, active=2, repeat=1, trace_dir=out / PROFILE_DIR, rank=rank)
    _train_listening(profiler, steps=6)
    return [str(p) for p in profiler.traces]


@pytest.mark.multiprocess
def test_each_of_two_ranks_writes_a_trace_with_profiler_steps_and_the_loops_phases(tmp_path):
    traces = run_in_pool(_profile_two_steps, world_size=2, args=(tmp_path,), timeout=90)
    assert [len(t) for t in traces] == [1, 1]  # repeat=1: one recorded cycle, one file per rank
    files = sorted((tmp_path / PROFILE_DIR).iterdir())
    assert [f.name.split(".")[0] for f in files] == ["rank0", "rank1"] and all(
        f.name.endswith(".pt.trace.json") for f in files
    )
    for trace in files:
        names = _span_names(trace)
        steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
        assert steps == ["ProfilerStep#2", "ProfilerStep#3"], steps  # wait 1, warmup 1, then two active steps
        assert {PHASE_PREFIX + p for p in ("data", "forward", "backward", "optimizer")} <= names
        assert "aten::addmm" in names  # torch's own operators, inside the phases


def test_a_cycle_cut_short_by_the_end_of_training_is_still_written(tmp_path):
    profiler = Profiler(wait=0, warmup=1, active=50, repeat=1, trace_dir=tmp_path, rank=0)
    _train_listening(profiler, steps=4)
    assert len(profiler.traces) == 1 and "ProfilerStep#3" in _span_names(profiler.traces[0])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_after_the_last_cycle_the_listener_stops_and_labels_nothing(tmp_path):
    profiler = Profiler(wait=0, warmup=0, active=1, repeat=2, trace_dir=tmp_path, rank=3)
    _train_listening(profiler, steps=5)
    assert len(profiler.traces) == 2 and all(p.name.startswith("rank3.") for p in profiler.traces)
    assert not profiler._running and not profiler._ranges
    profiler.on_phase("forward")  # after the schedule: returns at once, opens nothing
    assert not profiler._ranges


def test_no_section_no_listener():
    from ddpkit.config.loader import load_config

    cfg = load_config(tiny_config("/tmp/x"))
    assert Profiler.for_run(cfg, rank=0, device=torch.device("cpu")) is None


def test_the_section_defaults_and_ranges():
    assert ProfileConfig() == ProfileConfig(wait=1, warmup=1, active=3, repeat=1)
    limits = {f.name: (f.metadata["ge"], f.metadata["gt"]) for f in dataclasses.fields(ProfileConfig)}
    assert limits == {"wait": (0, None), "warmup": (0, None), "active": (1, None), "repeat": (0, None)}


def _fit_profiled(tmp: Path) -> list[str]:
    from ddpkit.trainer import Trainer

    cfg = tiny_config(
        tmp, train={"epochs": 1, "max_steps": 6, "profile": {"wait": 1, "warmup": 1, "active": 2, "repeat": 1}}
    )
    Trainer(cfg).fit()
    return sorted(p.name for p in (Path(cfg["run"]["output_dir"]) / PROFILE_DIR).iterdir())


@pytest.mark.multiprocess
@pytest.mark.skipif(
    "profile" not in {f.name for f in dataclasses.fields(TrainConfig)},
    reason="train.profile is not wired into the Trainer yet",
)
def test_a_two_rank_fit_with_train_profile_writes_a_trace_per_rank(tmp_path):
    names = run_in_pool(_fit_profiled, world_size=2, args=(tmp_path,), timeout=90)[0]
    assert [n.split(".")[0] for n in names] == ["rank0", "rank1"]
    for name in names:
        spans = _span_names(Path(tmp_path) / "run" / PROFILE_DIR / name)
        assert "ProfilerStep#2" in spans and PHASE_PREFIX + "forward" in spans
