"""A Hugging Face directory's weights read into a model a held part at a time: each rank reads only its slices.

    weights = HFWeights.open(directory, wanted, shapes)   # headers only: every tensor found, its shape checked
    weights.fill(part)        # each parameter ``part`` holds (whole, or a DTensor's shard): only its slice is read

``wanted`` names, for each of the model's parameters, the tensor of the files it comes from (:class:`Wanted`: the
family's renaming, GPT-2's transposed ``Conv1D``, a padded vocabulary); :mod:`ddpkit.models.hf_gpt2` and
:mod:`ddpkit.models.hf_llama` write it. A rank that holds a pipeline stage reads its stage's tensors; a rank that
holds a tensor plan's or FSDP2's shard reads the rows and columns of that shard (``safe_open(...).get_slice(name)
[rows, cols]``: the bytes are mapped, and only the slice's pages are touched), in blocks of at most :data:`BLOCK`
elements, the file opened for each (its mapped pages leave with it); each block is converted to the parameter's
dtype alone, so a rank never holds more than its part plus one block. A tied head is read once, as the
embedding. Rows a padded vocabulary adds past the file's are zeros (their logits are masked); a position table
shorter than the file's reads its first rows.

This is the read DCP's ``HuggingFaceStorageReader`` makes for each chunk (``get_slice(fqn)[slices]``, copied into
the target), made here per parameter because that reader cannot transpose GPT-2's ``Conv1D`` or pad a vocabulary,
and ``dcp.load`` plans collectively where every rank here already knows its slices. The chunk a DTensor holds comes
from its ``__create_chunk_list__``, the protocol DCP reads shards by.

Everything is checked when the directory is opened, before any parameter exists: a missing or truncated file, a
missing tensor, a shape that does not fit, each named with its file and tensor. Every rank opens the same files and
reaches the same verdict, so a bad directory stops every rank before the first collective, none waiting on another.
``pytorch_model.bin`` is read through ``torch.load(mmap=True, weights_only=True)``: mapped, not read whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.errors import CheckpointError
from ddpkit.models.hf_files import safetensors_torch
from ddpkit.models.init_by_name import is_adapter

__all__ = ["Wanted", "HFWeights", "BLOCK"]

#: The most elements read at once (16 Mi: 64 MiB of fp32): a larger slice is read in blocks of rows.
BLOCK = 16 * 2**20


@dataclass(frozen=True)
class Wanted:
    """Where one of the model's parameters is in the files."""

    #: The files' names for it, the first one present wins (GPT-2: ``transformer.h.0...`` or ``h.0...``).
    names: tuple[str, ...]
    #: Stored ``[in, out]`` (GPT-2's ``Conv1D``): the model's ``[out, in]`` is its transpose.
    transposed: bool = False
    #: Its first dimension may differ from the file's: a padded vocabulary (zero rows past the file's), a cropped
    #: position table (the file's first rows).
    rows: bool = False
    #: Said after "the files have no ..." when no name is present (why the tensor is needed).
    why: str = ""


@dataclass(frozen=True)
class _Found:
    file: Path
    name: str
    shape: tuple[int, ...]


