"""A model's own ``chat_template`` for ``ddpkit tokenize --chat --tokenizer DIR``, and the tokens a chat stops at.

    template, vocab_size, separator = hf_template("models/Qwen2.5-0.5B-Instruct", None)
    ids, trained = template(messages)          # every assistant turn and its end-of-turn token trained
    stops = stop_ids("models/Qwen2.5-0.5B-Instruct", codec)    # what ``ddpkit generate`` stops at

**The end-of-turn token.** A chat model stops by emitting the token its template closes each
assistant turn with: ``<|im_end|>`` (Qwen, SmolLM2: ChatML), ``<|eot_id|>`` (Llama 3), ``</s>``
(Mistral). It is found by rendering a probe conversation and reading the first token after the
assistant's text. It is trained: it lies inside the assistant turn's span (what rendering the turn
adds after the generation prompt), and when a template does not emit one, it is added after every
assistant turn. A model that never sees its end-of-turn token as a target never learns to stop (the
bug of collators that mask the pad token when the pad token is the end token).

**Between conversations** goes the tokenizer's end-of-text (``<|endoftext|>``, ``<|end_of_text|>``,
``</s>``: the one that is not the end-of-turn token), trained after an assistant's last turn as
before; it is what ``data.kwargs.eot`` names for ``document_mask`` (the end-of-turn token also ends
user turns, so it cannot separate conversations). When the end-of-text and the end-of-turn token
are one token (Mistral), nothing is added: the template's own token closes the conversation.

**Generation** (:func:`stop_ids`) stops at the end-of-text, at every ``eos_token_id`` of the
directory's ``generation_config.json`` / ``config.json`` (instruct models list their end-of-turn
there), at the tokenizer's ``eos_token``, and at the template's end-of-turn token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ddpkit.errors import DataError

__all__ = ["hf_template", "end_of_turn", "stop_ids", "chat_prompt", "SEPARATOR_NAMES"]

#: End-of-text tokens, in the order a separator between conversations is chosen among them.
SEPARATOR_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
_PROBE = [{"role": "user", "content": "ddpkit probe question"}, {"role": "assistant", "content": "ddpkit probe answer"}]


def _auto_tokenizer(directory: str, option: str = "--tokenizer") -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"{option} DIR with a chat template needs transformers: pip install 'ddpkit[transformers]'")
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        raise DataError(
            f"{option} {folder}: with --chat, give a local tokenizer directory (tokenizer.json and "
            "tokenizer_config.json with a chat_template); ddpkit never downloads one"
        )
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def end_of_turn(tok: Any) -> tuple[int | None, bool]:
    """``(id, emitted)``: the token the template closes an assistant turn with (``emitted``), else its ``eos_token``."""
    text = tok.apply_chat_template(_PROBE, tokenize=False)
    after = text[text.rfind(_PROBE[1]["content"]) + len(_PROBE[1]["content"]) :]
    for token in tok(after, add_special_tokens=False)["input_ids"]:
        if tok.decode([token]).strip():
            return int(token), True
    return tok.eos_token_id, False


def _separator(tok: Any, turn_end: int | None) -> int | None:
    """The end-of-text between conversations: the eos token, or another end-of-text when eos ends turns."""
    if tok.eos_token_id is not None and tok.eos_token_id != turn_end:
        return tok.eos_token_id
    vocab = tok.get_vocab()
    others = [vocab[name] for name in SEPARATOR_NAMES if name in vocab and vocab[name] != turn_end]
    return others[0] if others else turn_end


def hf_template(directory: str, eot: int | None) -> tuple[Any, int, int]:
    """``(template, vocab_size, separator)`` from the ``chat_template`` of a local Hugging Face tokenizer directory;
    ``template.end_of_turn`` is the end-of-turn id (``tokenize_chat`` adds no separator equal to it)."""
    tok = _auto_tokenizer(directory)
    if not getattr(tok, "chat_template", None):
        raise DataError(
            f"--tokenizer {directory}: the tokenizer has no chat_template; use one that has, or drop "
            "--tokenizer for the built-in byte template"
        )
    turn_end, emitted = end_of_turn(tok)
    separator = _separator(tok, turn_end) if eot is None else eot
    if separator is None:
        raise DataError(f"--tokenizer {directory}: no eos_token; name the end-of-text id with --eot ID")
    template = _ChatTemplate(tok, turn_end, add_end=not emitted)
    return template, len(tok), int(separator)


class _ChatTemplate:
    """One conversation rendered by the tokenizer's template: ``(ids, trained)`` (see the module docstring)."""

    def __init__(self, tok: Any, turn_end: int | None, *, add_end: bool):
        self.tok = tok
        self.end_of_turn = turn_end
        self.add_end = add_end

    def __call__(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        tok = self.tok
        if messages[0].get("_raw"):  # prompt/completion: plain text, no template
            prompt = tok(messages[0]["content"], add_special_tokens=False)["input_ids"]
            completion = tok(messages[1]["content"], add_special_tokens=False)["input_ids"]
            learn = np.array([False] * len(prompt) + [True] * len(completion))
            return np.array(prompt + completion, dtype=np.int64), learn
        text = tok.apply_chat_template(messages, tokenize=False)
        spans = [
            (
                len(tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)) if i else 0,
                len(tok.apply_chat_template(messages[: i + 1], tokenize=False)),
            )
            for i, m in enumerate(messages)
            if m["role"] == "assistant"
        ]
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        starts = [start for start, _ in encoded["offset_mapping"]]
        learn = [any(low <= start < high for low, high in spans) for start in starts]
        if self.add_end and self.end_of_turn is not None:
            # the template ends no assistant turn with a token: the end-of-turn goes after each, trained
            for _, high in reversed(spans):
                at = next((i for i, start in enumerate(starts) if start >= high), len(ids))
                ids.insert(at, self.end_of_turn)
                learn.insert(at, True)
                starts.insert(at, high)
        return np.array(ids, dtype=np.int64), np.array(learn, dtype=bool)


def _eos_ids(folder: Path) -> set[int]:
    """Every ``eos_token_id`` of ``generation_config.json`` and ``config.json`` in ``folder``."""
    found: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        found.update([value] if isinstance(value, int) else value if isinstance(value, list) else [])
    return found


def stop_ids(directory: str | None, codec: Any) -> set[int]:
    """The ids ``ddpkit generate`` stops at for a model whose files are in ``directory`` (see the module docstring)."""
    stops = {codec.eot} if codec.eot is not None else set()
    if directory is None or codec.tokenizer is None:
        return stops
    folder = Path(directory)
    stops |= _eos_ids(folder)
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    eos = settings.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and codec.tokenizer.token_to_id(eos) is not None:
        stops.add(codec.tokenizer.token_to_id(eos))
    if settings.get("chat_template") or (folder / "chat_template.jinja").is_file():
        try:
            stops.add(end_of_turn(_auto_tokenizer(str(folder)))[0])
        except DataError:  # transformers is not installed: the files' eos ids only
            pass
    return {int(i) for i in stops if i is not None and i < codec.vocab_size}


def chat_prompt(directory: str, message: str) -> str:
    """``message`` as a user turn in the model's chat format, followed by the assistant's header."""
    tok = _auto_tokenizer(directory, option="--chat")
    if not getattr(tok, "chat_template", None):
        raise DataError(f"--chat: {directory} has no chat_template; give the prompt as it is with --prompt")
    return tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True)
