"""How a run splits its global batch: over data-parallel replicas, and into loader batches per optimizer step.

    split = Split.of_config(config, world_size=4)      # or Split.of(flat_saved_config, world_size=2)
    split.samples_per_step      # the global batch: what must match for a resume to train on the same samples
    split.batches_per_step      # train.grad_accum_steps, or a pipeline's parallel.microbatches
    split.replicas              # world_size / (parallel.pipeline x parallel.tensor)

The same 16 samples a step can be 4 pipeline microbatches of 4, 2 DDP ranks of 8, or one rank accumulating 4
batches of 4. The global batch decides which samples each step trains on (``data.global_batch_size``,
:mod:`ddpkit.data.elastic`); the split only decides who computes which part. Arithmetic on the config alone, so
both the check of a checkpoint against the resuming run (:mod:`ddpkit.distributed.agreement`) and the data
position (:mod:`ddpkit.data.position`) read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpkit.config.layout import default_microbatches
from ddpkit.config.schema import Config
from ddpkit.config.serialize import config_to_dict, flatten

__all__ = ["Split"]


@dataclass(frozen=True)
class Split:
    """How a run splits one optimizer step's samples: over ``replicas``, and in ``batches_per_step`` loader batches."""

    #: The global batch: samples per optimizer step, over every data-parallel replica.
    samples_per_step: int
    #: Loader batches each replica takes per step: ``train.grad_accum_steps``, or a pipeline's microbatches.
    batches_per_step: int
    #: Data-parallel replicas (``world_size / (pipeline x tensor)``): each reads its own share of every batch.
    replicas: int

    @classmethod
    def of(cls, flat: dict[str, Any], *, world_size: int) -> Split:
        """The split of a run with config ``flat`` (a flattened config dict, keys missing from an older one at
        their defaults) on ``world_size`` ranks."""
        defaults = flatten(config_to_dict(Config()))

        def get(key: str) -> Any:
            return flat.get(key, defaults.get(key))

        stages = get("parallel.pipeline") or 1
        replicas = max(1, world_size // (stages * (get("parallel.tensor") or 1)))
        if stages > 1:
            batches = get("parallel.microbatches") or default_microbatches(stages)
        else:
            batches = get("train.grad_accum_steps") or 1
        total = get("data.global_batch_size")
        if total is None:
            total = get("data.batch_size") * batches * replicas
        return cls(samples_per_step=total, batches_per_step=batches, replicas=replicas)

    @classmethod
    def of_config(cls, config: Config, *, world_size: int) -> Split:
        return cls.of(flatten(config_to_dict(config)), world_size=world_size)

    @property
    def samples_per_batch(self) -> int:
        """Global samples per loader-batch index: every replica's batch together."""
        return self.samples_per_step // self.batches_per_step

    @property
    def micro_batch(self) -> int:
        """Samples in one replica's loader batch."""
        return self.samples_per_batch // self.replicas

    def describe(self) -> str:
        """``"2 replica(s) x 1 batch(es) of 8"``: what a log line names."""
        return f"{self.replicas} replica(s) x {self.batches_per_step} batch(es) of {self.micro_batch}"
