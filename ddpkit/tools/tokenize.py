"""``ddpkit tokenize INPUT... -o FILE.bin``: text files to a token file for ``data: {name: tokens}``.

    $ ddpkit tokenize notes.txt corpus/ -o data/train.bin                 # bytes: vocab 257, end-of-text 256
    ddpkit tokenize: wrote data/train.bin: 1,204 documents, 9,811,235 tokens, 19,622,470 bytes, uint16 (vocab 257, ...)
    $ ddpkit tokenize corpus/ -o data/train.bin --tokenizer gpt2/tokenizer.json      # a local Hugging Face tokenizer

Each INPUT file is one document; a directory means every file under it, in sorted order. One
end-of-text token separates documents. Byte mode (the default) needs nothing; ``--tokenizer``
reads a local ``tokenizer.json`` with the ``tokenizers`` library (``pip install tokenizers``),
whose end-of-text is ``<|endoftext|>`` or ``</s>`` unless ``--eot`` names one. Ids are written
as uint16 when the vocabulary fits (65,536 ids), else uint32: train with ``data.kwargs.dtype``
set to the dtype printed. The output is written as it goes (one document in memory at a time; in
byte mode, 16 MiB of it) and appears only when complete. A progress bar on stderr counts bytes.

``--chat FILE.jsonl`` tokenizes conversations instead and writes a mask file beside the tokens
(:mod:`ddpkit.tools.chat`): ``ddpkit tokenize --chat chats.jsonl -o sft.bin [--skip-bad]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ddpkit.data.tokens import BYTE_EOT, write_token_file
from ddpkit.errors import DataError, exit_code_of
from ddpkit.tools.chat import ChatSummary, byte_template, hf_template, tokenize_chat

__all__ = ["main", "tokenize", "input_files", "Summary"]

#: Bytes per read in byte mode: a large document never sits in memory whole
_CHUNK = 16 << 20
_EOT_NAMES = ("<|endoftext|>", "</s>")


@dataclass(frozen=True)
class Summary:
    """What :func:`tokenize` wrote."""

    path: Path
    documents: int
    tokens: int
    dtype: str
    vocab_size: int
    eot: int

    def line(self) -> str:
        size = self.tokens * np.dtype(self.dtype).itemsize
        return (
            f"ddpkit tokenize: wrote {self.path}: {self.documents:,} documents, {self.tokens:,} tokens, "
            f"{size:,} bytes, "
            f"{self.dtype} (vocab {self.vocab_size:,}, end-of-text {self.eot})"
        )


def tokenize(
    inputs: Sequence[str], output: str, *, tokenizer: str | None = None, eot: int | None = None, progress: bool = True
) -> Summary:
    """Tokenize ``inputs`` (files, or directories of files) into ``output``; see the module docstring."""
    if Path(output).suffix == ".npy":
        raise DataError(
            f"-o {output}: ddpkit tokenize writes raw token files; name it {Path(output).with_suffix('.bin')}"
        )
    files = input_files(inputs)
    encode, vocab_size, eot = _byte_encoder(eot) if tokenizer is None else _hf_encoder(tokenizer, eot)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", file=sys.stderr, disable=not progress) as bar:
        count = write_token_file((encode(f, bar.update) for f in files), output, dtype=dtype, eot=eot)
    return Summary(Path(output), len(files), count, dtype, vocab_size, eot)


def input_files(inputs: Sequence[str]) -> list[Path]:
    """The documents: each file as given, each directory's files (recursively, sorted by path)."""
    if not inputs:
        raise DataError("ddpkit tokenize: no INPUT given; name text files or directories")
    files: list[Path] = []
    for name in inputs:
        path = Path(name).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file())
            if not found:
                raise DataError(f"{path}: an empty directory; give directories that hold the text files to tokenize")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"no such input file {path}; give existing text files or directories")
    return files


Encode = Callable[[Path, Callable[[int], object]], Iterator[np.ndarray]]


