"""The config sections of the training step itself: optimizer, schedule, step options, DDP.

Part of the schema in :mod:`ddpkit.config.schema` (which re-exports these classes); declared with
:func:`~ddpkit.config.fields.option`, one docstring per field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ddpkit.config.fields import option
from ddpkit.config.profile_section import ProfileConfig
from ddpkit.config.sample_section import SampleConfig

__all__ = [
    "OptimConfig",
    "ParamGroupConfig",
    "SchedConfig",
    "EarlyStoppingConfig",
    "TrainConfig",
    "DDPConfig",
    "COMPILE_TORCH_OPTIONS",
    "COMPILE_DDPKIT_OPTIONS",
    "COMPILE_MODES",
]

# The one table of `train.compile` keys: the config checks and ddpkit.parallel.model_views both read it.
#: Keys of a ``train.compile`` mapping passed to ``torch.compile`` as they are.
COMPILE_TORCH_OPTIONS = ("mode", "fullgraph", "dynamic", "backend", "options")
#: Keys of a ``train.compile`` mapping that ddpkit itself reads, with their defaults.
COMPILE_DDPKIT_OPTIONS = {"recompile_limit": 8, "validation": True}
#: The values ``torch.compile`` accepts for ``mode``.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class ParamGroupConfig:
    """One entry of `optim.groups`: the parameters its patterns select, and the settings they get instead of the
    optimizer's."""

    params: list[str] = option(
        factory=list,
        doc="Patterns of parameter names: shell-style (`fnmatch`: `*.bias`, `blocks.*.ln?.weight`), or a regular "
        "expression after `re:` (`re:^blocks\\.(0|1)\\.`, matched with `re.search`). Every pattern must match some "
        "parameter.",
    )
    lr: float | None = option(
        None, "This group's learning rate (the schedule scales it like `optim.lr`). `null`: `optim.lr`.", gt=0
    )
    weight_decay: float | None = option(
        None,
        "This group's weight decay, whatever the parameters' shapes. `null`: `optim.weight_decay` under "
        "`optim.decay`'s rule.",
        ge=0,
    )


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer. Not needed when the Trainer subclass overrides `build_optimizer`."""

    name: str = option("sgd", "A registered optimizer (`sgd`, `adam`, `adamw`) or `package.module:callable`.")
    lr: float = option(0.01, "Learning rate (peak rate when a warmup is used).", gt=0)
    momentum: float = option(0.0, "SGD momentum (SGD only; Adam's are `kwargs.betas`).", ge=0)
    weight_decay: float = option(0.0, "Weight decay (of the parameters `decay` selects).", ge=0)
    decay: Literal["matrices", "all"] = option(
        "matrices",
        "Which parameters `weight_decay` applies to: `matrices` (parameters of 2 or more dimensions: weight matrices "
        "and embeddings, not biases or norm weights; nanoGPT's, torchtitan's and the Hugging Face Trainer's rule) or "
        "`all` (every parameter, the rule of earlier ddpkit releases). A `groups` entry's own `weight_decay` wins over "
        "both.",
    )
    groups: list[ParamGroupConfig] = option(
        factory=list,
        doc="Parameter groups with their own `lr` / `weight_decay`, e.g. `[{params: ['*.ln*', 'ln_f.*'], weight_decay: "
        "0.0}, {params: ['head.*'], lr: 1e-4}]`: a parameter joins the first group with a pattern matching its name "
        "(`model.named_parameters()`), the others keep `lr`, `weight_decay` and the `decay` rule (docs/lm.md).",
    )
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
    """Stop training when a validation metric stops improving, or as soon as it reaches a target."""

    metric: str | None = option(None, "Validation metric to watch, e.g. `val_loss`. `null` disables early stopping.")
    mode: Literal["min", "max"] = option("min", "Whether smaller (`min`) or larger (`max`) is better.")
    patience: int = option(3, "Evaluations without improvement before stopping.", ge=1)
    min_delta: float = option(0.0, "Smallest change that counts as an improvement.", ge=0)
    target: float | None = option(
        None,
        "Stop at the first evaluation whose `metric` reaches this value (`>=` for mode `max`, `<=` for `min`), "
        "e.g. `0.95` with `metric: val_accuracy, mode: max`; the patience rule still applies. `null`: no target.",
    )


@dataclass(frozen=True)
class TrainConfig:
    """Length of training and what happens in each step."""

    epochs: int | None = option(
        None,
        "Epochs to train. `null` (the default): as many as `max_steps` takes, or one epoch when `max_steps` is null "
        "too. With both set, training stops at whichever comes first.",
        ge=1,
    )
    max_steps: int | None = option(
        None,
        "Optimizer steps to train: exactly this many, over as many epochs as that takes, when `epochs` is null (the "
        "schedule spans them all); a cap when `epochs` is set. `null`: `epochs` decides.",
        ge=1,
    )

    @property
    def epoch_limit(self) -> int | None:
        """The epochs the run may start: ``epochs`` when set, else 1 without ``max_steps`` and unbounded (None) with
        it."""
        if self.epochs is not None:
            return self.epochs
        return None if self.max_steps is not None else 1

    grad_accum_steps: int = option(
        1, "Micro-batches per optimizer step; the first k-1 run under DDP's `no_sync()`.", ge=1
    )
    clip_grad_norm: float | None = option(None, "Clip the global gradient norm to this value.", gt=0)
    loss_normalization: Literal["mean", "tokens"] = option(
        "mean",
        "`mean`: `training_step` returns a mean loss, averaged over micro-batches and ranks. `tokens`: it returns "
        "`(loss_sum, n_tokens)` and the update is the sum over every token of the global batch divided by the global "
        "token count (exact for any split into ranks and micro-batches; one all-reduce per step).",
    )
    profile: ProfileConfig | None = option(
        None,
        "torch.profiler: `{wait, warmup, active, repeat}` (its schedule, in optimizer steps) writes a trace per rank "
        "and recorded cycle to `<output_dir>/profile/` (Chrome/TensorBoard format) with ddpkit's phases labelled "
        "(`ddpkit.forward`, ...); `null`: off, no cost (docs/profiling.md).",
    )
    sample: SampleConfig | None = option(
        None,
        "Sample text from a language model while it trains: `{every_steps, prompt, max_new_tokens, temperature, top_k, "
        "seed, tokenizer}`, written to the log, `<output_dir>/samples.jsonl` and TensorBoard's text tab on rank 0, "
        "outside the timed steps (every rank samples: fsdp2's forward is collective). Refused under a pipeline or "
        "tensor parallelism (no rank holds the whole model). `null`: off.",
    )
    peak_tflops: float | None = option(
        None,
        "Peak dense TFLOP/s of one device at the run's precision, for `mfu` (model FLOPs utilisation). "
        "`null`: looked up from the GPU's name (H100, H200, A100, ...); unknown devices (CPUs) log no `mfu`.",
        gt=0,
    )
    precision: Literal["fp32", "bf16", "fp16"] = option(
        "fp32", "Autocast precision: `bf16` on CPU or CUDA; `fp16` (with a GradScaler) on CUDA only."
    )
    log_every: int = option(50, "Optimizer steps between logged (rank-reduced) training metrics.", ge=1)
    eval_every: int | None = option(
        None, "Optimizer steps between evaluations. `null`: at the end of every epoch.", ge=1
    )
    timeline: bool = option(False, "Write a Chrome-trace timeline (one row per rank) to `<output_dir>/timeline.json`.")
    compile: bool | dict[str, Any] = option(
        False,
        "`torch.compile` the model: `false`, `true`, or a mapping of torch.compile's `mode`, `fullgraph`, `dynamic`, "
        "`backend`, `options`, plus ddpkit's `recompile_limit` (compiled versions of one function, default 8; past it "
        "training stops with a message) and `validation` (default true: validate with a compiled copy too). DDP wraps "
        "first, then compile; compile time is logged and left out of samples/s; checkpoints never carry `_orig_mod.`.",
    )
    channels_last: bool = option(
        False,
        "Convert the model and 4-D inputs to channels_last (NHWC) memory format: faster convolutions on "
        "recent GPUs and often on CPU; no effect on models without convolutions.",
    )
    deterministic: bool = option(
        False,
        "Deterministic CUDA kernels (`torch.use_deterministic_algorithms`, cuDNN without autotuning): a GPU "
        "run, resumed or not, then gives the same bits every time; slower for some layers, and an operation "
        "with no deterministic kernel raises. Without it GPU runs differ in the last bits (convolutions' "
        "backward); CPU runs are deterministic either way.",
    )
    memory_check: bool = option(
        True,
        "Refuse, before the model is made, a layout whose largest rank cannot hold its parameters, gradients and "
        "optimizer state in its device's memory (a GPU's total, or the host's available memory over its ranks), "
        "naming the layouts that would fit (`ddpkit estimate`'s arithmetic; activations are not counted). `false` "
        "starts anyway: memory another job will free, swap, or an estimate that errs for your model.",
    )
    keep_host_memory: bool | None = option(
        None,
        "Host memory freed during training: `true` keeps it in the process for reuse (glibc `mallopt`; blocks up "
        "to 32 MiB), so each step's CPU activations do not fault in fresh pages (measured 200-1,900 page faults "
        "and up to 5 ms per MNIST-CNN step without it); `false` gives it back (blocks from 128 KiB unmapped when "
        "freed), so a rank's resident memory follows what it holds (measured: fsdp2's steady training peak 15% "
        "lower on a 946 MiB Llama); null: keep where every rank holds the whole model (a world of one, ddp, "
        "zero1), give back where the layout splits it (a pipeline, a tensor plan, fsdp2). Linux/glibc only.",
    )
    activation_checkpointing: bool | list[str] = option(
        False,
        "Recompute each block's activations in the backward pass instead of keeping them (non-reentrant "
        "`torch.utils.checkpoint`; works under ddp, zero1, fsdp2 and compile, same loss): `true` checkpoints the "
        "built-in gpt's `GPTBlock`s, or a Hugging Face model through its `gradient_checkpointing_enable`; a list "
        "names the module classes to checkpoint (`[MyBlock]`). Less activation memory for about one more forward "
        "a step (docs/lm.md).",
    )
    early_stopping: EarlyStoppingConfig = option(
        factory=EarlyStoppingConfig, doc="Early stopping on a validation metric."
    )


@dataclass(frozen=True)
class DDPConfig:
    """DistributedDataParallel options, named as in torch."""

    bucket_cap_mb: float | None = option(
        None,
        "Gradient bucket size in MiB: larger buckets, fewer allreduce calls. `null`: torch's default "
        "(25 MiB, with a small first bucket so communication starts early).",
        gt=0,
    )
    find_unused_parameters: bool = option(
        False, "Allow parameters that get no gradient in some steps (costs a graph walk per step)."
    )
    static_graph: bool = option(
        False, "Promise the graph and used parameters never change (enables DDP optimizations)."
    )
    gradient_as_bucket_view: bool = option(
        True,
        "Gradients are views into the allreduce buckets: saves the gradients' memory and a copy (the same bits), "
        "and the health checks read the gradient norm from the few flat buckets, in cache after the all-reduce "
        "(52 -> 18 us a step on the benchmark MLP). `false`: torch's default; code that calls `detach_()` on a "
        "gradient, or keeps a gradient tensor across steps, needs it off.",
    )
    broadcast_buffers: bool = option(True, "Broadcast buffers (e.g. BatchNorm statistics) from rank 0 at each forward.")
    sync_batchnorm: bool = option(False, "Convert BatchNorm layers to SyncBatchNorm.")
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = option(
        "none", "DDP communication hook: compress gradients to fp16/bf16, or PowerSGD low-rank compression."
    )
    powersgd_rank: int = option(1, "PowerSGD matrix approximation rank.", ge=1)
    powersgd_start_iter: int = option(10, "PowerSGD: plain allreduce for this many steps first.", ge=2)
