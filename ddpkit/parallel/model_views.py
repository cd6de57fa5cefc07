"""The model as the loop sees it, and torch.compile from the config: DDP then compile, compile time kept apart.

Under fsdp2 and inside pipeline stages the blocks are compiled one by one instead, before the sharding
(:mod:`ddpkit.parallel.block_compile`); the watch below is the same.

    models = build_models(model, runtime, ddp=cfg.ddp, train=cfg.train, data_parallel=way, group=dp_group)
    models.watch.exclude_with(reporter.outside_training)   # when compiling: compile time left out of samples/s
    loss = F.cross_entropy(models.train(x), y)      # compile(DDP(model)), or DDP(model) when off
    metrics = evaluate(models.eval)                  # compile(model) on the bare module, no collectives
    torch.save(models.bare.state_dict(), path)       # no `module.` and no `_orig_mod.` prefix
    models.on_exit("FINISHED")                       # end of fit: callbacks off, dynamo settings restored

``to_channels_last`` is ``train.channels_last`` (NHWC parameters and 4-D inputs), applied by
:func:`ddpkit.parallel.parallelize.parallelize` before the wrapper.

``train.compile`` is ``false`` (the default), ``true`` or a mapping of ``torch.compile``'s own
arguments (``mode``, ``fullgraph``, ``dynamic``, ``backend``, ``options``) plus two of ddpkit's:
``recompile_limit`` (compiled versions of one function, default 8 as in torch) and ``validation``
(default true: validate with a compiled copy of the bare model too).

Order, as torch's DDP notes prescribe: DDP wraps the model first and ``torch.compile`` wraps the
DDP module, so Dynamo's DDPOptimizer sees the gradient buckets and splits the graph at their
boundaries; the allreduce of one bucket then overlaps the backward of the next, as in eager DDP.
Validation runs the *bare* module (ranks with fewer validation batches must never wait in a
collective), compiled separately; it shares the parameters and has no collectives inside.

Compiling happens lazily inside the first forward. Dynamo's compile callbacks bracket each
compilation, and each one runs inside ``exclude("compile")`` (the Reporter's context for work left
out of samples/s), so throughput counts training only; the seconds are logged. Every recompile is
logged with Dynamo's reason, and past ``recompile_limit`` versions of one function training
stops with a message (Dynamo's default would silently fall back to eager, a slowdown nobody sees).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddpkit.config.schema import DDPConfig, TrainConfig
from ddpkit.config.train_sections import COMPILE_DDPKIT_OPTIONS
from ddpkit.distributed.ddp import unwrap_model
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import DdpkitError, first_line
from ddpkit.parallel.data_parallel import DDP, DataParallel

# unwrap_model is re-exported: the Trainer takes its model views from here.
__all__ = [
    "CompileError",
    "Models",
    "build_models",
    "compile_settings",
    "CompileWatch",
    "CompileSettings",
    "explain_failures",
    "DDPKIT_OPTIONS",
    "to_channels_last",
    "unwrap_model",
]

log = logging.getLogger(__name__)

#: Keys of a ``train.compile`` mapping that ddpkit itself reads, with their defaults (the config's own table).
DDPKIT_OPTIONS = COMPILE_DDPKIT_OPTIONS

_TURN_OFF = "set train.compile=false to train without compiling"


class CompileError(DdpkitError):
    """``torch.compile`` failed on the model, or recompiled it more often than ``recompile_limit``."""


@dataclass(frozen=True)
class CompileSettings:
    """``train.compile`` resolved: torch.compile's keyword arguments and ddpkit's own two keys."""

    torch_kwargs: dict[str, Any] = field(default_factory=dict)
    recompile_limit: int = DDPKIT_OPTIONS["recompile_limit"]
    validation: bool = DDPKIT_OPTIONS["validation"]


def compile_settings(value: bool | Mapping[str, Any]) -> CompileSettings | None:
    """``train.compile`` as settings, or None when compiling is off (the config schema checked the keys)."""
    if value is False:
        return None
    options = dict(value) if isinstance(value, Mapping) else {}
    ours = {key: options.pop(key) for key in DDPKIT_OPTIONS if key in options}
    return CompileSettings(torch_kwargs=options, **ours)


@dataclass
class Models:
    """The three views of one model: what training calls, what validation calls, what gets saved."""

    train: nn.Module
    eval: nn.Module
    bare: nn.Module
    #: How the replicas hold the parameters (ddpkit.parallel.data_parallel): what validation gathers them with.
    data_parallel: DataParallel = field(default_factory=DDP)
    #: The compilations' watch when ``train.compile`` is on.
    watch: CompileWatch | None = None

    def for_evaluation(self, *, lockstep: bool) -> contextlib.AbstractContextManager[None]:
        """The context validation runs in: under FSDP2, each unit gathered for its forward and freed after it
        (``lockstep``: every rank runs as many forwards), else every unit gathered once for the pass; other ways
        need nothing."""
        way = self.data_parallel
        return way.block_by_block(self.bare) if lockstep else way.full_parameters(self.bare)

    def on_exit(self, status: str) -> None:
        """The run ended: stop watching compiles (callbacks off, Dynamo settings restored); safe to call twice."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def release(self) -> nn.Module:
        """After training: let go of the training wrapper (DDP holds the process group, destroyed
        next); ``train`` becomes the bare model, which is returned."""
        self.train = self.bare
        return self.bare


