"""Whether a run's layout fits its devices: what each rank will hold, from the model on the meta device.

    fp = footprint(model, cfg, nproc=4)                     # per parallel.mode: the largest rank's RankBytes
    fp.per_mode["fsdp2"].total                              # its parameters + gradients + optimizer state, in bytes
    refuse_what_cannot_fit(model, cfg, runtime=runtime)     # the Trainer, on every rank: ConfigError (exit 2) or none

The numbers are ``ddpkit estimate``'s (which reads them from here): each way's ``bytes_per_rank``
(:mod:`ddpkit.parallel.data_parallel`), over the pipeline's largest stage and each parameter's tensor-parallel shard.
A frozen parameter (LoRA's base) counts as a parameter only: no gradient, no optimizer state.

The Trainer refuses a layout whose largest rank cannot hold that much (exit 2, with the layouts that would fit) after
building the model on the meta device and before making any of it, and ``ddpkit run`` refuses it before it starts a
worker: a shape that cannot fit stops in seconds, not with an out-of-memory error an hour in. The device's memory is
the rank's GPU's total, or on the CPU the host's available memory shared by the node's ranks. Activations, FSDP2's
gathered block and allocator slack come on top: passing says the run may fit, a refusal that it cannot.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ddpkit.config.layout import layout_problems, tensor_config_problems
from ddpkit.config.schema import Config
from ddpkit.distributed.collectives import all_gather_object
from ddpkit.distributed.memory import RankBytes, format_bytes, fsdp_bytes, optimizer_slots
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import ConfigError
from ddpkit.parallel.layout import DATA_PARALLEL
from ddpkit.parallel.pipeline_split import split_model
from ddpkit.training.optim import build_optimizer

__all__ = [
    "Footprint",
    "footprint",
    "device_memory_per_rank",
    "fit_problem",
    "refuse_what_cannot_fit",
    "refuse_before_spawning",
]

log = logging.getLogger("ddpkit")

MODES = tuple(DATA_PARALLEL)


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What the largest rank of each ``parallel.mode`` holds, for one config and world size."""

    #: Trainable parameters of the whole model, and of the largest pipeline stage (the whole model without one).
    count: int
    stage_count: int
    element_size: int
    #: Optimizer state tensors per parameter element (None: an optimizer ddpkit does not know).
    slots: int | None
    per_mode: dict[str, RankBytes]
    #: The whole model's trainable parameter shapes: what fsdp2 over more ranks would shard.
    shapes: tuple[tuple[int, ...], ...]


def footprint(model: nn.Module, cfg: Config, *, nproc: int, modes: Sequence[str] = MODES) -> Footprint:
    """Each of ``modes``' largest rank on ``nproc`` ranks, for ``model`` (on the meta device, or real)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Over the model, as the Trainer builds it: optim.groups select parameters by name
    with torch.device("meta"):
        slots = optimizer_slots(build_optimizer(model, cfg.optim)) if trainable else 0
    held = _largest_stage(model, cfg) if cfg.parallel.pipeline > 1 else list(model.parameters())
    stages, tensor = cfg.parallel.pipeline, cfg.parallel.tensor
    replicas = max(1, nproc // (stages * tensor))
    if tensor > 1:
        # What the config refuses beside tensor parallelism (zero1, and ddp over several replicas) is left out.
        modes = [mode for mode in modes if _accepted(cfg, mode, nproc)]
    element_size = held[0].element_size() if held else 4
    shapes = _tensor_shard_shapes(model, held, tensor, cfg.parallel.vocab_parallel)
    learnt = [shapes[id(p)] for p in held if p.requires_grad]
    frozen = [shapes[id(p)] for p in held if not p.requires_grad]
    per_mode = {}
    for mode in modes:
        way = DATA_PARALLEL[mode].from_config(cfg.parallel)
        # An unknown optimizer: Adam's two, as ddpkit estimate says in its output
        state = 2 if slots is None else slots
        ranks = way.bytes_per_rank(learnt, world_size=replicas, slots=state, element_size=element_size)
        bases = way.bytes_per_rank(frozen, world_size=replicas, slots=0, element_size=element_size)
        both = [dataclasses.replace(r, parameters=r.parameters + b.parameters) for r, b in zip(ranks, bases)]
        per_mode[mode] = max(both, key=lambda b: b.total)
    return Footprint(
        count=sum(p.numel() for p in trainable),
        stage_count=sum(p.numel() for p in held if p.requires_grad),
        element_size=element_size,
        slots=slots,
        per_mode=per_mode,
        shapes=tuple(tuple(p.shape) for p in trainable),
    )


def device_memory_per_rank(device: torch.device, *, local_world_size: int) -> int:
    """Bytes one rank may use: its GPU's total memory, or the host's available memory over the node's ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return _available_host_memory() // max(1, local_world_size)


