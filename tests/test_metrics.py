"""Metric accumulators and the best-value tracker, without a process group (world of one)."""

from __future__ import annotations

import math

import pytest
import torch

from ddpkit.errors import ConfigError
from ddpkit.reporting.running_mean import RunningMean
from ddpkit.training.metrics import BestTracker, ExactMeans


def test_running_mean_reads_and_resets():
    mean = RunningMean(torch.device("cpu"))
    assert not mean.pending and math.isnan(mean.read())
    for value in (1.0, 2.0, 6.0):
        mean.add(torch.tensor(value, requires_grad=True) * 1)
    assert mean.pending and mean.read() == 3.0 and not mean.pending


def test_exact_means_weight_per_sample_values_and_batch_means():
    means = ExactMeans(torch.device("cpu"))
    means.add({"acc": torch.tensor([1.0, 0.0, 1.0]), "loss": torch.tensor(2.0)}, batch_size=3)
    means.add({"acc": torch.tensor([1.0]), "loss": torch.tensor(6.0)}, batch_size=1)
    result = means.compute()
    assert result["acc"] == 0.75
    assert result["loss"] == (2.0 * 3 + 6.0) / 4


def test_best_tracker_min_max_patience_and_off():
    loss = BestTracker("val_loss", "min", patience=2, min_delta=0.1)
    assert loss.update({"val_loss": 1.0}) and not loss.exhausted
    assert not loss.update({"val_loss": 0.95})  # better, but by less than min_delta
    assert loss.update({"val_loss": 0.5}) and loss.bad_evals == 0
    assert not loss.update({"val_loss": 0.6}) and not loss.update({"val_loss": 0.7})
    assert loss.exhausted and loss.best == 0.5

    accuracy = BestTracker("val_accuracy", "max")
    assert accuracy.update({"val_accuracy": 0.5}) and accuracy.update({"val_accuracy": 0.7})
    assert not accuracy.update({"val_accuracy": 0.7}) and not accuracy.exhausted  # no patience: never exhausted

    off = BestTracker(None)
    assert not off.update({"val_loss": 1.0}) and not off.exhausted

    restored = BestTracker("val_loss", patience=2)
    restored.load_state_dict(loss.state_dict())
    assert restored.best == 0.5 and restored.exhausted


def test_unknown_metric_names_the_config_key():
    with pytest.raises(
        ConfigError, match=r"checkpoint.best.metric: 'val_f1' is not a validation metric; available: val_loss"
    ):
        BestTracker("val_f1", key="checkpoint.best.metric").update({"val_loss": 1.0})
