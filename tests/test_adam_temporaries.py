"""The start-up log's line on torch's default Adam / AdamW temporaries (ddpkit.distributed.memory.adam_temporaries).

The default implementation makes tensors beyond what a rank holds (on the CPU two of the largest parameter's size,
on CUDA one per parameter at once); the line names them and the fix, and says nothing once the user chose an
implementation or runs another optimizer.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ddpkit.distributed.memory import adam_temporaries, log_rank_bytes


def _model() -> nn.Module:
    # the largest parameter: 300 x 16 floats, 18.75 KiB
    return nn.Sequential(nn.Embedding(300, 16), nn.Linear(16, 8))


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
def test_torch_s_default_on_the_cpu_is_named_with_its_two_temporaries_and_the_fix(kind):
    note = adam_temporaries(kind(_model().parameters(), lr=1e-3))
    assert note is not None
    assert f"torch's default {kind.__name__} runs a loop" in note
    # two temporaries of the embedding's 300 x 16 floats
    assert "37.50 KiB at the largest" in note
    assert "optim.kwargs.fused: true" in note


@pytest.mark.parametrize("chosen", [{"fused": True}, {"foreach": False}, {"foreach": True}])
def test_an_implementation_the_user_chose_gets_no_line(chosen):
    assert adam_temporaries(torch.optim.AdamW(_model().parameters(), lr=1e-3, **chosen)) is None


def test_another_optimizer_gets_no_line():
    assert adam_temporaries(torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)) is None


def test_the_start_up_log_carries_the_line_after_what_each_rank_holds(caplog):
    model = _model()
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        log_rank_bytes(model, torch.optim.AdamW(model.parameters(), lr=1e-3), layout="a world of one")
    messages = [record.getMessage() for record in caplog.records]
    assert "what each rank holds" in messages[0]
    assert messages[1].startswith("optim: torch's default AdamW runs a loop")
