"""Docstrings that say only what is there: every subpackage names its modules, and the usage
examples at the top of each module call names that exist, with keywords they accept and as many
positional arguments as they take.

    .venv/bin/pytest -q tests/test_docstrings.py

A usage example is an indented line of a module docstring that parses as Python. In it,
``Name.attr(...)`` and ``name(...)`` are checked when ``Name`` / ``name`` is defined or imported
in that module, and ``obj.method(kw=...)`` is checked against every class of the module that
has ``method`` (one that takes it is enough). Each call is checked for its keywords and its count
of positional arguments (not too many, and enough for the required parameters the keywords leave
open). ``from ddpkit.x import y`` must import. Calls on things the module does not know (torch's,
the user's) are not judged.
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
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py")
)


@pytest.mark.parametrize("folder", SUBPACKAGES, ids=lambda p: p.name)
def test_every_subpackage_docstring_names_each_of_its_modules(folder: Path):
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    missing = [p.stem for p in sorted(folder.glob("*.py")) if p.stem != "__init__" and f"``{p.stem}``" not in doc]
    named = ", ".join(f"``{m}``" for m in missing)
    assert not missing, f"ddpkit/{folder.name}/__init__.py's docstring does not name: {named}"


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
                problems += [
                    f"imports {node.module}.{a.name}, which does not exist"
                    for a in node.names
                    if not hasattr(imported, a.name) and not importlib.util.find_spec(f"{node.module}.{a.name}")
                ]
            elif isinstance(node, ast.Call):
                problems += _call_problems(node, namespace, classes)
    return problems


def _call_problems(call: ast.Call, namespace: dict, classes: list[type]) -> list[str]:
    func, keywords, shown = call.func, [k.arg for k in call.keywords if k.arg], ast.unparse(call.func)
    if isinstance(func, ast.Name) and func.id in namespace:
        return _signature_problems(namespace[func.id], call, keywords, shown, bound=True)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner = namespace.get(func.value.id)
        if inspect.isclass(owner) or inspect.ismodule(owner):
            if not hasattr(owner, func.attr):
                return [f"calls {func.value.id}.{func.attr}, which does not exist"]
            return _signature_problems(getattr(owner, func.attr), call, keywords, shown, bound=True)
        if owner is None:  # an instance in the example: fine if any of the module's classes with that method takes it
            each = [
                _signature_problems(
                    getattr(c, func.attr),
                    call,
                    keywords,
                    shown,
                    bound=not inspect.isfunction(inspect.getattr_static(c, func.attr)),
                )
                for c in classes
                if callable(getattr(c, func.attr, None))
            ]
            return [] if not each or [] in each else each[0]
    return []


def _signature_problems(target: object, call: ast.Call, keywords: list[str], shown: str, *, bound: bool) -> list[str]:
    found = (_keyword_problem(target, keywords, shown), _positional_problem(target, call, shown, bound))
    return [problem for problem in found if problem]


def _keyword_problem(target: object, keywords: list[str], shown: str) -> str | None:
    try:
        parameters = inspect.signature(target).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    unknown = [k for k in keywords if k not in parameters]
    return f"calls {shown}({', '.join(k + '=' for k in unknown)}...), which takes no such keyword" if unknown else None


def _positional_problem(target: object, call: ast.Call, shown: str, bound: bool) -> str | None:
    """Too many positional arguments, or too few for the required parameters the keywords leave open.

    Not judged: a call with ``*args`` or a ``...`` placeholder (the example elides its arguments);
    with ``**kwargs`` only the upper bound is.
    """
    if any(isinstance(a, ast.Starred) or (isinstance(a, ast.Constant) and a.value is Ellipsis) for a in call.args):
        return None
    try:
        parameters = list(inspect.signature(target).parameters.values())  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if not bound:
        parameters = parameters[1:]  # ``obj.method(...)`` against the class's function: ``self`` is obj
    kinds = inspect.Parameter
    positional = [p for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    given, keywords = len(call.args), {k.arg for k in call.keywords}
    counted = f"{given} positional argument{'' if given == 1 else 's'}"
    if given > len(positional) and not any(p.kind is kinds.VAR_POSITIONAL for p in parameters):
        return f"calls {shown} with {counted}; it takes at most {len(positional)}"
    missing = [p.name for p in positional[given:] if p.default is kinds.empty and p.name not in keywords]
    if missing and None not in keywords:
        return f"calls {shown} with {counted}; it also needs {', '.join(missing)}"
    return None


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


def test_the_example_checker_counts_positional_arguments():
    class Store:
        def __init__(self, root, *, mode="r"): ...
        def put(self, key, value, *, ttl=None): ...
        def add(self, *values): ...

    def check(line: str) -> list[str]:
        (statement,) = _example_statements(f"Usage:\n\n    {line}\n")
        call = next(node for node in ast.walk(statement) if isinstance(node, ast.Call))
        return _call_problems(call, {"Store": Store}, [Store])

    assert check('Store("/tmp", "w")') == ["calls Store with 2 positional arguments; it takes at most 1"]
    assert check('Store(mode="w")') == ["calls Store with 0 positional arguments; it also needs root"]
    assert check('store.put("k", 1, 60)') == ["calls store.put with 3 positional arguments; it takes at most 2"]
    assert check('store.put("k")') == ["calls store.put with 1 positional argument; it also needs value"]
    assert check('store.put("k", value=1, ttl=5)') == check("store.add(1, 2, 3)") == check("store.put(...)") == []
