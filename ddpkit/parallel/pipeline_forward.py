"""A pipeline's forward for validation: one batch through this rank's stages, with torch's stage and schedule.

    forward = PipelineForward(stages, ids, total=P * V, device=device, group=layout.pp_group)   # build_pipeline's
    logits = forward.run(x)          # the last stage's logits; None on the other stages

The first stage feeds a batch's input to a forward-only schedule of torch's (``schedule.eval``, one microbatch: the
batch as it is), the middle stages pass it on, and on the last stage the held parts' forward receives the previous
stage's activations and returns the logits (:mod:`ddpkit.training.evaluation_pipeline` runs validation with it).

Why separate stage objects for validation, one set per input shape: torch's ``PipelineStage`` infers the shapes it
receives once, on its first step, and allocates its receive buffers from them; a validation batch of another shape
(another batch size, the last short batch, another sequence length) through the training schedule's stages would be
received into buffers of the wrong size (Gloo fails the receive). A new ``PipelineStage`` per input shape infers that
shape on its first use, and is kept for the next validation: at most :data:`KEPT_SHAPES` shapes, the least recently
used let go first. Every stage of a replica sees the same shapes in the same order, so they make the same choices.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["PipelineForward", "KEPT_SHAPES"]

#: How many input shapes keep their validation stages (each holds one receive buffer per stage).
KEPT_SHAPES = 4


class PipelineForward:
    """This rank's stages run forward only, one validation batch at a time, with torch's stage and schedule."""

    def __init__(
        self,
        stages: list[nn.Module],
        ids: list[int],
        *,
        total: int,
        device: torch.device,
        group: Any,
        takes_tokens: bool = False,
    ) -> None:
        self.stages = stages
        #: Every stage's forward takes the batch's token ids too (``tokens=``: the document mask's source).
        self.takes_tokens = takes_tokens
        self.ids = ids
        self.total = total
        self.device = device
        self.group = group
        self.first = 0 in ids
        self.last = total - 1 in ids
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        #: The input the last stage's ``validation_step`` must forward next (None: not inside validation).
        self._expected: torch.Tensor | None = None

    def run(self, x: torch.Tensor) -> torch.Tensor | None:
        """One batch through this rank's stages: the logits on the last stage, None on the others."""
        schedule = self._schedule_for(x)
        # Every stage of a replica holds the batch: the ones after the first take its token ids from it.
        kwarg_mbs = [{"tokens": x}] if self.takes_tokens else None
        if self.first:
            return schedule.eval(arg_mbs=[(x,)], kwarg_mbs=kwarg_mbs)
        return schedule.eval(kwarg_mbs=kwarg_mbs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The held parts' forward on the last stage, inside ``validation_step``: this batch's logits."""
        if self._expected is None:
            raise RuntimeError(
                "under parallel.pipeline the model runs whole only inside validation, where every stage of the "
                "replica joins its forward; call self.model(x) from validation_step only"
            )
        if x is not self._expected:
            raise RuntimeError(
                "under parallel.pipeline validation_step must call self.model(x) once, with the batch's first "
                "element x (the input the first stage received)"
            )
        self._expected = None
        return self.run(x)

    @contextlib.contextmanager
    def expecting(self, x: torch.Tensor) -> Iterator[None]:
        """The last stage: ``validation_step`` runs inside, and must forward ``x`` through the model once."""
        self._expected = x
        try:
            yield
            if self._expected is not None:
                raise RuntimeError(
                    "under parallel.pipeline validation_step must call self.model(x) once per batch: the other "
                    "stages have sent this batch's activations to the last stage"
                )
        finally:
            self._expected = None

    def _schedule_for(self, x: torch.Tensor) -> Any:
        """The forward-only schedule for inputs shaped like ``x``: kept, or built (its stages infer the shape)."""
        from torch.distributed import pipelining

        key = (tuple(x.shape), x.dtype)
        schedule = self._schedules.get(key)
        if schedule is not None:
            self._schedules.move_to_end(key)
            return schedule
        stages = [
            pipelining.PipelineStage(_ForwardOf(module), i, self.total, self.device, group=self.group)
            for module, i in zip(self.stages, self.ids)
        ]
        if len(stages) == 1:
            schedule = pipelining.ScheduleGPipe(stages[0], n_microbatches=1)
        else:
            # Several stages a rank (interleaved): breadth first, one microbatch.
            schedule = pipelining.ScheduleLoopedBFS(stages, n_microbatches=1)
        self._schedules[key] = schedule
        if len(self._schedules) > KEPT_SHAPES:
            self._schedules.popitem(last=False)
        return schedule


class _ForwardOf(nn.Module):
    """A stage's forward, the stage itself kept out of ``modules()``.

    A new ``PipelineStage`` infers its shapes with a real forward and then reshards every FSDP2 module it finds
    among its module's submodules (torch's ``_post_metadata_inference_cleanup``): under fsdp2 that would free the
    parameters gathered for the whole validation, and the next forward would all-gather over the replicas, which
    may hold fewer batches and never join. Hidden, the stage keeps them; with no gradients and eval-mode buffers,
    nothing else of that cleanup applies.
    """

    def __init__(self, stage: nn.Module):
        super().__init__()
        # A tuple: not registered as a submodule.
        self._stage = (stage,)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._stage[0](*args, **kwargs)
