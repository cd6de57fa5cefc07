"""The final weights of a split model as a Hugging Face directory, every rank writing what it holds.

    save_hf_directory(held, output_dir / "hf", model_kwargs=cfg.model.kwargs, rank=rank)   # every rank calls it
    >>> AutoModelForCausalLM.from_pretrained("runs/x/hf")     # or model.kwargs.init_from: runs/x/hf

Under a pipeline, a tensor plan or FSDP2 no rank holds the whole model, and none needs to: each rank renames the
tensors it holds (DTensors stay DTensors) to the Hugging Face model's names, and torch's DCP writes them with its
Hugging Face writer (``HuggingFaceStorageWriter``: a ``sharded/`` directory, each rank's pieces of each file; a
tensor held by several ranks, replicated, is written once). Then torch's
``consolidate_safetensors_files_on_every_rank`` joins the pieces into whole tensors, each output file by one rank,
one tensor at a time, and writes ``model.safetensors.index.json``; rank 0 adds ``config.json`` and copies
``init_from``'s tokenizer files, as ``ddpkit export --format hf`` does. So a rank's memory is what it holds (and
its fp32 copy, when it holds bf16) plus one whole tensor while it joins a file, never the model.

The directory is written as ``<name>.partial`` and renamed once complete, so a crash leaves no directory that looks
whole. It needs a filesystem every rank sees (as sharded checkpoints do): where a rank does not see rank 0's partial
directory (nodes with disks of their own) nothing is written, and the caller hears why. ddpkit writes no file format
of its own here: the conversion is ``hf_llama`` / ``hf_gpt2``'s names, and the files are DCP's.

What the directory holds is ``ddpkit export RUN --format hf``'s: the tied head left out, GPT-2's ``Conv1D`` weights
transposed back (a transposed DTensor: the shard dimension swaps), fp32, a padded vocabulary cut back to its real
rows (that one tensor replicated on the ranks sharing it first: DTensor slicing across shards gathers).
"""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

from ddpkit.atomic import write_atomically
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.models import hf_gpt2, hf_llama
from ddpkit.models.gpt import resolve
from ddpkit.models.hf_files import copy_tokenizer, special_tokens
from ddpkit.reporting.log import log

__all__ = ["save_hf_directory", "hf_views"]

#: Rank 0's token in the partial directory, which every rank must read there: the disk is one for all.
_SHARED = ".ddpkit-shared"


def save_hf_directory(
    model: torch.nn.Module, directory: Path, *, model_kwargs: dict[str, Any], rank: int
) -> str | None:
    """``model``'s held tensors (a rank's part of ddpkit's ``gpt`` model) into the Hugging Face ``directory``.

    A collective: every rank calls it with what it holds; each writes its pieces, then the pieces of a file are
    joined by one rank. ``model_kwargs``: ``model.kwargs`` of the run (the shape, the family, a padded vocabulary).
    Returns None once written, or why not (the same on every rank; nothing written): the model has no Hugging Face
    form, or ``directory``'s disk is not one every rank sees.
    """
    try:
        arch, kwargs = resolve(model_kwargs)
        # The family's config refuses options it cannot describe (e.g. a bias that family lacks)
        config = hf_llama.hf_config(kwargs) if arch == "llama" else hf_gpt2.hf_config(kwargs)
        views, problem = hf_views(model.state_dict(), arch=arch, kwargs=kwargs), None
    except (CheckpointError, ConfigError) as error:
        views, problem = {}, str(error)
    # Every rank names the tensors it holds (under a pipeline no rank knows the others'), or what stops it
    held: list[tuple[list[str], str | None]] = [([], None)] * dist.get_world_size()
    dist.all_gather_object(held, (sorted(views), problem))
    problems = [problem for _, problem in held if problem is not None]
    if problems:
        return problems[0]
    files = _file_of_each(sorted({name for names, _ in held for name in names}), dist.get_world_size())
    partial = directory.with_name(directory.name + ".partial")
    blind = _ranks_that_cannot_see(partial, rank=rank)
    if blind:
        # Each node would join its own pieces: files with holes, and rank 0's hf/ looking complete
        return (
            f"{directory.parent} is not one filesystem every rank sees: rank(s) {', '.join(map(str, blind))} do "
            f"not see rank 0's {partial.name}, and every rank writes its pieces of hf/ into it (a shared disk)"
        )
    writer = HuggingFaceStorageWriter(str(partial / "sharded"), fqn_to_index_mapping=files, save_distributed=True)
    dcp.save(views, storage_writer=writer)
    consolidate_safetensors_files_on_every_rank(str(partial / "sharded"), str(partial), files)
    if rank == 0:
        # As ddpkit export writes it: init_from's special tokens and tokenizer, so the directory is complete
        init_from = model_kwargs.get("init_from")
        config.update(special_tokens(init_from))
        copy_tokenizer(init_from, partial)
        write_atomically(partial / "config.json", json.dumps(config, indent=2) + "\n", durable=True)
        shutil.rmtree(partial / "sharded")
        (partial / _SHARED).unlink()
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)
        count = len(set(files.values()))
        log.info("saved %s: config.json + %d safetensors files, each rank writing what it holds", directory, count)
    # The directory is complete for every rank once rank 0 has renamed it
    dist.barrier()
    return None


