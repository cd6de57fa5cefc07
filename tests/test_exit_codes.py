"""The exit-code contract (ddpkit.errors.EXIT_CODES) and torchrun's options after `--` on `ddpkit run`.

Fast: the table, `run.requeue_exit_code` (checked, honoured by the worker entry point and by the
launcher's own exit status), the argv `ddpkit run CONFIG -- OPTIONS` builds for torchrun, a typo
refused with torchrun's message (exit 2), and the cluster examples naming only codes of the table.
Slow: a real `ddpkit run` preempted with SIGTERM exits with the configured requeue code.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import REPO, tiny_config

from ddpkit import cli, errors
from ddpkit.checkpoint.preemption import Preempted
from ddpkit.config.loader import load_config
from ddpkit.errors import EXIT_CODES, NO_RETRY, ConfigError, check_requeue_exit_code
from ddpkit.launch import torchrun_adapter
from ddpkit.launch.entrypoint import run_trainer
from ddpkit.launch.launcher import _root_cause_code, _stopped_after_saving

CLUSTER = REPO / "examples" / "cluster"


def test_the_table_has_one_row_per_code_and_says_what_to_do():
    """The last check reads what a user sees: the exit code table in the real `ddpkit run --help`."""
    codes = [code for code, _, _ in EXIT_CODES]
    assert codes == [0, 1, 2, 3, 4, 75, 130] and len(set(codes)) == len(codes)
    assert NO_RETRY == {errors.EXIT_CONFIG, errors.EXIT_UNHEALTHY, errors.EXIT_INTERRUPTED}
    assert (
        errors.ConfigError.exit_code,
        errors.HealthError.exit_code,
        errors.LaunchError.exit_code,
        Preempted.exit_code,
    ) == (2, 4, 1, 75)
    table = errors.exit_code_table(requeue=138)
    assert "\n    138  stopped by a signal after saving" in table and " 75 " not in table
    help_text = subprocess.run(
        [sys.executable, "-m", "ddpkit", "run", "--help"], capture_output=True, text=True, cwd=REPO
    ).stdout
    assert errors.exit_code_table(indent="  ") in help_text and "-- TORCHRUN_OPTION" in help_text


def test_bad_data_is_refused_with_2_and_a_file_changed_under_the_job_is_worth_a_retry():
    assert errors.DataError("a token id outside the vocabulary").exit_code == errors.EXIT_CONFIG
    assert (
        errors.DataError("the token file disappeared after the run started", retryable=True).exit_code
        == errors.EXIT_FAILURE
    )
    assert errors.DataError.exit_code == errors.EXIT_CONFIG  # the class's default is unchanged by an instance


@pytest.mark.multiprocess
def test_a_token_id_outside_the_vocabulary_ends_ddpkit_run_with_2(tmp_path):
    """The whole path: the worker's DataError, torchrun's failure, the launcher's exit status."""
    import numpy as np

    tokens = np.arange(4096, dtype=np.uint16) % 300  # ids up to 299; the model embeds 257
    tokens.tofile(tmp_path / "train.bin")
    cfg = tiny_config(
        tmp_path,
        data={"name": "tokens", "batch_size": 4, "kwargs": {"path": str(tmp_path / "train.bin"), "seq_len": 32}},
        model={"name": "gpt", "kwargs": {"vocab_size": 257, "dim": 32, "depth": 1, "heads": 2, "max_len": 32}},
        train={"max_steps": 3},
    )
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(cfg))
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "run", str(tmp_path / "exp.yaml"), "--nproc-per-node", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == errors.EXIT_CONFIG, done.stderr[-3000:]
    assert "is outside the model's vocabulary [0, 257)" in done.stderr


@pytest.mark.parametrize("code", [0, 1, 2, 3, 4, 130, 256, -1])
def test_a_requeue_code_that_means_something_else_is_refused(code):
    with pytest.raises(ConfigError, match="run.requeue_exit_code"):
        check_requeue_exit_code(code)


def test_requeue_exit_code_is_a_run_setting_with_default_75(tiny_cfg):
    assert load_config(tiny_cfg).run.requeue_exit_code == 75
    assert load_config(tiny_cfg, ["run.requeue_exit_code=138"]).run.requeue_exit_code == 138
    with pytest.raises(ConfigError, match="run.requeue_exit_code"):
        load_config(tiny_cfg, ["run.requeue_exit_code=0"])


class _PreemptedTrainer:
    """Stands in for a Trainer whose fit() was stopped by a signal after saving."""

    def __init__(self, config, overrides=()):
        self.config = SimpleNamespace(run=SimpleNamespace(requeue_exit_code=int(overrides[0])))

    def fit(self):
        raise Preempted("SIGTERM: step 3 is saved")


@pytest.mark.parametrize("requeue", [75, 138])
def test_a_preempted_worker_exits_with_the_configured_code(requeue):
    with pytest.raises(SystemExit) as exit_info:
        run_trainer(_PreemptedTrainer, None, [str(requeue)])
    assert exit_info.value.code == requeue


