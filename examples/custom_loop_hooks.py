"""Custom logging with the Trainer's hooks: an epoch table, a CSV file and a stopping rule.

    torchrun --nproc-per-node=2 examples/custom_loop_hooks.py                    # about half a minute on CPU
    torchrun --nproc-per-node=2 examples/custom_loop_hooks.py --target-accuracy 0.95 train.epochs=12
    python examples/custom_loop_hooks.py                                         # a world of one

The loop itself stays ddpkit's; the hooks run at fixed points of it, on every rank::

    on_fit_start()                   after setup (and resume), before the first step
    on_epoch_start(epoch)            before the first batch of an epoch
    on_step_end(step)                after every optimizer step: keep it cheap, no host syncs
    on_log(metrics)                  every train.log_every steps: rank-reduced train_loss, lr, samples_per_s
    on_epoch_end(epoch)              after the last batch of an epoch (the end-of-epoch validation follows)
    on_validation_end(metrics)       after each validation, with exact global val_* metrics
    on_fit_end(metrics)              once, with the final metrics fit() returns

Metrics reach the hooks already reduced over ranks, so every rank sees the same numbers and can
make the same decision (here: stop once validation accuracy reaches ``--target-accuracy``). Side
effects such as files and printing are for rank 0 only (``self.is_main``). ddpkit's own
``metrics.jsonl`` is still written; ``epochs.csv`` below is an extra, in a format of your choosing.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time

import ddpkit
from ddpkit.reporting.log import log

DEFAULTS = [
    "run.name=custom_loop_hooks",
    "model.name=mnist_cnn",
    "data.name=digits",
    "data.batch_size=64",
    "data.kwargs.num_train=8000",
    "data.kwargs.num_val=1000",
    "optim.lr=0.05",
    "optim.momentum=0.9",
    "train.epochs=8",
    "train.log_every=20",
    "log.progress_bar=false",  # the hooks below print a table instead
]


COLUMNS = ["epoch", "train_loss", "val_loss", "val_accuracy", "seconds", "steps_per_s", "slowest_ms"]


class HookedTrainer(ddpkit.Trainer):
    """Prints one table row per epoch, writes them to epochs.csv, and stops at a target accuracy."""

    target_accuracy = 0.9

    def on_fit_start(self) -> None:
        self.rows: list[dict[str, float]] = []
        if self.is_main:
            params = sum(p.numel() for p in self.model.parameters())
            log.info(
                "%s with %d parameters on %d rank(s); stopping at val_accuracy >= %.2f",
                type(self.unwrapped_model).__name__,
                params,
                self.world_size,
                self.target_accuracy,
            )
            log.info(
                "%5s %10s %9s %8s %8s %8s %11s",
                "epoch",
                "train_loss",
                "val_loss",
                "val_acc",
                "seconds",
                "steps/s",
                "slowest_ms",
            )

    def on_epoch_start(self, epoch: int) -> None:
        self.epoch_started = self.last_step_end = time.perf_counter()
        self.epoch_first_step = self.progress.step
        self.slowest_step = 0.0
        self.last_train_loss = float("nan")

    def on_step_end(self, step: int) -> None:
        now = time.perf_counter()  # host-side timing only: reading a tensor here would sync every step
        self.slowest_step = max(self.slowest_step, now - self.last_step_end)
        self.last_step_end = now

    def on_log(self, metrics: dict[str, float]) -> None:
        self.last_train_loss = metrics["train_loss"]

    def on_epoch_end(self, epoch: int) -> None:
        seconds = time.perf_counter() - self.epoch_started
        steps = self.progress.step - self.epoch_first_step
        self.rows.append(
            {
                "epoch": epoch,
                "train_loss": self.last_train_loss,
                "seconds": seconds,
                "steps_per_s": steps / seconds,
                "slowest_ms": 1000 * self.slowest_step,
            }
        )

    def on_validation_end(self, metrics: dict[str, float]) -> None:
        row = self.rows[-1] if self.rows and "val_loss" not in self.rows[-1] else None
        if row is not None:  # the end-of-epoch validation: complete the row and show it
            row.update(val_loss=metrics["val_loss"], val_accuracy=metrics["val_accuracy"])
            if self.is_main:
                log.info("%5d %10.4f %9.4f %8.3f %8.1f %8.1f %11.1f", *(row[k] for k in COLUMNS))
        # Every rank sees the same exact metrics, so every rank stops at the same step.
        if metrics["val_accuracy"] >= self.target_accuracy:
            self.request_stop()

    def on_fit_end(self, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        path = self.output_dir / "epochs.csv"
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows)
        log.info(
            "stopped after %d steps at val_accuracy %.3f; wrote %s", metrics["step"], metrics["val_accuracy"], path
        )


def main(argv: list[str]) -> None:
    """``--target-accuracy X`` is this script's own option; the rest are config overrides (``key=value``)."""
    parser = argparse.ArgumentParser(
        description="Trainer hooks for custom logging.", usage="%(prog)s [--target-accuracy X] [key=value ...]"
    )
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=HookedTrainer.target_accuracy,
        help="stop once val_accuracy reaches this",
    )
    args, rest = parser.parse_known_args(argv)
    HookedTrainer.target_accuracy = args.target_accuracy
    HookedTrainer.main(rest, defaults=DEFAULTS)  # a key given on the command line replaces its default


if __name__ == "__main__":
    main(sys.argv[1:])
