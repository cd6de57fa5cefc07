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
import gc
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO, assert_bitwise_equal, load_script, load_weights, run_cli, run_in_pool, tiny_config
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ddpkit.data.datasets import make_digits
from ddpkit.data.streaming import StreamEpochs, build_stream_loader, stream_total_steps
from ddpkit.distributed.env import DistEnv
from ddpkit.errors import ConfigError, DataError, DdpkitError

write_shards = load_script(REPO / "scripts" / "write_digits_shards.py").write_shards


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


class WorkerAwareStream(IndexStream):
    """PyTorch's documented pattern for workers: each DataLoader worker reads only its part."""

    def __iter__(self):
        info, samples = get_worker_info(), list(super().__iter__())
        return iter(samples if info is None else samples[info.id :: info.num_workers])


def env_of(rank: int, world_size: int) -> DistEnv:
    return DistEnv(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        master_addr="127.0.0.1",
        master_port=0,
        launcher="test",
        restart_count=0,
    )


def epochs_of(dataset, *, rank=0, world_size=1, batch_size=5, workers=0, accum=1, window=2) -> StreamEpochs:
    env = env_of(rank, world_size)
    return build_stream_loader(
        dataset, env=env, batch_size=batch_size, num_workers=workers, accum=accum, window_steps=window
    ).stream_epochs


def indices(batches) -> list[int]:
    return [i for batch in batches for i in batch[1].tolist()]


@pytest.mark.parametrize("stream_class", [IndexStream, WorkerAwareStream])
def test_a_plain_stream_is_split_over_ranks_and_workers_each_sample_once_and_reshuffled_per_epoch(stream_class):
    # A stream that splits itself over workers is read whole (it sees no workers) and split by ddpkit.
    per_epoch = []
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            epochs = epochs_of(stream_class(203), rank=rank, world_size=2, workers=2)
            epochs.start_epoch(epoch)
            seen.append(indices(epochs))
            assert epochs.batches_per_epoch == 20  # 4 slots of ~50 samples: 10 full batches of 5 per worker
        assert not set(seen[0]) & set(seen[1])
        # 3 of 203 dropped: < 1 batch per worker
        assert len(set(seen[0])) == len(seen[0]) == 100 and len(seen[1]) == 100
        per_epoch.append(seen[0])
    assert per_epoch[0] != per_epoch[1]  # set_epoch reached the worker processes


@pytest.fixture
def abandoned_loaders_end_quickly(monkeypatch):
    """A loader iterator left mid-epoch (a stop) is shut down within the test, in a fraction of a second.

    torchdata's ``StatefulDataLoader`` joins each worker of such an iterator for torch's
    ``MP_STATUS_CHECK_INTERVAL`` (5 s) before it terminates it: 10 s for two workers, spent whenever the
    iterator is collected, often in a later test. What this module checks is ddpkit's resume, not that wait.
    """
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    yield
    gc.collect()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_after", [3, 4, 7])
@pytest.mark.usefixtures("abandoned_loaders_end_quickly")
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
    # a checkpoint inside the second window (4 batches each) holds its start
    assert (state["ranks"][0]["loader"] is not None) == (stop_after > 4)


def _uneven_ranks(workers: int, uneven: str = "truncate") -> tuple[int | str, list[int]]:
    import multiprocessing

    # run_on_ranks starts ranks from a forkserver, which would also start the DataLoader workers
    # (each importing torch again: ~30 s here); torchrun's ranks fork them.
    multiprocessing.set_start_method("fork", force=True)
    # The ranks with batches left end the epoch with their loader mid-stream: see abandoned_loaders_end_quickly.
    interval = torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL
    torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL = 0.2
    from ddpkit.distributed.env import read_dist_env

    env = read_dist_env()
    stream = IndexStream(94, shares=[40, 23, 31])
    epochs = build_stream_loader(
        stream, env=env, batch_size=4, num_workers=workers, accum=2, window_steps=1, uneven=uneven
    ).stream_epochs
    epochs.start_epoch(0)
    try:
        got = indices(epochs)
        return epochs.batches_per_epoch, got
    except DataError as error:
        return str(error), []
    finally:
        del epochs
        gc.collect()
        torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL = interval


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [0, 2])
def test_uneven_shards_on_three_ranks_end_the_epoch_at_the_same_batch_without_hanging(workers):
    results = run_in_pool(_uneven_ranks, world_size=3, args=(workers,), timeout=120)
    counts = {count for count, _ in results}
    # rank 1 has 23 samples: 5 full batches of 4 with 0 workers, 3 + 2 with 2 workers; 4 = whole steps of 2
    assert counts == {4}
    used = [i for _, got in results for i in got]
    assert len(used) == len(set(used)) == 3 * 4 * 4
    assert set(results[1][1]) <= set(range(40, 63))  # rank 1 trained on its own shard only


