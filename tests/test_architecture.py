"""The package's shape, checked from its source: no import cycles, the layer rules, small modules and functions.

    .venv/bin/pytest -q tests/test_architecture.py

Every import statement counts, including those inside functions and under ``TYPE_CHECKING``: a deferred
import hides a cycle from Python, not from a reader.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[1] / "ddpkit"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
# The Trainer: the loop on one screen and the overridable steps; its build lives in ddpkit.launch.run_parts.
MAX_TRAINER_LINES = 450
# 10: progress.py joined the bottom row, so every layer can name the loop's counter without importing checkpoint/.
MAX_TOP_MODULES = 10
# Who may import the command line and the Trainer: the public surface, the entry point, and the benchmarks
# (they time a Trainer subclass, the loop users run, so they sit beside the cli, above the Trainer).
MAY_IMPORT = {
    "ddpkit.cli": lambda m: m == "ddpkit.__main__",
    "ddpkit.trainer": lambda m: m in ("ddpkit", "ddpkit.cli") or m.startswith("ddpkit.bench."),
}
# The bottom layer: what everything else builds on; it imports nothing above itself.
BASE = ("ddpkit.errors", "ddpkit._version", "ddpkit.progress", "ddpkit.config", "ddpkit.distributed")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


SOURCES = _sources()


def _imported(module: str, tree: ast.Module, is_package: bool) -> set[str]:
    """Every module ``module`` imports anywhere in its body, functions and ``TYPE_CHECKING`` blocks included.

    ``from pkg import name`` counts ``pkg.name`` when that is a module (``from ddpkit import registry``
    needs ddpkit.registry, and ddpkit is only its parent), else ``pkg`` itself (a name its ``__init__`` defines).
    """
    names: set[str] = set()
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                source = ".".join(base[: len(base) - node.level + 1] + ([source] if source else []))
            submodules = {f"{source}.{alias.name}" for alias in node.names} & SOURCES.keys()
            names.update(submodules)
            if len(submodules) < len(node.names):
                names.add(source)
    return names


def _graph() -> dict[str, set[str]]:
    """ddpkit module -> the ddpkit modules it imports (a package import means its ``__init__``)."""
    graph = {}
    for module, (path, tree) in SOURCES.items():
        graph[module] = {name for name in _imported(module, tree, path.name == "__init__.py") if name in SOURCES} - {
            module
        }
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``a -> b -> ... -> a``, or None (depth-first search with colours)."""
    colour = dict.fromkeys(graph, 0)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if colour[nxt] == 0 and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = 2
        return None

    for start in sorted(graph):
        if colour[start] == 0 and (found := visit(start)):
            return found
    return None


def test_the_checker_finds_a_cycle_and_none_in_a_chain():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    tree = ast.parse("def f():\n    from ddpkit.config import checks\nif TYPE_CHECKING:\n    from . import sinks\n")
    assert _imported("ddpkit.reporting.trackers", tree, False) == {"ddpkit.config.checks", "ddpkit.reporting.sinks"}


def test_no_import_cycle_deferred_imports_included():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _map_rows() -> list[set[str]]:
    """The layers written in ``ddpkit/__init__.py``'s docstring, top first: each row a set of names
    (``trainer``, ``checkpoint``, ...), read from the block under "Where things live"."""
    doc = (PACKAGE / "__init__.py").read_text().split('"""')[1]
    block = doc.split("Where things live", 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in block.splitlines():
        names = line.strip().split("  ", 1)[0]
        if line.startswith("    ") and not line.startswith("     ") and names:
            rows.append({name.strip().removesuffix("/").removesuffix(".py") for name in names.split(",")})
    return rows


def _package_of(module: str) -> str:
    """``ddpkit.checkpoint.state`` -> ``checkpoint``; ``ddpkit.trainer`` -> ``trainer``; ``ddpkit`` -> ``ddpkit``."""
    return module.split(".")[1] if "." in module else module


def test_the_package_graph_follows_the_map_in_ddpkit_init():
    rows = _map_rows()
    layer = {name: i for i, row in enumerate(rows) for name in row}
    top_level = {_package_of(m) for m in SOURCES} - {"ddpkit"}
    assert top_level == set(layer), (
        f"the map in ddpkit/__init__.py lists {sorted(set(layer))}; the package has {sorted(top_level)}"
    )
    upward = set()
    for module, targets in _graph().items():
        source = _package_of(module)
        if source == "ddpkit":
            continue  # the public surface re-exports from every layer
        for target in targets:
            dest = _package_of(target)
            if dest != source and layer[dest] <= layer[source]:
                upward.add(f"{source} -> {dest} ({module} imports {target})")
    assert not upward, "imports that point up or sideways in the map of ddpkit/__init__.py:\n" + "\n".join(
        sorted(upward)
    )


def test_the_map_checker_reads_rows_and_refuses_an_upward_import(monkeypatch):
    rows = _map_rows()
    assert rows[0] == {"__main__"} and {"atomic", "errors", "progress", "_version"} in rows
    assert [i for i, row in enumerate(rows) if "trainer" in row] < [
        i for i, row in enumerate(rows) if "checkpoint" in row
    ]
    graph = _graph()
    graph["ddpkit.config.loader"] = graph["ddpkit.config.loader"] | {"ddpkit.trainer"}
    monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: graph)
    with pytest.raises(AssertionError, match="config -> trainer"):
        test_the_package_graph_follows_the_map_in_ddpkit_init()


