"""The loop's one event path: an ordered list of listeners, called in the order they were added.

    events = Events()
    events.add(watchdog, ledger, crash_save, health, trainer)   # the order every event is delivered in
    with reporter.span("data"): ...     # on_phase("data") as it starts, on_phase(None) as it ends
    events.step_end(step)               # on_step_end(step) of every listener that has one
    events.failure(error)               # fit() failed: on_failure(error) (the crash save saves here)
    events.exit("FAILED")               # the attempt ended, any way: on_exit(status)

A listener is any object; it receives the events it has a method for, and no others:
``on_phase(name)`` (a span of the loop starts with its name, ends with None; a listener may narrow
the spans it hears with a ``phases`` attribute), ``on_fit_start()``, ``on_epoch_start(epoch)``,
``on_step_end(step)``, ``on_log(record)``, ``on_validation_end(metrics)``, ``on_epoch_end(epoch)``,
``on_fit_end(metrics)``, ``on_failure(error)`` and ``on_exit(status)``. The Trainer adds itself
last, so a user's ``on_*`` hooks run after ddpkit's own listeners have seen the same event.

As detectron2's ``TrainerBase`` runs its hooks: one list, one order, visible in one place (the
Trainer's ``_attach``). The bound methods are collected once per event when a listener is added,
so delivering an event on the step path is a loop over a short tuple. A failing ``on_failure`` or
``on_exit`` is printed and the next listener still runs: the original failure is what the user
must see, and every listener must get its chance to clean up.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = ["Events", "EVENTS"]

#: Every event, as the method name a listener defines to receive it.
EVENTS = (
    "on_phase", "on_fit_start", "on_epoch_start", "on_step_end", "on_log", "on_validation_end",
    "on_epoch_end", "on_fit_end", "on_failure", "on_exit",
)


class Events:
    """The ordered listeners of one run, and the calls that deliver each event to them."""

    def __init__(self) -> None:
        self.listeners: list[Any] = []
        self._calls: dict[str, tuple[Callable[..., Any], ...]] = dict.fromkeys(EVENTS, ())
        #: Per span name, whatever a deliverer keeps (the Reporter: its reusable span); emptied by :meth:`add`.
        self.span_cache: dict[str, Any] = {}

    def add(self, *listeners: Any) -> None:
        """Append ``listeners`` (None is skipped: a subsystem that is off); each receives the events it has methods for."""
        for listener in listeners:
            if listener is None:
                continue
            phases = getattr(listener, "phases", None)
            if phases is not None and not (isinstance(phases, tuple) and all(isinstance(p, str) for p in phases)):
                raise TypeError(f"{type(listener).__name__}.phases must be a tuple of span names (the spans its on_phase hears), got {phases!r}")
            self.listeners.append(listener)
            for event in EVENTS:
                method = getattr(listener, event, None)
                if callable(method):
                    self._calls[event] += (method,)
        self.span_cache.clear()  # in place: holders of this dict see it emptied

    def phase_listeners(self, name: str) -> tuple[Callable[[str | None], None], ...]:
        """The ``on_phase`` methods that hear spans called ``name`` (a listener's ``phases`` narrows them)."""
        return tuple(method for method in self._calls["on_phase"] if name in (getattr(method.__self__, "phases", None) or (name,)))

    def fit_start(self) -> None:
        for call in self._calls["on_fit_start"]:
            call()

    def epoch_start(self, epoch: int) -> None:
        for call in self._calls["on_epoch_start"]:
            call(epoch)

    def step_end(self, step: int) -> None:
        for call in self._calls["on_step_end"]:
            call(step)

    def log(self, record: dict[str, Any]) -> None:
        for call in self._calls["on_log"]:
            call(record)

    def validation_end(self, metrics: dict[str, float]) -> None:
        for call in self._calls["on_validation_end"]:
            call(metrics)

    def epoch_end(self, epoch: int) -> None:
        for call in self._calls["on_epoch_end"]:
            call(epoch)

    def fit_end(self, metrics: dict[str, float]) -> None:
        for call in self._calls["on_fit_end"]:
            call(metrics)

    def failure(self, error: BaseException) -> None:
        """fit() failed with ``error``: every ``on_failure``, each guarded (see the module docstring)."""
        self._each_guarded("on_failure", error)

    def exit(self, status: str) -> None:
        """The attempt ended with ``status`` (FINISHED, STOPPED or FAILED): every ``on_exit``, each guarded."""
        self._each_guarded("on_exit", status)

    def _each_guarded(self, event: str, argument: Any) -> None:
        for call in self._calls[event]:
            try:
                call(argument)
            except Exception as problem:
                name = getattr(call, "__qualname__", call)
                print(f"ddpkit: {name} failed: {type(problem).__name__}: {problem}", file=sys.stderr, flush=True)
