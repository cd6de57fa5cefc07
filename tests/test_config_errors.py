"""Bad config input: always a ConfigError naming the file and what is wrong, exit code 2, nothing executed.

Each bad file is loaded three ways: ``load_config``, ``ddpkit config FILE`` and ``ddpkit run FILE``
(the command line runs in this process: a bad config stops ``run`` before any worker starts). Two
cases also run ``python -m ddpkit`` for real.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import run_cli

from ddpkit import ConfigError, load_config
from ddpkit.cli import main as cli_main
from ddpkit.config.yaml_text import MAX_FILE_BYTES


def _alias_bomb() -> str:
    """'Billion laughs': 9 levels of 9 aliases, a few hundred bytes that stand for 9**9 values."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "model:\n  kwargs:\n" + "".join(f"    {line}\n" for line in lines)


def _text(content: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        path = tmp / "bad.yaml"
        path.write_text(content.replace("{marker}", str(tmp / MARKER)), encoding="utf-8")
        return path

    return make


def _bytes(content: bytes) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        path = tmp / "bad.yaml"
        path.write_bytes(content)
        return path

    return make


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "pipe.yaml")  # reading it would block until someone writes
    return tmp / "pipe.yaml"


def _directory(tmp: Path) -> Path:
    (tmp / "configs").mkdir()
    return tmp / "configs"


MARKER = "executed"  # the file a config's Python tag would create if it ran

# name: (make the bad file in a temporary directory, what the message must say)
BAD_FILES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "python_object_tag": (
        _text('!!python/object/apply:os.system ["touch {marker}"]\n'),
        "uses a Python object tag (!!python/...), which would run code "
        "when loaded; ddpkit reads plain YAML only, so remove the tag",
    ),
    "nested_python_tag": (
        _text('run:\n  name: !!python/object/apply:os.system ["touch {marker}"]\n'),
        "uses a Python object tag (!!python/...)",
    ),
    "python_name_tag": (_text("optim:\n  name: !!python/name:os.system\n"), "uses a Python object tag (!!python/...)"),
    "binary_junk": (_bytes(bytes(range(256)) * 8), "is not UTF-8 text (byte 128 is 0x80); save it as UTF-8 YAML"),
    "control_characters": (_bytes(b"\x00\x01\x02\x03run: {}\n"), "is not valid YAML: unacceptable character #x0000"),
    "latin1_text": (
        _bytes("run: {name: café}\n".encode("latin-1")),
        "is not UTF-8 text (byte 15 is 0xe9); save it as UTF-8 YAML",
    ),
    "utf16_text": (_bytes("run: {name: x}\n".encode("utf-16")), "is not UTF-8 text (byte 0 is 0xff)"),
    "directory": (_directory, "is a directory; pass a YAML file such as"),
    "missing_file": (lambda tmp: tmp / "nope.yaml", "does not exist; check the path (run from the project root?)"),
    "fifo": (_fifo, "is not a regular file (a pipe, socket or device?); pass a YAML file"),
    "name_too_long": (
        lambda tmp: tmp / ("x" * 300 + ".yaml"),
        "cannot be read: File name too long; check the path and its permissions",
    ),
    "empty_file": (_text(""), "is empty; it needs at least one section, e.g. `data: {name: digits}`"),
    "only_comments": (_text("# nothing yet\n\n"), "is empty; it needs at least one section"),
    "top_level_list": (
        _text("- run\n- data\n"),
        "must hold a mapping of sections (run, data, model, ...), but its top level is a list",
    ),
    "top_level_string": (_text("just some words\n"), "but its top level is a str"),
    "syntax_error": (_text("run: {name: [}\n"), "is not valid YAML: while parsing a flow node"),
    "alias_bomb": (
        _text(_alias_bomb()),
        "the config holds more than 100000 values (aliases count each "
        "time they are used); a config holds settings, not data",
    ),
    "nested_far_too_deep": (
        _text("model: {kwargs: {x: " + "[" * 50_000 + "]" * 50_000 + "}}\n"),
        "is nested too deeply to be a config",
    ),
    "nested_deep": (
        _text("model: {kwargs: {x: " + "[" * 40 + "]" * 40 + "}}\n"),
        "model.kwargs.x...: nested more than 32 levels deep",
    ),
    "huge_file": (
        _text("run: {name: " + "x" * (MAX_FILE_BYTES + 10) + "}\n"),
        f"is larger than {MAX_FILE_BYTES} bytes; a config should be a small YAML file",
    ),
    "integer_beyond_python_limit": (
        _text("run: {seed: " + "9" * 5000 + "}\n"),
        "holds a value YAML cannot convert (Exceeds the limit (4300 digits) for integer string conversion: value has "
        "5000 digits); fix it, or quote it to keep it as a string",
    ),
    "integer_too_large_for_a_float": (
        _text("optim: {lr: " + "9" * 400 + "}\n"),
        "optim.lr: expected a finite number, got 99999",
    ),
    "impossible_date": (
        _text("run: {name: 2024-02-30}\n"),
        "holds a value YAML cannot convert (day is out of range for month)",
    ),
}


@pytest.fixture(params=list(BAD_FILES))
def bad_file(request, tmp_path) -> tuple[Path, str, Path]:
    """(bad config path, expected message, a file the config would create if anything ran)."""
    make, expected = BAD_FILES[request.param]
    return make(tmp_path), expected, tmp_path / MARKER


