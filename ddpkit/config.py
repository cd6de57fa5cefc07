"""The config schema: frozen nested dataclasses, one docstring per field, range checks.

A YAML file maps onto :class:`Config` section by section::

    run:   {name: mnist, seed: 0}
    data:  {name: digits, batch_size: 64}
    optim: {name: sgd, lr: 0.05, momentum: 0.9}

Each field is declared with :func:`option`, which records its documentation and its allowed
values; :mod:`ddpkit.config_loader` uses that metadata to check YAML input and
``scripts/gen_config_reference.py`` uses it to write ``docs/config.md``. Precedence is
command-line ``key=value`` > YAML file > the defaults written here.

This module knows nothing of ``torch.distributed``; checks that need the runtime (for example
``fp16`` without CUDA) happen where the runtime is known.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "Config",
    "RunConfig",
    "DistConfig",
    "ModelConfig",
    "DataConfig",
    "OptimConfig",
    "SchedConfig",
    "EarlyStoppingConfig",
    "TrainConfig",
    "DDPConfig",
    "BestConfig",
    "CheckpointConfig",
    "LogConfig",
    "option",
    "yaml_key",
    "cross_field_problems",
]


def option(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    key: str | None = None,
) -> Any:
    """Declare a config field with its documentation and range.

    ``ge`` / ``gt`` bound numbers (``>=`` / ``>``); allowed strings are written as ``Literal``
    types. ``key`` is the YAML spelling when it differs from the Python name (``async`` is a
    Python keyword, so the field is ``async_save`` and the YAML key is ``async``).
    """
    metadata = {"doc": doc, "ge": ge, "gt": gt, "key": key}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def yaml_key(f: dataclasses.Field) -> str:
    """The YAML key of a dataclass field (its name unless an alias was declared)."""
    return f.metadata.get("key") or f.name


@dataclass(frozen=True)
class RunConfig:
    """Identity of the run: its name, where it writes, and the seed that makes it reproducible."""

    name: str = option("", "Run name. Defaults to the config file's stem (or `run`).")
    output_dir: str | None = option(
        None,
        "Directory for config.yaml, metrics.jsonl, checkpoints and model.pt. Defaults to `runs/<name>`.",
    )
    seed: int = option(
        0,
        "Seed for model init, data order and per-rank randomness. Same seed + same world size gives "
        "bitwise-equal weights.",
        ge=0,
    )


HANG_TIMEOUT = 120.0  # dist.hang_timeout's default


@dataclass(frozen=True)
class DistConfig:
    """How the processes form a group and how fast a failure stops all of them."""

    backend: Literal["auto", "nccl", "gloo"] = option(
        "auto", "Collective backend. `auto`: NCCL when training on CUDA, else Gloo."
    )
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "`auto`: `cuda:LOCAL_RANK` when CUDA is available, else CPU."
    )
    timeout: float = option(
        300.0,
        "Seconds a collective may wait for the slowest rank (the process-group timeout).",
        gt=0,
    )
    failure_timeout: float = option(
        10.0,
        "Seconds from one rank's failure until every rank has exited: bounds startup checks and "
        "the launcher's shutdown grace period.",
        gt=0,
    )
    debug: bool = option(
        False,
        "Debug mode: TORCH_DISTRIBUTED_DEBUG=DETAIL, monitored barriers on Gloo that name a stuck "
        "rank, and a per-rank step log under the run directory.",
    )
    hang_timeout: float | None = option(
        HANG_TIMEOUT,
        "Seconds without progress on any rank before the hang watchdog names the stuck rank(s), writes "
        "`<output_dir>/logs/hang-<time>.txt` with every rank's Python stacks and stops the job (exit "
        "code 3). Must be below `dist.timeout`; the default is capped at 80% of it. `null`: no watchdog. "
        "Off for a world of one.",
        gt=0,
    )
    slow_phase_timeout: float | None = option(
        None,
        "The watchdog's limit instead of `hang_timeout` while a rank is in a phase that may be slow without "
        "visible progress: setup, compile, a checkpoint save, the first batch. `null`: 90% of `dist.timeout`.",
        gt=0,
    )


@dataclass(frozen=True)
class ModelConfig:
    """Which model to build. Not needed when the Trainer subclass overrides `build_model`."""

    name: str | None = option(
        None,
        "A registered model (`mlp`, `mnist_cnn`, any torchvision model such as `resnet18`) or "
        "`package.module:callable`.",
    )
    kwargs: dict[str, Any] = option(factory=dict, doc="Keyword arguments for the model builder.")


@dataclass(frozen=True)
class DataConfig:
    """Which dataset to load and how each rank batches it."""

    name: str | None = option(
        None,
        "A registered dataset (`digits`, `fake`, `mnist`, `fashion_mnist`, `cifar10`, "
        "`imagefolder`; streams: `webdataset`, `hf_datasets`) or `package.module:callable`.",
    )
    batch_size: int = option(32, "Per-rank batch size (global batch = this x world size x grad_accum_steps).", ge=1)
    global_batch_size: int | None = option(
        None,
        "Samples per optimizer step over all ranks, instead of `batch_size`: each rank takes "
        "global_batch_size / (world size x grad_accum_steps), and the sample order no longer depends on "
        "the world size, so a checkpoint resumes on more or fewer ranks. Do not set `batch_size` with it.",
        ge=1,
    )
    val_batch_size: int | None = option(None, "Per-rank validation batch size. Defaults to `batch_size`.", ge=1)
    num_workers: int = option(0, "DataLoader worker processes per rank.", ge=0)
    shuffle: bool = option(True, "Shuffle the training set each epoch (seeded by `run.seed` and the epoch).")
    drop_last: bool = option(
        True,
        "Drop the tail that does not fill a whole batch on every rank, so all ranks run the same "
        "number of steps.",
    )
    pin_memory: bool = option(
        True, "Pin host memory so host-to-GPU copies run asynchronously (`non_blocking`). Only used on CUDA."
    )
    persistent_workers: bool = option(
        True,
        "Keep the `num_workers` loader processes alive from one epoch to the next instead of restarting "
        "them every epoch. Per-sample seeding and exact resume are unaffected.",
    )
    prefetch_factor: int | None = option(
        None, "Batches each worker loads ahead (needs `num_workers` > 0). `null`: torch's default (2).", ge=1
    )
    stream_window: int = option(
        8,
        "Streams (an IterableDataset training set): optimizer steps each rank reads ahead before the ranks "
        "agree, with one small all_reduce, how many of them all ranks run. Larger: the collective is rarer; "
        "smaller: fewer batches held in memory.",
        ge=1,
    )
    kwargs: dict[str, Any] = option(factory=dict, doc="Keyword arguments for the dataset builder.")


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer. Not needed when the Trainer subclass overrides `build_optimizer`."""

    name: str = option("sgd", "A registered optimizer (`sgd`, `adam`, `adamw`) or `package.module:callable`.")
    lr: float = option(0.01, "Learning rate (peak rate when a warmup is used).", gt=0)
    momentum: float = option(0.0, "SGD momentum (SGD only; Adam's are `kwargs.betas`).", ge=0)
    weight_decay: float = option(0.0, "Weight decay.", ge=0)
    kwargs: dict[str, Any] = option(factory=dict, doc="Other optimizer arguments, e.g. `nesterov`, `betas`, `eps`.")


