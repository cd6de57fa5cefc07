"""Metric sinks and experiment trackers: real MLflow stores (SQLite, a real `mlflow server`), W&B offline files.

The sink-level tests drive a sink the way the reporter does (start, write, state_dict, finish)
and then read what the tracker itself stored. The end-to-end tests run `ddpkit run` and resume it.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import tiny_config

from ddpkit.errors import DdpkitError
from ddpkit.reporting import sinks
from ddpkit.reporting.sink_base import Sink, flatten_config
from ddpkit.reporting.sinks import STATUS_FILE, SinkGroup, StatusSink, read_status
from ddpkit.reporting.trackers import MlflowSink, WandbSink, tracker_sinks

mlflow = pytest.importorskip("mlflow")

CONFIG = {
    "run": {"name": "exp", "seed": 0},
    "optim": {"name": "sgd", "lr": 0.05},
    "model": {"kwargs": {}, "name": None},
    "train": {"epochs": 2},
    "data": {"kwargs": {"hidden": [64, 64]}},
}


def drive(
    sink: Sink, steps: range, *, resumed: dict | None = None, status: str = "FINISHED", artifacts: list[Path] = ()
) -> dict:
    """What the reporter does over one attempt: train records every step, a validation record at the end."""
    sink.start(CONFIG, resumed=resumed)
    for step in steps:
        sink.write({"step": step, "epoch": 0, "train_loss": 1.0 / step, "lr": 0.05, "time": time.time()})
    sink.write({"step": steps[-1], "epoch": 0, "val_accuracy": steps[-1] / 100, "val_loss": 0.5, "time": time.time()})
    state = sink.state_dict()
    sink.finish(status, list(artifacts))
    return state


def only_run(uri: str, experiment: str = "exp"):
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, f"expected one MLflow run, found {len(runs)}"
    return client, runs[0]


# --- the sink interface, no tracker ---------------------------------------------------------------


def test_flatten_config_gives_dotted_keys_and_keeps_empty_sections():
    flat = flatten_config(CONFIG)
    assert flat["optim.lr"] == 0.05 and flat["run.name"] == "exp"
    assert flat["model.kwargs"] == {} and flat["model.name"] is None and flat["data.kwargs.hidden"] == [64, 64]


class _Broken(Sink):
    name = "broken"

    def __init__(self):
        self.calls = 0

    def write(self, record):
        self.calls += 1
        raise ConnectionError("tracker down")


def test_a_failing_sink_is_dropped_with_one_warning_but_a_required_one_raises(caplog):
    broken, kept = _Broken(), []

    class Keeper(Sink):
        name = "keeper"

        def write(self, record):
            kept.append(record["step"])

    group = SinkGroup([broken, Keeper()])
    group.start(CONFIG)
    for step in (1, 2, 3):
        group.write({"step": step})
    assert broken.calls == 1 and kept == [1, 2, 3]
    assert sum("broken" in r.getMessage() and "switched off" in r.getMessage() for r in caplog.records) == 1

    required = _Broken()
    required.required = True
    with pytest.raises(ConnectionError):
        SinkGroup([required]).write({"step": 1})


class _Clock:
    """Stands in for the ``time`` module inside ``ddpkit.reporting.sinks``: a clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now


