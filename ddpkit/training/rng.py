"""Seeding and capturing / restoring every random number generator a training step may use.

A checkpoint stores each rank's generator states so a resumed run draws exactly the numbers the
uninterrupted run would have drawn (dropout masks, augmentations): the key to bitwise resume.
States are stored as tensors, tuples and ints only, so they load with ``weights_only=True``.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch

from ddpkit.distributed.collectives import all_gather_object

__all__ = [
    "seed_everything",
    "seed_for_setup",
    "rank_seed",
    "STAGE_STRIDE",
    "use_deterministic_kernels",
    "capture_rng",
    "restore_rng",
    "RngStreams",
]

#: How far apart two pipeline stages' seeds are: a prime far above any rank count, so no stage's ranks share a seed
#: with another stage's (nor, for nearby ``run.seed`` values, with another run's stage).
STAGE_STRIDE = 1_000_003


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy (if installed) and torch (CPU and every CUDA device)."""
    random.seed(seed)
    # Also seeds every CUDA device.
    torch.manual_seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)


def seed_for_setup(seed: int, *, deterministic: bool) -> None:
    """Seed every rank alike, so the initial weights and data are identical before DDP checks them (and, with
    ``train.deterministic``, make the kernels deterministic before the first one runs)."""
    if deterministic:
        use_deterministic_kernels()
    seed_everything(seed)


def rank_seed(seed: int, *, rank: int, world_size: int, stage: int = 0, stages: int = 1, tensor: int = 1) -> int:
    """The seed rank ``rank`` of a fresh run draws from (dropout masks, augmentations): ``run.seed``, the rank's
    pipeline stage and its place among that stage's ranks.

    Without a pipeline it is ``seed + rank``, as it always was: each rank is a replica reading other samples, and
    draws its own masks. Under a pipeline each stage holds other layers, and seeding the stages alike would repeat
    one stage's masks in the next (torchtitan and Megatron seed each pipeline rank apart): stage ``k``'s ranks, the
    ``world_size / stages`` neighbours the mesh gives it (pipeline outermost), draw from ``seed + k * STAGE_STRIDE``
    plus their place among them. So a stage's seeds depend on the run's seed and the stage, not on the global rank
    alone: stage 1 of replica 0 draws the same stream on 2 ranks (pp2) as on 4 (pp2 x dp2), and every launch of the
    same run draws the same masks.

    Under tensor parallelism (``tensor`` > 1) the ``tensor`` ranks of one replica (neighbours: the mesh holds the
    tensor dimension innermost) compute one model on one batch, so they share a seed: a dropout on an activation
    they all hold whole must draw one mask on all of them, and DTensor's RNG tracker (CUDA) draws a sharded
    activation's slices from one shared stream, each rank at its own offset, as a world of one draws the whole.
    """
    per_stage = world_size // stages
    return seed + STAGE_STRIDE * stage + (rank - stage * per_stage) // tensor


def use_deterministic_kernels() -> None:
    """Make CUDA kernels deterministic (``train.deterministic``): the same inputs give the same bits.

    Without it a GPU run is not bitwise reproducible, resumed or not: cuDNN's convolution backward
    and some cuBLAS paths accumulate with atomics in a varying order (seen on an H100: a resumed fp32
    CNN run ended 6e-8 away from the straight one). torch raises on an operation that has no
    deterministic kernel, naming it. cuBLAS needs its workspace setting before its first call. Without
    CUDA nothing is changed: the CPU's kernels are deterministic already.
    """
    if not torch.cuda.is_available():
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def capture_rng() -> dict[str, Any]:
    """This process's generator states, in a ``weights_only``-loadable form."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the generator states saved by :func:`capture_rng`."""
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = _numpy()
    if "numpy" in state and np is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _as_tuple(value: Any) -> Any:
    """Python's RNG state is nested tuples; make sure a loaded copy is too."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class RngStreams:
    """Every rank's generators as one part of the run's state (registered as ``rng``).

    ``state_dict()`` gathers each rank's :func:`capture_rng` in rank order (a collective: every rank
    calls it, as every rank captures a checkpoint); ``load_state_dict`` restores this rank's own
    streams, or rank 0's when the run resumes on another world size (``data.global_batch_size``).
    There, under a pipeline (``stage``: this rank's pipeline coordinate), the ranks of stage ``k > 0``
    draw one number from rank 0's streams and seed from it and their stage, as :func:`rank_seed` does
    (``+ k * STAGE_STRIDE``): every stage resuming rank 0's streams would repeat its masks in the next.
    """

    def __init__(self, *, rank: int, world_size: int, stage: int = 0):
        self.rank = rank
        self.world_size = world_size
        self.stage = stage

    def state_dict(self) -> list[dict[str, Any]]:
        return all_gather_object(capture_rng())

    def load_state_dict(self, streams: list[dict[str, Any]]) -> None:
        if len(streams) == self.world_size:
            restore_rng(streams[self.rank])
            return
        restore_rng(streams[0])
        if self.stage > 0:
            # From the checkpoint alone: the same streams in every launch, each stage's its own
            seed_everything(int(torch.randint(2**62, (1,))) + STAGE_STRIDE * self.stage)