@dataclass(frozen=True)
class SchedConfig:
    """Learning-rate schedule, stepped once per optimizer step."""

    name: Literal["constant", "cosine", "linear", "step"] = option(
        "constant", "Shape after the warmup: constant, cosine or linear decay to `min_lr`, or step decay."
    )
    warmup_steps: int = option(0, "Optimizer steps of linear warmup from 0 to `optim.lr`.", ge=0)
    min_lr: float = option(0.0, "Final learning rate of the cosine and linear schedules.", ge=0)
    step_size: int = option(1000, "`step` schedule: multiply the rate by `gamma` every this many steps.", ge=1)
    gamma: float = option(0.1, "`step` schedule: decay factor.", gt=0)


@dataclass(frozen=True)
class EarlyStoppingConfig:
    """Stop training when a validation metric stops improving."""

    metric: str | None = option(None, "Validation metric to watch, e.g. `val_loss`. `null` disables early stopping.")
    mode: Literal["min", "max"] = option("min", "Whether smaller (`min`) or larger (`max`) is better.")
    patience: int = option(3, "Evaluations without improvement before stopping.", ge=1)
    min_delta: float = option(0.0, "Smallest change that counts as an improvement.", ge=0)


@dataclass(frozen=True)
class TrainConfig:
    """Length of training and what happens in each step."""

    epochs: int | None = option(1, "Epochs to train. Training stops at `epochs` or `max_steps`, whichever comes first.", ge=1)
    max_steps: int | None = option(None, "Optimizer steps to train (optional cap).", ge=1)
    grad_accum_steps: int = option(
        1, "Micro-batches per optimizer step; the first k-1 run under DDP's `no_sync()`.", ge=1
    )
    clip_grad_norm: float | None = option(None, "Clip the global gradient norm to this value.", gt=0)
    precision: Literal["fp32", "bf16", "fp16"] = option(
        "fp32", "Autocast precision: `bf16` on CPU or CUDA; `fp16` (with a GradScaler) on CUDA only."
    )
    log_every: int = option(50, "Optimizer steps between logged (rank-reduced) training metrics.", ge=1)
    eval_every: int | None = option(None, "Optimizer steps between evaluations. `null`: at the end of every epoch.", ge=1)
    timeline: bool = option(False, "Write a Chrome-trace timeline (one row per rank) to `<output_dir>/timeline.json`.")
    compile: bool | dict[str, Any] = option(
        False,
        "`torch.compile` the model: `false`, `true`, or a mapping of torch.compile's `mode`, `fullgraph`, "
        "`dynamic`, `backend`, `options`, plus ddpkit's `recompile_limit` (compiled versions of one function, default 8; past it training stops "
        "with a message) and `validation` (default true: validate with a compiled copy too). DDP wraps first, "
        "then compile; compile time is logged and left out of samples/s; checkpoints never carry `_orig_mod.`.",
    )
    channels_last: bool = option(
        False,
        "Convert the model and 4-D inputs to channels_last (NHWC) memory format: faster convolutions on "
        "recent GPUs and often on CPU; no effect on models without convolutions.",
    )
    keep_host_memory: bool = option(
        True,
        "Keep host memory freed during training in the process for reuse (glibc `mallopt`; blocks up to "
        "32 MiB), so each step's CPU activations do not fault in fresh pages: measured 200-1,900 page faults "
        "and up to 5 ms per MNIST-CNN step without it. `false`: malloc's defaults. Linux/glibc only.",
    )
    early_stopping: EarlyStoppingConfig = option(factory=EarlyStoppingConfig, doc="Early stopping on a validation metric.")


