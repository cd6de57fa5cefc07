"""The progress display: plain lines in a batch job's log, a bar on a terminal that log lines never break.

The end-to-end tests capture a real `ddpkit run` through a pipe (what SLURM and CI write) and
through a pseudo-terminal (`script`), and read the output the way a person would.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from helpers import REPO, tiny_config

from ddpkit.reporting.console import ProgressDisplay, format_duration


def plain_display(**kwargs) -> tuple[ProgressDisplay, list[str]]:
    lines: list[str] = []
    return ProgressDisplay(stream=io.StringIO(), emit=lines.append, **kwargs), lines


def test_plain_lines_have_step_percent_loss_throughput_and_eta():
    display, lines = plain_display(total=10, every=0.0)
    assert display.plain
    display.show({"loss": 0.123456, "samples/s": 1530.4, "lr": 0.05})
    for _ in range(3):
        display.update()
    assert len(lines) == 3
    assert re.fullmatch(r"progress: step 3/10 \(30%\) loss 0\.1235 samples/s 1530 lr 0\.05 eta \d+s", lines[-1]), lines[
        -1
    ]
    for _ in range(7):
        display.update()
    display.close()
    assert re.fullmatch(r"progress: step 10/10 \(100%\) .* done in \d+s", lines[-1]), lines[-1]
    assert len(lines) == 10  # close() adds nothing when the last step already has its line


def test_plain_lines_come_every_n_seconds_and_once_at_the_end():
    display, lines = plain_display(total=100, initial=40, every=3600.0)
    for _ in range(10):
        display.update()
    assert lines == []
    display.close()
    display.close()
    assert len(lines) == 1 and lines[0].startswith("progress: step 50/100 (50%)")


def test_log_lines_in_plain_mode_are_whole_lines_and_disabled_shows_nothing():
    stream = io.StringIO()
    display = ProgressDisplay(total=5, every=0.0, stream=stream, emit=lambda line: stream.write(line + "\n"))
    display.update()
    display.write("[rank0] validation: val_accuracy 0.9")
    display.update()
    display.close()
    out = stream.getvalue()
    assert "\r" not in out and out.splitlines()[1] == "[rank0] validation: val_accuracy 0.9"
    quiet, lines = plain_display(total=5, every=0.0, enabled=False)
    quiet.update()
    quiet.write("x")  # a log line still prints: only progress is off
    quiet.close()
    assert lines == []


def visible_lines(raw: str) -> list[str]:
    """What a terminal shows for each line: ``\\r`` returns to column 0 and overwrites."""
    shown = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        screen: list[str] = []
        col = 0
        for chunk in re.split(r"(\r)", line):
            if chunk == "\r":
                col = 0
                continue
            chunk = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", chunk)  # cursor moves and colours: ignored
            screen[col : col + len(chunk)] = chunk
            col += len(chunk)
        shown.append("".join(screen).rstrip())
    return shown


def test_terminal_bar_is_cleared_before_a_log_line():
    stream = io.StringIO()
    display = ProgressDisplay(total=50, stream=stream, terminal=True)
    for i in range(50):
        display.update()
        display.show({"loss": 1.0 / (i + 1)})
        if i % 10 == 9:
            display.write(f"[rank0] INFO step {i + 1} validation: val_accuracy 0.9")
    display.close()
    shown = visible_lines(stream.getvalue())
    logged = [line for line in shown if "validation" in line]
    assert len(logged) == 5 and all(line.startswith("[rank0] INFO step") for line in logged), logged
    assert "50/50" in shown[-2] or "50/50" in shown[-1]


def test_format_duration():
    assert [format_duration(s) for s in (0, 42.4, 194, 7500)] == ["0s", "42s", "3m14s", "2h05m"]


# --- real runs, captured as a batch job and a person at a terminal would see them ---------------------


def _config(tmp_path, **log) -> str:
    cfg = tiny_config(
        tmp_path,
        train={"epochs": 3, "log_every": 4},
        data={"kwargs": {"num_train": 768, "num_val": 101, "image_size": 12}},
        log={"progress_bar": True, **log},
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_piped_output_of_a_real_run_has_plain_lines_and_no_carriage_returns(tmp_path):
    """What a user sees when the command's output is piped: plain progress lines, with no terminal control
    characters."""
    cmd = [sys.executable, "-m", "ddpkit", "run", _config(tmp_path, progress_every=0.05), "--nproc-per-node", "2"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, env=_env(), cwd=REPO)
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, out[-3000:]
    assert "\r" not in out and "\x1b[" not in out, "terminal control characters in a pipe"
    progress = [line for line in out.splitlines() if "progress: " in line]
    assert progress, out[-3000:]
    assert all(re.match(r"\[rank0\] \S+ INFO progress: step \d+/72 \(\d+%\)", line) for line in progress), progress
    assert re.search(
        r"progress: step 72/72 \(100%\) loss \S+ grad_norm \S+ samples/s \d+ lr \S+ done in", progress[-1]
    ), progress[-1]
    assert len(progress) == len(set(progress)) and progress[-1].count("72/72") == 1  # one final line, not two bars
    validations = [line for line in out.splitlines() if "validation:" in line]
    assert len(validations) == 3 and all(line.startswith("[rank0] ") for line in validations), validations


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script` for a pseudo-terminal")
def test_in_a_terminal_log_lines_never_share_a_line_with_the_bar(tmp_path):
    """What a user sees on the console in a terminal: the command runs under a pseudo-terminal (`script`)."""
    inner = " ".join([sys.executable, "-m", "ddpkit", "run", _config(tmp_path), "--nproc-per-node", "2"])
    typescript = tmp_path / "typescript"
    done = subprocess.run(
        ["script", "-qfec", f"stty cols 120 rows 40; {inner}", str(typescript)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=300,
        env=_env(),
        cwd=REPO,
    )
    raw = typescript.read_bytes().decode(errors="replace")  # bytes: read_text would turn \r into \n
    assert done.returncode == 0, raw[-3000:]
    assert "\r" in raw and "step/s" in raw, "no live bar: the run did not see a terminal"
    shown = visible_lines(raw)
    validations = [line for line in shown if "validation:" in line]
    assert len(validations) == 3, shown
    for line in validations:  # the whole visible line is the log line: no bar before or after it
        assert re.fullmatch(r"\[rank0\] \S+ INFO step \d+ validation: val_accuracy \S+, val_loss \S+", line), line
    assert not any("progress: " in line for line in shown)  # plain lines only when there is no terminal
