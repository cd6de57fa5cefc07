"""The crash save's per-rank RNG slot files: two steps readable, a torn slot refused.

    .venv/bin/pytest -q tests/test_boundary_rng.py

The end-to-end proof (a SIGKILLed rank's dropout stream continues bitwise after the restart) is the
slow test in tests/test_goodput.py.
"""

from __future__ import annotations

import pytest
import torch

from ddpkit.checkpoint.boundary_rng import HEADER, BoundarySlots, read_boundary, slot_offset

pytestmark = pytest.mark.timeout(30)


def test_the_last_two_boundaries_are_readable_and_a_torn_slot_is_refused(tmp_path):
    path = tmp_path / "s-0-rank1.rng"
    torch.manual_seed(7)
    at_k = torch.get_rng_state()
    slots = BoundarySlots.create(path, at_k.numel())
    assert read_boundary(path, 0) is None  # a fresh file holds no step, not even step 0
    slots.write(10, at_k)
    torch.rand(100)  # the stream moves on, as a step's dropout would move it
    at_next = torch.get_rng_state()
    slots.write(11, at_k, final=False)  # as step 11's update ends: provisional, then replaced at the boundary
    assert read_boundary(path, 11)[1] is False
    slots.write(11, at_next)
    assert [
        (torch.equal(s, want), final)
        for (s, final), want in [(read_boundary(path, 10), at_k), (read_boundary(path, 11), at_next)]
    ] == [(True, True)] * 2
    assert not torch.equal(at_k, at_next)
    assert read_boundary(path, 12) is None and read_boundary(path, 9) is None  # only the steps written
    torch.set_rng_state(read_boundary(path, 10)[0])
    torch.rand(100)
    assert torch.equal(torch.get_rng_state(), at_next)  # the state read back is a working torch RNG state

    slots.write(12, torch.get_rng_state())  # step 12 overwrites step 10's slot (same parity)
    assert read_boundary(path, 10) is None and torch.equal(read_boundary(path, 11)[0], at_next)

    # A writer killed half-way through step 13: marker already -1, step written, payload partly new.
    data = bytearray(path.read_bytes())
    start = slot_offset(1, at_k.numel())
    HEADER.pack_into(data, start, 13, at_k.numel(), 1)
    data[start + HEADER.size] ^= 0xFF
    data[start + HEADER.size + at_k.numel() :] = (-1).to_bytes(8, "little", signed=True)
    path.write_bytes(bytes(data))
    assert read_boundary(path, 13) is None and read_boundary(path, 11) is None
    HEADER.pack_into(data, start, 15, at_k.numel(), 1)  # a step that does not match the slot's marker
    data[start + HEADER.size + at_k.numel() :] = (13).to_bytes(8, "little", signed=True)
    path.write_bytes(bytes(data))
    assert read_boundary(path, 15) is None and read_boundary(path, 13) is None
    assert torch.equal(read_boundary(path, 12)[0], at_next)  # the other slot is untouched
    slots.close()
    path.write_bytes(b"short")
    assert read_boundary(path, 12) is None and read_boundary(tmp_path / "missing.rng", 12) is None
