"""``parallel.mode: fsdp2``: torch's ``fully_shard``, every block then the root, over the data-parallel replicas.

    way = FSDP2(cfg.parallel.fsdp, precision=cfg.train.precision)
    model = way.shard(model, mesh=layout.dp_mesh, runtime=runtime)   # in place: parameters become DTensor shards
    with way.block_by_block(model):                                   # validation gathers as training does
        ...

One wrapper for a whole model and for a pipeline's stage alike (torchtitan's order): each block of it
(:func:`fsdp_blocks`), then under the default rule each of the root's other children that holds parameters of its own
(:func:`fsdp_ends`: the embedding, the final norm, the output head; an embedding unit is not gathered for its
backward, which reads only the token ids), then the module itself, each ``fully_shard``-ed over the layout's ``dp``
mesh dimension (a 2-D (dp, tp) layout when tensor-parallel: FSDP2 shards each DTensor's local
rows further). Under HSDP (``parallel.replicate`` R > 1) the layout hands a 2-D ``("dp_replicate", "dp_shard")`` mesh
instead, which ``fully_shard`` takes as HSDP: parameters ``(Replicate(), Shard(0))``, all-gathered and
reduce-scattered within a shard group, their gradient shards then all-reduced across the R replicas. Under a pipeline
torch's ``PipelineStage`` drives FSDP2 itself: every microbatch's backward but the last runs without gradient sync and
without resharding, and after the last it runs FSDP2's post-backward (one reduce-scatter a unit); with
``reshard_after_forward`` off there (its default inside a pipeline) each unit is all-gathered once a step. Gradients are
reduced in fp32 whatever the compute precision: bf16 sums drift from DDP's. On Gloo every unit's all-gather and
reduce-scatter run in place (:mod:`ddpkit.parallel.gloo_collectives`): Gloo's own stage a whole-size copy, which
lands at the training peak.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ddpkit.config.parallel import FSDPConfig, ParallelConfig
from ddpkit.config.schema import DDPConfig
from ddpkit.distributed import ddp
from ddpkit.distributed.memory import RankBytes, fsdp_bytes
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import ConfigError
from ddpkit.models.init_by_name import is_on_meta
from ddpkit.parallel.data_parallel import DataParallel
from ddpkit.parallel.gloo_collectives import use_in_place_collectives

__all__ = ["FSDP2", "fsdp_blocks", "fsdp_ends", "is_sharded"]

log = logging.getLogger("ddpkit")

_PRECISION = {"bf16": torch.bfloat16, "fp32": None}
#: What FSDP2's sync_gradients hands out: one shared object, nothing allocated per micro-step.
_EVERY_MICRO_STEP = contextlib.nullcontext()
#: The containers whose children are blocks under the default rule.
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


class FSDP2(DataParallel):
    """Parameters, gradients and optimizer state each spread over the replicas, gathered one block at a time."""

    name = "fsdp2"
    replicated = False
    sharded_checkpoints = True

    def __init__(self, options: FSDPConfig, *, precision: str = "fp32", replicate: int = 1, pipeline: bool = False):
        self.blocks = options.blocks
        #: ``parallel.fsdp.reshard_after_forward`` resolved: null is true alone and false inside a pipeline, where
        #: torch's stage keeps a stage's parameters gathered from the first microbatch's forward to the step's
        #: gradient reduction (it turns resharding after backward off until then): one all-gather per unit and step.
        #: Resharding after each forward would gather again for every microbatch's forward and backward (measured
        #: on pp2 x dp2, 4 microbatches, 3 units a stage: 11 all-gathers a step instead of 3; docs/modes.md).
        setting = options.reshard_after_forward
        self.reshard_after_forward = (not pipeline) if setting is None else setting
        self.precision = precision
        #: HSDP's replicas (``parallel.replicate``): the data-parallel ranks hold R copies of one sharding.
        self.replicate = replicate
        #: ``parallel.fsdp.shard_vocabulary``: the embedding and the head split by vocabulary rows outside FSDP2's
        #: units (:mod:`ddpkit.parallel.fsdp_vocabulary`).
        self.shard_vocabulary = options.shard_vocabulary

    @classmethod
    def from_config(cls, parallel: ParallelConfig, *, precision: str = "fp32") -> FSDP2:
        return cls(parallel.fsdp, precision=precision, replicate=parallel.replicate, pipeline=parallel.pipeline > 1)

    def shard(self, model: nn.Module, *, mesh: Any, runtime: Runtime) -> nn.Module:
        """``fully_shard`` each block, then ``model``, over ``mesh`` (None: a mesh over every rank, built here)."""
        if len(ddp.devices_of(model)) > 1:
            raise ConfigError(
                "parallel.mode: fsdp2 shards a model over one device a rank, and this model's parameters are on "
                "several (placed by hand); build it on one device, or use parallel.mode=ddp"
            )
        # Imported here: FSDP2 pulls in DTensor and sympy (about a second) that ddp and zero1 never use.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not is_on_meta(model):
            model = model.to(runtime.device)
        if mesh is None:
            mesh = init_device_mesh(runtime.device.type, (runtime.env.world_size,), mesh_dim_names=("dp",))
        mp_policy = MixedPrecisionPolicy(param_dtype=_PRECISION[self.precision], reduce_dtype=torch.float32)
        ignored: set[nn.Parameter] = set()
        if self.shard_vocabulary:
            from ddpkit.parallel.fsdp_vocabulary import shard_vocabulary

            ignored = shard_vocabulary(model, mesh)
        blocks = fsdp_blocks(model, self.blocks)
        # Named classes are the user's whole choice; the default rule also takes the vocabulary matrices out of the
        # root, which FSDP2 keeps unsharded from its forward to the end of the backward.
        ends = fsdp_ends(model, blocks) if self.blocks is None else []
        # a module whose every parameter is split by vocabulary is no unit: FSDP2 would hold nothing of it
        ends = [end for end in ends if not set(end.parameters()) <= ignored]
        for block in [*blocks, *ends]:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp_policy)
            use_in_place_collectives(block, runtime.backend)
        # An embedding's backward reads the token ids, never its weight: FSDP2's own switch spares the all-gather
        # before it (measured: 125 MiB less at the end of a 946 MiB Llama's backward, where the peak is)
        for end in ends:
            if _embeddings_only(end):
                end.set_unshard_in_backward(False)
        # The root keeps its parameters for the backward (FSDP2's rule).
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, ignored_params=ignored or None)
        use_in_place_collectives(model, runtime.backend)
        # A 2-D mesh is HSDP: replicated over its first dimension, sharded over its last.
        replicas = mesh.size(0) if mesh.ndim == 2 else 1
        log.info(
            "fsdp2: %d block(s) sharded over %d rank(s)%s (%s), %d end(s) (%s), then the root%s",
            len(blocks),
            mesh.size(mesh.ndim - 1),
            f", replicated {replicas} times (HSDP)" if replicas > 1 else "",
            ", ".join(sorted({type(b).__name__ for b in blocks})) or "none",
            len(ends),
            ", ".join(type(e).__name__ for e in ends) or "none",
            "; the embedding and the head split by vocabulary rows outside its units" if ignored else "",
        )
        return model

    def wrap(self, model: nn.Module, runtime: Runtime, options: DDPConfig, *, group: Any = None) -> nn.Module:
        """The sharded model itself: FSDP2's hooks reduce the gradients."""
        if not is_sharded(model):
            raise RuntimeError("parallel.mode=fsdp2 but the model was not sharded: shard it before the optimizer")
        return model

    def sync_gradients(self, model: nn.Module, *, sync: bool) -> contextlib.AbstractContextManager[None]:
        """Every micro-batch's gradients reduce-scattered, accumulation micro-steps too: skipping it
        (``set_requires_gradient_sync(False)``) would keep every unsharded gradient until the last micro-batch, the
        whole model's gradients on every rank, which is what fsdp2 exists to avoid (measured: 0.82 of a world of
        one's peak on 2 ranks instead of 0.5). Under a pipeline torch's stage decides itself."""
        return _EVERY_MICRO_STEP

    def gathers_in_forward(self, model: nn.Module) -> bool:
        return is_sharded(model)

    @contextlib.contextmanager
    def block_by_block(self, model: nn.Module) -> Iterator[None]:
        """Validation as training gathers: each unit's parameters gathered for its forward and freed after it
        (``reshard_after_forward`` on for the pass, whatever ``parallel.fsdp.reshard_after_forward`` says: no
        backward follows), the root's freed at the end. A rank holds one block's full parameters at a time, not the
        model's."""
        if not is_sharded(model):
            yield
            return
        units = [m for m in model.modules() if is_sharded(m) and m is not model]
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
            # The root keeps its parameters after a forward (FSDP2's rule, for the backward): none follows here.
            model.reshard()

    @contextlib.contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[None]:
        """Every unit's parameters gathered once and kept through the context, freed after.

        Validation's way when the ranks cannot run as many forwards (a rank without a validation batch, a loader
        without a length: :mod:`ddpkit.training.evaluation`), so that no forward is a collective. Costs the full
        parameters on every rank meanwhile.
        """
        if not is_sharded(model):
            yield
            return
        units = [m for m in model.modules() if is_sharded(m)]
        for unit in units:
            # The same order on every rank: each is one all-gather.
            unit.unshard()
        model.set_reshard_after_forward(False)
        try:
            with self._whole_vocabulary(model):
                yield
        finally:
            for unit in units:
                unit.reshard()
            # Back to the configured behaviour; the root never reshards after forward (FSDP2's own rule).
            for unit in units:
                if unit is not model:
                    unit.set_reshard_after_forward(self.reshard_after_forward, recurse=False)

    def _whole_vocabulary(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """The vocabulary rows gathered whole too, when split outside FSDP2's units (``shard_vocabulary``)."""
        if not self.shard_vocabulary:
            return contextlib.nullcontext()
        from ddpkit.parallel.fsdp_vocabulary import whole_vocabulary

        return whole_vocabulary(model)

    def bytes_per_rank(
        self, shapes: Sequence[tuple[int, ...]], *, world_size: int, slots: int, element_size: int = 4
    ) -> list[RankBytes]:
        """``world_size``: the data-parallel degree; under HSDP each of the R replicas shards over world_size / R
        ranks, so a rank holds R times fsdp2's share over all of them."""
        if world_size % self.replicate:
            raise ConfigError(
                f"parallel.replicate: {self.replicate} does not divide the data-parallel degree {world_size}; set a "
                f"divisor of {world_size}"
            )
        shards = fsdp_bytes(shapes, world_size=world_size // self.replicate, slots=slots, element_size=element_size)
        return shards * self.replicate

    def __repr__(self) -> str:
        hsdp = f", replicate={self.replicate}" if self.replicate > 1 else ""
        vocabulary = ", shard_vocabulary=True" if self.shard_vocabulary else ""
        return f"FSDP2(blocks={self.blocks!r}, reshard_after_forward={self.reshard_after_forward}{hsdp}{vocabulary})"


def fsdp_blocks(model: nn.Module, names: list[str] | None) -> list[nn.Module]:
    """The submodules sharded as one unit each: by class name, or the default rule (docs/modes.md).

    Default: every child that has parameters, of the outermost ``nn.ModuleList`` / ``nn.Sequential`` /
    ``nn.ModuleDict`` containers (a transformer's layer list, an MLP's layers, a pipeline stage's blocks); the
    root keeps whatever is left.
    """
    if names is not None:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        missing = sorted(set(names) - {type(m).__name__ for m in found})
        if missing:
            known = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"parallel.fsdp.blocks: no submodule of class {', '.join(missing)} "
                f"in the model; its classes are {', '.join(known)}"
            )
        return _outermost(found)
    return list(_container_children(model))


def fsdp_ends(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """The root's other children sharded as one unit each: the default rule's second half (docs/modes.md).

    Every direct child of ``model`` that holds parameters, is not a container and holds no block: a transformer's
    embedding, final norm and output head (torchtitan shards its embedding and its norm and output as units of their
    own). Without this they sit in the root unit, which FSDP2 never reshards after its forward, so a rank would hold
    the whole vocabulary matrices, often the largest part of a language model, for the whole step. A child that
    shares a parameter with another (a head tied to the embedding) stays in the root: a parameter belongs to exactly
    one unit.
    """
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    # Which top-level names reach each parameter (tied weights are reached from two; the root's own from "")
    owners: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), set()).add(name.split(".", 1)[0] if "." in name else "")
    ends = []
    for name, child in model.named_children():
        if isinstance(child, _CONTAINERS) or any(id(m) in in_blocks for m in child.modules()):
            continue
        params = list(child.parameters())
        if params and all(owners[id(p)] == {name} for p in params):
            ends.append(child)
    return ends


def _embeddings_only(module: nn.Module) -> bool:
    """Whether every module of ``module`` that owns parameters is an ``nn.Embedding`` (a token or position table)."""
    owners = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    return bool(owners) and all(isinstance(m, nn.Embedding) for m in owners)


def _container_children(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        if isinstance(child, _CONTAINERS):
            yield from (c for c in child.children() if any(True for _ in c.parameters()))
        else:
            yield from _container_children(child)


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """Drop modules nested inside another listed one: FSDP2 units must not overlap in this use."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def is_sharded(model: nn.Module) -> bool:
    """True for a model that went through ``fully_shard`` (on the step path: a dict lookup, no import).

    FSDP2 is imported only when a model is sharded, so while it is not loaded no model can be one.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)