def _byte_encoder(eot: int | None) -> tuple[Encode, int, int]:
    eot = BYTE_EOT if eot is None else eot
    if eot < 256:
        raise DataError(
            f"--eot {eot}: in byte mode ids 0-255 are the bytes; the end-of-text id must be 256 or more (default 256)"
        )

    def encode(file: Path, advance: Callable[[int], object]) -> Iterator[np.ndarray]:
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                advance(len(chunk))
                yield np.frombuffer(chunk, dtype=np.uint8)

    return encode, eot + 1, eot


def _hf_encoder(tokenizer_json: str, eot: int | None) -> tuple[Encode, int, int]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(
            "--tokenizer needs the Hugging Face tokenizers library: pip install tokenizers "
            "(or pip install 'ddpkit[tokenizers]')"
        ) from None
    path = Path(tokenizer_json).expanduser()
    if not path.is_file():
        raise DataError(f"--tokenizer {path}: no such file; give a local tokenizer.json (ddpkit never downloads one)")
    tok = Tokenizer.from_file(str(path))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if eot is None:
        eot = next((tok.token_to_id(name) for name in _EOT_NAMES if tok.token_to_id(name) is not None), None)
        if eot is None:
            raise DataError(
                f"--tokenizer {path}: no {' or '.join(_EOT_NAMES)} token; name the end-of-text id with --eot ID"
            )
    if not 0 <= eot < vocab_size:
        raise DataError(
            f"--eot {eot}: outside the tokenizer's vocabulary (0 to {vocab_size - 1}); give an id the tokenizer has"
        )

    def encode(file: Path, advance: Callable[[int], object]) -> Iterator[np.ndarray]:
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{file}: not UTF-8 text ({exc}); convert it, or tokenize bytes (no --tokenizer)") from None
        advance(file.stat().st_size)
        yield np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    return encode, vocab_size, eot


def _chat(args: argparse.Namespace) -> ChatSummary:
    """``--chat``: the conversations of one JSON-lines file, with the byte template or a tokenizer's chat_template."""
    if args.inputs:
        raise DataError(f"--chat {args.chat}: give the chat file alone, not also INPUT files ({args.inputs[0]})")
    if args.tokenizer is None:
        template = byte_template
        _, vocab_size, eot = _byte_encoder(args.eot)
    else:
        template, vocab_size, eot = hf_template(args.tokenizer, args.eot)
    return tokenize_chat(
        args.chat, args.output, template=template, vocab_size=vocab_size, eot=eot, skip_bad=args.skip_bad
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddpkit tokenize", description="Text files (or chat lines) to a token file for data: {name: tokens}."
    )
    parser.add_argument(
        "inputs", nargs="*", metavar="INPUT", help="text files (one document each) or directories of them"
    )
    parser.add_argument("-o", "--output", required=True, metavar="FILE.bin", help="the token file to write")
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="tokenizer.json",
        help="a local Hugging Face tokenizer (default: bytes, vocab 257); with --chat, its directory",
    )
    parser.add_argument(
        "--eot", type=int, default=None, metavar="ID", help="the end-of-text id written between documents"
    )
    parser.add_argument(
        "--chat",
        default=None,
        metavar="FILE.jsonl",
        help="chat or prompt/completion lines: also writes FILE.mask, 1 for the trained tokens",
    )
    parser.add_argument(
        "--skip-bad", action="store_true", help="with --chat: skip and count bad lines instead of stopping"
    )
    try:
        args = parser.parse_args(list(argv or []))
    except SystemExit as exc:
        # argparse already printed usage or help
        return int(exc.code or 0)

    def run() -> int:
        if args.chat is not None:
            print(_chat(args).line())
        elif args.skip_bad:
            raise DataError("--skip-bad applies to --chat FILE.jsonl; text INPUT files have no bad lines to skip")
        else:
            print(tokenize(args.inputs, args.output, tokenizer=args.tokenizer, eot=args.eot).line())
        return 0

    return exit_code_of(run, command="ddpkit tokenize")


if __name__ == "__main__":
    sys.exit(main())