def test_status_sink_adds_wall_time_over_attempts(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(sinks, "time", clock)
    first = StatusSink(tmp_path)
    first.start(CONFIG, resumed=None)
    clock.now += 7.0  # the first attempt trains for 7 s
    state = first.state_dict()  # what its last checkpoint carries
    first.finish("KILLED", [])
    assert read_status(tmp_path)["status"] == "KILLED" and state["attempts"] == 1 and state["wall_s"] == 7.0
    clock.now += 500.0  # the job waits to be relaunched: not the run's wall time
    second = StatusSink(tmp_path)
    second.start(CONFIG, resumed=state)
    second.write({"step": 4})
    clock.now += 3.0  # the second attempt trains for 3 s
    second.finish("FINISHED", [])
    status = json.loads((tmp_path / STATUS_FILE).read_text())
    assert status["status"] == "FINISHED" and status["attempts"] == 2 and status["step"] == 4
    assert status["wall_s"] == 7.0 + 3.0  # carried over, plus this attempt's own time
    assert status["started"] == state["started"] and status["ended"] == clock.time()


def test_missing_tracker_package_names_the_extra_and_the_key(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("mlflow", "wandb") else real(name, *a)
    )
    with pytest.raises(DdpkitError, match=r"pip install 'ddpkit\[mlflow\]'.*log\.mlflow=false"):
        MlflowSink(tmp_path, experiment="exp")
    with pytest.raises(DdpkitError, match=r"pip install 'ddpkit\[wandb\]'.*log\.wandb=false"):
        tracker_sinks(mlflow=False, wandb=True, output_dir=tmp_path, run_name="exp")


# --- MLflow ------------------------------------------------------------------------------------------


def test_mlflow_resumed_run_continues_the_same_run_in_a_sqlite_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "model.pt").write_bytes(b"weights")
    state = drive(MlflowSink(tmp_path, experiment="exp"), range(1, 5), status="KILLED")
    assert state["tracking_uri"] == f"sqlite:///{tmp_path.resolve()}/mlflow.db"  # the default store: in the run dir
    _, run = only_run(state["tracking_uri"])
    assert run.info.status == "KILLED" and run.data.tags["ddpkit_run_key"] == state["run_key"]

    later = MlflowSink(tmp_path, experiment="exp")
    # steps 3-4 again: logged after the checkpoint
    drive(later, range(3, 9), resumed=state, artifacts=[tmp_path / "model.pt"])
    # found again by the key, though the checkpoint came before the id was known
    client, run = only_run(state["tracking_uri"])
    assert run.data.tags["ddpkit_run_key"] == state["run_key"] and run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.05" and run.data.params["train.epochs"] == "2"
    assert run.data.params["model.name"] == "null" and run.data.params["data.kwargs.hidden"] == "[64, 64]"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val_accuracy")] == [
        (4, 0.04),
        (8, 0.08),
    ]
    assert {m.step for m in client.get_metric_history(run.info.run_id, "train_loss")} == set(range(1, 9))
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["model.pt"]
    assert Path(tmp_path / "mlartifacts").is_dir()  # artifacts beside the store, not in the current directory
    third = later.state_dict()
    assert third["run_id"] == run.info.run_id  # known by now: found by id next time
    drive(MlflowSink(tmp_path, experiment="exp"), range(9, 10), resumed=third)
    assert only_run(state["tracking_uri"])[1].info.run_id == run.info.run_id


def _returns(fn, *, within: float = 60.0) -> bool:
    """Whether ``fn()`` returns at all: run on a thread, given ``within`` s (a guard against blocking forever)."""
    caller = threading.Thread(target=fn, daemon=True)
    caller.start()
    caller.join(within)
    return not caller.is_alive()


def test_mlflow_down_never_stalls_a_step_and_warns_once(tmp_path, monkeypatch, caplog):
    # A server that accepts connections and never answers: the worst case, each call would hang.
    # It stays silent until the test closes it, and the client has no timeout of its own before
    # then, so the tracker's first request is certainly unanswered while the calls below run:
    # that they return at all shows they did not wait for it, however slow the machine is.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once when the connection is reset
    try:
        sink = MlflowSink(tmp_path, experiment="exp", timeout=3.0)

        def train() -> None:
            sink.start(CONFIG, resumed=None)
            for step in range(1, 200):
                sink.write({"step": step, "train_loss": 0.5, "time": time.time()})

        assert _returns(train), "start()/write() waited for the tracker"
        assert _returns(lambda: sink.finish("FINISHED", [])), "finish() waited for the tracker past log.tracker_timeout"
        gave_up = [
            r for r in caplog.records if "mlflow did not finish sending within log.tracker_timeout=3s" in r.getMessage()
        ]
        assert len(gave_up) == 1  # finish() stopped waiting on its timeout: the server had not answered anything
    finally:
        silent.close()  # the connection waiting in its backlog is reset: the tracker's request fails now

    def switched_off() -> int:
        return sum(
            "mlflow failed and is switched off" in r.getMessage() for r in caplog.records if r.levelname == "WARNING"
        )

    deadline = time.monotonic() + 60
    while not switched_off() and time.monotonic() < deadline:
        time.sleep(0.2)  # the failure surfaces on the background thread
    time.sleep(0.5)  # room for a second warning, were the queued calls still tried
    assert switched_off() == 1  # once, although 200 calls were queued behind the failed one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on 127.0.0.1 (SQLite backend); always killed."""
    port = _free_port()
    log_file = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{tmp_path}/server.db",
            "--artifacts-destination",
            str(tmp_path / "server-artifacts"),
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
        log_file.close()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mlflow_through_a_real_tracking_server(tmp_path, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.pt").write_bytes(b"weights")
    state = drive(MlflowSink(out, experiment="exp"), range(1, 4), status="KILLED")
    drive(MlflowSink(out, experiment="exp"), range(4, 7), resumed=state, artifacts=[out / "model.pt"])
    client, run = only_run(mlflow_server)
    assert run.data.tags["ddpkit_run_key"] == state["run_key"] and run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.05"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")] == [3, 6]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["model.pt"]
    assert not (out / "mlflow.db").exists()