def test_the_launcher_reads_and_returns_the_configured_code():
    def failed(*codes: int) -> SimpleNamespace:
        return SimpleNamespace(failures={rank: SimpleNamespace(exitcode=code) for rank, code in enumerate(codes)})

    assert _stopped_after_saving(failed(138, -15), 138) and not _stopped_after_saving(failed(75, -15), 138)
    assert not _stopped_after_saving(failed(138, 1), 138)  # a rank failed on its own

    def first(code: int) -> SimpleNamespace:
        return SimpleNamespace(get_first_failure=lambda: (0, SimpleNamespace(exitcode=code)))

    assert [_root_cause_code(first(code)) for code in (1, 2, 3, 4, 7, -9)] == [1, 2, 3, 4, 1, 1]


# --- torchrun's options after `--` -------------------------------------------------------------------


def _run_args(*argv: str) -> list[str]:
    """The torchrun argv `ddpkit run ARGV` builds (what ddpkit.launch.launcher.launch is given)."""
    _, commands = cli._parser()
    rest, passthrough = cli._split_at_dashes(list(argv))
    args = commands["run"].parse_intermixed_args(rest)
    args.torchrun = passthrough
    return cli.torchrun_args(args)


def test_options_after_dashes_reach_torchrun_unchanged_before_the_program():
    argv = _run_args(
        "configs/quickstart.yaml",
        "optim.lr=0.1",
        "--nproc-per-node",
        "2",
        "--",
        "--local-ranks-filter",
        "0",
        "--log-dir",
        "logs/tr",
        "--tee",
        "3",
    )
    at = argv.index("-m")
    assert argv[at - 6 : at] == ["--local-ranks-filter", "0", "--log-dir", "logs/tr", "--tee", "3"]
    assert argv[at:] == ["-m", "ddpkit", "train", "configs/quickstart.yaml", "optim.lr=0.1"]  # overrides stay ddpkit's
    parsed = torchrun_adapter.parse(argv)  # torchrun's own reading of it
    assert (parsed.local_ranks_filter, parsed.log_dir, parsed.tee, parsed.nproc_per_node) == ("0", "logs/tr", "3", "2")


def test_c10d_rendezvous_options_pass_through():
    argv = _run_args(
        "configs/quickstart.yaml",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "head:29400",
        "--",
        "--rdzv-conf",
        "join_timeout=900,read_timeout=120",
        "--local-addr",
        "10.0.0.5",
        "--monitor-interval",
        "1",
    )
    parsed = torchrun_adapter.parse(argv)
    assert (parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_conf, parsed.local_addr) == (
        "c10d",
        "head:29400",
        "join_timeout=900,read_timeout=120",
        "10.0.0.5",
    )
    assert parsed.monitor_interval == 1


def test_a_typo_after_dashes_gets_torchruns_message_and_exit_2():
    with pytest.raises(ConfigError, match="torchrun: error: unrecognized arguments: --local-rank-filter") as info:
        _run_args("configs/quickstart.yaml", "--", "--local-rank-filter", "0")
    assert info.value.exit_code == 2
    with pytest.raises(ConfigError, match="only options go after `--`"):
        _run_args("configs/quickstart.yaml", "--", "train.py")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpkit",
            "run",
            "configs/quickstart.yaml",
            "--nproc-per-node",
            "1",
            "--",
            "--local-rank-filter",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "torchrun: error: unrecognized arguments: --local-rank-filter" in done.stderr


def test_torchruns_private_names_are_read_in_one_module():
    """Reads the source of ddpkit/launch and asks the adapter about torchrun's options; it starts no process."""
    private = (
        "_option_string_actions",
        "config_from_args",
        "torch.distributed.elastic",
        "torch.distributed.run",
        "torch.distributed.launcher",
    )
    offenders = []
    for path in (REPO / "ddpkit" / "launch").glob("*.py"):
        if path.name == "torchrun_adapter.py":
            continue
        code = [line for line in path.read_text().splitlines() if ("import" in line or "getLogger" in line)]
        offenders += [f"{path.name}: {line.strip()}" for line in code if any(name in line for name in private)]
    # public: torch's documented decorator
    allowed = "from torch.distributed.elastic.multiprocessing.errors import record"
    assert [o for o in offenders if allowed not in o] == []
    for option in ("--local-ranks-filter", "--log-dir", "--tee", "--rdzv-conf", "--local-addr", "--monitor-interval"):
        assert torchrun_adapter.has_option(option), option


# --- the cluster examples name only codes of the table --------------------------------------------------