@pytest.mark.multiprocess
def test_uneven_shards_with_data_uneven_error_stop_every_rank_naming_each_ranks_count():
    # shares 40/23/31 in batches of 4: rank 0 has 10 batches, rank 1 5, rank 2 7 (windows of 2 batches)
    results = run_in_pool(_uneven_ranks, world_size=3, args=(0, "error"), timeout=120)
    messages = [message for message, _ in results]
    assert all(isinstance(m, str) for m in messages) and len(set(messages)) == 1, messages  # every rank, the same error
    assert "rank 0: 8 or more, rank 1: 5, rank 2: 7" in messages[0] and "data.uneven=truncate" in messages[0]


def test_webdataset_shards_split_over_ranks_and_workers_cover_every_sample_once(tmp_path):
    from ddpkit.data.stream_sources import webdataset

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
    from ddpkit.data.stream_sources import hf_datasets

    files = []
    for part in range(2):
        rows = range(part * 30, part * 30 + 30)
        datasets.Dataset.from_dict({"x": [[float(i)] for i in rows], "idx": list(rows)}).to_parquet(
            tmp_path / f"{part}.parquet"
        )
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
    from ddpkit.data.stream_sources import webdataset

    with pytest.raises(DataError, match=r"data\.kwargs\.urls: 2 of 2 shard files not found.*write_digits_shards"):
        webdataset(urls=str(tmp_path / "train-{0..1}.tar"))
    two_ranks = {"ranks": [{"epoch": 0, "window_first": 0, "loader": None, "batches_per_epoch": None}] * 2}
    epochs = epochs_of(IndexStream(40))  # one rank resuming what two wrote
    epochs.load_state_dict(two_ranks)
    with pytest.raises(
        DataError,
        match=r"batch 3 of epoch 0 on 1 ranks: "
        r"the checkpoint was written by 2.*checkpoint\.every_epochs",
    ):
        epochs.start_epoch(0, start_batch=3)
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)  # as if torchdata were not installed
    with pytest.raises(DdpkitError, match=r"pip install 'ddpkit\[stream\]'"):
        build_stream_loader(IndexStream(10), env=env_of(0, 1), batch_size=2)


def test_the_epoch_end_logs_how_many_samples_were_dropped(caplog):
    epochs = epochs_of(IndexStream(23), batch_size=4, accum=2, window=1)
    epochs.start_epoch(0)
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        assert len(indices(epochs)) == 16  # 5 full batches, 4 in whole steps of 2
    assert "dropped 7 samples" in caplog.text  # one batch of 4 past the last whole step, and a partial batch of 3


# --- through the Trainer ----------------------------------------------------------------------------

STREAM_SCRIPT = "tests/scripts/stream_trainer.py"