def fit_problem(fp: Footprint, mode: str, budget: int, *, nproc: int) -> str | None:
    """Why ``mode`` on ``nproc`` ranks cannot fit in ``budget`` bytes a rank, naming what would; None if it fits."""
    need = fp.per_mode[mode]
    if need.total <= budget:
        return None
    fits = [m for m, b in fp.per_mode.items() if b.total <= budget]
    if fits:
        other = ", ".join(f"parallel.mode={m} ({format_bytes(fp.per_mode[m].total, exact=False)})" for m in fits)
        instead = f"on {nproc} rank(s) {other} would fit"
    else:
        instead = _ranks_for_fsdp2(fp, budget)
    return (
        f"parallel.mode={mode} on {nproc} rank(s) cannot fit: its largest rank would hold "
        f"{format_bytes(need.total, exact=False)} (parameters {format_bytes(need.parameters, exact=False)}, "
        f"gradients {format_bytes(need.gradients, exact=False)}, optimizer state "
        f"{format_bytes(need.optimizer, exact=False)}) and the device has {format_bytes(budget, exact=False)} a rank; "
        f"{instead}, or make the model smaller (`ddpkit estimate CONFIG --nproc-per-node N` prints each layout); "
        "train.memory_check=false starts it anyway"
    )


def refuse_what_cannot_fit(model: nn.Module, cfg: Config, *, runtime: Runtime) -> None:
    """Raise ConfigError on every rank, or on none, when the configured layout's largest rank cannot hold its
    parameters, gradients and optimizer state (one collective: the ranks take the smallest device's memory)."""
    env = runtime.env
    budget = min(all_gather_object(device_memory_per_rank(runtime.device, local_world_size=env.local_world_size)))
    _refuse(model, cfg, budget=budget, world_size=env.world_size)


def refuse_before_spawning(cfg: Config, *, world_size: int, local_world_size: int, device: torch.device) -> None:
    """``ddpkit run``'s same refusal before it starts a worker, for a model the registry builds on the meta device
    (one a training script registers is checked by its workers)."""
    from ddpkit import registry

    try:
        # The launcher's generator left as it was: forked workers start from it
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = registry.build_model(cfg.model)
    # Whatever stops the build here (a name the script registers, kwargs it rejects) each worker reports in full
    except Exception:
        return
    budget = device_memory_per_rank(device, local_world_size=local_world_size)
    _refuse(model, cfg, budget=budget, world_size=world_size)


def _refuse(model: nn.Module, cfg: Config, *, budget: int, world_size: int) -> None:
    if not cfg.train.memory_check:
        return
    try:
        held = footprint(model, cfg, nproc=world_size)
    except ConfigError as error:
        # A model the pipeline's own rule cannot cut (the Trainer's pipeline_stages does): nothing to check here
        log.info("memory check: skipped (%s)", str(error).splitlines()[0])
        return
    if cfg.parallel.mode not in held.per_mode:
        # A mode the layout's own checks refuse beside tensor parallelism: they say so, with the fix
        return
    problem = fit_problem(held, cfg.parallel.mode, budget, nproc=world_size)
    if problem is not None:
        raise ConfigError(problem)


