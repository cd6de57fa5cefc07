"""Stopping right (issue 59): chat data tokenized with a model's own chat_template trains each assistant turn's
end-of-turn token, conversations are separated by the end-of-text, and generation stops at the end-of-turn.

.venv/bin/pytest tests/test_llama_chat.py -q
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from hf_tiny import fit, save_tiny, write_tokenizer

from ddpkit.data.text_codec import TextCodec
from ddpkit.tools import generate
from ddpkit.tools.chat_template import stop_ids
from ddpkit.tools.tokenize import main as tokenize_main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

QUESTION = {"role": "user", "content": "What is 2 + 2?"}
ANSWER = {"role": "assistant", "content": "It is 4."}


def _chats(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def _tokenized(tmp_path, folder, records) -> tuple[list[str], list[int], str]:
    """The tokens (as text) and mask ``ddpkit tokenize --chat`` wrote, and its summary line."""
    out = io.StringIO()
    chats = _chats(tmp_path / "chats.jsonl", records)
    import contextlib

    with contextlib.redirect_stdout(out):
        assert tokenize_main(["--chat", chats, "-o", str(tmp_path / "sft.bin"), "--tokenizer", str(folder)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = np.fromfile(tmp_path / "sft.bin", dtype=np.uint16).tolist()
    mask = np.fromfile(tmp_path / "sft.mask", dtype=np.uint8).tolist()
    return [tok.decode([i]) for i in ids], mask, out.getvalue()


def test_chatml_trains_each_assistant_end_of_turn_and_separates_conversations_by_end_of_text(tmp_path):
    write_tokenizer(tmp_path / "tok")  # ChatML, eos_token <|im_end|> (as Qwen2.5-Instruct and SmolLM2-Instruct)
    record = {
        "messages": [QUESTION, ANSWER, {"role": "user", "content": "Paris?"}, {"role": "assistant", "content": "Yes."}]
    }
    tokens, mask, line = _tokenized(tmp_path, tmp_path / "tok", [record, record])
    assert "end-of-text 0, end-of-turn 2)" in line  # <|endoftext|> between conversations, <|im_end|> ends turns
    ends = [i for i, t in enumerate(tokens) if t == "<|im_end|>"]
    assert [mask[i] for i in ends] == [0, 1, 0, 1] * 2  # the user turns' end is context, the assistant's a target
    assert tokens.count("<|endoftext|>") == 2 and tokens[-1] == "<|endoftext|>"
    assert "<|im_end|><|im_end|>" not in "".join(tokens)  # no doubled end-of-turn (eos is the end-of-turn here)
    trained = "".join(t for t, m in zip(tokens, mask) if m)
    assert trained == ("It is 4.<|im_end|>\nYes.<|im_end|>\n<|endoftext|>") * 2


def test_a_template_that_closes_no_turn_gets_the_end_of_turn_token_after_each_answer(tmp_path):
    write_tokenizer(tmp_path / "tok")
    config = json.loads((tmp_path / "tok/tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "tok/tokenizer_config.json").write_text(json.dumps(config))
    tokens, mask, line = _tokenized(tmp_path, tmp_path / "tok", [{"messages": [QUESTION, ANSWER]}])
    assert "end-of-turn 2)" in line
    at = tokens.index("<|im_end|>")
    assert "".join(tokens[:at]).endswith("assistant: It is 4.\n") and mask[at] == 1


def test_generation_stops_at_the_ids_the_model_directory_names(tmp_path):
    save_tiny(tmp_path, "qwen2", eos_token_id=[2, 0])
    write_tokenizer(tmp_path)
    codec = TextCodec.open(str(tmp_path / "tokenizer.json"))
    assert stop_ids(str(tmp_path), codec) == {0, 2}
    assert stop_ids(None, codec) == {0}


@pytest.mark.slow
def test_a_model_fine_tuned_on_its_chat_template_answers_and_stops(tmp_path):
    save_tiny(tmp_path / "hf", "qwen2")
    write_tokenizer(tmp_path / "hf")
    _tokenized(tmp_path, tmp_path / "hf", [{"messages": [QUESTION, ANSWER]}] * 64)
    config = {
        "run": {"output_dir": str(tmp_path / "run"), "seed": 0},
        "log": {"progress_bar": False},
        "model": {"name": "gpt", "kwargs": {"init_from": str(tmp_path / "hf")}},
        "data": {"name": "tokens", "batch_size": 8, "kwargs": {"path": str(tmp_path / "sft.bin"), "seq_len": 32}},
        "optim": {"name": "adamw", "lr": 3e-3},
        "train": {"max_steps": 150, "loss_normalization": "tokens", "log_every": 50},
    }
    fit(config)
    out = io.StringIO()
    argv = [str(tmp_path / "run"), "--chat", QUESTION["content"], "--temperature", "0", "--max-new-tokens", "40"]
    assert generate.main(argv, out=out) == 0
    prompt = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    # the answer, then nothing: it stopped at <|im_end|> instead of writing a next turn
    assert out.getvalue() == prompt + "It is 4.\n"
