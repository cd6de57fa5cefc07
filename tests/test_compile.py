"""torch.compile from the config (ddpkit.parallel.model_views), wrapper-free state dicts, and the data path's
worker options.

Fast tests use Dynamo's ``eager`` / ``aot_eager`` backends (no C++ compiler involved); the
end-to-end runs on 2 Gloo ranks use the default Inductor backend, as users do, and are slow.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.nn import functional as F

from ddpkit.config.schema import DDPConfig, TrainConfig
from ddpkit.distributed.ddp import strip_wrapper_prefixes, sync_gradients, unwrap_model
from ddpkit.distributed.env import read_dist_env
from ddpkit.parallel.model_views import CompileError, CompileWatch, build_models, compile_settings, to_channels_last
from ddpkit.testing import fake_ranks


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: Dynamo's caches are per process and would hide recompiles."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


class Excluded:
    """Records the spans it is asked to leave out of samples/s."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.depth = 0

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.names.append(name)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


# --- settings ---------------------------------------------------------------------------------


def test_compile_settings_split_torch_and_ddpkit_keys():
    assert compile_settings(False) is None
    assert compile_settings(True).torch_kwargs == {}
    settings = compile_settings({"mode": "max-autotune", "dynamic": True, "recompile_limit": 3, "validation": False})
    assert settings.torch_kwargs == {"mode": "max-autotune", "dynamic": True}
    assert (settings.recompile_limit, settings.validation) == (3, False)


# --- prefixes ---------------------------------------------------------------------------------


def test_compiled_state_dict_prefixes_are_stripped_and_load_into_the_bare_network():
    model = mlp()
    compiled = torch.compile(model, backend="eager")  # no compiling happens until it is called
    assert all(key.startswith("_orig_mod.") for key in compiled.state_dict())
    assert list(unwrap_model(compiled).state_dict()) == list(model.state_dict())
    nested = {f"_orig_mod.module.{k}": v for k, v in model.state_dict().items()}  # torch.compile(DDP(model))
    fresh = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    fresh.load_state_dict(strip_wrapper_prefixes(nested))  # strict: every key matches
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert strip_wrapper_prefixes({"module_a.w": 1}) == {"module_a.w": 1}  # only whole prefixes


# --- build_models in a world of one -------------------------------------------------------------


def test_compile_off_gives_the_bare_model_everywhere(world_of_one):
    models = build_models(mlp(), world_of_one, ddp=DDPConfig(), train=TrainConfig())
    assert models.train is models.eval is models.bare and models.watch is None