def test_layers_point_one_way():
    graph = _graph()
    for module, targets in graph.items():
        for top, allowed in MAY_IMPORT.items():
            assert top not in targets or allowed(module), f"{module} imports {top}; nothing below it may"
        if module.startswith(BASE):
            above = {t for t in targets if not t.startswith(BASE)}
            assert not above, f"{module} (config/distributed/errors) imports {sorted(above)} from a layer above"
        if module.startswith("ddpkit.checkpoint"):
            assert "ddpkit.trainer" not in targets, f"{module} reaches back into the Trainer"
        if module.startswith("ddpkit.config"):
            outside = {t for t in targets if not t.startswith("ddpkit.config") and t != "ddpkit.errors"}
            assert not outside, f"{module} imports {sorted(outside)}; config/ may use only ddpkit.errors"
            path, tree = SOURCES[module]
            torch_dist = {
                n for n in _imported(module, tree, path.name == "__init__.py") if n.startswith("torch.distributed")
            }
            assert not torch_dist, f"{module} imports {sorted(torch_dist)}; config/ knows nothing of torch.distributed"


def test_few_plain_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES + 1, f"{len(top)} modules at the top of ddpkit/: {top}"  # +1: __init__


def test_modules_and_functions_are_small():
    too_long = []
    for module, (path, tree) in SOURCES.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{module}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name} (line {node.lineno}): {length} lines")
    trainer = len((PACKAGE / "trainer.py").read_text().splitlines())
    if trainer > MAX_TRAINER_LINES:
        too_long.append(f"ddpkit.trainer: {trainer} lines (at most {MAX_TRAINER_LINES})")
    assert not too_long, "over the limits (500 lines a module, 60 a function):\n" + "\n".join(too_long)


def test_public_names_resolve_and_testing_is_reachable():
    import ddpkit

    for name in ddpkit.__all__:
        assert getattr(ddpkit, name) is not None, name
    code = "import ddpkit; ddpkit.testing.run_on_ranks"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_import_ddpkit_loads_nothing_until_a_public_name_is_used():
    """``import ddpkit`` costs its version, not torch and the Trainer's 130 modules (about 170 ms more than torch
    alone before the names became lazy): a worker, a restart, ``ddpkit --help`` pay for what they name."""
    code = (
        "import sys, ddpkit; print(sorted(m for m in sys.modules if m.split('.')[0] in ('ddpkit', 'torch')));"
        "ddpkit.Trainer; print('ddpkit.trainer' in sys.modules, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['ddpkit', 'ddpkit._version']", "True True"], done.stdout


def test_every_error_class_and_the_sink_base_are_public():
    import ddpkit
    from ddpkit import errors

    error_classes = [name for name in errors.__all__ if isinstance(getattr(errors, name), type)]
    missing = [name for name in [*error_classes, "Preempted", "CompileError", "Sink"] if name not in ddpkit.__all__]
    assert not missing, f"not exported from ddpkit/__init__.py: {missing}"
    assert issubclass(ddpkit.Preempted, ddpkit.DdpkitError) and ddpkit.Sink.__module__ == "ddpkit.reporting.sink_base"


def test_exit_codes_are_defined_once_and_the_cli_lists_them():
    from ddpkit import cli, errors
    from ddpkit.checkpoint.preemption import PREEMPTED_EXIT_CODE, Preempted
    from ddpkit.watchdog.monitor import HANG_EXIT_CODE

    codes = (
        errors.EXIT_OK,
        errors.EXIT_FAILURE,
        errors.EXIT_CONFIG,
        errors.EXIT_HANG,
        errors.EXIT_UNHEALTHY,
        errors.EXIT_PREEMPTED,
        errors.EXIT_INTERRUPTED,
    )
    assert codes == (0, 1, 2, 3, 4, 75, 130)
    assert (errors.ConfigError.exit_code, HANG_EXIT_CODE, PREEMPTED_EXIT_CODE, Preempted.exit_code) == (2, 3, 75, 75)
    for code in codes:
        assert f"\n    {code} " in cli.__doc__, f"cli.py's docstring does not list exit code {code}"
    # Nowhere else spells a code as a number: no sys.exit(2), os._exit(3), terminate(1), `== 75`.
    literal_uses = []
    for module, (path, tree) in SOURCES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "exit",
                "_exit",
                "terminate",
                "_exit_now",
            ):
                args = [a for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, int)]
                literal_uses += [f"{module} line {node.lineno}: exit({a.value})" for a in args]
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in (75, 130) for c in node.comparators
            ):
                literal_uses.append(f"{module} line {node.lineno}: compares with an exit code's number")
    assert not literal_uses, "use ddpkit.errors.EXIT_*:\n" + "\n".join(literal_uses)
