"""Issue 67: ddpkit's models built on the meta device, each rank making and initialising only what it holds.

    .venv/bin/pytest -q tests/test_meta_build.py

The initial weights, read at ``on_fit_start`` and made whole, are compared bit for bit across layouts (a world of one,
ddp, zero1, fsdp2, pp2, tp2, pp2 x tp2) and against a model built on the CPU by hand under the same seed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import RaggedSequences, run_in_pool

import ddpkit
from ddpkit.models.gpt import GPT
from ddpkit.models.init_by_name import retie, tied_names
from ddpkit.models.llama import Llama, LlamaShape

pytestmark = pytest.mark.timeout(300)

LLAMA = {"arch": "llama", "vocab_size": 50, "dim": 32, "depth": 4, "heads": 4, "kv_heads": 2, "mlp_dim": 64}
SEED = 5


def _config(out: Path, model: dict, **parallel) -> dict:
    """One step of a global batch of 8 in 2 micro-batches (accumulation, or a pipeline's microbatches)."""
    pipelined = parallel.get("pipeline", 1) > 1
    return {
        "run": {"name": "meta", "output_dir": str(out), "seed": SEED},
        "data": {"global_batch_size": 8, "order": "index_free"},
        "model": {"name": "gpt", "kwargs": {**model, "max_len": 16}},
        "optim": {"name": "adamw", "lr": 1e-3},
        "train": {"max_steps": 1, "loss_normalization": "tokens", "grad_accum_steps": 1 if pipelined else 2},
        "parallel": {**parallel, **({"microbatches": 2} if pipelined else {})},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }


class InitialWeights(ddpkit.Trainer):
    """Keeps the weights it starts from, whole, and whether the model was built on the meta device."""

    def build_datasets(self):
        return RaggedSequences(n=16), None

    def on_fit_start(self) -> None:
        state = self.placed.held.state_dict()
        # a DTensor's full_tensor is a collective on its mesh: every rank of the layout runs it
        self.initial = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in state.items()
        }


def _initial(cfg: dict) -> dict[str, torch.Tensor]:
    trainer = InitialWeights(cfg)
    trainer.fit()
    return trainer.initial


def _merged(results: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for weights in results:
        for name, value in weights.items():
            if name in merged:
                # every rank that holds a name holds the same bits
                assert torch.equal(merged[name], value), name
            merged[name] = value
    return merged


def _hand_built(model: dict) -> dict[str, torch.Tensor]:
    """The model class built on the CPU by hand under the run's seed, as ddpkit's setup seeds it."""
    from ddpkit.models.gpt import build_gpt
    from ddpkit.training.rng import seed_for_setup

    seed_for_setup(SEED, deterministic=False)
    return {k: v.clone() for k, v in build_gpt({**model, "max_len": 16}).state_dict().items()}


@pytest.mark.parametrize("model", [{**LLAMA, "tied": False}, {**LLAMA, "tied": True}], ids=["untied", "tied"])
def test_a_meta_build_made_and_initialised_by_name_equals_a_cpu_build(model):
    shape = {k: v for k, v in model.items() if k != "arch"}
    torch.manual_seed(11)
    cpu = Llama(LlamaShape(**shape, max_len=16))
    torch.manual_seed(11)
    with torch.device("meta"):
        meta = Llama(LlamaShape(**shape, max_len=16))
    tied = tied_names(meta)
    meta.to_empty(device="cpu")
    retie(meta, tied)
    meta.init_weights()
    for name, value in cpu.state_dict().items():
        assert torch.equal(value, meta.state_dict()[name]), name
    assert (meta.head.weight is meta.embed.weight) == bool(model.get("tied"))


def test_a_part_initialised_alone_gets_the_bits_the_whole_model_gives_it():
    torch.manual_seed(2)
    whole = GPT(vocab_size=40, dim=16, depth=3, heads=2, max_len=8)
    expected = {k: v.clone() for k, v in whole.blocks[1].state_dict().items()}
    with torch.no_grad():
        for p in whole.parameters():
            p.zero_()
    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleDict({"1": whole.blocks[1]})
    whole.init_weights(holder)
    for name, value in whole.blocks[1].state_dict().items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.multiprocess
def test_initial_weights_are_bitwise_equal_in_every_layout_and_to_a_hand_built_model(tmp_path):
    reference = _hand_built(LLAMA)
    layouts = [
        (1, {}),
        (2, {}),
        (2, {"mode": "zero1"}),
        (2, {"mode": "fsdp2"}),
        (2, {"pipeline": 2}),
        (2, {"tensor": 2}),
        (4, {"pipeline": 2, "tensor": 2}),
    ]
    for ranks, parallel in layouts:
        cfg = _config(tmp_path / f"{ranks}-{'-'.join(map(str, parallel.values())) or 'plain'}", LLAMA, **parallel)
        merged = _merged(run_in_pool(_initial, ranks, args=(cfg,), timeout=200))
        assert merged.keys() == reference.keys(), parallel
        for name, value in reference.items():
            assert torch.equal(merged[name], value), (ranks, parallel, name)


class Plain(torch.nn.Module):
    """A user's model without init_weights: built whole on every rank, as before."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class SelfInitialising(Plain):
    """A user's model that can initialise any part of itself by name: ddpkit builds it on the meta device."""

    def init_weights(self, parts: torch.nn.Module | None = None) -> None:
        from ddpkit.models.init_by_name import initialize

        initialize(self if parts is None else parts, seed=7, residuals=(), depth=1)


class UserModelTrainer(ddpkit.Trainer):
    model_class: type = SelfInitialising
    # its build_model neither loads nor reads weights: it may run on the meta device
    build_on_meta = True

    def build_model(self):
        return self.model_class()

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.TensorDataset(
            torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
        ), None

    def on_fit_start(self) -> None:
        state = self.placed.held.state_dict()
        self.initial = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()
        }


