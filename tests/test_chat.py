"""Chat fine-tuning data: ``ddpkit tokenize --chat`` (tokens + mask), the masked token dataset, an exact first step.

.venv/bin/pytest tests/test_chat.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import REPO, run_cli
from torch.nn import functional as F

import ddpkit
from ddpkit.data.tokens import BYTE_EOT, TokenFile
from ddpkit.tools.tokenize import main as tokenize_main

CHATS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6, of course."},
        ]
    },
    {"prompt": "The capital of France is", "completion": " Paris."},
]


def _write_chats(path: Path, records: list, n: int = 1) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for _ in range(n) for r in records))
    return path


def test_the_byte_template_trains_exactly_the_assistant_turns(tmp_path):
    chats = _write_chats(tmp_path / "chats.jsonl", CHATS)
    assert tokenize_main(["--chat", str(chats), "-o", str(tmp_path / "sft.bin")]) == 0
    ids = np.fromfile(tmp_path / "sft.bin", dtype=np.uint16)
    mask = np.fromfile(tmp_path / "sft.mask", dtype=np.uint8)
    first = (
        b"<|system|>\nBe brief.\n<|user|>\n2+2?\n<|assistant|>\n4\n<|user|>\nand 3+3?\n<|assistant|>\n6, of course.\n"
    )
    second = b"The capital of France is Paris."
    assert ids.tolist() == [*first, BYTE_EOT, *second, BYTE_EOT]
    trained = bytes(int(t) for t, m in zip(ids, mask) if m and t != BYTE_EOT)
    assert trained == b"4\n6, of course.\n Paris."
    assert mask[len(first)] == 1 and mask[-1] == 1  # each conversation's end-of-text: the model learns to stop


def test_bad_lines_are_named_with_file_and_line_or_skipped_and_counted(tmp_path, capsys):
    lines = [
        json.dumps(CHATS[0]),
        "{not json",
        json.dumps({"messages": [{"content": "hi"}]}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps(CHATS[1]),
    ]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "sft.bin")
    assert tokenize_main(["--chat", str(chats), "-o", out]) == 2
    err = capsys.readouterr().err
    assert f"{chats}:2: not valid JSON" in err and "--skip-bad" in err
    assert not (tmp_path / "sft.bin").exists() and not (tmp_path / "sft.mask").exists()  # nothing half-written
    assert tokenize_main(["--chat", str(chats), "-o", out, "--skip-bad"]) == 0
    printed = capsys.readouterr().out
    assert "2 conversations" in printed and "skipped 3 bad lines" in printed
    chats.write_text(lines[2] + "\n")
    assert tokenize_main(["--chat", str(chats), "-o", out]) == 2
    assert f"{chats}:1: messages[0] has no role" in capsys.readouterr().err
    chats.write_text(lines[3] + "\n")
    assert tokenize_main(["--chat", str(chats), "-o", out]) == 2
    assert f"{chats}:1: no assistant turn to train on" in capsys.readouterr().err


def test_skip_bad_reports_what_it_skipped(tmp_path, capsys):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps(CHATS[1]) + "\n[1, 2]\n{bad\n")
    assert tokenize_main(["--chat", str(chats), "-o", str(tmp_path / "sft.bin"), "--skip-bad"]) == 0
    out = capsys.readouterr().out
    assert "1 conversations" in out and "skipped 2 bad lines" in out


def test_the_token_dataset_turns_untrained_targets_into_minus_100(tmp_path):
    tokenize_main(["--chat", str(_write_chats(tmp_path / "c.jsonl", CHATS)), "-o", str(tmp_path / "sft.bin")])
    ids, mask = np.fromfile(tmp_path / "sft.bin", dtype=np.uint16), np.fromfile(tmp_path / "sft.mask", dtype=np.uint8)
    ds = TokenFile(tmp_path / "sft.bin", seq_len=16)
    for i in range(len(ds)):
        x, y = ds[i]
        window = slice(i * 16 + 1, i * 16 + 17)
        assert x.tolist() == ids[i * 16 : i * 16 + 16].tolist()
        assert y.tolist() == [int(t) if m else -100 for t, m in zip(ids[window], mask[window])]
    (tmp_path / "sft.mask").write_bytes(b"\x01" * 5)
    with pytest.raises(ddpkit.DataError, match=r"sft.mask: 5 bytes but .* holds .* tokens \(one mask byte each\)"):
        TokenFile(tmp_path / "sft.bin", seq_len=16)


class _FirstStep(ddpkit.Trainer):
    """Keeps the weights the first step starts from, for the hand computation."""

    def on_fit_start(self) -> None:
        self.initial = {k: v.clone() for k, v in self.unwrapped_model.state_dict().items()}


def test_the_loss_and_first_update_count_response_tokens_only(tmp_path):
    chats = _write_chats(tmp_path / "chats.jsonl", CHATS, n=3)
    tokenize_main(["--chat", str(chats), "-o", str(tmp_path / "sft.bin")])
    cfg = yaml.safe_load((REPO / "configs" / "sft_tiny.yaml").read_text())
    windows = len(TokenFile(tmp_path / "sft.bin", seq_len=cfg["data"]["kwargs"]["seq_len"]))
    cfg["run"]["output_dir"] = str(tmp_path / "run")
    cfg["data"].update(batch_size=windows, shuffle=False)  # one step over every window: the hand sum is the whole file
    cfg["data"]["kwargs"]["path"] = str(tmp_path / "sft.bin")
    cfg["optim"] = {"name": "sgd", "lr": 0.5, "momentum": 0.0, "weight_decay": 0.0}
    cfg["train"].update(max_steps=1, log_every=1, clip_grad_norm=None)
    cfg["checkpoint"] = {"every_steps": None}
    cfg["log"] = {"progress_bar": False}
    trainer = _FirstStep(cfg)
    metrics = trainer.fit()

    model = trainer.build_model()
    model.load_state_dict(trainer.initial)
    ids = torch.from_numpy(np.fromfile(tmp_path / "sft.bin", dtype=np.uint16).astype(np.int64))
    mask = torch.from_numpy(np.fromfile(tmp_path / "sft.mask", dtype=np.uint8).astype(bool))
    seq = cfg["data"]["kwargs"]["seq_len"]
    x = torch.stack([ids[i * seq : (i + 1) * seq] for i in range(windows)])
    targets = torch.stack([ids[i * seq + 1 : (i + 1) * seq + 1] for i in range(windows)])
    trained = torch.stack([mask[i * seq + 1 : (i + 1) * seq + 1] for i in range(windows)])
    log_probs = F.log_softmax(model(x).double(), dim=-1).gather(-1, targets[..., None])[..., 0]
    hand_loss = -(log_probs * trained).sum() / trained.sum()  # the mean over the response tokens, nothing else
    assert 0 < trained.sum() < trained.numel() / 2
    assert metrics["train_loss"] == pytest.approx(hand_loss.item(), rel=1e-5)
    hand_loss.backward()
    after = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for name, param in model.named_parameters():
        expected = trainer.initial[name] - 0.5 * param.grad.float()
        torch.testing.assert_close(after[name], expected, rtol=1e-4, atol=1e-6)


def test_sft_tiny_runs_on_two_ranks(tmp_path):
    """The shipped configs/sft_tiny.yaml as its header tells users to run it, `ddpkit run configs/sft_tiny.yaml
    --nproc-per-node 2` with overrides on the real command line."""
    tokenize_main(["--chat", str(_write_chats(tmp_path / "chats.jsonl", CHATS, n=40)), "-o", str(tmp_path / "sft.bin")])
    done = run_cli(
        "run",
        "configs/sft_tiny.yaml",
        "--nproc-per-node",
        "2",
        f"data.kwargs.path={tmp_path / 'sft.bin'}",
        f"run.output_dir={tmp_path / 'run'}",
        "train.max_steps=6",
        "log.progress_bar=false",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert losses and all(np.isfinite(losses))


def _word_tokenizer(folder: Path) -> Path:
    """A local Hugging Face tokenizer (whitespace words) with a chat template: nothing downloaded."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = [
        "[UNK]",
        "<eos>",
        "<system>",
        "<user>",
        "<assistant>",
        "<end>",
        "be",
        "brief",
        "hi",
        "hello",
        "there",
        "and",
        "bye",
        "ok",
        "capital",
        "paris",
    ]
    model = tokenizers.models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    fast.save_pretrained(folder)
    return folder


