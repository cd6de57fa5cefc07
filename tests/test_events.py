"""The loop's one event path: listeners hear the events they have methods for, in the order added.

    .venv/bin/pytest -q tests/test_events.py
"""

from __future__ import annotations

import pytest

from ddpkit.reporting.events import Events


class Recorder:
    def __init__(self, name: str, log: list, phases: tuple[str, ...] | None = None):
        self.name, self.log = name, log
        if phases is not None:
            self.phases = phases

    def on_phase(self, span):
        self.log.append((self.name, "phase", span))

    def on_step_end(self, step):
        self.log.append((self.name, "step", step))

    def on_exit(self, status):
        self.log.append((self.name, "exit", status))


class Failing:
    def on_failure(self, error):
        raise RuntimeError("cannot save")

    def on_exit(self, status):
        raise OSError("disk full")


def test_events_reach_listeners_in_order_and_phases_narrow_the_spans(capsys):
    log: list = []
    events = Events()
    events.add(Recorder("all", log), None, Recorder("data-only", log, phases=("data",)), Failing(), Recorder("last", log))
    for listener in events.phase_listeners("data"):
        listener("data")
    for listener in events.phase_listeners("forward"):
        listener("forward")
    events.step_end(3)
    events.failure(ValueError("peer died"))  # a failing listener is reported, the next still runs
    events.exit("FAILED")
    assert log == [
        ("all", "phase", "data"), ("data-only", "phase", "data"), ("last", "phase", "data"),
        ("all", "phase", "forward"), ("last", "phase", "forward"),
        ("all", "step", 3), ("data-only", "step", 3), ("last", "step", 3),
        ("all", "exit", "FAILED"), ("data-only", "exit", "FAILED"), ("last", "exit", "FAILED"),
    ]
    err = capsys.readouterr().err
    assert "Failing.on_failure failed: RuntimeError: cannot save" in err and "Failing.on_exit failed: OSError: disk full" in err


def test_a_phases_attribute_that_is_not_a_tuple_of_names_is_refused():
    class Stack:
        phases = ["setup"]  # state, not a filter: the watchdog once had such an attribute

        def on_phase(self, span): ...

    with pytest.raises(TypeError, match="Stack.phases must be a tuple of span names"):
        Events().add(Stack())


def test_the_span_cache_is_emptied_in_place_when_a_listener_joins():
    events = Events()
    cache = events.span_cache
    cache["data"] = object()
    events.add(Recorder("late", []))
    assert cache == {} and events.span_cache is cache
