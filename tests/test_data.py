"""Samplers and loaders without a process group: shards, resume offsets, size checks, datasets."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from ddpkit.data.datasets import digits, make_digits, synthetic
from ddpkit.data.epochs import start_epoch
from ddpkit.data.loaders import build_train_loader, build_val_loader
from ddpkit.data.samplers import ExactShardSampler, ResumableDistributedSampler
from ddpkit.distributed.env import DistEnv
from ddpkit.errors import DataError


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_exact_shards_cover_every_index_once(world_size):
    length = 101
    shards = [list(ExactShardSampler(length, rank=r, world_size=world_size)) for r in range(world_size)]
    flat = sorted(i for shard in shards for i in shard)
    assert flat == list(range(length))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_exact_shards_may_be_empty_for_tiny_sets():
    assert list(ExactShardSampler(2, rank=2, world_size=3)) == []


def test_resumable_sampler_is_a_distributed_sampler_with_an_offset():
    data = list(range(50))
    plain = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=True)
    resumable = ResumableDistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=True)
    plain.set_epoch(4)
    resumable.set_epoch(4, start_index=10)
    assert list(resumable) == list(plain)[10:]
    assert len(resumable) == len(plain) - 10


def test_train_loader_skips_whole_batches_on_resume():
    dataset = TensorDataset(torch.arange(64))
    loader = build_train_loader(dataset, env=DistEnv(rank=0, world_size=2), batch_size=4, seed=1)
    start_epoch(loader, 2)
    full = [b[0].tolist() for b in loader]
    start_epoch(loader, 2, start_batch=3)
    assert [b[0].tolist() for b in loader] == full[3:]
    start_epoch(loader, 3)
    assert [b[0].tolist() for b in loader] != full  # a new epoch, a new order


def test_iterating_a_loader_leaves_the_global_rng_alone():
    loader = build_train_loader(TensorDataset(torch.arange(32)), env=DistEnv(), batch_size=4)
    start_epoch(loader, 0)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    list(loader)
    assert torch.equal(torch.rand(3), expected)


def test_too_small_training_set_is_refused_before_training():
    dataset = TensorDataset(torch.arange(10))
    with pytest.raises(DataError, match=r"10 samples, fewer than world_size \(3\) x data.batch_size \(4\) = 12"):
        build_train_loader(dataset, env=DistEnv(rank=0, world_size=3), batch_size=4)
    with pytest.raises(DataError, match="dataset is empty"):
        build_train_loader(TensorDataset(torch.arange(0)), env=DistEnv(), batch_size=4, drop_last=False)


def test_eval_loader_has_no_padding():
    dataset = TensorDataset(torch.arange(7))
    seen = []
    for rank in range(3):
        loader = build_val_loader(dataset, env=DistEnv(rank=rank, world_size=3), batch_size=2)
        seen += [int(i) for (batch,) in loader for i in batch]
    assert sorted(seen) == list(range(7))


def test_digits_are_deterministic_balanced_and_distinct_between_splits():
    x1, y1 = make_digits(500, seed=7)
    x2, y2 = make_digits(500, seed=7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (500, 1, 28, 28) and x1.min() >= -1 and x1.max() <= 1
    assert set(y1.tolist()) == set(range(10))
    train, val = digits(num_train=50, num_val=20)
    assert len(train) == 50 and len(val) == 20
    assert not torch.equal(train[0][0], val[0][0])


def test_synthetic_dataset_shapes():
    train, val = synthetic(size=8, shape=(3, 4, 4), num_classes=5, val_size=2)
    x, y = train[0]
    assert x.shape == (3, 4, 4) and 0 <= int(y) < 5 and len(val) == 2


class NoisyDataset(torch.utils.data.Dataset):
    """A random "augmentation" per sample, drawn from the global RNG as transforms do."""

    def __len__(self):
        return 48

    def __getitem__(self, index):
        return torch.rand(2) + index


def test_worker_augmentation_depends_only_on_seed_epoch_and_index():
    def epoch_batches(num_workers, start_batch=0):
        loader = build_train_loader(NoisyDataset(), env=DistEnv(), batch_size=4, num_workers=num_workers, seed=5)
        start_epoch(loader, 1, start_batch=start_batch)
        return [b.clone() for b in loader]

    reference = epoch_batches(1)
    same = epoch_batches(2)
    # independent of the worker count
    assert len(reference) == 12 and all(torch.equal(a, b) for a, b in zip(reference, same))
    resumed = epoch_batches(2, start_batch=5)
    assert all(torch.equal(a, b) for a, b in zip(reference[5:], resumed))  # and of a mid-epoch resume


def _batches(loader) -> list:
    start_epoch(loader, 1)
    return list(loader)


@pytest.mark.parametrize("drop_last", [True, False])
def test_tensor_datasets_are_read_a_batch_at_a_time_with_the_same_batches_bit_for_bit(drop_last):
    from torch.utils.data import DataLoader

    from ddpkit.data.batched import TensorBatches

    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(
        torch.randn(70, 1, 5, 5, generator=g),
        torch.randint(0, 10, (70,), generator=g),
        torch.rand(70, generator=g).half(),
    )
    env = DistEnv(rank=1, world_size=2)
    loader = build_train_loader(dataset, env=env, batch_size=8, seed=3, drop_last=drop_last)
    assert isinstance(loader.dataset, TensorBatches) and loader.dataset.tensors is dataset.tensors
    # The reference: torch's own per-sample path over the same sampler (same order, same batch size).
    reference = DataLoader(dataset, batch_size=8, sampler=loader.sampler, drop_last=drop_last)
    got, want = _batches(loader), _batches(reference)
    assert len(got) == len(want) == (4 if drop_last else 5)  # 35 samples on this rank
    for mine, theirs in zip(got, want):
        assert type(mine) is type(theirs) is list and len(mine) == 3
        for a, b in zip(mine, theirs):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    val = build_val_loader(dataset, env=env, batch_size=16)
    assert [torch.equal(a[0], b[0]) for a, b in zip(val, DataLoader(dataset, batch_size=16, sampler=val.sampler))] == [
        True,
        True,
        True,
    ]


def test_a_dataset_already_on_an_accelerator_is_gathered_there_never_pinned_nor_forked():
    """The device path without a GPU: "meta" tensors stand in for CUDA ones (any non-CPU device takes it)."""
    from ddpkit.data.batched import resident_device

    on_device = TensorDataset(torch.empty(40, 3, device="meta"), torch.empty(40, dtype=torch.long, device="meta"))
    env = DistEnv(rank=0, world_size=2)
    loader = build_train_loader(on_device, env=env, batch_size=4, pin_memory=True)
    assert resident_device(loader.dataset) == torch.device("meta") and loader.pin_memory is False
    x, y = next(iter(loader))  # the index went to the tensors' device: a gather there, no copy to the host
    assert x.device.type == y.device.type == "meta" and x.shape == (4, 3) and y.shape == (4,)
    assert build_val_loader(on_device, env=env, batch_size=8, pin_memory=True).pin_memory is False
    with pytest.raises(DataError, match=r"already on meta.*data.num_workers=0"):
        build_train_loader(on_device, env=env, batch_size=4, num_workers=2)
    assert resident_device(TensorDataset(torch.zeros(4))) is None and resident_device(list(range(4))) is None
    assert build_train_loader(TensorDataset(torch.zeros(40)), env=env, batch_size=4, pin_memory=True).pin_memory is True


def test_batch_reads_leave_other_datasets_and_worker_loaders_alone():
    from ddpkit.data.batched import batch_reads

    class Augmented(TensorDataset):
        def __getitem__(self, index):  # a per-sample transform must see every sample
            x, y = super().__getitem__(index)
            return x + 1, y

    plain = TensorDataset(torch.arange(8))
    assert batch_reads(plain, num_workers=2) == (plain, None)
    augmented = Augmented(torch.arange(8), torch.arange(8))
    assert batch_reads(augmented) == (augmented, None)
    assert batch_reads(list(range(8))) == (list(range(8)), None)
    assert batch_reads(TensorDataset(torch.arange(8)))[1] is not None

    class Windows(TensorDataset):  # keeps __getitem__: read a batch at a time, its attributes still readable
        seq_len = 16

    wrapped, _ = batch_reads(Windows(torch.arange(8)))
    assert wrapped.seq_len == 16 and not hasattr(wrapped, "missing")
    batches, _ = batch_reads(TensorDataset(torch.arange(8) * 10))
    assert batches.__getitems__([torch.tensor(1), 3])[0].tolist() == [10, 30]  # indices that are not plain ints
    assert batches.__getitems__([])[0].shape == (0,)
