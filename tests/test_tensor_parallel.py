"""Tensor parallelism (ddpkit.parallel.tensor_plan) on real Gloo ranks: T = 2 against a world of one over 50 AdamW
steps (losses, clipping norms, weights), the collectives one step costs, FSDP2 over a (dp, tp) mesh, and the
models and degrees that cannot run tensor-parallel.

    .venv/bin/pytest -q tests/test_tensor_parallel.py

The data is a small training set seen over and over (four fixed batches), as a real run sees its corpus: with
fresh random tokens every step AdamW turns the rounding of a split sum (about 2e-7 of a gradient) into 8e-5 of a
weight within 50 steps at lr 1e-3, as it would any other change in the order of a sum; in float64 the same runs
agree to 1e-12 (asserted), so what differs is rounding and nothing else.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import cpu_runtime, run_in_pool
from tensor_harness import GPT2, GQA, VOCAB, fixed_batch, relative_l2, relative_max, tiny_model, train_counted, whole
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ddpkit.errors import ConfigError
from ddpkit.models.gpt import GPT
from ddpkit.models.llama import LlamaShape
from ddpkit.models.vocab_embedding import VocabParallelEmbedding
from ddpkit.parallel.tensor_plan import (
    Replicated,
    apply_tensor_parallel,
    check_tensor_plan,
    tensor_plan,
    valid_tensor_degrees,
    vocab_parallel_for,
)

pytestmark = pytest.mark.timeout(300)

#: Below every run's first gradient norm (about 1.0 to 1.5), so clipping acts from the first step.
CLIP = 0.5


def _determined(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights without GPT-2's key biases (the middle third of ``attn.qkv.bias``): their gradient is zero in exact
    arithmetic (a bias added to every key adds ``q . b`` to every score of a query, which softmax cancels), so AdamW
    drives them by rounding noise alone, in a world of one as much as under T = 2 (1.9e-4 apart after 50 steps)."""
    out = dict(weights)
    for name, bias in weights.items():
        if name.endswith("attn.qkv.bias"):
            q, _, v = bias.chunk(3)
            out[name] = torch.cat([q, v])
    return out