# --- W&B, offline ---------------------------------------------------------------------------------


def wandb_records(path: Path):
    """The records of a `.wandb` file: W&B's header, then LevelDB log framing of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a .wandb file"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768  # records never straddle a 32 KiB block header
        if room < 7:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def test_wandb_offline_run_has_config_history_status_and_resumes_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    (tmp_path / "model.pt").write_bytes(b"weights")
    state = drive(WandbSink(tmp_path, project="exp"), range(1, 4), status="KILLED")
    drive(WandbSink(tmp_path, project="exp"), range(4, 7), resumed=state, artifacts=[tmp_path / "model.pt"])
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{state['run_id']}.wandb" for f in files)  # one W&B run id
    deadline = time.monotonic() + 60  # wandb's service process may still be writing the tail of the last file
    while (
        not all(any(r.WhichOneof("record_type") == "exit" for r in wandb_records(f)) for f in files)
        and time.monotonic() < deadline
    ):
        time.sleep(0.5)
    history, config, exits, summary, artifacts = [], {}, [], {}, 0
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.project == "exp"
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
            elif kind == "exit":
                exits.append(record.exit.exit_code)
            elif kind == "summary":
                summary.update({u.key: json.loads(u.value_json) for u in record.summary.update if u.key})
            artifacts += kind == "artifact"
    assert config["optim.lr"] == 0.05 and config["data.kwargs.hidden"] == [64, 64]
    assert [(h["step"], h["val_accuracy"]) for h in history if "val_accuracy" in h] == [(3, 0.03), (6, 0.06)]
    assert [h["step"] for h in history if "train_loss" in h] == list(range(1, 7))
    assert exits == [1, 0] and summary["status"] == "FINISHED" and artifacts == 1


# --- end to end: `ddpkit run`, then a longer run that resumes it -------------------------------------


def _run(tmp_path: Path, *overrides: str, env: dict | None = None):
    import yaml
    from helpers import run_cli

    config = tmp_path / "c.yaml"
    if not config.exists():
        cfg = tiny_config(
            tmp_path, run={"name": "held", "output_dir": str(tmp_path / "run")}, checkpoint={"every_epochs": 1}
        )
        config.write_text(yaml.safe_dump(cfg))
    done = run_cli("run", str(config), "--nproc-per-node", "2", *overrides, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_and_its_longer_resumed_relaunch_are_one_mlflow_run(tmp_path, monkeypatch):
    """Each attempt is its own command and process, so the relaunch can find the MLflow run only through what the first
    left behind."""
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    (tmp_path / "store").mkdir()
    env = {"MLFLOW_TRACKING_URI": uri}
    _run(tmp_path, "log.mlflow=true", "train.epochs=2", env=env)
    second = _run(tmp_path, "log.mlflow=true", "train.epochs=4", env=env)
    assert "resuming from" in second.stderr
    client, run = only_run(uri, experiment="held")
    assert run.info.status == "FINISHED" and run.data.params["optim.lr"] == "0.1"
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [8, 16, 24, 32]  # 256 / (16 x 2) = 8 steps per epoch, both attempts
    assert {m.step for m in client.get_metric_history(run.info.run_id, "train_loss")} == {4, 8, 12, 16, 20, 24, 28, 32}
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["model.pt"]
    assert (tmp_path / "store" / "mlartifacts").is_dir()  # beside the store, not ./mlruns where the job started
    status = json.loads((tmp_path / "run" / STATUS_FILE).read_text())
    assert status["status"] == "FINISHED" and status["attempts"] == 2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_training_goes_on_when_the_tracker_is_down(tmp_path):
    """What a user sees with the tracker down: one warning on the command's stderr and a run that still finishes."""
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = _run(tmp_path, "log.mlflow=true", env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"})
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line and "mlflow" in line]
    assert len(warnings) == 1, done.stderr[-3000:]  # warned once, not per record
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 16 and any("val_accuracy" in r for r in records)
    assert (tmp_path / "run" / "model.pt").exists()


