"""ddpkit: take a single-process PyTorch training script to N processes, GPUs and nodes with DDP.

    import ddpkit

    class MyTrainer(ddpkit.Trainer):
        def build_model(self): ...
        def training_step(self, batch): ...

    if __name__ == "__main__":
        MyTrainer.main()     # torchrun --nproc-per-node=2 train.py config.yaml optim.lr=0.1

See README.md for the config reference and the command line (``ddpkit run / config / bench``).
"""

from ddpkit._version import __version__
from ddpkit.config.loader import dump_config, load_config
from ddpkit.config.schema import Config
from ddpkit.distributed.env import DistEnv, read_dist_env
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import CheckpointError, ConfigError, ConsistencyError, DataError, DdpkitError, LaunchError
from ddpkit.faults.preemption import PREEMPTED_EXIT_CODE, Preempted
from ddpkit.registry import register_dataset, register_model, register_optimizer
from ddpkit.trainer import Progress, Trainer

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
    "DdpkitError",
    "ConfigError",
    "LaunchError",
    "DataError",
    "CheckpointError",
    "ConsistencyError",
    "Preempted",
    "PREEMPTED_EXIT_CODE",
]
