"""RemoteMirror against a real S3 server (moto's, started by tests/storage_server.py on 127.0.0.1).

    .venv/bin/pytest -q tests/test_storage_s3.py

What a run does with ``checkpoint.dir: s3://...``, minus the Trainer: probe the bucket, take its lock,
save locally and upload in the background process, report the lag, wait at the end; then a second
run on an empty disk fetches the newest valid checkpoint, bit for bit. A store that stops answering
delays the uploads, never the saves. A missing bucket, missing credentials and a second writer are refused.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import cpu_runtime
from storage_server import s3_server, s3_url  # noqa: F401 (fixtures, found by name)

from ddpkit.checkpoint.files import find_latest_checkpoint, save_checkpoint
from ddpkit.checkpoint.run_lock import RunDirectoryLocked
from ddpkit.checkpoint.storage import RemoteMirror
from ddpkit.checkpoint.storage.layout import find_remote
from ddpkit.checkpoint.storage.lease import LOCK_OBJECT
from ddpkit.config.loader import load_config
from ddpkit.config.schema import Config
from ddpkit.errors import ConfigError

pytestmark = [pytest.mark.timeout(180), pytest.mark.multiprocess]


def _config(tmp_path: Path, url: str, name: str = "a", **checkpoint) -> Config:
    checkpoint = {"dir": url, "keep_last": 2, **checkpoint}
    return load_config({"run": {"output_dir": str(tmp_path / name)}, "checkpoint": checkpoint})


def _save(config: Config, step: int) -> Path:
    state = {"w": torch.arange(1000.0) * step, "step": step}
    return save_checkpoint(state, config.checkpoint_dir, step=step, keep_last=config.checkpoint.keep_last).path


def _wait_until(condition, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def test_a_run_is_mirrored_and_a_fresh_disk_resumes_from_the_bucket(s3_url, tmp_path):  # noqa: F811
    config = _config(tmp_path, s3_url)
    mirror = RemoteMirror.for_run(config, cpu_runtime())
    Path(config.output_dir).mkdir(parents=True)
    Path(config.output_dir, "metrics.jsonl").write_text('{"step": 10}\n{"step": 20}\n{"step": 3')  # a line half-written
    paths = []
    for step in (10, 20, 30):
        paths.append(_save(config, step))
        started = time.perf_counter()
        mirror.saved(paths[-1])
        assert time.perf_counter() - started < 0.5  # queued, not uploaded, on the training thread
        _wait_until(lambda: mirror.metrics()["remote_lag_steps"] == 0)
    metrics = mirror.metrics()
    assert metrics["remote_upload_bytes"] > 0 and metrics["remote_upload_s"] > 0
    assert metrics["remote_upload_failures"] == 0
    Path(config.output_dir, "model.pt").write_bytes(b"weights")
    assert mirror.on_exit("finished", deadline_s=60) == []
    store = mirror.store
    assert [c.step for c in find_remote(store)] == [30, 20]  # step 10 retired once 30 counted
    assert store.get_bytes(LOCK_OBJECT) is None  # released
    assert store.get_bytes("metrics.jsonl") == b'{"step": 10}\n{"step": 20}\n'  # complete lines only
    assert store.get_bytes("model.pt") == b"weights"

    fresh = _config(tmp_path, s3_url, name="fresh")  # another machine: nothing on its disk
    again = RemoteMirror.for_run(fresh, cpu_runtime())
    fetched = again.fetch(fresh.checkpoint_dir)
    found = find_latest_checkpoint(fresh.checkpoint_dir)
    assert found is not None and str(found.path) == fetched and found.step == 30
    assert found.path.read_bytes() == paths[-1].read_bytes()
    assert Path(fresh.output_dir, "metrics.jsonl").read_text() == '{"step": 10}\n{"step": 20}\n'
    assert again.fetch(fresh.checkpoint_dir) is None  # this disk has it now: nothing to download
    again.protect(found.path)
    again.on_exit("finished", deadline_s=60)


def test_a_second_run_on_the_same_url_is_refused_while_the_first_holds_the_lock(s3_url, tmp_path):  # noqa: F811
    first = RemoteMirror.for_run(_config(tmp_path, s3_url), cpu_runtime())
    with pytest.raises(RunDirectoryLocked, match=f"checkpoint.dir={s3_url} is in use by another run"):
        RemoteMirror.for_run(_config(tmp_path, s3_url, name="b"), cpu_runtime())
    first.on_exit("finished", deadline_s=60)
    second = RemoteMirror.for_run(_config(tmp_path, s3_url, name="b"), cpu_runtime())  # released: free again
    assert second.lease.epoch == first.lease.epoch + 1
    second.on_exit("finished", deadline_s=60)


def test_a_store_that_stops_answering_delays_uploads_not_saves(s3_server, s3_url, tmp_path):  # noqa: F811
    config = _config(tmp_path, s3_url)
    mirror = RemoteMirror.for_run(config, cpu_runtime())
    mirror.saved(_save(config, 10))
    _wait_until(lambda: mirror.metrics()["remote_lag_steps"] == 0)
    s3_server.pause()
    try:
        started = time.perf_counter()
        mirror.saved(_save(config, 20))
        assert time.perf_counter() - started < 0.5
        time.sleep(1.0)
        assert mirror.metrics()["remote_lag_steps"] == 10
    finally:
        s3_server.resume()
    # The stalled request completes, or times out (60 s) and a retry on a new client does.
    _wait_until(lambda: mirror.metrics()["remote_lag_steps"] == 0, timeout=150)
    mirror.on_exit("finished", deadline_s=60)
    assert [c.step for c in find_remote(mirror.store)] == [20, 10]


def test_the_end_of_a_run_waits_for_uploads_only_until_its_deadline(s3_server, s3_url, tmp_path, caplog):  # noqa: F811
    config = _config(tmp_path, s3_url)
    mirror = RemoteMirror.for_run(config, cpu_runtime())
    s3_server.pause()
    try:
        path = _save(config, 10)
        mirror.saved(path)
        started = time.perf_counter()
        left = mirror.on_exit("finished", deadline_s=2.0)
        assert time.perf_counter() - started < 10 and left == [str(path)]
    finally:
        s3_server.resume()
    assert "not finished within 2 s, kept only locally" in caplog.text


def test_a_missing_bucket_and_missing_credentials_are_refused_at_start(s3_url, tmp_path, monkeypatch):  # noqa: F811
    with pytest.raises(ConfigError, match="checkpoint.dir=s3://no-such-bucket/run: .* the bucket does not exist"):
        RemoteMirror.for_run(_config(tmp_path, "s3://no-such-bucket/run"), cpu_runtime())
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="no credentials were found"):
        RemoteMirror.for_run(_config(tmp_path, s3_url), cpu_runtime())


def test_a_checkpoint_saved_behind_the_mirrors_back_goes_up_at_the_end(s3_url, tmp_path):  # noqa: F811
    config = _config(tmp_path, s3_url)
    mirror = RemoteMirror.for_run(config, cpu_runtime())
    path = _save(config, 10)  # the crash save of a dead peer's last step: written without mirror.saved()
    assert mirror.on_exit("FAILED", deadline_s=60) == []
    (remote,) = find_remote(mirror.store)
    assert remote.step == 10 and remote.manifest["objects"][path.name]["bytes"] == path.stat().st_size


def test_the_hf_directory_goes_up_when_the_run_finished_and_stays_when_it_failed(s3_url, tmp_path):  # noqa: F811
    config = _config(tmp_path, s3_url)
    directory = Path(config.output_dir, "hf")
    directory.mkdir(parents=True)
    for name in ("model-00001-of-00001.safetensors", "model.safetensors.index.json", "config.json"):
        (directory / name).write_bytes(name.encode() * 1000)
    failed = RemoteMirror.for_run(config, cpu_runtime())
    # a failed run's hf/ may be an earlier run's: the store's copy stays as it was
    assert failed.on_exit("FAILED", deadline_s=60) == [] and failed.store.listing("hf/") == {}
    finished = RemoteMirror.for_run(config, cpu_runtime())
    assert finished.on_exit("FINISHED", deadline_s=60) == []
    assert finished.store.listing("hf/") == {f"hf/{f.name}": f.stat().st_size for f in directory.iterdir()}
    assert all(finished.store.get_bytes(f"hf/{f.name}") == f.read_bytes() for f in directory.iterdir())
