"""parallel.mode ddp | zero1 | fsdp2: same weights as DDP, refusals by name, bytes per rank, resume across modes.

.venv/bin/pytest tests/test_parallel_modes.py -q            # add -m slow for the multi-run cases
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO, cpu_runtime, run_cli, run_in_pool, samples_by_step, tiny_config
from tiny_lm import TinyLM

from ddpkit.checkpoint import files
from ddpkit.config.loader import load_config
from ddpkit.config.parallel import FSDPConfig, ParallelConfig
from ddpkit.errors import ConfigError
from ddpkit.models.builtin import MLP
from ddpkit.parallel.fsdp import fsdp_blocks
from ddpkit.testing import RankFailure

pytestmark = pytest.mark.timeout(600)


def _cfg(tmp: Path | str, mode: str, **sections) -> dict:
    sections.setdefault("optim", {"name": "adam", "lr": 0.003, "momentum": 0.0})
    sections.setdefault("model", {"name": "mlp", "kwargs": {"in_features": 144, "hidden": [32, 32]}})
    return tiny_config(tmp, parallel={"mode": mode}, **sections)


def test_combinations_fsdp2_cannot_run_are_refused_by_name():
    base = {"train": {"epochs": 1}, "parallel": {"mode": "fsdp2"}}
    for extra, key in [
        ({"ddp": {"comm_hook": "powersgd"}}, "ddp.comm_hook"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
            load_config({**base, **extra})
        assert "parallel.mode" in str(err.value)  # the fix is named too
    with pytest.raises(ConfigError, match="did you mean 'zero1'"):
        load_config({"train": {"epochs": 1}, "parallel": {"mode": "zero"}})
    assert (
        load_config({"train": {"epochs": 1}, "parallel": {"mode": "zero1"}, "ddp": {"comm_hook": "fp16"}}).parallel.mode
        == "zero1"
    )


def test_fsdp_blocks_default_rule_and_named_classes():
    lm = TinyLM(vocab=16, dim=8, depth=3, heads=2)
    assert [type(b).__name__ for b in fsdp_blocks(lm, None)] == ["TransformerBlock"] * 3  # the ModuleList's children
    assert [type(b).__name__ for b in fsdp_blocks(MLP(16, (8, 8)), None)] == ["Linear"] * 3  # Flatten/ReLU hold nothing
    # Linears inside blocks are covered
    assert fsdp_blocks(lm, ["TransformerBlock", "Linear"]) == list(lm.blocks) + [lm.head]
    with pytest.raises(ConfigError, match="parallel.fsdp.blocks: no submodule of class Block.*TransformerBlock"):
        fsdp_blocks(lm, ["Block"])
    assert ParallelConfig().mode == "ddp"


def test_fsdp2_default_rule_gives_the_embedding_norm_and_head_units_of_their_own_and_leaves_a_tied_pair_in_the_root():
    from ddpkit.models.gpt import gpt
    from ddpkit.parallel.fsdp import fsdp_ends

    def ends(model: torch.nn.Module) -> list[str]:
        units = fsdp_ends(model, fsdp_blocks(model, None))
        return [name for name, child in model.named_children() if any(child is unit for unit in units)]

    llama = {"arch": "llama", "dim": 16, "depth": 2, "heads": 2, "kv_heads": 1, "max_len": 8, "vocab_size": 32}
    assert ends(gpt(**llama, tied=False)) == ["embed", "norm", "head"]
    # tied: one matrix reads tokens in and scores them out, so it cannot live in two units; the root keeps it
    assert ends(gpt(**llama, tied=True)) == ["norm"]
    assert ends(TinyLM(vocab=16, dim=8, depth=3, heads=2)) == ["embed", "pos", "ln_f", "head"]
    # an MLP whose layers are all blocks leaves nothing else
    assert ends(MLP(16, (8, 8))) == []


def _held_after_forward(rank: int) -> dict[str, tuple[str, ...]]:
    """Rank ``rank`` of 2 on the fake backend: after one forward of an untied Llama under fsdp2, which parameters
    are held whole (plain tensors: FSDP2 swaps a unit's shards for the gathered tensors until it reshards)."""
    from torch.distributed.tensor import DTensor

    from ddpkit.config.loader import load_config
    from ddpkit.models.gpt import gpt
    from ddpkit.parallel.layout import ParallelLayout
    from ddpkit.testing import fake_ranks

    with fake_ranks(2, rank=rank):
        cfg = load_config({"parallel": {"mode": "fsdp2"}})
        layout = ParallelLayout.build(cfg.parallel, cpu_runtime())
        torch.manual_seed(0)
        model = gpt(arch="llama", dim=16, depth=2, heads=2, kv_heads=1, max_len=8, vocab_size=32, tied=False)
        model = layout.data_parallel.shard(model, mesh=layout.dp_mesh, runtime=cpu_runtime())
        model(torch.zeros(1, 4, dtype=torch.long)).sum()
        whole = tuple(name for name, p in model.named_parameters() if not isinstance(p, DTensor))
        return {"whole": whole, "rows": tuple(model.head.weight.to_local().shape)}


def test_fsdp2_reshards_the_vocabulary_matrices_after_the_forward_where_the_root_kept_them_whole():
    for rank in range(2):
        held = _held_after_forward(rank)
        # the root unit (FSDP2 keeps its parameters until the backward) holds nothing now: no matrix stays whole
        assert held == {"whole": (), "rows": (16, 16)}, rank


def test_fsdp2_reshards_after_forward_alone_and_keeps_a_stage_gathered_inside_a_pipeline_unless_told():
    from ddpkit.parallel.fsdp import FSDP2

    def resolved(**parallel) -> bool:
        return FSDP2.from_config(ParallelConfig(mode="fsdp2", **parallel)).reshard_after_forward

    assert resolved() is True
    assert resolved(pipeline=2) is False
    assert resolved(fsdp=FSDPConfig(reshard_after_forward=False)) is False
    assert resolved(pipeline=2, fsdp=FSDPConfig(reshard_after_forward=True)) is True


def _three_modes(tmp: str) -> dict:
    """ddp, zero1 and fsdp2 one after another in the same two processes (one spawn): weights, metrics, logged bytes."""
    import torch.distributed as dist

    from ddpkit import Trainer
    from ddpkit.distributed.memory import rank_bytes

    out = {}
    for mode in ("ddp", "zero1", "fsdp2"):
        train = {"epochs": 6, "grad_accum_steps": 2, "clip_grad_norm": 0.5, "log_every": 100}
        trainer = Trainer(_cfg(Path(tmp) / mode, mode, train=train, log={"progress_bar": False, "rank_files": True}))
        metrics = trainer.fit()
        held = rank_bytes(trainer.placed.held, trainer.optimizer)
        out[mode] = {"metrics": metrics, "held": held}
        dist.barrier()
    return out


@pytest.mark.slow
def test_zero1_and_fsdp2_train_to_ddp_weights_with_accumulation_and_clipping(tmp_path):
    results = run_in_pool(_three_modes, 2, args=(str(tmp_path),), timeout=400)
    weights = {
        mode: torch.load(tmp_path / mode / "run/model.pt", weights_only=True) for mode in ("ddp", "zero1", "fsdp2")
    }
    count = sum(w.numel() for w in weights["ddp"].values())
    for mode in ("zero1", "fsdp2"):
        assert weights[mode].keys() == weights["ddp"].keys()  # model.pt is the bare model in every mode
        diff = max((weights[mode][k] - weights["ddp"][k]).abs().max().item() for k in weights["ddp"])
        assert diff <= 1e-5, (mode, diff)
        assert results[0][mode]["metrics"]["val_accuracy"] == results[0]["ddp"]["metrics"]["val_accuracy"]
        assert results[0][mode]["metrics"]["step"] == results[0]["ddp"]["metrics"]["step"] == 24
    held = {mode: [results[r][mode]["held"] for r in (0, 1)] for mode in results[0]}
    # Adam: 2 slots
    assert all(h.parameters == h.gradients == 4 * count and h.optimizer == 8 * count for h in held["ddp"])
    assert sum(h.optimizer for h in held["zero1"]) == 8 * count and all(
        h.parameters == 4 * count for h in held["zero1"]
    )
    assert (
        sum(h.parameters for h in held["fsdp2"]) == 4 * count and sum(h.optimizer for h in held["fsdp2"]) == 8 * count
    )
    # the startup line: what each rank holds, before any state exists
    log = (tmp_path / "fsdp2/run/logs/rank0.log").read_text()
    assert f"{count:,} parameters" in log and "rank 1: parameters" in log
    assert (
        f"({held['fsdp2'][0].parameters:,} B)" in log
        and f"optimizer state {held['fsdp2'][1].optimizer / 1024:.2f} KiB" in log
    )


def _train(tmp: str, mode: str, steps: int, crash: str | None = None) -> dict:
    from ddpkit import Trainer

    if crash is not None:
        _arm_crash(crash)
    cfg = _cfg(
        tmp,
        mode,
        data={"global_batch_size": 24, "kwargs": {"num_train": 256, "num_val": 101, "image_size": 12}},
        train={"epochs": None, "max_steps": steps, "log_every": 100},
        checkpoint={"every_steps": 4, "keep_last": 5},
    )
    cfg["data"].pop("batch_size")
    return Trainer(cfg).fit()


def _arm_crash(point: str) -> None:
    """SIGKILL inside the second sharded save: rank 1 in DCP's write, or rank 0 before the rename or the manifest."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import filesystem

    from ddpkit.checkpoint import sharded

    saves, rank = [0], dist.get_rank()
    real_prepare, real_replace, real_write = (
        sharded._prepare,
        sharded.os.replace,
        filesystem.FileSystemWriter.write_data,
    )

    def prepare(*args, **kwargs):
        saves[0] += 1
        return real_prepare(*args, **kwargs)

    def replace(src, dst):
        if saves[0] == 2 and point == "before-rename":
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)

    def write_data(self, plan, planner):
        if saves[0] == 2 and point == "mid-write" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(self, plan, planner)

    real_write_atomically = sharded.write_atomically

    def write_manifest(path, data, **kwargs):
        if saves[0] == 2 and point == "before-manifest":
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write_atomically(path, data, **kwargs)

    sharded._prepare, sharded.os.replace, sharded.write_atomically = prepare, replace, write_manifest
    filesystem.FileSystemWriter.write_data = write_data


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "run/model.pt", weights_only=True)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "point"), [("fsdp2", "mid-write"), ("zero1", "before-rename"), ("fsdp2", "before-manifest")]
)
def test_a_sharded_save_cut_by_sigkill_leaves_the_previous_one_and_resume_ends_equal(tmp_path, mode, point):
    with pytest.raises(RankFailure, match="exit code -9"):
        run_in_pool(_train, 2, args=(str(tmp_path / "cut"), mode, 12, point), timeout=300)
    checkpoints = tmp_path / "cut/run/checkpoints"
    assert [c.step for c in files.list_checkpoints(checkpoints)] == [4]  # the save of step 8 never counted
    run_in_pool(_train, 2, args=(str(tmp_path / "cut"), mode, 12), timeout=300)
    assert not list(checkpoints.glob(".*.partial"))  # the killed write was cleared
    run_in_pool(_train, 2, args=(str(tmp_path / "ref"), mode, 12), timeout=300)
    assert _max_diff(_weights(tmp_path / "cut"), _weights(tmp_path / "ref")) <= 1e-6


@pytest.mark.slow
def test_fsdp2_on_two_ranks_resumes_as_ddp_on_one_zero1_on_two_fsdp2_on_three(tmp_path):
    import shutil

    run_in_pool(_train, 2, args=(str(tmp_path / "ref"), "ddp", 16), timeout=300)
    run_in_pool(_train, 2, args=(str(tmp_path / "half"), "fsdp2", 8), timeout=300)
    assert files.find_latest_checkpoint(tmp_path / "half/run/checkpoints").path.name == "step-000000008.dcp"
    for mode, world in [("ddp", 1), ("zero1", 2), ("fsdp2", 3)]:
        shutil.copytree(tmp_path / "half", tmp_path / f"{mode}{world}")
        metrics = run_in_pool(_train, world, args=(str(tmp_path / f"{mode}{world}"), mode, 16), timeout=300)[0]
        assert metrics["step"] == 16
        assert _max_diff(_weights(tmp_path / f"{mode}{world}"), _weights(tmp_path / "ref")) <= 1e-5, (mode, world)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "checkpoint", "resumed_from"),
    [
        # the newest DCP checkpoint (a lone survivor cannot save shards)
        ("fsdp2", {"every_steps": 3}, "step-000000006.dcp"),
        # the whole-state memory snapshot
        ("zero1", {"every_steps": 100, "every_epochs": None, "memory_every_steps": 3}, "/dev/shm/"),
    ],
)
def test_ddpkit_run_restarts_a_killed_sharded_rank_and_ends_equal(tmp_path, mode, checkpoint, resumed_from):
    """`ddpkit run`'s own restart (`--max-restarts 2`) after rank 1 SIGKILLs itself, resuming a sharded run."""

    def launch(out: Path, env: dict[str, str]):
        out.mkdir()
        cfg = _cfg(out, mode, train={"epochs": 2}, checkpoint=checkpoint)
        (out / "exp.yaml").write_text(yaml.safe_dump(cfg))
        return run_cli(
            "run",
            str(out / "exp.yaml"),
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--script",
            "tests/checkpoint_crash.py",
            env=env,
            timeout=300,
            cwd=REPO,
        )

    killed = launch(tmp_path / "killed", {"KILL_RANK": "1", "KILL_AT_STEP": "7"})
    assert killed.returncode == 0, killed.stderr[-3000:]
    resumed = [line for line in killed.stderr.splitlines() if "resuming from" in line]
    assert resumed and resumed_from in resumed[0] and "(step 6)" in resumed[0], resumed
    clean = launch(tmp_path / "clean", {})
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert _max_diff(_weights(tmp_path / "killed"), _weights(tmp_path / "clean")) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "nproc"), [("ddp", 1), ("zero1", 2)])
def test_a_preempted_fsdp2_run_resumes_in_another_mode_at_the_samesamples_by_step(tmp_path, mode, nproc):
    """SIGTERM after step 5 of a 2-rank fsdp2 run (exit 75, a DCP checkpoint), then ``ddpkit run`` in ``mode`` on
    ``nproc`` ranks. Real commands: the stop is the whole command's exit code 75, and the resume is a new command on
    another number of ranks."""
    script = str(REPO / "tests" / "scripts" / "preempt_trainer.py")
    paths = {}
    for name in ("whole", "cut"):
        cfg = _cfg(
            tmp_path / name,
            "fsdp2",
            data={"global_batch_size": 24, "kwargs": {"num_train": 256, "num_val": 101, "image_size": 12}},
            train={"epochs": 2, "log_every": 2},
            checkpoint={"every_epochs": None},
        )
        del cfg["data"]["batch_size"]
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(cfg))
        (tmp_path / f"{name}-samples").mkdir()

    def launch(name: str, ranks: int, *overrides: str, env: dict[str, str]):
        return run_cli(
            "run",
            str(paths[name]),
            *overrides,
            "--nproc-per-node",
            str(ranks),
            "--script",
            script,
            env=env,
            timeout=300,
        )

    assert launch("whole", 2, env={"SAMPLES_DIR": str(tmp_path / "whole-samples")}).returncode == 0
    env = {"SAMPLES_DIR": str(tmp_path / "cut-samples"), "PREEMPT_STEP": "5", "PREEMPT_STAMP": str(tmp_path / "stamp")}
    assert launch("cut", 2, env=env).returncode == 75
    # the step every rank agreed on, soon after 5
    saved = files.find_latest_checkpoint(tmp_path / "cut/run/checkpoints")
    assert saved.path.suffix == ".dcp" and 5 <= saved.step < 20
    resumed = launch("cut", nproc, f"parallel.mode={mode}", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming a parallel.mode=fsdp2 checkpoint (2 rank(s)) as parallel.mode={mode}" in resumed.stderr
    reference, cut = samples_by_step(tmp_path / "whole-samples"), samples_by_step(tmp_path / "cut-samples")
    assert sorted(reference) == sorted(cut) and all(
        cut[s] == reference[s] and len(reference[s]) == 24 for s in reference
    )
    assert _max_diff(_weights(tmp_path / "cut"), _weights(tmp_path / "whole")) <= 1e-5
