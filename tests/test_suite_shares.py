"""The test suite shares through ``helpers`` and ``conftest.py``, never through another test module or sys.path.

``tests`` and the checkout's root are on pytest's ``pythonpath`` (pyproject.toml), so a test imports
``helpers``, ``tiny_lm`` or ``benchmarks`` as they are; what two test modules both need moves to
``tests/helpers.py``. Scripts the tests run as programs get ``PYTHONPATH`` from the test that starts
them, or are imported by path with ``helpers.load_script``.

    .venv/bin/pytest tests/test_suite_shares.py -q
"""

from __future__ import annotations

import ast

from helpers import REPO

TESTS = REPO / "tests"
# test_warm_restart checks how ddpkit run finds a `-m` module on sys.path: editing it is the test's subject.
SYS_PATH_IS_THE_SUBJECT = {"test_warm_restart.py"}


def _imported_modules(path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def test_no_test_module_imports_another_test_module():
    offenders = {
        str(path.relative_to(REPO)): name
        for path in sorted(TESTS.rglob("*.py"))
        for name in _imported_modules(path)
        if name.split(".")[0].startswith("test_")
    }
    assert offenders == {}, "move what they share to tests/helpers.py"


def test_nothing_in_tests_edits_sys_path():
    offenders = [
        str(path.relative_to(REPO))
        for path in sorted(TESTS.rglob("*.py"))
        if path.name not in SYS_PATH_IS_THE_SUBJECT
        and path != TESTS / "test_suite_shares.py"
        and any(edit in path.read_text() for edit in ("sys.path.insert", "sys.path.append", "syspath_prepend"))
    ]
    assert offenders == [], "use pytest's pythonpath, PYTHONPATH for a subprocess, or helpers.load_script"