@dataclass(frozen=True)
class DDPConfig:
    """DistributedDataParallel options, named as in torch."""

    bucket_cap_mb: float | None = option(
        None,
        "Gradient bucket size in MiB: larger buckets, fewer allreduce calls. `null`: torch's default "
        "(25 MiB, with a small first bucket so communication starts early).",
        gt=0,
    )
    find_unused_parameters: bool = option(False, "Allow parameters that get no gradient in some steps (costs a graph walk per step).")
    static_graph: bool = option(False, "Promise the graph and used parameters never change (enables DDP optimizations).")
    gradient_as_bucket_view: bool = option(False, "Gradients are views into the allreduce buckets (saves memory and a copy).")
    broadcast_buffers: bool = option(True, "Broadcast buffers (e.g. BatchNorm statistics) from rank 0 at each forward.")
    sync_batchnorm: bool = option(False, "Convert BatchNorm layers to SyncBatchNorm.")
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = option(
        "none", "DDP communication hook: compress gradients to fp16/bf16, or PowerSGD low-rank compression."
    )
    powersgd_rank: int = option(1, "PowerSGD matrix approximation rank.", ge=1)
    powersgd_start_iter: int = option(10, "PowerSGD: plain allreduce for this many steps first.", ge=2)


@dataclass(frozen=True)
class BestConfig:
    """Keep the checkpoint with the best value of a validation metric."""

    metric: str = option("val_loss", "Validation metric, e.g. `val_loss` or `val_accuracy`.")
    mode: Literal["min", "max"] = option("min", "Whether smaller (`min`) or larger (`max`) is better.")


