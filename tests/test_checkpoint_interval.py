"""``checkpoint.every_steps: auto``: the Young/Daly formula, the interval's re-estimates, the ranks' agreement,
a real run.

    .venv/bin/pytest -q tests/test_checkpoint_interval.py
"""

from __future__ import annotations

import math
import re

import pytest
from helpers import run_in_pool, tiny_config

import ddpkit
from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint import interval
from ddpkit.checkpoint.interval import AutoInterval, YoungDaly, describe, interval_steps, young_daly_seconds
from ddpkit.config.loader import load_config
from ddpkit.distributed.collectives import broadcast_object
from ddpkit.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

CHOICE = re.compile(r"checkpoint\.every_steps=auto: every (\d+) steps from step (\d+) \(a save blocks .+ Young/Daly")


def test_young_daly_period_and_its_conversion_to_steps():
    assert young_daly_seconds(24.0, 0.2) == pytest.approx(math.sqrt(2 * 24 * 3600 * 0.2))  # 185.9 s
    assert young_daly_seconds(1.0, 1.8) == pytest.approx(113.84, abs=0.01)
    assert interval_steps(185.9, 0.0123) == 15114
    assert interval_steps(1.0, 0.4) == 2  # rounded: 2.5 -> 2 (round half to even), 2.6 -> 3
    assert interval_steps(1.04, 0.4) == 3
    assert interval_steps(0.001, 5.0) == 1  # never less than one step
    with pytest.raises(ValueError):
        interval_steps(1.0, 0.0)


def test_the_log_line_names_the_interval_and_its_inputs():
    line = describe(340, since=100, save_seconds=0.21, step_seconds=0.0123, mtbf_hours=24)
    assert line == (
        "checkpoint.every_steps=auto: every 340 steps from step 100 (a save blocks 210 ms, a step takes 12.3 ms, "
        "checkpoint.mtbf_hours=24: Young/Daly sqrt(2*MTBF*T_save) = 3.2 min)"
    )
    assert "a step takes 1.5 s, checkpoint.mtbf_hours=100: Young/Daly sqrt(2*MTBF*T_save) = 5.8 h)" in describe(
        9, since=0, save_seconds=600, step_seconds=1.5, mtbf_hours=100
    )
    assert CHOICE.search(line).groups() == ("340", "100")


def _saved(auto: AutoInterval, *, blocked: float, since: int) -> None:
    """What the checkpointer does after a save: rank 0's measurement, broadcast (with the save's outcome), adopted."""
    auto.adopt(broadcast_object(auto.measurement(blocked)), since=since)


def _timed(auto: AutoInterval, step_seconds: list[float]) -> AutoInterval:
    auto._step_times.extend(step_seconds)  # what tick() records, without waiting for it
    return auto


def test_first_guess_then_measured_then_only_changes_beyond_a_fifth():
    auto = AutoInterval(mtbf_hours=1.0)
    assert auto.every == interval.FIRST_EVERY and not auto.measured
    assert not auto.due(interval.FIRST_EVERY - 1) and auto.due(interval.FIRST_EVERY)
    _saved(auto, blocked=0.5, since=1)  # no step timed yet: nothing to convert with
    assert auto.every == interval.FIRST_EVERY and not auto.measured
    _timed(auto, [0.1, 0.1, 9.0])  # median: an evaluation's long step does not count
    _saved(auto, blocked=0.5, since=100)
    expected = interval_steps(young_daly_seconds(1.0, 0.5), 0.1)  # sqrt(3600) = 60 s -> 600 steps
    assert auto.measured and auto.every == expected == 600
    _timed(auto, [0.1, 0.1])
    _saved(auto, blocked=0.6, since=700)  # 657 steps: within 20% of 600, kept
    assert auto.every == 600
    _saved(auto, blocked=2.0, since=1300)  # 1200 steps: a real change
    assert auto.every == 1200