def _ranks_that_cannot_see(partial: Path, *, rank: int) -> list[int]:
    """Rank 0 makes ``partial`` afresh with a token of this run in it; the ranks that do not read that token there
    (another node's disk, a stale directory of an earlier run) are returned, on every rank. A collective."""
    token = [secrets.token_hex(8) if rank == 0 else None]
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        write_atomically(partial / _SHARED, token[0], durable=True)
    dist.broadcast_object_list(token, src=0)
    try:
        seen = (partial / _SHARED).read_text() == token[0]
    except OSError:
        seen = False
    everyone: list[bool] = [False] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    blind = [other for other, saw in enumerate(everyone) if not saw]
    if blind and rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    return blind


def hf_views(weights: dict[str, torch.Tensor], *, arch: str, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``weights`` (some of the model's, DTensors or plain) under the Hugging Face model's names, as it stores them.

    Views where they can be (a rename; a cast to fp32 of fp32 is the tensor itself), DTensors where they were, so
    every rank's part of the model stays where it is. The conversion is ``ddpkit export --format hf``'s."""
    vocab = kwargs.get("valid_vocab") or kwargs["vocab_size"]
    out = {}
    for name, tensor in weights.items():
        # A tied head is the embedding: the Hugging Face model leaves it out of its files (GPT-2's always is)
        if name == "head.weight" and (arch != "llama" or kwargs["tied"]):
            continue
        if arch == "llama":
            theirs, transposed = hf_llama.hf_name(name), False
        else:
            theirs, transposed = hf_gpt2.hf_name(name) or (None, False)
        if theirs is None:
            raise CheckpointError(
                f"the model has {name!r}: it is not ddpkit's gpt model (the one with a Hugging Face form)"
            )
        tensor = tensor.detach().float()
        if transposed:
            # safetensors stores a contiguous tensor; a DTensor's contiguous() packs its local shard, placement kept
            tensor = tensor.t().contiguous()
        if name in ("embed.weight", "head.weight") and tensor.shape[0] > vocab:
            tensor = tensor[:vocab]
        out[theirs] = tensor
    return out


def _file_of_each(names: list[str], world_size: int) -> dict[str, int]:
    """File index (1, 2, ...) of each tensor: a block's tensors together, the blocks dealt round the ranks, so each
    rank joins about one world's share of the model (torch gives file ``i`` to rank ``i % world_size``)."""
    blocks = sorted({_block_of(name) for name in names} - {None})
    count = max(1, min(world_size, len(blocks)))
    return {name: 1 + (blocks.index(_block_of(name)) % count if _block_of(name) is not None else 0) for name in names}


def _block_of(name: str) -> int | None:
    parts = name.split(".")
    for marker in ("layers", "h"):
        if marker in parts[:-1]:
            return int(parts[parts.index(marker) + 1])
    return None
