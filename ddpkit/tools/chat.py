"""``ddpkit tokenize --chat FILE.jsonl -o sft.bin``: chat data to a token file and a mask file beside it.

    $ ddpkit tokenize --chat chats.jsonl -o data/sft.bin                       # the built-in byte template
    ddpkit tokenize: wrote data/sft.bin and data/sft.mask: 1,000 conversations, 412,311 tokens (150,222 trained), ...
    $ ddpkit tokenize --chat chats.jsonl -o data/sft.bin --tokenizer my-model/   # that directory's chat_template
    $ ddpkit tokenize --chat chats.jsonl -o data/sft.bin --skip-bad             # skip (and count) bad lines

Each line of the input is one JSON object, either a conversation or a prompt and its completion::

    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}]}
    {"prompt": "The capital of France is", "completion": " Paris."}

The mask file (``sft.mask``: ``sft.bin`` with the suffix ``.mask``) holds one byte per token: 1 where
the token is a target to train on, 0 elsewhere. Trained: the content of every ``assistant`` turn and
what closes it, or the completion; never the system and user turns, the role headers or the prompt.
The token dataset (``data: {name: tokens}``) finds the mask beside the file and turns every target
whose byte is 0 into -100, so under ``train.loss_normalization: tokens`` the loss is the mean over
the response tokens exactly. One end-of-text token follows every conversation (trained when the
conversation ends with the assistant, so the model learns to stop).

**The built-in byte template** (no ``--tokenizer``; ids 0-255 are bytes, 256 the end-of-text)::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <eot>

each turn is its header line ``<|role|>`` and its content, ending with a newline; an assistant turn's
content and newline are trained. A prompt/completion line is the two texts back to back, no header.

**A local Hugging Face tokenizer directory** (``--tokenizer DIR``, with ``transformers`` installed):
its ``chat_template`` renders each conversation; the text of assistant turn ``i`` is what rendering
turns ``0..i`` adds after rendering ``0..i-1`` with the generation prompt (the assistant header, so
it stays untrained), and each token is trained when it starts inside such a span (the tokenizer's
character offsets), the template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ...) included.
A prompt/completion line is tokenized as plain text. The end-of-text between conversations is the
tokenizer's end-of-text that is not its end-of-turn token (or ``--eot``): see
:mod:`ddpkit.tools.chat_template`.

Errors name the file and line: a line that is not JSON, a message without a role or content, a
conversation with no assistant turn to train on. ``--skip-bad`` skips such lines and counts them.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddpkit.data.tokens import BYTE_EOT, mask_path_of
from ddpkit.errors import DataError
from ddpkit.tools.chat_template import hf_template

__all__ = ["ChatSummary", "tokenize_chat", "byte_template", "hf_template"]

#: A conversation rendered: ``(ids, trained)`` where ``trained[i]`` says whether token ``i`` is a target to learn.
Rendered = tuple[np.ndarray, np.ndarray]
Template = Callable[[list[dict]], Rendered]


@dataclass(frozen=True)
class ChatSummary:
    """What :func:`tokenize_chat` wrote."""

    path: Path
    conversations: int
    tokens: int
    trained: int
    skipped: int
    dtype: str
    vocab_size: int
    eot: int
    #: The token the chat template closes each assistant turn with (trained); None for the byte template.
    end_of_turn: int | None = None

    def line(self) -> str:
        skipped = f"; skipped {self.skipped:,} bad lines" if self.skipped else ""
        turn = f", end-of-turn {self.end_of_turn}" if self.end_of_turn is not None else ""
        return (
            f"ddpkit tokenize: wrote {self.path} and {mask_path_of(self.path)}: "
            f"{self.conversations:,} conversations, "
            f"{self.tokens:,} tokens ({self.trained:,} trained), {self.dtype} (vocab {self.vocab_size:,}, "
            f"end-of-text {self.eot}{turn}){skipped}"
        )


def byte_template(messages: list[dict]) -> Rendered:
    """The built-in template over byte tokens; see the module docstring."""
    ids: list[bytes] = []
    trained: list[bool] = []
    for message in messages:
        if message.get("_raw"):  # a prompt/completion line: the texts back to back
            body = message["content"].encode()
            header = b""
        else:
            body = message["content"].encode() + b"\n"
            header = f"<|{message['role']}|>\n".encode()
        ids += [header, body]
        trained += [False] * len(header) + [message["role"] == "assistant"] * len(body)
    data = np.frombuffer(b"".join(ids), dtype=np.uint8).astype(np.int64)
    return data, np.array(trained, dtype=bool)


def conversation_of(record: object, where: str) -> list[dict]:
    """The messages of one input line, checked; a prompt/completion becomes two raw turns."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}}')
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise DataError(f'{where}: messages[{i}] has no role; give each message a "role" and a "content"')
            if not isinstance(message.get("content"), str):
                raise DataError(f'{where}: messages[{i}] ({message["role"]}) has no text "content"')
        if not any(m["role"] == "assistant" and m["content"] for m in messages):
            raise DataError(
                f"{where}: no assistant turn to train on; a conversation needs a non-empty assistant message"
            )
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if isinstance(record, dict) and "prompt" in record and "completion" in record:
        prompt = record["prompt"]
        completion = record["completion"]
        if not (isinstance(prompt, str) and isinstance(completion, str)) or not completion:
            raise DataError(f'{where}: "prompt" and "completion" must be strings, the completion non-empty')
        return [
            {"role": "user", "content": prompt, "_raw": True},
            {"role": "assistant", "content": completion, "_raw": True},
        ]
    raise DataError(f'{where}: expected {{"messages": [...]}} or {{"prompt", "completion"}}')


