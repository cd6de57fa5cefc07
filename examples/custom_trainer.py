"""Subclass the Trainer: your own model, data and loss; ddpkit does the distributed parts.

    torchrun --nproc-per-node=2 examples/custom_trainer.py
    torchrun --nproc-per-node=2 examples/custom_trainer.py optim.lr=0.01 train.epochs=5
    python examples/custom_trainer.py                             # a world of one

No config file is needed: every section whose builder is overridden needs no entries, and the
rest take their defaults (or `key=value` overrides). Learns y = sin(x0) + x1^2 with an MLP.
"""

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit


class RegressionTrainer(ddpkit.Trainer):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)  # the same data on every rank
        x = torch.rand(4096 + 1000, 2, generator=g) * 4 - 2
        y = (torch.sin(x[:, 0]) + x[:, 1] ** 2).unsqueeze(1)
        return TensorDataset(x[:4096], y[:4096]), TensorDataset(x[4096:], y[4096:])

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=self.config.optim.lr)

    def training_step(self, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def validation_step(self, batch) -> dict[str, torch.Tensor]:
        x, y = batch
        squared_error = (self.model(x) - y).pow(2).squeeze(1)  # one value per sample: exact means
        return {"mse": squared_error}


if __name__ == "__main__":
    # yours replace these
    RegressionTrainer.main(
        defaults=["run.name=custom_trainer", "optim.lr=0.003", "train.epochs=20", "data.batch_size=64"]
    )
