"""The ``parallel`` config section: how the model, its gradients and its optimizer state are spread over ranks.

    parallel: {mode: fsdp2, fsdp: {blocks: [GPTBlock], reshard_after_forward: true}}

    ddpkit run --nproc 2 train.py config.yaml parallel.mode=zero1

``ddp`` (the default) keeps a full copy of everything on every rank; ``zero1`` shards the optimizer
state (torch's ``ZeroRedundancyOptimizer``); ``fsdp2`` shards parameters, gradients and optimizer
state (torch's ``fully_shard``). docs/modes.md says which to choose. The wrapping itself lives in
:mod:`ddpkit.distributed.sharding`; this module only declares the options. The combinations that
cannot work are refused by :mod:`ddpkit.config.checks` (``parallel_problems``), so a bad config stops
before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ddpkit.config.fields import option

__all__ = ["FSDPConfig", "ParallelConfig"]


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 (`fully_shard`) options, used when `parallel.mode` is `fsdp2`."""

    blocks: list[str] | None = option(
        None,
        "Class names of the submodules sharded as one unit each (e.g. `[GPTBlock]`); the root takes the rest. "
        "`null`: every child with parameters of the outermost `nn.ModuleList` / `nn.Sequential` containers.",
    )
    reshard_after_forward: bool = option(
        True,
        "Free each block's gathered parameters after its forward and gather them again for the backward: "
        "less memory, one more all-gather per block and step (ZeRO-3). "
        "`false`: keep them until the backward (ZeRO-2 like).",
    )


@dataclass(frozen=True)
class ParallelConfig:
    """How parameters, gradients and optimizer state are held across ranks (see docs/modes.md)."""

    mode: Literal["ddp", "zero1", "fsdp2"] = option(
        "ddp",
        "`ddp`: every rank holds everything; `zero1`: DDP plus `ZeroRedundancyOptimizer` (each rank holds 1/N of "
        "the optimizer state); `fsdp2`: `fully_shard` (1/N of parameters, gradients and optimizer state). `zero1` and "
        "`fsdp2` write sharded checkpoints (a DCP directory) that resume in any mode on any number of ranks.",
    )
    fsdp: FSDPConfig = option(factory=FSDPConfig, doc="FSDP2 options (`parallel.mode: fsdp2`).")