class PlainTrainer(UserModelTrainer):
    model_class = Plain


class NotOptedIn(UserModelTrainer):
    """A build_model of its own, not opted in: built whole, whatever its model can do (it might load weights)."""

    build_on_meta = False


def _logged(run) -> tuple[object, str]:
    """``run()``'s result and what the meta build logged meanwhile (its logger swapped for a recorder)."""
    from unittest import mock

    from ddpkit.parallel import meta_build

    lines: list[str] = []
    recorder = mock.Mock()
    recorder.info = lambda message, *args: lines.append(message % args)
    with mock.patch.object(meta_build, "log", recorder):
        return run(), "\n".join(lines)


def _user_run(cfg: dict, which: str) -> tuple[dict[str, torch.Tensor], str]:
    trainer = {"self": UserModelTrainer, "plain": PlainTrainer, "not opted in": NotOptedIn}[which](cfg)
    _, log = _logged(trainer.fit)
    return trainer.initial, log


def _user_config(out: Path, **parallel) -> dict:
    return {
        "run": {"name": "user", "output_dir": str(out), "seed": SEED},
        "data": {"global_batch_size": 8},
        "optim": {"name": "sgd", "lr": 0.1},
        "train": {"max_steps": 1},
        "parallel": parallel,
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }


@pytest.mark.multiprocess
def test_a_users_model_with_init_weights_is_built_on_meta_and_one_without_is_built_whole_saying_the_fix(tmp_path):
    (alone, log) = run_in_pool(_user_run, 1, args=(_user_config(tmp_path / "one"), "self"), timeout=120)[0]
    assert "model: built on the meta device" in log
    sharded = run_in_pool(_user_run, 2, args=(_user_config(tmp_path / "fsdp2", mode="fsdp2"), "self"), timeout=120)
    for weights, _ in sharded:
        assert weights.keys() == alone.keys()
        assert all(torch.equal(weights[k], alone[k]) for k in alone)
    # where the layout splits the model (fsdp2), the line names the fix; where every rank holds it whole, it does not
    (_, log) = run_in_pool(_user_run, 2, args=(_user_config(tmp_path / "plain", mode="fsdp2"), "plain"), timeout=120)[0]
    assert "model: built whole on every rank (Plain has no init_weights(parts); give it init_weights(parts)" in log
    (_, log) = run_in_pool(_user_run, 1, args=(_user_config(tmp_path / "plain-one"), "plain"), timeout=120)[0]
    assert "model: built whole on every rank, as this layout holds it (parallel.mode=ddp)" in log
    cfg = _user_config(tmp_path / "not-opted-in", mode="fsdp2")
    (_, log) = run_in_pool(_user_run, 2, args=(cfg, "not opted in"), timeout=120)[0]
    assert "model: built whole on every rank (Trainer.build_model is overridden; set build_on_meta = True" in log


def _manual_placement(cfg: dict) -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "manual_placement", Path(__file__).parents[1] / "examples/manual_placement.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    # opted in, as a user might: its build moves its halves to devices, which fails on meta, so it is built whole
    opted_in = type("OptedIn", (example.ManualPlacementTrainer,), {"build_on_meta": True})
    trainer = opted_in(cfg)
    return _logged(trainer.fit)[1]