def _exit_codes_named(node) -> list[int]:
    """Every exit code a manifest names: podFailurePolicy onExitCodes values."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "onExitCodes":
                found += list(value["values"])
            else:
                found += _exit_codes_named(value)
    elif isinstance(node, list):
        for item in node:
            found += _exit_codes_named(item)
    return found


def test_the_trainjob_example_maps_the_table():
    """Reads the TrainJob manifest and parses its command with `ddpkit run`'s own parser; it starts no process."""
    runtime, job = list(yaml.safe_load_all((CLUSTER / "trainjob.yaml").read_text()))
    assert (runtime["kind"], job["kind"]) == ("TrainingRuntime", "TrainJob")
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    table = {code for code, _, _ in EXIT_CODES}
    named = _exit_codes_named(runtime)
    assert named and set(named) <= table, set(named) - table
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    rules = node["template"]["spec"]["podFailurePolicy"]["rules"]
    by_action: dict[str, set[int]] = {}
    for rule in rules:
        if "onExitCodes" in rule:
            by_action.setdefault(rule["action"], set()).update(rule["onExitCodes"]["values"])
    # retryable codes are counted: restart
    assert by_action == {"FailJob": set(NO_RETRY), "Ignore": {errors.EXIT_PREEMPTED}}
    assert node["template"]["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    policy = runtime["spec"]["template"]["spec"]["failurePolicy"]
    assert policy["rules"][0] == {
        "name": "refusedForGood",
        "action": "FailJobSet",
        "onJobFailureReasons": ["PodFailurePolicy"],
    }
    command = [*job["spec"]["trainer"]["command"], *job["spec"]["trainer"]["args"]]
    assert command[:3] == ["ddpkit", "run", "configs/quickstart.yaml"]
    _, commands = cli._parser()
    torch_plugin = {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "ddpkit-quickstart-node-0-0.ddpkit-quickstart",
        "PET_MASTER_PORT": "29400",
        "PET_NPROC_PER_NODE": "4",
    }  # what Kubeflow Trainer's torch plugin sets
    for name, value in torch_plugin.items():
        command = [arg.replace(f"$({name})", value) for arg in command]
    assert not any("$(" in arg for arg in command), command
    args = commands["run"].parse_intermixed_args(command[2:])  # ddpkit run's own parser takes the pod's command
    assert (args.nnodes, args.node_rank, args.master_port, args.nproc_per_node) == ("2", 1, 29400, "4")


def test_every_cluster_example_and_the_sbatch_script_name_only_table_codes():
    table = {code for code, _, _ in EXIT_CODES} | {138}  # 138: the requeue code docs/multinode.md sets for PyTorchJob
    for path in CLUSTER.glob("*.yaml"):
        for document in yaml.safe_load_all(path.read_text()):
            assert set(_exit_codes_named(document)) <= table, path
    sbatch = (REPO / "scripts" / "slurm.sbatch").read_text()
    assert "-eq 75" in sbatch or "requeue" in sbatch


# --- a real preempted `ddpkit run` ------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_preempted_ddpkit_run_exits_with_run_requeue_exit_code(tmp_path):
    """SIGTERM goes to the launcher, as a scheduler would send it, and the whole command must exit with
    run.requeue_exit_code."""
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(tiny_config(tmp_path, train={"epochs": 40, "log_every": 2}, run={"requeue_exit_code": 138}))
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "run", str(config), "--nproc-per-node", "2"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    metrics = Path(tmp_path) / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 138, output[-3000:]
    assert "Run the same command again to resume" in output or "run the same command again to resume" in output


def test_a_killed_frozen_rank_counts_with_the_code_its_error_file_records(tmp_path):
    """The watchdog SIGKILLs a rank frozen in C code after writing its error file (exit code 3): if
    torchrun sees that rank first, ``ddpkit run`` still exits 3, not 1."""
    import json
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddpkit.launch.launcher import _root_cause_code

    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps({"message": {"message": "hang", "extraInfo": {"timestamp": "1", "exitcode": 3, "pid": 1}}})
    )

    class Failed:
        def __init__(self, failure):
            self.failure = failure

        def get_first_failure(self):
            return 1, self.failure

    killed = ProcessFailure(local_rank=1, pid=1, exitcode=-signal.SIGKILL, error_file=str(error_file))
    assert _root_cause_code(Failed(killed)) == 3
    plain = ProcessFailure(local_rank=1, pid=1, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none.json"))
    assert _root_cause_code(Failed(plain)) == 1


def test_the_summary_shows_a_killed_frozen_rank_with_its_code_whichever_exit_torch_saw_first(tmp_path):
    """torch reports the worker it sees exit first: the frozen rank (SIGKILLed by the watchdog) or the rank that
    reported the hang (exit 3), and ddpkit adds the other from its error file. The summary reads the same."""
    import json
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddpkit.launch.launcher import _summary

    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps(
            {
                "message": {
                    "message": "hang: no heartbeat: rank 1",
                    "extraInfo": {"timestamp": "1", "exitcode": 3, "pid": 7},
                }
            }
        )
    )
    killed = ProcessFailure(local_rank=1, pid=7, exitcode=-signal.SIGKILL, error_file=str(error_file))
    reporter = ProcessFailure(local_rank=0, pid=6, exitcode=3, error_file=str(tmp_path / "none.json"))
    summary = _summary(ChildFailedError("run_program", {0: reporter, 1: killed}))
    assert re.search(r"Root Cause.*?rank\s+: 1 .*?exitcode\s+: 3 \(pid: 7\)", summary, re.DOTALL), summary
    assert "SIGKILL" not in summary, summary
