"""The vocabulary matrices' micro-batch gradients added into ``.grad`` in place (ddpkit.models.accumulate_in_place).

What must hold: autograd's bits, micro-batch after micro-batch (one rank, under DDP, and under a tensor plan with
and without sequence parallelism); no second whole matrix made once ``.grad`` exists (a check shown to fail on
autograd's own path); and the cases it must stay out of. The Trainer's layouts run it everywhere (``parallelize``'s
``prepare``), so their tests against a world of one check it end to end as well.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bitwise_equal, run_in_pool
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ddpkit.models import accumulate_in_place
from ddpkit.models.accumulate_in_place import rebind_vocabulary

pytestmark = pytest.mark.timeout(300)

VOCAB, DIM = 300, 16


class _Pair(nn.Module):
    """An embedding and a head, as ddpkit's language models name them, with a layer between."""

    def __init__(self, *, tied: bool = False, bias: bool = False, padding_idx: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=bias)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _micro_batches(count: int, *, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches whose ids repeat within each (only 40 of the vocabulary drawn), so rows sum several terms."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 40, (3, 17), generator=g), torch.randint(0, VOCAB, (3, 17), generator=g))
        for _ in range(count)
    ]


def _accumulate(model: nn.Module, batches: list) -> dict[str, torch.Tensor]:
    for ids, targets in batches:
        F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_three_micro_batches_accumulate_autograd_s_bits(dtype, monkeypatch):
    # a block of 64 rows: the head's gradient is added in five blocks, the last one short
    monkeypatch.setattr(accumulate_in_place, "BLOCK_BYTES", 64 * DIM * torch.tensor([], dtype=dtype).element_size())
    torch.manual_seed(0)
    plain = _Pair().to(dtype)
    rebound = copy.deepcopy(plain)
    assert rebind_vocabulary(rebound) == ["embed", "head"]
    batches = _micro_batches(3)
    assert_bitwise_equal(_accumulate(plain, batches), _accumulate(rebound, batches))


