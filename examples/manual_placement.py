"""A model split by hand across the two GPUs of one process, wrapped in DDP: the placement torch's first
model-parallel tutorial teaches (its ToyModel's ``net1`` on ``cuda:0``, ``net2`` on ``cuda:1``).

    torchrun --nnodes=2 --nproc-per-node=1 ... examples/manual_placement.py     # each process drives 2 GPUs
    python examples/manual_placement.py                                         # here: one device, same code

Each process holds the whole model, half on each of its two GPUs, and DDP wraps it with ``device_ids=None``
(ddpkit sees the parameters on two devices, leaves them where they are and passes no ``device_ids``). Launch one
process per pair of GPUs; with ``--nproc-per-node=1`` the process is bound to ``cuda:0`` and its second half lives
on ``cuda:1``. Without two GPUs both halves go to the process's device, and the example runs as an ordinary model.
For a model no single process can hold, use a pipeline instead (``parallel.pipeline``, docs/modes.md#pipelines);
the two cannot combine (a pipeline places its stages itself), nor can ``parallel.mode: fsdp2`` (one device a rank).
"""

import torch
from torch import nn
from torch.nn import functional as F

import ddpkit


class TwoDeviceModel(nn.Module):
    """Two halves on two devices; the activations cross between them in the forward."""

    def __init__(self, first: torch.device, second: torch.device):
        super().__init__()
        self.first, self.second = first, second
        self.net1 = nn.Sequential(nn.Flatten(), nn.Linear(144, 256), nn.ReLU()).to(first)
        self.net2 = nn.Sequential(nn.Linear(256, 10)).to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.net1(x.to(self.first)).to(self.second))


class ManualPlacementTrainer(ddpkit.Trainer):
    def build_model(self) -> nn.Module:
        if torch.cuda.device_count() >= 2:
            return TwoDeviceModel(torch.device("cuda:0"), torch.device("cuda:1"))
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        return TwoDeviceModel(device, device)

    def training_step(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        # The loss where the output is: the second device.
        return F.cross_entropy(logits, y.to(logits.device))

    def validation_step(self, batch) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self.model(x)
        y = y.to(logits.device)
        return {"loss": F.cross_entropy(logits, y, reduction="none"), "accuracy": (logits.argmax(1) == y).float()}


if __name__ == "__main__":
    ManualPlacementTrainer.main(
        defaults=["data.name=digits", "data.kwargs.image_size=12", "train.epochs=2", "run.name=manual-placement"]
    )
