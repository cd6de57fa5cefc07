"""A ddpkit Trainer under Ray Train's TorchTrainer on a local Ray cluster (tests/test_ray.py runs it).

    PYTHONPATH=examples python tests/scripts/ray_job.py OUT [KILL_STEP]

Two CPU workers train the quickstart config, cut short; each rank appends "pid step" to
OUT/steps-rank<r>.txt after every optimizer step. With KILL_STEP, rank 1 SIGKILLs itself after that
step the first time (FailureConfig(max_failures=1): Ray restarts the worker group once). Run as a
script so Ray pickles the Trainer subclass by value into its workers.
"""

import os
import signal
import sys
from pathlib import Path

import ray
import ray_train  # examples/ray_train.py: PYTHONPATH=examples (tests/test_ray.py sets it)
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray_train import RayReporting, train_loop

REPO = Path(__file__).resolve().parents[2]

ray.cloudpickle.register_pickle_by_value(ray_train)  # so Ray's workers need not find examples/ themselves

OUT = Path(sys.argv[1]).resolve()
KILL = int(sys.argv[2]) if len(sys.argv) > 2 else 0


class Recorded(RayReporting):
    def on_step_end(self, step: int) -> None:
        with open(OUT / f"steps-rank{self.rank}.txt", "a") as f:
            f.write(f"{os.getpid()} {step}\n")
        if KILL and self.rank == 1 and step == KILL and not (OUT / "killed").exists():
            (OUT / "killed").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"run.output_dir={OUT / 'run'}",
        "data.kwargs.num_train=2560",
        "data.kwargs.num_val=256",
        "train.epochs=2",
        "log.progress_bar=false",
        "train.log_every=5",
    ]
    ray.init(num_cpus=2, include_dashboard=False)
    result = TorchTrainer(
        train_loop,
        train_loop_config={
            "config": str(REPO / "configs" / "quickstart.yaml"),
            "overrides": overrides,
            "trainer_class": Recorded,
        },
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(OUT / "ray"), name="job", failure_config=FailureConfig(max_failures=1)),
    ).fit()
    print(f"RAY RESULT metrics={result.metrics} checkpoint={result.checkpoint} error={result.error}", flush=True)