def _stream_run(out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """2 ranks x 2 workers of tests/scripts/stream_trainer.py: 3 epochs of 8000 digits, checkpoint every 10 steps."""
    cfg = tiny_config(
        out,
        data={"batch_size": 32, "num_workers": 2, "kwargs": {"num_train": 8000, "num_val": 500}},
        model={"name": "mnist_cnn", "kwargs": {}},
        optim={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        sched={"name": "cosine", "warmup_steps": 20},
        train={"epochs": 3, "max_steps": 372, "log_every": 20},
        checkpoint={"every_steps": 10},
    )
    out.mkdir()
    (out / "exp.yaml").write_text(yaml.safe_dump(cfg))
    return run_cli(
        "run",
        str(out / "exp.yaml"),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--script",
        STREAM_SCRIPT,
        env=env,
        timeout=540,
    )


def _samples_per_epoch(run_dir: Path) -> dict[int, list[int]]:
    """Every sample index trained on, per epoch, over both ranks (from the script's per-rank logs)."""
    epochs: dict[int, list[int]] = {}
    for rank in (0, 1):
        for line in (run_dir / f"samples-rank{rank}.txt").read_text().splitlines():
            epoch, _step, *indices = line.split()
            epochs.setdefault(int(epoch), []).extend(map(int, indices))
    return epochs


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_plain_stream_on_2_ranks_x_2_workers_is_exact_accurate_and_a_killed_rank_resumes_bitwise(tmp_path):
    """`ddpkit run`'s own restart (`--max-restarts 1`) after rank 1 SIGKILLs itself with DataLoader workers reading
    ahead."""
    clean = _stream_run(tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-3000:]
    epochs = _samples_per_epoch(tmp_path / "clean/run")
    assert sorted(epochs) == [0, 1, 2]
    for used in epochs.values():
        # no sample twice within an epoch, over ranks and workers (a restart would replay some)
        assert len(used) == len(set(used)), clean.stderr[-3000:]
        assert len(used) >= 0.9 * 8000  # 7936: only partial batches were dropped
    assert epochs[0] != epochs[1]  # set_epoch reshuffled the stream
    assert (
        "dropped 64 samples" in clean.stderr
        and "unknown (a stream) steps per epoch, 372 steps in total" in clean.stderr
    )
    records = [json.loads(line) for line in (tmp_path / "clean/run/metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if "val_accuracy" in r][-1]
    assert final["val_accuracy"] >= 0.95 and final["val_index"] == 249.5  # each of 500 validation samples once

    # Rank 1 is SIGKILLed after step 157 (epoch 1, inside a read-ahead window); torchrun restarts
    # both ranks. They resume from the newest checkpoint: the periodic one of step 150 (batch 26 of
    # epoch 1: window start 24, then skip 2), or a memory snapshot the survivor wrote on its way out
    # (its interval is tuned to the measured cost, e.g. every 76 steps: step 152).
    killed = _stream_run(tmp_path / "killed", {"KILL_RANK": "1", "KILL_AT_STEP": "157"})
    assert killed.returncode == 0, killed.stderr[-3000:]
    resumed = re.search(r"resuming from \S+step-0*(\d+)\.pt \(step (\d+)\)", killed.stderr)
    # An earlier resume means the first attempt ended before step 157 for another reason: show why.
    why = [line for line in killed.stderr.splitlines() if re.search(r"error|Error|exitcode|WARNING", line)]
    assert resumed is not None and 150 <= int(resumed.group(2)) <= 157, (
        "\n".join(why[:40]) + "\n...\n" + killed.stderr[-3000:]
    )
    assert_bitwise_equal(load_weights(tmp_path / "killed/run/model.pt"), load_weights(tmp_path / "clean/run/model.pt"))


def _fit_named_stream(out: str, data: dict) -> dict:
    import ddpkit

    cfg = tiny_config(out, data=data, train={"epochs": 2, "log_every": 4})
    return ddpkit.Trainer(cfg).fit()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_webdataset_and_hf_datasets_by_name_train_on_two_ranks(tmp_path):
    import datasets

    shards = tmp_path / "shards"
    written = subprocess.run(
        [
            sys.executable,
            "scripts/write_digits_shards.py",
            str(shards),
            "--num-train",
            "300",
            "--num-val",
            "101",
            "--shards",
            "5",
            "--image-size",
            "12",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert written.returncode == 0, written.stderr
    urls = {"urls": str(shards / "train-{000..004}.tar"), "val_urls": str(shards / "val-000.tar")}
    images, labels = make_digits(300, seed=1234, image_size=12)
    datasets.Dataset.from_dict({"image": images.tolist(), "label": labels.tolist()}).to_parquet(
        tmp_path / "train.parquet"
    )
    hf = {"path": "parquet", "data_files": {"train": str(tmp_path / "train.parquet")}, "columns": ["image", "label"]}
    # webdataset: 5 shards of 60 over 2 ranks give one rank 3 shards (180 samples), the other 2 (120):
    # 7 batches of 16 each epoch on both. hf_datasets: one file, split by rows: 150 per rank, 9 batches.
    for data, steps_per_epoch in (
        ({"name": "webdataset", "kwargs": urls}, 7),
        ({"name": "hf_datasets", "kwargs": hf}, 9),
    ):
        results = run_in_pool(_fit_named_stream, world_size=2, args=(str(tmp_path / data["name"]), data), timeout=240)
        assert results[0] == results[1]  # the same steps and reduced metrics on both ranks
        assert results[0]["epoch"] == 2 and results[0]["step"] == 2 * steps_per_epoch
        assert ("val_accuracy" in results[0]) == (data["name"] == "webdataset")  # hf: no validation split given


def test_a_stream_with_a_schedule_that_needs_a_length_stops_with_a_config_error(tmp_path):
    import ddpkit

    shards = tmp_path / "shards"
    images, labels = make_digits(64, seed=0, image_size=12)
    write_shards(images, labels, shards, prefix="train", sizes=[64])
    cfg = tiny_config(
        tmp_path,
        data={"name": "webdataset", "kwargs": {"urls": str(shards / "train-000.tar")}},
        sched={"name": "cosine"},
    )
    with pytest.raises(
        ConfigError, match=r"train\.max_steps: sched\.name=cosine needs the run's length.*stream without len\(\)"
    ):
        ddpkit.Trainer(cfg).fit()
