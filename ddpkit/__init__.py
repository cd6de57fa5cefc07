"""ddpkit: take a single-process PyTorch training script to N processes, GPUs and nodes with DDP.

    import ddpkit

    class MyTrainer(ddpkit.Trainer):
        def build_model(self): ...
        def training_step(self, batch): ...

    if __name__ == "__main__":
        MyTrainer.main()     # torchrun --nproc-per-node=2 train.py config.yaml optim.lr=0.1

See README.md for the config reference and the command line (``ddpkit run / config / bench``).

Where things live, one folder per stage of a run (imports point down this list, never up):

    cli.py, bench/, tools/   the ``ddpkit`` command line, benchmarks, and the commands that read finished runs (runs, plot)
    trainer.py               ``Trainer``: setup as straight code, the loop, overridable steps, no-op hooks
    launch/                  ``ddpkit run``'s launcher side (preflight, torchrun's argv, signals) and the worker entry point
    checkpoint/              crash-safe checkpoint files, and the run's state: parts registered by name, resume
    data/                    samplers and loaders sharded over ranks, exact evaluation, datasets, streams
    training/                the optimizer step: optimizers, schedules, precision, compile, metrics, models, RNG
    faults/                  the hang watchdog and its report, preemption (stop on a signal after saving)
    reporting/               the reporter, logging, the console display, timeline, metric sinks and trackers
    distributed/             the launcher's environment read once, the process group, DDP wrapping, rank agreement
    config/                  the typed schema, safe YAML, ``key=value`` overrides, cross-field checks, hashing
    errors.py                the user-facing exceptions and every exit code (0, 1, 2, 3, 75, 130)
    testing.py               ``ddpkit.testing.run_on_ranks``: run a function on N Gloo ranks, for your own tests
    registry.py              models, datasets and optimizers by name
"""

from ddpkit._version import __version__
from ddpkit.config.loader import dump_config, load_config
from ddpkit.config.schema import Config

# Plumbing, public since the first release (the Trainer's ``env`` and ``runtime``); it lives in ddpkit.distributed.
from ddpkit.distributed import DistEnv, Runtime, read_dist_env
from ddpkit.errors import CheckpointError, ConfigError, ConsistencyError, DataError, DdpkitError, HealthError, LaunchError
from ddpkit.faults.preemption import PREEMPTED_EXIT_CODE, Preempted
from ddpkit.registry import register_dataset, register_model, register_optimizer
from ddpkit.reporting.sink_base import Sink
from ddpkit.trainer import Progress, Trainer
from ddpkit.training.compile import CompileError

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
    """``ddpkit.testing`` on first use (PEP 562): multiprocessing and tempfile cost 15 ms that a run never needs."""
    if name == "testing":
        import importlib

        return importlib.import_module("ddpkit.testing")
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