class HFWeights:
    """A directory's tensors by the model's parameter names, checked, read a slice at a time (:meth:`fill`)."""

    def __init__(self, directory: Path, found: dict[str, _Found], wanted: dict[str, Wanted]):
        self.directory = directory
        self._found = found
        self._wanted = wanted

    @classmethod
    def open(cls, directory: str | Path, wanted: dict[str, Wanted], shapes: dict[str, tuple[int, ...]]) -> HFWeights:
        """The weights of ``directory`` for a model whose parameters have ``shapes``, each found where ``wanted``
        says; a CheckpointError naming the file and the tensor for anything missing, truncated or misshapen."""
        directory = Path(directory)
        headers, files = _headers(directory)
        found = {}
        for name, where in wanted.items():
            theirs = next((candidate for candidate in where.names if candidate in headers), None)
            if theirs is None:
                # the file the index places it in, or the one file there is
                file = next((files[c] for c in where.names if c in files), files.get("", directory))
                raise CheckpointError(
                    f"model.kwargs.init_from: {file}: the weights have no {where.names[0]!r}; the files are not a "
                    f"complete checkpoint of the model its config.json describes{where.why}"
                )
            file, shape = headers[theirs]
            _check_shape(name, where, shape, shapes[name], file=file, theirs=theirs)
            found[name] = _Found(file, theirs, shape)
        return cls(directory, found, wanted)

    def fill(self, module: nn.Module) -> None:
        """Every parameter ``module`` holds (the whole model or a part of it under its names) read from the files:
        a plain parameter whole, a DTensor its own shard only; each converted to the parameter's dtype alone."""
        with torch.no_grad():
            # named_parameters gives a tied parameter once, under its first name (the embedding's)
            for name, param in module.named_parameters():
                found = self._found.get(name)
                # a LoRA adapter is no tensor of the files: drawn by its own rule (ddpkit.models.lora)
                if found is None and is_adapter(name):
                    continue
                if found is None:
                    raise CheckpointError(f"model.kwargs.init_from: the model's {name!r} has no tensor in the files")
                _read_into(param, found, self._wanted[name])

    def files(self) -> list[Path]:
        """The weight files the model's tensors are read from, sorted (what a LoRA base is fingerprinted by)."""
        return sorted({found.file for found in self._found.values()})

    def __repr__(self) -> str:
        return f"HFWeights({str(self.directory)!r}, {len(self._found)} tensors)"


def _check_shape(
    name: str, where: Wanted, theirs_shape: tuple[int, ...], ours: tuple[int, ...], *, file: Path, theirs: str
) -> None:
    """The file's tensor fits the parameter: equal (transposed for GPT-2's Conv1D), or other rows where allowed."""
    shape = tuple(reversed(theirs_shape)) if where.transposed else theirs_shape
    fits = shape == ours or (where.rows and len(shape) == len(ours) and shape[1:] == ours[1:])
    if not fits:
        raise CheckpointError(
            f"model.kwargs.init_from: {file}: tensor {theirs!r} has shape {list(theirs_shape)}, but the model's "
            f"{name!r} needs {list(ours)}{' transposed' if where.transposed else ''}; the files do not match the "
            "model their config.json describes (a model.kwargs override, or files from another model?)"
        )


def _headers(directory: Path) -> tuple[dict[str, tuple[Path, tuple[int, ...]]], dict[str, Path]]:
    """Each tensor of the directory's weight files: its file and shape (headers only; every file opened once); and
    the file the index places each tensor in (``""``: the one file, without an index)."""
    index = directory / "model.safetensors.index.json"
    # which tensors each file holds, by the index: what a missing or unreadable shard is named by
    placed: dict[str, list[str]] = {}
    if index.is_file():
        for tensor, name in json.loads(index.read_text())["weight_map"].items():
            placed.setdefault(name, []).append(tensor)
        files = sorted(placed)
    elif (directory / "model.safetensors").is_file() or not (directory / "pytorch_model.bin").is_file():
        files = ["model.safetensors"]
    else:
        files = ["pytorch_model.bin"]
    missing = [name for name in files if not (directory / name).is_file()]
    if missing and not placed:
        raise CheckpointError(
            f"model.kwargs.init_from: {directory} has a config.json but no weights (model.safetensors or "
            "pytorch_model.bin); copy the weight files next to it"
        )
    if missing:
        raise CheckpointError(
            f"model.kwargs.init_from: {directory / missing[0]} is missing ({_holding(placed, missing[0])}, says "
            f"{index.name}); copy the weight files next to it"
        )
    headers = {}
    for name in files:
        path = directory / name
        with _open(path, holding=_holding(placed, name)) as handle:
            for key in handle.keys():
                headers[key] = (path, tuple(handle.get_slice(key).get_shape()))
    where = {tensor: directory / name for name, tensors in placed.items() for tensor in tensors}
    return headers, (where if placed else {"": directory / files[0]})