def build_models(
    model: nn.Module,
    runtime: Runtime,
    *,
    ddp: DDPConfig,
    train: TrainConfig,
    exclude: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
    data_parallel: DataParallel | None = None,
    group: Any = None,
    blocks_compiled: bool = False,
) -> Models:
    """``model`` wrapped by ``data_parallel`` (DDP by default) over ``group`` (None: every rank), then compiled if
    ``train.compile`` asks: the three views. ``blocks_compiled``: its blocks were compiled one by one before the
    wrapper (fsdp2: :mod:`ddpkit.parallel.block_compile`), so the views are not compiled again, only watched.

    ``exclude(name)`` is a context for work left out of samples/s; each compilation runs inside it (also settable
    later, once the reporter exists: :meth:`CompileWatch.exclude_with`).
    """
    way = data_parallel if data_parallel is not None else DDP()
    settings = compile_settings(train.compile)
    # build_model compiled it: recompile in DDP's order.
    if settings is not None and hasattr(model, "_orig_mod"):
        log.info(
            "build_model returned a torch.compile'd model; with train.compile it is compiled after DDP wrapping instead"
        )
        model = unwrap_model(model)
    # DDP, or the model fsdp2 already sharded
    wrapped = way.wrap(model, runtime, ddp, group=group)
    bare = unwrap_model(wrapped)
    if settings is None:
        return Models(train=wrapped, eval=bare, bare=bare, data_parallel=way)
    watch = CompileWatch(settings.recompile_limit, exclude=exclude)
    if blocks_compiled:
        return Models(train=wrapped, eval=bare, bare=bare, data_parallel=way, watch=watch)
    compiled = _compiled(wrapped, settings)
    eval_model = _compiled(bare, settings) if settings.validation and _eval_compile_is_safe(runtime) else bare
    return Models(train=compiled, eval=eval_model, bare=bare, data_parallel=way, watch=watch)


def to_channels_last(model: nn.Module) -> nn.Module:
    """Parameters in channels_last, and 4-D inputs converted to it before each forward.

    Convolutions on CPU (oneDNN) and on recent GPUs run faster on NHWC data; converting the
    input in a pre-hook means neither the data pipeline nor ``training_step`` has to change.
    """
    model = model.to(memory_format=torch.channels_last)
    model.register_forward_pre_hook(_inputs_to_channels_last)
    return model


def _inputs_to_channels_last(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4 else a
        for a in args
    )


def _compiled(module: nn.Module, settings: CompileSettings) -> nn.Module:
    compiled = torch.compile(module, **settings.torch_kwargs)
    # OptimizedModule calls its instance attribute `forward`; wrapping it turns Dynamo's and
    # Inductor's internal errors into one message that names the config key to change.
    compiled.forward = explain_failures(compiled.forward, settings.recompile_limit)
    return compiled


def _eval_compile_is_safe(runtime: Runtime) -> bool:
    """Compiling the bare model for validation must not involve other ranks.

    With ``enable_compiler_collectives`` Dynamo agrees on dynamic shapes by collectives during a
    compile; a rank with no (or fewer) validation batches would never join them.
    """
    return runtime.env.world_size == 1 or not torch._dynamo.config.enable_compiler_collectives


def explain_failures(forward: Callable[..., Any], limit: int) -> Callable[..., Any]:
    from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

    failures: tuple[type[BaseException], ...] = (TorchDynamoException,)
    with contextlib.suppress(ImportError):
        from torch._inductor.exc import InductorError

        failures += (InductorError,)

    @functools.wraps(forward)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except FailOnRecompileLimitHit as exc:
            raise CompileError(
                f"torch.compile needed more than train.compile.recompile_limit={limit} "
                "compiled versions of one function; "
                f"the reasons are logged above (last: {_LAST_REASON[0] or 'not recorded'}). Make the input shapes "
                "constant (e.g. data.drop_last=true), set train.compile.dynamic=true, raise "
                f"train.compile.recompile_limit, or {_TURN_OFF}"
            ) from exc
        except failures as exc:
            raise CompileError(
                f"torch.compile could not compile the model ({_summary(exc)}); {_TURN_OFF}, "
                "or change train.compile's backend/mode. (On CPU the default backend needs a C++ compiler such as gcc.)"
            ) from exc

    return guarded


