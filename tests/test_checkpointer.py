"""The checkpointer: what a periodic save costs in collectives, and state a user's subclass adds.

.venv/bin/pytest -q tests/test_checkpointer.py            # the fast cases
.venv/bin/pytest -q -m slow tests/test_checkpointer.py    # a user's parts resumed after a SIGKILL, per mode
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import yaml
from helpers import REPO, assert_bitwise_equal, load_script, load_weights, run_cli, run_in_pool, tiny_config

import ddpkit
from ddpkit.errors import ConfigError

EMA_SCRIPT = REPO / "tests" / "scripts" / "ema_trainer.py"
#: Every collective ddpkit's code calls through torch.distributed's namespace.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "gather",
    "gather_object",
    "scatter",
    "reduce",
    "all_to_all",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
)


Counter = load_script(EMA_SCRIPT).Counter  # the subclass script's own part: a step counter


class CountingTrainer(ddpkit.Trainer):
    """Records the collectives each checkpoint save calls (a save that is not due records nothing)."""

    def on_fit_start(self) -> None:
        self.saves: list[list[str]] = []
        save = self.checkpointer.save

        def counted(step: int, **kwargs: object) -> bool:
            calls: list[str] = []

            def counting(name: str):
                original = getattr(dist, name)
                return lambda *a, **k: (calls.append(name), original(*a, **k))[1]

            patches = [mock.patch.object(dist, name, counting(name)) for name in COLLECTIVES if hasattr(dist, name)]
            for patch in patches:
                patch.start()
            try:
                saved = save(step, **kwargs)
            finally:
                for patch in patches:
                    patch.stop()
            if saved:
                self.saves.append(calls)
            return saved

        self.checkpointer.save = counted


def _saves_and_their_collectives(out: str, every: object, async_save: bool) -> list[list[str]]:
    cfg = tiny_config(out, train={"epochs": 1}, checkpoint={"every_steps": every, "async": async_save})
    trainer = CountingTrainer(cfg)
    trainer.fit()
    return trainer.saves


@pytest.mark.multiprocess
@pytest.mark.parametrize("every, async_save", [(2, False), (2, True), ("auto", False)])
def test_a_periodic_ddp_save_costs_one_all_gather_and_one_broadcast(tmp_path, every, async_save):
    ranks = run_in_pool(_saves_and_their_collectives, 2, args=(str(tmp_path), every, async_save))
    # 8 steps: saves at 2, 4, 6 and 8 (the last); `auto` plans its first interval beyond 8 steps: the last one only
    assert ranks[0] == ranks[1] and len(ranks[0]) == (1 if every == "auto" else 4), ranks
    for calls in ranks[0]:
        assert calls == ["all_gather_object", "broadcast_object_list"], ranks[0]


class ClashingTrainer(ddpkit.Trainer):
    def checkpoint_parts(self) -> dict[str, object]:
        return {"optimizer": Counter()}


def test_a_user_part_named_like_a_builtin_one_is_refused_naming_both(tmp_path):
    with pytest.raises(ConfigError, match=r"'optimizer', which is ddpkit's own part 'optimizer' \(SGD\)"):
        ClashingTrainer(tiny_config(tmp_path)).fit()


class NotStateful(ddpkit.Trainer):
    def checkpoint_parts(self) -> dict[str, object]:
        return {"ema": [1.0, 2.0]}


def test_a_user_part_without_state_dict_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"part 'ema' is a list, which has no state_dict\(\)"):
        NotStateful(tiny_config(tmp_path)).fit()


class WithCounter(ddpkit.Trainer):
    def checkpoint_parts(self) -> dict[str, object]:
        self.counter = Counter()
        return {"steps_counted": self.counter}

    def on_step_end(self, step: int) -> None:
        self.counter.value += 1


def test_user_parts_resume_and_one_missing_from_an_older_checkpoint_is_named(tmp_path, capsys):
    cfg = tiny_config(tmp_path, train={"epochs": None, "max_steps": 4}, checkpoint={"every_steps": 2})
    ddpkit.Trainer(cfg).fit()  # written before the part existed
    longer = {**cfg, "train": {**cfg["train"], "max_steps": 8}}
    capsys.readouterr()
    first = WithCounter(longer)
    first.fit()
    assert "holds no part 'steps_counted' (Trainer.checkpoint_parts): it starts as built" in capsys.readouterr().err
    assert first.counter.value == 4  # counted from the resume at step 4 to step 8
    again = WithCounter({**longer, "train": {**longer["train"], "max_steps": 10}})
    again.fit()
    assert again.counter.value == 6  # restored (4 at step 8), then steps 9 and 10
    saved = torch.load(Path(cfg["run"]["output_dir"]) / "checkpoints" / "step-000000010.pt", weights_only=True)
    assert saved["steps_counted"] == {"value": 6} and "steps_counted" in saved["schema"]


def _ema_run(out: Path, mode: str, kill: bool) -> Path:
    out.mkdir()
    cfg = tiny_config(
        out, parallel={"mode": mode}, train={"epochs": 2}, checkpoint={"every_steps": 3, "memory_every_steps": None}
    )
    (out / "exp.yaml").write_text(yaml.safe_dump(cfg))
    env = {"KILL_RANK": "1", "KILL_AT_STEP": "7"} if kill else {}
    done = run_cli(
        "run",
        str(out / "exp.yaml"),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--script",
        str(EMA_SCRIPT),
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("resuming from" in done.stderr) == kill, done.stderr[-3000:]
    return Path(cfg["run"]["output_dir"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["ddp", "zero1", "fsdp2"])
def test_a_subclass_ema_and_counter_resume_bitwise_after_a_sigkill(tmp_path, mode):
    """`ddpkit run`'s own restart (`--max-restarts 1`) after rank 1 SIGKILLs itself is what brings the subclass's EMA
    and counter back from the checkpoint."""
    killed, clean = _ema_run(tmp_path / "killed", mode, True), _ema_run(tmp_path / "clean", mode, False)
    assert_bitwise_equal(load_weights(killed / "model.pt"), load_weights(clean / "model.pt"))
    after_kill, uninterrupted = torch.load(killed / "ema.pt"), torch.load(clean / "ema.pt")
    assert after_kill["count"] == uninterrupted["count"] == 16  # 8 steps an epoch on 2 ranks, 2 epochs
    assert_bitwise_equal(after_kill["ema"], uninterrupted["ema"])