def test_compiled_training_matches_eager_and_compile_time_is_excluded(world_of_one):
    excluded = Excluded()
    eager = mlp()
    train = TrainConfig(compile={"backend": "aot_eager"})
    models = build_models(mlp(), world_of_one, ddp=DDPConfig(), train=train, exclude=excluded)
    try:
        assert models.train is not models.bare and unwrap_model(models.train) is models.bare
        x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
        for net in (eager, models.train):
            F.cross_entropy(net(x), y).backward()
        for a, b in zip(eager.parameters(), models.bare.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
        assert models.watch.compilations >= 1 and models.watch.seconds > 0
        assert excluded.names == ["compile"] * models.watch.compilations and excluded.depth == 0
        models.bare.eval()
        with torch.no_grad():
            torch.testing.assert_close(models.eval(x), eager.eval()(x))
    finally:
        models.on_exit("FINISHED")
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False  # restored


def test_a_model_compiled_in_build_model_is_compiled_once_in_ddp_order(world_of_one):
    net = mlp()
    train = TrainConfig(compile={"backend": "eager"})
    models = build_models(torch.compile(net, backend="eager"), world_of_one, ddp=DDPConfig(), train=train)
    try:
        assert models.bare is net and models.train._orig_mod is net  # one compile wrapper, around the (DDP-wrapped) net
    finally:
        models.on_exit("FINISHED")


def test_recompiles_are_logged_with_their_reason_and_capped_with_a_clear_error(caplog, world_of_one):
    models = build_models(
        mlp(),
        world_of_one,
        ddp=DDPConfig(),
        train=TrainConfig(compile={"backend": "eager", "dynamic": False, "recompile_limit": 2}),
    )
    try:
        with caplog.at_level(logging.INFO, logger="ddpkit"):
            models.train(torch.randn(4, 6))
            models.train(torch.randn(5, 6))  # a new batch size: the second compiled version, with its reason
            assert any("recompile 1" in r.getMessage() and "size mismatch" in r.getMessage() for r in caplog.records)
            with pytest.raises(CompileError, match=r"recompile_limit=2.*train.compile=false"):
                models.train(torch.randn(6, 6))
    finally:
        models.on_exit("FINISHED")
    assert len(models.bare(torch.randn(7, 6))) == 7


@torch._dynamo.register_backend
def ddpkit_test_broken_backend(gm, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def test_a_failing_compile_names_the_option_to_turn_off(world_of_one):
    train = TrainConfig(compile={"backend": "ddpkit_test_broken_backend"})
    models = build_models(mlp(), world_of_one, ddp=DDPConfig(), train=train)
    try:
        with pytest.raises(CompileError, match="train.compile=false") as info:
            models.train(torch.randn(4, 6))
        assert "cannot compile anything" in str(info.value)
    finally:
        models.on_exit("FINISHED")


def test_watch_close_is_complete():
    before = len(torch._dynamo.callback_handler.start_callbacks)
    watch = CompileWatch(5)
    assert torch._dynamo.config.recompile_limit == 5
    watch.close()
    assert len(torch._dynamo.callback_handler.start_callbacks) == before
    assert torch._dynamo.config.recompile_limit == 8


def test_channels_last_converts_parameters_and_inputs_without_changing_results():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    reference = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(2, 3, 8, 8)
    expected = net(x)
    converted = to_channels_last(net)
    assert converted[0].weight.is_contiguous(memory_format=torch.channels_last)
    seen = []
    converted[0].register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    torch.testing.assert_close(converted(x), expected)
    assert seen == [True]
    assert all(torch.equal(converted.state_dict()[k], v) for k, v in reference.items())


# --- no_sync through the compile wrapper --------------------------------------------------------


def _no_sync_reaches_ddp_inside_compile() -> bool:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(mlp())
    compiled = torch.compile(ddp, backend="eager")
    with sync_gradients(compiled, sync=False):
        inside = ddp.require_backward_grad_sync
    return inside is False and ddp.require_backward_grad_sync is True


def test_sync_gradients_finds_ddp_inside_a_compiled_wrapper():
    """Where DDP's flag is, not what it reduces: each of 2 ranks in this process, on torch's fake backend."""
    found = []
    for rank in range(2):
        with fake_ranks(2, rank=rank):
            found.append(_no_sync_reaches_ddp_inside_compile())
    assert found == [True, True]


# --- host memory ------------------------------------------------------------------------------------

_FAULTS_PER_STEP = r"""
import resource, sys, torch, torch.nn.functional as F
from torch import nn
from ddpkit.training.allocator import keep_freed_host_memory
applied = keep_freed_host_memory() if sys.argv[1] == "keep" else False
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(1, 16, 5), nn.ReLU(), nn.Conv2d(16, 16, 5), nn.Flatten(), nn.Linear(16 * 20 * 20, 10))
x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
keep = []
def step(i):
    F.cross_entropy(net(x), y).backward()
    net.zero_grad(set_to_none=True)
    keep.append(torch.zeros(3))  # small long-lived blocks between the big ones, as any loop makes
for i in range(5):
    step(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(20):
    step(i)
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


@pytest.mark.skipif(not __import__("platform").libc_ver()[0] == "glibc", reason="mallopt is glibc's")
def test_kept_host_memory_means_no_page_faults_in_steady_steps():
    import subprocess
    import sys

    def faults_per_step(mode: str) -> tuple[str, float]:
        out = subprocess.run(
            [sys.executable, "-c", _FAULTS_PER_STEP, mode], capture_output=True, text=True, timeout=120, check=True
        )
        applied, faults = out.stdout.split()
        return applied, float(faults)

    # Each step allocates ~12 MB of activations and gradients (3,000 pages). With malloc's defaults
    # about 1,700 of them are faulted in again every step; kept, only the heap's slow growth around
    # the small long-lived blocks faults: 1-35 pages per step when the kernel can hand out huge
    # pages, a few hundred when memory is fragmented (seen after the compile tests; 571 against the
    # default's 1,520 once in a full suite). Compared side by side, so the kernel's state is the same
    # for both. Now and then glibc's own dynamic threshold happens to keep the memory too (the
    # default then faults ~0 pages a step, seen once in a full suite). The claim: `keep` avoids
    # most (more than half) of what the default faults, or of the ~3,000 pages when that is ~0.
    # The kernel's state moves under a loaded machine (two test workers beside each other): up to three pairs,
    # each side by side, and one must show it (once both measured ~550, the default's share of them small).
    pairs = []
    for _ in range(3):
        applied, kept = faults_per_step("keep")
        _, default = faults_per_step("default")
        assert applied == "True"
        pairs.append((kept, default))
        if kept < 0.5 * (default if default >= 500 else 3000):
            break
    else:
        raise AssertionError(f"keeping host memory never halved the page faults a step (kept, default): {pairs}")


# --- the data path -------------------------------------------------------------------------------------


class _RandomPerSample(torch.utils.data.Dataset):
    """Each sample is a draw from the global RNG: what a random augmentation does."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(1)


def _epochs(loader, epochs: int) -> list[list[float]]:
    from ddpkit.data.epochs import start_epoch

    seen = []
    for epoch in range(epochs):
        start_epoch(loader, epoch, start_batch=1 if epoch == 2 else 0)
        seen.append([round(v, 6) for batch in loader for v in batch.flatten().tolist()])
    return seen


@pytest.mark.multiprocess
def test_persistent_workers_keep_per_sample_seeds_across_epochs_and_resume():
    from ddpkit.data.loaders import build_train_loader

    env = read_dist_env()
    kwargs = dict(env=env, batch_size=4, seed=3)
    persistent = build_train_loader(
        _RandomPerSample(), num_workers=2, persistent_workers=True, prefetch_factor=3, **kwargs
    )
    restarted = build_train_loader(_RandomPerSample(), num_workers=1, persistent_workers=False, **kwargs)
    assert persistent.persistent_workers and persistent.prefetch_factor == 3
    a, b = _epochs(persistent, 3), _epochs(restarted, 3)
    assert a == b  # the same samples whatever the number of workers and whether they persist
    assert a[0] != a[1]  # and the epoch reached the persistent workers: new draws each epoch
    assert len(a[2]) == 12  # epoch 2 resumed after its first batch


# --- the Trainer on 2 ranks ---------------------------------------------------------------------------


class _SeesItsModel:
    """Mixin recording which model object validation_step and training_step see."""

    def training_step(self, batch):
        self.seen = getattr(self, "seen", set()) | {("train", type(self.model).__name__)}
        return super().training_step(batch)

    def validation_step(self, batch):
        self.seen = getattr(self, "seen", set()) | {("val", type(self.model).__name__)}
        return super().validation_step(batch)


def _fit(cfg: dict) -> dict:
    import ddpkit

    trainer = type("Recording", (_SeesItsModel, ddpkit.Trainer), {})(cfg)
    metrics = trainer.fit()
    return {"metrics": metrics, "seen": sorted(trainer.seen)}


def _fit_each(configs: list[dict]) -> list[dict]:
    return [_fit(cfg) for cfg in configs]


def _bare_mlp() -> nn.Module:
    from ddpkit.registry import MODELS

    return MODELS.build("mlp", key="model.name", kwargs={"in_features": 144, "hidden": [32]})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_compiled_training_saves_plain_weights_and_resumes_with_compile_off_and_on(tmp_path):
    from helpers import load_weights, run_in_pool, tiny_config

    def config(epochs: int, compile_value) -> dict:
        return tiny_config(
            tmp_path, train={"epochs": epochs, "log_every": 4, "compile": compile_value}, checkpoint={"every_epochs": 1}
        )

    first = run_in_pool(_fit, world_size=2, args=(config(2, True),), timeout=600)  # Inductor, as users run it
    assert first[0]["metrics"] == first[1]["metrics"] and first[0]["metrics"]["step"] == 16
    assert first[0]["seen"] == [("train", "OptimizedModule"), ("val", "OptimizedModule")]
    run = tmp_path / "run"
    weights = load_weights(run / "model.pt")
    bare = _bare_mlp()
    bare.load_state_dict(weights)  # strict: no `_orig_mod.` or `module.` anywhere
    saved = torch.load(sorted((run / "checkpoints").glob("step-*.pt"))[-1], weights_only=True)
    assert set(saved["model"]) == set(bare.state_dict())

    # Compile off, resuming a compiled run; then on again, resuming an eager one (one spawn for both).
    eager, again = run_in_pool(
        _fit_each, world_size=2, args=([config(3, False), config(4, {"backend": "aot_eager"})],), timeout=300
    )[0]
    assert eager["metrics"]["step"] == 24 and eager["seen"] == [("train", "DistributedDataParallel"), ("val", "MLP")]
    assert again["metrics"]["step"] == 32 and again["seen"] == first[0]["seen"]
    bare.load_state_dict(load_weights(run / "model.pt"))


def _accumulated(configs: list[dict]) -> list[dict]:
    import ddpkit

    weights = []
    for cfg in configs:  # one after the other in the same ranks: one spawn
        trainer = ddpkit.Trainer(cfg)
        trainer.fit()
        weights.append({k: v.clone() for k, v in trainer.unwrapped_model.state_dict().items()})
    return weights


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gradient_accumulation_under_compile_matches_eager(tmp_path):
    from helpers import run_in_pool, tiny_config

    configs = [
        tiny_config(tmp_path / name, train={"epochs": 1, "grad_accum_steps": 2, "compile": value})
        for name, value in (("eager", False), ("compiled", {"backend": "aot_eager"}))
    ]
    ranks = run_in_pool(_accumulated, world_size=2, args=(configs,), timeout=300)
    for eager, compiled in ranks:
        for key, value in eager.items():
            torch.testing.assert_close(compiled[key], value, rtol=1e-4, atol=1e-5)
    assert all(torch.equal(ranks[0][1][k], ranks[1][1][k]) for k in ranks[0][1])  # the ranks stayed in sync


# --- the config keys --------------------------------------------------------------------------------


def test_train_compile_takes_true_false_or_a_mapping_and_rejects_the_rest(tiny_cfg):
    from ddpkit.config.loader import load_config
    from ddpkit.errors import ConfigError

    cfg = tiny_cfg
    assert load_config(cfg, ["train.compile=true"]).train.compile is True
    assert load_config(cfg).train.compile is False
    mapping = load_config(cfg, ["train.compile.mode=max-autotune", "train.compile.recompile_limit=4"]).train.compile
    assert mapping == {"mode": "max-autotune", "recompile_limit": 4}
    with pytest.raises(ConfigError) as info:
        load_config(cfg, ["train.compile.mdoe=default", "train.compile.recompile_limit=0", "data.prefetch_factor=4"])
    message = str(info.value)
    assert (
        "train.compile.mdoe: unknown option" in message
        and "train.compile.recompile_limit: expected an integer >= 1" in message
    )
    assert "data.prefetch_factor: only used with worker processes" in message
    with pytest.raises(ConfigError, match="train.compile: expected true or false"):
        load_config(cfg, ["train.compile=3"])


def test_a_compile_inside_evaluation_is_left_out_of_samples_per_s_once(tiny_cfg, world_of_one):
    """samples/s measures training only: an evaluation, and a compile inside it (CompileWatch opens a
    nested span), are left out of the rate once, neither kept in its time nor taken out of it twice."""
    import time

    from ddpkit.config.loader import load_config
    from ddpkit.progress import Progress
    from ddpkit.reporting import log as logs
    from ddpkit.reporting.events import Events
    from ddpkit.reporting.reporter import Reporter

    started, progress = time.perf_counter(), Progress()
    reporter = Reporter(load_config(tiny_cfg), runtime=world_of_one, total_steps=10, progress=progress, events=Events())
    try:
        time.sleep(0.2)  # stands for 4 training steps
        with reporter.outside_training("evaluation"):
            time.sleep(0.05)
            with reporter.outside_training("compile"):  # what CompileWatch does when validation compiles
                time.sleep(0.2)
        progress.step = 4
        reporter.add_loss(torch.tensor(1.0))
        record = reporter.training(progress, lr=0.1)
        elapsed = time.perf_counter() - started
    finally:
        reporter.on_exit("FINISHED")
    training_seconds = 4 * reporter.samples_per_step / record[logs.SAMPLES_PER_S]
    # Counted twice, the 0.2 s compile would also be taken from the training time (0.2 s minus 0.2 s);
    # not counted, the 0.25 s evaluation would stay in it.
    assert 0.2 <= training_seconds <= elapsed - 0.25, (training_seconds, elapsed)


@pytest.mark.multiprocess
def test_export_strips_compile_and_ddp_prefixes_from_a_checkpoint_written_elsewhere(tmp_path):
    from helpers import load_weights, run_cli

    from ddpkit.checkpoint.files import save_checkpoint

    net = mlp()
    wrapped = {f"_orig_mod.module.{k}": v for k, v in net.state_dict().items()}  # torch.compile(DDP(net)).state_dict()
    save_checkpoint({"model": wrapped}, tmp_path / "ckpts", step=3)
    done = run_cli("export", str(tmp_path / "ckpts"), str(tmp_path / "model.pt"))
    assert done.returncode == 0, done.stderr
    mlp().load_state_dict(load_weights(tmp_path / "model.pt"))  # strict
