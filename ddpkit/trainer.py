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
``python`` it is a world of one on the same code path.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from ddpkit import checkpoint as ckpt
from ddpkit._version import __version__
from ddpkit.config import Config
from ddpkit.config_loader import config_hash, config_to_dict, dump_config, flatten, load_config
from ddpkit.consistency import check_ranks_agree
from ddpkit.data import batch_size_of, build_eval_loader, build_train_loader, move_to_device, start_epoch
from ddpkit.ddp import parameter_shapes, sync_gradients, unwrap_model, wrap_model
from ddpkit.distributed import Runtime, all_gather_object, barrier, broadcast_object, process_group
from ddpkit.entrypoint import run_entrypoint
from ddpkit.env import DistEnv, read_dist_env
from ddpkit.errors import CheckpointError, ConfigError, DataError, DdpkitError
from ddpkit.log import MetricSinks, ProgressBar, StepLog, log, setup_logging
from ddpkit.metrics import BestTracker, ExactMeans, RunningMean
from ddpkit.optim import build_optimizer, build_scheduler
from ddpkit.precision import autocast, check_precision, grad_scaler
from ddpkit.registry import DATASETS, MODELS
from ddpkit.resume import config_differences
from ddpkit.rng import capture_rng, restore_rng, seed_everything
from ddpkit.timeline import Timeline

__all__ = ["Trainer", "Progress"]