def test_bad_file_gives_a_config_error_naming_the_file_and_the_problem(bad_file):
    path, expected, marker = bad_file
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(path) in str(caught.value)
    assert expected in str(caught.value)
    assert not marker.exists()


@pytest.mark.parametrize("command", ["config", "run"])
def test_bad_file_exits_2_from_the_command_line_with_one_message(bad_file, command, capsys):
    path, expected, marker = bad_file
    with pytest.raises(SystemExit) as exited:
        cli_main([command, str(path), "--nproc-per-node", "2"] if command == "run" else [command, str(path)])
    out = capsys.readouterr()
    assert exited.value.code == 2
    assert out.err.startswith(f"ddpkit {command}: error: ")
    assert str(path) in out.err and expected in out.err
    assert "Traceback" not in out.err and not out.out
    assert not marker.exists()


@pytest.mark.parametrize("command", ["config", "run"])
def test_python_tags_never_run_through_the_real_command_line(tmp_path, command):
    """The YAML is read by the real command's own config parsing (`ddpkit config` and `ddpkit run`), and the refusal
    must be the command's exit code 2 and one message on stderr."""
    marker = tmp_path / "executed"
    path = tmp_path / "evil.yaml"
    path.write_text(f'data:\n  name: digits\nrun:\n  name: !!python/object/apply:os.system ["touch {marker}"]\n')
    done = run_cli(command, str(path), *(["--nproc-per-node", "2"] if command == "run" else []), timeout=120)
    assert done.returncode == 2
    assert "uses a Python object tag" in done.stderr and "Traceback" not in done.stderr
    assert not marker.exists()


@pytest.mark.multiprocess
def test_a_config_error_only_the_workers_can_find_exits_2_with_the_message_and_no_cpp_trace(tiny_yaml):
    """The error is found in the workers, and the check is on the whole command: exit code 2, and no C++ stack trace
    from ranks reading a store that rank 0 took away as it exited."""
    # The model's own keyword arguments are checked when it is built, i.e. in the workers.
    done = run_cli("run", str(tiny_yaml), "--nproc-per-node", "2", "model.kwargs.bogus=1", timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert (
        "model.kwargs: got an unexpected keyword argument 'bogus' for model 'mlp'; "
        "it accepts: in_features, hidden, num_classes" in output
    )
    # Every rank fails at once; the one whose failure is published last must not read a store
    # that rank 0 took away on exit (TCPStore then prints a C++ stack trace).
    assert "Traceback" not in output and "frame #" not in output and "recvValue failed" not in output, output[-3000:]


# --- overrides ------------------------------------------------------------------------------------------

BILLION_LAUGHS_OVERRIDE = (
    "model.kwargs.x=[&a [1,1,1,1,1,1,1,1,1], "
    + ", ".join(f"&{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefg", "bcdefgh"))
    + "]"
)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (BILLION_LAUGHS_OVERRIDE, "model.kwargs.x...: the config holds more than 100000 values"),
        ("model.kwargs.x=" + "[" * 40 + "]" * 40, "model.kwargs.x...: nested more than 32 levels deep"),
        ("model.kwargs.x=" + "[" * 50_000, "the value is not a YAML value; quote it if it is a string"),
        ("run.seed=" + "9" * 5000, "the value cannot be converted (Exceeds the limit (4300 digits)"),
        ("optim.lr=" + "9" * 400, "optim.lr: expected a finite number, got 99999"),
        ("run.name=!!python/object/apply:os.system ['true']", "the value is not a YAML value"),
        ("run.name=a: b: c", "the value is not a YAML value"),
    ],
)
def test_bad_overrides_give_a_config_error(override, expected, capsys):
    with pytest.raises(ConfigError) as caught:
        load_config({"data": {"name": "digits"}}, [override])
    assert expected in str(caught.value)
    assert len(str(caught.value)) < 1000  # long values are shortened in the message
    with pytest.raises(SystemExit) as exited:
        cli_main(["config", os.devnull, override])  # /dev/null: not a regular file, reported with the override
    assert exited.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_an_override_changes_one_place_even_where_the_file_shares_it_by_alias(tmp_path):
    path = tmp_path / "aliases.yaml"
    path.write_text("model: {name: mlp, kwargs: &shared {hidden: [8]}}\ndata: {name: digits, kwargs: *shared}\n")
    cfg = load_config(path, ["model.kwargs.hidden=[16]"])
    assert cfg.model.kwargs == {"hidden": [16]}
    assert cfg.data.kwargs == {"hidden": [8]}


def test_many_problems_are_summarised(tmp_path):
    path = tmp_path / "data.yaml"
    path.write_text("".join(f"column{i}: {i}\n" for i in range(100)))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"invalid config {path}: 100 problems\n")
    assert message.count("\n  - ") == 30 and message.endswith("\n  ... and 70 more")


def test_a_dict_that_contains_itself_is_refused_not_a_recursion_error():
    kwargs: dict = {}
    kwargs["self"] = kwargs
    with pytest.raises(ConfigError, match=r"model.kwargs.self...: nested more than 32 levels deep"):
        load_config({"model": {"kwargs": kwargs}})
