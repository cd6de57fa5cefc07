"""``ddpkit run --worker-start fork`` (the default on the CPU): workers forked from the launcher,
with torch imported there once, must behave like the new interpreters torchrun would start.

Real launches of ``tests/scripts/worker_facts.py`` both ways; the script reports its process from
inside (its ``__name__``, arguments, ``sys.path[0]``, threads, signal handlers, exit handlers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from helpers import REPO, run_cli, tiny_config

pytestmark = pytest.mark.multiprocess
SCRIPT = REPO / "tests" / "scripts" / "worker_facts.py"


def _facts(tmp_path: Path, method: str) -> dict[str, dict]:
    out = tmp_path / method
    out.mkdir()
    config = out / "exp.yaml"
    config.write_text(yaml.safe_dump(tiny_config(out)))
    proc = run_cli(
        "run",
        str(config),
        "--nproc-per-node",
        "2",
        "--script",
        str(SCRIPT),
        "--worker-start",
        method,
        env={"FACTS_DIR": str(out)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("exit*")) == ["exit0", "exit1"], "the script's atexit handlers did not run"
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in ("0", "1")}


def test_a_forked_worker_looks_like_a_new_interpreter_but_starts_with_torch_imported(tmp_path):
    """What a worker process is at its start (`__main__`, argv, `sys.path[0]`, threads, signal handlers, process name,
    atexit handlers run at exit) exists only in processes a real launcher started."""
    forked, fresh = _facts(tmp_path, "fork"), _facts(tmp_path, "subprocess")
    for rank in ("0", "1"):
        for facts in (forked[rank], fresh[rank]):
            assert facts["name"] == "__main__"
            assert facts["argv"][0].endswith("exp.yaml") and len(facts["argv"]) == 1
            assert Path(facts["path0"]) == SCRIPT.parent  # sibling modules import as with `python SCRIPT`
            assert facts["threads"] == 1  # OMP_NUM_THREADS=1 per worker, not the launcher's thread count
            assert facts["sigterm_default"], "a worker inherited the launcher's SIGTERM handler"
            assert facts["sigint_python"]
            assert facts["comm"] == os.path.basename(os.path.realpath(facts["comm"]))  # no "pt_elastic" thread name
            assert facts["comm"] != "pt_elastic"
            # what `ps` shows: torchrun's command line
            assert facts["cmdline"][1:] == ["-u", str(SCRIPT), *facts["argv"]]
        assert forked[rank]["preloaded"] is True, "the forked worker imported torch itself"
        assert fresh[rank]["preloaded"] is False


def test_fork_is_refused_where_the_workers_count_their_own_devices(tiny_yaml):
    """The refusal comes from `ddpkit run`'s own argv checks before any worker starts: exit code 2 and one message on
    stderr."""
    proc = run_cli("run", str(tiny_yaml), "--nproc-per-node", "gpu", "--worker-start", "fork")
    assert proc.returncode == 2  # refused before anything started (a ConfigError)
    assert "--worker-start fork" in proc.stderr and "CUDA cannot be used in a forked process" in proc.stderr
    assert "Traceback" not in proc.stderr
