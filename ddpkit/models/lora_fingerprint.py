"""The fingerprint of a LoRA adapter's frozen base: what a checkpoint's adapter is checked against on resume.

    fingerprint, of_what = fingerprint_base(model)     # before the adapter is added (ddpkit.models.lora.apply_lora)

Two kinds, by what the base is:

- **ddpkit's own models** (``gpt`` and the Llama family: they carry ``init_seed`` and ``weights_from``) are
  fingerprinted by their **source** (:func:`source_fingerprint`): the weight files' bytes for ``init_from``, or the
  seed their weights are drawn from by name. Either determines every bit of the base, and neither needs the base's
  tensors: the model may be on the meta device (each rank makes only what it holds, ddpkit.parallel.meta_build),
  and no rank ever holds the whole base to hash it. The files are hashed once in all, each by one rank.
- **Any other model** is fingerprinted by its **weights** (:func:`base_fingerprint`): sha256 over every parameter's
  name, dtype, shape and bytes, a piece at a time (no second copy of the model, nor of its largest matrix). Such a
  model is built whole on every rank.

A checkpoint records which kind it carries (``LoraBase``'s ``fingerprint_of``); one of the other kind (an adapter
saved by an earlier ddpkit, which hashed every base's weights) cannot be compared and is resumed with a warning.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.atomic import file_sha256

__all__ = ["fingerprint_base", "fingerprinted_by_source", "base_fingerprint", "source_fingerprint", "SOURCE", "WEIGHTS"]

#: The two kinds a checkpoint's ``fingerprint_of`` names.
SOURCE, WEIGHTS = "source", "weights"

#: Elements of a tensor hashed at a time: a GPU's tensor crosses to the host in pieces of at most 64 MiB (fp32).
_HASHED_AT_ONCE = 2**24

#: Names the scheme a seeded base is drawn by (ddpkit.models.init_by_name): a new scheme must change it.
_SEEDED_SCHEME = "ddpkit.models.init_by_name/1"


def fingerprint_base(model: nn.Module) -> tuple[str, str]:
    """``(sha256 hex, kind)`` of ``model``'s base as built: by its source where it is one of ddpkit's models, else
    by its weights (which must then be real tensors, not on the meta device)."""
    if fingerprinted_by_source(model):
        return source_fingerprint(model), SOURCE
    return base_fingerprint(model), WEIGHTS


def fingerprinted_by_source(model: nn.Module) -> bool:
    """Whether ``model`` is one of ddpkit's own (it carries ``init_seed`` and ``weights_from``), fingerprinted by its
    source: without its tensors, so it may be built on the meta device."""
    return hasattr(model, "init_seed") and hasattr(model, "weights_from")


def source_fingerprint(model: nn.Module) -> str:
    """sha256 over the parameters' names, dtypes and shapes and what their values come from: every weight file's
    sha256 (``init_from``; the files spread over the ranks, each hashed by one), or the seed and scheme they are
    drawn by. Collective when ``init_from`` is set and a process group is up: every rank must call it."""
    params = [[name, str(p.dtype), list(p.shape)] for name, p in model.named_parameters()]
    if model.weights_from is None:
        source = {"scheme": _SEEDED_SCHEME, "seed": int(model.init_seed)}
    else:
        source = {"files": _file_digests(model.weights_from.files())}
    text = json.dumps({"parameters": params, **source}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def base_fingerprint(model: nn.Module) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes, in ``named_parameters`` order (tied ones once).

    Tensor by tensor, a piece at a time: a CPU tensor's own bytes are hashed where they are (no copy), a GPU's come
    over in pieces, so no second copy of the model, nor of its largest matrix, is ever made."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        data = param.detach()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
        # a view for a contiguous parameter (all of a model's, in practice); the same bytes in the same order
        for piece in data.reshape(-1).split(_HASHED_AT_ONCE):
            digest.update(piece.cpu().view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _file_digests(files: list[Path]) -> list[list[str]]:
    """``[name, sha256]`` of each file; under a process group, rank r hashes files r, r + world, ... and every rank
    gets all of them (one ``all_gather_object``): the files are read once in all, not once a rank."""
    spread = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if spread else (0, 1)
    mine = {str(path): file_sha256(path) for path in files[rank::world]}
    if spread:
        gathered: list[dict[str, str] | None] = [None] * world
        dist.all_gather_object(gathered, mine)
        mine = {path: digest for part in gathered for path, digest in (part or {}).items()}
    return [[Path(path).name, mine[str(path)]] for path in files]
