"""Import the user's libraries once, in the launcher, so that every forked worker (first start, each restart) has them.

    names = script_imports(["train.py", "exp.yaml"])   # ['numpy', 'sklearn.datasets', ...]: its top-level imports
    preload_program(["train.py", "exp.yaml"])          # import those that are installed packages, here

``ddpkit run`` forks its CPU workers from the launcher (:mod:`ddpkit.launch.forked`), which imported torch
and ddpkit once. A script that imports scikit-learn, transformers or datasets at its top still paid those
imports in every worker on every restart (1.3 to 1.7 s a restart for scikit-learn on a 2-core machine):
forked from a launcher that imported them too, a restarted worker finds them loaded.

What is imported here: the script's own module-level ``import X`` / ``from X import Y`` statements (read with
:mod:`ast`, never run), and of those only the modules that come from an installed package or the standard
library (their file lies under ``sys.prefix``, ``sys.base_prefix`` or a site-packages folder). The script's
own modules (its folder, the working directory, an editable install) are not: they are more likely to read
``RANK`` or open files when imported, and they are cheap. The script itself still runs once per attempt, as
``__main__``, in the worker, so its body's side effects happen where they always did. A module that fails to
import here is left to the worker, which reports the error as it would have.

Opting out: ``DDPKIT_PRELOAD=off`` in the environment, or ``DDPKIT_PRELOAD = False`` at the top level of the
script (a literal, read without running it). ``DDPKIT_PRELOAD=mod1,mod2`` imports those modules too, whatever
their origin (your own package, say). Don't preload a library that starts threads or opens connections when
imported: a forked child has none of its parent's threads; one line is logged when preloading started
Python threads (native ones, a BLAS pool or an allocator's, come with their own fork handlers).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import logging
import os
import site
import sys
import sysconfig
import threading
from pathlib import Path

__all__ = ["PRELOAD_ENV", "script_imports", "preload_program", "installed"]

#: Its value: ``off`` preloads nothing beyond torch and ddpkit, ``mod1,mod2`` these modules too
PRELOAD_ENV = "DDPKIT_PRELOAD"
#: A script's own top-level `DDPKIT_PRELOAD = False` opts it out
_MARKER = "DDPKIT_PRELOAD"

logger = logging.getLogger(__name__)


def _source_of(program: list[str]) -> Path | None:
    """The file ``program`` (``[SCRIPT, ...]`` or ``["-m", MODULE, ...]``) runs, found without importing anything."""
    if program[0] != "-m":
        return Path(program[0])
    parts = program[1].split(".")
    for base in (os.getcwd(), *sys.path):
        folder = Path(base or ".", *parts)
        for candidate in (folder.with_suffix(".py"), folder / "__main__.py"):
            if candidate.is_file():
                return candidate
    return None


def script_imports(program: list[str]) -> list[str]:
    """The modules ``program``'s file imports at its top level, in order; [] when it opts out or cannot be read."""
    source = _source_of(program)
    try:
        tree = ast.parse(source.read_bytes()) if source is not None else None
    except (OSError, SyntaxError, ValueError):
        return []
    if tree is None or _opted_out(tree):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module != "__future__":
            names.append(node.module)
            # Each imported name may be a submodule too
            names += [f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"]
    return list(dict.fromkeys(names))


def _opted_out(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == _MARKER for t in node.targets):
            return isinstance(node.value, ast.Constant) and node.value.value is False
    return False


def installed(name: str) -> bool:
    """Whether module ``name``'s top-level package comes from the standard library or an installed package (not the
    user's folder)."""
    try:
        spec = importlib.util.find_spec(name.partition(".")[0])
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if spec.origin in ("built-in", "frozen"):
        return True
    where = spec.origin or next(iter(spec.submodule_search_locations or []), None)
    return where is not None and any(os.path.realpath(where).startswith(root) for root in _install_roots())


def _install_roots() -> set[str]:
    """The folders installed packages and the standard library live in (each ending with a separator)."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots |= {*site.getsitepackages(), site.getusersitepackages()}
    return {os.path.join(os.path.realpath(root), "") for root in roots}


def _wanted(program: list[str]) -> list[str]:
    """What to import for ``program``: its installed top-level imports and ``$DDPKIT_PRELOAD``'s modules."""
    setting = os.environ.get(PRELOAD_ENV, "").strip()
    if setting.lower() in ("off", "0", "false", "no", "none"):
        return []
    extra = [name.strip() for name in setting.split(",") if name.strip() and name.strip().lower() != "auto"]
    return list(dict.fromkeys([*(name for name in script_imports(program) if installed(name)), *extra]))


def preload_program(program: list[str]) -> list[str]:
    """Import what :func:`_wanted` names for ``program`` in this process; return the modules that imported."""
    threads_before = set(threading.enumerate())
    done = []
    for name in _wanted(program):
        if name in sys.modules:
            done.append(name)
            continue
        parent, _, attr = name.rpartition(".")
        if parent in sys.modules and not _may_be_submodule(sys.modules[parent], attr):
            # `from module import function`: nothing more to import
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001
            # The worker imports it again and reports the error as it would
            logger.debug("not preloading %s: %s", name, exc)
            continue
        done.append(name)
    started = [thread.name for thread in threading.enumerate() if thread not in threads_before]
    if started:
        logger.warning(
            "ddpkit run: importing %s in the launcher started thread(s) %s, which forked workers do not "
            "inherit; if a worker hangs, set %s=off",
            ", ".join(done),
            ", ".join(started),
            PRELOAD_ENV,
        )
    return done


def _may_be_submodule(parent: object, attr: str) -> bool:
    if not hasattr(parent, "__path__"):
        # A plain module: `attr` is one of its names
        return False
    return not hasattr(parent, attr) or inspect.ismodule(getattr(parent, attr))