@pytest.mark.multiprocess
def test_the_seeds_model_split_by_hand_is_built_whole_because_its_build_moves_real_tensors(tmp_path):
    cfg = {
        **_user_config(tmp_path / "manual", mode="fsdp2"),
        "data": {"name": "digits", "kwargs": {"image_size": 12}, "global_batch_size": 8},
    }
    log = run_in_pool(_manual_placement, 2, args=(cfg,), timeout=120)[0]
    assert "model: built whole on every rank (its build needs real tensors (NotImplementedError" in log


class ApplyStyle(Plain):
    """``init_weights(m)`` written for ``model.apply``: not a promise to initialise any part, so built whole."""

    def init_weights(self, m: torch.nn.Module) -> None:
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.zeros_(m.bias)


def test_only_an_init_weights_taking_parts_by_that_name_counts():
    from ddpkit.parallel.meta_build import initialises_parts

    assert initialises_parts(SelfInitialising()) and initialises_parts(GPT(vocab_size=8, dim=8, depth=1, heads=2))
    assert not initialises_parts(ApplyStyle()) and not initialises_parts(Plain())


LORA = {"r": 4, "alpha": 8, "targets": "all-linear"}


class InitialParameters(InitialWeights):
    """The parameters it starts from, whole, the frozen base's too (a LoRA model's state_dict holds the adapter only),
    and what the meta build logged."""

    def on_fit_start(self) -> None:
        params = self.placed.held.named_parameters()
        # a DTensor's full_tensor is a collective on its mesh: every rank of the layout runs it, in the same order
        self.initial = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in params
        }


def _lora_initial(cfg: dict) -> tuple[dict[str, torch.Tensor], str]:
    trainer = InitialParameters(cfg)
    _, log = _logged(trainer.fit)
    return trainer.initial, log


def _hand_built_lora(model: dict, precision: str) -> dict[str, torch.Tensor]:
    """The model class built whole on the CPU by hand, its adapter added by ``apply_lora``, under the run's seed."""
    from ddpkit.config.loader import load_config
    from ddpkit.models.gpt import build_gpt
    from ddpkit.models.lora import apply_lora
    from ddpkit.training.rng import seed_for_setup

    seed_for_setup(SEED, deterministic=False)
    section = load_config({"model": {"name": "gpt", "kwargs": model, "lora": LORA}}).model
    built = apply_lora(build_gpt({**model, "max_len": 16}), section, precision=precision)
    return {k: v.detach().clone() for k, v in built.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_lora_model_is_built_on_meta_its_base_and_adapter_bitwise_equal_in_every_layout(tmp_path, precision):
    """The base drawn by name as without LoRA, the adapter's A by name too (B zero), the frozen base stored in the
    run's precision: the same bits made a part a rank as built whole by hand."""
    reference = _hand_built_lora(LLAMA, precision)
    adapter_a = [name for name in reference if name.endswith("lora_A.weight")]
    assert len(adapter_a) == 4 * 7 and all(reference[name].abs().max() > 0 for name in adapter_a)
    layouts = [(1, {}), (2, {"mode": "fsdp2"}), (2, {"pipeline": 2}), (2, {"tensor": 2})]
    for ranks, parallel in layouts:
        cfg = _config(tmp_path / f"{precision}-{ranks}-{'-'.join(map(str, parallel.values())) or 'one'}", LLAMA)
        cfg["parallel"] = _config(tmp_path, LLAMA, **parallel)["parallel"]
        cfg["train"] = {**_config(tmp_path, LLAMA, **parallel)["train"], "precision": precision}
        cfg["model"]["lora"] = LORA
        results = run_in_pool(_lora_initial, ranks, args=(cfg,), timeout=200)
        assert all("model: built on the meta device" in log for _, log in results), parallel
        merged = _merged([weights for weights, _ in results])
        assert merged.keys() == reference.keys(), parallel
        for name, value in reference.items():
            assert merged[name].dtype == value.dtype and torch.equal(merged[name], value), (parallel, name)


def test_an_adapter_saved_with_a_fingerprint_of_the_other_kind_is_resumed_with_a_warning(caplog):
    """An adapter saved by an earlier ddpkit carries a fingerprint of its base's weights and no ``fingerprint_of``:
    it cannot be compared with a fingerprint of the base's source, so it loads, saying so."""
    from ddpkit.models.lora import LoraBase

    base = LoraBase(base="gpt", fingerprint="a" * 64, fingerprint_of="source", config={"r": 4}, adapter_seed=0)
    with caplog.at_level("WARNING"):
        base.set_extra_state({"base": "gpt", "fingerprint": "b" * 64, "r": 4})
    assert "fingerprint of its base's weights (an earlier ddpkit)" in caplog.text and "not checked" in caplog.text
