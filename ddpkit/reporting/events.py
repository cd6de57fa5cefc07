"""The loop's one event path: an ordered list of listeners, called in the order they were added.

    events = Events()
    events.add(watchdog, ledger, crash_save, health, trainer)   # the order every event is delivered in
    events.step_start(step)             # an optimizer step begins: steps 1..step are complete
    with reporter.span("data"): ...     # on_phase("data") as it starts, on_phase(None) as it ends
    events.update_start(step)           # the optimizer is about to change the parameters
    events.step_end(step)               # on_step_end(step) of every listener that has one
    events.failure(error)               # fit() failed: on_failure(error) (the crash save saves here)
    events.exit("FAILED")               # the attempt ended, any way: on_exit(status)
    events.position.phase               # the innermost span running now, read from any thread (the watchdog's)

A listener is any object; it receives the events it has a method for, and no others. :class:`Listener`
documents every event with a no-op method; subclassing it is optional, and a method it does not override
is never called. A method whose name starts with ``on_`` but names no event is refused when the listener
is added, with the closest event's name: a misspelt hook would otherwise never run. The Trainer adds itself
last, so a user's ``on_*`` hooks run after ddpkit's own listeners have seen the same event;
``on_exit(status)`` is the one teardown every run component gets, in the list's order.

As detectron2's ``TrainerBase`` runs its hooks: one list, one order (the Trainer adds each listener as its
setup builds it, itself last), and each event a plain loop over the methods collected when a listener was
added. A failing ``on_failure`` or ``on_exit`` is printed and the next listener still runs: the original
failure is what the user must see, and every listener must get its chance to clean up.

Where the training thread is needs no listener: the spans write it into :attr:`Events.position` as they
start and end (two attribute writes and a count, no call), and a thread that wants it reads it there. The
hang watchdog does, twice a second; hearing every span edge instead cost it 8 calls a step.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["Events", "EVENTS", "Listener", "PhaseSpan", "Position"]


class Listener:
    """Every event of the loop, each a no-op: override the ones a listener needs (see the module docstring)."""

    #: The span names ``on_phase`` hears; None: every span.
    phases: tuple[str, ...] | None = None

    def on_phase(self, name: str | None) -> None:
        """A span of the loop starts (``name``: data, forward, backward, optimizer, ...) or ends (None)."""

    def on_fit_start(self) -> None:
        """After setup and resume, before the first step."""

    def on_epoch_start(self, epoch: int) -> None:
        """Before the first batch of ``epoch``."""

    def on_step_start(self, step: int) -> None:
        """Before the first micro-batch of the next optimizer step: steps 1..``step`` are complete, their
        validation and checkpoint included (the step boundary the crash save and memory snapshots use)."""

    def on_update_start(self, step: int) -> None:
        """The optimizer is about to change the parameters for step ``step + 1`` (they differ from the boundary's
        from here)."""

    def on_step_end(self, step: int) -> None:
        """After optimizer step ``step`` (1-based), every step: keep it cheap, no host syncs."""

    def on_log(self, record: dict[str, Any]) -> None:
        """Every ``log_every`` steps, with the rank-reduced training record."""

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        """After each validation, with the exact global metrics (every rank)."""

    def on_epoch_end(self, epoch: int) -> None:
        """After the last batch of ``epoch``."""

    def on_fit_end(self, metrics: dict[str, float]) -> None:
        """After training, with the metrics ``fit()`` returns."""

    def on_failure(self, error: BaseException) -> None:
        """``fit()`` failed with ``error`` (the crash save saves here)."""

    def on_exit(self, status: str) -> None:
        """The attempt ended, any way (FINISHED, STOPPED or FAILED): release what this listener holds."""


#: Every event, as the method name a listener defines to receive it.
EVENTS = tuple(name for name in vars(Listener) if name.startswith("on_"))


class Position:
    """Where the training thread is: ``phase``, the innermost span running ("setup" until ``fit_start``, then
    "loop" between spans), and ``edges``, the span starts and ends so far (progress, to a reader)."""

    __slots__ = ("phase", "edges")

    def __init__(self, phase: str = "setup", edges: int = 0):
        self.phase = phase
        self.edges = edges


class Events:
    """The ordered listeners of one run, and the calls that deliver each event to them."""

    def __init__(self) -> None:
        #: Written by the spans on the training thread; read by other threads (see the module docstring).
        self.position = Position()
        self.listeners: list[Any] = []
        self._hooks: dict[str, list[Callable[..., Any]]] = {event: [] for event in EVENTS}
        # One reusable span per name, emptied when a listener joins: a span built before would not call it.
        self._spans: dict[str, PhaseSpan] = {}

    def add(self, *listeners: Any) -> None:
        """Append ``listeners`` (None is skipped: a subsystem that is off); each receives the events it has methods
        for (an instance attribute set to None, as ``self.on_step_end = None``, opts it out of that event)."""
        for listener in listeners:
            if listener is None:
                continue
            _check_listener(listener)
            self.listeners.append(listener)
            for event, hooks in self._hooks.items():
                hook = getattr(listener, event, None)
                if callable(hook) and getattr(hook, "__func__", None) is not vars(Listener)[event]:
                    hooks.append(hook)
        self._spans.clear()

    def phase(self, name: str) -> PhaseSpan:
        """The context that tells the ``on_phase`` listeners of span ``name`` that it starts and ends (reused)."""
        span = self._spans.get(name)
        if span is None:
            span = PhaseSpan(name, self.phase_listeners(name), self.position)
            self._spans[name] = span
        return span

    def phase_listeners(self, name: str) -> tuple[Callable[[str | None], None], ...]:
        """The ``on_phase`` methods that hear spans called ``name`` (a listener's ``phases`` narrows them)."""
        return tuple(
            hook for hook in self._hooks["on_phase"] if name in (getattr(hook.__self__, "phases", None) or (name,))
        )

    def fit_start(self) -> None:
        # Setup is over: between spans the loop runs its hooks and logging.
        self.position.phase = "loop"
        self._deliver("on_fit_start")

    def epoch_start(self, epoch: int) -> None:
        self._deliver("on_epoch_start", epoch)

    def step_start(self, step: int) -> None:
        for hook in self._hooks["on_step_start"]:
            hook(step)

    def update_start(self, step: int) -> None:
        for hook in self._hooks["on_update_start"]:
            hook(step)

    def step_end(self, step: int) -> None:
        for hook in self._hooks["on_step_end"]:
            hook(step)

    def log(self, record: dict[str, Any]) -> None:
        self._deliver("on_log", record)

    def validation_end(self, metrics: dict[str, float]) -> None:
        self._deliver("on_validation_end", metrics)

    def epoch_end(self, epoch: int) -> None:
        self._deliver("on_epoch_end", epoch)

    def fit_end(self, metrics: dict[str, float]) -> None:
        self._deliver("on_fit_end", metrics)

    def failure(self, error: BaseException) -> None:
        """fit() failed with ``error``: every ``on_failure``, each guarded (see the module docstring)."""
        self._each_guarded("on_failure", error)

    def exit(self, status: str) -> None:
        """The attempt ended with ``status`` (FINISHED, STOPPED or FAILED): every ``on_exit``, each guarded."""
        self._each_guarded("on_exit", status)

    def _deliver(self, event: str, *arguments: Any) -> None:
        for hook in self._hooks[event]:
            hook(*arguments)

    def _each_guarded(self, event: str, argument: Any) -> None:
        for hook in self._hooks[event]:
            try:
                hook(argument)
            except Exception as problem:
                name = getattr(hook, "__qualname__", hook)
                print(f"ddpkit: {name} failed: {type(problem).__name__}: {problem}", file=sys.stderr, flush=True)


def _check_listener(listener: Any) -> None:
    """Refuse a ``phases`` that is not a tuple of span names, and an ``on_*`` method that names no event."""
    kind = type(listener).__name__
    phases = getattr(listener, "phases", None)
    if phases is not None and not (isinstance(phases, tuple) and all(isinstance(p, str) for p in phases)):
        raise TypeError(f"{kind}.phases must be a tuple of span names (the spans its on_phase hears), got {phases!r}")
    for name in dir(listener):
        if name.startswith("on_") and name not in EVENTS and callable(getattr(listener, name, None)):
            close = difflib.get_close_matches(name, EVENTS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the events are {', '.join(EVENTS)}"
            raise TypeError(f"{kind}.{name} names no event, so it would never be called: {hint}")


class PhaseSpan:
    """Marks phase ``name`` in ``position`` and tells its listeners as it starts and ends (reused: phases of one
    name never nest)."""

    __slots__ = ("name", "listeners", "position", "outer")

    def __init__(self, name: str, listeners: tuple[Callable[[str | None], None], ...], position: Position):
        self.name = name
        self.listeners = listeners
        self.position = position
        # The span this one runs inside: the phase again at its end.
        self.outer = ""

    def __enter__(self) -> None:
        position = self.position
        self.outer = position.phase
        position.phase = self.name
        position.edges += 1
        for listener in self.listeners:
            listener(self.name)

    def __exit__(self, *exc: object) -> None:
        position = self.position
        position.phase = self.outer
        position.edges += 1
        for listener in self.listeners:
            listener(None)
