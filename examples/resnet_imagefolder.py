"""A torchvision ResNet trained on an ``ImageFolder`` tree: the layout most image datasets come in.

    torchrun --nproc-per-node=2 examples/resnet_imagefolder.py        # generated shape images, about a minute on CPU
    torchrun --nproc-per-node=2 examples/resnet_imagefolder.py data.kwargs.root=~/pets data.kwargs.image_size=224
    torchrun --nproc-per-node=2 examples/resnet_imagefolder.py model.name=resnet50 train.precision=bf16
    python examples/resnet_imagefolder.py train.epochs=1              # a world of one

The tree is ``root/train/<class>/*.png`` and ``root/val/<class>/*.png`` (or just
``root/<class>/*.png`` with no validation split); any format PIL reads works. The number of
classes is read from the tree, so ``model.name`` can be any torchvision classification model,
built untrained (nothing is downloaded). Without ``data.kwargs.root`` rank 0 first draws a small
demo tree of circles, squares and triangles under ``<output_dir>/demo_images`` while the other
ranks wait at a barrier.
"""

from __future__ import annotations

import random
from pathlib import Path

import torchvision
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit.data.datasets import imagefolder
from ddpkit.distributed.collectives import barrier
from ddpkit.reporting.log import log

DEFAULTS = [
    "run.name=resnet_imagefolder",
    "model.name=resnet18",
    "data.batch_size=32",
    "data.kwargs.image_size=32",  # small images keep the demo quick on a CPU; ResNets take any size
    "optim.lr=0.02",
    "optim.momentum=0.9",
    "optim.weight_decay=5.0e-4",
    "sched.name=cosine",
    "sched.warmup_steps=5",
    "train.epochs=6",
    "train.log_every=5",
]

SHAPES = ("circle", "square", "triangle")


class ImageFolderTrainer(ddpkit.Trainer):
    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        kwargs = dict(self.config.data.kwargs)
        if not kwargs.get("root"):
            kwargs["root"] = str(self.output_dir / "demo_images")
            if self.is_main:
                draw_demo_tree(Path(kwargs["root"]))
            barrier()  # the other ranks read the tree only once rank 0 has finished writing it
        train, val = imagefolder(**kwargs)
        self.classes = train.classes
        log.info(
            "%d classes (%s), %d training images, %d validation images",
            len(self.classes),
            ", ".join(self.classes[:5]),
            len(train),
            len(val) if val else 0,
        )
        return train, val

    def build_model(self) -> nn.Module:
        """Any torchvision classifier, untrained, with one output per class folder."""
        return torchvision.models.get_model(self.config.model.name, weights=None, num_classes=len(self.classes))


def draw_demo_tree(root: Path, *, per_class: int = 160, val_per_class: int = 40, size: int = 32, seed: int = 0) -> None:
    """Write ``root/{train,val}/<shape>/<i>.png``: one bright shape per image, on a dark background."""
    from PIL import Image, ImageDraw

    if (root / "val" / SHAPES[-1] / f"{val_per_class - 1}.png").exists():
        return  # drawn by an earlier run: the same seed draws the same images
    rng = random.Random(seed)
    for split, count in (("train", per_class), ("val", val_per_class)):
        for shape in SHAPES:
            folder = root / split / shape
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image = Image.new("RGB", (size, size), tuple(rng.randrange(100) for _ in range(3)))
                radius = rng.uniform(0.25, 0.45) * size
                cx, cy = (rng.uniform(radius, size - radius) for _ in range(2))
                box = (cx - radius, cy - radius, cx + radius, cy + radius)
                color = tuple(rng.randrange(140, 256) for _ in range(3))
                draw = ImageDraw.Draw(image)
                if shape == "circle":
                    draw.ellipse(box, fill=color)
                elif shape == "square":
                    draw.rectangle(box, fill=color)
                else:
                    corners = [(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)]
                    draw.polygon(corners, fill=color)
                image.save(folder / f"{i}.png")


if __name__ == "__main__":
    ImageFolderTrainer.main(defaults=DEFAULTS)  # a key given on the command line replaces its default
