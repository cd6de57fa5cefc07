"""The Trainer: a DDP training loop you subclass, driven by a YAML config (usage: the class docstring).
Every process runs the same code; plain ``python`` is a world of one on the same code path. The
Trainer composes small modules, each called in one line: see the map of folders in :mod:`ddpkit`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset

from ddpkit import data, registry, training
from ddpkit.checkpoint import Checkpointer, Stateful, save_final_model
from ddpkit.config.layout import check_layout
from ddpkit.config.loader import load_config
from ddpkit.config.schema import Config
from ddpkit.distributed import DistEnv, Runtime, check_same_run_on_every_rank, read_dist_env
from ddpkit.distributed.ddp import unwrap_model
from ddpkit.distributed.memory import log_rank_bytes
from ddpkit.launch.entrypoint import parse_worker_argv, run_trainer
from ddpkit.launch.run_parts import Built, RunParts, build_run_parts
from ddpkit.launch.worker_scope import Worker, worker_scope
from ddpkit.parallel.layout import ParallelLayout
from ddpkit.parallel.meta_build import build_on_meta
from ddpkit.parallel.parallelize import Placed, check_tensor_degree, parallelize
from ddpkit.progress import Progress
from ddpkit.reporting import Events, Reporter, start_logging

__all__ = ["Trainer"]


class Trainer:
    """A DistributedDataParallel training loop. Override the ``build_*`` and ``*_step`` methods.

    ``fit()`` runs, on every rank (each event also reaches the run's listeners, the ``on_*`` hooks last)::

        build: process group, layout, seed, datasets, model -> DDP (or pipeline stages), optimizer, schedule;
               register the state; resume once
        for epoch in range(epochs):
            train_sampler.set_epoch(epoch)
            while batches are left in this replica's shard:
                step.run(its next batches_per_step batches)   # the step object:
                    # accumulation: for each micro-batch, loss = training_step(batch) under no_sync() but the
                    #   last, backward(loss / grad_accum_steps);  a pipeline: the schedule runs M microbatches
                    #   through the stages, pipeline_loss(output, target) on the last
                    # then the update: clip gradients, optimizer.step(), scheduler.step(), zero_grad()
                every log_every steps:  reduce the loss over ranks, log it
                every eval_every steps: validate()
                checkpointer.save(step)            # when due: rank 0 writes, all ranks wait
            on_epoch_end(); validate(); checkpointer.save(step)
        rank 0 writes model.pt; return the final metrics

    Inside the step methods ``self.model`` is the DDP-wrapped model (the bare one during validation, so ranks with
    fewer batches never wait on a collective); ``self.device``, ``self.rank``, ``self.world_size``... say where.
    """

    #: Build an overridden ``build_model``'s model on the meta device too (docs/modes.md): set it when that model has
    #: ``init_weights(parts)`` and ``build_model`` neither loads nor reads weights (on meta they would be lost).
    build_on_meta: bool = False

    def __init__(self, config: Config | str | os.PathLike | dict | None = None, *, overrides: Sequence[str] = ()):
        self.env: DistEnv = read_dist_env()
        # A Config is re-validated too; rank 0 alone names the overrides a later one replaced (once a launch).
        self.config: Config = load_config(config, overrides, log_replaced=self.env.rank == 0)
        # Seeded now, not only in fit(): a module a subclass builds after super().__init__() (an EMA copy,
        # an auxiliary head) gets the same weights in every launch and on every rank (torch 2.14 seeds each
        # process at random). fit() seeds again before its own build.
        training.seed_for_setup(self.config.run.seed, deterministic=self.config.train.deterministic)
        # The layout's degrees against this launch's world size, and the model's widths, before any process group.
        check_layout(self.config.parallel, world_size=self.env.world_size)
        check_tensor_degree(self.config)
        self.progress = Progress()
        self.output_dir = Path(self.config.output_dir)
        # the loop's one ordered list of listeners; setup fills it, this Trainer last
        self.events = Events()
        self.metrics: dict[str, float] = {}
        # this and the rest: built by fit(), in _setup's order
        self.worker: Worker | None = None
        #: The parallel layout (degrees, mesh, groups): built by fit() once the process group exists.
        self.layout: ParallelLayout | None = None
        #: Where this rank's part of the model lives and how it trains (ddpkit.parallel.parallelize).
        self.placed: Placed | None = None
        self.train_loader: DataLoader | None = None
        self.val_loader: DataLoader | None = None
        self._steps_per_epoch = 0
        self.total_steps = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: LRScheduler | None = None
        # the run's parts (ddpkit.launch.run_parts)
        self._parts: RunParts | None = None
        self.reporter: Reporter | None = None
        self.checkpointer: Checkpointer | None = None
        self.health: training.TrainingHealth | None = None
        self.data_env: DistEnv = self.env
        self.data_config: Config = self.config
        self._stop_requested = False

    @property
    def rank(self) -> int:
        """This process's global rank (0 .. world_size - 1)."""
        return self.env.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node: its GPU index."""
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        """How many processes train together."""
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0: it writes files and shows progress."""
        return self.env.rank == 0

    @property
    def runtime(self) -> Runtime | None:
        """The process group's device, backend and store (None before fit() sets it up)."""
        return self.worker.runtime if self.worker is not None else None

    @property
    def device(self) -> torch.device:
        if self.worker is None:
            raise RuntimeError("Trainer.device is known once fit() has set up the process group")
        return self.worker.runtime.device

    @property
    def model(self) -> nn.Module:
        """The DDP-wrapped model while training; the bare model during validation and after ``fit()``."""
        if self.placed is None:
            raise RuntimeError("Trainer.model exists once fit() has placed it")
        models = self.placed.models
        validating = self._parts is not None and self._parts.evaluation.active
        return models.eval if validating else models.train

    @property
    def unwrapped_model(self) -> nn.Module:
        """The model without DDP and torch.compile: what is saved."""
        return unwrap_model(self.model)

    def request_stop(self) -> None:
        """Stop after the current optimizer step. Call it on every rank (e.g. from reduced metrics)."""
        self._stop_requested = True

    def build_model(self) -> nn.Module:
        """The model, built from config ``model`` by default. Runs on every rank under the same seed."""
        return registry.build_model(self.config.model)

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        """``(train, val)`` datasets, from config ``data`` by default; ``val`` may be None."""
        return registry.build_datasets(self.config.data)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over the bare model's named parameters (``optim.groups``), from config ``optim``."""
        return training.build_optimizer(model, self.config.optim)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler | None:
        """A per-step LR schedule from config ``sched``; None when the rate is constant."""
        return training.build_scheduler(optimizer, self.config.sched, total_steps=total_steps)

    def build_train_loader(self, dataset: Dataset) -> DataLoader:
        """The training loader: ``DistributedSampler`` sharding over the data-parallel replicas, per-replica batch
        size from config."""
        return data.train_loader_for(dataset, self.data_config, env=self.data_env, device=self.device)

    def build_val_loader(self, dataset: Dataset) -> DataLoader:
        """The validation loader: exact, duplicate-free shards."""
        return data.val_loader_for(dataset, self.data_config, env=self.data_env, device=self.device)

    def pipeline_stages(self, model: nn.Module, stages: int) -> list[nn.Module] | None:
        """Under ``parallel.pipeline``: the ``stages`` stage modules of ``model``, in order, each a module whose
        forward takes the previous stage's output. None (the default): ddpkit's own models cut themselves, and
        ``parallel.split_points`` cuts a model whose top-level children run in order."""
        return None

    def tensor_plan(self, model: nn.Module) -> dict[str, Any] | None:
        """Under ``parallel.tensor``: torch's ParallelStyle objects by module name (``{"fc1": ColwiseParallel()}``).
        None (the default): ddpkit's own models' plans (ddpkit.parallel.tensor_plan); another model needs one."""
        return None

    def pipeline_loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """Under a pipeline the model is never whole on one rank, so the loss runs on the last stage, per
        microbatch: cross-entropy of ``output`` against ``target``, as the default ``training_step`` computes it
        (a mean, or the sum over the tokens under ``train.loss_normalization: tokens``)."""
        return training.steps.loss_of_output(output, target, normalization=self.config.train.loss_normalization)

    def checkpoint_parts(self) -> dict[str, Stateful]:
        """Your own parts of every checkpoint, by name (an EMA model: anything with state_dict / load_state_dict)."""
        return {}

    def training_step(self, batch: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The loss of one micro-batch (already on ``self.device``): a mean, or ``(loss_sum, n_tokens)`` under
        ``train.loss_normalization: tokens``. Default: cross-entropy on ``(x, y)``, per token for ``[B, T, V]``."""
        return training.steps.training_step(self.model, batch, normalization=self.config.train.loss_normalization)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """Metrics of one validation batch: 1-D tensors (one value per sample or token) or 0-d batch means; ddpkit
        averages them over the whole validation set exactly, whatever the world size, as ``val_<name>``."""
        return training.steps.validation_step(self.model, batch)

    def on_fit_start(self) -> None:
        """After setup (and resume), before the first step."""

    def on_epoch_start(self, epoch: int) -> None:
        """Before the first batch of ``epoch``."""

    def on_step_end(self, step: int) -> None:
        """After optimizer step ``step`` (1-based), every step: no host syncs."""

    def on_log(self, metrics: dict[str, float]) -> None:
        """Every ``log_every`` steps, with rank-reduced metrics."""

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        """After each validation, with exact metrics."""

    def on_epoch_end(self, epoch: int) -> None:
        """After the last batch of ``epoch``."""

    def on_fit_end(self, metrics: dict[str, float]) -> None:
        """After training, with the metrics ``fit()`` returns."""

    @classmethod
    def main(cls, argv: Sequence[str] | None = None, *, defaults: Sequence[str] = ()) -> None:
        """``script.py [CONFIG] [key=value ...]``: ``cls(CONFIG, overrides=[*defaults, ...]).fit()``."""
        run_trainer(cls, *parse_worker_argv(argv, usage=cls.__doc__ or "", defaults=defaults))

    def fit(self) -> dict[str, float]:
        """Train as configured and return the final metrics (identical on every rank)."""
        with worker_scope(self.config, self.env, self.events, progress=self.progress) as self.worker:
            self._setup()
            self.events.fit_start()
            while not self._finished():
                self._train_epoch()
            metrics = self._finish()
            # DDP holds the group: it goes first (after a success only); model is the bare one
            self._parts.models.release()
        # a signal stopped the run: saved, now exit 75 (resumable)
        self.worker.stop.raise_if_stopped()
        self.events.fit_end(metrics)
        return metrics

    def _setup(self) -> None:
        """Build (the same on every rank), register what a checkpoint holds, resume once, attach the listeners."""
        cfg = self.config
        worker = self.worker
        start_logging(cfg, rank=self.rank)
        # the same weights everywhere
        training.seed_for_setup(cfg.run.seed, deterministic=cfg.train.deterministic)
        self.layout = ParallelLayout.build(cfg.parallel, worker.runtime, precision=cfg.train.precision)
        # What the samplers shard by and the config the data sees: under a pipeline, the data-parallel coordinate
        # (every stage of a pipeline reads the same batches) and its M microbatches as the accumulation.
        self.data_env = self.layout.data_env(self.env)
        self.data_config = self.layout.data_config(cfg)
        self._build()
        # timed, in goodput.jsonl
        resumed = worker.ledger.restore(self.checkpointer.resume)
        self.reporter.start(steps_per_epoch=self._steps_per_epoch, step=self.progress.step, resumed=resumed)
        # the listeners, in the order events reach them: this Trainer's hooks last
        self.events.add(*self._parts.listeners(self.worker, self.config, self.placed.held, owner=self))

    def _build(self) -> None:
        """Place the model, then build the run's parts from it (and register what a checkpoint holds)."""
        cfg = self.config
        train_set, val_set = self.build_datasets()
        custom = type(self).build_model is not Trainer.build_model and not self.build_on_meta
        whole = build_on_meta(self.build_model, cfg, custom=custom, splits=self.layout.splits_model)
        whole = training.apply_lora(whole, cfg.model, precision=cfg.train.precision)
        # First: any later failure would say less.
        check_same_run_on_every_rank(cfg, whole, train_set, val_set)
        # A token id the model cannot embed: its file and offset.
        data.require_vocab_of(whole, train_set, val_set)
        # A layout whose largest rank cannot hold its share: refused on every rank before any of it is made (exit 2)
        training.refuse_what_cannot_fit(whole, cfg, runtime=self.runtime)
        self.placed = self._place(whole)
        held = self.placed.held
        self.train_loader = self.build_train_loader(train_set)
        self.val_loader = self.build_val_loader(val_set) if val_set is not None else None
        pipelined = self.placed.pipeline is not None
        length = data.run_length(self.train_loader, self.data_config, short_steps=not pipelined)
        self._steps_per_epoch = length.steps_per_epoch
        self.total_steps = length.total_steps
        # zero1: ZeRO over the data-parallel replicas
        optimizer = self.build_optimizer(held)
        self.optimizer = self.layout.data_parallel.shard_optimizer(optimizer, group=self.layout.dp_group)
        log_rank_bytes(held, self.optimizer, layout=self.layout.describe())
        self.scheduler = self.build_scheduler(self.optimizer, self.total_steps)
        loaders = (self.train_loader, self.val_loader)
        built = Built(self.placed, self.optimizer, self.scheduler, *loaders, self.total_steps)
        self._parts = build_run_parts(
            self.worker,
            config=cfg,
            layout=self.layout,
            progress=self.progress,
            events=self.events,
            built=built,
            loss=self.training_step,
            owner=type(self),
            user_parts=self.checkpoint_parts(),
        )
        self.reporter = self._parts.reporter
        self.checkpointer = self._parts.checkpointer
        self.health = self._parts.health

    def _place(self, whole: nn.Module) -> Placed:
        """The tensor plan, then this rank's pipeline stages or the whole model, wrapped (ddpkit.parallel)."""
        if self.layout.pp > 1:
            training.refuse_training_step_override(type(self), Trainer)
        plan = self.tensor_plan(whole) if self.layout.tp > 1 else None
        # A single-file checkpoint's optimizer state is keyed by position in the whole model's optimizer.
        order = training.optimizer_order(whole, self.config.optim) if self.layout.pp > 1 else None
        # The schedule runs the backward itself: a non-finite loss poisons the gradients in its loss function
        hooks = dict(split=self.pipeline_stages, loss=training.watched(self.pipeline_loss))
        return parallelize(whole, self.layout, self.config, self.runtime, plan=plan, optimizer_order=order, **hooks)

    def _finished(self) -> bool:
        epochs = self.config.train.epoch_limit
        progress = self.progress
        early = self._parts.early_stopping
        stopped = self._stop_requested or self.worker.stop.stopped or (early is not None and early.triggered)
        return stopped or progress.step >= self.total_steps or (epochs is not None and progress.epoch >= epochs)

    def _train_epoch(self) -> None:
        progress = self.progress
        events = self.events
        step = self._parts.step
        batches, batches_per_epoch = data.epoch_batches(
            self.train_loader,
            epoch=progress.epoch,
            rank=self.data_env.rank,
            consumed=progress.batch_in_epoch,
            uneven=self.config.data.uneven,
        )
        if progress.batch_in_epoch == 0:
            events.epoch_start(progress.epoch)
        self._parts.models.train.train()
        while progress.batch_in_epoch < batches_per_epoch and not self._finished():
            count = min(step.batches_per_step, batches_per_epoch - progress.batch_in_epoch)
            if count < step.batches_per_step and not step.takes_short_steps:
                # A pipeline schedule needs all M microbatches: the epoch's shorter tail is left out.
                progress.batch_in_epoch = batches_per_epoch
                break
            # the step boundary: steps 1..step are complete
            events.step_start(progress.step)
            taken = data.take_batches(batches, count, progress=progress, span=self.reporter.span)
            if step.run(taken, count=count) < count:
                # a stream ended, at this same batch on every rank (ddpkit.data.streaming)
                batches_per_epoch = progress.batch_in_epoch
                break
            progress.step += 1
            self._after_step()
        if progress.batch_in_epoch >= batches_per_epoch:
            progress.epoch += 1
            progress.batch_in_epoch = 0
            self._after_epoch(progress.epoch - 1)

    def _after_step(self) -> None:
        step = self.progress.step
        train = self.config.train
        self.reporter.step_done(self.progress)
        # health's straggler and replica checks, then the user's on_step_end
        self.events.step_end(step)
        if step % train.log_every == 0:
            self._log_training()
        if train.eval_every and step % train.eval_every == 0:
            self._evaluate()
        # when due, or at the step every rank agreed to stop at on a signal
        self.checkpointer.save(step)

    def _after_epoch(self, epoch: int) -> None:
        self.events.epoch_end(epoch)
        if self.config.train.eval_every is None:
            self._evaluate()
        # checkpoint.every_epochs
        self.checkpointer.save(self.progress.step)

    def _finish(self) -> dict[str, float]:
        if self.reporter.loss_pending:
            self._log_training()
        # by a signal: save and go, within the launcher's grace period
        stopped = self.worker.stop.stopped
        if not stopped and self.val_loader is not None and self._parts.evaluation.last_step != self.progress.step:
            self._evaluate()
        # so a longer run can resume from here
        self.checkpointer.save(self.progress.step, last=True)
        self.checkpointer.wait()
        self.reporter.write_timeline()
        if not stopped:
            # model.pt and, for a split model, hf/ (each rank writing what it holds): checkpoint.model_pt's rule
            save_final_model(self.placed.held, self.output_dir, rank=self.rank, config=self.config, layout=self.layout)
        self.worker.barrier("end of training", note=self.reporter.note)
        return {**self.metrics, "step": self.progress.step, "epoch": self.progress.epoch}

    def _log_training(self) -> None:
        extra = {
            **self.health.log_fields(),
            # remote uploads: bytes, lag
            **self.checkpointer.log_fields(),
            # a mixture's tokens per source
            **data.consumed_tokens(self.train_loader, self.progress.step),
        }
        record = self.reporter.training(self.progress, lr=self.optimizer.param_groups[0]["lr"], extra=extra)
        self.metrics.update(train_loss=record["train_loss"])
        self.events.log(record)

    def validate(self) -> dict[str, float]:
        """Exact validation metrics over the whole validation set (call on every rank)."""
        return self._parts.evaluation.validate(self.validation_step)

    def _evaluate(self) -> None:
        with self.reporter.outside_training("evaluation"):
            metrics = self._parts.evaluation.validate(self.validation_step, at_step=self.progress.step)
        if metrics:
            # val_ppl added for runs on tokens
            metrics = self.reporter.validation(self.progress, metrics)
            self.metrics.update(metrics)
            # the best checkpoint, early stopping, then the user's hook
            self.events.validation_end(metrics)
