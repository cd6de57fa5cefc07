"""Built-in models, registered by name. Every ``torchvision.models`` builder is available too.

model: {name: mnist_cnn}                                  # the classic MNIST CNN
model: {name: mlp, kwargs: {hidden: [256, 256]}}          # a small MLP
model: {name: resnet18, kwargs: {num_classes: 10}}        # torchvision
model: {name: gpt, kwargs: {dim: 128, depth: 4}}          # a GPT-2 style LM (ddpkit.models.gpt; data: tokens)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ddpkit.registry import register_model

__all__ = ["MLP", "MnistCNN"]


class MLP(nn.Module):
    """Flatten, then ``Linear -> ReLU`` per hidden width, then a linear classifier."""

    def __init__(self, in_features: int = 784, hidden: Sequence[int] = (128, 128), num_classes: int = 10):
        super().__init__()
        widths = [in_features, *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for width_in, width_out in zip(widths, widths[1:]):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MnistCNN(nn.Module):
    """The classic MNIST CNN from the PyTorch and Horovod examples.

    Two 5x5 convolutions (10 and 20 channels, each followed by 2x2 max-pooling), dropout, and two
    linear layers (50 hidden units). Returns logits; for 28x28 inputs the flattened size is 320.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        side = ((image_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(20 * side * side, 50)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, training=self.training)
        return self.fc2(x)


register_model("mlp", MLP)
register_model("mnist_cnn", MnistCNN)


# The language model registers itself as ``gpt``.
import ddpkit.models.gpt  # noqa: E402,F401
