"""Metrics and logs: metrics.jsonl, TensorBoard, rank-aware log lines, early stopping, best checkpoint.

Two real 2-rank Gloo runs (``ddpkit.testing.run_on_ranks``) carry most checks; the rest need no
process group, or one process.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_in_pool, tiny_config

import ddpkit
from ddpkit.errors import ConfigError, DdpkitError
from ddpkit.reporting.log import MetricSinks, setup_logging
from ddpkit.reporting.sinks import SinkGroup, TensorBoardSink

# tensorboard is the optional `ddpkit[tensorboard]` extra.
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
TRAIN_KEYS = {"step", "epoch", "train_loss", "lr", "samples_per_s", "time"} | {  # and ddpkit.training.health's
    "grad_norm",
    "skipped_steps",
    "nonfinite_steps",
    "scaler_skips",
    "spikes",
    "rollbacks",
    "divergences",
    "straggler_rank",
    "straggler_slowdown",
}
EVAL_KEYS = {"step", "epoch", "val_loss", "val_accuracy", "time"}


class ProbeTrainer(ddpkit.Trainer):
    """Checks, every time a record is logged, that it is already on disk as the file's last line."""

    flushed: list[bool]

    def on_fit_start(self) -> None:
        self.flushed = []

    def on_log(self, metrics: dict[str, float]) -> None:
        if self.is_main:
            last_line = (self.output_dir / "metrics.jsonl").read_text().splitlines()[-1]
            self.flushed.append(json.loads(last_line) == metrics)


