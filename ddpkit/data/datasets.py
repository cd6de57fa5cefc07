"""Built-in datasets, registered by name. A builder returns ``(train_dataset, val_dataset_or_None)``.

    data: {name: digits}                                   # embedded, generated, no download
    data: {name: mnist, kwargs: {root: ~/data}}            # from local files
    data: {name: imagefolder, kwargs: {root: ~/pets}}      # root/train/<class>/*.jpg, root/val/...
    data: {name: tokens, kwargs: {path: train.bin, seq_len: 1024}}   # token files (ddpkit.data.tokens)

Nothing is ever downloaded at run time: the file-backed datasets read a local ``root`` and say
exactly where the files must be when they are missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from ddpkit.data.cache import cached_tensors
from ddpkit.errors import DataError
from ddpkit.registry import register_dataset

__all__ = ["make_digits", "digits", "synthetic", "fake", "mnist", "fashion_mnist", "cifar10", "imagefolder"]

# A 5x7 bitmap font for 0-9: the seed of the embedded "digits" dataset.
_FONT = """
.###. ..#.. .###. ##### ...#. ##### ..##. ##### .###. .###.
#...# .##.. #...# ...#. ..##. #.... .#... ....# #...# #...#
#..## ..#.. ....# ..#.. .#.#. ####. #.... ...#. #...# #...#
#.#.# ..#.. ...#. ...#. #..#. ....# ####. ..#.. .###. .####
##..# ..#.. ..#.. ....# ##### ....# #...# .#... #...# ....#
#...# ..#.. .#... #...# ...#. #...# #...# .#... #...# ...#.
.###. .###. ##### .###. ...#. .###. .###. .#... .###. .##..
"""


def _glyphs() -> torch.Tensor:
    """The font as a (10, 1, 9, 7) float tensor: each 7x5 glyph with a one-pixel empty border."""
    rows = [line.split() for line in _FONT.strip().splitlines()]
    glyphs = torch.tensor([[[ch == "#" for ch in row[d]] for row in rows] for d in range(10)], dtype=torch.float32)
    return F.pad(glyphs, (1, 1, 1, 1)).unsqueeze(1)


def make_digits(n: int, *, seed: int, image_size: int = 28, noise: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """Render ``n`` handwriting-like digits: (images ``[n, 1, S, S]`` in about [-1, 1], labels ``[n]``).

    Each sample is a font glyph under a random affine map (size, rotation, shear, position),
    randomly thickened, with random contrast and Gaussian noise: easy enough that the MNIST CNN
    passes 90% accuracy within a few hundred steps, hard enough that a linear model does not.
    Deterministic: the same ``seed`` always gives the same tensors.
    """
    g = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, generator=g)

    labels = torch.randint(0, 10, (n,), generator=g)
    # The glyph's height, in pixels.
    height = uniform(0.5, 0.8) * image_size
    angle = uniform(-0.3, 0.3)
    shear = uniform(-0.3, 0.3)
    shift = torch.stack([uniform(-0.2, 0.2), uniform(-0.2, 0.2)], dim=1)
    # affine_grid maps output coordinates to input coordinates, both normalised to [-1, 1].
    # One glyph pixel should cover height/7 output pixels; the padded glyph is 7 wide and 9 tall.
    scale = torch.stack([image_size / height, 7 * image_size / (9 * height)], dim=1)
    cos = torch.cos(angle)
    sin = torch.sin(angle)
    rotate_shear = torch.stack([torch.stack([cos, -sin + shear * cos], 1), torch.stack([sin, cos + shear * sin], 1)], 1)
    linear = scale.unsqueeze(2) * rotate_shear
    offset = -(linear @ shift.unsqueeze(2))
    grid = F.affine_grid(torch.cat([linear, offset], dim=2), [n, 1, image_size, image_size], align_corners=False)
    images = F.grid_sample(_glyphs()[labels], grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    thick = torch.rand(n, generator=g) < 0.5
    images = torch.where(thick.view(n, 1, 1, 1), F.max_pool2d(images, 3, stride=1, padding=1), images)
    images = images * uniform(0.6, 1.0).view(n, 1, 1, 1) + noise * torch.randn(images.shape, generator=g)
    return (images.clamp(0, 1) - 0.5) * 2, labels


def digits(
    num_train: int = 12000, num_val: int = 2000, image_size: int = 28, noise: float = 0.2, seed: int = 1234
) -> tuple[Dataset, Dataset]:
    """The embedded default dataset: 10 classes of generated 1x28x28 digit images, no download.

    ``seed`` fixes the data itself (independent of ``run.seed``, which fixes the training run).
    """
    train = TensorDataset(*_cached_digits(num_train, seed=seed, image_size=image_size, noise=noise))
    val = None
    if num_val:
        val = TensorDataset(*_cached_digits(num_val, seed=seed + 1, image_size=image_size, noise=noise))
    return train, val


def _cached_digits(n: int, *, seed: int, image_size: int, noise: float) -> tuple[torch.Tensor, ...]:
    """:func:`make_digits` through the disk cache (:mod:`ddpkit.data.cache`): a restart reads, not renders.

    The key's ``v1`` names the rendering above: change it whenever ``make_digits`` changes.
    """
    key = f"digits-v1-n{n}-s{image_size}-noise{noise!r}-seed{seed}"
    return cached_tensors(key, lambda: make_digits(n, seed=seed, image_size=image_size, noise=noise))


def synthetic(
    size: int = 1024, shape: Sequence[int] = (3, 32, 32), num_classes: int = 10, val_size: int = 0, seed: int = 0
) -> tuple[Dataset, Dataset | None]:
    """Random tensors held in memory: for benchmarks, where data loading must cost nothing."""
    g = torch.Generator().manual_seed(seed)

    def make(count: int) -> TensorDataset:
        return TensorDataset(
            torch.randn(count, *shape, generator=g), torch.randint(0, num_classes, (count,), generator=g)
        )

    return make(size), (make(val_size) if val_size else None)


def fake(
    size: int = 1000, val_size: int = 200, image_size: Sequence[int] = (3, 32, 32), num_classes: int = 10
) -> tuple[Dataset, Dataset]:
    """``torchvision.datasets.FakeData``: random PIL images through the usual ToTensor transform."""
    from torchvision import datasets, transforms

    to_tensor = transforms.ToTensor()
    train = datasets.FakeData(size, tuple(image_size), num_classes, transform=to_tensor)
    val = datasets.FakeData(val_size, tuple(image_size), num_classes, transform=to_tensor, random_offset=size)
    return train, val


def _local_torchvision(name: str, root: str | None, layout: str, **kwargs: Any) -> tuple[Dataset, Dataset]:
    from torchvision import datasets, transforms

    if not root:
        raise DataError(
            f"data.kwargs.root: the {name} dataset needs a local root directory, e.g. data.kwargs.root=~/data"
        )
    path = Path(root).expanduser()
    stats = {"MNIST": (0.1307, 0.3081), "FashionMNIST": (0.2860, 0.3530), "CIFAR10": (0.4734, 0.2516)}[name]
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(*stats)])
    cls = getattr(datasets, name)
    try:
        return (
            cls(str(path), train=True, download=False, transform=transform, **kwargs),
            cls(str(path), train=False, download=False, transform=transform, **kwargs),
        )
    except RuntimeError as exc:
        # torchvision's "Dataset not found. You can use download=True ...": ddpkit says where the files go.
        raise DataError(
            f"data.kwargs.root: {name} files not found under {path} ({exc}). ddpkit never downloads at run time: "
            f"put the files at {path}/{layout}, or use data.name=digits for the embedded dataset."
        ) from None


def mnist(root: str | None = None) -> tuple[Dataset, Dataset]:
    """MNIST from ``root/MNIST/raw`` (the uncompressed idx files)."""
    return _local_torchvision("MNIST", root, "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte")


def fashion_mnist(root: str | None = None) -> tuple[Dataset, Dataset]:
    """FashionMNIST from ``root/FashionMNIST/raw``."""
    return _local_torchvision("FashionMNIST", root, "FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte")


def cifar10(root: str | None = None) -> tuple[Dataset, Dataset]:
    """CIFAR-10 from ``root/cifar-10-batches-py`` (the python version of the archive, extracted)."""
    return _local_torchvision("CIFAR10", root, "cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}")


def imagefolder(
    root: str | None = None, val_root: str | None = None, image_size: int = 224, augment: bool = True
) -> tuple[Dataset, Dataset | None]:
    """``torchvision.datasets.ImageFolder``: ``root/<class>/<image>``.

    If ``root`` has ``train/`` (and optionally ``val/``) subfolders they are used as the splits;
    ``val_root`` names a validation tree explicitly.
    """
    from torchvision import datasets, transforms

    if not root:
        raise DataError(
            "data.kwargs.root: the imagefolder dataset needs a "
            "directory of class folders, e.g. data.kwargs.root=~/images"
        )
    base = Path(root).expanduser()
    train_dir = base / "train" if (base / "train").is_dir() else base
    val_dir = Path(val_root).expanduser() if val_root else (base / "val" if (base / "val").is_dir() else None)
    normalize = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    resize = [transforms.Resize(image_size), transforms.CenterCrop(image_size)]
    flip = [transforms.RandomHorizontalFlip()] if augment else []
    train_tf = transforms.Compose([*resize, *flip, transforms.ToTensor(), normalize])
    val_tf = transforms.Compose([*resize, transforms.ToTensor(), normalize])

    def load(path: Path, transform: Any) -> Dataset:
        if not path.is_dir():
            raise DataError(f"data.kwargs.root: {path} is not a directory; expected {path}/<class_name>/<image files>")
        try:
            return datasets.ImageFolder(str(path), transform=transform)
        except (FileNotFoundError, RuntimeError) as exc:
            raise DataError(
                f"data.kwargs.root: no images found under {path} ({exc}); expected {path}/<class_name>/<image files>"
            ) from None

    return load(train_dir, train_tf), (load(val_dir, val_tf) if val_dir else None)


for _name, _builder in [
    ("digits", digits),
    ("synthetic", synthetic),
    ("fake", fake),
    ("mnist", mnist),
    ("fashion_mnist", fashion_mnist),
    ("cifar10", cifar10),
    ("imagefolder", imagefolder),
]:
    register_dataset(_name, _builder)


# The streaming sources (webdataset, hf_datasets) register themselves; their libraries load only when used.
import ddpkit.data.stream_sources  # noqa: E402,F401

# Token files for language models (``tokens``) register themselves too.
import ddpkit.data.tokens  # noqa: E402,F401
