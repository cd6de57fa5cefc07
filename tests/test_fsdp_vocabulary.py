"""``parallel.fsdp.shard_vocabulary`` on real Gloo ranks: the embedding and the head split by vocabulary rows over
fsdp2's ranks compute what whole matrices compute (the lookup bit for bit, the logits and gradients to float64's
rounding) for ranks with different batches, no training step makes a whole ``[vocab, dim]`` tensor, and a Trainer
run trains, validates and resumes like a world of one. (Not compared in float64 through the Trainer: FSDP2 reduces
gradients in float32 whatever the parameters' type, so plain fsdp2 itself differs from a world of one by 1.5e-6 of
a weight after 8 float64 steps, as much as with the vocabulary split.)

    .venv/bin/pytest -q tests/test_fsdp_vocabulary.py
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise_equal, run_in_pool
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from trainer_layouts import (
    BOUND,
    RaggedTrainer,
    assert_close_to,
    fit,
    fit_alone,
    fit_first_half,
    fit_validated,
    layout_config,
)

from ddpkit.config.loader import load_config
from ddpkit.errors import ConfigError

pytestmark = pytest.mark.timeout(300)

VOCAB, DIM = 48, 8


class _Pair(nn.Module):
    """An embedding and a head, as ddpkit's language models name them, with a nonlinearity between."""

    def __init__(self, *, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def _against_whole_matrices(tied: bool) -> dict:
    """Each rank a batch of its own shape (rank 2: none at all) through the split pair and the whole one."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ddpkit.parallel.fsdp_vocabulary import shard_vocabulary, whole_vocabulary

    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    whole = _Pair(tied=tied).double()
    split = copy.deepcopy(whole)
    ignored = shard_vocabulary(split, init_device_mesh("cpu", (ranks,)))
    g = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, VOCAB, ([3, 1, 0][rank], 2 + rank), generator=g)
    weights = torch.randn(*ids.shape, VOCAB, generator=g, dtype=torch.float64)
    lookups = (whole.embed(ids), split.embed(ids))
    logits = (whole(ids), split(ids))
    for out in logits:
        (out * weights).sum().backward()
    # FSDP2's gradient: the mean over the ranks of each rank's own
    expected = {}
    for name, param in whole.named_parameters():
        dist.all_reduce(param.grad)
        expected[name] = param.grad / ranks
    got = {name: param.grad.full_tensor() for name, param in split.named_parameters()}
    alone = []
    with whole_vocabulary(split):
        # no collective inside: rank 0 alone runs forwards
        if rank == 0:
            alone = [torch.equal(whole(ids), split(ids)), torch.equal(whole.embed(ids), split.embed(ids))]
    return {
        "lookup": torch.equal(*lookups),
        "logits": float((logits[0] - logits[1]).abs().max()) if ids.numel() else 0.0,
        "gradients": {name: float((got[name] - expected[name]).abs().max()) for name in expected},
        "held": {name: tuple(p.to_local().shape) for name, p in split.named_parameters()},
        "ignored": len(ignored),
        "alone": alone,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_split_rows_compute_what_whole_matrices_do_for_ranks_with_different_batches(tied):
    results = run_in_pool(_against_whole_matrices, 3, args=(tied,), timeout=120)
    for rank, result in enumerate(results):
        assert result["lookup"], rank
        assert result["logits"] < 1e-12, (rank, result)
        assert max(result["gradients"].values()) < 1e-12, (rank, result)
        # a tied matrix is one parameter, split once
        assert (
            result["held"] == {"embed.weight": (VOCAB // 3, DIM)}
            if tied
            else {
                "embed.weight": (VOCAB // 3, DIM),
                "head.weight": (VOCAB // 3, DIM),
            }
        )
        assert result["ignored"] == (1 if tied else 2)
    assert results[0]["alone"] == [True, True]


def _split(out: Path, **options) -> dict:
    cfg = layout_config(out, mode="fsdp2", **options)
    cfg["parallel"]["fsdp"] = {"shard_vocabulary": True}
    return cfg


@pytest.mark.multiprocess
def test_fsdp2_with_the_vocabulary_split_trains_and_validates_like_a_world_of_one(tmp_path):
    one = layout_config(tmp_path / "one")
    one["train"]["eval_every"] = 4
    reference = run_in_pool(fit_validated, 1, args=(one,), timeout=120)[0]
    cfg = _split(tmp_path / "split")
    cfg["train"]["eval_every"] = 4
    results = run_in_pool(fit_validated, 2, args=(cfg,), timeout=200)
    assert_close_to(results, reference)
    for result in results:
        assert result["metrics"]["val_loss"] == pytest.approx(reference["metrics"]["val_loss"], rel=BOUND)
        assert result["metrics"]["val_accuracy"] == reference["metrics"]["val_accuracy"]


class ShapeWatch(TorchDispatchMode):
    """Every shape of a plain tensor an op makes while it is on."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            # memory is plain tensors: a DTensor op is seen with its global shape, then its local ops
            if type(tensor) is torch.Tensor:
                self.shapes.add(tuple(tensor.shape))
        return out


class TrainingShapes(RaggedTrainer):
    """The shapes every op makes from the first step's start to the last step's end (set-up and the end's outputs
    left out: initialisation draws each tensor whole by design, ``model.pt`` is the whole model)."""

    def on_fit_start(self) -> None:
        self.watch = ShapeWatch()
        self.watch.__enter__()

    def on_step_end(self, step: int) -> None:
        if step == self.config.train.max_steps:
            self.watch.__exit__(None, None, None)


def _training_shapes(cfg: dict) -> list[tuple[int, ...]]:
    trainer = TrainingShapes(cfg)
    trainer.fit()
    return sorted(trainer.watch.shapes)


@pytest.mark.multiprocess
@pytest.mark.parametrize("split", [True, False], ids=["split", "fsdp2_s_units"])
def test_no_training_step_makes_a_whole_vocabulary_matrix(tmp_path, split):
    """The vocabulary matrices are ``[50, 32]``: split, no op of a step makes one (the lookups' and the scores'
    gradients are ``[25, 32]``); as FSDP2's units, the all-gathers and the gradients do, which shows the check
    sees them."""
    cfg = _split(tmp_path / "run", steps=2) if split else layout_config(tmp_path / "run", steps=2, mode="fsdp2")
    cfg["checkpoint"] = {"every_epochs": None, "every_steps": None}
    for shapes in run_in_pool(_training_shapes, 2, args=(cfg,), timeout=120):
        assert ((50, 32) in shapes) is not split, shapes
        if split:
            assert (25, 32) in shapes


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_with_the_vocabulary_split_resumes_in_a_world_of_one_and_back(tmp_path):
    reference = fit_alone(tmp_path / "one")
    run_in_pool(fit_first_half, 2, args=(_split(tmp_path / "a"),), timeout=200)
    resumed = run_in_pool(fit, 1, args=(layout_config(tmp_path / "a"),), timeout=120)[0]
    assert resumed["metrics"]["step"] == 8
    assert_close_to([resumed], reference)
    # a world of one's checkpoint, then fsdp2 with the vocabulary split: each rank takes its rows
    run_in_pool(fit_first_half, 1, args=(layout_config(tmp_path / "b"),), timeout=120)
    split = run_in_pool(fit, 2, args=(_split(tmp_path / "b"),), timeout=200)
    assert split[0]["metrics"]["step"] == 8
    assert_close_to(split, reference)
    assert_bitwise_equal(split[0]["weights"], split[1]["weights"])


@pytest.mark.parametrize(
    "parallel, named",
    [
        ({"mode": "ddp"}, "parallel.mode=ddp"),
        ({"mode": "fsdp2", "tensor": 2}, "parallel.tensor=2"),
        ({"mode": "fsdp2", "pipeline": 2}, "parallel.pipeline=2"),
        ({"mode": "fsdp2", "replicate": 2}, "parallel.replicate=2"),
    ],
)
def test_a_split_vocabulary_outside_plain_fsdp2_is_refused_naming_the_setting(tmp_path, parallel, named):
    cfg = layout_config(tmp_path, **parallel)
    cfg["parallel"]["fsdp"] = {"shard_vocabulary": True}
    with pytest.raises(ConfigError, match=rf"parallel.fsdp.shard_vocabulary: .*{named}.*shard_vocabulary=false"):
        load_config(cfg)


def _refusal(kwargs: dict) -> str:
    from ddpkit.parallel.fsdp_vocabulary import shard_vocabulary

    model = nn.Sequential(nn.Linear(4, 4)) if kwargs.get("mlp") else _Pair(tied=False)
    if "vocab" in kwargs:
        model.embed, model.head = nn.Embedding(kwargs["vocab"], DIM), nn.Linear(DIM, kwargs["vocab"], bias=False)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        shard_vocabulary(model, init_device_mesh("cpu", (2,)))
    except ConfigError as error:
        return str(error)
    return "accepted"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "kwargs, says",
    [({"mlp": True}, "a Sequential has no such pair"), ({"vocab": 49}, "49 rows does not split evenly over 2")],
)
def test_a_model_the_split_cannot_take_is_refused_with_the_fix(kwargs, says):
    for message in run_in_pool(_refusal, 2, args=(kwargs,), timeout=60):
        assert says in message and "parallel.fsdp.shard_vocabulary=false" in message, message


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "parallel",
    [{"tensor": 2}, {"mode": "fsdp2", "fsdp": {"shard_vocabulary": True}}, {"pipeline": 2, "tensor": 2}],
    ids=["tp2", "vocabulary_split", "pp2_x_tp2"],
)
def test_a_padded_vocabulary_trains_like_a_world_of_one_where_the_head_s_output_is_a_dtensor_s_view(tmp_path, parallel):
    """50 ids padded to 52 rows (``valid_vocab``): the models and a pipeline's last stage set the padded ids' logits
    to -inf out of place, since under a tensor plan (the vocabulary replicated or sharded) or the split the head
    returns a view a custom autograd Function made (``to_local``, ``from_local``), which autograd forbids filling in
    place (it raised before)."""

    def padded(cfg: dict) -> dict:
        cfg["model"]["kwargs"] = {**cfg["model"]["kwargs"], "vocab_size": 52, "valid_vocab": 50}
        return cfg

    reference = run_in_pool(fit, 1, args=(padded(layout_config(tmp_path / "one")),), timeout=120)[0]
    ranks = 4 if "pipeline" in parallel else 2
    config = padded(layout_config(tmp_path / "split", **dict(parallel)))
    results = run_in_pool(fit, ranks, args=(config,), timeout=200)
    assert_close_to(results, reference)