def fit_capturing_stderr(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs on each rank: fit, and return what this rank printed to stderr."""
    captured = io.StringIO()
    sys.stderr = captured  # the console log handler is created inside fit(), on this stream
    try:
        trainer = ProbeTrainer(cfg)
        trainer.fit()
    finally:
        sys.stderr = sys.__stderr__
    return {"stderr": captured.getvalue(), "flushed": trainer.flushed, "step": trainer.progress.step}


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """2 ranks with TensorBoard, per-rank log files and a best-checkpoint keeper."""
    tmp = tmp_path_factory.mktemp("logged")
    cfg = tiny_config(
        tmp,
        train={"epochs": 2, "log_every": 3, "eval_every": 4},
        log={"progress_bar": False, "tensorboard": HAS_TENSORBOARD, "rank_files": True},
        checkpoint={"every_epochs": None, "best": {"metric": "val_accuracy", "mode": "max"}},
    )
    results = run_in_pool(fit_capturing_stderr, world_size=2, args=(cfg,), timeout=120)
    return Path(cfg["run"]["output_dir"]), results


@pytest.mark.multiprocess
def test_metrics_jsonl_has_the_documented_keys_once_per_step(logged_run):
    run_dir, _ = logged_run
    records = read_records(run_dir)
    train = [r for r in records if "train_loss" in r]
    evals = [r for r in records if "val_loss" in r]

    # 256 samples / (16 per rank x 2 ranks) = 8 steps per epoch, 16 in all; logged every 3 and at the end.
    assert [r["step"] for r in train] == [3, 6, 9, 12, 15, 16]  # one writer: no step twice
    assert [r["step"] for r in evals] == [4, 8, 12, 16]
    assert all(set(r) == TRAIN_KEYS for r in train)
    assert all(set(r) == EVAL_KEYS for r in evals)
    assert len(train) + len(evals) == len(records)
    assert all(r["samples_per_s"] > 0 and r["lr"] == 0.1 for r in train)


@pytest.mark.multiprocess
def test_metrics_jsonl_is_flushed_as_each_record_is_logged(logged_run):
    _, results = logged_run
    assert results[0]["flushed"] == [True] * 6  # rank 0 saw every record on disk when it was logged
    assert results[1]["flushed"] == []


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="pip install 'ddpkit[tensorboard]'")
@pytest.mark.multiprocess
def test_tensorboard_event_file_written_once_with_the_scalars(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = logged_run
    event_files = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1  # rank 0 only
    events = EventAccumulator(str(event_files[0]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train_loss", "lr", "samples_per_s", "val_loss", "val_accuracy"} <= tags
    assert "time" not in tags  # TensorBoard has its own wall time per event
    assert [e.step for e in events.Scalars("val_loss")] == [4, 8, 12, 16]


@pytest.mark.multiprocess
def test_console_shows_info_from_rank_zero_only_and_rank_files_keep_everything(logged_run):
    run_dir, results = logged_run
    rank0, rank1 = results[0]["stderr"], results[1]["stderr"]
    assert "[rank0]" in rank0 and " INFO step 3 epoch 0 loss" in rank0
    assert " INFO " not in rank1  # rank 1's console is at WARNING

    files = {p.name: p.read_text() for p in (run_dir / "logs").iterdir()}
    assert set(files) == {"rank0.log", "rank1.log"}
    assert "[rank0]" in files["rank0.log"] and " INFO step 3 epoch 0 loss" in files["rank0.log"]
    assert "[rank1]" in files["rank1.log"] and " INFO step 3 epoch 0 loss" in files["rank1.log"]


@pytest.mark.multiprocess
def test_best_checkpoint_holds_the_best_evaluation(logged_run):
    run_dir, _ = logged_run
    evals = [r for r in read_records(run_dir) if "val_accuracy" in r]
    best = max(evals, key=lambda r: r["val_accuracy"])  # the first of equal maxima: later ties don't improve
    state = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert state["progress"]["step"] == best["step"]
    assert state["best"]["best"] == pytest.approx(best["val_accuracy"])


def test_best_checkpoint_is_kept_alongside_step_checkpoints(tmp_path):
    cfg = tiny_config(
        tmp_path,
        train={"epochs": 1, "log_every": 4, "eval_every": 4},
        checkpoint={"every_steps": 2, "keep_last": 1, "best": {"metric": "val_loss"}},
    )
    ddpkit.Trainer(cfg).fit()
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.pt"))
    assert names == ["best.pt", "step-000000016.pt"]  # keep_last prunes step files, never best.pt


@pytest.mark.multiprocess
def test_early_stopping_stops_every_rank_at_the_same_step(tmp_path):
    # min_delta larger than any loss change: only the first evaluation counts as an improvement,
    # so with patience 2 the run stops at the third evaluation (step 6 of 16).
    cfg = tiny_config(
        tmp_path,
        train={
            "epochs": 2,
            "log_every": 2,
            "eval_every": 2,
            "early_stopping": {"metric": "val_loss", "patience": 2, "min_delta": 100.0},
        },
        log={"progress_bar": False, "all_ranks": True},
    )
    results = run_in_pool(fit_capturing_stderr, world_size=2, args=(cfg,), timeout=120)

    assert [r["step"] for r in results] == [6, 6]
    assert "early stopping: val_loss has not improved for 2 evaluations" in results[0]["stderr"]
    assert "[rank1]" in results[1]["stderr"] and " INFO " in results[1]["stderr"]  # log.all_ranks
    steps = [r["step"] for r in read_records(tmp_path / "run")]
    assert max(steps) == 6
    assert (tmp_path / "run" / "model.pt").exists()


def test_early_stopping_target_stops_at_the_first_evaluation_that_reaches_it(tmp_path):
    train = {"epochs": 2, "log_every": 2, "eval_every": 2}
    ddpkit.Trainer(tiny_config(tmp_path / "free", train=train)).fit()
    curve = [(r["step"], r["val_accuracy"]) for r in read_records(tmp_path / "free" / "run") if "val_accuracy" in r]
    # The target: the first evaluation after the first that beats every earlier one.
    index = next(i for i in range(1, len(curve)) if curve[i][1] > max(a for _, a in curve[:i]))
    step, target = curve[index]

    early = {"metric": "val_accuracy", "mode": "max", "target": target, "patience": 100}
    result = fit_capturing_stderr(tiny_config(tmp_path / "target", train={**train, "early_stopping": early}))

    assert result["step"] == step  # at the evaluation that reached it, not before (earlier ones were below)
    stopped = [(r["step"], r["val_accuracy"]) for r in read_records(tmp_path / "target" / "run") if "val_accuracy" in r]
    assert stopped == curve[: index + 1]
    assert (
        f"early stopping: val_accuracy {target:.4f} >= train.early_stopping.target={target:g} "
        f"(mode max) at step {step}" in result["stderr"]
    )
    assert (tmp_path / "target" / "run" / "model.pt").exists()


def test_early_stopping_target_needs_a_metric(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.early_stopping\.target: 0\.9 needs train\.early_stopping\.metric"):
        ddpkit.load_config(tiny_config(tmp_path, train={"early_stopping": {"target": 0.9}}))


def test_log_levels_per_rank_without_a_process_group(tmp_path, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # no program logging (and not pytest's capture)
    try:
        assert setup_logging(0).level == logging.INFO
        assert setup_logging(1).level == logging.WARNING
        assert setup_logging(1, all_ranks=True).level == logging.INFO
        logger = setup_logging(3, log_dir=tmp_path)
        logger.info("hello from three")
        for handler in logger.handlers:
            handler.flush()
        assert "[rank3]" in (tmp_path / "rank3.log").read_text()
        console = [h for h in logger.handlers if not isinstance(h, logging.FileHandler)]
        assert [h.level for h in console] == [logging.WARNING] and not logger.propagate
    finally:
        _pristine()


def _pristine() -> None:
    """The ``ddpkit`` logger as an import leaves it (handlers closed, propagating), for the tests after these."""
    logger = logging.getLogger("ddpkit")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.propagate, logger.level = True, logging.NOTSET


def test_a_programs_own_logging_gets_every_line_once_in_its_format(tmp_path, monkeypatch, capsys):
    stream = io.StringIO()
    program = logging.StreamHandler(stream)
    program.setFormatter(logging.Formatter("PROGRAM %(name)s %(levelname)s %(message)s"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [program])  # as logging.basicConfig(...) leaves it
    try:
        logger = setup_logging(1, log_dir=tmp_path)  # rank 1: WARNING to the program, INFO to its file
        logger.info("an info line")
        logging.getLogger("ddpkit.reporting.sinks").warning("a child's warning")
        for handler in logger.handlers:
            handler.flush()
        assert stream.getvalue().splitlines() == ["PROGRAM ddpkit.reporting.sinks WARNING a child's warning"]
        assert capsys.readouterr().err == ""  # no ddpkit console line beside the program's
        file_lines = (tmp_path / "rank1.log").read_text().splitlines()
        assert [line.split(" ", 3)[3] for line in file_lines] == ["an info line", "a child's warning"]
        stream.truncate(0), stream.seek(0)
        setup_logging(0).info("rank zero")
        assert stream.getvalue() == "PROGRAM ddpkit INFO rank zero\n"
    finally:
        _pristine()


def test_without_program_logging_the_console_format_is_todays(monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    setup_logging(0).info("plain")
    _pristine()
    err = capsys.readouterr().err
    assert err.startswith("[rank0] ") and err.endswith(" INFO plain\n")


def test_sinks_write_nothing_on_other_ranks(tmp_path):
    sinks = MetricSinks(tmp_path, enabled=False)
    sinks.write({"step": 1, "train_loss": 1.0})
    sinks.close()
    assert list(tmp_path.iterdir()) == []


def test_sinks_turn_non_finite_values_into_null(tmp_path):
    sinks = MetricSinks(tmp_path, enabled=True)
    sinks.write({"step": 1, "train_loss": float("nan"), "lr": float("inf")})
    sinks.close()
    assert read_records(tmp_path) == [{"step": 1, "train_loss": None, "lr": None}]


def test_missing_tensorboard_is_a_clear_error(tmp_path, monkeypatch):
    # A None entry in sys.modules makes the import raise ImportError, as when the package is absent.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(
        DdpkitError,
        match=r"log.tensorboard=true needs the tensorboard package.*"
        r"pip install 'ddpkit\[tensorboard\]'",
    ):
        TensorBoardSink(tmp_path / "tensorboard")
    assert not (tmp_path / "tensorboard").exists()

    cfg = tiny_config(tmp_path, log={"progress_bar": False, "tensorboard": True})
    with pytest.raises(DdpkitError, match="ddpkit\\[tensorboard\\]"):
        ddpkit.Trainer(cfg).fit()


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="pip install 'ddpkit[tensorboard]'")
def test_a_failing_tensorboard_writer_is_switched_off_with_a_warning_and_metrics_go_on(tmp_path, caplog):
    sink = TensorBoardSink(tmp_path / "tensorboard")
    group = SinkGroup([sink])
    group.start({})
    sink._writer.add_scalar = lambda *a, **k: (_ for _ in ()).throw(OSError("No space left on device"))
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        group.write({"step": 1, "train_loss": 0.5})
        group.write({"step": 2, "train_loss": 0.4})
    assert group.sinks == [] and not sink.required
    warnings = [r.getMessage() for r in caplog.records if "tensorboard" in r.getMessage()]
    assert len(warnings) == 1 and "switched off" in warnings[0] and "No space left" in warnings[0]