def test_a_user_sink_added_in_on_fit_start_gets_every_record(tmp_path):
    """The documented way to add your own sink, on a real (one-process) fit."""
    import ddpkit
    from ddpkit.reporting.sink_base import Sink

    seen: dict = {"records": [], "ended": None}

    class Recorder(Sink):
        name = "recorder"

        def start(self, config, *, resumed):
            seen["lr"] = config["optim"]["lr"]

        def write(self, record):
            seen["records"].append(record["step"])

        def finish(self, status, artifacts):
            seen["ended"] = (status, [p.name for p in artifacts])

    class MyTrainer(ddpkit.Trainer):
        def on_fit_start(self):
            if self.is_main:
                self.reporter.sinks.add(Recorder())

    MyTrainer(tiny_config(tmp_path, train={"epochs": 1, "log_every": 4})).fit()  # one process: 256 / 16 = 16 steps
    assert seen["lr"] == 0.1 and seen["records"] == [4, 8, 12, 16, 16] and seen["ended"] == ("FINISHED", ["model.pt"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_preempted_run_is_killed_in_mlflow_and_its_relaunch_finishes_the_same_run(tmp_path):
    """The launcher's signal forwarding: SIGTERM goes to `ddpkit run`, which must exit 75 and leave the MLflow run
    KILLED."""
    import signal
    import subprocess

    import yaml
    from helpers import REPO, run_cli

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = tiny_config(
        tmp_path,
        run={"name": "pre", "output_dir": str(tmp_path / "run")},
        train={"epochs": 1000, "log_every": 2},
        log={"mlflow": True},
    )
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MLFLOW_TRACKING_URI": uri}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "run", str(config), "--nproc-per-node", "2"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    # Preempted once the tracker is up, as a real preemption (minutes in) would find it: a job
    # killed within seconds of creating a new SQLite store can interrupt MLflow's own schema setup.
    deadline = time.time() + 240
    while (
        time.time() < deadline and not any("mlflow: experiment" in line for line in lines) and launcher.poll() is None
    ):
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=180)
    reader.join(timeout=30)
    output = "".join(lines)
    assert launcher.returncode == 75, output[-3000:]  # stopped at an agreed step, checkpoint saved
    client, run = only_run(uri, experiment="pre")
    assert run.info.status == "KILLED"
    stopped_at = max(m.step for m in client.get_metric_history(run.info.run_id, "train_loss"))
    end = (stopped_at // 8 + 3) * 8  # the relaunch goes on for a few more epochs (8 steps each), not all 1000
    relaunch = run_cli(
        "run",
        str(config),
        "--nproc-per-node",
        "2",
        f"train.max_steps={end}",
        env={"MLFLOW_TRACKING_URI": uri},
        timeout=400,
    )
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    client, again = only_run(uri, experiment="pre")
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    val_steps = {m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")}
    assert set(range(8, end + 1, 8)) <= val_steps and max(val_steps) == end  # one curve over both attempts
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "train_loss")) == end


@pytest.mark.multiprocess
@pytest.mark.slow
def test_wandb_offline_run_and_its_resumed_relaunch_are_one_wandb_run(tmp_path):
    """Each attempt is its own command and process, so the relaunch can find the W&B run id only through what the first
    left behind."""
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "held-wandb"}
    _run(tmp_path, "log.wandb=true", "train.epochs=1", env=env)
    _run(tmp_path, "log.wandb=true", "train.epochs=2", env=env)
    files = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({f.name for f in files}) == 1, files  # two attempts, one W&B run id
    val_steps, projects = [], set()
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                projects.add(record.run.project)
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                val_steps += [row["step"]] if "val_accuracy" in row else []
    assert projects == {"held-wandb"} and val_steps == [8, 16]
