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
costs nothing (only overridden methods are collected). The Trainer adds itself last, so a user's ``on_*``
hooks run after ddpkit's own listeners have seen the same event; ``on_exit(status)`` is the one teardown
every run component gets, in the list's order.

As detectron2's ``TrainerBase`` runs its hooks: one list, one order (the Trainer's ``_attach`` adds every
listener in one call). The bound methods are collected once per event when a listener is added, a
method whose body is only a docstring (or ``pass``) left out, so an empty hook costs nothing; the three
events of every step are bound to the cheapest callable (nothing, the one listener's method, or a loop),
so delivering one on the step path is one call. A failing ``on_failure`` or
``on_exit`` is printed and the next listener still runs: the original failure is what the user
must see, and every listener must get its chance to clean up.

Where the training thread is needs no listener: the spans write it into :attr:`Events.position` as they
start and end (two attribute writes and a count, no call), and a thread that wants it reads it there. The
hang watchdog does, twice a second; hearing every span edge instead cost it 8 calls a step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from types import MappingProxyType
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
        self.phase, self.edges = phase, edges


class Events:
    """The ordered listeners of one run, and the calls that deliver each event to them."""

    def __init__(self) -> None:
        #: Written by the spans on the training thread; read by other threads (see the module docstring).
        self.position = Position()
        self.listeners: list[Any] = []
        self._calls: dict[str, tuple[Callable[..., Any], ...]] = dict.fromkeys(EVENTS, ())
        self._phases: dict[str, PhaseSpan] = {}  # one reusable span per name; emptied when a listener joins
        #: The spans built so far, read-only (the Reporter's step path looks a span up here before asking phase()).
        self.phases: Mapping[str, PhaseSpan] = MappingProxyType(self._phases)
        self._bind_step_events()

    def _bind_step_events(self) -> None:
        """The three events of every optimizer step as the cheapest callable: nothing to call, the one
        listener's own method, or a loop over several (the step path pays one call, not a loop in a method)."""
        #: ``step_start(step)``, ``update_start(step)``, ``step_end(step)``: see :class:`Listener`.
        self.step_start = _deliverer(self._calls["on_step_start"])
        self.update_start = _deliverer(self._calls["on_update_start"])
        self.step_end = _deliverer(self._calls["on_step_end"])

    def add(self, *listeners: Any) -> None:
        """Append ``listeners`` (None is skipped: a subsystem that is off); each receives the events it has methods
        for (an instance attribute set to None, as ``self.on_step_end = None``, opts it out of that event)."""
        for listener in listeners:
            if listener is None:
                continue
            phases = getattr(listener, "phases", None)
            if phases is not None and not (isinstance(phases, tuple) and all(isinstance(p, str) for p in phases)):
                raise TypeError(
                    f"{type(listener).__name__}.phases must be a tuple of span names "
                    f"(the spans its on_phase hears), got {phases!r}"
                )
            self.listeners.append(listener)
            for event in EVENTS:
                method = getattr(listener, event, None)
                if callable(method) and not _does_nothing(method):
                    self._calls[event] += (method,)
        self._phases.clear()  # a span built before this listener joined would not call it
        self._bind_step_events()

    def phase(self, name: str) -> PhaseSpan:
        """The context that tells the ``on_phase`` listeners of span ``name`` that it starts and ends (reused)."""
        span = self._phases.get(name)
        if span is None:
            span = self._phases[name] = PhaseSpan(name, self.phase_listeners(name), self.position)
        return span

    def phase_listeners(self, name: str) -> tuple[Callable[[str | None], None], ...]:
        """The ``on_phase`` methods that hear spans called ``name`` (a listener's ``phases`` narrows them)."""
        return tuple(
            method
            for method in self._calls["on_phase"]
            if name in (getattr(method.__self__, "phases", None) or (name,))
        )

    def fit_start(self) -> None:
        self.position.phase = "loop"  # setup is over: between spans the loop runs its hooks and logging
        for call in self._calls["on_fit_start"]:
            call()

    def epoch_start(self, epoch: int) -> None:
        for call in self._calls["on_epoch_start"]:
            call(epoch)

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


def _nobody(step: int) -> None:
    """A step event no listener hears."""


def _deliverer(calls: tuple[Callable[[int], None], ...]) -> Callable[[int], None]:
    if not calls:
        return _nobody
    if len(calls) == 1:
        return calls[0]

    def deliver(step: int) -> None:
        for call in calls:
            call(step)

    return deliver


def _docstring_only() -> None:
    """A body that is a docstring and nothing else."""


def _empty() -> None:
    pass


_NOTHING = {_docstring_only.__code__.co_code, _empty.__code__.co_code}


def _does_nothing(method: Callable[..., Any]) -> bool:
    """Whether ``method``'s body is only a docstring or ``pass`` (:class:`Listener`'s, the Trainer's hooks a
    subclass did not override): never called, so a no-op hook costs the step path nothing."""
    code = getattr(getattr(method, "__func__", method), "__code__", None)
    return code is not None and code.co_code in _NOTHING


class PhaseSpan:
    """Marks phase ``name`` in ``position`` and tells its listeners as it starts and ends (reused: phases of one
    name never nest)."""

    __slots__ = ("name", "listeners", "position", "outer")

    def __init__(self, name: str, listeners: tuple[Callable[[str | None], None], ...], position: Position):
        self.name, self.listeners, self.position, self.outer = name, listeners, position, ""

    def __enter__(self) -> None:
        position = self.position
        self.outer, position.phase = position.phase, self.name  # the span this one runs inside, back at its end
        position.edges += 1
        for listener in self.listeners:
            listener(self.name)

    def __exit__(self, *exc: object) -> None:
        position = self.position
        position.phase = self.outer
        position.edges += 1
        for listener in self.listeners:
            listener(None)
