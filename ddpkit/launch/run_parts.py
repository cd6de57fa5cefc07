"""The parts a worker's training loop works with, built in their one order for the Trainer.

    built = Built(placed, optimizer, scheduler, train_loader, val_loader, total_steps)
    parts = build_run_parts(worker, layout=layout, built=built, loss=trainer.training_step,
                            user_parts=trainer.checkpoint_parts(), ...)
    parts.reporter, parts.checkpointer, parts.health      # what the loop reports to, saves with, checks with
    parts.update, parts.models, parts.step, parts.evaluation
    parts.best, parts.early_stopping                      # the best checkpoint, and early stopping

The order is the dependencies' order, each part built from those before it:

1. the token count (``train.loss_normalization: tokens``), which the throughput (tokens/s, MFU) reads;
2. the reporter: spans, losses, the records;
3. the checkpointer: it leaves its saves' time out of samples/s through the reporter;
4. health (NaNs, spikes, stragglers, replicas): it rolls back through the checkpointer;
5. the update (clip, step, schedule, zero), which asks health whether to apply a step;
6. the compile watch over the placed model's views (:func:`ddpkit.parallel.parallelize.parallelize` wrapped and
   compiled them): each compilation is timed outside training by the reporter;
7. the step object the loop asks for each optimizer step (accumulation, or the pipeline's schedule);
8. validation, on the bare model, ticking the watchdog through a long run;
9. the best checkpoint and early stopping (both read validation's metrics), then every part a checkpoint holds,
   registered by name in one call, the user's own last.

The Trainer keeps the rest: the resume, the listeners' order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit import training
from ddpkit.checkpoint import BestCheckpoint, Checkpointer, Stateful
from ddpkit.config.schema import Config
from ddpkit.data import data_position
from ddpkit.data.position import SamplePosition, Split
from ddpkit.distributed.process_group import Runtime
from ddpkit.launch.worker_scope import Worker
from ddpkit.parallel.layout import ParallelLayout
from ddpkit.parallel.model_views import Models
from ddpkit.parallel.parallelize import Placed
from ddpkit.parallel.pipeline import Pipeline
from ddpkit.progress import Progress
from ddpkit.reporting import Events, Profiler, Reporter, TokenThroughput
from ddpkit.training.allocator import apply_host_memory

__all__ = ["Built", "RunParts", "build_run_parts"]


@dataclass(frozen=True)
class Built:
    """What the Trainer's build produced: the placed model, the optimizer and schedule, the loaders, the run's
    length."""

    placed: Placed
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: DataLoader
    val_loader: DataLoader | None
    total_steps: int

    @property
    def model(self) -> nn.Module:
        """The bare model this rank holds (under a pipeline, its parts under the whole model's names)."""
        return self.placed.held

    @property
    def pipeline(self) -> Pipeline | None:
        return self.placed.pipeline


@dataclass(frozen=True)
class RunParts:
    """The collaborators of the loop, in the order they were built."""

    reporter: Reporter
    checkpointer: Checkpointer
    health: training.TrainingHealth
    update: training.OptimizerStep
    models: Models
    step: training.TrainStep
    evaluation: training.Evaluation
    best: BestCheckpoint | None
    early_stopping: training.EarlyStopping | None

    def listeners(self, worker: Worker, config: Config, model: nn.Module, *, owner: Any) -> list[Any]:
        """The run's listeners, in the order events reach them: ``owner`` (the Trainer, its ``on_*`` hooks) last."""
        rank = worker.runtime.env.rank
        # train.sample
        samples = training.TrainingSamples.for_run(
            config, rank=rank, model=model, outside=self.reporter.outside_training
        )
        return [
            Profiler.for_run(config, rank=rank, device=worker.runtime.device),
            worker.watchdog,
            worker.ledger,
            *self.checkpointer.protections(ledger=worker.ledger),
            self.health.straggler,
            self.health,
            self.early_stopping,
            self.best,
            samples,
            owner,
        ]


def build_run_parts(
    worker: Worker,
    *,
    config: Config,
    layout: ParallelLayout,
    progress: Progress,
    events: Events,
    built: Built,
    loss: Callable[[Any], Any],
    owner: type,
    user_parts: Mapping[str, Stateful] | None = None,
) -> RunParts:
    """Every part of the loop for ``built.model`` (the bare model, or a pipeline's parts), in the module's order.

    ``user_parts``: the Trainer subclass's own parts of every checkpoint (``Trainer.checkpoint_parts``)."""
    model = built.model
    runtime = worker.runtime
    device = runtime.device
    tokens = training.TokenCount.for_run(
        model, config.train, device=device, world_size=layout.dp, group=layout.dp_group
    )
    reporter = _reporter(built, tokens, layout, config=config, runtime=runtime, progress=progress, events=events)
    checkpointer = Checkpointer(
        config, runtime=runtime, layout=layout, progress=progress, stop=worker.stop, pauses=reporter
    )
    health = training.TrainingHealth(
        config,
        runtime=runtime,
        model=model,
        loader=built.train_loader,
        progress=progress,
        checkpoints=checkpointer,
        layout=layout,
    )
    update = _update(model, built, config=config, layout=layout, tokens=tokens, health=health, device=device)
    models = built.placed.models
    apply_host_memory(config.train.keep_host_memory, splits_model=layout.splits_model)
    if models.watch is not None:
        models.watch.exclude_with(reporter.outside_training)
    reporting = training.StepReporting(reporter, events, progress)
    # Their on_exit runs however fit() ends.
    events.add(models, reporter, checkpointer.mirror)
    step = _step(
        update, models, built, config=config, layout=layout, reporting=reporting, loss=loss, owner=owner, device=device
    )
    ticking = worker.watchdog.ticking
    evaluation = training.Evaluation(
        models, built.val_loader, device=device, autocast=update.autocast, ticking=ticking, pipeline=built.pipeline
    )
    best = BestCheckpoint.for_run(config, checkpointer=checkpointer, progress=progress)
    early_stopping = training.EarlyStopping.for_run(config, progress=progress)
    parts = RunParts(reporter, checkpointer, health, update, models, step, evaluation, best, early_stopping)
    # The checkpoint keeps the epoch's position in global samples: another split of the same global batch resumes it.
    position = SamplePosition(progress, Split.of_config(config, world_size=runtime.env.world_size))
    _register(
        parts, built, position=position, rank=runtime.env.rank, world_size=runtime.env.world_size, user=user_parts
    )
    return parts


def _step(
    update: training.OptimizerStep,
    models: Models,
    built: Built,
    *,
    config: Config,
    layout: ParallelLayout,
    reporting: training.StepReporting,
    loss: Callable[[Any], Any],
    owner: type,
    device: torch.device,
) -> training.TrainStep:
    """The step object: the pipeline's schedule, or accumulation over the training view."""
    return training.build_train_step(
        update,
        models.train,
        built.pipeline,
        loss=loss,
        owner=owner,
        reporting=reporting,
        device=device,
        accum=config.train.grad_accum_steps,
        vocab_parallel=built.placed.vocab_parallel,
        data_parallel=layout.data_parallel,
    )


def _register(
    parts: RunParts, built: Built, *, position: SamplePosition, rank: int, world_size: int, user: Any
) -> None:
    """Every part a checkpoint holds, by name, in one call: ddpkit's own, then the user's."""
    builtin = dict(
        model=built.model,
        optimizer=built.optimizer,
        scheduler=built.scheduler,
        scaler=parts.update.scaler,
        progress=position,
        rng=training.RngStreams(rank=rank, world_size=world_size, stage=built.pipeline.stage if built.pipeline else 0),
        best=parts.best,
        early_stopping=parts.early_stopping,
        health=parts.health,
        sinks=parts.reporter.sinks,
        **data_position(built.train_loader),
    )
    parts.checkpointer.register(builtin=builtin, user=user, optimizer_order=built.placed.optimizer_order)


def _reporter(
    built: Built,
    tokens: Any,
    layout: ParallelLayout,
    *,
    config: Config,
    runtime: Runtime,
    progress: Progress,
    events: Events,
) -> Reporter:
    """The reporter, with the throughput (tokens/s, MFU) read from the token count."""
    dataset = built.train_loader.dataset
    throughput = TokenThroughput.for_run(config, runtime, model=built.model, dataset=dataset, counter=tokens)
    return Reporter(
        config,
        runtime=runtime,
        total_steps=built.total_steps,
        progress=progress,
        events=events,
        throughput=throughput,
        replicas=layout.dp,
        accumulation=layout.data_config(config).train.grad_accum_steps,
    )


def _update(
    model: nn.Module,
    built: Built,
    *,
    config: Config,
    layout: ParallelLayout,
    tokens: training.TokenCount | None,
    health: training.TrainingHealth,
    device: torch.device,
) -> training.OptimizerStep:
    """The update; under a pipeline its norm is summed over the stages (the tied matrix counted once)."""
    pipeline = built.pipeline
    return training.OptimizerStep(
        model,
        built.optimizer,
        built.scheduler,
        train=config.train,
        tokens=tokens,
        device=device,
        world_size=layout.dp,
        health=health,
        stages=layout.pp_group if pipeline is not None else None,
        counted=pipeline.norm_parameters if pipeline is not None else None,
    )
