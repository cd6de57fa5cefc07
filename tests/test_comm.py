"""Communication options on 2 real Gloo ranks: compression hooks, and one allreduce per bucket per step.

Hook invocations are counted by wrapping ``DistributedDataParallel.register_comm_hook`` inside the
rank processes: every hook DDP runs (one per gradient bucket each time gradients are reduced)
passes through the counter, so the count is exactly the number of bucket allreduces.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import assert_bitwise_equal, load_weights, run_in_pool, tiny_config
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpkit
from ddpkit.parallel.data_parallel import DataParallel

pytestmark = pytest.mark.multiprocess

HOOK_NAMES = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook", "powersgd": "powerSGD_hook"}


@contextmanager
def _count_bucket_reductions() -> Iterator[list[int]]:
    """Within the block, route every registered comm hook through a counter; yield the list of reduced bucket
    indices.

    For ``comm_hook: none`` (DDP's built-in allreduce, which has no Python hook) the Trainer's model
    gets torch's own ``allreduce_hook`` registered, through the same counter. Both patches end with the block:
    the rank runs other tests' functions next.
    """
    calls: list[int] = []
    register = DDP.register_comm_hook

    def counting_register(self, state, hook):
        def counted(state, bucket):  # DDP checks the parameter is named `bucket`
            calls.append(bucket.index())
            return hook(state, bucket)

        counted.__name__ = hook.__name__
        return register(self, state, counted)

    wrap = DataParallel.wrap  # where the Trainer's model building wraps in DDP

    def wrap_and_count(self, model, runtime, options, *, group=None):
        wrapped = wrap(self, model, runtime, options, group=group)
        if options.comm_hook == "none" and isinstance(wrapped, DDP):
            wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
        return wrapped

    with (
        mock.patch.object(DDP, "register_comm_hook", counting_register),
        mock.patch.object(DataParallel, "wrap", wrap_and_count),
    ):
        yield calls


class _PerStep(ddpkit.Trainer):
    """Snapshots the bucket indices reduced during each optimizer step."""

    calls: list[int]
    per_step: list[list[int]]

    def on_fit_start(self) -> None:
        self.per_step, self._seen = [], len(self.calls)

    def on_step_end(self, step: int) -> None:
        self.per_step.append(self.calls[self._seen :])
        self._seen = len(self.calls)


class _NotesHook(ddpkit.Trainer):
    """Notes the comm hook registered on the DDP wrapper (fit() lets go of the wrapper when it ends)."""

    def on_fit_start(self) -> None:
        self.registered = self.placed.models.train._comm_hooks[0][0].__name__


def _train_with_each_hook(tmp: Path) -> dict:
    out = {}
    with _count_bucket_reductions() as calls:
        for hook in ("none", "fp16", "bf16", "powersgd"):
            before = len(calls)
            trainer = _NotesHook(tiny_config(tmp / hook, ddp={"comm_hook": hook, "powersgd_start_iter": 2}))
            trainer.fit()
            out[hook] = {
                "calls": len(calls) - before,
                "registered": trainer.registered,
                "weights": {k: v.clone() for k, v in trainer.unwrapped_model.state_dict().items()},
            }
    return out


def _accumulate(tmp: Path, accum: int) -> dict:
    # Tiny buckets (about 1 KB), so the MLP's gradients travel in two: [fc2 weight + bias], [fc1 weight + bias].
    config = tiny_config(tmp, train={"grad_accum_steps": accum, "epochs": 2}, ddp={"bucket_cap_mb": 0.001})
    with _count_bucket_reductions() as calls:
        _PerStep.calls = calls
        trainer = _PerStep(config)
        trainer.fit()
    return {"per_step": trainer.per_step, "steps": trainer.progress.step}


def test_compression_hooks_train_and_ranks_end_bitwise_identical(tmp_path):
    results = run_in_pool(_train_with_each_hook, world_size=2, args=(tmp_path,), timeout=150)
    for hook in ("fp16", "bf16", "powersgd"):
        for rank in (0, 1):
            assert results[rank][hook]["registered"] == HOOK_NAMES[hook]
            assert results[rank][hook]["calls"] > 0
            assert all(torch.isfinite(t).all() for t in results[rank][hook]["weights"].values())
        # Nothing is broadcast after training: equal weights mean the hook gave both ranks the
        # same reduced gradients at every step.
        assert_bitwise_equal(results[0][hook]["weights"], results[1][hook]["weights"])
        assert_bitwise_equal(results[0][hook]["weights"], load_weights(tmp_path / hook / "run/model.pt"))
    # PowerSGD's rank-1 approximation changes the result: the hook ran past its start iteration; and the
    # compressed reductions really are compressed (another rounding than fp32's).
    none = results[0]["none"]["weights"]
    for hook in ("fp16", "bf16", "powersgd"):
        other = results[0][hook]["weights"]
        assert any(not torch.equal(none[k], other[k]) for k in none), hook


def test_gradient_accumulation_reduces_each_bucket_once_per_optimizer_step(tmp_path):
    k = 3
    results = run_in_pool(_accumulate, world_size=2, args=(tmp_path, k), timeout=120)
    # 8 micro-batches per epoch: optimizer steps after micro-batches 3, 6 and 8 (the short tail), 2 epochs.
    assert results[0]["steps"] == results[1]["steps"] == 6
    for result in results:
        per_step = result["per_step"]
        assert len(per_step) == 6
        buckets = len(set(per_step[-1]))
        assert buckets >= 2, "the test wants several buckets"
        for indices in per_step[1:]:  # after the first step DDP has settled its bucket order
            assert sorted(indices) == list(range(buckets))  # each bucket exactly once, not k times
        assert len(per_step[0]) == len(set(per_step[0]))  # the first step too: once per bucket
