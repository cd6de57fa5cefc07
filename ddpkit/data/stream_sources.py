"""Built-in streaming datasets, registered by name: WebDataset tar shards and Hugging Face ``datasets``.

    data: {name: webdataset, kwargs: {urls: "/data/digits/train-{000..007}.tar", val_urls: "/data/digits/val-000.tar"}}
    data: {name: hf_datasets, kwargs: {path: parquet, data_files: {train: /data/train.parquet},
                                       columns: [image, label]}}

Both return ``(train, val_or_None)`` streams (``IterableDataset``s without ``len()``), which the
Trainer shards over ranks and workers with :mod:`ddpkit.data.streaming`. ``python
scripts/write_digits_shards.py OUT_DIR`` writes the embedded ``digits`` data as tar shards, so
``webdataset`` runs with no download. Nothing here reaches the network: ``urls`` are local files,
and ``hf_datasets`` reads a local directory, local files or the local cache.

Needs the ``stream`` extra (torchdata, webdataset); ``hf_datasets`` also the ``hf`` extra.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ddpkit.errors import DataError, DdpkitError
from ddpkit.registry import register_dataset

__all__ = ["TarShards", "HFStream", "webdataset", "hf_datasets"]


def _require(module: str, extra: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise DdpkitError(
            f"data.name: this dataset needs the {module!r} package: pip install 'ddpkit[{extra}]'. "
            "Or choose a map-style dataset, e.g. data.name=digits."
        ) from None


class TarShards(IterableDataset):
    """WebDataset-style tar shards (``<key>.<field>`` members), read with the ``webdataset`` library.

    Each sample is the tuple of its ``fields`` (decoded by extension: ``npy`` arrays become
    tensors, ``cls`` an int). Shards are split over ``(rank, worker)`` slots when there are enough
    of them, else over ranks with samples split over workers, else samples over all slots; with
    ``shuffle`` the shard order is reshuffled per epoch from ``(seed, epoch)``, the same on every rank.
    """

    # See ddpkit.data.streaming: this class does its own worker split.
    ddpkit_splits_workers = True

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        fields: Sequence[str] = ("npy", "cls"),
        shuffle: bool = True,
        seed: int = 0,
        key: str = "data.kwargs.urls",
    ):
        self.urls = _expand(urls, key)
        self.fields = tuple(fields)
        self.shuffle = shuffle
        self.seed = seed
        self.rank = 0
        self.world_size = 1
        self.epoch = 0

    def shard(self, rank: int, world_size: int) -> TarShards:
        """This rank's view (called once by ddpkit on each rank)."""
        view = copy.copy(self)
        view.rank = rank
        view.world_size = world_size
        return view

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _assignment(self) -> tuple[list[str], int, int]:
        """This slot's shard files and its ``(offset, step)`` among their samples."""
        files = list(self.urls)
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(files)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        slot = self.rank * workers + worker
        slots = self.world_size * workers
        if len(files) >= slots:
            return files[slot::slots], 0, 1
        if len(files) >= self.world_size:
            return files[self.rank :: self.world_size], worker, workers
        return files, slot, slots

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        wds = _require("webdataset", "stream")
        files, offset, step = self._assignment()
        pipeline = wds.DataPipeline(
            wds.SimpleShardList(files), wds.tarfile_to_samples(), wds.decode(), wds.to_tuple(*self.fields)
        )
        for sample in itertools.islice(pipeline, offset, None, step):
            yield tuple(torch.from_numpy(value) if type(value).__module__ == "numpy" else value for value in sample)


def _expand(urls: str | Sequence[str], key: str) -> list[str]:
    """Brace-expanded local paths, each checked to exist."""
    if not urls:
        raise DataError(f"{key}: no shard files given; e.g. {key}=/data/digits/train-{{000..007}}.tar")
    if isinstance(urls, str):
        _require("webdataset", "stream")
        from webdataset.shardlists import expand_urls

        urls = expand_urls(urls)
    paths = [str(Path(url).expanduser()) for url in urls]
    missing = [path for path in paths if not Path(path).is_file()]
    if missing:
        raise DataError(
            f"{key}: {len(missing)} of {len(paths)} shard files not found (first: {missing[0]}). ddpkit reads local "
            "files only; write the embedded digits data with: python scripts/write_digits_shards.py DIR"
        )
    return paths


def webdataset(
    urls: str | list[str] = "",
    val_urls: str | list[str] | None = None,
    fields: Sequence[str] = ("npy", "cls"),
    shuffle: bool = True,
    seed: int = 0,
) -> tuple[TarShards, TarShards | None]:
    """Tar shards from ``urls`` (brace patterns like ``train-{000..007}.tar`` or a list) and optional ``val_urls``."""
    train = TarShards(urls, fields=fields, shuffle=shuffle, seed=seed)
    val = TarShards(val_urls, fields=fields, shuffle=False, key="data.kwargs.val_urls") if val_urls else None
    return train, val


class HFStream(IterableDataset):
    """A Hugging Face streaming ``IterableDataset`` whose rows become tuples of tensors (``columns``)."""

    # datasets splits its shards over DataLoader workers itself.
    ddpkit_splits_workers = True

    def __init__(self, dataset: Any, columns: Sequence[str] | None):
        self.dataset = dataset
        self.columns = tuple(columns) if columns else None

    def shard(self, rank: int, world_size: int) -> HFStream:
        from datasets.distributed import split_dataset_by_node

        return HFStream(split_dataset_by_node(self.dataset, rank=rank, world_size=world_size), self.columns)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        for row in self.dataset:
            yield tuple(torch.as_tensor(row[c]) for c in self.columns) if self.columns else row


def hf_datasets(
    path: str = "",
    split: str = "train",
    val_split: str | None = None,
    data_files: Any = None,
    columns: Sequence[str] | None = None,
    shuffle_buffer: int = 0,
    seed: int = 0,
) -> tuple[HFStream, HFStream | None]:
    """``datasets.load_dataset(path, data_files=..., split=..., streaming=True)`` from local files.

    ``path``: a local directory of data files, or a file format (``parquet``, ``json``, ``csv``)
    with ``data_files``. ``columns``: the row fields that make a sample tuple (default: the row
    dict). ``shuffle_buffer`` > 0: a shuffle buffer reseeded per epoch (``seed`` + epoch).
    """
    datasets = _require("datasets", "hf")
    if not path:
        raise DataError(
            "data.kwargs.path: set a local directory, or a format (parquet, json, csv) with data.kwargs.data_files"
        )

    def load(which: str) -> HFStream:
        try:
            stream = datasets.load_dataset(path, data_files=data_files, split=which, streaming=True)
        except (FileNotFoundError, ValueError) as exc:
            raise DataError(
                f"data.kwargs.path: cannot stream split {which!r} from {path!r} (data_files={data_files!r}): {exc}"
            ) from None
        if shuffle_buffer:
            stream = stream.shuffle(seed=seed, buffer_size=shuffle_buffer)
        return HFStream(stream, columns)

    return load(split), (load(val_split) if val_split else None)


register_dataset("webdataset", webdataset)
register_dataset("hf_datasets", hf_datasets)
