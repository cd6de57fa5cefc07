"""The parts a worker's training loop works with, built in their one order for the Trainer.

    built = Built(model, optimizer, scheduler, train_loader, val_loader, total_steps, pipeline)
    parts = build_run_parts(worker, layout=layout, built=built, loss=trainer.training_step, ...)
    parts.reporter, parts.checkpointer, parts.health      # what the loop reports to, saves with, checks with
    parts.update, parts.models, parts.step, parts.evaluation

The order is the dependencies' order, each part built from those before it:

1. the token count (``train.loss_normalization: tokens``), which the throughput (tokens/s, MFU) reads;
2. the reporter: spans, losses, the records;
3. the checkpointer: it leaves its saves' time out of samples/s through the reporter;
4. health (NaNs, spikes, stragglers, replicas): it rolls back through the checkpointer;
5. the update (clip, step, schedule, zero), which asks health whether to apply a step;
6. the model views: DDP, then compiled (a pipeline's stages are wrapped already); each compilation is timed
   outside training by the reporter;
7. the step object the loop asks for each optimizer step (accumulation, or the pipeline's schedule);
8. validation, on the bare model, ticking the watchdog through a long run.

The Trainer keeps the rest: what a checkpoint holds (one ``register`` call), the resume, the listeners' order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit import training
from ddpkit.checkpoint import Checkpointer
from ddpkit.config.schema import Config
from ddpkit.distributed.layout import ParallelLayout
from ddpkit.distributed.process_group import Runtime
from ddpkit.launch.worker_scope import Worker
from ddpkit.progress import Progress
from ddpkit.reporting import Events, Reporter, TokenThroughput

__all__ = ["Built", "RunParts", "build_run_parts"]


@dataclass(frozen=True)
class Built:
    """What the Trainer's build produced: the bare model (a pipeline's parts), the optimizer and schedule, the
    loaders, the run's length, and the pipeline."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: DataLoader
    val_loader: DataLoader | None
    total_steps: int
    pipeline: training.Pipeline | None = None


@dataclass(frozen=True)
class RunParts:
    """The collaborators of the loop, in the order they were built."""

    reporter: Reporter
    checkpointer: Checkpointer
    health: training.TrainingHealth
    update: training.OptimizerStep
    models: training.Models
    step: training.TrainStep
    evaluation: training.Evaluation


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
) -> RunParts:
    """Every part of the loop for ``built.model`` (the bare model, or a pipeline's parts), in the module's order."""
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
    models = training.build_models(
        model,
        runtime,
        ddp=config.ddp,
        train=config.train,
        parallel=config.parallel,
        exclude=reporter.outside_training,
        pipelined=built.pipeline is not None,
    )
    # Their on_exit runs however fit() ends.
    events.add(models, reporter, checkpointer.mirror)
    step = training.build_train_step(
        update,
        models.train,
        built.pipeline,
        loss=loss,
        owner=owner,
        reporting=training.StepReporting(reporter, events, progress),
        device=device,
        accum=config.train.grad_accum_steps,
        vocab_parallel=config.parallel.vocab_parallel,
    )
    ticking = worker.watchdog.ticking
    evaluation = training.Evaluation(
        models, built.val_loader, device=device, autocast=update.autocast, ticking=ticking, pipeline=built.pipeline
    )
    return RunParts(reporter, checkpointer, health, update, models, step, evaluation)


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
