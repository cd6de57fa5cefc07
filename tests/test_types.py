"""No collaborator typed ``Any``: a parameter named ``config``, ``runtime``, ``state``, ``progress`` or
``checkpointer`` anywhere in ``ddpkit/`` names its type (``Config``, ``Runtime``, ``Progress``, a class or a
small ``typing.Protocol``), so a reader and a type checker know what it is.

    .venv/bin/pytest -q tests/test_types.py

``Any`` spelled as ``typing.Any`` or inside ``Optional[...]`` / ``Any | None`` counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ddpkit"
COLLABORATORS = frozenset({"config", "runtime", "state", "progress", "checkpointer"})


def _is_any(annotation: ast.expr | None) -> bool:
    """Whether ``annotation`` is ``Any``, or a union / Optional with ``Any`` in it (a string annotation parsed)."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any"
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "Any"
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _is_any(annotation.left) or _is_any(annotation.right)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value).endswith(("Optional", "Union")):
        inner = annotation.slice
        return any(_is_any(e) for e in (inner.elts if isinstance(inner, ast.Tuple) else [inner]))
    return False


def any_typed_collaborators(source: str, name: str = "<source>") -> list[str]:
    """``path:line function(parameter: Any)`` for each collaborator parameter typed ``Any`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                if arg.arg in COLLABORATORS and _is_any(arg.annotation):
                    where = getattr(node, "name", "lambda")
                    found.append(f"{name}:{arg.lineno} {where}({arg.arg}: {ast.unparse(arg.annotation)})")
    return found


def test_no_collaborator_parameter_is_typed_any():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += any_typed_collaborators(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))
    assert not found, "type these parameters (Config, Runtime, Progress, a class or a Protocol):\n" + "\n".join(found)


def test_the_walk_sees_any_in_every_spelling():
    source = """
def a(config: Any, *, runtime: typing.Any = None): ...
def b(state: "Any | None", progress: Optional[Any]): ...
def c(checkpointer: Union[int, Any], other: Any, config: Config, runtime: "Runtime"): ...
"""
    assert [line.split(" ", 1)[1] for line in any_typed_collaborators(source)] == [
        "a(config: Any)",
        "a(runtime: typing.Any)",
        "b(state: 'Any | None')",
        "b(progress: Optional[Any])",
        "c(checkpointer: Union[int, Any])",
    ]
