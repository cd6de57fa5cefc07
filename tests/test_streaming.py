"""Streams (IterableDatasets) on N ranks x W workers: sharding, agreed epoch ends, exact resume, sources.

The fast tests build one rank's loader at a time with an explicit ``DistEnv`` (no process group)
and read real DataLoader workers; the multi-rank tests run the agreement on 3 real Gloo ranks
with uneven shards; the end-to-end tests train ``tests/scripts/stream_trainer.py`` (a plain
IterableDataset, no len(), reshuffled by set_epoch, samples carrying their index) through
``ddpkit run`` on 2 ranks x 2 workers, including a rank SIGKILLed mid-epoch and restarted by
torchrun, which must end bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from ddpkit.env import DistEnv
from ddpkit.errors import ConfigError, DataError, DdpkitError
from ddpkit.streaming import StreamEpochs, build_stream_loader, stream_total_steps
from ddpkit.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from write_digits_shards import write_shards  # noqa: E402


class IndexStream(IterableDataset):
    """Samples ``(tensor([i]), i)`` for ``i < n`` in an order reshuffled by ``set_epoch``; no ``len()``.

    With ``shares`` it also shards itself: ``shard(rank, world_size)`` keeps a contiguous run of
    ``shares[rank]`` samples, so ranks get deliberately uneven streams.
    """

    def __init__(self, n: int, shares: list[int] | None = None):
        self.n, self.shares, self.epoch, self.start = n, shares, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        for i in order.tolist():
            yield torch.tensor([float(self.start + i)]) + torch.rand(1), self.start + i  # a random "augmentation"

    def __getattr__(self, name: str):
        if name == "shard" and self.__dict__.get("shares"):
            return self._shard
        raise AttributeError(name)

    def _shard(self, rank: int, world_size: int) -> IndexStream:
        view = IndexStream(self.shares[rank])
        view.start = sum(self.shares[:rank])
        return view


def env_of(rank: int, world_size: int) -> DistEnv:
    return DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size, master_addr="127.0.0.1",
                   master_port=0, launcher="test", restart_count=0)


def epochs_of(dataset, *, rank=0, world_size=1, batch_size=5, workers=0, accum=1, window=2) -> StreamEpochs:
    env = env_of(rank, world_size)
    return build_stream_loader(dataset, env=env, batch_size=batch_size, num_workers=workers, accum=accum, window_steps=window).stream_epochs


def indices(batches) -> list[int]:
    return [i for batch in batches for i in batch[1].tolist()]


def test_a_plain_stream_is_split_over_ranks_and_workers_each_sample_once_and_reshuffled_per_epoch():
    per_epoch = []
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            epochs = epochs_of(IndexStream(203), rank=rank, world_size=2, workers=2)
            epochs.start_epoch(epoch)
            seen.append(indices(epochs))
            assert epochs.batches_per_epoch == 20  # 4 slots of ~50 samples: 10 full batches of 5 per worker
        assert not set(seen[0]) & set(seen[1])
        assert len(set(seen[0])) == len(seen[0]) == 100 and len(seen[1]) == 100  # 3 of 203 dropped: < 1 batch per worker
        per_epoch.append(seen[0])
    assert per_epoch[0] != per_epoch[1]  # set_epoch reached the worker processes


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_after", [3, 4, 7])
def test_a_resumed_epoch_continues_with_exactly_the_batches_the_uninterrupted_one_had(workers, stop_after):
    full = epochs_of(IndexStream(97), workers=workers, accum=2, batch_size=4)
    full.start_epoch(3)
    full_batches = list(full)
    expected = indices(full_batches)
    first = epochs_of(IndexStream(97), workers=workers, accum=2, batch_size=4)
    first.start_epoch(3)
    batches = iter(first)
    before = [next(batches) for _ in range(stop_after)]
    state = copy.deepcopy(first.state_dict())  # what a checkpoint holds after stop_after batches
    resumed = epochs_of(IndexStream(97), workers=workers, accum=2, batch_size=4)
    resumed.load_state_dict(state)
    resumed.start_epoch(3, start_batch=stop_after)
    after = list(resumed)
    assert indices(before) + indices(after) == expected
    if workers:  # worker seeds follow the epoch and a resume replays the stream: the augmentation is the same too
        assert torch.equal(torch.cat([b[0] for b in before + after]), torch.cat([b[0] for b in full_batches]))
    assert (state["ranks"][0]["loader"] is not None) == (stop_after > 4)  # a checkpoint inside the second window (4 batches each) holds its start


def _uneven_ranks(workers: int) -> tuple[int, list[int]]:
    import multiprocessing

    # run_on_ranks starts ranks from a forkserver, which would also start the DataLoader workers
    # (each importing torch again: ~30 s here); torchrun's ranks fork them.
    multiprocessing.set_start_method("fork", force=True)
    from ddpkit.env import read_dist_env

    env = read_dist_env()
    stream = IndexStream(94, shares=[40, 23, 31])
    epochs = build_stream_loader(stream, env=env, batch_size=4, num_workers=workers, accum=2, window_steps=1).stream_epochs
    epochs.start_epoch(0)
    got = indices(epochs)
    return epochs.batches_per_epoch, got


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [0, 2])
def test_uneven_shards_on_three_ranks_end_the_epoch_at_the_same_batch_without_hanging(workers):
    results = run_on_ranks(_uneven_ranks, world_size=3, args=(workers,), timeout=120)
    counts = {count for count, _ in results}
    # rank 1 has 23 samples: 5 full batches of 4 with 0 workers, 3 + 2 with 2 workers; 4 = whole steps of 2
    assert counts == {4}
    used = [i for _, got in results for i in got]
    assert len(used) == len(set(used)) == 3 * 4 * 4
    assert set(results[1][1]) <= set(range(40, 63))  # rank 1 trained on its own shard only


def test_webdataset_shards_split_over_ranks_and_workers_cover_every_sample_once(tmp_path):
    from ddpkit.stream_sources import webdataset

    images, labels = torch.zeros(53, 1, 2, 2), torch.arange(53) % 10
    paths = write_shards(images, labels, tmp_path, prefix="train", sizes=[20, 3, 11, 12, 7])  # uneven on purpose
    train, val = webdataset(urls=str(tmp_path / "train-{000..004}.tar"), fields=("__key__", "cls"))
    assert val is None and len(paths) == 5
    for epoch in (0, 1):
        keys = []
        for rank in range(3):
            view = train.shard(rank, 3)
            view.set_epoch(epoch)
            keys += [key for key, _ in DataLoader(view, batch_size=None, num_workers=2)]
        assert sorted(int(k) for k in keys) == list(range(53))


def test_hf_datasets_from_local_parquet_files_stream_each_row_to_one_rank(tmp_path):
    datasets = pytest.importorskip("datasets")
    from ddpkit.stream_sources import hf_datasets

    files = []
    for part in range(2):
        rows = range(part * 30, part * 30 + 30)
        datasets.Dataset.from_dict({"x": [[float(i)] for i in rows], "idx": list(rows)}).to_parquet(tmp_path / f"{part}.parquet")
        files.append(str(tmp_path / f"{part}.parquet"))
    train, _ = hf_datasets(path="parquet", data_files={"train": files}, columns=["x", "idx"])
    seen = []
    for rank in (0, 1):
        epochs = epochs_of(train, rank=rank, world_size=2, batch_size=3, workers=2)
        epochs.start_epoch(0)
        seen.append(indices(epochs))
    assert not set(seen[0]) & set(seen[1]) and len(seen[0]) == len(seen[1]) == 30


def test_a_schedule_that_needs_a_length_asks_for_train_max_steps():
    with pytest.raises(ConfigError, match=r"train\.max_steps.*sched\.name=cosine"):
        stream_total_steps(max_steps=None, epochs=3, steps_per_epoch=None, sched_name="cosine")
    assert stream_total_steps(max_steps=None, epochs=3, steps_per_epoch=None, sched_name="constant") is None
    assert stream_total_steps(max_steps=None, epochs=3, steps_per_epoch=40, sched_name="cosine") == 120
    assert stream_total_steps(max_steps=50, epochs=3, steps_per_epoch=40, sched_name="linear") == 50


def test_missing_shards_and_missing_extras_are_clear_errors(tmp_path, monkeypatch):
    from ddpkit.stream_sources import webdataset

    with pytest.raises(DataError, match=r"data\.kwargs\.urls: 2 of 2 shard files not found.*write_digits_shards"):
        webdataset(urls=str(tmp_path / "train-{0..1}.tar"))
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)  # as if torchdata were not installed
    with pytest.raises(DdpkitError, match=r"pip install 'ddpkit\[stream\]'"):
        build_stream_loader(IndexStream(10), env=env_of(0, 1), batch_size=2)


def test_the_epoch_end_logs_how_many_samples_were_dropped(caplog):
    epochs = epochs_of(IndexStream(23), batch_size=4, accum=2, window=1)
    epochs.start_epoch(0)
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        assert len(indices(epochs)) == 16  # 5 full batches, 4 in whole steps of 2
    assert "dropped 7 samples" in caplog.text  # one batch of 4 past the last whole step, and a partial batch of 3