def _against_one(kind: str, steps: int, dtype: torch.dtype, *, vocab_parallel: bool, **options: Any) -> dict:
    """T = world size against the same model trained here alone (``options``: ``train_counted``'s): the relative
    differences and the counts."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_model(kind, dtype)
    model = apply_tensor_parallel(model, mesh, tensor_plan(model, vocab_parallel=vocab_parallel))
    every_dtensor = all(type(p).__name__ == "DTensor" for p in model.parameters())
    tp = train_counted(model, steps, clip=CLIP, vocab_parallel=vocab_parallel, **options)
    one = train_counted(tiny_model(kind, dtype), steps, clip=CLIP, vocab_parallel=vocab_parallel, **options)
    return {
        "losses": relative_max(tp["losses"], one["losses"]),
        "norms": relative_max(tp["norms"], one["norms"]),
        "weights": relative_max(_determined(tp["weights"]), _determined(one["weights"])),
        "weights_l2": relative_l2(_determined(tp["weights"]), _determined(one["weights"])),
        "first_norm": one["norms"][0],
        "counts": tp["counts"],
        "counts_alone": one["counts"],
        "every_dtensor": every_dtensor,
        "tied": model.head.weight is model.embed.weight,
    }


def _runs_against_one() -> dict:
    """Several comparisons in one spawn (each spawn costs seconds)."""
    return {
        # the vocabulary replicated (a run's parallel.vocab_parallel: false)
        "gqa": _against_one("gqa", 50, torch.float32, vocab_parallel=False),
        "qwen": _against_one("qwen", 50, torch.float32, vocab_parallel=False),
        "gpt2": _against_one("gpt2", 50, torch.float32, vocab_parallel=False),
        "gqa_float64": _against_one("gqa", 50, torch.float64, vocab_parallel=False),
        "qwen_accumulated": _against_one("qwen", 10, torch.float32, vocab_parallel=False, microbatches=2),
        # the vocabulary sharded (a run's default where it divides by T)
        "gqa_vocab": _against_one("gqa", 50, torch.float32, vocab_parallel=True),
        "qwen_vocab": _against_one("qwen", 50, torch.float32, vocab_parallel=True),
        "gpt2_vocab": _against_one("gpt2", 50, torch.float32, vocab_parallel=True),
        "qwen_vocab_float64": _against_one("qwen", 50, torch.float64, vocab_parallel=True, token_loss=True),
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_match_a_world_of_one_and_count_their_collectives():
    results = run_in_pool(_runs_against_one, world_size=2, timeout=280)
    assert results[0] == results[1]
    runs = results[0]
    for name, run in runs.items():
        assert run["every_dtensor"], name
        # clipping acted: the norm it clipped was the whole model's, as a world of one measures it
        assert run["first_norm"] > CLIP, name
        tolerance = 1e-12 if name.endswith("float64") else 1e-5
        assert run["losses"] < tolerance, (name, run)
        assert run["norms"] < tolerance, (name, run)
        # float32: each weight tensor's relative L2 error (elementwise, qwen's drifts to 1.2e-5 .. 4.7e-5 in
        # blocks.1.mlp.down_proj, depending on the machine's kernels: AdamW amplifying the split sums' rounding);
        # float64 elementwise, so the arithmetic is the same
        weights = run["weights"] if name.endswith("float64") else run["weights_l2"]
        assert weights < tolerance, (name, run)
        assert run["counts_alone"] == {}, name
        # a tied head is still one parameter with its embedding, replicated or sharded by vocabulary rows
        assert run["tied"] == (not name.startswith("gqa")), name
    # the vocabulary replicated, a step: per block two all-reduces forward (o_proj, down_proj) and two backward (the
    # inputs of q/k/v and of gate/up), one more per q/k norm; GPT-2 shards its MLP only (one each way); one for the
    # clipping norm
    assert runs["gqa"]["counts"] == {"c10d_functional.all_reduce": 4 * 2 + 1}
    assert runs["qwen"]["counts"] == {"c10d_functional.all_reduce": 6 * 2 + 1}
    assert runs["gpt2"]["counts"] == {"c10d_functional.all_reduce": 2 * 2 + 1}
    # two microbatches: each backward reduces its own activations' gradients and q/k norms' weight gradients
    assert runs["qwen_accumulated"]["counts"] == {"c10d_functional.all_reduce": 2 * 6 * 2 + 1}
    # the vocabulary sharded: the embedding's lookup, the head's input gradient, loss_parallel's three
    for name in ("gqa", "qwen", "gpt2"):
        vocab = runs[f"{name}_vocab"]["counts"]["c10d_functional.all_reduce"]
        assert vocab == runs[name]["counts"]["c10d_functional.all_reduce"] + 5, name


def _gradients_as_placed() -> dict:
    """Each parameter's gradient after two accumulated micro-batches of the vocabulary-sharded gqa (untied) and qwen
    (tied) models: its placements and local shape against its parameter's, and the embedding's against a world of
    one's gradient rows."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    found = {}
    for kind in ("gqa", "qwen"):
        model = apply_tensor_parallel(tiny_model(kind), mesh, tensor_plan(tiny_model(kind), vocab_parallel=True))
        alone = tiny_model(kind)
        found[f"{kind} made"] = []
        for step in range(2):
            x = fixed_batch(step)
            logits = whole(model(x[:, :-1]))
            with _EmbeddingGradients() as made:
                F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
            found[f"{kind} made"].append(made.shapes)
            F.cross_entropy(whole(alone(x[:, :-1])).flatten(0, 1), x[:, 1:].flatten()).backward()
        found[kind] = {
            name: (p.grad.placements == p.placements, p.grad.to_local().shape == p.to_local().shape)
            for name, p in model.named_parameters()
        }
        rows = model.embed.weight.grad.to_local()
        mine = alone.embed.weight.grad.chunk(dist.get_world_size())[dist.get_rank()]
        found[f"{kind} embed rows"] = float((rows - mine).abs().max() / mine.abs().max())
    return found