@dataclass(frozen=True)
class CheckpointConfig:
    """Crash-safe rank-0 checkpoints and resume."""

    dir: str | None = option(None, "Checkpoint directory. Defaults to `<output_dir>/checkpoints`.")
    every_steps: int | None = option(None, "Save every this many optimizer steps.", ge=1)
    every_epochs: int | None = option(1, "Save at the end of every this many epochs. `null`: never at epoch ends.", ge=1)
    keep_last: int = option(2, "Checkpoints kept; older ones are removed once a newer one is complete.", ge=1)
    best: BestConfig | None = option(None, "Also keep the best checkpoint by a validation metric (`{metric, mode}`).")
    resume: str = option(
        "auto", "`auto`: newest valid checkpoint in `dir`, if any; `none`: start fresh; or a checkpoint path."
    )
    async_save: bool = option(
        False,
        "Write checkpoint files in a background thread; the step loop only pays for the copy to CPU memory.",
        key="async",
    )
    allow_config_change: bool = option(
        False, "Resume even when the checkpoint's model/optimizer/data/seed/world size differ from this run."
    )
    save_on_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGQUIT"]] = option(
        factory=lambda: ["SIGTERM", "SIGUSR1"],
        doc="Signals that stop training at the next optimizer step every rank agrees on, save a checkpoint of "
        "exactly that step and exit with code 75 (resumable); a second signal stops at once. `[]` turns it off.",
    )
    stop_timeout: float = option(
        30.0,
        "Seconds `ddpkit run` lets the workers take, after a signal, to reach the agreed step, save and exit "
        "before torchrun's agent kills them (its --shutdown-timeout). Raise it when one save takes longer; a "
        "save cut short leaves the previous complete checkpoint as the one to resume from.",
        gt=0,
    )


@dataclass(frozen=True)
class LogConfig:
    """Console, file, TensorBoard and experiment-tracker logging."""

    progress_bar: bool = option(
        True, "Show progress on rank 0: a tqdm bar on a terminal, else a plain line every `log.progress_every` seconds."
    )
    all_ranks: bool = option(False, "Log INFO messages from every rank (default: rank 0 at INFO, others at WARNING).")
    rank_files: bool = option(False, "Also write each rank's log to `<output_dir>/logs/rank<N>.log`.")
    tensorboard: bool = option(False, "Write TensorBoard event files to `<output_dir>/tensorboard` (needs `ddpkit[tensorboard]`).")
    progress_every: float = option(
        30.0, "When stderr is not a terminal (a batch job's log): seconds between plain progress lines, instead of a bar.", gt=0
    )
    mlflow: bool = option(
        False,
        "Log params, metrics, status and model.pt to MLflow (needs `ddpkit[mlflow]`): `MLFLOW_TRACKING_URI`, else "
        "`sqlite:///<output_dir>/mlflow.db`; experiment = `run.name`. A resumed run continues the same MLflow run.",
    )
    wandb: bool = option(
        False,
        "Log the same to Weights & Biases (needs `ddpkit[wandb]`); project = `run.name` unless `WANDB_PROJECT` is set; "
        "`WANDB_MODE=offline` needs no network.",
    )
    tracker_timeout: float = option(
        60.0, "Seconds the end of training waits for MLflow / W&B to send what is queued; a tracker never stalls a step.", gt=0
    )


