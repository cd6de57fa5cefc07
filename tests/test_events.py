"""The loop's one event path: listeners hear the events they have methods for, in the order added.

.venv/bin/pytest -q tests/test_events.py
"""

from __future__ import annotations

import pytest

from ddpkit.reporting.events import EVENTS, Events, Listener


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
    events.add(
        Recorder("all", log), None, Recorder("data-only", log, phases=("data",)), Failing(), Recorder("last", log)
    )
    for listener in events.phase_listeners("data"):
        listener("data")
    for listener in events.phase_listeners("forward"):
        listener("forward")
    events.step_end(3)
    events.failure(ValueError("peer died"))  # a failing listener is reported, the next still runs
    events.exit("FAILED")
    assert log == [
        ("all", "phase", "data"),
        ("data-only", "phase", "data"),
        ("last", "phase", "data"),
        ("all", "phase", "forward"),
        ("last", "phase", "forward"),
        ("all", "step", 3),
        ("data-only", "step", 3),
        ("last", "step", 3),
        ("all", "exit", "FAILED"),
        ("data-only", "exit", "FAILED"),
        ("last", "exit", "FAILED"),
    ]
    err = capsys.readouterr().err
    assert (
        "Failing.on_failure failed: RuntimeError: cannot save" in err
        and "Failing.on_exit failed: OSError: disk full" in err
    )


def test_a_phases_attribute_that_is_not_a_tuple_of_names_is_refused():
    class Stack:
        phases = ["setup"]  # state, not a filter: the watchdog once had such an attribute

        def on_phase(self, span): ...

    with pytest.raises(TypeError, match="Stack.phases must be a tuple of span names"):
        Events().add(Stack())


def test_a_listener_added_after_a_span_was_used_hears_it_and_the_step_boundary_events():
    log: list = []
    events = Events()
    events.add(Recorder("early", log))
    with events.phase("data"):
        pass
    events.add(Recorder("late", log), Boundary(log))
    with events.phase("data"):
        pass
    events.step_start(4)
    events.update_start(4)
    assert log == [
        ("early", "phase", "data"),
        ("early", "phase", None),
        ("early", "phase", "data"),
        ("late", "phase", "data"),
        ("early", "phase", None),
        ("late", "phase", None),
        ("boundary", "step_start", 4),
        ("boundary", "update_start", 4),
    ]


class Boundary(Listener):
    """Overrides two events of the documented base; the base's no-ops are never called for it."""

    def __init__(self, log: list):
        self.log = log

    def on_step_start(self, step):
        self.log.append(("boundary", "step_start", step))

    def on_update_start(self, step):
        self.log.append(("boundary", "update_start", step))


def test_a_listener_base_documents_every_event_and_costs_nothing_for_what_it_does_not_override():
    events = Events()
    events.add(Boundary([]))
    assert events.phase_listeners("data") == ()  # the base's on_phase is not called: no cost on the step path
    assert {"on_step_start", "on_update_start", "on_exit", "on_phase"} <= set(EVENTS)
    assert all(getattr(Listener, event).__doc__ for event in EVENTS), "every event has a docstring on Listener"


def test_a_method_named_like_a_hook_that_names_no_event_is_refused_with_the_closest_event():
    class Misspelt:
        on_divergence = "warn"  # an on_ attribute that is not a method: not a hook, left alone

        def on_step_ned(self, step): ...

    with pytest.raises(TypeError, match=r"Misspelt\.on_step_ned names no event.*did you mean 'on_step_end'\?"):
        Events().add(Misspelt())

    class Unlike:
        def on_everything(self): ...

    with pytest.raises(TypeError, match=r"Unlike\.on_everything names no event.*the events are on_phase, "):
        Events().add(Unlike())
