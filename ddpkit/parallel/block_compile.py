"""``train.compile`` one block at a time: under ``parallel.mode: fsdp2`` and inside pipeline stages.

    if compiles_per_block(layout):                      # fsdp2, or parallel.pipeline > 1
        compile_blocks(part, settings, names=way_blocks)  # in place, after activation checkpointing, before sharding

Without these, ddpkit compiles the DDP-wrapped model whole (:mod:`ddpkit.parallel.model_views`). FSDP2 and torch's
pipeline stages instead drive the model from outside its forward: FSDP2 gathers and frees each block's parameters in
hooks around the block, and torch's ``PipelineStage`` calls the stage module itself. So ddpkit compiles as torchtitan
does (``apply_compile``): each block on its own, before ``fully_shard``. What is compiled is the block's ``forward``
(replaced on the instance), not its ``__call__``: the hooks FSDP2 registers on the block (gather before, free after)
run around the compiled code, never inside it, as around torchtitan's compiled wrapper. Identical blocks share their
compiled graphs (Dynamo takes the parameters as inputs), so a 12-block model costs a few compilations, not twelve.

The blocks are those FSDP2 shards as units (:func:`ddpkit.parallel.fsdp.fsdp_blocks`: ``parallel.fsdp.blocks``, or
the children of the model's outermost ``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential``); a part that has no
such block (a user's model cut by module names) is compiled whole, in place. Replacing ``forward`` keeps every
parameter's name (no ``_orig_mod.`` as a wrapper module would add), so checkpoints do not change with compiling;
activation checkpointing, applied first, is inside the compiled forward. Validation runs the same compiled
blocks (``train.compile.validation`` has no separate copy to turn off here).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ddpkit.parallel.fsdp import fsdp_blocks
from ddpkit.parallel.layout import ParallelLayout
from ddpkit.parallel.model_views import CompileSettings, explain_failures

__all__ = ["compiles_per_block", "compile_blocks"]

log = logging.getLogger("ddpkit")


def compiles_per_block(layout: ParallelLayout) -> bool:
    """Whether ``train.compile`` compiles block by block on this layout: under fsdp2 or inside a pipeline."""
    return layout.pp > 1 or not layout.data_parallel.replicated


def compile_blocks(part: nn.Module, settings: CompileSettings, *, names: list[str] | None = None) -> int:
    """Compile each block of ``part`` in place (``names``: ``parallel.fsdp.blocks``), or ``part`` itself when it
    has none; the number of modules compiled."""
    blocks = fsdp_blocks(part, names) or [part]
    for block in blocks:
        # Wrapped, Dynamo's and Inductor's errors become one message that names the config key to change, as for a
        # model compiled whole.
        block.forward = explain_failures(
            torch.compile(block.forward, **settings.torch_kwargs), settings.recompile_limit
        )
    log.info(
        "torch.compile: %d module(s) of %s compiled one by one (%s), before the data-parallel wrapper",
        len(blocks),
        type(part).__name__,
        ", ".join(sorted({type(b).__name__ for b in blocks})),
    )
    return len(blocks)
