"""``checkpoint.async``'s host staging: reused buffers, the state of the moment of the save, real files.

    .venv/bin/pytest -q tests/test_checkpoint_staging.py

On the CPU the copies are synchronous; what these tests pin down is the writer's order (wait for
the previous save, then overwrite its buffers), reuse and reallocation, and what the file holds.
The pinned, queued copies from CUDA are checked in ``tests/test_gpu.py``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from ddpkit.checkpoint import files
from ddpkit.checkpoint.files import AsyncCheckpointWriter, load_checkpoint
from ddpkit.checkpoint.staging import HostStaging


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def model_state(value: float, *, size: int = 8) -> dict:
    return {
        "model": {"w": torch.full((size, size), value), "b": torch.full((size,), value)},
        "progress": {"step": int(value)},
    }


@pytest.fixture
def saves(monkeypatch):
    """The writer's saves, recorded: ``saves.seen`` holds, per save, the data pointers of the model tensors the
    background thread was given; each save first sleeps ``saves.delay`` seconds (a slow disk)."""
    saves, real = SimpleNamespace(seen=[], delay=0.0), files.save_checkpoint

    def save(state, directory, **kwargs):
        saves.seen.append({k: v.data_ptr() for k, v in state["model"].items()})
        time.sleep(saves.delay)
        return real(state, directory, **kwargs)

    monkeypatch.setattr(files, "save_checkpoint", save)
    return saves


def read(tmp_path, step: int) -> dict:
    return load_checkpoint(tmp_path / f"step-{step:09d}.pt")


def test_the_file_holds_the_state_of_the_save_though_training_changes_it_after(tmp_path, saves):
    saves.delay = 0.2
    state = model_state(1.0)
    writer = AsyncCheckpointWriter()
    writer.stage_and_submit(state, tmp_path, step=1)
    state["model"]["w"].add_(100.0)  # the next step's in-place update, while the write is still asleep
    state["model"]["b"].zero_()
    writer.wait()
    assert torch.equal(read(tmp_path, 1)["model"]["w"], torch.full((8, 8), 1.0))
    assert torch.equal(read(tmp_path, 1)["model"]["b"], torch.full((8,), 1.0))


def test_saves_in_a_row_reuse_the_buffers_and_each_file_holds_its_own_state(tmp_path, saves):
    writer, state = AsyncCheckpointWriter(), model_state(1.0)
    writer.stage_and_submit(state, tmp_path, step=1)
    state["model"]["w"].fill_(2.0)
    state["model"]["b"].fill_(2.0)
    writer.stage_and_submit(state, tmp_path, step=2)
    writer.wait()
    assert saves.seen[0] == saves.seen[1]  # the same host memory, not a new copy per save
    assert saves.seen[0]["w"] != state["model"]["w"].data_ptr()  # and never the source itself
    assert torch.equal(read(tmp_path, 1)["model"]["w"], torch.full((8, 8), 1.0))
    assert torch.equal(read(tmp_path, 2)["model"]["w"], torch.full((8, 8), 2.0))
    assert torch.equal(read(tmp_path, 2)["model"]["b"], torch.full((8,), 2.0))


def test_a_slow_save_is_finished_before_its_buffers_are_overwritten(tmp_path, saves):
    saves.delay = 0.3
    writer, state = AsyncCheckpointWriter(), model_state(1.0)
    writer.stage_and_submit(state, tmp_path, step=1)
    state["model"]["w"].fill_(2.0)
    writer.stage_and_submit(state, tmp_path, step=2)  # must wait for step 1's write before copying into its buffers
    writer.wait()
    assert saves.seen[0] == saves.seen[1]
    assert torch.equal(read(tmp_path, 1)["model"]["w"], torch.full((8, 8), 1.0))
    assert torch.equal(read(tmp_path, 2)["model"]["w"], torch.full((8, 8), 2.0))


def test_a_changed_shape_or_dtype_gets_a_new_buffer_and_the_rest_are_kept():
    staging = HostStaging()
    first = staging.copy({"w": torch.ones(4, 4), "b": torch.ones(4), "n": torch.ones(3)})
    grown = staging.copy({"w": torch.ones(5, 4), "b": torch.full((4,), 3.0), "n": torch.ones(3, dtype=torch.float64)})
    assert grown["w"].shape == (5, 4) and grown["w"].data_ptr() != first["w"].data_ptr()
    assert grown["n"].dtype == torch.float64 and grown["n"].data_ptr() != first["n"].data_ptr()
    assert grown["b"].data_ptr() == first["b"].data_ptr() and torch.equal(grown["b"], torch.full((4,), 3.0))
    shrunk = staging.copy({"b": torch.zeros(4)})
    # the buffers of tensors that are gone are given back
    assert torch.equal(shrunk["b"], torch.zeros(4)) and len(staging._buffers) == 1


def test_every_kind_of_leaf_round_trips_bitwise(tmp_path):
    bf16 = torch.tensor([1.5, -0.0, float("nan"), float("inf"), 3e38], dtype=torch.bfloat16)
    int64 = torch.tensor([2**62 + 1, -(2**63), 7], dtype=torch.int64)
    wide = torch.arange(12.0).reshape(3, 4)
    state = {
        "model": {"bf16": bf16, "int64": int64, "scalar": torch.tensor(0.25), "empty": torch.empty(0, 3)},
        "rng": {"cpu": torch.get_rng_state(), "flags": [True, None, 3, 2.5, "seed"]},
        "nested": [
            (1, (wide.t(), {"p": torch.nn.Parameter(torch.ones(2))})),
            {"deep": [torch.ones(2, dtype=torch.bool)]},
        ],
        "progress": {"step": 3, "name": "x"},
    }
    writer = AsyncCheckpointWriter()
    writer.stage_and_submit(state, tmp_path, step=3)
    wide.zero_()  # a non-contiguous view is copied at once too (the fallback), not read later
    writer.wait()
    loaded = read(tmp_path, 3)
    for key, tensor in state["model"].items():
        assert same_bits(loaded["model"][key], tensor), key
    assert same_bits(loaded["rng"]["cpu"], torch.get_rng_state()) and loaded["rng"]["flags"] == [
        True,
        None,
        3,
        2.5,
        "seed",
    ]
    assert isinstance(loaded["nested"][0], tuple) and loaded["nested"][0][0] == 1
    view, inner = loaded["nested"][0][1]
    assert torch.equal(view, torch.arange(12.0).reshape(3, 4).t()) and same_bits(inner["p"], torch.ones(2))
    assert same_bits(loaded["nested"][1]["deep"][0], torch.ones(2, dtype=torch.bool))
    assert loaded["progress"] == {"step": 3, "name": "x"}


def test_an_error_in_the_background_is_raised_by_the_next_save_and_then_saving_goes_on(tmp_path, monkeypatch):
    real = files.save_checkpoint
    monkeypatch.setattr(
        files, "save_checkpoint", lambda *a, **k: (_ for _ in ()).throw(OSError("No space left on device"))
    )
    writer = AsyncCheckpointWriter()
    writer.stage_and_submit(model_state(1.0), tmp_path, step=1)
    with pytest.raises(OSError, match="No space left"):
        writer.stage_and_submit(model_state(2.0), tmp_path, step=2)
    monkeypatch.setattr(files, "save_checkpoint", real)
    writer.stage_and_submit(model_state(3.0), tmp_path, step=3)
    writer.wait()
    assert torch.equal(read(tmp_path, 3)["model"]["w"], torch.full((8, 8), 3.0))
    assert not (tmp_path / "step-000000001.pt").exists()