class _Sizes(TorchDispatchMode):
    """The largest storage any op makes while it is on: an in-place op's output (its input), a view and an expanded
    zero make none of their own."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {
            a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
        }
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in given:
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("rebound", [True, False], ids=["in-place", "autograd-s-own"])
def test_once_grad_exists_no_op_makes_a_second_vocabulary_matrix(rebound, monkeypatch):
    # the head's gradient made 60 rows at a time (a fifth of the matrix); by default a block is 8 MiB
    block = 60 * DIM * 4
    monkeypatch.setattr(accumulate_in_place, "BLOCK_BYTES", block)
    torch.manual_seed(0)
    model = _Pair()
    if rebound:
        rebind_vocabulary(model)
    _accumulate(model, _micro_batches(1))
    # 4 tokens (one id thrice): their logits and its gradients are far smaller than the [VOCAB, DIM] matrix
    ids, targets = torch.tensor([[1, 2, 1, 1]]), torch.tensor([[5, 6, 7, 8]])
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    matrix = VOCAB * DIM * 4
    with _Sizes() as sizes:
        loss.backward()
    if rebound:
        # the largest is the logits' gradient (4 x VOCAB floats), then a block
        assert sizes.largest == 4 * VOCAB * 4 < matrix / 2, sizes.largest
    else:
        # the check can fail: autograd's own backward makes the whole matrix (the embedding's and the head's)
        assert sizes.largest >= matrix


def test_a_run_of_micro_batches_under_autocast_is_autograd_s_own():
    torch.manual_seed(0)
    plain = _Pair()
    rebound = copy.deepcopy(plain)
    rebind_vocabulary(rebound)
    batches = _micro_batches(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads = [_accumulate(plain, batches), _accumulate(rebound, batches)]
    assert_bitwise_equal(*grads)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [({"tied": True}, []), ({"bias": True}, ["embed"]), ({"padding_idx": 0}, ["head"])],
    ids=["tied", "head-with-bias", "padding-idx"],
)
def test_the_cases_it_stays_out_of_keep_their_forward(kwargs, expected):
    model = _Pair(**kwargs)
    assert rebind_vocabulary(model) == expected
    for name in ("embed", "head"):
        assert ("forward" in vars(getattr(model, name))) == (name in expected)


def test_a_frozen_matrix_takes_autograd_s_path():
    model = _Pair()
    rebind_vocabulary(model)
    model.head.weight.requires_grad_(False)
    ids, targets = _micro_batches(1)[0]
    for _ in range(2):
        F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
    assert model.head.weight.grad is None and model.embed.weight.grad is not None


def _under_ddp(bucket_view: bool) -> dict[str, bool]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = _Pair()
    results = {}
    grads = []
    for rebound in (False, True):
        model = copy.deepcopy(base)
        if rebound:
            rebind_vocabulary(model)
        ddp = DDP(model, gradient_as_bucket_view=bucket_view)
        batches = _micro_batches(3, seed=10 + dist.get_rank())
        # two steps: with bucket_view the second runs with .grad already a view of DDP's bucket, zeroed in place, so
        # even its first micro-batch adds into the bucket
        for _ in range(2):
            model.zero_grad(set_to_none=not bucket_view)
            with ddp.no_sync():
                for ids, targets in batches[:-1]:
                    F.cross_entropy(ddp(ids).flatten(0, 1), targets.flatten()).backward()
            ids, targets = batches[-1]
            F.cross_entropy(ddp(ids).flatten(0, 1), targets.flatten()).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    results["bitwise"] = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    # DDP averaged them: every rank holds the same gradients
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grads[1]["embed.weight"])
    results["agreed"] = all(torch.equal(gathered[0], g) for g in gathered)
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("bucket_view", [True, False], ids=["grad-as-bucket-view", "grad-copied"])
def test_under_ddp_the_reducer_still_sees_each_matrix_and_averages_autograd_s_bits(bucket_view):
    # ddp.gradient_as_bucket_view is on by default in ddpkit: .grad is then a view of DDP's bucket
    for result in run_in_pool(_under_ddp, 2, args=(bucket_view,), timeout=120):
        assert result == {"bitwise": True, "agreed": True}


def _under_a_tensor_plan(sequence_parallel: bool, tied: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    from ddpkit.models import tensor_plans
    from ddpkit.models.gpt import build_gpt
    from ddpkit.models.vocab_embedding import VocabParallelEmbedding

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    shape = {"arch": "llama", "vocab_size": 64, "dim": 32, "depth": 2, "heads": 4, "kv_heads": 2, "mlp_dim": 64}
    base = build_gpt({**shape, "max_len": 16, "tied": tied}).double()
    grads, styles = [], []
    for in_place in (False, True):
        model = copy.deepcopy(base)
        plan = tensor_plans.llama_plan(model, vocab_parallel=True, sequence_parallel=sequence_parallel)
        if not in_place:
            # the styles as they were: autograd's own backward for both matrices
            stream = Shard(1) if sequence_parallel else Replicate()
            embed = VocabParallelEmbedding(output_layout=stream, in_place=False)
            plan["embed"] = tensor_plans.SequenceSplit(embed) if sequence_parallel else embed
            plan["head"] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
        else:
            styles = [repr(plan["embed"]), repr(plan["head"])]
        parallelize_module(model, mesh, plan)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            ids, targets = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
            with loss_parallel():
                F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
        grads.append({name: p.grad.full_tensor() for name, p in model.named_parameters()})
    return {"differ": [n for n in grads[0] if not torch.equal(grads[0][n], grads[1][n])], "styles": styles}


@pytest.mark.multiprocess
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated-stream", "sequence-parallel"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_vocabulary_parallel_styles_accumulate_autograd_s_bits(sequence_parallel, tied):
    for result in run_in_pool(_under_a_tensor_plan, 2, args=(sequence_parallel, tied), timeout=120):
        assert result["differ"] == []
        # a tied matrix keeps autograd's order: the two uses' gradients summed before .grad
        assert all(f"in_place={not tied}" in style for style in result["styles"]), result["styles"]
