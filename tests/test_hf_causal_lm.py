"""examples/hf_causal_lm.py on 2 real ranks under torchrun, in ddp and fsdp2: a Hugging Face GPT-2
built from a config trains on dict batches with train.loss_normalization=tokens.

    .venv/bin/pytest -q tests/test_hf_causal_lm.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port

pytest.importorskip("transformers", reason="the example needs transformers: pip install 'ddpkit[transformers]'")

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_the_hugging_face_example_trains_on_two_ranks(tmp_path, mode):
    """The example as its docstring tells users to run it: `torchrun --nproc-per-node=2 examples/hf_causal_lm.py`."""
    out = tmp_path / mode
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        str(REPO / "examples/hf_causal_lm.py"),
        f"run.output_dir={out}",
        "train.max_steps=6",
        "train.log_every=3",
        "checkpoint.every_steps=3",
        f"parallel.mode={mode}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDPKIT_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in training] == [3, 6] and all(r["tokens_per_s"] > 0 for r in training)
    validation = [r for r in records if "val_loss" in r]
    assert validation and (
        abs(validation[-1]["val_ppl"] - 2.718281828 ** validation[-1]["val_loss"]) < 1e-6 * validation[-1]["val_ppl"]
    )
    assert (out / "model.pt").is_file()
