"""Experiment trackers as metric sinks: MLflow (``log.mlflow``) and Weights & Biases (``log.wandb``).

    ddpkit run configs/quickstart.yaml --nproc-per-node 2 log.mlflow=true
    mlflow ui --backend-store-uri sqlite:///runs/quickstart/mlflow.db    # then open the run

    MLFLOW_TRACKING_URI=http://mlflow.internal:5000 ddpkit run CONFIG log.mlflow=true
    WANDB_MODE=offline ddpkit run CONFIG log.wandb=true                   # `wandb sync` it later

Each tracker gets, from rank 0 only: the resolved config as flat params (``optim.lr``), every
``metrics.jsonl`` record with its step, ``model.pt`` as an artifact, and how the run ended
(FINISHED, FAILED, or KILLED when preempted). The tracker's run id is saved in each checkpoint,
so a resumed run continues the same tracker run: one run, one curve, however many restarts.

A tracker must never cost a run. Every call to its client runs on one background thread, so a
slow or unreachable server cannot stall a training step; the first error is logged once as a
warning and the tracker is switched off while training and ``metrics.jsonl`` go on. At the end
the run waits at most ``log.tracker_timeout`` seconds for what is still queued.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import queue
import secrets
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpkit.errors import DdpkitError, first_line
from ddpkit.reporting.sink_base import Sink, as_text, flatten_config

__all__ = ["MlflowSink", "WandbSink", "tracker_sinks"]

log = logging.getLogger("ddpkit.reporting.trackers")

# Record keys that are not metrics: the step is the x axis, the time becomes the timestamp.
_NOT_METRICS = ("step", "time")


def tracker_sinks(
    *, mlflow: bool, wandb: bool, output_dir: str | os.PathLike, run_name: str, timeout: float = 60.0
) -> list[Sink]:
    """The tracker sinks the ``log`` config asks for (call on rank 0 only)."""
    sinks: list[Sink] = []
    if mlflow:
        sinks.append(MlflowSink(output_dir, experiment=run_name, timeout=timeout))
    if wandb:
        sinks.append(WandbSink(output_dir, project=run_name, timeout=timeout))
    return sinks


def _require(module: str, *, extra: str, key: str) -> None:
    # Only look for it here: importing mlflow or wandb takes seconds, which the background
    # thread pays instead of the training loop.
    if importlib.util.find_spec(module) is None:
        raise DdpkitError(
            f"{key}=true needs the {module} package, which is not installed: "
            f"pip install 'ddpkit[{extra}]' (or set {key}=false)"
        )


#: _Background's last item: its thread returns
_STOP = object()


class _Background:
    """One daemon thread that runs a tracker's calls in order; the caller never waits on it.

    After the first failure every later call is dropped: a tracker that failed once (bad URI,
    server down, wrong credentials) would only fail again, slowly.
    """

    def __init__(self, name: str, *, max_pending: int = 10_000):
        self.name = name
        self.failed = False
        # Set by the sink's start(): finish() without it has nothing to end
        self.started = False
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._warned_full = False
        self._thread = threading.Thread(target=self._run, name=f"ddpkit-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.failed:
            return
        try:
            self._queue.put_nowait((fn, args))
        except queue.Full:
            # The tracker cannot keep up: drop, never block a training step
            if not self._warned_full:
                self._warned_full = True
                log.warning("%s is falling behind; dropping its updates (metrics.jsonl keeps every record)", self.name)

    def drain(self, timeout: float) -> bool:
        """Wait until everything submitted has run, at most ``timeout`` seconds; True if it has."""
        done = threading.Event()
        try:
            # A marker: set once everything before it ran
            self._queue.put((None, (done,)), timeout=timeout)
        except queue.Full:
            pass
        finished = self.failed or done.wait(timeout)
        if not finished and not self.failed:
            log.warning(
                "%s did not finish sending within log.tracker_timeout=%gs; training ends without waiting longer",
                self.name,
                timeout,
            )
        return finished

    def close(self, timeout: float) -> None:
        """Run what is queued (at most ``timeout`` seconds), then end the thread. A stuck tracker is not waited for
        longer: its daemon thread ends after the stuck call (never holding the process), and the queued calls."""
        drained = self.drain(timeout)
        try:
            self._queue.put_nowait((_STOP, ()))
        except queue.Full:
            # 10,000 calls pending behind a stuck one: the daemon thread stays, idle
            return
        if drained:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            fn, args = self._queue.get()
            if fn is _STOP:
                return
            # drain()'s marker: everything queued before it has run
            if fn is None:
                args[0].set()
                continue
            if self.failed:
                continue
            try:
                fn(*args)
            except Exception as exc:
                # A tracker client may raise anything; none of it may reach training
                self.failed = True
                log.warning(
                    "%s failed and is switched off for the rest of this run; training and metrics.jsonl go on: %s: %s",
                    self.name,
                    type(exc).__name__,
                    first_line(exc),
                )


def _metrics_of(record: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class MlflowSink(Sink):
    """Logs to MLflow with its own client (``pip install 'ddpkit[mlflow]'``).

    Where: ``MLFLOW_TRACKING_URI`` if set, else a SQLite store ``<output_dir>/mlflow.db`` (MLflow's
    default backend; its plain-file store is in maintenance mode) with artifacts beside it in
    ``<output_dir>/mlartifacts``. Experiment: ``experiment`` (the run name).
    """

    name = "mlflow"

    def __init__(self, output_dir: str | os.PathLike, *, experiment: str, timeout: float = 60.0):
        _require("mlflow", extra="mlflow", key="log.mlflow")
        # MLflow retries a failing HTTP call 7 times with backoff (minutes). Ours runs in the
        # background anyway, but a dead server should be noticed in seconds: keep the user's
        # settings, shorten only the defaults.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        self.output_dir = Path(output_dir).resolve()
        self.experiment = experiment or "ddpkit"
        self.timeout = timeout
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.output_dir / 'mlflow.db'}"
        self.run_id: str | None = None
        self._client: Any = None
        self._pending: list[Any] = []
        self._flush_queued = False
        self._lock = threading.Lock()
        # Tags the MLflow run, so a resume finds it before its id is known
        self.run_key = uuid.uuid4().hex
        self._bg = _Background("mlflow")

    def start(self, config: dict[str, Any], *, resumed: dict[str, Any] | None) -> None:
        resumed = resumed or {}
        if resumed.get("tracking_uri") == self.tracking_uri:
            self.run_id = resumed.get("run_id")
            self.run_key = resumed.get("run_key") or self.run_key
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._bg.started = True
        self._bg.submit(self._open, flatten_config(config))

    def write(self, record: dict[str, Any]) -> None:
        stamp = int(float(record.get("time", 0)) * 1000)
        metrics = [(k, v, stamp, int(record["step"])) for k, v in _metrics_of(record).items()]
        with self._lock:
            self._pending.extend(metrics)
            if self._flush_queued:
                # The queued flush will take these too: one log_batch for a backlog
                return
            self._flush_queued = True
        self._bg.submit(self._flush)

    def state_dict(self) -> dict[str, Any]:
        # MLflow assigns run ids, so a checkpoint may come before the run exists: the key we
        # tagged it with (known at once) finds it again, and no checkpoint waits for MLflow.
        return {"run_key": self.run_key, "run_id": self.run_id, "tracking_uri": self.tracking_uri}

    def finish(self, status: str, artifacts: list[Path]) -> None:
        if self._bg.started:
            for path in artifacts:
                if Path(path).is_file():
                    self._bg.submit(lambda p=str(path): self._client.log_artifact(self.run_id, p))
            self._bg.submit(lambda: self._client.set_terminated(self.run_id, status=status))
        self._bg.close(self.timeout)

    # --- on the background thread -------------------------------------------------------------

    def _open(self, params: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        # Not its INFO chatter in the run's output
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        self._client = client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment_id = self._experiment_id(client)
        run = _find_run(client, experiment_id, self.run_id, self.run_key)
        if run is None and self.run_id is not None:
            log.warning(
                "mlflow run %s (from the checkpoint) is not in %s; starting a new mlflow run",
                self.run_id,
                self.tracking_uri,
            )
        if run is None:
            tags = {_RUN_KEY_TAG: self.run_key, "ddpkit.output_dir": str(self.output_dir)}
            run = client.create_run(experiment_id, run_name=self.output_dir.name, tags=tags)
        else:
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        self._log_params(client, run, params)
        log.info("mlflow: experiment %r, run %s at %s", self.experiment, self.run_id, self.tracking_uri)

    def _experiment_id(self, client: Any) -> str:
        from mlflow.exceptions import MlflowException

        found = client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        # A SQLite store keeps artifacts beside its file (MLflow's default would be ./mlruns in
        # whatever directory the job started in); a server decides for itself.
        db = self.tracking_uri.removeprefix("sqlite:///") if self.tracking_uri.startswith("sqlite:///") else None
        location = (Path(db).resolve().parent / "mlartifacts").as_uri() if db else None
        try:
            return client.create_experiment(self.experiment, artifact_location=location)
        except MlflowException:
            # Created meanwhile by another run sharing the store
            return client.get_experiment_by_name(self.experiment).experiment_id

    def _log_params(self, client: Any, run: Any, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # MLflow params are write-once. A resume may change the run length (train.epochs): keep
        # the first value and say so, instead of failing the whole tracker.
        existing = run.data.params
        params = {k: as_text(v) for k, v in config.items()}
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:
            log.info("mlflow: params keep their first value on resume; changed now: %s", ", ".join(changed))
        new = [Param(k, v[:6000]) for k, v in params.items() if k not in existing]
        # log_batch takes at most 100 params
        for i in range(0, len(new), 100):
            client.log_batch(self.run_id, params=new[i : i + 100])

    def _flush(self) -> None:
        from mlflow.entities import Metric

        with self._lock:
            pending = self._pending
            self._pending = []
            self._flush_queued = False
        metrics = [Metric(*values) for values in pending]
        # log_batch takes at most 1000 metrics
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])


_RUN_KEY_TAG = "ddpkit_run_key"


def _find_run(client: Any, experiment_id: str, run_id: str | None, run_key: str) -> Any:
    """The run a resumed checkpoint belongs to: by id, else by the key it was tagged with."""
    from mlflow.exceptions import MlflowException

    if run_id is not None:
        try:
            run = client.get_run(run_id)
        except MlflowException:
            return None
        return run if run.info.lifecycle_stage == "active" else None
    found = client.search_runs([experiment_id], filter_string=f"tags.{_RUN_KEY_TAG} = '{run_key}'", max_results=1)
    return found[0] if found else None


class WandbSink(Sink):
    """Logs to Weights & Biases with its own client (``pip install 'ddpkit[wandb]'``).

    Project: ``WANDB_PROJECT`` or ``project`` (the run name); files under ``<output_dir>/wandb``.
    ``WANDB_MODE=offline`` needs no network or account: ``wandb sync <output_dir>/wandb/offline-run-*``
    uploads it later. Metrics are plotted against ddpkit's ``step``, so the points a resumed run
    logs again after its last checkpoint are kept rather than dropped as out of order.
    """

    name = "wandb"

    def __init__(self, output_dir: str | os.PathLike, *, project: str, timeout: float = 60.0):
        _require("wandb", extra="wandb", key="log.wandb")
        self.output_dir = Path(output_dir).resolve()
        self.project = os.environ.get("WANDB_PROJECT") or project or "ddpkit"
        self.timeout = timeout
        self.run_id: str | None = None
        self._run: Any = None
        self._bg = _Background("wandb")

    def start(self, config: dict[str, Any], *, resumed: dict[str, Any] | None) -> None:
        # Our own id (W&B's form: 8 lowercase characters), known at once for the next checkpoint.
        self.run_id = (resumed or {}).get("run_id") or secrets.token_hex(4)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._bg.started = True
        self._bg.submit(self._open, flatten_config(config))

    def write(self, record: dict[str, Any]) -> None:
        self._bg.submit(self._log, {**_metrics_of(record), "step": int(record["step"])})

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id} if self.run_id else {}

    def finish(self, status: str, artifacts: list[Path]) -> None:
        if self._bg.started:
            self._bg.submit(self._close, status, [str(p) for p in artifacts if Path(p).is_file()])
        self._bg.close(self.timeout)

    # --- on the background thread -------------------------------------------------------------

    def _open(self, params: dict[str, Any]) -> None:
        import wandb

        # console="off": wandb would otherwise wrap sys.stderr, under the progress bar.
        settings = wandb.Settings(console="off", init_timeout=max(self.timeout, 1.0), silent=True)
        self._run = wandb.init(
            project=self.project,
            id=self.run_id,
            resume="allow",
            name=self.output_dir.name,
            dir=str(self.output_dir),
            config=params,
            settings=settings,
            reinit="create_new",
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        log.info("wandb: project %r, run %s (%s)", self.project, self.run_id, self._run.settings.mode)

    def _log(self, values: dict[str, float]) -> None:
        self._run.log(values)

    def _close(self, status: str, artifacts: list[str]) -> None:
        import wandb

        for path in artifacts:
            artifact = wandb.Artifact(f"{self.run_id}-{Path(path).stem}", type="model")
            artifact.add_file(path)
            self._run.log_artifact(artifact)
        self._run.summary["status"] = status
        if status == "KILLED":
            # W&B shows it as preempted, to be resumed
            self._run.mark_preempting()
        self._run.finish(exit_code=0 if status == "FINISHED" else 1)