@dataclass
class Progress:
    """Where training is: optimizer steps taken, current epoch, micro-batches consumed in it."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


class Trainer:
    """A DistributedDataParallel training loop. Override the ``build_*`` and ``*_step`` methods.

    ``fit()`` runs, on every rank::

        set up: process group, seed, datasets, model -> DDP, optimizer, schedule, resume
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
        self.runtime: Runtime | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.train_loader: DataLoader | None = None
        self.val_loader: DataLoader | None = None
        self.output_dir = Path(self.config.output_dir)
        self._train_model: nn.Module | None = None
        self._in_validation = False
        self._stop_requested = False

    # --- where this process runs -----------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the rank that writes files and shows progress."""
        return self.env.rank == 0

    @property
    def device(self) -> torch.device:
        if self.runtime is None:
            raise RuntimeError("Trainer.device is known once fit() has set up the process group")
        return self.runtime.device

    @property
    def model(self) -> nn.Module:
        """The DDP-wrapped model while training; the bare model during validation."""
        if self._train_model is None:
            raise RuntimeError("Trainer.model exists once fit() has built it")
        return unwrap_model(self._train_model) if self._in_validation else self._train_model

    @property
    def unwrapped_model(self) -> nn.Module:
        """The model without its DDP wrapper: what gets saved."""
        return unwrap_model(self.model)

    def request_stop(self) -> None:
        """Stop after the current optimizer step. Call it on every rank (e.g. from reduced metrics)."""
        self._stop_requested = True

    # --- what to train: override these ------------------------------------------------------

    def build_model(self) -> nn.Module:
        """The model, built from config ``model`` by default. Runs on every rank under the same seed."""
        cfg = self.config.model
        if not cfg.name:
            raise ConfigError("model.name: not set; name a model (e.g. model.name=mnist_cnn) or override build_model()")
        return MODELS.build(cfg.name, key="model.name", kwargs=cfg.kwargs)

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        """``(train, val)`` datasets, from config ``data`` by default; ``val`` may be None."""
        cfg = self.config.data
        if not cfg.name:
            raise ConfigError("data.name: not set; name a dataset (e.g. data.name=digits) or override build_datasets()")
        datasets = DATASETS.build(cfg.name, key="data.name", kwargs=cfg.kwargs)
        if not (isinstance(datasets, tuple) and len(datasets) == 2):
            raise ConfigError(f"data.name: dataset builder {cfg.name!r} must return (train, val), got {type(datasets).__name__}")
        return datasets

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over ``model.parameters()``, from config ``optim`` by default."""
        return build_optimizer(model.parameters(), self.config.optim)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
        """A per-step LR schedule from config ``sched``; None when the rate is constant."""
        cfg = self.config.sched
        if cfg.name == "constant" and cfg.warmup_steps == 0:
            return None  # nothing to do each step: skip the scheduler's per-step cost
        return build_scheduler(optimizer, cfg, total_steps=total_steps)

    def training_step(self, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch (already on ``self.device``). Default: cross-entropy on ``(x, y)``."""
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        """Metrics of one validation batch: 1-D tensors (one value per sample) or 0-d batch means.

        ddpkit averages them over the whole validation set exactly, whatever the world size, and
        reports them prefixed with ``val_``.
        """
        x, y = batch
        logits = self.model(x)
        return {"loss": F.cross_entropy(logits, y, reduction="none"), "accuracy": (logits.argmax(dim=1) == y).float()}

    # --- hooks: no-ops to override -----------------------------------------------------------

    def on_fit_start(self) -> None:
        """After setup (and resume), before the first step."""

    def on_epoch_start(self, epoch: int) -> None:
        """Before the first batch of ``epoch``."""

    def on_step_end(self, step: int) -> None:
        """After optimizer step ``step`` (1-based). Runs every step: keep it cheap, no host syncs."""

    def on_log(self, metrics: dict[str, float]) -> None:
        """Every ``log_every`` steps, on every rank, with rank-reduced training metrics."""

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        """After each validation, on every rank, with the exact global validation metrics."""

    def on_epoch_end(self, epoch: int) -> None:
        """After the last batch of ``epoch``."""

    def on_fit_end(self, metrics: dict[str, float]) -> None:
        """After training, with the final metrics ``fit()`` returns."""

    # --- entry points ---------------------------------------------------------------------------

    @classmethod
    def main(cls, argv: Sequence[str] | None = None) -> None:
        """Command-line entry: ``script.py [CONFIG] [key=value ...]``; exits non-zero on failure.

        Equivalent to ``cls(load_config(CONFIG, overrides)).fit()``, with errors turned into clear
        messages and the failing rank's traceback recorded for torchrun's summary.
        """
        args = list(sys.argv[1:] if argv is None else argv)
        if args and args[0] in ("-h", "--help"):
            print(f"usage: {Path(sys.argv[0]).name} [CONFIG.yaml] [key.sub=value ...]\n\n{cls.__doc__}")
            return
        path = args.pop(0) if args and "=" not in args[0] else None
        code = run_entrypoint(lambda: cls(path, overrides=args).fit())
        if code:
            sys.exit(code)

    def fit(self) -> dict[str, float]:
        """Train as configured and return the final metrics (identical on every rank)."""
        cfg = self.config
        with process_group(self.env, backend=cfg.dist.backend, device=cfg.dist.device, timeout=cfg.dist.timeout, debug=cfg.dist.debug) as runtime:
            self.runtime = runtime
            self._sinks = MetricSinks(self.output_dir, enabled=False)  # opened by _setup, once resume is decided
            self._bar: ProgressBar | None = None
            self._step_log = StepLog(None)
            try:
                self._setup()
                self.on_fit_start()
                while not self._finished():
                    self._train_epoch()
                metrics = self._finish()
            finally:
                if self._bar is not None:
                    self._bar.close()
                self._sinks.close()
                self._step_log.close()
        self.on_fit_end(metrics)
        return metrics

    # --- setup ------------------------------------------------------------------------------------

    def _setup(self) -> None:
        """Build everything in an order that makes every rank identical and a resume exact."""
        cfg, runtime = self.config, self.runtime
        assert runtime is not None
        log_dir = self.output_dir / "logs" if (cfg.log.rank_files or cfg.dist.debug) else None
        setup_logging(self.rank, all_ranks=cfg.log.all_ranks, log_dir=log_dir)
        check_precision(cfg.train.precision, runtime.device)
        self._write_resolved_config()
        seed_everything(cfg.run.seed)  # the same initial weights and data on every rank
        resume_state = self._build_model_and_data()
        self._build_optimization()
        self._prepare_loop(resumed=resume_state is not None)
        if resume_state is not None:
            self._restore(resume_state)
        else:
            seed_everything(cfg.run.seed + self.rank)  # independent dropout / augmentation per rank
        self._log_start()
        self._bar = ProgressBar(total=int(self.total_steps), initial=self.progress.step, enabled=self.is_main and cfg.log.progress_bar)
        self._window_start, self._window_step = time.perf_counter(), self.progress.step

    def _build_model_and_data(self) -> dict[str, Any] | None:
        """Datasets, model (with resumed weights), the rank agreement check, DDP, loaders."""
        train_set, val_set = self.build_datasets()
        model = self.build_model()
        resume_state = self._load_resume_state()
        if resume_state is not None:
            model.load_state_dict(resume_state["model"])
        check_ranks_agree(self._fingerprint(model, train_set, val_set))
        self._train_model = wrap_model(model, self.runtime, self.config.ddp)
        self.train_loader = self.build_train_loader(train_set)
        self.val_loader = self.build_val_loader(val_set) if val_set is not None else None
        return resume_state

    def _build_optimization(self) -> None:
        """Run length, optimizer, schedule, precision."""
        train, device = self.config.train, self.runtime.device
        self._batches_per_epoch = len(self.train_loader)
        self._steps_per_epoch = math.ceil(self._batches_per_epoch / train.grad_accum_steps)
        self.total_steps = int(min(train.max_steps or math.inf, (train.epochs or math.inf) * self._steps_per_epoch))
        self.optimizer = self.build_optimizer(self._train_model)
        self.scheduler = self.build_scheduler(self.optimizer, self.total_steps)
        self.scaler = grad_scaler(train.precision, device)
        self._autocast = lambda: autocast(train.precision, device)

    def _prepare_loop(self, *, resumed: bool) -> None:
        """Metric accumulators, sinks, trackers, timeline, step log, async writer."""
        cfg, device = self.config, self.runtime.device
        self._running_loss = RunningMean(device)
        self._timeline = Timeline(enabled=cfg.train.timeline, rank=self.rank, device=device)
        self._async_writer = ckpt.AsyncCheckpointWriter() if cfg.checkpoint.async_save else None
        early, best = cfg.train.early_stopping, cfg.checkpoint.best
        self._early_stopping = BestTracker(early.metric, early.mode, patience=early.patience, min_delta=early.min_delta, key="train.early_stopping.metric")
        self._best = BestTracker(best.metric if best else None, best.mode if best else "min", key="checkpoint.best.metric")
        self._step_log = StepLog(self.output_dir / "logs" / f"steps-rank{self.rank}.log" if cfg.dist.debug else None)
        self._last_eval_step = self._last_checkpoint_step = -1
        self.metrics: dict[str, float] = {}
        self._sinks = MetricSinks(self.output_dir, enabled=self.is_main, tensorboard=cfg.log.tensorboard, append=resumed)

    def build_train_loader(self, dataset: Dataset) -> DataLoader:
        """The training loader: ``DistributedSampler`` sharding, per-rank batch size from config."""
        cfg = self.config.data
        return build_train_loader(
            dataset, env=self.env, batch_size=cfg.batch_size, num_workers=cfg.num_workers, shuffle=cfg.shuffle,
            drop_last=cfg.drop_last, seed=self.config.run.seed, pin_memory=cfg.pin_memory and self.device.type == "cuda",
        )

    def build_val_loader(self, dataset: Dataset) -> DataLoader:
        """The validation loader: exact, duplicate-free shards."""
        cfg = self.config.data
        return build_eval_loader(
            dataset, env=self.env, batch_size=cfg.val_batch_size or cfg.batch_size, num_workers=cfg.num_workers,
            pin_memory=cfg.pin_memory and self.device.type == "cuda",
        )

    def _write_resolved_config(self) -> None:
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            ckpt.write_atomically(self.output_dir / "config.yaml", dump_config(self.config).encode())

    def _fingerprint(self, model: nn.Module, train_set: Dataset, val_set: Dataset | None) -> dict[str, Any]:
        shapes = parameter_shapes(model)
        return {
            "config": flatten(config_to_dict(self.config)),
            "parameter_count": sum(math.prod(shape) for _, shape in shapes),
            "parameter_shapes": shapes,
            "train_dataset_length": len(train_set),  # type: ignore[arg-type]
            "val_dataset_length": len(val_set) if val_set is not None else None,  # type: ignore[arg-type]
            "ddpkit_version": __version__,
            "torch_version": str(torch.__version__),
        }

    def _log_start(self) -> None:
        cfg, rt = self.config, self.runtime
        assert rt is not None
        global_batch = cfg.data.batch_size * self.world_size * cfg.train.grad_accum_steps
        log.info(
            "world_size=%d backend=%s device=%s launcher=%s | per-rank batch %d x %d ranks x %d accumulation = global batch %d",
            self.world_size, rt.backend, rt.device, self.env.launcher, cfg.data.batch_size, self.world_size,
            cfg.train.grad_accum_steps, global_batch,
        )
        log.info(
            "%d steps per epoch, %d steps in total%s; writing to %s",
            self._steps_per_epoch, self.total_steps, f", resuming at step {self.progress.step}" if self.progress.step else "",
            self.output_dir,
        )

    # --- the loop -----------------------------------------------------------------------------------

    def _finished(self) -> bool:
        epochs = self.config.train.epochs
        return (
            self._stop_requested
            or self.progress.step >= self.total_steps
            or (epochs is not None and self.progress.epoch >= epochs)
        )

    def _train_epoch(self) -> None:
        progress, accum = self.progress, self.config.train.grad_accum_steps
        start_epoch(self.train_loader, progress.epoch, start_batch=progress.batch_in_epoch)
        self._batches_per_epoch = self._agree_on_batch_count()
        if progress.batch_in_epoch == 0:
            self.on_epoch_start(progress.epoch)
        self._train_model.train()
        batches = iter(self.train_loader)
        while progress.batch_in_epoch < self._batches_per_epoch and not self._finished():
            with self._timeline.span("data"):
                batch = next(batches, None)
            if batch is None:
                raise DataError(
                    f"rank {self.rank}'s training loader ended after {progress.batch_in_epoch} batches of epoch "
                    f"{progress.epoch}, but its len() promised {self._batches_per_epoch}; fix the sampler's __len__"
                )
            progress.batch_in_epoch += 1
            boundary = progress.batch_in_epoch % accum == 0 or progress.batch_in_epoch == self._batches_per_epoch
            self._micro_step(batch, sync=boundary)
            if boundary:
                self._optimizer_step()
                self._after_step()
        if progress.batch_in_epoch >= self._batches_per_epoch:
            progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
            self._after_epoch(progress.epoch - 1)

    def _agree_on_batch_count(self) -> int:
        """This epoch's batch count, checked to be the same on every rank.

        DDP needs every rank to run the same number of backward passes: a rank with an extra
        batch would wait forever in an allreduce the others never join. A custom sampler that
        shards unevenly is stopped here, on every rank, with the counts.
        """
        counts = all_gather_object(self.progress.batch_in_epoch + len(self.train_loader))
        if any(count != counts[0] for count in counts):
            raise DataError(
                f"ranks would run different numbers of training batches in epoch {self.progress.epoch}: "
                + ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
                + ". DDP needs the same number on every rank (a rank with more would wait forever in allreduce). "
                "Give every rank the same number of samples, e.g. DistributedSampler(drop_last=True) and data.drop_last=true."
            )
        if counts[0] == 0:
            raise DataError(f"the training loader yields no batches on any rank in epoch {self.progress.epoch}; check the dataset and data.batch_size")
        return counts[0]

    def _micro_step(self, batch: Any, *, sync: bool) -> None:
        batch = move_to_device(batch, self.device)
        with sync_gradients(self._train_model, sync=sync):
            with self._timeline.span("forward"), self._autocast():
                loss = self.training_step(batch)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise DdpkitError(f"{type(self).__name__}.training_step must return a scalar loss tensor, got {_describe(loss)}")
            self._running_loss.add(loss)
            accum = self.config.train.grad_accum_steps
            if accum > 1:
                loss = loss / accum
            with self._timeline.span("backward"):
                (self.scaler.scale(loss) if self.scaler else loss).backward()

    def _optimizer_step(self) -> None:
        clip = self.config.train.clip_grad_norm
        with self._timeline.span("optimizer"):
            if self.scaler is not None:
                if clip:
                    self.scaler.unscale_(self.optimizer)
                    torch.nn.utils.clip_grad_norm_(self._train_model.parameters(), clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                if clip:
                    torch.nn.utils.clip_grad_norm_(self._train_model.parameters(), clip)
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.scheduler is not None:
                self.scheduler.step()
        self.progress.step += 1

    def _after_step(self) -> None:
        step, train, ck = self.progress.step, self.config.train, self.config.checkpoint
        self._bar.update()
        self._step_log.write("step %d done (epoch %d, batch %d)", step, self.progress.epoch, self.progress.batch_in_epoch)
        self.on_step_end(step)
        if step % train.log_every == 0:
            self._log_training()
        if train.eval_every and step % train.eval_every == 0:
            self._evaluate()
        if ck.every_steps and step % ck.every_steps == 0:
            self._save_checkpoint()

    def _after_epoch(self, epoch: int) -> None:
        self.on_epoch_end(epoch)
        if self.config.train.eval_every is None:
            self._evaluate()
        every = self.config.checkpoint.every_epochs
        if every and (epoch + 1) % every == 0:
            self._save_checkpoint()

    def _finish(self) -> dict[str, float]:
        if self._running_loss.pending:
            self._log_training()
        if self.val_loader is not None and self._last_eval_step != self.progress.step:
            self._evaluate()
        if self._checkpointing_enabled():
            self._save_checkpoint()  # so a longer run can resume from here
        if self._async_writer is not None:
            self._async_writer.wait()
        self._timeline.write(self.output_dir / "timeline.json")
        if self.is_main:
            ckpt.save_atomically(self.unwrapped_model.state_dict(), self.output_dir / "model.pt")
            log.info("saved %s", self.output_dir / "model.pt")
        self._barrier("end of training")
        return {**self.metrics, "step": self.progress.step, "epoch": self.progress.epoch}

    # --- logging and evaluation -----------------------------------------------------------------------

    def _log_training(self) -> None:
        now, step = time.perf_counter(), self.progress.step
        cfg = self.config
        samples = (step - self._window_step) * cfg.data.batch_size * cfg.train.grad_accum_steps * self.world_size
        record = {
            "step": step,
            "epoch": self.progress.epoch,
            "train_loss": self._running_loss.read(),
            "lr": self.optimizer.param_groups[0]["lr"],
            "samples_per_s": samples / max(now - self._window_start, 1e-9),
            "time": time.time(),
        }
        self._window_start, self._window_step = now, step
        self.metrics.update(train_loss=record["train_loss"])
        self._sinks.write(record)
        self._bar.show({"loss": record["train_loss"], "samples/s": round(record["samples_per_s"]), "lr": record["lr"]})
        if not (self.is_main and self.config.log.progress_bar):
            log.info("step %d epoch %d loss %.4f lr %.3g %.0f samples/s", step, record["epoch"], record["train_loss"], record["lr"], record["samples_per_s"])
        self.on_log(record)

    def validate(self) -> dict[str, float]:
        """Exact validation metrics over the whole validation set (call on every rank)."""
        if self.val_loader is None:
            return {}
        bare = unwrap_model(self._train_model)
        was_training = bare.training
        bare.eval()
        means = ExactMeans(self.device)
        self._in_validation = True
        try:
            with torch.no_grad(), self._autocast():
                for batch in self.val_loader:
                    batch = move_to_device(batch, self.device)
                    means.add(self.validation_step(batch), batch_size=batch_size_of(batch))
        finally:
            self._in_validation = False
            bare.train(was_training)
        return {f"val_{name}": value for name, value in means.compute().items()}

    @contextlib.contextmanager
    def _outside_training(self, span: str) -> Iterator[None]:
        """Work recorded as ``span`` on the timeline and left out of samples/s, which measures training only."""
        started = time.perf_counter()
        with self._timeline.span(span):
            yield
        self._window_start += time.perf_counter() - started

    def _evaluate(self) -> None:
        with self._outside_training("evaluation"):
            metrics = self.validate()
        self._last_eval_step = self.progress.step
        if not metrics:
            return
        self.metrics.update(metrics)
        self._sinks.write({"step": self.progress.step, "epoch": self.progress.epoch, **metrics, "time": time.time()})
        log.info("step %d validation: %s", self.progress.step, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        self.on_validation_end(metrics)
        if self._best.update(metrics):
            self._save_checkpoint(name="best")
        self._early_stopping.update(metrics)
        if self._early_stopping.exhausted:
            log.info("early stopping: %s has not improved for %d evaluations", self.config.train.early_stopping.metric, self.config.train.early_stopping.patience)
            self.request_stop()

    # --- checkpoints ------------------------------------------------------------------------------------

    def _checkpointing_enabled(self) -> bool:
        ck = self.config.checkpoint
        return bool(ck.every_steps or ck.every_epochs or ck.best)

    def _barrier(self, where: str) -> None:
        """Wait for every rank; in debug mode a monitored barrier names ranks that never arrive."""
        self._step_log.write("barrier: %s", where)
        barrier(debug=self.config.dist.debug, timeout=self.config.dist.timeout)

    def _save_checkpoint(self, name: str | None = None) -> None:
        """Rank 0 writes the full training state; the other ranks contribute their RNG states and wait."""
        if name is None and self._last_checkpoint_step == self.progress.step:
            return
        with self._outside_training("checkpoint"):
            state = self.checkpoint_state()
            if self.is_main:
                kwargs = dict(
                    step=self.progress.step, name=name, keep_last=self.config.checkpoint.keep_last,
                    meta={"epoch": self.progress.epoch, "config_hash": state["config_hash"], "versions": state["versions"]},
                )
                if self._async_writer is not None:
                    self._async_writer.submit(ckpt.to_cpu(state), self.config.checkpoint_dir, **kwargs)
                else:
                    ckpt.save_checkpoint(state, self.config.checkpoint_dir, **kwargs)
            if self._async_writer is None:
                self._barrier("checkpoint")
        if name is None:
            self._last_checkpoint_step = self.progress.step

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything needed to continue exactly (a collective: gathers every rank's RNG states)."""
        rng_states = all_gather_object(capture_rng())
        return {
            "model": self.unwrapped_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "progress": {"step": self.progress.step, "epoch": self.progress.epoch, "batch_in_epoch": self.progress.batch_in_epoch},
            "rng": rng_states,
            "trackers": {"early_stopping": self._early_stopping.state_dict(), "best": self._best.state_dict()},
            "world_size": self.world_size,
            "config": config_to_dict(self.config),
            "config_hash": config_hash(self.config),
            "versions": {"ddpkit": __version__, "torch": str(torch.__version__)},
        }

    def _load_resume_state(self) -> dict[str, Any] | None:
        ck = self.config.checkpoint
        # Rank 0 decides which file (so all ranks agree even if a save lands meanwhile) ...
        choice: str | None = None
        problem: str | None = None
        if self.is_main:
            try:
                info = ckpt.resolve_resume_path(ck.resume, self.config.checkpoint_dir)
                choice = str(info.path) if info else None
            except CheckpointError as exc:
                problem = str(exc)
        choice, problem = broadcast_object((choice, problem))
        if problem is not None:
            raise CheckpointError(problem)
        if choice is None:
            return None
        # ... and every rank reads it (checkpoint.dir must be on a filesystem all nodes share).
        state = ckpt.load_checkpoint(choice)
        differences = config_differences(
            state.get("config", {}), config_to_dict(self.config), saved_world_size=state.get("world_size", -1), world_size=self.world_size
        )
        if differences and not ck.allow_config_change:
            raise CheckpointError(
                f"cannot resume from {choice}: it was written by a run whose config differs in fields that change the math:\n"
                + "\n".join(f"  - {d}" for d in differences)
                + "\nStart fresh with checkpoint.resume=none (or a new run.output_dir), or resume anyway with checkpoint.allow_config_change=true."
            )
        log.info("resuming from %s (step %d)", choice, state["progress"]["step"])
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.progress = Progress(**state["progress"])
        self._last_checkpoint_step = self.progress.step
        trackers = state.get("trackers", {})
        self._early_stopping.load_state_dict(trackers.get("early_stopping", {}))
        self._best.load_state_dict(trackers.get("best", {}))
        rng = state["rng"]
        restore_rng(rng[self.rank] if len(rng) == self.world_size else rng[0])


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r:.60}"