class _EmbeddingGradients(TorchDispatchMode):
    """The local shape of every embedding gradient an ``aten.embedding_dense_backward`` makes under it (a DTensor's:
    the rank's own tensor, as DTensor hands it to the op)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.embedding_dense_backward.default:
            self.shapes.append(tuple((out.to_local() if isinstance(out, DTensor) else out).shape))
        return out


@pytest.mark.multiprocess
def test_every_gradient_is_held_as_its_parameter_is_placed_the_embeddings_too():
    """A vocabulary-sharded embedding's backward makes only the rank's rows' gradient, ``[vocab / T, dim]``
    (ddpkit.models.vocab_embedding; torch's RowwiseParallel makes the whole matrix on every rank), and from the
    second micro-batch on, untied, only the rows of the ids it looked up, added into ``.grad`` in place
    (ddpkit.models.accumulate_in_place); every gradient is held as its parameter is placed, with a world of one's
    values."""
    for found in run_in_pool(_gradients_as_placed, 2):
        for kind in ("gqa", "qwen"):
            assert all(same == (True, True) for same in found[kind].values()), found[kind]
            assert found[f"{kind} embed rows"] < 1e-6, found
            dim = tiny_model(kind).embed.embedding_dim
            first, second = found[f"{kind} made"]
            assert first == [(VOCAB // 2, dim)], found
            if kind == "qwen":
                # tied: the head's and the embedding's gradients are summed by autograd first, as before
                assert second == [(VOCAB // 2, dim)], found
            else:
                # the ids this rank holds (and row 0, where the others' zeros land): fewer rows than its shard
                assert len(second) == 1 and second[0][0] < VOCAB // 2 and second[0][1] == dim, found


def _fsdp2_over_dp_tp(steps: int) -> dict:
    """FSDP2 over "dp" after the tensor plan over "tp" on a (2, 2) mesh, each dp replica half of every batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = apply_tensor_parallel(tiny_model("qwen", torch.float64), mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    alone = tiny_model("qwen", torch.float64)
    optimizer_alone = torch.optim.AdamW(alone.parameters(), lr=1e-3, weight_decay=0.1)
    norms = []
    for step in range(steps):
        x = fixed_batch(step)
        for net, opt, rows in ((model, optimizer, x.chunk(2)[dp_rank]), (alone, optimizer_alone, x)):
            F.cross_entropy(net(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten()).backward()
            norms.append(whole(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)).item())
            opt.step()
            opt.zero_grad()
    weights = {name: whole(p.detach()) for name, p in model.named_parameters()}
    placements = {name: str(p.placements) for name, p in model.named_parameters()}
    return {
        "weights": relative_max(weights, {name: p.detach() for name, p in alone.named_parameters()}),
        "norms": relative_max(norms[0::2], norms[1::2]),
        "q_proj": placements["blocks.0.attn.q_proj.weight"],
    }


@pytest.mark.multiprocess
def test_fsdp2_over_a_dp_tp_mesh_matches_a_world_of_one():
    results = run_in_pool(_fsdp2_over_dp_tp, world_size=4, args=(10,), timeout=280)
    for result in results:
        assert result["weights"] < 1e-12
        assert result["norms"] < 1e-12
        # sharded over tp by rows first, then FSDP2's dp shard of each tp shard
        assert result["q_proj"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"


def test_a_one_rank_mesh_is_the_plain_model_bitwise(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    model = apply_tensor_parallel(tiny_model("qwen"), init_device_mesh("cpu", (1,)))
    tp = train_counted(model, 5, clip=CLIP)
    one = train_counted(tiny_model("qwen"), 5, clip=CLIP)
    assert tp["losses"] == one["losses"]
    assert all(torch.equal(tp["weights"][k], one["weights"][k]) for k in one["weights"])
    # a tied head stays tied: one parameter under both names
    assert model.head.weight is model.embed.weight


def test_the_llama_plan_names_torchs_styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    plan = tensor_plan(tiny_model("qwen"))
    for name in ("q_proj", "k_proj", "v_proj"):
        assert isinstance(plan[f"blocks.1.attn.{name}"], ColwiseParallel)
    assert isinstance(plan["blocks.1.attn.o_proj"], RowwiseParallel)
    assert isinstance(plan["blocks.1.mlp.gate_proj"], ColwiseParallel)
    assert isinstance(plan["blocks.1.mlp.down_proj"], RowwiseParallel)
    assert isinstance(plan["blocks.1.attn"], PrepareModuleInput)
    assert "Shard(dim=2)" in repr(plan["blocks.1.attn.q_norm"])
    assert isinstance(plan["embed"], Replicated) and isinstance(plan["head"], Replicated)
    assert "blocks.0.attn.q_norm" not in tensor_plan(tiny_model("gqa"))
    vocab = tensor_plan(tiny_model("qwen"), vocab_parallel=True)
    assert isinstance(vocab["embed"], VocabParallelEmbedding) and isinstance(vocab["head"], ColwiseParallel)
    # GPT-2's fused qkv stays whole: a colwise split of [q | k | v] rows would not be whole heads
    gpt2 = tensor_plan(tiny_model("gpt2"))
    assert isinstance(gpt2["blocks.0.attn.qkv"], Replicated)
    assert isinstance(gpt2["blocks.0.fc"], ColwiseParallel)
    assert isinstance(gpt2["blocks.0.proj"], RowwiseParallel)


def test_a_user_model_brings_its_own_plan():
    with pytest.raises(ConfigError, match=r"tensor_plan\(model\)"):
        tensor_plan(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)))


@pytest.mark.parametrize(
    ("model", "tensor", "message"),
    [
        (LlamaShape(**GQA), 4, r"model.kwargs.kv_heads 2 is not divisible by 4 \(valid parallel.tensor .*: 1, 2\)"),
        (
            LlamaShape(**{**GQA, "heads": 6, "kv_heads": 6, "head_dim": 8}),
            4,
            r"model.kwargs.heads 6 is not divisible by 4",
        ),
        ({"arch": "llama", "dim": 48, "heads": 3}, 2, r"model.kwargs.heads 3 .* \(valid .*: 1\)"),
        ({"preset": "qwen2.5-0.5b"}, 4, r"model.kwargs.heads 14 .*kv_heads 2 .*\(valid .*: 1, 2\)"),
        ({"dim": 30, "heads": 5}, 16, r"the MLP width \(4 x model.kwargs.dim\) 120 is not divisible by 16"),
        (LlamaShape(**{**GQA, "dropout": 0.1}), 2, r"model.kwargs.dropout 0.1 .*OffsetBasedRNGTracker"),
        (GPT(**GPT2, dropout=0.1), 2, r"model.kwargs.dropout 0.1"),
        (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2)), 2, r"the model's nn.Dropout p 0.2 cannot run"),
        (LlamaShape(**GQA), 0, r"parallel.tensor: expected a positive integer, got 0"),
    ],
)
def test_degrees_a_model_cannot_take_are_refused_by_name(model, tensor, message):
    with pytest.raises(ConfigError, match=message):
        check_tensor_plan(model, tensor)


