"""A model cut into pipeline stages, each keeping the whole model's parameter names.

    stages = split_model(model, stages=4)                  # ddpkit's gpt / llama: by blocks, balanced
    stages = split_model(model, stages=2, split_points=["layer3"])   # a model whose children run in order
    stage = stages[rank]; stage(h) -> the next stage's input (the last stage's output: the logits)

Why the names matter: a checkpoint is keyed by parameter name, so a stage that keeps ``blocks.7.attn.qkv.weight``
under that very name saves into, and resumes from, the same keys as a world of one (and as any other cut). The
blocks of a stage therefore sit in an ``nn.ModuleDict`` keyed ``"7"``, where an ``nn.ModuleList`` would renumber
them from 0; the embeddings stay ``embed`` / ``pos`` on the first stage, the final norm and ``head`` on the last.

A tied output layer (GPT-2's ``head.weight is embed.weight``) lives on the first stage and on the last: the last
stage keeps ``embed`` too (not called there), so the shared matrix has one name, ``embed.weight``, on both, and
:class:`TiedWeights` sums its two gradients before each update (Megatron-LM's embedding group).

Balance: blocks are cut at the block boundary nearest to where the running parameter count reaches each stage's
share, the embeddings counted on the first stage and the head on the last (torchtitan splits by layer count; by
parameters the first and last stages, which carry the vocabulary, get fewer blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.models.document_mask import Documents, documents_of
from ddpkit.models.llama import mask_padded_ids

__all__ = ["split_model", "cut_blocks", "stage_blocks", "TiedWeights", "tied_weight", "HeldParts"]


def split_model(model: nn.Module, *, stages: int, split_points: Sequence[str] | None = None) -> list[nn.Module]:
    """All ``stages`` stage modules of ``model`` (each rank then keeps its own); their parameters are ``model``'s."""
    if split_points is not None:
        return _split_children(model, stages, list(split_points))
    # ddpkit's model families say how they are cut: stage_parts, stage_input, stage_rotation, stage_output.
    family = getattr(model, "stage_parts", None)
    if family is None:
        raise ConfigError(
            f"parallel.pipeline: ddpkit cannot cut a {type(model).__name__} into stages by itself; set "
            "parallel.split_points to the names of its top-level children where a stage starts (children "
            f"{', '.join(name for name, _ in model.named_children())}), or override the Trainer's "
            "pipeline_stages(model, stages)"
        )
    ranges = cut_blocks(model, stages, family)
    return [LanguageModelStage(model, family, blocks, index, stages) for index, blocks in enumerate(ranges)]


def cut_blocks(model: nn.Module, stages: int, family: dict[str, tuple[str, ...]]) -> list[range]:
    """The blocks of each stage: contiguous, at least one each, cut by the running parameter count."""
    depth = len(model.blocks)
    if stages > depth:
        raise ConfigError(
            f"parallel.pipeline: {stages} stages (x parallel.stages_per_rank) but the model has {depth} blocks; "
            f"use at most {depth} stages"
        )
    first = _count(model, family["first"])
    last = _count(model, family["last"], skip_embedding=True)
    costs = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    share = (first + sum(costs) + last) / stages
    bounds = [0]
    running = first
    for index, cost in enumerate(costs):
        target = share * len(bounds)
        # This block would cross the stage's share: cut before it when that is nearer the share (two equal blocks
        # and a vocabulary at each end cut 2:2, not 3:1), keeping a block for each stage still to come.
        nearer_before = target - running < running + cost - target
        room_before = depth - index >= stages - len(bounds)
        if len(bounds) < stages and index > bounds[-1] and running + cost > target and nearer_before and room_before:
            bounds.append(index)
        running += cost
        # keep one block for each stage still to come
        room = depth - (index + 1) >= stages - len(bounds)
        if len(bounds) < stages and running >= share * len(bounds) and room:
            bounds.append(index + 1)
    while len(bounds) < stages:
        bounds.append(depth - (stages - len(bounds)))
    bounds.append(depth)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_blocks(stage: nn.Module) -> list[str]:
    """What a stage holds, for the log: its block names (``["0", "1"]``), or a user model's children names."""
    blocks = getattr(stage, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.keys())
    return [name for name, _ in stage.named_children()]


def _count(model: nn.Module, names: tuple[str, ...], *, skip_embedding: bool = False) -> int:
    """Parameters of ``model``'s parts ``names``, each once; ``skip_embedding``: not the embedding's (a tied head
    is counted on the first stage)."""
    seen = set()
    if skip_embedding and getattr(model, "embed", None) is not None:
        seen = {id(p) for p in model.embed.parameters()}
    total = 0
    for name in names:
        for p in getattr(model, name).parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


