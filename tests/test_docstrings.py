"""Docstrings that say only what is there: every subpackage names its modules, and the usage
examples at the top of each module call names that exist, with keywords they accept.

    .venv/bin/pytest -q tests/test_docstrings.py

A usage example is an indented line of a module docstring that parses as Python. In it,
``Name.attr(...)`` and ``name(...)`` are checked when ``Name`` / ``name`` is defined or imported
in that module, and ``obj.method(kw=...)`` is checked against every class of the module that
has ``method``; ``from ddpkit.x import y`` must import. Calls on things the module does not know
(torch's, the user's) are not judged.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ddpkit"
SUBPACKAGES = sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))
MODULES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__") for p in PACKAGE.rglob("*.py")
)


@pytest.mark.parametrize("folder", SUBPACKAGES, ids=lambda p: p.name)
def test_every_subpackage_docstring_names_each_of_its_modules(folder: Path):
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    missing = [p.stem for p in sorted(folder.glob("*.py")) if p.stem != "__init__" and f"``{p.stem}``" not in doc]
    assert not missing, f"ddpkit/{folder.name}/__init__.py's docstring does not name: {', '.join(f'``{m}``' for m in missing)}"


def _example_statements(doc: str) -> list[ast.stmt]:
    """The statements of the indented example lines of ``doc`` that parse on their own."""
    statements = []
    for line in doc.splitlines():
        if not line.startswith("    ") or line.strip().startswith(("#", "...", "-", "*")):
            continue
        code = textwrap.dedent(line).split("  #", 1)[0].rstrip().removesuffix(":")
        try:
            statements.extend(ast.parse(code).body)
        except SyntaxError:
            continue
    return statements


def _problems(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    namespace, problems = vars(module), []
    classes = [obj for obj in namespace.values() if inspect.isclass(obj) and obj.__module__ == module_name]
    for statement in _example_statements(module.__doc__ or ""):
        for node in ast.walk(statement):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpkit"):
                imported = importlib.import_module(node.module)
                problems += [f"imports {node.module}.{a.name}, which does not exist" for a in node.names if not hasattr(imported, a.name)
                             and not importlib.util.find_spec(f"{node.module}.{a.name}")]
            elif isinstance(node, ast.Call):
                problems += _call_problems(node, namespace, classes)
    return problems


def _call_problems(call: ast.Call, namespace: dict, classes: list[type]) -> list[str]:
    func, keywords = call.func, [k.arg for k in call.keywords if k.arg]
    targets: list[object] = []
    if isinstance(func, ast.Name) and func.id in namespace:
        targets = [namespace[func.id]]
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner = namespace.get(func.value.id)
        if inspect.isclass(owner) or inspect.ismodule(owner):
            if not hasattr(owner, func.attr):
                return [f"calls {func.value.id}.{func.attr}, which does not exist"]
            targets = [getattr(owner, func.attr)]
        elif owner is None:  # an instance in the example: any of the module's classes with that method
            targets = [getattr(c, func.attr) for c in classes if callable(getattr(c, func.attr, None))]
    return [problem for target in targets[:1] if (problem := _keyword_problem(target, keywords, ast.unparse(func)))]


def _keyword_problem(target: object, keywords: list[str], shown: str) -> str | None:
    try:
        parameters = inspect.signature(target).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    unknown = [k for k in keywords if k not in parameters]
    return f"calls {shown}({', '.join(k + '=' for k in unknown)}...), which takes no such keyword" if unknown else None


@pytest.mark.parametrize("module_name", MODULES)
def test_usage_examples_call_names_that_exist(module_name: str):
    problems = _problems(module_name)
    assert not problems, f"{module_name}'s docstring example: " + "; ".join(problems)


def test_the_example_checker_catches_a_missing_method_and_a_wrong_keyword():
    from ddpkit.distributed import Runtime

    statements = _example_statements("Usage:\n\n    runtime = Runtime.setup(env, cfg.dist)\n    state.capture(rng=1)\n")
    calls = [node for s in statements for node in ast.walk(s) if isinstance(node, ast.Call)]
    assert _call_problems(calls[0], {"Runtime": Runtime}, []) == ["calls Runtime.setup, which does not exist"]

    class State:
        def capture(self, exclude=()): ...

    assert _call_problems(calls[1], {}, [State]) == ["calls state.capture(rng=...), which takes no such keyword"]