def _records(path: Path, skip_bad: bool, skipped: list[str]) -> Iterator[list[dict]]:
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                yield conversation_of(record, where)
            except DataError as exc:
                if not skip_bad:
                    raise DataError(f"{exc}; fix the line or pass --skip-bad to skip it") from None
                skipped.append(str(exc))


def tokenize_chat(
    path: str, output: str, *, template: Template, vocab_size: int, eot: int = BYTE_EOT, skip_bad: bool = False
) -> ChatSummary:
    """Render every conversation of ``path`` with ``template`` into ``output`` and its mask file."""
    source = Path(path).expanduser()
    if not source.is_file():
        raise DataError(f"--chat {source}: no such file; give a JSON-lines file of conversations")
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    target = Path(output)
    mask = mask_path_of(output)
    target.parent.mkdir(parents=True, exist_ok=True)
    skipped: list[str] = []
    count = tokens = trained = 0
    end_of_turn = getattr(template, "end_of_turn", None)
    with _Staged(target) as ids_out, _Staged(mask) as mask_out:
        for messages in _records(source, skip_bad, skipped):
            ids, learn = template(messages)
            # between conversations, unless the template's end-of-turn token is the end-of-text and closed it
            if eot != end_of_turn:
                ids = np.append(ids, eot)
                # the model learns to stop after answering
                learn = np.append(learn, messages[-1]["role"] == "assistant")
            ids_out.write(ids.astype(dtype).tobytes())
            mask_out.write(learn.astype(np.uint8).tobytes())
            count = count + 1
            tokens = tokens + len(ids)
            trained = trained + int(learn.sum())
    if not count:
        raise DataError(f"--chat {source}: no conversation to write ({len(skipped)} bad lines skipped)")
    return ChatSummary(target, count, tokens, trained, len(skipped), dtype, vocab_size, eot, end_of_turn)


class _Staged:
    """A file written to a temporary name in its folder and renamed into place only when the block succeeds."""

    def __init__(self, target: Path):
        self.target = target

    def __enter__(self):  # noqa: ANN204 - returns the open binary file
        fd, self.temporary = tempfile.mkstemp(dir=self.target.parent, prefix=f".{self.target.name}.", suffix=".tmp")
        self.file = os.fdopen(fd, "wb")
        return self.file

    def __exit__(self, kind: object, *_: object) -> None:
        self.file.close()
        if kind is None:
            os.replace(self.temporary, self.target)
        else:
            Path(self.temporary).unlink(missing_ok=True)
