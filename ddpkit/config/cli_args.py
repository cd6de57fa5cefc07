"""One command-line style for every ``ddpkit`` command: how a config is named, old spellings, plain help.

    add_config_arguments(parser)                     # CONFIG positional, then key=value overrides
    argv = renamed(argv, OLD_SPELLINGS, prog="ddpkit bench")   # --nproc -> --nproc-per-node, with a message
    parser = argparse.ArgumentParser(description=plain_text(module.__doc__))   # no ``literals`` in --help

The style: CONFIG is the first positional argument wherever a command takes one, process counts are
``--nproc-per-node``, ``--json`` prints JSON on stdout and ``-o/--output`` writes a file, and usage
errors go to stderr with exit code 2 (argparse's). Spellings of earlier releases keep working for
one release: :func:`renamed` rewrites them and prints one deprecation line each on stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence

__all__ = ["add_config_arguments", "add_output_arguments", "renamed", "plain_text", "OLD_SPELLINGS"]

#: Old option -> its new spelling (``""``: the option is dropped and its value stays as the positional CONFIG).
#: ``--json FILE`` (a value ending in ``.json``) becomes ``--output FILE``; a bare ``--json`` is the new flag.
OLD_SPELLINGS: Mapping[str, str] = {
    "--nproc": "--nproc-per-node",
    "--config": "",
    "--json": "--output",
    "--start-method": "--worker-start",
    "--start_method": "--worker-start",
}


def add_config_arguments(parser: argparse.ArgumentParser, *, config_help: str = "YAML config file") -> None:
    """CONFIG, then ``key=value`` overrides (parse with ``parse_intermixed_args``: options may sit among them)."""
    parser.add_argument("config", metavar="CONFIG", help=config_help)
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optim.lr=0.1 train.epochs=3"
    )


def add_output_arguments(parser: argparse.ArgumentParser, *, what: str = "the results") -> None:
    """``--json`` (print ``what`` as JSON on stdout, tables go to stderr) and ``-o/--output FILE.json`` (write them
    there)."""
    parser.add_argument(
        "--json", action="store_true", help=f"print {what} as JSON on stdout (tables and progress go to stderr)"
    )
    parser.add_argument(
        "-o", "--output", default=None, metavar="FILE.json", help=f"also write {what} as JSON to this file"
    )


def renamed(argv: Sequence[str], spellings: Mapping[str, str], *, prog: str) -> list[str]:
    """``argv`` with the old spellings in ``spellings`` rewritten (never after ``--``), one stderr line per rewrite."""
    out: list[str] = []
    args = list(argv)
    for i, token in enumerate(args):
        if token == "--":
            return out + args[i:]
        option, eq, value = token.partition("=")
        if option not in spellings or (option == "--json" and not _json_file(value if eq else _next(args, i))):
            out.append(token)
            continue
        new = spellings[option]
        shown = f"{new} {value if eq else _next(args, i)}".rstrip() if new else "CONFIG as the first argument"
        print(f"{prog}: {option} is deprecated and will be removed in the next release; write {shown}", file=sys.stderr)
        out += ([f"{new}={value}"] if eq else [new]) if new else ([value] if eq else [])
    return out


def _next(args: list[str], i: int) -> str:
    return args[i + 1] if i + 1 < len(args) else ""


def _json_file(value: str) -> bool:
    """Whether ``--json``'s neighbour is the old spelling's file name (the new ``--json`` takes no value)."""
    return value.endswith(".json") and not value.startswith("-") and "=" not in value


def plain_text(doc: str | None) -> str:
    """A docstring for ``--help``: reStructuredText literals and roles as plain text (``x`` -> x, :mod:`x` -> x)."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc or "")
    return re.sub(r"``([^`]+)``", r"\1", text)