def test_a_sharded_vocabulary_must_divide_and_cannot_be_padded():
    odd = LlamaShape(**{**GQA, "vocab_size": 257})
    check_tensor_plan(odd, 2)
    with pytest.raises(ConfigError, match=r"model.kwargs.vocab_size 257 is not divisible by 2 \(valid .*: 1\)"):
        check_tensor_plan(odd, 2, vocab_parallel=True)
    padded = {"arch": "llama", "vocab_size": 64, "valid_vocab": 60}
    check_tensor_plan(padded, 2)
    with pytest.raises(ConfigError, match=r"model.kwargs.valid_vocab 60 pads the vocabulary"):
        check_tensor_plan(padded, 2, vocab_parallel=True)
    assert valid_tensor_degrees(tiny_model("gpt2"), vocab_parallel=True) == [1, 2, 4, 8, 16, 32, 64]


def test_a_run_shards_the_vocabulary_by_default_where_it_divides_and_has_no_padding():
    # parallel.vocab_parallel: null (the default) resolved against the model
    assert vocab_parallel_for(LlamaShape(**GQA), 2, None) is True
    assert vocab_parallel_for(tiny_model("gpt2"), 4, None) is True
    assert vocab_parallel_for({"arch": "llama", "vocab_size": 50}, 2, None) is True
    # 50 ids do not split 4-way; padded ids could not be masked on a shard; nothing to shard at T = 1
    assert vocab_parallel_for({"arch": "llama", "vocab_size": 50}, 4, None) is False
    assert vocab_parallel_for({"arch": "llama", "vocab_size": 64, "valid_vocab": 60}, 2, None) is False
    assert vocab_parallel_for(LlamaShape(**GQA), 1, None) is False
    # a user's model: its plan is its own
    assert vocab_parallel_for(nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64)), 2, None) is False
    # set explicitly: as set (true on a vocabulary that does not divide is refused by check_tensor_plan)
    assert vocab_parallel_for(LlamaShape(**GQA), 2, False) is False
    assert vocab_parallel_for({"arch": "llama", "vocab_size": 50}, 4, True) is True


