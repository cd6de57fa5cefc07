"""Write ddpkit's embedded ``digits`` data as WebDataset tar shards, so streaming runs with no download.

    python scripts/write_digits_shards.py /tmp/digits-shards --shards 8
    ddpkit run configs/quickstart.yaml --nproc-per-node 2 data.name=webdataset \\
        'data.kwargs={urls: "/tmp/digits-shards/train-{000..007}.tar", val_urls: /tmp/digits-shards/val-000.tar}'

Each sample is two tar members, ``<index>.npy`` (a float32 1xSxS image) and ``<index>.cls``
(its label as text), where ``<index>`` is the sample's position in the data set (7 digits). The
data are exactly those of ``data.name=digits`` with the same arguments (the same seeds). Only the
standard library and numpy are used: writing shards needs no extra.
"""

from __future__ import annotations

import argparse
import io
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ddpkit.data.datasets import make_digits


def write_shards(
    images: torch.Tensor, labels: torch.Tensor, out_dir: Path, *, prefix: str, sizes: Sequence[int]
) -> list[Path]:
    """Write consecutive runs of ``sizes`` samples to ``out_dir/<prefix>-000.tar``, ...; return the paths."""
    if sum(sizes) != len(labels):
        raise ValueError(f"shard sizes add up to {sum(sizes)}, but there are {len(labels)} samples")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for number, size in enumerate(sizes):
        path = out_dir / f"{prefix}-{number:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for index in range(start, start + size):
                npy = io.BytesIO()
                np.save(npy, images[index].numpy().astype(np.float32), allow_pickle=False)
                _add(tar, f"{index:07d}.npy", npy.getvalue())
                _add(tar, f"{index:07d}.cls", str(int(labels[index])).encode())
        paths.append(path)
        start += size
    return paths


def even_sizes(total: int, shards: int) -> list[int]:
    """``total`` split into ``shards`` sizes that differ by at most one."""
    return [total // shards + (1 if i < total % shards else 0) for i in range(shards)]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 0  # mtime 0: the same data give byte-identical shards
    tar.addfile(info, io.BytesIO(data))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--num-train", type=int, default=12000)
    parser.add_argument("--num-val", type=int, default=2000)
    parser.add_argument("--shards", type=int, default=8, help="training shards (validation: --val-shards)")
    parser.add_argument("--val-shards", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--noise", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1234, help="the data seed, as data.kwargs.seed of `digits`")
    args = parser.parse_args(argv)
    splits = [("train", args.num_train, args.shards, args.seed), ("val", args.num_val, args.val_shards, args.seed + 1)]
    for prefix, count, shards, seed in splits:
        if count:
            images, labels = make_digits(count, seed=seed, image_size=args.image_size, noise=args.noise)
            paths = write_shards(images, labels, args.out_dir, prefix=prefix, sizes=even_sizes(count, shards))
            print(
                f"wrote {count} samples to {len(paths)} shards: "
                f"{args.out_dir}/{prefix}-{{000..{len(paths) - 1:03d}}}.tar"
            )


if __name__ == "__main__":
    main()
