"""``ddpkit export CHECKPOINT OUT.safetensors``: read back by safetensors itself, equal to model.pt's tensors.

.venv/bin/pytest -q tests/test_export.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import run_cli, run_in_pool, tiny_config

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.models.gpt import gpt
from ddpkit.tools.export import export, save_safetensors

pytestmark = pytest.mark.timeout(300)
safetensors_torch = pytest.importorskip("safetensors.torch")


def test_tied_embeddings_and_strided_views_are_written_under_every_name(tmp_path):
    model = gpt(vocab_size=64, dim=32, depth=1, heads=2, max_len=16)
    state = model.state_dict()
    assert state["embed.weight"].data_ptr() == state["head.weight"].data_ptr()  # tied input and output embeddings
    state = {**state, "a_view": torch.arange(12.0).reshape(3, 4).t()}  # not contiguous
    save_safetensors(state, tmp_path / "m.safetensors", metadata={"step": "7"})
    back = safetensors_torch.load_file(tmp_path / "m.safetensors")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    from safetensors import safe_open

    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "step": "7"}


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(DdpkitError, match=r"pip install 'ddpkit\[safetensors\]'"):
        save_safetensors({"w": torch.zeros(2)}, tmp_path / "m.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess
def test_export_of_a_run_equals_model_pt_in_both_formats(tmp_path):
    """Runs `ddpkit export` as a command for what a user sees: exit code 0 and the `wrote ...` line on stdout."""
    cfg = tiny_config(tmp_path, train={"epochs": 1}, checkpoint={"every_epochs": 1})
    ddpkit.Trainer(cfg).fit()
    run_dir = Path(cfg["run"]["output_dir"])
    final = torch.load(run_dir / "model.pt", weights_only=True)
    done = run_cli("export", str(run_dir / "checkpoints"), str(tmp_path / "out.safetensors"))
    assert done.returncode == 0 and done.stdout.startswith(
        f"wrote {tmp_path / 'out.safetensors'}: {len(final)} tensors"
    ), done.stderr
    back = safetensors_torch.load_file(tmp_path / "out.safetensors")
    assert back.keys() == final.keys() and all(
        torch.equal(back[k], final[k]) and back[k].dtype == final[k].dtype for k in final
    )
    export(run_dir / "checkpoints", tmp_path / "out.pt")
    plain = torch.load(tmp_path / "out.pt", weights_only=True)
    assert plain.keys() == final.keys() and all(torch.equal(plain[k], final[k]) for k in final)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_sharded_checkpoint_exports_to_safetensors_the_same_way(tmp_path):
    from helpers import train_and_save_sharded

    saved = run_in_pool(train_and_save_sharded, 2, args=(str(tmp_path), "fsdp2"), timeout=120)[0]
    line = export(tmp_path, tmp_path / "model.safetensors")
    assert "DCP directory" in line
    back = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert back.keys() == {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert all(torch.equal(back[k], saved[f"model.{k}"]) for k in back)
