"""The Trainer: a DDP training loop you subclass, driven by a YAML config.

    class MyTrainer(ddpkit.Trainer):
        def build_model(self):
            return MyNet()

        def training_step(self, batch):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

    if __name__ == "__main__":
        MyTrainer.main()   # torchrun --nproc-per-node=2 my_train.py config.yaml optim.lr=0.1

Launched by torchrun (or ``ddpkit run``) every process runs the same code; started with plain
``python`` it is a world of one on the same code path. The Trainer composes small modules, each
with one job, and calls each in one line: see the map of folders in :mod:`ddpkit`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from ddpkit import registry
from ddpkit.checkpoint.state import Progress, RunState, seed_for_setup
from ddpkit.config.loader import Config, load_config
from ddpkit.data.epochs import data_position, epoch_batches, run_length
from ddpkit.data.loaders import move_to_device, train_loader_for, val_loader_for
from ddpkit.distributed.agreement import check_same_run_on_every_rank
from ddpkit.distributed.env import DistEnv, read_dist_env
from ddpkit.distributed.process_group import Runtime, barrier, group_options, process_group
from ddpkit.distributed.sharding import shard_model, shard_optimizer
from ddpkit.faults.goodput import GoodputLedger
from ddpkit.faults.recovery import arm_recovery
from ddpkit.faults.watchdog import Watchdog
from ddpkit.launch.entrypoint import parse_worker_argv, run_trainer
from ddpkit.reporting import reporter
from ddpkit.training.compile import Models, build_models, sync_gradients, unwrap_model
from ddpkit.training.health import TrainingHealth
from ddpkit.training.metrics import evaluate
from ddpkit.training.optim import OptimizerStep, build_optimizer, build_scheduler

__all__ = ["Trainer", "Progress"]


class Trainer:
    """A DistributedDataParallel training loop. Override the ``build_*`` and ``*_step`` methods.

    ``fit()`` runs, on every rank::

        set up: process group, seed, datasets, model -> DDP, optimizer, schedule; resume once
        for epoch in range(epochs):
            train_sampler.set_epoch(epoch)
            for each micro-batch of this rank's shard:
                loss = training_step(batch)            # under no_sync() unless last micro-step
                backward(loss / grad_accum_steps)
                if last micro-step of the optimizer step:
                    clip gradients, optimizer.step(), scheduler.step(), zero_grad()
                    every log_every steps:  reduce the loss over ranks, log it
                    every eval_every steps: validate()
                    every every_steps:      checkpoint (rank 0 writes, all ranks wait)
            on_epoch_end(); validate(); checkpoint
        rank 0 writes model.pt; return the final metrics

    Inside the step methods ``self.model`` is the DDP-wrapped model (the bare model during
    validation, so ranks with fewer validation batches never wait on a collective), and
    ``self.device``, ``self.rank``, ``self.local_rank``, ``self.world_size``, ``self.is_main``
    say where this process runs.
    """

    def __init__(self, config: Config | str | os.PathLike | dict[str, Any] | None = None, *, overrides: Sequence[str] = ()):
        self.config: Config = load_config(config, overrides)  # a Config is re-validated too
        self.env: DistEnv = read_dist_env()
        self.progress = Progress()
        self.output_dir = Path(self.config.output_dir)
        self.runtime: Runtime | None = None
        self.optimizer: torch.optim.Optimizer | None = None  # these four are built by fit()
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.train_loader: DataLoader | None = None
        self.val_loader: DataLoader | None = None
        self.metrics: dict[str, float] = {}
        self.state: RunState | None = None  # built by fit(): the run's state, checkpoints, resume
        self.reporter: reporter.Reporter | None = None  # built by fit(), once resume is decided
        self._train_model: nn.Module | None = None
        self._models: Models | None = None  # train (DDP, compiled), eval, bare views of the model
        self._in_validation = self._stop_requested = False
        self._last_eval_step = -1

    # --- where this process runs -----------------------------------------------------------

    rank = property(lambda self: self.env.rank, doc="This process's global rank (0 .. world_size - 1).")
    local_rank = property(lambda self: self.env.local_rank, doc="This process's rank on its node: its GPU index.")
    world_size = property(lambda self: self.env.world_size, doc="How many processes train together.")
    is_main = property(lambda self: self.env.rank == 0, doc="True on global rank 0: the rank that writes files and shows progress.")

    @property
    def device(self) -> torch.device:
        if self.runtime is None:
            raise RuntimeError("Trainer.device is known once fit() has set up the process group")
        return self.runtime.device

    @property
    def model(self) -> nn.Module:
        """The DDP-wrapped model while training; the bare model during validation and after ``fit()``."""
        if self._train_model is None:
            raise RuntimeError("Trainer.model exists once fit() has built it")
        return self._models.eval if self._in_validation else self._train_model

    unwrapped_model = property(lambda self: unwrap_model(self.model), doc="The model without its DDP wrapper: what gets saved.")

    def request_stop(self) -> None:
        """Stop after the current optimizer step. Call it on every rank (e.g. from reduced metrics)."""
        self._stop_requested = True

    # --- what to train: override these ------------------------------------------------------

    def build_model(self) -> nn.Module:
        """The model, built from config ``model`` by default. Runs on every rank under the same seed."""
        return registry.build_model(self.config.model)

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        """``(train, val)`` datasets, from config ``data`` by default; ``val`` may be None."""
        return registry.build_datasets(self.config.data)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over ``model.parameters()`` (the bare model), from config ``optim`` by default."""
        return build_optimizer(model.parameters(), self.config.optim)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
        """A per-step LR schedule from config ``sched``; None when the rate is constant."""
        return build_scheduler(optimizer, self.config.sched, total_steps=total_steps)

    def build_train_loader(self, dataset: Dataset) -> DataLoader:
        """The training loader: ``DistributedSampler`` sharding, per-rank batch size from config."""
        return train_loader_for(dataset, self.config, env=self.env, device=self.device)

    def build_val_loader(self, dataset: Dataset) -> DataLoader:
        """The validation loader: exact, duplicate-free shards."""
        return val_loader_for(dataset, self.config, env=self.env, device=self.device)

    def training_step(self, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch (already on ``self.device``). Default: cross-entropy on ``(x, y)``."""
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """Metrics of one validation batch: 1-D tensors (one value per sample) or 0-d batch means; ddpkit
        averages them over the whole validation set exactly, whatever the world size, as ``val_<name>``."""
        x, y = batch
        logits = self.model(x)
        return {"loss": F.cross_entropy(logits, y, reduction="none"), "accuracy": (logits.argmax(dim=1) == y).float()}

    # --- hooks: no-ops to override -----------------------------------------------------------

    def on_fit_start(self) -> None: """After setup (and resume), before the first step."""
    def on_epoch_start(self, epoch: int) -> None: """Before the first batch of ``epoch``."""
    def on_step_end(self, step: int) -> None: """After optimizer step ``step`` (1-based). Runs every step: keep it cheap, no host syncs."""
    def on_log(self, metrics: dict[str, float]) -> None: """Every ``log_every`` steps, on every rank, with rank-reduced training metrics."""
    def on_validation_end(self, metrics: dict[str, float]) -> None: """After each validation, on every rank, with the exact global validation metrics."""
    def on_epoch_end(self, epoch: int) -> None: """After the last batch of ``epoch``."""
    def on_fit_end(self, metrics: dict[str, float]) -> None: """After training, with the final metrics ``fit()`` returns."""

    # --- entry points ---------------------------------------------------------------------------

    @classmethod
    def main(cls, argv: Sequence[str] | None = None) -> None:
        """``script.py [CONFIG] [key=value ...]``: ``cls(CONFIG, overrides=[...]).fit()``, with errors turned
        into clear messages, exit codes (:mod:`ddpkit.errors`) and the failing rank's traceback for torchrun."""
        run_trainer(cls, *parse_worker_argv(argv, usage=cls.__doc__ or ""))

    def fit(self) -> dict[str, float]:
        """Train as configured and return the final metrics (identical on every rank)."""
        cfg = self.config
        group = process_group(self.env, **group_options(cfg), trace_dir=self.output_dir / "logs")
        with group as runtime, Watchdog.for_run(cfg, runtime, step=lambda: self.progress.step) as self._watchdog, \
                GoodputLedger.for_run(cfg, runtime, step=lambda: self.progress.step) as self._goodput:  # hang diagnosis; goodput.jsonl
            self.runtime, status = runtime, "FAILED"
            try:
                self._setup()
                self.on_fit_start()
                while not self._finished():
                    self._train_epoch()
                metrics = self._finish()
                status, self._goodput.stopped = self.state.outcome, self.state.stopped  # a signal stop ends the attempt STOPPED
            finally:
                if self.reporter is not None:
                    self.reporter.close(status)
                if self._models is not None:
                    self._models.close()  # torch.compile's callbacks and settings are process-wide
                if self.state is not None:
                    self.state.close()  # the signal handlers it installed give way to the previous ones
            self._train_model = self._models.release()  # DDP holds the group: it goes first (after a success only)
        self.state.raise_if_stopped()  # a signal stopped the run: saved, now exit 75 (resumable)
        self.on_fit_end(metrics)
        return metrics

    # --- setup: build everything, then resume once ---------------------------------------------

    def _setup(self) -> None:
        """Build everything in an order that makes every rank identical, then resume once."""
        cfg = self.config
        reporter.start_logging(cfg, rank=self.rank)
        seed_for_setup(cfg)  # the same initial weights and data on every rank
        train_set, val_set = self.build_datasets()
        model = shard_model(self.build_model(), self.runtime, cfg.parallel, precision=cfg.train.precision)  # fsdp2: before the optimizer
        check_same_run_on_every_rank(cfg, model, train_set, val_set)  # first: any later failure would say less
        self.train_loader = self.build_train_loader(train_set)
        self.val_loader = self.build_val_loader(val_set) if val_set is not None else None
        self._steps_per_epoch, self.total_steps = run_length(self.train_loader, cfg)
        self.optimizer = shard_optimizer(self.build_optimizer(model), cfg.parallel, model=model)  # zero1: ZeRO; logs each rank's bytes
        self.scheduler = self.build_scheduler(self.optimizer, self.total_steps)
        self._step = OptimizerStep(model, self.optimizer, self.scheduler, train=cfg.train, device=self.device)
        self.state = RunState(cfg, runtime=self.runtime, progress=self.progress)
        # A checkpoint holds exactly the parts registered by name (None: nothing to save).
        self.state.register_all(model=model, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self._step.scaler, **data_position(self.train_loader))
        self._models = build_models(model, self.runtime, ddp=cfg.ddp, train=cfg.train, parallel=cfg.parallel,
                                    exclude=lambda name: self.reporter.outside_training(name))
        self._train_model = self._models.train  # DDP-wrapped, then compiled (train.compile)
        resumed = self._goodput.restore(self.state.resume)  # timed, in goodput.jsonl
        self.reporter = reporter.Reporter(cfg, runtime=self.runtime, total_steps=self.total_steps, progress=self.progress, resumed=resumed)
        self.state.register("sinks", self.reporter.sinks)  # a tracker's run id travels in the checkpoint
        self.reporter.start(steps_per_epoch=self._steps_per_epoch, step=self.progress.step)
        self._watchdog.listen_to(self.reporter)  # every span is a phase the watchdog sees
        self._step.health = self.health = TrainingHealth(cfg, runtime=self.runtime, model=model, loader=self.train_loader, progress=self.progress,
                                                         reporter=self.reporter, state=self.state)  # NaNs, spikes, stragglers, replicas
        arm_recovery(cfg, self.runtime, self.state, self.reporter, ledger=self._goodput)  # ledger spans, crash save, memory snapshots

    # --- the loop -----------------------------------------------------------------------------------

    def _finished(self) -> bool:
        epochs, progress = self.config.train.epochs, self.progress
        return self._stop_requested or self.state.stopped or progress.step >= self.total_steps or (epochs is not None and progress.epoch >= epochs)

    def _train_epoch(self) -> None:
        progress, accum, report = self.progress, self.config.train.grad_accum_steps, self.reporter
        batches, batches_per_epoch = epoch_batches(
            self.train_loader, epoch=progress.epoch, consumed=progress.batch_in_epoch, rank=self.rank, uneven=self.config.data.uneven
        )
        if progress.batch_in_epoch == 0:
            self.on_epoch_start(progress.epoch)
        self._train_model.train()
        while progress.batch_in_epoch < batches_per_epoch and not self._finished():
            with report.span("data"):
                batch = next(batches, None)
            if batch is None:  # a stream ended, at this same batch on every rank (ddpkit.data.streaming)
                batches_per_epoch = progress.batch_in_epoch
                break
            progress.batch_in_epoch += 1
            boundary = progress.batch_in_epoch % accum == 0 or progress.batch_in_epoch == batches_per_epoch
            self._micro_step(batch, sync=boundary)
            if boundary:
                with report.span("optimizer"):
                    self._step.step()
                progress.step += 1
                self._after_step()
        if progress.batch_in_epoch >= batches_per_epoch:
            progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
            self._after_epoch(progress.epoch - 1)

    def _micro_step(self, batch: Any, *, sync: bool) -> None:
        batch = move_to_device(batch, self.device)
        with sync_gradients(self._train_model, sync=sync):
            with self.reporter.span("forward"), self._step.autocast():
                loss = self.training_step(batch)
            self.reporter.add_loss(loss, owner=type(self))
            with self.reporter.span("backward"):
                self._step.backward(loss)

    def _after_step(self) -> None:
        step, train = self.progress.step, self.config.train
        self.reporter.step_done(self.progress)
        self.on_step_end(step)
        self.health.after_step(step)  # NaN steps were skipped inside the step; stragglers, replicas here
        if step % train.log_every == 0:
            self._log_training()
        if train.eval_every and step % train.eval_every == 0:
            self._evaluate()
        if self.state.due(after="step"):
            self._save_checkpoint()

    def _after_epoch(self, epoch: int) -> None:
        self.on_epoch_end(epoch)
        if self.config.train.eval_every is None:
            self._evaluate()
        if self.state.due(after="epoch"):
            self._save_checkpoint()

    def _finish(self) -> dict[str, float]:
        if self.reporter.loss_pending:
            self._log_training()
        stopped = self.state.stopped  # by a signal: save and go, within the launcher's grace period
        if not stopped and self.val_loader is not None and self._last_eval_step != self.progress.step:
            self._evaluate()
        if self.state.enabled:
            self._save_checkpoint()  # so a longer run can resume from here
        self.state.wait()
        self.reporter.write_timeline()
        if not stopped:
            self.state.save_model(self.output_dir / "model.pt")  # rank 0 writes; fsdp2 gathers the shards first
        self._barrier("end of training")
        return {**self.metrics, "step": self.progress.step, "epoch": self.progress.epoch}

    # --- logging, evaluation, checkpoints ---------------------------------------------------------------

    def _log_training(self) -> None:
        record = self.reporter.training(self.progress, lr=self.optimizer.param_groups[0]["lr"], extra=self.health.log_fields())
        self.metrics.update(train_loss=record["train_loss"])
        self.on_log(record)

    def validate(self) -> dict[str, float]:
        """Exact validation metrics over the whole validation set (call on every rank)."""
        if self.val_loader is None:
            return {}
        self._in_validation = True
        try:
            step = self._watchdog.ticking(self.validation_step)  # a long validation is progress, not a hang
            with self._models.for_evaluation():  # fsdp2: parameters gathered once, no collective per batch
                return evaluate(unwrap_model(self._train_model), self.val_loader, step, device=self.device, autocast=self._step.autocast)
        finally:
            self._in_validation = False

    def _evaluate(self) -> None:
        with self.reporter.outside_training("evaluation"):
            metrics = self.validate()
        self._last_eval_step = self.progress.step
        if not metrics:
            return
        self.metrics.update(metrics)
        self.reporter.validation(self.progress, metrics)
        self.on_validation_end(metrics)
        if self.state.after_evaluation(metrics, save_best=lambda: self._save_checkpoint(name="best")):
            self.request_stop()

    def _barrier(self, where: str) -> None:
        """Wait for every rank; in debug mode a monitored barrier names ranks that never arrive."""
        self.reporter.note("barrier: %s", where)
        barrier(debug=self.config.dist.debug, timeout=self.config.dist.timeout)

    def _save_checkpoint(self, name: str | None = None) -> None:
        """Rank 0 writes the full training state; the other ranks contribute their RNG states and wait."""
        if not self.state.saved_already(name):
            with self.reporter.outside_training("checkpoint"):
                self.state.save(barrier=self._barrier, name=name)
