"""ddpkit: take a single-process PyTorch training script to N processes, GPUs and nodes with DDP.

    import ddpkit

    class MyTrainer(ddpkit.Trainer):
        def build_model(self): ...
        def training_step(self, batch): ...

    if __name__ == "__main__":
        MyTrainer.main()     # torchrun --nproc-per-node=2 train.py config.yaml optim.lr=0.1

See README.md for the config reference and the command line (``ddpkit run / config / bench``).

Where things live: one row per layer, and every import points down this list, never up or
sideways (``tests/test_architecture.py`` holds every import statement, deferred ones included,
against this order, collapsed to packages):

    __main__.py              ``python -m ddpkit``
    cli.py                   the ``ddpkit`` command line: parses argv, calls one of the rows below
    spark/                   ``ddpkit.spark.run`` / ``ddpkit spark``: a run as Spark barrier stages, restarted, resumed
    tools/, bench/           commands that read finished runs or plan one
                             (runs, plot, goodput, estimate); ``ddpkit bench``
    trainer.py               ``Trainer``: build, register, attach; the loop on one screen; overridable steps
    testing/                 ``run_on_ranks`` and a pool of live ranks (``RankPool``, the ``rank_pool`` fixture):
                             run functions on N Gloo ranks, for your own tests; ``fake_ranks``: any rank of any
                             world in one process, on torch's fake backend
    launch/                  ``ddpkit run``'s launcher side (preflight, torchrun's argv, signals)
                             and the worker entry point
    goodput/                 the goodput ledger: written by every rank (``goodput.jsonl``), read by ``ddpkit goodput``
    watchdog/                the hang watchdog: heartbeats through the job's store, the alarm, the hang report
    checkpoint/              the run's state (one owner, parts registered by name), crash-safe files, resume, sharded
                             checkpoints, the crash save, the in-memory tier, the agreed stop on a signal (preemption)
    training/                the step objects (accumulation; the pipeline's schedule), the optimizer and its update,
                             the losses, precision, health, evaluation, metrics, RNG
    parallel/                where a rank's part of the model lives and how it trains: ``parallelize`` (tensor plan,
                             pipeline cut, activation checkpointing, the data-parallel way: DDP / ZeRO-1 / FSDP2,
                             compile), the layout (degrees, coordinates, mesh)
    reporting/               the reporter and the loop's one ordered list of listeners, logging, console,
                             timeline, sinks
    data/                    samplers and loaders sharded over ranks, exact evaluation, datasets, token files, streams
    models/                  what a network is: GPT-2 and the Llama family, attention, RoPE, the document mask,
                             generation, LoRA, the Hugging Face converters, the built-in models
    registry.py              models, datasets and optimizers by name
    distributed/             the launcher's environment read once, the process group, DDP wrapping, rank agreement,
                             the gradient norm
    config/                  the typed schema, safe YAML, ``key=value`` overrides, cross-field checks, hashing
    atomic.py, errors.py, progress.py, _version.py   atomic file writes; the user-facing exceptions and every exit code;
                             the loop's Progress counter that every layer reads; the version
"""

import importlib
import importlib.util

from ddpkit._version import __version__

# Each public name and the module it lives in, imported on first use (PEP 562): ``import ddpkit`` costs what its
# version does, and a program pays for the Trainer (about 130 modules) when it first names it.
_PUBLIC = {
    "PREEMPTED_EXIT_CODE": "ddpkit.checkpoint.preemption",
    "Preempted": "ddpkit.checkpoint.preemption",
    "load_config": "ddpkit.config.loader",
    "Config": "ddpkit.config.schema",
    "dump_config": "ddpkit.config.serialize",
    # Plumbing, public since the first release (the Trainer's ``env`` and ``runtime``).
    "DistEnv": "ddpkit.distributed",
    "Runtime": "ddpkit.distributed",
    "read_dist_env": "ddpkit.distributed",
    "CheckpointError": "ddpkit.errors",
    "ConfigError": "ddpkit.errors",
    "ConsistencyError": "ddpkit.errors",
    "DataError": "ddpkit.errors",
    "DdpkitError": "ddpkit.errors",
    "HealthError": "ddpkit.errors",
    "LaunchError": "ddpkit.errors",
    "Progress": "ddpkit.progress",
    "register_dataset": "ddpkit.registry",
    "register_model": "ddpkit.registry",
    "register_optimizer": "ddpkit.registry",
    "Sink": "ddpkit.reporting.sink_base",
    "Trainer": "ddpkit.trainer",
    "CompileError": "ddpkit.parallel.model_views",
}

__all__ = [
    "__version__",
    "Trainer",
    "Progress",
    "Config",
    "load_config",
    "dump_config",
    "DistEnv",
    "read_dist_env",
    "Runtime",
    "register_model",
    "register_dataset",
    "register_optimizer",
    "Sink",
    "testing",
    "DdpkitError",
    "ConfigError",
    "LaunchError",
    "DataError",
    "CheckpointError",
    "ConsistencyError",
    "HealthError",
    "CompileError",
    "Preempted",
    "PREEMPTED_EXIT_CODE",
]


def __getattr__(name: str) -> object:
    """A public name, or a subpackage (``ddpkit.testing``, ``ddpkit.trainer``, ...), imported on first use."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        # Kept, so the next use is a plain attribute
        globals()[name] = value
        return value
    if importlib.util.find_spec(f"ddpkit.{name}") is not None:
        return importlib.import_module(f"ddpkit.{name}")
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