def test_a_local_tokenizers_chat_template_trains_the_assistant_spans_only(tmp_path, capsys):
    folder = _word_tokenizer(tmp_path / "tok")
    record = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "ok"},
        ]
    }
    chats = _write_chats(tmp_path / "c.jsonl", [record, {"prompt": "capital", "completion": "paris"}])
    assert tokenize_main(["--chat", str(chats), "-o", str(tmp_path / "sft.bin"), "--tokenizer", str(folder)]) == 0
    assert "2 conversations" in capsys.readouterr().out
    ids = np.fromfile(tmp_path / "sft.bin", dtype=np.uint16).tolist()
    mask = np.fromfile(tmp_path / "sft.mask", dtype=np.uint8).tolist()
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    words = {i: w for w, i in vocab.items()}
    rendered = [words[i] for i in ids]
    assert rendered == [
        "<system>",
        "be",
        "brief",
        "<end>",
        "<user>",
        "hi",
        "<end>",
        "<assistant>",
        "hello",
        "there",
        "<end>",
        "<user>",
        "bye",
        "<end>",
        "<assistant>",
        "ok",
        "<end>",
        "<eos>",
        "capital",
        "paris",
        "<eos>",
    ]
    trained = [w for w, m in zip(rendered, mask) if m]
    assert trained == ["hello", "there", "<end>", "ok", "<end>", "<eos>", "paris", "<eos>"]
