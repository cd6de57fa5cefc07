"""The disk cache of generated datasets: the same bits as rendering, atomic files, a bad file rebuilt."""

from __future__ import annotations

import torch

from ddpkit.data.cache import cache_dir, cached_tensors
from ddpkit.data.datasets import digits, make_digits


def test_cached_digits_are_the_rendered_digits_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPKIT_CACHE_DIR", str(tmp_path))
    first, _ = digits(num_train=64, num_val=0, image_size=12)
    files = list(tmp_path.glob("digits-v1-*.pt"))
    assert len(files) == 1 and not list(tmp_path.glob(".*tmp"))  # written whole, under its final name only
    again, _ = digits(num_train=64, num_val=0, image_size=12)  # read back this time
    rendered = make_digits(64, seed=1234, image_size=12, noise=0.2)
    for a, b, c in zip(first.tensors, again.tensors, rendered):
        assert torch.equal(a, c) and torch.equal(b, c)
    other, _ = digits(num_train=64, num_val=0, image_size=12, seed=7)  # the key names every argument
    assert not torch.equal(other.tensors[0], first.tensors[0]) and len(list(tmp_path.glob("digits-v1-*.pt"))) == 2


def test_a_corrupt_cache_file_is_rebuilt_and_off_means_off(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPKIT_CACHE_DIR", str(tmp_path))
    (tmp_path / "k.pt").write_bytes(b"not a torch file")
    built = []
    tensors = cached_tensors("k", lambda: built.append(1) or (torch.arange(3),))
    assert built == [1] and torch.equal(tensors[0], torch.arange(3))
    assert torch.equal(torch.load(tmp_path / "k.pt", weights_only=True)[0], torch.arange(3))
    monkeypatch.setenv("DDPKIT_CACHE_DIR", "off")
    assert cache_dir() is None
    assert cached_tensors("k", lambda: built.append(2) or (torch.ones(1),))[0].item() == 1 and built == [1, 2]