def _summary(exc: BaseException) -> str:
    """``Type: first line`` of the error that started it (Dynamo wraps a backend's error in its own)."""
    root = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
    return f"{type(root).__name__}: {first_line(root)}"


#: The newest recompile reason, for the limit message.
_LAST_REASON: list[str | None] = [None]


class CompileWatch:
    """Brackets each compilation with ``exclude("compile")``, logs it, and logs and caps recompiles.

    Process-wide while open: Dynamo's callbacks and settings are global. ``close()`` undoes all of it.
    """

    def __init__(
        self, recompile_limit: int, *, exclude: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None
    ):
        import torch._dynamo

        self.seconds = 0.0
        self.compilations = 0
        self.recompiles: list[str] = []
        self._exclude = exclude
        self._open: tuple[float, contextlib.ExitStack] | None = None
        self._callbacks = torch._dynamo.callback_handler
        self._callbacks.register_start_callback(self._started)
        self._callbacks.register_end_callback(self._ended)
        config = torch._dynamo.config
        self._saved = {
            "recompile_limit": config.recompile_limit,
            "fail_on_recompile_limit_hit": config.fail_on_recompile_limit_hit,
        }
        config.recompile_limit = recompile_limit
        config.fail_on_recompile_limit_hit = True
        self._reasons = _RecompileReasons(self.recompiles, recompile_limit)

    def exclude_with(self, exclude: Callable[[str], contextlib.AbstractContextManager[Any]]) -> None:
        """From now on each compilation runs inside ``exclude("compile")`` (the reporter's context)."""
        self._exclude = exclude

    def _started(self, args: Any) -> None:
        stack = contextlib.ExitStack()
        if self._exclude is not None:
            stack.enter_context(self._exclude("compile"))
        self._open = (time.perf_counter(), stack)

    def _ended(self, args: Any) -> None:
        if self._open is None:
            return
        started, stack = self._open
        self._open = None
        stack.close()
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        self.compilations += 1
        log.info(
            "torch.compile: compiled %s in %.1f s (%.1f s compiling in total, left out of samples/s)",
            _frame_name(args),
            elapsed,
            self.seconds,
        )

    def close(self) -> None:
        """Remove the callbacks and the recompile log handler; restore Dynamo's settings."""
        import torch._dynamo

        with contextlib.suppress(ValueError):
            self._callbacks.remove_start_callback(self._started)
            self._callbacks.remove_end_callback(self._ended)
        for name, value in self._saved.items():
            setattr(torch._dynamo.config, name, value)
        self._reasons.close()


def _frame_name(args: Any) -> str:
    trigger = getattr(getattr(args, "callback_trigger", None), "name", "").lower()
    compile_id = getattr(args, "compile_id", "?")
    return f"graph {compile_id}" + (f" ({trigger.replace('_', ' ')})" if trigger and trigger != "dynamo" else "")


class _RecompileReasons(logging.Handler):
    """Receives Dynamo's ``recompiles`` log records and re-logs them as ddpkit lines with a count."""

    def __init__(self, into: list[str], limit: int):
        super().__init__(level=logging.DEBUG)
        from torch._dynamo.guards import recompiles_log

        self.into = into
        self.limit = limit
        self._logger = recompiles_log
        # A user's TORCH_LOGS wins; theirs prints too.
        self._enabled_here = not os.environ.get("TORCH_LOGS")
        if self._enabled_here:
            torch._logging.set_logs(recompiles=True)
            self._propagate = self._logger.propagate
            # One line per recompile, ours, not torch's as well.
            self._logger.propagate = False
        self._logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        reason = " ".join(line.strip() for line in message.splitlines()[2:]) or message
        self.into.append(reason)
        _LAST_REASON[0] = reason
        log.info(
            "torch.compile: recompile %d (at most %d compiled versions per function): %s",
            len(self.into),
            self.limit,
            reason,
        )

    def close(self) -> None:
        self._logger.removeHandler(self)
        if self._enabled_here:
            self._logger.propagate = self._propagate
            torch._logging.set_logs()
        super().close()
