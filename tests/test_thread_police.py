"""conftest.py's ``thread_police``: a test that leaves a ddpkit thread running fails, one that stops it passes.

The police knows ddpkit's threads by name, so every thread ddpkit starts must be named ``ddpkit-...``:
checked here in the source. The police itself runs on a throwaway test file in a pytest of its own.

    .venv/bin/pytest tests/test_thread_police.py -q
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
from helpers import REPO

LEAKY_AND_TIDY = """
import threading


def test_leaves_a_thread_running():
    stop = threading.Event()
    threading.Thread(target=stop.wait, args=(60,), name="ddpkit-leaky", daemon=True).start()


def test_stops_its_thread_just_before_it_ends():
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="ddpkit-tidy", daemon=True).start()
    stop.set()  # the thread may still be alive as the test returns: the grace join covers that


def test_leaves_a_thread_that_is_not_ddpkits():
    threading.Thread(target=threading.Event().wait, args=(60,), name="someone-else", daemon=True).start()
"""


@pytest.mark.timeout(120)
def test_a_test_that_leaves_a_ddpkit_thread_running_fails_and_names_it(tmp_path):
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_threads.py").write_text(LEAKY_AND_TIDY)
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}  # conftest imports helpers
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "3 passed, 1 error" in out, out[-3000:]
    assert "ERROR at teardown of test_leaves_a_thread_running" in out, out[-3000:]
    assert "the test left 1 ddpkit thread(s) running: ddpkit-leaky (daemon=True)" in out
    assert "ddpkit-tidy" not in out and "someone-else" not in out


def _thread_name(call: ast.Call) -> ast.expr | None:
    return next((kw.value for kw in call.keywords if kw.arg == "name"), None)


def _starts_with_ddpkit(name: ast.expr | None) -> bool:
    if isinstance(name, ast.Constant):
        return str(name.value).startswith("ddpkit-")
    if isinstance(name, ast.JoinedStr) and name.values and isinstance(name.values[0], ast.Constant):
        return str(name.values[0].value).startswith("ddpkit-")  # f"ddpkit-{name}"
    return False


def test_every_thread_ddpkit_starts_is_named_ddpkit():
    calls = []
    for path in sorted((REPO / "ddpkit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and getattr(func, "attr", getattr(func, "id", None)) in ("Thread", "Timer"):
                calls.append((f"{path.relative_to(REPO)}:{node.lineno}", _starts_with_ddpkit(_thread_name(node))))
    assert calls, "no threading.Thread(...) found in ddpkit/: has the scan gone stale?"
    assert [where for where, named in calls if not named] == []
