"""Replica divergence: every rank's parameters must stay bit-for-bit equal to rank 0's under DDP.

    check = ReplicaCheck(model, rank=rank, world_size=2, device=device, on_divergence="broadcast")
    check(step=100)    # a collective: the same call on every rank; logs, re-broadcasts or raises HealthError
    require_finite(model, what="the checkpoint of step 100")   # the checkpointer, before it writes anything

A missed broadcast, a bit flip or rank-dependent user code makes a replica drift while DDP goes on
averaging gradients computed on different weights. Each rank takes an exact fingerprint of its
parameters (:func:`ddpkit.training.health_checks.fingerprint`: two int64s, computed on the device)
and one all_reduce of a ``world_size x 2`` table compares them with rank 0's. ``broadcast`` then
copies rank 0's parameters to every rank (optimizer state stays each rank's own); ``stop`` raises
:class:`~ddpkit.errors.HealthError` on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.collectives import all_reduce_sum
from ddpkit.errors import HealthError
from ddpkit.reporting.log import log
from ddpkit.training.health_checks import fingerprint

__all__ = ["ReplicaCheck", "require_finite"]


class ReplicaCheck:
    """Compares every rank's parameter fingerprint with its first replica's (rank 0's without a pipeline), and acts
    on a difference.

    ``replicas`` / ``group``: the data-parallel degree and this rank's replicas' group. Under a pipeline the ranks
    of one stage are ``replicas`` in a row (the mesh puts the pipeline outermost: ddpkit.parallel.layout), so
    rank ``r``'s first replica is ``r // replicas * replicas``; stages are compared with their own replicas only.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        on_divergence: str,
        replicas: int | None = None,
        group: Any = None,
    ):
        self.model = model
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.on_divergence = on_divergence
        self.replicas = replicas or world_size
        self.group = group
        if group is not None:
            # The first-replica rule below holds only where a stage's replicas are neighbouring ranks
            replicas_of_this_rank = dist.get_process_group_ranks(group)
            first = self._first_replica(rank)
            assert replicas_of_this_rank == list(range(first, first + self.replicas)), (
                f"rank {rank}'s replicas are ranks {replicas_of_this_rank}, not {self.replicas} neighbours from {first}"
            )
        #: Checks that found a difference, for metrics.
        self.divergences = 0

    def _first_replica(self, rank: int) -> int:
        return rank // self.replicas * self.replicas

    def differing_ranks(self) -> list[int]:
        """The ranks whose fingerprint differs from their first replica's (a collective over every rank)."""
        table = torch.zeros(self.world_size, 2, dtype=torch.int64, device=self.device)
        table[self.rank] = fingerprint(self.model.parameters()).to(self.device)
        rows = all_reduce_sum(table).tolist()
        return [r for r in range(self.world_size) if rows[r] != rows[self._first_replica(r)]]

    def __call__(self, *, step: int) -> list[int]:
        """Check at optimizer step ``step``; return the differing ranks (empty when all agree)."""
        differing = self.differing_ranks()
        if not differing:
            return []
        self.divergences += 1
        ranks = ", ".join(map(str, differing))
        first = "rank 0's" if self.replicas == self.world_size else "their stage's first replica's"
        what = f"replica divergence at step {step}: the parameters of rank(s) {ranks} differ from {first}"
        if self.on_divergence == "stop":
            raise HealthError(
                f"{what} (health.on_divergence=stop). Look for rank-dependent code that changes weights outside the "
                "optimizer, or set health.on_divergence=broadcast to copy rank 0's weights to every rank and go on."
            )
        with torch.no_grad():
            for param in self.model.parameters():
                dist.broadcast(param.data, src=self._first_replica(self.rank), group=self.group)
        if self.rank == 0:
            source = (
                "rank 0's parameters to every rank"
                if self.replicas == self.world_size
                else ("each stage's first replica's parameters to its other replicas")
            )
            log.warning("%s; copied %s (health.on_divergence=broadcast)", what, source)
        return differing


def require_finite(model: torch.nn.Module, *, what: str, collective: bool = True) -> None:
    """Raise :class:`~ddpkit.errors.HealthError` instead of writing ``what`` when ``model`` has a non-finite parameter.

    ``collective``: every rank checks its own parameters and one all_reduce makes the verdict
    every rank's (so all raise together, none waits at a barrier); False for rank 0's ``model.pt``.
    """
    tensors = [p.detach() for p in model.parameters()]
    # fsdp2: this rank's shard.
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    bad = torch.zeros(1, device=tensors[0].device if tensors else "cpu")
    if tensors:
        bad += sum(int(not torch.isfinite(t).all()) for t in tensors if t.numel())
    if collective:
        bad = all_reduce_sum(bad)
    if bad.item():
        raise HealthError(
            f"not writing {what}: the model's parameters hold NaN or Inf, so the checkpoints already on disk are "
            "kept as they are (none is pruned for this one). Resume from the newest with checkpoint.resume=auto, "
            "lower the learning rate, or keep health.nonfinite=skip so that a bad step never reaches the weights."
        )
