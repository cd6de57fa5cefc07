"""A training set whose length changed since the checkpoint is refused at resume with both lengths,
unless ``data.allow_length_change: true`` (then the epoch is re-planned, with a warning).

    pytest -q tests/test_data_length.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from torch.utils.data import Subset

import ddpkit
from ddpkit.data.epochs import SampleOrder
from ddpkit.errors import CheckpointError


def test_the_order_records_the_length_and_refuses_another() -> None:
    saved = SampleOrder("randperm", length=256).state_dict()
    assert saved == {"order": "randperm", "length": 256}
    with pytest.raises(
        CheckpointError, match="has 200 samples, but the checkpoint's run trained on 256.*allow_length_change=true"
    ):
        SampleOrder("randperm", length=200).load_state_dict(saved)
    SampleOrder("randperm", length=200, allow_length_change=True).load_state_dict(saved)
    # an older checkpoint: nothing to compare
    SampleOrder("randperm", length=200).load_state_dict({"order": "randperm"})


class Shrunk(ddpkit.Trainer):
    """The same config; the training set lost its last 16 samples (a data file edited between runs)."""

    def build_datasets(self):
        train, val = super().build_datasets()
        return Subset(train, range(len(train) - 16)), val


def test_a_resume_onto_a_shorter_dataset_is_refused_unless_allowed(tmp_path: Path, capfd) -> None:
    cfg = tiny_config(tmp_path, train={"epochs": 1, "log_every": 4}, checkpoint={"every_steps": 4})
    ddpkit.Trainer(cfg).fit()
    longer = tiny_config(tmp_path, train={"epochs": 2, "log_every": 4}, checkpoint={"every_steps": 4})
    with pytest.raises(CheckpointError, match="has 240 samples, but the checkpoint's run trained on 256"):
        Shrunk(longer).fit()
    allowed = tiny_config(
        tmp_path, train={"epochs": 2, "log_every": 4}, checkpoint={"every_steps": 4}, data={"allow_length_change": True}
    )
    Shrunk(allowed).fit()
    assert "the training set has 240 samples, the checkpoint's run had 256" in capfd.readouterr().err
    assert torch.load(tmp_path / "run/model.pt", weights_only=True)
