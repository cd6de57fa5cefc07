"""Models, datasets and optimizers by name.

Config files name what to build (``model: {name: resnet18, kwargs: {num_classes: 10}}``); a
:class:`Registry` maps the name to a builder function and calls it with the config's kwargs.
A name can be:

* a built-in (``mlp``, ``mnist_cnn``; ``digits``, ``mnist``, ...; ``sgd``, ``adam``, ``adamw``);
* one of yours, registered with a decorator before the Trainer runs::

      @ddpkit.register_model("tiny")
      def tiny(width: int = 16) -> nn.Module: ...

* for models, any ``torchvision.models`` builder (``resnet18``, ``vit_b_16``, ...);
* an explicit ``package.module:callable`` path, imported on use.

Built-ins live in :mod:`ddpkit.models.builtin`, :mod:`ddpkit.data.datasets` and :mod:`ddpkit.training.optim` and are
imported the first time a name is looked up, so ``import ddpkit`` stays fast.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from ddpkit.config.schema import DataConfig, ModelConfig
from ddpkit.errors import ConfigError

__all__ = [
    "Registry",
    "MODELS",
    "DATASETS",
    "OPTIMIZERS",
    "register_model",
    "register_dataset",
    "register_optimizer",
    "build_model",
    "build_datasets",
]


class Registry:
    """A name -> builder table for one kind of object (``kind`` is used in error messages)."""

    def __init__(self, kind: str, *, builtins: str, fallback: Callable[[], dict[str, Callable]] | None = None):
        self.kind = kind
        self._builders: dict[str, Callable[..., Any]] = {}
        self._builtins_module = builtins
        # Names resolved elsewhere (torchvision's models), looked up only when ours miss.
        self._fallback = fallback

    def register(self, name: str, builder: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Register ``builder`` under ``name``; without ``builder``, works as a decorator."""

        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            self._builders[name] = fn
            return fn

        return add(builder) if builder is not None else add

    def names(self) -> list[str]:
        """Registered names (built-ins and user registrations), sorted."""
        self._load_builtins()
        return sorted(self._builders)

    def get(self, name: str, *, key: str) -> Callable[..., Any]:
        """The builder for ``name``; ``key`` is the config path reported in errors (e.g. ``model.name``)."""
        self._load_builtins()
        if ":" in name:
            return _import_callable(name, key)
        if name in self._builders:
            return self._builders[name]
        others = self._fallback() if self._fallback else {}
        if name in others:
            return others[name]
        hint = difflib.get_close_matches(name, [*self.names(), *others], n=1)
        raise ConfigError(
            f"{key}: unknown {self.kind} {name!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else "")
            + f" Registered: {', '.join(self.names())}"
            + (" (and every torchvision model)" if self.kind == "model" else "")
            + ". Or give an import path, package.module:callable."
        )

    def build(self, name: str, *args: Any, key: str, kwargs: dict[str, Any]) -> Any:
        """Look up ``name`` and call its builder, reporting bad ``kwargs`` against ``key``."""
        builder = self.get(name, key=key)
        check_kwargs(builder, args, kwargs, key=key.rsplit(".", 1)[0] + ".kwargs", what=f"{self.kind} {name!r}")
        return builder(*args, **kwargs)

    def _load_builtins(self) -> None:
        if self._builtins_module:
            module = self._builtins_module
            self._builtins_module = ""
            importlib.import_module(module)


def check_kwargs(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], *, key: str, what: str) -> None:
    """Raise a ConfigError naming ``key`` when ``fn`` cannot accept ``kwargs``."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        # Some C callables have no signature; let the call decide.
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        accepted = [p for p in signature.parameters if p not in ("self", "params", "args", "kwargs")]
        raise ConfigError(f"{key}: {exc} for {what}; it accepts: {', '.join(accepted) or 'no arguments'}") from None


def _import_callable(path: str, key: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import {module_name!r} from {path!r} ({exc}); is it on PYTHONPATH?") from None
    target = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise ConfigError(f"{key}: {path!r} is not callable")
    return target


def _torchvision_models() -> dict[str, Callable[..., Any]]:
    # Imported here: torchvision costs ~0.5 s to import.
    import torchvision.models

    return {name: torchvision.models.get_model_builder(name) for name in torchvision.models.list_models()}


MODELS = Registry("model", builtins="ddpkit.models.builtin", fallback=_torchvision_models)
DATASETS = Registry("dataset", builtins="ddpkit.data.datasets")
OPTIMIZERS = Registry("optimizer", builtins="ddpkit.training.optim")

#: Decorators for user code: ``@ddpkit.register_model("name")``.
register_model = MODELS.register
register_dataset = DATASETS.register
register_optimizer = OPTIMIZERS.register


def build_model(cfg: ModelConfig) -> Any:
    """The model config section ``model`` names (the Trainer's default ``build_model``)."""
    if not cfg.name:
        raise ConfigError("model.name: not set; name a model (e.g. model.name=mnist_cnn) or override build_model()")
    return MODELS.build(cfg.name, key="model.name", kwargs=cfg.kwargs)


def build_datasets(cfg: DataConfig) -> tuple[Any, Any]:
    """The ``(train, val)`` datasets config section ``data`` names (the Trainer's default ``build_datasets``)."""
    if not cfg.name:
        raise ConfigError("data.name: not set; name a dataset (e.g. data.name=digits) or override build_datasets()")
    datasets = DATASETS.build(cfg.name, key="data.name", kwargs=cfg.kwargs)
    if not (isinstance(datasets, tuple) and len(datasets) == 2):
        raise ConfigError(
            f"data.name: dataset builder {cfg.name!r} must return (train, val), got {type(datasets).__name__}"
        )
    return datasets
