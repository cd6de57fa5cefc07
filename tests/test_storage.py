"""Object storage without a server: fsspec's ``memory://`` store, wrapped to fail, expire or die at chosen points.

    .venv/bin/pytest -q tests/test_storage.py

Real checkpoints (written by ``ddpkit.checkpoint.files.save_checkpoint``) are published, found, fetched
into an empty folder where local discovery takes them, refused when altered, retired, fenced by the lease.
The same code against a real S3 server (and the upload process) is in tests/test_storage_s3.py.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from ddpkit.checkpoint.files import find_latest_checkpoint, save_checkpoint
from ddpkit.checkpoint.run_lock import RunDirectoryLocked
from ddpkit.checkpoint.storage import layout, lease
from ddpkit.checkpoint.storage.publish import LeaseLost, publish_checkpoint
from ddpkit.checkpoint.storage.store import Store, open_store
from ddpkit.checkpoint.storage.worker import Worker, coalesce
from ddpkit.config.loader import load_config
from ddpkit.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.timeout(60)


class Killed(BaseException):
    """The writing process dies here: not an Exception, so no retry or handler catches it."""


class Faulty(MemoryFileSystem):
    """The memory store, failing on request: ``fail_puts`` writes raise, ``die_on`` kills the writer at a name."""

    def __init__(self, *, fail_puts: int = 0, die_on: str | None = None, expired: bool = False):
        super().__init__()
        self.fail_puts, self.die_on, self.expired = fail_puts, die_on, expired

    def _check(self, path: str) -> None:
        if self.expired:
            raise PermissionError("An error occurred (ExpiredToken): The provided token has expired.")
        if self.die_on and path.endswith(self.die_on):
            raise Killed(path)
        if self.fail_puts > 0:
            self.fail_puts -= 1
            raise ConnectionError("connection reset by peer")

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        self._check(path)
        return super().pipe_file(path, value, mode=mode, **kwargs)

    def open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            self._check(path)
        return super().open(path, mode, **kwargs)


class Rebuilt(Store):
    """A store whose client has expired credentials until :meth:`rebuild` makes a new one."""

    def rebuild(self) -> None:
        self.fs = Faulty(skip_instance_cache=True)


class Kept(Store):
    """A store whose faults survive :meth:`rebuild` (a server that keeps failing, whatever the client)."""

    rebuilds = 0

    def rebuild(self) -> None:
        self.rebuilds += 1


@pytest.fixture
def store() -> Store:
    return Kept(f"memory://bucket-{secrets.token_hex(4)}/run", fs=Faulty(skip_instance_cache=True))


def _saves(directory: Path, steps: list[int]) -> list[Path]:
    return [save_checkpoint({"w": torch.arange(50.0) * s, "step": s}, directory, step=s).path for s in steps]


def _publish(store: Store, path: Path, *, epoch: int | None = None, keep_last: int | None = None, protected=()) -> dict:
    job = {"op": "checkpoint", "path": str(path), "step": int(path.name[5:14])}
    return publish_checkpoint(store, job, epoch=epoch, keep_last=keep_last, protected=set(protected))


def test_a_checkpoint_goes_up_and_comes_back_into_an_empty_folder(store, tmp_path):
    (path,) = _saves(tmp_path / "a", [100])
    assert _publish(store, path)["bytes"] == path.stat().st_size
    (remote,) = layout.find_remote(store)
    assert remote.step == 100 and remote.manifest["objects"]["step-000000100.pt"]["bytes"] == path.stat().st_size
    fetched = layout.download(store, remote, tmp_path / "empty")
    found = find_latest_checkpoint(tmp_path / "empty")
    assert found is not None and found.path == fetched and fetched.read_bytes() == path.read_bytes()


def test_an_altered_object_is_refused_and_leaves_nothing_local_discovery_takes(store, tmp_path):
    (path,) = _saves(tmp_path / "a", [100])
    _publish(store, path)
    data = bytearray(store.get_bytes("step-000000100.pt"))
    data[-100] ^= 0xFF  # same size, one flipped byte: only the sha256 tells
    store.put_bytes("step-000000100.pt", bytes(data))
    with pytest.raises(CheckpointError, match="corrupt or altered"):
        layout.download(store, layout.find_remote(store)[0], tmp_path / "empty")
    assert find_latest_checkpoint(tmp_path / "empty") is None and not list((tmp_path / "empty").iterdir())


def test_a_writer_killed_between_data_and_manifest_leaves_the_previous_checkpoint_newest(store, tmp_path):
    first, second = _saves(tmp_path / "a", [100, 200])
    _publish(store, first)
    store.fs.die_on = "step-000000200.json"
    with pytest.raises(Killed):
        _publish(store, second)
    assert "step-000000200.pt" in store.listing()  # the data went up ...
    assert [c.step for c in layout.find_remote(store)] == [100]  # ... but without its manifest it does not count


def test_retention_keeps_the_newest_and_the_protected_and_sweeps_unfinished_uploads(store, tmp_path):
    paths = _saves(tmp_path / "a", [100, 200, 300, 400])
    store.put_bytes("step-000000150.pt", b"a killed upload's data")
    _publish(store, paths[0])
    for path in paths:  # the run resumed from step 100: protected, and not sent again
        _publish(store, path, keep_last=2, protected={"step-000000100.pt"})
    assert [c.step for c in layout.find_remote(store)] == [400, 300, 100]
    assert sorted(store.listing()) == sorted(f"step-000000{s}.{e}" for s in (100, 300, 400) for e in ("pt", "json"))


def test_a_failing_put_is_retried_with_backoff_and_counted_once_it_keeps_failing(store, tmp_path, capfd):
    first, second = _saves(tmp_path / "a", [100, 200])
    waits: list[float] = []
    store.fs.fail_puts = 2
    answer = Worker(store, sleep=waits.append).handle({"op": "checkpoint", "path": str(first), "step": 100, "seq": 1})
    assert answer["ok"] and waits == [1.0, 2.0] and store.rebuilds == 2
    store.fs.fail_puts, waits[:] = 100, []
    answer = Worker(store, sleep=waits.append).handle({"op": "checkpoint", "path": str(second), "step": 200, "seq": 2})
    assert not answer["ok"] and "connection reset" in answer["error"] and waits == [1, 2, 4, 8, 16, 30, 30, 30, 30]
    assert "could not upload" in capfd.readouterr().err and [c.step for c in layout.find_remote(store)] == [100]


def test_expired_credentials_are_recovered_by_a_new_client(tmp_path):
    (path,) = _saves(tmp_path / "a", [100])
    store = Rebuilt(f"memory://bucket-{secrets.token_hex(4)}/run", fs=Faulty(expired=True, skip_instance_cache=True))
    answer = Worker(store, sleep=lambda s: None).handle({"op": "checkpoint", "path": str(path), "step": 100})
    assert answer["ok"] and [c.step for c in layout.find_remote(store)] == [100]


def test_a_checkpoint_pruned_locally_before_its_turn_is_skipped_without_retries(store, tmp_path):
    _saves(tmp_path, [200])  # step 100 was pruned once 200 was committed
    waits: list[float] = []
    job = {"op": "checkpoint", "path": str(tmp_path / "step-000000100.pt"), "step": 100}
    answer = Worker(store, sleep=waits.append).handle(job)
    assert answer["ok"] and answer["skipped"] and waits == []  # superseded: not a failure


def test_an_upload_queued_before_its_async_write_finished_waits_for_the_commit(store, tmp_path):
    import threading

    path = tmp_path / "step-000000100.pt"
    writer = threading.Timer(0.5, _saves, args=(tmp_path, [100]))  # the background write lands after the queueing
    writer.start()
    answer = Worker(store, sleep=lambda s: None).handle({"op": "checkpoint", "path": str(path), "step": 100})
    writer.join()
    assert answer["ok"] and [c.step for c in layout.find_remote(store)] == [100]


def test_only_the_newest_of_queued_checkpoints_is_sent():
    jobs = [{"op": "checkpoint", "path": f"c/step-00000000{i}.pt", "seq": i} for i in range(3)]
    jobs.append({"op": "file", "seq": 9})
    run, skipped = coalesce(jobs, in_parts=False)
    assert [j["seq"] for j in run] == [2, 9] and [j["seq"] for j in skipped] == [0, 1]
    assert coalesce(jobs, in_parts=True) == (jobs, [])


def test_the_lock_refuses_a_live_holder_and_takes_over_a_dead_one(store):
    first = lease.acquire(store)
    with pytest.raises(RunDirectoryLocked, match="in use by another run"):
        lease.acquire(store)  # this very process holds it: alive
    holder = json.loads(store.get_bytes(lease.LOCK_OBJECT))
    store.put_bytes(lease.LOCK_OBJECT, json.dumps({**holder, "host": "elsewhere", "renewed": 0.0}).encode())
    second = lease.acquire(store)  # another host's lock, not renewed for ages: taken over
    assert (first.epoch, second.epoch) == (1, 2)
    assert not lease.renew(store, first) and lease.renew(store, second)
    lease.release(store, first)
    assert json.loads(store.get_bytes(lease.LOCK_OBJECT))["token"] == second.token  # not the old holder's to remove


def test_a_run_that_lost_its_lease_cannot_publish_a_checkpoint_that_counts(store, tmp_path):
    old_path, new_path, late_path = _saves(tmp_path / "a", [100, 200, 300])
    old = lease.acquire(store)
    _publish(store, old_path, epoch=old.epoch)
    store.delete([lease.LOCK_OBJECT])  # the holder froze; its lock went stale and another run took over
    new = lease.acquire(store)
    _publish(store, new_path, epoch=new.epoch, keep_last=1, protected={"step-000000100.pt"})
    with pytest.raises(LeaseLost, match="taken over"):
        _publish(store, late_path, epoch=old.epoch)
    manifest = {
        "format": layout.FORMAT,
        "name": "step-000000300.pt",
        "step": 300,
        "epoch": old.epoch,
        "objects": {},
        "local": {},
    }
    store.put_bytes("step-000000300.json", json.dumps(manifest).encode())  # a zombie that skipped the check
    assert not layout.counting(manifest, layout.newest_fence(store))
    assert [c.step for c in layout.find_remote(store)] == [200, 100]  # epoch 1's step 100 was accepted at the takeover
    assert layout.retire(store, keep_last=1, protected=set(), epoch=old.epoch) == []  # the zombie deletes nothing


def test_config_keeps_a_local_staging_folder_for_a_url_and_refuses_lookalikes(tmp_path):
    config = load_config({"run": {"output_dir": str(tmp_path / "run")}, "checkpoint": {"dir": "s3://bucket/run"}})
    assert config.checkpoint_dir == f"{tmp_path}/run/checkpoints" and config.checkpoint_url == "s3://bucket/run"
    local = load_config({"checkpoint": {"dir": str(tmp_path / "c")}})
    assert local.checkpoint_dir == str(tmp_path / "c") and local.checkpoint_url is None
    for value, message in (("s3:/bucket/run", "did you mean s3://bucket/run"), ("ftp://h/x", "unknown storage scheme")):
        with pytest.raises(ConfigError, match=message):
            load_config({"checkpoint": {"dir": value}})
    with pytest.raises(ConfigError, match="run.output_dir: s3://b/x must be a local folder"):
        load_config({"run": {"output_dir": "s3://b/x"}})
    with pytest.raises(ConfigError, match="checkpoint.storage_options: only used"):
        load_config({"checkpoint": {"storage_options": {"profile": "x"}}})


def test_a_missing_backend_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else real(name, *a))
    with pytest.raises(ConfigError, match=r"gs://b/run needs gcsfs, which is not installed: pip install 'ddpkit\[gcs"):
        open_store("gs://b/run")


def test_a_file_url_is_a_store_with_atomic_create(tmp_path):
    store = open_store(f"file://{tmp_path}/remote")
    store.put_bytes(".ddpkit/x", b"1", create=True)
    with pytest.raises(FileExistsError):
        store.put_bytes(".ddpkit/x", b"2", create=True)
    assert store.listing() == {".ddpkit/x": 1} and os.path.isfile(tmp_path / "remote" / ".ddpkit" / "x")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, on purpose
def test_a_sharded_checkpoint_goes_up_as_one_object_per_file_and_validates_after_fetch(store, tmp_path):
    from ddpkit.checkpoint.files import validate_checkpoint
    from ddpkit.checkpoint.sharded import save_sharded

    final = save_sharded({"model": {"w": torch.arange(64.0)}}, {"step": 100}, tmp_path / "a", step=100, rank=0)
    answer = _publish(store, final)
    assert answer["bytes"] == sum(f.stat().st_size for f in final.iterdir())
    (remote,) = layout.find_remote(store)
    assert sorted(remote.manifest["objects"]) == sorted(f"step-000000100.dcp/{f.name}" for f in final.iterdir())
    fetched = layout.download(store, remote, tmp_path / "empty")
    assert validate_checkpoint(fetched).step == 100 and find_latest_checkpoint(tmp_path / "empty").path == fetched
    assert all((fetched / f.name).read_bytes() == f.read_bytes() for f in final.iterdir())


def test_the_upload_process_runs_without_torch_and_answers_each_job(tmp_path):
    from ddpkit.checkpoint.storage.uploads import Uploader

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"st')
    uploads = Uploader({"url": f"file://{tmp_path}/remote", "options": {}, "keep_last": 2, "lease": None})
    uploads.submit({"op": "file", "path": str(tmp_path / "metrics.jsonl"), "name": "metrics.jsonl", "lines": True})
    answers: list[dict] = []
    while not answers:
        answers = uploads.answers()
    maps = Path(f"/proc/{uploads._proc.pid}/maps").read_text()
    assert answers[0]["ok"] and answers[0]["bytes"] == 12 and "libtorch" not in maps
    assert uploads.drain(30) == ([], [])
    assert (tmp_path / "remote" / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_an_sdks_own_already_exists_error_reads_as_a_refused_create(tmp_path):
    class ResourceExistsError(Exception):  # Azure's name for it; GCS answers HTTP 412
        pass

    class Refusing(MemoryFileSystem):
        def pipe_file(self, path, value, mode="overwrite", **kwargs):
            raise ResourceExistsError("The specified blob already exists.")

    store = Store(f"memory://bucket-{secrets.token_hex(4)}/run", fs=Refusing(skip_instance_cache=True))
    with pytest.raises(FileExistsError):
        store.put_bytes(".ddpkit/epoch-000000001.json", b"{}", create=True)


def test_start_up_calls_ride_out_a_hiccup_but_not_a_denied_access(store):
    from ddpkit.checkpoint.storage.probe import with_retries

    waits: list[float] = []
    store.fs.fail_puts = 2
    with_retries(lambda: store.put_bytes("a", b"1"), store, sleep=waits.append)
    assert waits == [1.0, 2.0] and store.get_bytes("a") == b"1"

    def denied() -> None:
        raise PermissionError("An error occurred (AccessDenied) when calling the PutObject operation")

    with pytest.raises(PermissionError):
        with_retries(denied, store, sleep=waits.append)
    assert waits == [1.0, 2.0]  # no retry: the store's answer, not a hiccup


HF_JOB = {"op": "directory", "name": "hf", "last": ["model.safetensors.index.json", "config.json"]}


def _hf_directory(directory: Path, files: int, tag: bytes) -> Path:
    """A Hugging Face directory's files (their bytes made up, ``tag`` telling two copies apart)."""
    directory.mkdir(parents=True)
    for i in range(1, files + 1):
        (directory / f"model-{i:05d}-of-{files:05d}.safetensors").write_bytes(tag * (100 * i))
    for name in ("model.safetensors.index.json", "config.json", "tokenizer.json"):
        (directory / name).write_bytes(tag + name.encode())
    return directory


