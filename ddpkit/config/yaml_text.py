"""Reading raw config input safely: YAML files, and guards against structures no config needs.

    raw = read_yaml(Path("configs/quickstart.yaml"))   # a dict, or a ConfigError saying why not
    problems = []; check_size(raw, problems)          # refuse alias bombs before walking them

The file (a regular file of at most 1 MiB) is read as UTF-8 and parsed with :func:`parse_yaml`:
PyYAML's safe loader plus one rule, so Python object tags are refused and nothing in a config is
ever executed. Structures deeper
than 32 levels or with more than 100,000 values (YAML alias bombs) are refused before use.
The one rule added to the safe loader is YAML 1.2's spelling of numbers: ``3e-4`` (no dot) is
plain text under PyYAML's YAML 1.1 rules but a number to every user and every other tool. Such
an unquoted scalar is read as :class:`NumberText`, a ``str`` that remembers it was written as a
number; the schema (:mod:`ddpkit.config.loader`) turns it into a float for a float field, an int
for an int field when it is whole (``1e5``), and keeps it as the text for a string field
(``run.name=1e3``). A quoted ``"3e-4"`` stays an ordinary string.
The other rule is the YAML spec's own: keys in a mapping are unique. PyYAML keeps the last of two
equal keys and drops the first silently (two ``train:`` sections lose the first one's settings);
:func:`parse_yaml` raises :class:`DuplicateKeyError` naming the key's path and both line numbers.
Keys brought in by a ``<<: *anchor`` merge may be overridden, as YAML intends.
Also the small helpers that describe a raw value in a message (:func:`short_repr`, :func:`show`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_DEPTH",
    "MAX_NODES",
    "NumberText",
    "DuplicateKeyError",
    "parse_yaml",
    "dump_yaml",
    "read_yaml",
    "check_size",
    "plain_copy",
    "first_clause",
    "short_repr",
    "show",
    "key_text",
]

# A config is a few kilobytes; these limits turn a pathological file into a clear error
# instead of minutes of parsing or an exponential "billion laughs" alias expansion.
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 100_000


# Scientific notation without a dot or without an exponent sign (3e-4, 1E5, 1.0e5, 5e+2): a float
# in YAML 1.2, text in YAML 1.1. Spellings with both (2.5e-3) YAML 1.1 already reads as floats.
_NUMBER_WITH_EXPONENT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_NUMBER_TEXT_TAG = "tag:ddpkit,2026:number-text"


class NumberText(str):
    """An unquoted scalar such as ``3e-4``: text to YAML 1.1, a number as the user meant it.

    ``float(NumberText("3e-4"))`` is the value; the schema decides per field (see the module
    docstring). Only :func:`parse_yaml` creates these.
    """


class DuplicateKeyError(ValueError):
    """A mapping that names the same key twice: ``duplicates`` holds (dotted path, first line, second line), 1-based."""

    def __init__(self, duplicates: list[tuple[str, int, int]]) -> None:
        self.duplicates = duplicates
        super().__init__("; ".join(f"{path} (lines {first} and {second})" for path, first, second in duplicates))

    def describe(self) -> str:
        """``"`train` is given twice (lines 1 and 9)"``, one clause per repeated key."""
        return "; ".join(
            f"`{path}` is given twice (lines {first} and {second})" for path, first, second in self.duplicates
        )


_loader_class = None


def _config_loader() -> type:
    """PyYAML's SafeLoader plus the YAML 1.2 exponent rule (built once, on first use)."""
    global _loader_class
    if _loader_class is None:
        # Imported here, not at the top: keeps `import ddpkit` fast.
        import yaml

        class ConfigYamlLoader(yaml.SafeLoader):
            pass

        # Implicit resolvers are tried in order; int and YAML 1.1 float come first, so "3" stays an
        # int and "2.5e-3" a float. A subclass gets its own copy of the resolver table.
        ConfigYamlLoader.add_implicit_resolver(_NUMBER_TEXT_TAG, _NUMBER_WITH_EXPONENT, list("-+0123456789"))
        ConfigYamlLoader.add_constructor(
            _NUMBER_TEXT_TAG, lambda loader, node: NumberText(loader.construct_scalar(node))
        )
        _loader_class = ConfigYamlLoader
    return _loader_class


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` with ``3e-4`` read as :class:`NumberText` and repeated keys refused.

    Raises ``yaml.YAMLError`` for malformed text, :class:`DuplicateKeyError` for a key given twice.
    """
    loader = _config_loader()(text)
    try:
        # The node graph, before any value exists (what yaml.load does).
        node = loader.get_single_node()
        if node is None:
            return None
        duplicates = _duplicate_keys(node)
        if duplicates:
            raise DuplicateKeyError(duplicates)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _duplicate_keys(root: Any) -> list[tuple[str, int, int]]:
    """(dotted path, first line, second line) for every scalar key given twice in one mapping of ``root``.

    Walks the composed node graph once per node (an alias is visited once, so an alias bomb costs
    nothing here; :func:`check_size` refuses it later). Merge keys (``<<``) are skipped: overriding a
    merged key is what a merge is for.
    """
    import yaml

    found: list[tuple[str, int, int]] = []
    seen_nodes: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key_path = f"{path}.{key_node.value}" if path else key_node.value
                line = key_node.start_mark.line + 1
                identity = (key_node.tag, key_node.value)
                if identity in first_line:
                    found.append((key_path, first_line[identity], line))
                else:
                    first_line[identity] = line
                stack.append((value_node, key_path))
    return sorted(found, key=lambda item: item[2])


def dump_yaml(data: Any) -> str:
    """``yaml.safe_dump`` in block style, quoting text that :func:`parse_yaml` would read as a number.

    A string ``"1e3"`` inside free-form ``kwargs`` must come back as the string, so the resolved
    ``config.yaml`` reloads to the same config.
    """
    import yaml

    class ConfigYamlDumper(yaml.SafeDumper):
        pass

    def represent_str(dumper: yaml.SafeDumper, text: str) -> Any:
        style = "'" if _NUMBER_WITH_EXPONENT.match(text) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)

    ConfigYamlDumper.add_representer(str, represent_str)
    return yaml.dump(data, Dumper=ConfigYamlDumper, sort_keys=False, default_flow_style=False)


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping from ``path`` with :func:`parse_yaml`, turning every failure into a ConfigError."""
    # Imported here, not at the top: keeps `import ddpkit` fast.
    import yaml

    text = _read_config_text(path)
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        if "python/" in detail:
            raise ConfigError(
                f"config file {path} uses a Python object tag (!!python/...), which would run code when loaded; "
                f"ddpkit reads plain YAML only, so remove the tag ({detail})"
            ) from None
        raise ConfigError(f"config file {path} is not valid YAML: {detail}") from None
    except DuplicateKeyError as exc:
        raise ConfigError(
            f"config file {path}: {exc.describe()}; YAML keeps only the last one and would silently drop "
            "the first, so merge them into one"
        ) from None
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply to be a config") from None
    except (ValueError, OverflowError) as exc:
        # PyYAML's own converters: an integer beyond Python's digit limit, a date such as 2024-02-30.
        raise ConfigError(
            f"config file {path} holds a value YAML cannot convert ({first_clause(exc)}); "
            "fix it, or quote it to keep it as a string"
        ) from None
    if raw is None:
        raise ConfigError(f"config file {path} is empty; it needs at least one section, e.g. `data: {{name: digits}}`")
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections (run, data, model, ...), "
            f"but its top level is a {type(raw).__name__}"
        )
    return raw


def _read_config_text(path: Path) -> str:
    """The file's text, or a ConfigError saying why it cannot be had (not a file, too large, not UTF-8)."""
    data = _read_config_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}); save it as UTF-8 YAML"
        ) from None


def _read_config_bytes(path: Path) -> bytes:
    """The file's bytes, or a ConfigError saying why they cannot be had (never blocks on a pipe)."""
    try:
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist; check the path (run from the project root?)")
        if path.is_dir():
            raise ConfigError(f"config path {path} is a directory; pass a YAML file such as {path}/quickstart.yaml")
        if not path.is_file():
            # A FIFO would block until someone writes to it; a device may never end.
            raise ConfigError(f"config path {path} is not a regular file (a pipe, socket or device?); pass a YAML file")
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"config file {path} cannot be read: {exc.strerror or exc}; check the path and its permissions"
        ) from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(
            f"config file {path} is larger than {MAX_FILE_BYTES} bytes; a config should be a small YAML file"
        )
    return data


def first_clause(exc: BaseException) -> str:
    """``"Exceeds the limit (4300 digits) ...; use sys.set_int_max_str_digits() ..."`` -> the part before ``;``."""
    return str(exc).split(";")[0].strip() or type(exc).__name__


def plain_copy(value: Any) -> Any:
    """A deep copy of nested mappings and sequences (as dicts and lists); call after ``check_size``."""
    if isinstance(value, Mapping):
        return {k: plain_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_copy(v) for v in value]
    return value


def check_size(raw: Any, problems: list[str]) -> None:
    """Refuse absurdly deep or large structures (e.g. YAML alias bombs) before walking them.

    Counts a value each time it is reached, so an alias counts as often as it is used: exactly
    what copying or printing the structure would cost.
    """
    budget = MAX_NODES
    stack = [(raw, 0, "")]
    while stack:
        value, depth, path = stack.pop()
        budget -= 1
        if depth > MAX_DEPTH:
            problems.append(
                f"{_under(path)}: nested more than {MAX_DEPTH} levels deep; a config is a few levels of sections"
            )
            return
        if budget < 0:
            problems.append(
                f"{_under(path)}: the config holds more than {MAX_NODES} values (aliases count each time "
                "they are used); a config holds settings, not data"
            )
            return
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1, f"{path}.{key_text(k)}" if path else key_text(k)) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(value))


def key_text(key: Any) -> str:
    """A mapping key as it reads in a message: strings as they are, anything else as its repr."""
    return key if isinstance(key, str) else short_repr(key)


def _under(path: str) -> str:
    """Where a deep path starts, for messages: ``"model.kwargs.x[6][8][7]"`` -> ``"model.kwargs.x..."``."""
    parts = path.split("[", 1)[0].split(".")
    head = ".".join(parts[:3]) or "<top level>"
    return head + ("..." if len(parts) > 3 or "[" in path else "")


def short_repr(value: Any) -> str:
    """``repr(value)``, at most 60 characters (and an int too long for ``repr`` is described instead)."""
    try:
        text = repr(value)
    except ValueError:
        # An int beyond sys.get_int_max_str_digits().
        text = f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= 60 else text[:57] + "..."


def show(value: Any) -> str:
    return f"{short_repr(value)} ({type(value).__name__})"