def test_the_degrees_a_model_can_take():
    check_tensor_plan(LlamaShape(**GQA), 2)
    check_tensor_plan(LlamaShape(**{**GQA, "dropout": 0.1}), 1)
    check_tensor_plan(nn.Sequential(nn.Linear(4, 4)), 8)
    assert valid_tensor_degrees({"preset": "llama3.2-1b"}) == [1, 2, 4, 8]
    assert valid_tensor_degrees(tiny_model("gpt2")) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert valid_tensor_degrees(nn.Linear(4, 4)) is None


@pytest.mark.parametrize("kind", ["gqa", "qwen"])
def test_the_estimate_splits_a_vocabulary_matrix_once_tied_or_not(kind):
    """``ddpkit estimate``'s per-rank shapes under tp2 with the vocabulary sharded: the embedding and the head hold
    ``vocab / 2`` rows each; a tied head, one matrix under two styles, is split once, not twice."""
    from ddpkit.training.footprint import _tensor_shard_shapes

    model = tiny_model(kind)
    shapes = _tensor_shard_shapes(model, list(model.parameters()), 2, True)
    dim = model.embed.embedding_dim
    assert shapes[id(model.embed.weight)] == shapes[id(model.head.weight)] == (VOCAB // 2, dim)
    assert shapes[id(model.blocks[0].attn.q_proj.weight)] == (model.blocks[0].attn.q_proj.out_features // 2, dim)


def test_ddp_s_wrapper_leaves_a_model_already_on_its_device_as_it_is(tmp_path):
    """``ddp.wrap_model`` (one replica: no DDP) on a tensor-parallel model already on its device leaves its
    parameters with their hooks. DTensor's ``.to()`` makes a new tensor even to its own device, and
    ``Module._apply`` swaps it into the parameter, dropping the gradient hooks on it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor as Distributed

    from ddpkit.config.schema import DDPConfig
    from ddpkit.distributed.ddp import wrap_model

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    model = apply_tensor_parallel(tiny_model("qwen"), init_device_mesh("cpu", (1,)))
    seen = []
    model.norm.weight.register_hook(lambda grad: seen.append(type(grad)) or grad)
    assert wrap_model(model, cpu_runtime(world_size=1), DDPConfig()) is model
    F.cross_entropy(model(fixed_batch(0)[:, :-1]).flatten(0, 1), fixed_batch(0)[:, 1:].flatten()).backward()
    assert seen == [Distributed]
