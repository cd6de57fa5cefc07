"""Horovod's PyTorch MNIST example, ported to ddpkit.

    torchrun --nproc-per-node=2 examples/horovod_mnist.py                        # 2 CPU processes, about a minute
    torchrun --nproc-per-node=2 examples/horovod_mnist.py data.kwargs.root=~/data  # real MNIST in ~/data/MNIST/raw
    MNIST_ROOT=~/data torchrun --nproc-per-node=2 examples/horovod_mnist.py         # same, from the environment
    python examples/horovod_mnist.py train.epochs=2                               # a world of one

Same model (the classic MNIST CNN), same optimizer (SGD, momentum 0.5, the learning rate scaled
by the number of processes), same batch size, seed and rank-0 checkpoints as Horovod's
``pytorch_mnist.py``. Data: MNIST read from a local root when one is given (``data.kwargs.root``
or ``$MNIST_ROOT``, holding ``MNIST/raw/*-ubyte``; nothing is downloaded), otherwise ddpkit's
embedded ``digits`` dataset (generated 28x28 digits, no files needed). Writes
``runs/horovod_mnist/``: ``metrics.jsonl``, ``checkpoints/``, ``model.pt``.

Horovod, line by line, and what replaces it here::

    Horovod (pytorch_mnist.py)                             ddpkit
    ---------------------------------------------------    ----------------------------------------------------
    import horovod.torch as hvd; hvd.init()                nothing: Trainer.fit() creates the process group from
                                                           the variables torchrun sets (RANK, WORLD_SIZE, ...)
    torch.cuda.set_device(hvd.local_rank())                done by fit(): device cuda:LOCAL_RANK, or the CPU
    hvd.rank(), hvd.size(), hvd.local_rank()               self.rank, self.world_size, self.local_rank
    DistributedSampler(train_dataset,                      the Trainer's training loader (a DistributedSampler,
        num_replicas=hvd.size(), rank=hvd.rank())          set_epoch() called every epoch)
    test DistributedSampler + metric_average()             exact validation: each sample counted once, averaged
        (hvd.allreduce of per-rank means)                  over all ranks (val_loss, val_accuracy)
    optim.SGD(..., lr=args.lr * hvd.size(),                build_optimizer() below: lr * self.world_size
        momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), 0)        DDP broadcasts rank 0's weights and buffers when it
                                                           wraps the model
    hvd.broadcast_optimizer_state(optimizer, 0)            not needed: every rank builds the same optimizer, and
                                                           on resume every rank loads the same checkpoint
    hvd.DistributedOptimizer(optimizer,                    DistributedDataParallel: gradients are averaged by
        named_parameters=model.named_parameters())         allreduce during backward
    compression=hvd.Compression.fp16                       ddp.comm_hook=fp16
    if hvd.rank() == 0: torch.save(model.state_dict())     checkpoint.every_epochs=1: rank 0 writes crash-safe
                                                           checkpoints (the run resumes from them), then model.pt
    horovodrun -np 2 python pytorch_mnist.py               torchrun --nproc-per-node=2 examples/horovod_mnist.py
    horovodrun -np 8 -H host1:4,host2:4 python ...         torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d
                                                           --rdzv-endpoint=host1:29400 examples/horovod_mnist.py
                                                           (on each host; see docs/multinode.md)

Two small differences: Horovod's network ends in ``log_softmax`` and trains with ``nll_loss``;
ddpkit's ``mnist_cnn`` returns logits for ``cross_entropy``, which is the same loss. Horovod's
``--use-adasum`` and ``--gradient-predivide-factor`` have no counterpart.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit.data.datasets import digits, mnist
from ddpkit.reporting.log import log

# Horovod's argparse defaults, as ddpkit config overrides (command-line key=value pairs win).
DEFAULTS = [
    "run.name=horovod_mnist",
    "run.seed=42",
    "model.name=mnist_cnn",
    "data.batch_size=64",  # per process, like Horovod's --batch-size
    "data.val_batch_size=1000",  # --test-batch-size
    "optim.lr=0.01",  # before scaling by the number of processes
    "optim.momentum=0.5",
    "train.epochs=10",  # --epochs: about a minute on 2 CPU processes, ~95% accuracy on digits
    "train.log_every=10",  # --log-interval
    "checkpoint.every_epochs=1",
]


class HorovodMnistTrainer(ddpkit.Trainer):
    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        """MNIST from a local root if one is given, else the embedded digits dataset."""
        kwargs = dict(self.config.data.kwargs)
        root = kwargs.pop("root", None) or os.environ.get("MNIST_ROOT")
        if root:
            return mnist(root)  # a clear error if the files are not there: nothing is downloaded
        log.info("no MNIST root given (data.kwargs.root or $MNIST_ROOT): using the embedded digits dataset")
        return digits(**kwargs)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """Horovod's rule: the learning rate grows with the number of processes (the global batch does)."""
        cfg = self.config.optim
        return torch.optim.SGD(
            model.parameters(), lr=cfg.lr * self.world_size, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )


if __name__ == "__main__":
    HorovodMnistTrainer.main(defaults=DEFAULTS)  # a key given on the command line replaces its default