def _ranks_for_fsdp2(fp: Footprint, budget: int) -> str:
    """The fewest ranks (a power of two) over which fsdp2 alone would hold the whole model within ``budget``."""
    slots = 2 if fp.slots is None else fp.slots
    for power in range(1, 21):
        ranks = 2**power
        most = max(b.total for b in fsdp_bytes(fp.shapes, world_size=ranks, slots=slots, element_size=fp.element_size))
        if most <= budget:
            return (
                f"none of {', '.join(fp.per_mode)} fits on these ranks; parallel.mode=fsdp2 fits from {ranks} ranks "
                f"({format_bytes(most, exact=False)} a rank)"
            )
    return f"none of {', '.join(fp.per_mode)} fits, nor fsdp2 over {2**20:,} ranks"


def _available_host_memory() -> int:
    """``MemAvailable`` (free memory plus what the kernel can reclaim), or the free pages where it is not known."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _accepted(cfg: Config, mode: str, nproc: int) -> bool:
    """Whether the config's layout with ``parallel.mode`` set to ``mode`` passes the config's own checks."""
    parallel = dataclasses.replace(cfg.parallel, mode=mode)
    changed = dataclasses.replace(cfg, parallel=parallel)
    return not tensor_config_problems(changed) and not layout_problems(parallel, world_size=nproc)


def _largest_stage(model: nn.Module, cfg: Config) -> list[torch.Tensor]:
    """The parameters of the pipeline stage that holds the most trainable ones (each counted once)."""
    stages = split_model(
        model, stages=cfg.parallel.pipeline * cfg.parallel.stages_per_rank, split_points=cfg.parallel.split_points
    )
    held = [list({id(p): p for p in stage.parameters()}.values()) for stage in stages]
    return max(held, key=lambda params: sum(p.numel() for p in params if p.requires_grad))


def _tensor_shard_shapes(
    model: nn.Module, params: list[torch.Tensor], tensor: int, vocab_parallel: bool | None
) -> dict[int, tuple[int, ...]]:
    """Each parameter's shape on one rank under ``tensor``-way tensor parallelism, by ``id``: the dimension its
    module's style splits (ddpkit.parallel.tensor_plan) divided by ``tensor``; the shapes as they are for ``tensor`` 1
    or a model without a plan of ddpkit's. ``vocab_parallel``: ``parallel.vocab_parallel`` (null: resolved as a run
    does)."""
    shapes = {id(p): tuple(p.shape) for p in params}
    if tensor == 1:
        return shapes
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ddpkit.models.tensor_plans import SequenceSplit
    from ddpkit.models.vocab_embedding import VocabParallelEmbedding
    from ddpkit.parallel.tensor_plan import tensor_plan, vocab_parallel_for

    splitting = (ColwiseParallel, RowwiseParallel, VocabParallelEmbedding)
    try:
        plan = tensor_plan(model, vocab_parallel=vocab_parallel_for(model, tensor, vocab_parallel))
    except ValueError:
        return shapes
    whole = dict(shapes)
    for name, style in plan.items():
        module = model.get_submodule(name)
        embedding = isinstance(module, nn.Embedding)
        style = style.style if isinstance(style, SequenceSplit) else style
        for key, param in module.named_parameters(recurse=False):
            if id(param) not in shapes or not isinstance(style, splitting):
                continue
            # Linear weights are [out, in]: colwise splits the rows (and the bias), rowwise the columns;
            # an Embedding's [vocab, dim] the other way round (VocabParallelEmbedding: its rows, as rowwise).
            rows = isinstance(style, ColwiseParallel) != embedding
            dim = 0 if rows or key == "bias" else 1
            if key == "bias" and not rows:
                continue
            # from the whole shape: a tied head's style splits the embedding's rows again, the same ones
            shape = list(whole[id(param)])
            shape[dim] //= tensor
            shapes[id(param)] = tuple(shape)
    return shapes