def test_a_directory_goes_up_over_its_previous_copy_with_its_config_last(store, tmp_path):
    from ddpkit.checkpoint.storage.publish import publish_directory

    publish_directory(store, {**HF_JOB, "path": str(_hf_directory(tmp_path / "old", 3, b"o"))})
    new = _hf_directory(tmp_path / "hf", 2, b"n")
    answer = publish_directory(store, {**HF_JOB, "path": str(new)})
    # the previous copy's third file is gone: the index names two
    assert sorted(store.listing()) == sorted(f"hf/{f.name}" for f in new.iterdir())
    assert all(store.get_bytes(f"hf/{f.name}") == f.read_bytes() for f in new.iterdir())
    assert answer["bytes"] == sum(f.stat().st_size for f in new.iterdir())


@pytest.mark.parametrize("killed_at", ["hf/model-00001-of-00002.safetensors", "hf/config.json"])
def test_a_directory_cut_short_never_looks_complete(store, tmp_path, killed_at):
    from ddpkit.checkpoint.storage.publish import publish_directory

    publish_directory(store, {**HF_JOB, "path": str(_hf_directory(tmp_path / "old", 3, b"o"))})
    store.fs.die_on = killed_at
    with pytest.raises(Killed):
        publish_directory(store, {**HF_JOB, "path": str(_hf_directory(tmp_path / "hf", 2, b"n"))})
    # no config.json: transformers loads nothing from it, old or new (the previous copy's went before its data)
    remote = store.listing()
    assert "hf/config.json" not in remote and "hf/model-00003-of-00003.safetensors" not in remote
    if killed_at == "hf/config.json":
        # every data file and the index of the new copy are up: only the marker is missing
        assert store.get_bytes("hf/model.safetensors.index.json") == b"nmodel.safetensors.index.json"


def test_a_directory_without_its_config_is_not_uploaded_and_not_retried(store, tmp_path):
    directory = _hf_directory(tmp_path / "hf", 2, b"n")
    (directory / "config.json").unlink()
    waits: list[float] = []
    answer = Worker(store, sleep=waits.append).handle({**HF_JOB, "path": str(directory), "seq": 1})
    assert not answer["ok"] and "has no config.json" in answer["error"] and waits == []
    assert store.listing() == {}