def test_the_planner_keeps_saves_within_a_budget_whatever_the_mtbf():
    """The memory snapshots' use: with an MTBF of 3.6 s, Young/Daly says every 0.27 s; 1% of the time says 1 s."""
    plan = YoungDaly(0.001, every=20, budget=0.01)
    assert plan.period(0.01) == pytest.approx(math.sqrt(2 * 3.6 * 0.01))
    assert plan.update(blocked=0.01, step_seconds=0.01) and plan.every == 100 and plan.planned
    assert not plan.update(blocked=0.011, step_seconds=0.01) and plan.every == 100  # 110: within a fifth


def test_a_save_step_is_not_a_step_time():
    auto = AutoInterval(mtbf_hours=1.0)
    auto.tick()
    auto.tick()
    assert len(auto._step_times) == 1
    _saved(auto, blocked=0.0, since=2)
    auto.tick()  # the step that carried the save: only starts the clock again
    assert len(auto._step_times) == 1


@pytest.mark.parametrize(
    ("checkpoint", "key", "message"),
    [
        ({"every_steps": "autox"}, "checkpoint.every_steps", "did you mean 'auto'"),
        ({"every_steps": 0}, "checkpoint.every_steps", ">= 1"),
        ({"every_steps": "auto", "mtbf_hours": 0}, "checkpoint.mtbf_hours", "> 0"),
        ({"mtbf_hours": -2.5}, "checkpoint.mtbf_hours", "> 0"),
    ],
)
def test_bad_values_name_the_key(checkpoint, key, message):
    with pytest.raises(ConfigError) as error:
        load_config({"checkpoint": checkpoint})
    assert key in str(error.value) and message in str(error.value)


def test_auto_from_yaml_and_the_command_line():
    assert load_config({"checkpoint": {"every_steps": "auto"}}).checkpoint.mtbf_hours == 24.0
    ck = load_config(None, ["checkpoint.every_steps=auto", "checkpoint.mtbf_hours=0.5"]).checkpoint
    assert (ck.every_steps, ck.mtbf_hours) == ("auto", 0.5)


def _choose_on_each_rank(mtbf_hours: float) -> tuple[int, int]:
    import torch.distributed as dist

    rank = dist.get_rank()
    auto = _timed(AutoInterval(mtbf_hours=mtbf_hours), [0.01 * (rank + 1)] * 3)  # each rank measures differently
    _saved(auto, blocked=0.1 * (rank + 1), since=100)
    first = auto.every
    _saved(auto, blocked=10.0 * (rank + 1), since=200)
    return first, auto.every


def test_every_rank_follows_rank_0s_measurements():
    results = run_in_pool(_choose_on_each_rank, world_size=2, args=(1.0,), timeout=60)
    rank0 = (interval_steps(young_daly_seconds(1.0, 0.1), 0.01), interval_steps(young_daly_seconds(1.0, 10.0), 0.01))
    assert results == [rank0, rank0]


def test_a_run_saves_at_the_logged_intervals(tmp_path, monkeypatch):
    """A save blocks milliseconds here and a step under one: an MTBF of 11 ms makes the interval tens of steps."""
    monkeypatch.setattr(interval, "FIRST_EVERY", 20)
    cfg = tiny_config(
        tmp_path,
        train={"epochs": 16},  # 16 steps an epoch: 256 steps
        checkpoint={
            "every_steps": "auto",
            "mtbf_hours": 3e-6,
            "keep_last": 1000,
            "resume": "none",
            "memory_every_steps": None,
        },
        log={"rank_files": True},
    )
    ddpkit.Trainer(cfg).fit()
    run = tmp_path / "run"
    choices = [(int(every), int(since)) for every, since in CHOICE.findall((run / "logs" / "rank0.log").read_text())]
    saved = [info.step for info in ckpt.list_checkpoints(run / "checkpoints")]
    assert choices and choices[0][1] == 20, choices  # picked at the first save, which the first guess placed
    expected, last, every = [], 0, 20
    for step in range(1, 257):  # replay the schedule the log announced
        if step - last >= every:
            expected.append(step)
            last = step
        every = next((e for e, since in choices if since == step == last), every)
    assert saved == sorted({*expected, 256}), (choices, saved)  # 256: the end of the run is always saved
    assert len(expected) >= 2, (choices, saved)  # the first guess, then at least one interval that was chosen
