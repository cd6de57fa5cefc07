"""What a checkpoint holds: the run's named stateful components, and the file layout around them.

    components = Components()
    components.register("model", model)            # anything with state_dict() / load_state_dict()
    components.register("optimizer", optimizer)
    state = components.capture(metadata={...})    # a plain dict (metadata: config, versions): what torch.save writes
    components.restore(read_checkpoint(raw, path=path))

One protocol, borrowed from torchtitan's ``Stateful``: every part of a run that must survive a
restart (model, optimizer, schedule, gradient scaler, progress counters, data position, early
stopping, the best-checkpoint tracker, a tracker's run id, ...) has ``state_dict()`` /
``load_state_dict()`` and is registered by name. Nothing else decides what a checkpoint holds:
the file's ``schema`` is the list of registered names, each saved under its own key, beside the
run's metadata (:data:`METADATA_KEYS`). Every part is registered before the resume, in one call
(:meth:`ddpkit.checkpoint.checkpointer.Checkpointer.register`), so the resume restores all of them.

Files written before this layout (format 1: ``model``, ``optimizer``, ``scheduler``, ``scaler``
and ``progress`` at the top, the rest under ``components``) are read into the same shape by
:func:`read_checkpoint`, so checkpoints of earlier releases still resume.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ddpkit.errors import CheckpointError
from ddpkit.progress import Progress

__all__ = [
    "StateTree",
    "Stateful",
    "Ledger",
    "Capturer",
    "Progress",
    "Components",
    "read_checkpoint",
    "METADATA_KEYS",
    "REQUIRED_COMPONENTS",
]

#: Keys a checkpoint holds besides its components: the list of components, and what wrote it.
METADATA_KEYS = ("schema", "world_size", "config", "config_hash", "versions")
#: Components without which a checkpoint cannot continue a run (``rng``: every rank's RNG streams).
REQUIRED_COMPONENTS = ("model", "optimizer", "progress", "rng")
#: Components that releases before 0.4 stored beside the schema instead of in it.
_OUTSIDE_THE_SCHEMA = ("rng",)
_FORMAT_1_TOP_LEVEL = ("model", "optimizer", "scheduler", "scaler", "progress")


#: A state dict as torch.save writes it: tensors and plain values, nested in dicts, lists and tuples.
StateTree = (
    torch.Tensor
    | dict[str, "StateTree"]
    | list["StateTree"]
    | tuple["StateTree", ...]
    | int
    | float
    | str
    | bool
    | None
)


class Stateful(Protocol):
    """Anything a checkpoint can hold: ``torch.nn.Module``, ``torch.optim.Optimizer``, schedulers, ..."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class Ledger(Protocol):
    """Where a save that blocked training is recorded (:class:`ddpkit.goodput.ledger.GoodputLedger`)."""

    def checkpoint(self, *, began: float, step: int, kind: str, always: bool = False) -> None: ...


class Capturer(Protocol):
    """What the crash save and memory snapshots capture through (the run's
    :class:`ddpkit.checkpoint.checkpointer.Checkpointer`)."""

    progress: Progress
    components: Components

    def capture(self, exclude: tuple[str, ...] = (), *, rng: list[dict[str, Any]] | None = None) -> dict[str, Any]: ...


class Components:
    """The run's stateful parts by name, in registration order."""

    def __init__(self) -> None:
        self._parts: dict[str, Stateful] = {}

    def register(self, name: str, component: Stateful | None) -> None:
        """Save ``component`` under ``name`` from now on (None: nothing to save, e.g. no scheduler)."""
        if name in METADATA_KEYS:
            raise ValueError(f"{name!r} is reserved for a checkpoint's metadata; register the part under another name")
        if component is None:
            self._parts.pop(name, None)
            return
        self._parts[name] = component

    def __getitem__(self, name: str) -> Stateful:
        return self._parts[name]

    @property
    def names(self) -> list[str]:
        return list(self._parts)

    def capture(self, *, metadata: dict[str, Any], exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        """Every component's state under its name, plus ``metadata`` (see :data:`METADATA_KEYS`).

        ``exclude``: components saved another way (sharded model and optimizer: ddpkit.checkpoint.sharded_run).
        """
        state = {name: part.state_dict() for name, part in self._parts.items() if name not in exclude}
        return {**state, **metadata, "schema": list(state)}

    def restore(self, state: dict[str, Any]) -> None:
        """Load each registered component that ``state`` holds.

        A component the checkpoint lacks keeps its freshly built state (e.g. a run that now has a
        schedule resumes a checkpoint written without one).
        """
        names = [*state["schema"], *(n for n in _OUTSIDE_THE_SCHEMA if n in state and n not in state["schema"])]
        self.load({name: state[name] for name in names}, self.names)

    def load(self, state: dict[str, Any], names: list[str] | tuple[str, ...]) -> list[str]:
        """Load ``names`` that are registered and that ``state`` holds (e.g. a rollback's model and
        optimizer); return the names loaded. Every other component keeps its state."""
        loaded = [name for name in names if name in self._parts and state.get(name) is not None]
        for name in loaded:
            self._parts[name].load_state_dict(state[name])
        return loaded


def read_checkpoint(raw: dict[str, Any], *, path: str) -> dict[str, Any]:
    """A loaded checkpoint file in the current layout (format 1 files are converted), or a CheckpointError."""
    # Format 1, written by releases before this layout
    if "schema" not in raw and "components" in raw:
        raw = _from_format_1(raw)
    missing = [key for key in (*METADATA_KEYS, *REQUIRED_COMPONENTS) if key not in raw]
    if missing:
        raise CheckpointError(
            f"{path} lacks {', '.join(missing)}: it was not written by ddpkit's Trainer. "
            "Start fresh with checkpoint.resume=none, or load its weights yourself (`ddpkit export`)."
        )
    return raw


def _from_format_1(raw: dict[str, Any]) -> dict[str, Any]:
    extras = raw.get("components") or {}
    top = {name: raw[name] for name in _FORMAT_1_TOP_LEVEL if raw.get(name) is not None}
    converted = {key: raw[key] for key in (*METADATA_KEYS, *_OUTSIDE_THE_SCHEMA) if key in raw}
    converted.update(top)
    converted.update(extras)
    converted["schema"] = [*top, *extras]
    return converted
