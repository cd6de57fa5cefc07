"""The ``parallel`` config section: how the model, its gradients and its optimizer state are spread over ranks.

    parallel: {mode: fsdp2, fsdp: {blocks: [GPTBlock], reshard_after_forward: true}}

    ddpkit run --nproc 2 train.py config.yaml parallel.mode=zero1

``ddp`` (the default) keeps a full copy of everything on every rank; ``zero1`` shards the optimizer
state (torch's ``ZeroRedundancyOptimizer``); ``fsdp2`` shards parameters, gradients and optimizer
state (torch's ``fully_shard``). docs/modes.md says which to choose. The ways themselves live in
:mod:`ddpkit.parallel.data_parallel` and :mod:`ddpkit.parallel.fsdp`; this module only declares the options. The
combinations that cannot work are refused by :mod:`ddpkit.config.checks` (``parallel_problems``), so a bad config stops
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
    reshard_after_forward: bool | None = option(
        None,
        "Free each block's gathered parameters after its forward and gather them again for the backward: "
        "less memory, one more all-gather per block and step (ZeRO-3). "
        "`false`: keep them until the backward (ZeRO-2 like); inside a pipeline, until the step's last microbatch "
        "(one all-gather per block and step instead of about two per microbatch). "
        "`null`: `true` without a pipeline, `false` inside one (torchtitan's default).",
    )
    shard_vocabulary: bool = option(
        False,
        "Hold the token embedding and the output head of ddpkit's language models as vocabulary rows split over the "
        "data-parallel ranks, outside FSDP2's units, so that no rank ever gathers a whole `[vocab, dim]` matrix or "
        "its gradient: the token ids and the final hidden states are all-gathered instead, and an all-to-all hands "
        "each rank its own tokens' logits (docs/modes.md#a-vocabulary-split-over-the-data-parallel-ranks). fsdp2 "
        "alone: no pipeline, tensor plan or HSDP. `false`: FSDP2 shards them as units of their own.",
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
    replicate: int = option(
        1,
        "HSDP (`parallel.mode: fsdp2` only): the data-parallel ranks form R replicas, each sharding the model over "
        "dp / R ranks (torch's `fully_shard` on a 2-D (replicate, shard) mesh): all-gathers and reduce-scatters stay "
        "within a shard group (one node's fast links), and one gradient all-reduce crosses the replicas. R must "
        "divide the data-parallel degree world_size / (P x T) (docs/modes.md#hsdp). `1`: plain fsdp2 over every "
        "data-parallel rank.",
        ge=1,
    )
    pipeline: int = option(
        1,
        "Pipeline stages P: the model is cut into P stages, each on its own rank (torch.distributed.pipelining); the "
        "data-parallel degree becomes world_size / P, held by `mode` (docs/modes.md#pipelines). `1`: no pipeline.",
        ge=1,
    )
    microbatches: int | None = option(
        None,
        "Microbatches M per optimizer step on each pipeline (they replace `train.grad_accum_steps`): each replica's "
        "share of the batch is split into M; `null`: 2 x `pipeline` (at least 2).",
        ge=1,
    )
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"] = option(
        "1f1b",
        "Pipeline schedule: `gpipe` (all forwards, then all backwards: holds M microbatches' activations), `1f1b` "
        "(at most P - stage), `interleaved_1f1b` and `looped_bfs` (`stages_per_rank` stages on each rank).",
    )
    stages_per_rank: int = option(
        1,
        "Stages V each rank holds (the model is cut into P x V stages): 2 or more for `interleaved_1f1b` and "
        "`looped_bfs`, 1 for `gpipe` and `1f1b`.",
        ge=1,
    )
    split_points: list[str] | None = option(
        None,
        "A user model's pipeline cut, by the names of its top-level children where a new stage starts (`[layer3]`; "
        "the children must run in order). `null`: ddpkit's own models cut themselves by blocks, balanced by "
        "parameters; another model needs these or a `pipeline_stages(model, stages)` Trainer method.",
    )
    tensor: int = option(
        1,
        "Tensor-parallel degree T: each block's attention heads and MLP width are split T-way over T ranks (torch's "
        "DTensor styles, a tensor plan by module name); the data-parallel degree becomes world_size / (P x T), held "
        "by `mode` (`fsdp2` over any degree, `ddp` with one replica) (docs/modes.md#tensor-parallelism). `1`: none.",
        ge=1,
    )
    vocab_parallel: bool | None = option(
        None,
        "Under `tensor` > 1, shard the embedding and the head by vocabulary too (torch's `loss_parallel`: the logits "
        "are never whole on one rank). `null`: on where ddpkit's model's vocabulary divides by `tensor` and has no "
        "padded ids, else off; `true`: on (refused where the vocabulary does not divide); `false`: both replicated, "
        "the logits whole.",
    )
    sequence_parallel: bool = option(
        False,
        "Under `tensor` > 1, split the residual stream between each block's sharded matmuls by sequence too "
        "(Megatron-LM's sequence parallelism, torch's `SequenceParallel` norms): each tensor rank holds `length / "
        "tensor` positions of the norms' and residuals' activations, and the attention and MLP all-gather their "
        "input and reduce-scatter their output instead of all-reducing it. The Llama family only; every batch's "
        "sequence length must divide by `tensor` (docs/modes.md#sequence-parallelism).",
    )
