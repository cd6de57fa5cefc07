"""A user's script that imports scikit-learn at its top and builds its dataset with it, as user scripts import
transformers, datasets or their own packages: for tests/test_warm_restart.py and ``python -m benchmarks.goodput``.

    ddpkit run CONFIG --nproc-per-node 2 --max-restarts 3 --script tests/scripts/sklearn_trainer.py
    KILL_RANKS=1 KILL_AT_STEP=7 ddpkit run ...      # as tests/scripts/goodput_trainer.py: a worker SIGKILLs itself

Each rank logs the steps it trains (``trained-rank<r>.log``, from ``goodput_trainer.LoggingTrainer``) and
``<output_dir>/imports-rank<r>.log`` records, per attempt, whether scikit-learn was already imported when this
script began (a warm start) and how long its imports took. The data: ``make_classification`` (``SKLEARN_SAMPLES``
samples, 64 features, 8 classes), standardised, in the disk cache of generated data (``ddpkit.data.cache``).
"""

import os
import sys
import time

T0, WARM = time.time(), "sklearn" in sys.modules  # before this script's own imports

import torch  # noqa: E402
from goodput_trainer import ATTEMPT, LoggingTrainer  # noqa: E402  # a sibling module: never preloaded
from sklearn.datasets import make_classification  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from ddpkit.data.cache import cached_tensors  # noqa: E402

IMPORTS_S = time.time() - T0
SAMPLES, FEATURES, CLASSES = int(os.environ.get("SKLEARN_SAMPLES", "20000")), 64, 8


def _build() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_classification(
        n_samples=SAMPLES, n_features=FEATURES, n_informative=32, n_classes=CLASSES, random_state=0
    )
    return torch.tensor(StandardScaler().fit_transform(x), dtype=torch.float32), torch.tensor(y)


class SklearnTrainer(LoggingTrainer):
    def build_datasets(self):
        x, y = cached_tensors(f"sklearn-classification-v1-{SAMPLES}-{FEATURES}-{CLASSES}", _build)
        cut = SAMPLES * 9 // 10
        return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, CLASSES))

    def on_fit_start(self) -> None:
        with open(os.path.join(self.config.output_dir, f"imports-rank{self.rank}.log"), "a") as f:
            f.write(f"{ATTEMPT} {int(WARM)} {IMPORTS_S:.4f}\n")


if __name__ == "__main__":
    SklearnTrainer.main()
