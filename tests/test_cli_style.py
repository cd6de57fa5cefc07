"""One command-line style: CONFIG positional, --nproc-per-node, one --json, plain --help with the exit
codes, usage errors on stderr with exit 2, and the previous release's spellings with a deprecation line.

    .venv/bin/pytest -q tests/test_cli_style.py
"""

from __future__ import annotations

import json

import pytest
from helpers import run_cli

from ddpkit import __version__, cli
from ddpkit.config.cli_args import OLD_SPELLINGS, plain_text, renamed

pytestmark = pytest.mark.timeout(180)
COMMANDS = ["run", "train", "config", "export", "bench", "plot", "runs", "estimate", "goodput", "tokenize", "env"]


def _main(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_bare_ddpkit_is_a_usage_error_on_stderr_and_help_goes_to_stdout(capsys):
    code, out, err = _main([], capsys)
    assert (code, out) == (2, "") and err.startswith("usage: ddpkit")
    code, out, err = _main(["--help"], capsys)
    assert (code, err) == (0, "") and out.startswith("usage: ddpkit")
    assert "exit codes" in out and "\n  75 " in out and "\n  130 " in out  # the table, from ddpkit.errors
    code, out, err = _main(["nosuch"], capsys)
    assert code == 2 and out == "" and "unknown command 'nosuch'" in err


def test_version(capsys):
    for flag in ("--version", "-V"):
        assert _main([flag], capsys)[:2] == (0, f"ddpkit {__version__}\n")


@pytest.mark.parametrize(
    "command", [*COMMANDS, "bench throughput", "bench allreduce", "bench autotune", "bench scaling"]
)
def test_help_is_plain_text(command, capsys):
    code, out, err = _main([*command.split(), "--help"], capsys)
    assert code == 0 and out.startswith(f"usage: ddpkit {command}")
    assert "``" not in out and ":mod:" not in out and ":func:" not in out, out


def test_plain_text_drops_literals_and_roles():
    assert (
        plain_text("The ``ddpkit`` line, :mod:`ddpkit.bench.units` and :func:`~ddpkit.x.y`.")
        == "The ddpkit line, ddpkit.bench.units and ddpkit.x.y."
    )


@pytest.mark.parametrize(
    "argv, expected, message",
    [
        (["--nproc", "2"], ["--nproc-per-node", "2"], "--nproc is deprecated"),
        (["--nproc=2"], ["--nproc-per-node=2"], "--nproc is deprecated"),
        (["--config", "c.yaml", "a=1"], ["c.yaml", "a=1"], "write CONFIG as the first argument"),
        (["--config=c.yaml"], ["c.yaml"], "--config is deprecated"),
        (["--json", "out.json"], ["--output", "out.json"], "--json is deprecated"),
        (["--start-method", "fork"], ["--worker-start", "fork"], "write --worker-start fork"),
        (["--start_method=fork"], ["--worker-start=fork"], "--start_method is deprecated"),
        (["--json"], ["--json"], None),  # the new flag
        (["--json", "optim.lr=1"], ["--json", "optim.lr=1"], None),  # an override after it, not a file
        (["c.yaml", "--", "--nproc", "2"], ["c.yaml", "--", "--nproc", "2"], None),  # torchrun's, after --
    ],
)
def test_old_spellings_are_rewritten_with_one_deprecation_line(argv, expected, message, capsys):
    assert renamed(argv, OLD_SPELLINGS, prog="ddpkit bench") == expected
    err = capsys.readouterr().err
    if message is None:
        assert err == ""
    else:
        assert err.count("\n") == 1 and err.startswith("ddpkit bench: ") and message in err and "next release" in err


def test_the_launcher_flag_no_longer_collides_with_torchruns(capsys):
    parser = cli._parser()[1]["run"]
    options = {o for action in parser._actions for o in action.option_strings}
    assert "--worker-start" in options and "--start-method" not in options and "--start_method" not in options
    args = parser.parse_intermixed_args(["c.yaml", "--worker-start", "subprocess", "optim.lr=1"])
    assert (args.config, args.overrides, args.worker_start) == ("c.yaml", ["optim.lr=1"], "subprocess")
    with pytest.raises(SystemExit) as info:
        parser.parse_intermixed_args(["c.yaml", "--worker-start", "spawn"])
    assert info.value.code == 2 and "invalid choice: 'spawn'" in capsys.readouterr().err


def test_config_is_positional_everywhere_and_process_counts_are_nproc_per_node(capsys):
    import argparse
    import importlib

    from ddpkit.tools import estimate

    for name in ("autotune", "scaling"):
        parser = argparse.ArgumentParser()
        importlib.import_module(f"ddpkit.bench.{name}").add_arguments(parser)
        options = {o for action in parser._actions for o in action.option_strings}
        assert "--config" not in options and {"--json", "-o", "--output"} <= options
        assert parser.parse_intermixed_args(["c.yaml", "a=1"]).config == "c.yaml"
    for name in ("throughput", "allreduce", "autotune"):
        parser = argparse.ArgumentParser()
        importlib.import_module(f"ddpkit.bench.{name}").add_arguments(parser)
        assert "--nproc-per-node" in {o for action in parser._actions for o in action.option_strings}
    assert estimate.main(["c.yaml", "--nproc", "2", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "--nproc is deprecated" in err and "unrecognized arguments: --bogus" in err  # --nproc itself was accepted


@pytest.mark.parametrize(
    "argv",
    [
        ["runs", "--bogus"],
        ["goodput"],
        ["plot"],
        ["env", "--bogus"],
        ["tokenize"],
        ["export", "x"],
        ["config"],
        ["bench"],
        ["bench", "nosuch"],
        ["bench", "autotune"],
        ["estimate", "c.yaml"],
    ],
)
def test_usage_errors_go_to_stderr_with_exit_code_2(argv, capsys):
    code, out, err = _main(argv, capsys)
    assert code == 2 and out == "" and err.strip(), (code, out, err)
    assert "Traceback" not in err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_bench_json_prints_json_on_stdout_and_output_writes_a_file(tmp_path):
    """In the slow set: it starts two real allreduce jobs of two processes, and the fast set keeps
    test_old_spellings_are_rewritten_with_one_deprecation_line for the old spellings."""
    done = run_cli(
        "bench",
        "allreduce",
        "--nproc-per-node",
        "2",
        "--sizes",
        "4KB",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--json",
        "-o",
        str(tmp_path / "ar.json"),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)  # nothing else on stdout: the table went to stderr
    assert printed == json.loads((tmp_path / "ar.json").read_text()) and printed[0]["rows"][0]["bytes"] == 4096
    assert "busbw" in done.stderr
    old = run_cli(
        "bench",
        "allreduce",
        "--nproc",
        "2",
        "--sizes",
        "4KB",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--json",
        str(tmp_path / "old.json"),
    )
    assert old.returncode == 0 and json.loads((tmp_path / "old.json").read_text())[0]["rows"][0]["bytes"] == 4096
    assert "--nproc is deprecated" in old.stderr and "--json is deprecated" in old.stderr and "busbw" in old.stdout
