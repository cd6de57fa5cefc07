"""Train a YAML-configured ddpkit Trainer with Ray Train's TorchTrainer (pip install "ddpkit[ray]").

    python examples/ray_train.py configs/quickstart.yaml --workers 2 run.output_dir=/shared/runs/quickstart
    python examples/ray_train.py configs/quickstart.yaml --workers 2 --max-failures 3 train.epochs=2

Ray starts the workers, creates the process group (Gloo on CPUs, NCCL on GPUs) and runs
``train_loop`` in a thread of each worker; the Trainer adopts that group and leaves it to Ray.
A worker that dies (SIGKILL, OOM) costs no completed step: a surviving rank saves the last one
(ddpkit's crash save) and the worker group Ray restarts (``FailureConfig(max_failures=...)``)
resumes from ``run.output_dir``, which must be an absolute path on storage every node sees (Ray
changes the workers' directory to one of its own). Metrics go to Ray at every validation; the
newest checkpoint directory is reported to Ray once, at the end (docs/ray.md says why).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import ddpkit


class RayReporting(ddpkit.Trainer):
    """A Trainer that tells Ray Train its validation metrics and, at the end, its checkpoint directory."""

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        import ray.train

        ray.train.report({**metrics, "step": self.progress.step})  # every rank calls report: Ray waits for all

    def on_fit_end(self, metrics: dict[str, float]) -> None:
        import ray.train

        directory = Path(self.config.checkpoint_dir)
        checkpoint = (
            ray.train.Checkpoint.from_directory(str(directory)) if self.rank == 0 and directory.is_dir() else None
        )
        ray.train.report({**metrics, "step": self.progress.step}, checkpoint=checkpoint)


def train_loop(loop_config: dict[str, Any]) -> None:
    """What each Ray worker runs: ``cls(config, overrides=...).fit()``."""
    cls = loop_config.get("trainer_class", RayReporting)
    cls(loop_config["config"], overrides=loop_config.get("overrides", [])).fit()


def main() -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (ranks)")
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--max-failures", type=int, default=1, help="worker-group restarts Ray allows")
    parser.add_argument(
        "--storage", default=str(Path("runs/ray").resolve()), help="Ray's storage_path (its own results)"
    )
    args = parser.parse_args()
    ray.init()
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"config": str(Path(args.config).resolve()), "overrides": args.overrides},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=RunConfig(storage_path=args.storage, failure_config=FailureConfig(max_failures=args.max_failures)),
    )
    result = trainer.fit()
    print(f"metrics: {result.metrics}\ncheckpoint: {result.checkpoint}")


if __name__ == "__main__":
    main()