class LanguageModelStage(nn.Module):
    """Stage ``index`` of ``stages`` of a gpt / llama model: its blocks, and the embeddings or the head."""

    def __init__(self, model: nn.Module, family: dict, blocks: range, index: int, stages: int):
        super().__init__()
        self.is_first = index == 0
        self.is_last = index == stages - 1
        #: The model's class: its stage_input / stage_rotation / stage_output run on this stage's parts.
        self.family = type(model)
        #: The model's document mask setting (``use_documents``), None without one: each stage then needs the batch's
        #: token ids beside its activations (the ``tokens`` keyword every stage's forward gets from the schedule).
        self.documents = getattr(model, "documents", None)
        #: Into how many slices sequence parallelism splits the residual stream (``parallel.sequence_parallel``: the
        #: tensor degree; 1 without it): a later stage's input holds one slice, its rotary positions the whole.
        self.sequence_split = getattr(model, "sequence_split", 1)
        self.valid_vocab = getattr(model, "valid_vocab", None)
        tied = getattr(model, "head", None) is not None and model.head.weight is model.embed.weight
        wanted = set(family["every"])
        if self.is_first:
            wanted |= set(family["first"])
        if self.is_last:
            wanted |= set(family["last"])
            # the shared matrix keeps its first name, embed.weight, on the last stage too
            if tied:
                wanted.add("embed")
        # In the model's own order, so the parameter names and their order are the model's.
        for name, child in model.named_children():
            if name == "blocks":
                self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
            elif name in wanted:
                self.add_module(name, child)

    def forward(self, h: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's output of ``h`` (the token ids on the first stage, the previous stage's activations after).

        ``tokens``: the microbatch's token ids, which a model with the document mask needs on every stage (only the
        first receives them as its input); each stage finds the documents in them itself, as the whole model does.
        """
        documents = self._documents(tokens)
        # the whole sequence's length: the first stage's token ids are whole, a later stage's input may be a slice
        length = h.shape[1] if self.is_first else h.shape[1] * self.sequence_split
        if self.is_first:
            h = self.family.stage_input(self, h, documents)
        rope = self.family.stage_rotation(self, h, documents, length=length)
        for block in self.blocks.values():
            h = block(h, rope, None, documents) if rope is not None else block(h, None, documents)
        if self.is_last:
            h = self._logits(h)
        return h

    def _documents(self, tokens: torch.Tensor | None) -> Documents | None:
        if self.documents is None:
            return None
        if tokens is None:
            raise RuntimeError(
                "data.kwargs.document_mask: a pipeline stage needs the batch's token ids (its forward's tokens=) to "
                "mask attention by document; the pipeline's step and validation pass them"
            )
        return documents_of(tokens, **self.documents)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        # padded ids at -inf out of place, as the whole model does: under a tensor plan the head's output is a view
        return mask_padded_ids(self.family.stage_output(self, h), self.valid_vocab)


class ChildrenStage(nn.Module):
    """Some top-level children of a user's model, applied in order, under their own names."""

    def __init__(self, children: list[tuple[str, nn.Module]]):
        super().__init__()
        for name, child in children:
            self.add_module(name, child)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for child in self.children():
            h = child(h)
        return h


def _split_children(model: nn.Module, stages: int, split_points: list[str]) -> list[nn.Module]:
    children = list(model.named_children())
    names = [name for name, _ in children]
    unknown = [point for point in split_points if point not in names]
    if unknown:
        raise ConfigError(
            f"parallel.split_points: {', '.join(unknown)} is not a top-level child of {type(model).__name__}; "
            f"its children are {', '.join(names)}"
        )
    starts = sorted(names.index(point) for point in split_points)
    if len(starts) != stages - 1 or 0 in starts:
        raise ConfigError(
            f"parallel.split_points: {stages} stages need {stages - 1} split point(s) after the first child, "
            f"got {split_points}"
        )
    bounds = [0, *starts, len(children)]
    return [ChildrenStage(children[a:b]) for a, b in zip(bounds, bounds[1:])]


class TiedWeights:
    """A tied matrix's gradients summed over the two stages that hold it (the first and the last), before the update.

    Both stages then apply the same update to the same values, so the copies stay equal bit for bit.
    """

    def __init__(self, weight: torch.Tensor | None, group: Any):
        self.weight = weight
        self.group = group

    def reduce(self) -> None:
        """One all-reduce of the shared matrix's gradient between its two stages; nothing where it is not tied, or
        where it is frozen (a LoRA base: a zero gradient given to it would let weight decay move it)."""
        if self.group is None or self.weight is None or not self.weight.requires_grad:
            return
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        grad = self.weight.grad
        placements = getattr(self.weight, "placements", None)
        if placements is not None and grad.placements != placements:
            # A vocabulary-sharded embedding's lookup leaves its gradient replicated on the first stage, while the
            # last stage's head leaves it sharded: both laid out as the weight (a local slice, no communication),
            # so that the two stages reduce tensors of one size.
            grad = self.weight.grad = grad.redistribute(placements=placements)
        # fsdp2: the two stages of one replica hold the same shard (their data-parallel coordinate is the same).
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        torch.distributed.all_reduce(local, group=self.group)


def tied_weight(stage: nn.Module) -> torch.Tensor | None:
    """The matrix a last stage shares with the first (its ``embed`` kept beside ``head``), else None."""
    if not getattr(stage, "is_last", False) or getattr(stage, "embed", None) is None:
        return None
    head = getattr(stage, "head", None)
    return stage.embed.weight if head is not None and head.weight is stage.embed.weight else None


class HeldParts(nn.Module):
    """Every part the local stages hold, under the whole model's names: what this rank saves, trains and counts.

    One ``blocks`` ModuleDict gathers the blocks of all local stages (interleaved schedules hold several).
    ``forward``: what calling the parts does, validation's forward through every stage of the replica
    (:class:`ddpkit.training.evaluation_pipeline.PipelineForward`; outside validation it refuses).
    """

    def __init__(self, stages: list[nn.Module], *, forward: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self._run_forward = forward
        blocks = nn.ModuleDict()
        for stage in stages:
            for name, child in stage.named_children():
                if name == "blocks":
                    blocks.update(child)
                elif not hasattr(self, name):
                    self.add_module(name, child)
        if len(blocks):
            self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's logits of ``x``, inside validation (``validation_step``'s ``self.model(x)``)."""
        if self._run_forward is None:
            raise RuntimeError("these pipeline parts have no forward: a rank holds only its stages")
        return self._run_forward(x)
