"""Loss weighted by tokens: the same global batch split into ranks (1, 2 and 3) and micro-batches in different
ways ends with the same weights under ``train.loss_normalization: tokens`` (and not under ``mean``),
on real Gloo ranks; a plain tensor under ``tokens`` is refused with the expected return shown.

    .venv/bin/pytest -q tests/test_token_loss.py
"""

from __future__ import annotations

import pytest
import torch
from helpers import RaggedSequences, run_in_pool

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.training.token_loss import TokenCount, split_loss

pytestmark = pytest.mark.timeout(240)

# 12: split over 1, 2, 3 and 4 ranks, with and without accumulation.
GLOBAL_BATCH = 12


class RaggedTrainer(ddpkit.Trainer):
    def build_datasets(self):
        return RaggedSequences(), None


def _fit(tmp, world_size: int, accum: int, normalization: str, mode: str = "ddp") -> list[torch.Tensor]:
    cfg = {
        "run": {
            "name": f"{normalization}-{mode}-{world_size}x{accum}",
            "output_dir": f"{tmp}/{normalization}-{mode}-{world_size}x{accum}",
            "seed": 3,
        },
        "data": {"global_batch_size": GLOBAL_BATCH, "order": "index_free"},
        "model": {"name": "gpt", "kwargs": {"vocab_size": 50, "dim": 32, "depth": 2, "heads": 2, "max_len": 16}},
        "optim": {"name": "sgd", "lr": 0.5},
        "train": {"max_steps": 4, "grad_accum_steps": accum, "loss_normalization": normalization, "log_every": 2},
        "parallel": {"mode": mode},
        "checkpoint": {"crash_save": False},
        "log": {"progress_bar": False},
    }
    trainer = RaggedTrainer(cfg)
    trainer.fit()
    # fsdp2: gather the shards
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in trainer.unwrapped_model.parameters()]
    return [p.detach().clone() for p in full]


def _fit_on(tmp, world_size: int, accum: int, normalization: str, mode: str = "ddp") -> list[torch.Tensor]:
    if world_size == 1:
        return run_in_pool(_fit, 1, args=(tmp, 1, accum, normalization, mode), timeout=200)[0]
    return run_in_pool(_fit, world_size, args=(tmp, world_size, accum, normalization, mode), timeout=200)[0]


def _max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.multiprocess
def test_any_split_of_the_global_batch_gives_the_same_update_under_tokens_and_not_under_mean(tmp_path):
    one_by_one = _fit_on(tmp_path, 1, 1, "tokens")
    two_by_two = _fit_on(tmp_path, 2, 2, "tokens")
    one_by_four = _fit_on(tmp_path, 1, 4, "tokens")
    # 3 ranks: a sum over ranks that is not a + b (2 ranks add in either order alike).
    three_by_two = _fit_on(tmp_path, 3, 2, "tokens")
    assert _max_difference(one_by_one, two_by_two) < 1e-5
    assert _max_difference(one_by_one, one_by_four) < 1e-5
    assert _max_difference(one_by_one, three_by_two) < 1e-5
    mean_whole, mean_split = _fit_on(tmp_path, 1, 1, "mean"), _fit_on(tmp_path, 1, 4, "mean")
    assert _max_difference(mean_whole, mean_split) > 1e-3  # mean of means weights a short sequence's tokens more


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tokens_under_zero1_and_fsdp2_match_ddp(tmp_path):
    reference = _fit_on(tmp_path, 2, 2, "tokens")
    for mode in ("zero1", "fsdp2"):
        assert _max_difference(reference, _fit_on(tmp_path, 2, 2, "tokens", mode)) < 1e-5, mode


def test_a_plain_tensor_under_tokens_is_refused_with_the_expected_return():
    with pytest.raises(
        ConfigError, match=r"must return \(loss_sum, n_tokens\).*reduction='sum'\), \(labels != -100\).sum\(\)"
    ):
        split_loss(torch.tensor(1.0), normalization="tokens", owner=RaggedTrainer)
    with pytest.raises(ConfigError, match="needs train.loss_normalization=tokens"):
        split_loss((torch.tensor(1.0), torch.tensor(3)), normalization="mean", owner=RaggedTrainer)
    loss, tokens = split_loss((torch.tensor(6.0), 3), normalization="tokens", owner=RaggedTrainer)
    assert float(loss) == 6.0 and int(tokens) == 3


def _scaled(tmp):
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([2.0, 4.0])
    count = TokenCount([weight], world_size=2, device=torch.device("cpu"))
    count.add(torch.tensor(3 if torch.distributed.get_rank() == 0 else 1))
    count.scale_gradients()  # global count 4: gradients x world_size / 4
    return weight.grad.tolist(), count.read_total()


@pytest.mark.multiprocess
def test_token_counts_are_summed_over_ranks_once_per_step(tmp_path):
    for grad, total in run_in_pool(_scaled, 2, args=(tmp_path,), timeout=60):
        assert grad == [1.0, 2.0] and total == 4.0