def _holding(placed: dict[str, list[str]], name: str) -> str:
    """What the index says file ``name`` holds, for a message: its first tensor and how many more."""
    tensors = placed.get(name)
    if not tensors:
        return ""
    more = f" and {len(tensors) - 1} more" if len(tensors) > 1 else ""
    return f"it holds {tensors[0]!r}{more}"


class _Torch:
    """A ``pytorch_model.bin`` mapped (``mmap=True``), behind safetensors' ``keys`` / ``get_slice`` interface."""

    def __init__(self, path: Path):
        self._tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_slice(self, name: str) -> _TorchSlice:
        return _TorchSlice(self._tensors[name])

    def __enter__(self) -> _Torch:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tensors = {}


@dataclass(frozen=True)
class _TorchSlice:
    tensor: torch.Tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensor[index]


def _open(path: Path, *, holding: str = "") -> Any:
    """A weight file opened for reading by slice; a truncated or unreadable one named, with what it holds."""
    try:
        if path.suffix == ".bin":
            return _Torch(path)
        from safetensors import safe_open

        return safe_open(str(path), framework="pt")
    except ImportError:
        safetensors_torch(f"reading {path}")
        raise
    except Exception as error:
        what = f" ({holding})" if holding else ""
        raise CheckpointError(
            f"model.kwargs.init_from: {path}{what} cannot be read ({str(error).splitlines()[0]}); the file is "
            "truncated or not a weight file: copy it again"
        ) from None


def _held(param: torch.Tensor) -> Iterator[tuple[torch.Tensor, tuple[int, ...]]]:
    """The tensors a rank holds of ``param`` and the offset of each in the whole parameter."""
    if hasattr(param, "device_mesh"):
        local = param.to_local()
        for chunk in param.__create_chunk_list__():
            yield local, tuple(chunk.offsets)
    else:
        yield param, (0,) * param.dim()


def _read_into(param: torch.Tensor, found: _Found, where: Wanted) -> None:
    """The slice of ``found`` that ``param`` holds, read and copied in (rows past the file's: zeros)."""
    for local, offsets in _held(param):
        if local.numel() == 0:
            continue
        box = [slice(o, o + n) for o, n in zip(offsets, local.shape)]
        target = local
        if where.rows:
            # rows past the file's (a padded vocabulary) are zeros: read only the rows the file has
            stored = found.shape[1] if where.transposed else found.shape[0]
            end = min(box[0].stop, stored)
            kept = max(end - box[0].start, 0)
            local[kept:].zero_()
            if kept == 0:
                continue
            box[0] = slice(box[0].start, end)
            target = local[:kept]
        _copy_rows(target, box, found, where)


def _copy_rows(target: torch.Tensor, box: list[slice], found: _Found, where: Wanted) -> None:
    """``box`` of ``found`` (in the model's layout) copied into ``target``, at most :data:`BLOCK` elements at a time,
    the file opened for each block: the pages a read maps leave with it, so a rank's peak is its part plus one
    block twice (the mapped pages and the converted copy), never a whole file or a whole tensor."""
    width = max(1, target[0].numel()) if target.dim() > 1 else 1
    step = max(1, BLOCK // width)
    start = box[0].start
    for first in range(0, target.shape[0], step):
        rows = slice(start + first, start + min(first + step, target.shape[0]))
        block = [rows, *box[1:]]
        index = tuple(reversed(block)) if where.transposed else tuple(block)
        with _open(found.file) as handle:
            piece = handle.get_slice(found.name)[index]
        target[first : first + step].copy_(piece.t() if where.transposed else piece)