@dataclass(frozen=True)
class Config:
    """A whole experiment: one section per concern."""

    run: RunConfig = option(factory=RunConfig, doc="Run identity, output directory and seed.")
    dist: DistConfig = option(factory=DistConfig, doc="Process group, backend and failure handling.")
    model: ModelConfig = option(factory=ModelConfig, doc="Model to build.")
    data: DataConfig = option(factory=DataConfig, doc="Dataset and per-rank loading.")
    optim: OptimConfig = option(factory=OptimConfig, doc="Optimizer.")
    sched: SchedConfig = option(factory=SchedConfig, doc="Learning-rate schedule.")
    train: TrainConfig = option(factory=TrainConfig, doc="Training length and step options.")
    ddp: DDPConfig = option(factory=DDPConfig, doc="DistributedDataParallel options.")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, doc="Checkpointing and resume.")
    log: LogConfig = option(factory=LogConfig, doc="Logging.")

    @property
    def output_dir(self) -> str:
        """The run directory, with the `runs/<name>` default applied."""
        return self.run.output_dir or f"runs/{self.run.name or 'run'}"

    @property
    def checkpoint_dir(self) -> str:
        """The checkpoint directory, with the `<output_dir>/checkpoints` default applied."""
        return self.checkpoint.dir or f"{self.output_dir}/checkpoints"


def cross_field_problems(cfg: Config) -> list[str]:
    """Problems that involve more than one field, as ``"path: message"`` strings."""
    problems = []
    if cfg.train.epochs is None and cfg.train.max_steps is None:
        problems.append("train.epochs: set train.epochs or train.max_steps (both are null, so training would never end)")
    if cfg.ddp.static_graph and cfg.ddp.find_unused_parameters:
        problems.append(
            "ddp.static_graph: static_graph=true already handles unused parameters; "
            "set ddp.find_unused_parameters=false"
        )
    if cfg.optim.momentum and cfg.optim.name in ("adam", "adamw"):
        problems.append(
            f"optim.momentum: {cfg.optim.name} has no momentum argument; set optim.kwargs.betas instead"
        )
    problems += _watchdog_problems(cfg.dist)
    problems += _compile_problems(cfg.train.compile)
    if cfg.data.prefetch_factor is not None and cfg.data.num_workers == 0:
        problems.append("data.prefetch_factor: only used with worker processes; set data.num_workers > 0 or data.prefetch_factor=null")
    return problems


def _watchdog_problems(d: DistConfig) -> list[str]:
    """A watchdog limit at or above the collective timeout would never fire first (the default is capped instead)."""
    problems = []
    if d.hang_timeout is not None and d.hang_timeout != HANG_TIMEOUT and d.hang_timeout >= d.timeout:
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


_COMPILE_KEYS = ("mode", "fullgraph", "dynamic", "backend", "options", "recompile_limit", "validation")
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _compile_problems(value: bool | dict[str, Any]) -> list[str]:
    """A `train.compile` mapping holds torch.compile's own arguments and ddpkit's two keys, nothing else."""
    if not isinstance(value, dict):
        return []
    problems = [f"train.compile.{key}: unknown option; use {', '.join(_COMPILE_KEYS)}" for key in value if key not in _COMPILE_KEYS]
    if value.get("mode") not in (None, *_COMPILE_MODES):
        problems.append(f"train.compile.mode: expected one of {', '.join(_COMPILE_MODES)}, got {value['mode']!r}")
    limit = value.get("recompile_limit", 8)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        problems.append(f"train.compile.recompile_limit: expected an integer >= 1, got {limit!r}")
    return problems
