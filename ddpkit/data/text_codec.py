"""Text to token ids and back, as ``ddpkit tokenize`` made them: bytes (ids 0-255, end-of-text 256) or a local
``tokenizer.json`` (the Hugging Face ``tokenizers`` library; end-of-text ``<|endoftext|>`` or ``</s>``).

    codec = TextCodec.open(None)                    # bytes
    codec = TextCodec.open("gpt2/tokenizer.json")   # a local tokenizer
    ids = codec.encode("def main():")
    stream = codec.stream()                          # decodes ids one at a time, for printing as they come
    print(stream.add(ids[0]), end="")                # "" until the text is complete (a split UTF-8 character)

``codec.check_fits(vocab_size)`` refuses, in one line, a tokenizer with more ids than the model can score.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddpkit.errors import ConfigError

__all__ = ["TextCodec", "TextStream", "BYTE_EOT"]

#: The end-of-text id of byte tokens (ids 0-255 are the bytes themselves).
BYTE_EOT = 256
_EOT_NAMES = ("<|endoftext|>", "</s>")


@dataclass(frozen=True)
class TextCodec:
    """Encode and decode text for one vocabulary; ``tokenizer`` is None for bytes."""

    vocab_size: int
    eot: int | None
    tokenizer: Any = None
    source: str = "bytes"

    @classmethod
    def open(cls, tokenizer_json: str | None, *, option: str = "--tokenizer") -> TextCodec:
        """Bytes (None) or the ``tokenizer.json`` at that path (``pip install 'ddpkit[tokenizers]'``)."""
        if tokenizer_json is None:
            return cls(vocab_size=BYTE_EOT + 1, eot=BYTE_EOT)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(
                f"{option} {tokenizer_json} needs the tokenizers package, which is not installed: "
                "pip install 'ddpkit[tokenizers]' (or leave it out for byte tokens)"
            ) from None
        try:
            tok = Tokenizer.from_file(str(tokenizer_json))
        except Exception as exc:
            # The library raises its own Exception type for a missing or malformed file.
            raise ConfigError(
                f"{option} {tokenizer_json}: cannot read it as a Hugging Face tokenizer.json ({exc})"
            ) from None
        eot = next((tok.token_to_id(name) for name in _EOT_NAMES if tok.token_to_id(name) is not None), None)
        return cls(vocab_size=tok.get_vocab_size(), eot=eot, tokenizer=tok, source=str(tokenizer_json))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(list(ids))

    def stream(self) -> TextStream:
        """A decoder of ids one at a time that returns each piece of text once it is complete."""
        return TextStream(self)

    def check_fits(self, vocab_size: int, *, option: str = "--tokenizer") -> None:
        """Refuse a vocabulary with ids the model (``vocab_size`` logits) cannot score."""
        if self.vocab_size > vocab_size:
            raise ConfigError(
                f"{option}: {self.source} has {self.vocab_size:,} ids but the model scores {vocab_size:,}; "
                "use the tokenizer the model was trained with (byte tokens need a vocabulary of 257)"
            )


class TextStream:
    """Text of ids given one by one: bytes through an incremental UTF-8 decoder, tokenizers by decoding the whole
    sequence and returning what was added (a token may change how the ones before it read)."""

    def __init__(self, codec: TextCodec):
        self._codec = codec
        self._ids = []
        self._shown = ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        if self._codec.tokenizer is None:
            return self._utf8.decode(bytes([token])) if token < 256 else ""
        self._ids.append(token)
        text = self._codec.decode(self._ids)
        # An incomplete character: wait for the next token.
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self._shown) :]
        self._shown = text
        return new

    def finish(self) -> str:
        """Whatever was still held back (an incomplete character at the very end)."""
        return self._utf8.decode(b"", final=True) if self._codec.tokenizer is None else ""
