"""Checks that involve more than one config field (one field's own range is checked where it is declared).

problems = cross_field_problems(cfg)   # ["ddp.static_graph: static_graph=true already handles ...", ...]
hang_timeout_seconds(cfg.dist)          # dist.hang_timeout resolved: `auto` is 120 s capped at 80% of dist.timeout
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpkit.config.layout import pipeline_problems, replicate_problems, tensor_config_problems
from ddpkit.config.schema import HANG_TIMEOUT
from ddpkit.config.train_sections import COMPILE_DDPKIT_OPTIONS, COMPILE_MODES, COMPILE_TORCH_OPTIONS
from ddpkit.config.urls import url_problems
from ddpkit.errors import ConfigError, check_requeue_exit_code

if TYPE_CHECKING:
    from ddpkit.config.parallel import ParallelConfig
    from ddpkit.config.schema import Config, DistConfig

__all__ = ["cross_field_problems", "hang_timeout_seconds", "parallel_problems"]


def hang_timeout_seconds(d: DistConfig) -> float | None:
    """The hang watchdog's limit in seconds, or None when it is off (``dist.hang_timeout: null``).

    Args:
        d: the ``dist`` section. ``hang_timeout: auto`` (the default, i.e. not given) is :data:`HANG_TIMEOUT`
            capped at 80% of ``dist.timeout``; a number given explicitly is used as it is (the checks
            below refuse one at or above ``dist.timeout``).
    """
    if d.hang_timeout == "auto":
        return min(HANG_TIMEOUT, 0.8 * d.timeout)
    return d.hang_timeout


def cross_field_problems(cfg: Config) -> list[str]:
    """Problems that involve more than one field, as ``"path: message"`` strings."""
    problems = []
    if cfg.ddp.static_graph and cfg.ddp.find_unused_parameters:
        problems.append(
            "ddp.static_graph: static_graph=true already handles unused parameters; "
            "set ddp.find_unused_parameters=false"
        )
    if cfg.optim.momentum and cfg.optim.name in ("adam", "adamw"):
        problems.append(
            f"optim.momentum: {cfg.optim.momentum:g} is set, but {cfg.optim.name} has no momentum argument; "
            "set optim.kwargs.betas instead, and drop momentum from the file or add ~optim.momentum on the command "
            "line (back to its default)"
        )
    early = cfg.train.early_stopping
    if early.target is not None and early.metric is None:
        problems.append(
            f"train.early_stopping.target: {early.target:g} needs train.early_stopping.metric, the validation metric "
            "to compare (e.g. val_accuracy with train.early_stopping.mode=max); set it, or set the target to null"
        )
    problems += _watchdog_problems(cfg.dist)
    problems += _compile_problems(cfg.train.compile)
    problems += parallel_problems(cfg)
    # checkpoint.dir=s3:/x would otherwise be a local folder named 's3:'
    ck = cfg.checkpoint
    problems += url_problems(directory=ck.dir, output_dir=cfg.run.output_dir, storage_options=ck.storage_options)
    if cfg.data.prefetch_factor is not None and cfg.data.num_workers == 0:
        problems.append(
            "data.prefetch_factor: only used with worker processes; "
            "set data.num_workers > 0 or data.prefetch_factor=null"
        )
    try:
        check_requeue_exit_code(cfg.run.requeue_exit_code)
    except ConfigError as exc:
        problems.append(str(exc))
    return problems


def _watchdog_problems(d: DistConfig) -> list[str]:
    """A watchdog limit at or above the collective timeout would never fire first (`auto` is capped instead)."""
    problems = []
    if isinstance(d.hang_timeout, float) and d.hang_timeout >= d.timeout:
        problems.append(
            f"dist.hang_timeout: {d.hang_timeout:g}s is not below dist.timeout ({d.timeout:g}s), so collectives would "
            "time out first; lower dist.hang_timeout or raise dist.timeout"
        )
    if d.slow_phase_timeout is not None and d.slow_phase_timeout >= d.timeout:
        problems.append(
            f"dist.slow_phase_timeout: {d.slow_phase_timeout:g}s is not below dist.timeout ({d.timeout:g}s); "
            "lower it, raise dist.timeout, or set it to null (90% of dist.timeout)"
        )
    return problems


_COMPILE_KEYS = (*COMPILE_TORCH_OPTIONS, *COMPILE_DDPKIT_OPTIONS)


def _compile_problems(value: bool | dict[str, Any]) -> list[str]:
    """A `train.compile` mapping holds torch.compile's own arguments and ddpkit's two keys, nothing else."""
    if not isinstance(value, dict):
        return []
    problems = [
        f"train.compile.{key}: unknown option; use {', '.join(_COMPILE_KEYS)}"
        for key in value
        if key not in _COMPILE_KEYS
    ]
    if value.get("mode") not in (None, *COMPILE_MODES):
        problems.append(f"train.compile.mode: expected one of {', '.join(COMPILE_MODES)}, got {value['mode']!r}")
    limit = value.get("recompile_limit", COMPILE_DDPKIT_OPTIONS["recompile_limit"])
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        problems.append(f"train.compile.recompile_limit: expected an integer >= 1, got {limit!r}")
    return problems


def parallel_problems(cfg: Config) -> list[str]:
    """Combinations a sharded mode or a pipeline cannot run, as ``"path: message"`` strings naming the fix."""
    problems = pipeline_problems(cfg) + tensor_config_problems(cfg) + replicate_problems(cfg)
    problems += _vocabulary_problems(cfg.parallel)
    if cfg.parallel.mode != "fsdp2":
        return problems
    if cfg.ddp.comm_hook != "none":
        problems.append(
            f"ddp.comm_hook: {cfg.ddp.comm_hook!r} is a DDP communication hook and FSDP2 reduce-scatters gradients "
            "itself; set ddp.comm_hook=none or parallel.mode=ddp (or zero1)"
        )
    if cfg.ddp.sync_batchnorm:
        problems.append(
            "ddp.sync_batchnorm: SyncBatchNorm is applied by the DDP wrapper; set it false with parallel.mode=fsdp2"
        )
    if cfg.train.precision == "fp16":
        problems.append(
            "train.precision: fp16 needs a GradScaler, which ddpkit does not run on FSDP2's sharded gradients; "
            "use train.precision=bf16 (FSDP2's MixedPrecisionPolicy) or parallel.mode=ddp"
        )
    return problems


def _vocabulary_problems(parallel: ParallelConfig) -> list[str]:
    """``parallel.fsdp.shard_vocabulary`` outside the layout it is built for: fsdp2 over a 1-D data-parallel mesh."""
    if not parallel.fsdp.shard_vocabulary:
        return []
    settings = {
        "mode": (parallel.mode, parallel.mode != "fsdp2"),
        "pipeline": (parallel.pipeline, parallel.pipeline > 1),
        "tensor": (parallel.tensor, parallel.tensor > 1),
        "replicate": (parallel.replicate, parallel.replicate > 1),
    }
    clash = [f"parallel.{name}={value}" for name, (value, clashes) in settings.items() if clashes]
    if not clash:
        return []
    return [
        "parallel.fsdp.shard_vocabulary: splits the vocabulary over plain fsdp2's data-parallel ranks only, and this "
        f"run sets {', '.join(clash)}; set parallel.fsdp.shard_vocabulary=false (under a tensor plan "
        "parallel.vocab_parallel shards the vocabulary)"
    ]
