"""The config schema: frozen nested dataclasses, one docstring per field, range checks.

A YAML file maps onto :class:`Config` section by section::

    run:   {name: mnist, seed: 0}
    data:  {name: digits, batch_size: 64}
    optim: {name: sgd, lr: 0.05, momentum: 0.9}

The training-step sections live in :mod:`ddpkit.config.train_sections` and are importable from here;
the cross-field checks are in :mod:`ddpkit.config.checks`. Each field is declared with
:func:`~ddpkit.config.fields.option`, which records its documentation and its allowed
values; :mod:`ddpkit.config.loader` uses that metadata to check YAML input and
``scripts/gen_config_reference.py`` uses it to write ``docs/config.md``. Precedence is
command-line ``key=value`` > YAML file > the defaults written here.

This module knows nothing of ``torch.distributed``; checks that need the runtime (for example
``fp16`` without CUDA) happen where the runtime is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# The schema spans a few modules; everything is importable from here.
from ddpkit.config.fields import option, yaml_key
from ddpkit.config.health_section import HealthConfig, SpikeConfig, StragglerConfig
from ddpkit.config.lora_section import LoraConfig
from ddpkit.config.parallel import FSDPConfig, ParallelConfig
from ddpkit.config.train_sections import (
    DDPConfig,
    EarlyStoppingConfig,
    OptimConfig,
    ParamGroupConfig,
    SchedConfig,
    TrainConfig,
)
from ddpkit.config.urls import url_scheme

__all__ = [
    "Config",
    "RunConfig",
    "DistConfig",
    "ModelConfig",
    "DataConfig",
    "OptimConfig",
    "ParamGroupConfig",
    "SchedConfig",
    "EarlyStoppingConfig",
    "TrainConfig",
    "DDPConfig",
    "ParallelConfig",
    "FSDPConfig",
    "BestConfig",
    "CheckpointConfig",
    "LogConfig",
    "HealthConfig",
    "SpikeConfig",
    "StragglerConfig",
    "LoraConfig",
    "option",
    "yaml_key",
    "HANG_TIMEOUT",
]

#: Seconds of `dist.hang_timeout: auto` (its default), capped at 80% of `dist.timeout` where it is used.
HANG_TIMEOUT = 120.0


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
        "bitwise-equal weights. Every generator is seeded with it when the Trainer is constructed, so a module "
        "a subclass builds in its own `__init__` after `super().__init__()` (an EMA copy, an auxiliary head) is "
        "the same in every launch and on every rank, and again in `fit()` before the model is built.",
        ge=0,
    )
    requeue_exit_code: int = option(
        75,
        "Exit code of a run stopped by a signal after saving (checkpoint.save_on_signals), from every worker "
        "and from `ddpkit run`: the code your scheduler should requeue on. 75 is sysexits' EX_TEMPFAIL; "
        "Kubeflow's PyTorchJob `restartPolicy: ExitCode` retries only codes >= 128, so set 138 there "
        "(docs/multinode.md). 1 to 255, and not 1, 2, 3, 4 or 130, which mean something else (`ddpkit run --help`).",
        ge=1,
    )


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
    hang_timeout: float | Literal["auto"] | None = option(
        "auto",
        "Seconds without progress on any rank before the hang watchdog names the stuck rank(s), writes "
        "`<output_dir>/logs/hang-<time>.txt` with every rank's Python stacks and stops the job (exit "
        "code 3). Must be below `dist.timeout`. `auto`: 120 s, capped at 80% of `dist.timeout`. `null`: no "
        "watchdog. Off for a world of one.",
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
    lora: LoraConfig | None = option(
        None,
        "Train a LoRA adapter instead of the whole model: `{r, alpha, dropout, targets}` (peft's names; `targets: "
        "[q_proj, v_proj]` or `all-linear`). The base is frozen before the ddp/zero1/fsdp2 wrap; checkpoints hold "
        "the adapter, its optimizer state and a fingerprint of the base. A Hugging Face model goes through peft "
        "(`pip install 'ddpkit[peft]'`). `null`: train every parameter (docs/lm.md).",
    )


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
        "Drop the tail that does not fill a whole batch on every rank, so all ranks run the same number of steps.",
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
    order: Literal["auto", "index_free", "randperm"] = option(
        "auto",
        "Training sample order per epoch. `index_free`: a keyed permutation computed per position, no memory "
        "in the dataset size (for 10^8+ samples); `randperm`: torch.randperm, as DistributedSampler; `auto`: "
        "randperm below 2^20 samples, index_free above. Both depend only on `run.seed` and the epoch.",
    )
    uneven: Literal["error", "truncate"] = option(
        "error",
        "When ranks would run different numbers of batches (a custom sampler, uneven stream shards): `error` "
        "stops every rank with each rank's count; `truncate` ends the epoch on every rank at the shortest.",
    )
    allow_length_change: bool = option(
        False,
        "Resuming onto a training set whose length differs from the checkpoint's is refused (both lengths "
        "are named); `true` accepts it and re-plans the epoch: the run continues at the same batch of the "
        "new length's order, so within that epoch some samples may repeat or be skipped.",
    )
    kwargs: dict[str, Any] = option(factory=dict, doc="Keyword arguments for the dataset builder.")


@dataclass(frozen=True)
class BestConfig:
    """Keep the checkpoint with the best value of a validation metric."""

    metric: str = option("val_loss", "Validation metric, e.g. `val_loss` or `val_accuracy`.")
    mode: Literal["min", "max"] = option("min", "Whether smaller (`min`) or larger (`max`) is better.")


@dataclass(frozen=True)
class CheckpointConfig:
    """Crash-safe rank-0 checkpoints and resume."""

    dir: str | None = option(
        None,
        "Checkpoint directory. Defaults to `<output_dir>/checkpoints`. A URL (`s3://`, `gs://`, `az://`, `abfs://`, "
        "`file://`) keeps the checkpoints, `metrics.jsonl` and `model.pt` in object storage: each save is written to "
        "`<output_dir>/checkpoints` first, then uploaded in the background; a run on an empty disk resumes from the "
        "newest valid one there (docs/storage.md; needs `ddpkit[s3]`, `[gcs]` or `[azure]`).",
    )
    storage_options: dict[str, Any] = option(
        factory=dict,
        doc="fsspec options for a URL `dir` (S3: `{profile: ..., endpoint_url: ...}`); "
        "else the cloud's own env and files.",
    )
    every_steps: int | Literal["auto"] | None = option(
        None,
        "Save every this many optimizer steps. `auto`: every sqrt(2 * `mtbf_hours` * T_save) seconds of training "
        "(Young/Daly), T_save being a save's measured blocking time, in steps of the median measured step time; the "
        "first save, after 100 steps, measures it, each save re-estimates, and the log shows the interval and its "
        "inputs (docs/goodput.md).",
        ge=1,
    )
    mtbf_hours: float = option(
        24.0,
        "`every_steps: auto` and `memory_every_steps: auto`: the mean time between failures of the whole job you "
        "expect, in hours (a job on N nodes fails about N times as often as one node).",
        gt=0,
    )
    every_epochs: int | None = option(
        1, "Save at the end of every this many epochs. `null`: never at epoch ends.", ge=1
    )
    keep_last: int = option(2, "Checkpoints kept; older ones are removed once a newer one is complete.", ge=1)
    best: BestConfig | None = option(None, "Also keep the best checkpoint by a validation metric (`{metric, mode}`).")
    resume: str = option(
        "auto", "`auto`: newest valid checkpoint in `dir`, if any; `none`: start fresh; or a checkpoint path."
    )
    async_save: bool = option(
        False,
        "Write checkpoint files in a background thread; the step loop only waits for the state's copy into reused host "
        "memory (from CUDA only queued: the buffers are pinned, the copy runs as a DMA) and for a previous save still "
        "being written.",
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
        "before torchrun's agent kills them (its --shutdown-timeout; torch 2.11 and older wait a fixed 30 s). "
        "Raise it when one save takes longer; a "
        "save cut short leaves the previous complete checkpoint as the one to resume from.",
        gt=0,
    )
    crash_save: bool = option(
        True,
        "When a worker dies (SIGKILL, segfault, OOM kill), the lowest surviving rank saves the last completed step "
        "before it exits, so a restart under `--max-restarts` re-runs no step (see docs/goodput.md). Needs 2+ ranks.",
    )
    model_pt: bool | Literal["auto"] = option(
        "auto",
        "The final `model.pt` (the whole model in one file, written by rank 0). A split `gpt` model (pipeline, tensor "
        "plan, fsdp2; no LoRA) also writes `hf/`, each rank writing what it holds: safetensors files, their index and "
        "config.json, what transformers and `init_from` load. `auto`: `model.pt` when each rank holds the whole "
        "model (a world of one, ddp, zero1), when there is no `hf/` (not `gpt`, or a LoRA run), or when the whole "
        "model fits a quarter of the memory available on rank 0's host; rank 0 then holds it once, a pipeline's "
        "stages sent one tensor at a time. `true`: always; `false`: never (docs/modes.md, outputs).",
    )
    memory_every_steps: int | Literal["auto"] | None = option(
        "auto",
        "Keep a copy of the state in shared memory (`/dev/shm`) every this many steps, written off the training "
        "thread; a restart after every worker of the host died resumes from it when it is newer than the newest disk "
        "checkpoint. `auto`: spaced by Young/Daly from the (first estimated, then measured) blocking time and "
        "`checkpoint.mtbf_hours`, blocking at most 1% of the training (docs/goodput.md). `null`: off.",
        ge=1,
    )


@dataclass(frozen=True)
class LogConfig:
    """Console, file, TensorBoard and experiment-tracker logging."""

    progress_bar: bool = option(
        True, "Show progress on rank 0: a tqdm bar on a terminal, else a plain line every `log.progress_every` seconds."
    )
    all_ranks: bool = option(False, "Log INFO messages from every rank (default: rank 0 at INFO, others at WARNING).")
    rank_files: bool = option(False, "Also write each rank's log to `<output_dir>/logs/rank<N>.log`.")
    tensorboard: bool = option(
        False, "Write TensorBoard event files to `<output_dir>/tensorboard` (needs `ddpkit[tensorboard]`)."
    )
    progress_every: float = option(
        30.0,
        "When stderr is not a terminal (a batch job's log): seconds between plain progress lines, instead of a bar.",
        gt=0,
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
        60.0,
        "Seconds the end of training waits for MLflow / W&B to send what is queued; a tracker never stalls a step.",
        gt=0,
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
    parallel: ParallelConfig = option(
        factory=ParallelConfig, doc="Sharding: `ddp`, `zero1` or `fsdp2` (docs/modes.md)."
    )
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, doc="Checkpointing and resume.")
    log: LogConfig = option(factory=LogConfig, doc="Logging.")
    health: HealthConfig = option(
        factory=HealthConfig,
        doc="Training health: NaN steps, loss spikes, stragglers, replica divergence (docs/health.md).",
    )

    @property
    def output_dir(self) -> str:
        """The run directory, with the `runs/<name>` default applied."""
        return self.run.output_dir or f"runs/{self.run.name or 'run'}"

    @property
    def checkpoint_dir(self) -> str:
        """The local checkpoint directory: `checkpoint.dir`, or `<output_dir>/checkpoints` by default and when
        `checkpoint.dir` is a URL (the staging copy that is uploaded there)."""
        if self.checkpoint.dir and url_scheme(self.checkpoint.dir) is None:
            return self.checkpoint.dir
        return f"{self.output_dir}/checkpoints"

    @property
    def checkpoint_url(self) -> str | None:
        """`checkpoint.dir` when it is an object-storage URL (mirrored by ddpkit.checkpoint.storage), else None."""
        return self.checkpoint.dir if url_scheme(self.checkpoint.dir) is not None else None
