"""Token files for language models: a flat file of token ids, read one window at a time.

    data: {name: tokens, kwargs: {path: data/train.bin, val_path: data/val.bin, seq_len: 1024, dtype: uint16}}
    data: {name: tokens, kwargs: {corpus: stdlib, seq_len: 128}}     # bytes of Python's own sources, on every machine

    ddpkit tokenize corpus/ -o data/train.bin                          # makes such a file (ddpkit.tools.tokenize)

A file is raw token ids (``.bin``, ``dtype`` uint16 / uint32 / int32, default uint16) or a 1-D
``.npy`` array (its header gives the dtype). Sample ``i`` is ``(x, y)``: the tokens
``[i*seq_len, (i+1)*seq_len)`` and the same window shifted by one, both int64; ``len`` is the
number of such non-overlapping windows, ``(n_tokens - 1) // seq_len``. The sampler
(:mod:`ddpkit.data.samplers`) shuffles, shards and resumes over those indices.

Each window is one ``os.pread`` of ``seq_len + 1`` tokens: the file is never read whole and never
memory-mapped, so resident and virtual memory are bounded by the batches in flight and start-up
costs the same for a 20 GB file as for a small one. The file is opened lazily in each process
(a forked DataLoader worker reopens it), so the dataset pickles.

Token ids are checked against the model's vocabulary once it is known (``vocab_size`` here, or
``require_vocab(model.vocab_size)``, which the Trainer calls): an id out of range is a
:class:`~ddpkit.errors.DataError` naming the file and the offset, not an IndexError in the
embedding or a CUDA device-side assert.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpkit.data.cache import cache_dir
from ddpkit.data.mixture import mixture_datasets
from ddpkit.errors import ConfigError, DataError
from ddpkit.registry import register_dataset

__all__ = [
    "TokenFile",
    "tokens",
    "write_token_file",
    "stdlib_corpus",
    "mask_path_of",
    "require_vocab_of",
    "DTYPES",
    "BYTE_EOT",
    "BYTE_VOCAB",
    "IGNORE_INDEX",
]

#: The ``dtype`` values of a raw ``.bin`` file.
DTYPES = ("uint16", "uint32", "int32")
#: Byte-level tokens: ids 0-255 are the bytes, 256 separates documents.
BYTE_EOT = 256
BYTE_VOCAB = 257
#: A target that carries no loss (torch's ``ignore_index``): what a mask file's 0 turns a target into.
IGNORE_INDEX = -100
#: Which files of the standard library become the stdlib corpus (see :func:`stdlib_corpus`).
_CORPUS_VERSION = "v1"
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib"}


class TokenFile(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens of one file, as ``(x, y)`` int64 tensors.

    ds = TokenFile("data/train.bin", seq_len=1024)            # raw uint16 ids
    ds.require_vocab(50304)                                    # ids >= 50304 now raise DataError
    x, y = ds[0]                                               # x = tokens[0:1024], y = tokens[1:1025]
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        seq_len: int,
        dtype: str | None = None,
        vocab_size: int | None = None,
        documents: dict[str, Any] | None = None,
    ):
        self.path = str(Path(path).expanduser())
        if not isinstance(seq_len, int) or seq_len < 1:
            raise DataError(f"data.kwargs.seq_len: expected a positive integer, got {seq_len!r}")
        self.seq_len = seq_len
        self.dtype, self.offset, self.n_tokens = _layout(self.path, dtype)
        if self.n_tokens < seq_len + 1:
            raise DataError(
                f"{self.path}: {self.n_tokens:,} tokens, fewer than seq_len + 1 = {seq_len + 1:,} "
                "(one window and its shifted target); "
                f"lower data.kwargs.seq_len or use a longer file"
            )
        self.vocab_size: int | None = None
        if vocab_size is not None:
            self.require_vocab(vocab_size)
        self.mask_path = _mask_beside(self.path, self.n_tokens)
        #: ``{eot, restart_positions}`` with ``data.kwargs.document_mask``: handed to the model (require_vocab_of).
        self.documents = documents
        self._fd: int | None = None
        self._mask_fd: int | None = None
        self._pid: int | None = None

    def require_vocab(self, vocab_size: int) -> None:
        """From now on every window read raises DataError if it holds an id outside ``[0, vocab_size)``.

        Call it before DataLoader workers start (they copy the dataset), on the validation set too.
        """
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise DataError(f"{self.path}: vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = len(self)
        if not -length <= index < length:
            raise IndexError(f"window {index} out of range for {self.path} ({length:,} windows of {self.seq_len})")
        start = (index % length) * self.seq_len
        window = self._read(start, self.seq_len + 1)
        if self.vocab_size is not None:
            self._check_ids(window, start)
        both = torch.from_numpy(window.astype(np.int64))
        x = both[:-1]
        y = both[1:]
        # A chat file: targets outside the trainable turns carry no loss.
        if self.mask_path is not None:
            # One byte per token; y starts one later.
            trained = os.pread(self._files()[1], self.seq_len, start + 1)
            y = y.masked_fill(torch.frombuffer(bytearray(trained), dtype=torch.uint8) == 0, IGNORE_INDEX)
        return x, y

    def _read(self, start: int, count: int) -> np.ndarray:
        nbytes = count * self.dtype.itemsize
        data = os.pread(self._files()[0], nbytes, self.offset + start * self.dtype.itemsize)
        if len(data) != nbytes:
            raise DataError(
                f"{self.path}: read {len(data)} of {nbytes} bytes at token {start:,}; "
                "the file shrank since the run started",
                retryable=True,
            )
        return np.frombuffer(data, dtype=self.dtype)

    def _check_ids(self, window: np.ndarray, start: int) -> None:
        if window.max() >= self.vocab_size or (window.dtype.kind == "i" and window.min() < 0):
            at = int(np.argmax((window >= self.vocab_size) | (window < 0)))
            raise DataError(
                f"{self.path}: token id {int(window[at])} at token offset {start + at:,} is outside the "
                f"model's vocabulary [0, {self.vocab_size}); the file was made with another tokenizer, "
                "or raise model.kwargs.vocab_size"
            )

    def _files(self) -> tuple[int, int | None]:
        """``(token file, mask file or None)`` descriptors of this process."""
        # First read in this process (a forked DataLoader worker?): its own descriptors.
        if self._pid != os.getpid():
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
                self._mask_fd = os.open(self.mask_path, os.O_RDONLY) if self.mask_path is not None else None
                self._pid = os.getpid()
            except FileNotFoundError as exc:
                raise DataError(f"{exc.filename}: the file disappeared after the run started", retryable=True) from None
        assert self._fd is not None
        return self._fd, self._mask_fd

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None, "_mask_fd": None, "_pid": None}

    # The defaults bind os's functions early: at exit the os module may be gone.
    def __del__(self, _getpid=os.getpid, _close=os.close) -> None:
        if getattr(self, "_pid", None) == _getpid():
            for fd in (self._fd, self._mask_fd):
                if fd is not None:
                    _close(fd)

    def __repr__(self) -> str:
        return f"TokenFile({self.path!r}, seq_len={self.seq_len}, dtype={self.dtype.name}, n_tokens={self.n_tokens:,})"


def mask_path_of(path: str | os.PathLike) -> Path:
    """The mask file beside a token file: ``sft.bin`` -> ``sft.mask`` (one byte per token, 1 = a trained target)."""
    return Path(path).with_suffix(".mask")


def _mask_beside(path: str, n_tokens: int) -> str | None:
    """The mask file beside ``path`` if there is one, checked to hold one byte per token."""
    mask = mask_path_of(path)
    if not mask.is_file():
        return None
    if mask.stat().st_size != n_tokens:
        raise DataError(
            f"{mask}: {mask.stat().st_size:,} bytes but {path} holds {n_tokens:,} tokens "
            "(one mask byte each); "
            f"remake both with `ddpkit tokenize --chat`, or remove the stale mask file"
        )
    return str(mask)


def _layout(path: str, dtype: str | None) -> tuple[np.dtype, int, int]:
    """``(dtype, byte offset of token 0, number of tokens)`` from the file's size (and .npy header)."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise DataError(
            f"no such token file {path}; make one with `ddpkit tokenize INPUT... -o {path}`, "
            f"or use data.kwargs.corpus=stdlib for a small built-in corpus"
        ) from None
    if path.endswith(".npy"):
        return _npy_layout(path, dtype, size)
    if dtype is None:
        dtype = "uint16"
    if dtype not in DTYPES:
        raise DataError(f"data.kwargs.dtype: {dtype!r} is not a token dtype; choose one of {', '.join(DTYPES)}")
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise DataError(
            f"{path}: {size:,} bytes is not a whole number of {dtype} tokens ({itemsize} bytes each); "
            f"wrong data.kwargs.dtype, or a truncated file?"
        )
    return np.dtype(dtype), 0, size // itemsize


def _npy_layout(path: str, dtype: str | None, size: int) -> tuple[np.dtype, int, int]:
    """The layout of a ``.npy`` file from its header alone (the array is never loaded)."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            fmt = np.lib.format
            read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, fortran_order, found = read_header(f)
        except ValueError as exc:
            raise DataError(
                f"{path}: not a readable .npy file ({exc}); write it with numpy.save, or use a raw .bin"
            ) from None
        offset = f.tell()
    if len(shape) != 1 or fortran_order:
        raise DataError(
            f"{path}: a .npy token file must be a 1-D C-order array, this one has shape {shape}"
            f"{' in Fortran order' if fortran_order else ''}; save tokens.ravel() instead"
        )
    if found.kind not in "iu":
        raise DataError(
            f"{path}: a .npy token file must hold integers, this one holds {found}; save token ids as uint16 or uint32"
        )
    if dtype is not None and np.dtype(dtype) != found:
        raise DataError(
            f"{path}: data.kwargs.dtype is {dtype} but the .npy header says {found}; "
            "drop data.kwargs.dtype for .npy files"
        )
    if offset + shape[0] * found.itemsize > size:
        raise DataError(
            f"{path}: the header promises {shape[0]:,} {found} tokens but the file has "
            f"{size - offset:,} data bytes; a truncated file?"
        )
    return found, offset, shape[0]


def tokens(
    path: str | None = None,
    val_path: str | None = None,
    seq_len: int = 1024,
    dtype: str | None = None,
    vocab_size: int | None = None,
    corpus: str | None = None,
    sources: list | None = None,
    val_sources: list | None = None,
    repeat: bool = True,
    document_mask: bool = False,
    restart_positions: bool = False,
    eot: int = BYTE_EOT,
) -> tuple[Dataset, Dataset | None]:
    """The ``tokens`` dataset builder: ``(train, val)`` windows of ``path`` and ``val_path`` (None without one).

    ``corpus: stdlib`` instead of ``path`` uses :func:`stdlib_corpus` (built on first use, then cached);
    ``sources`` (and ``val_sources``, ``repeat``) instead of ``path`` blend several files by weight
    (:mod:`ddpkit.data.mixture`). ``document_mask`` keeps the model's attention inside the documents that
    ``eot`` separates, ``restart_positions`` restarts positions in each (:mod:`ddpkit.models.document_mask`).
    """
    documents = {"eot": eot, "restart_positions": restart_positions} if document_mask else None

    def open_file(file: str, file_dtype: str | None = None) -> TokenFile:
        return TokenFile(file, seq_len=seq_len, dtype=file_dtype or dtype, vocab_size=vocab_size, documents=documents)

    if sources is not None:
        if path is not None or val_path is not None or corpus is not None:
            raise DataError(
                "data.kwargs.sources: give either sources (and val_sources) or path/val_path/corpus, not both"
            )
        return mixture_datasets(sources, val_sources, open_file=open_file, repeat=repeat)
    if val_sources is not None:
        raise DataError(
            "data.kwargs.val_sources: validation sources come with training sources; set data.kwargs.sources"
        )
    if corpus is not None:
        if corpus != "stdlib":
            raise DataError(
                f"data.kwargs.corpus: unknown corpus {corpus!r}; the built-in one is 'stdlib' "
                "(or give data.kwargs.path)"
            )
        if path is not None or val_path is not None:
            raise DataError("data.kwargs.corpus: give either corpus or path/val_path, not both")
        path, val_path = map(str, stdlib_corpus())
    if path is None:
        raise DataError(
            "data.kwargs.path: not set; give a token file (make one with `ddpkit tokenize INPUT... "
            "-o FILE.bin`) or data.kwargs.corpus=stdlib"
        )
    return open_file(path), (open_file(val_path) if val_path is not None else None)


register_dataset("tokens", tokens)


def write_token_file(
    documents: Iterable[Iterable[np.ndarray]], path: str | os.PathLike, *, dtype: str, eot: int
) -> int:
    """Write ``documents`` to ``path`` as raw ``dtype`` ids with ``eot`` between them; return the number of tokens.

        write_token_file([[np.array([1, 2])], [np.array([3])]], "out.bin", dtype="uint16", eot=256)   # 1 2 256 3

    A document is an iterable of chunks (arrays of ids), written as they come: nothing holds the
    corpus. The file appears whole or not at all (a temporary file in the same folder, renamed).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    count = 0
    limit = np.iinfo(dtype).max
    separator = np.array([eot], dtype=dtype).tobytes()
    try:
        with os.fdopen(fd, "wb") as out:
            for i, document in enumerate(documents):
                if i:
                    out.write(separator)
                    count += 1
                for chunk in document:
                    ids = np.asarray(chunk)
                    if ids.size and (int(ids.max()) > limit or int(ids.min()) < 0):
                        bad = int(ids.max()) if int(ids.max()) > limit else int(ids.min())
                        raise DataError(
                            f"{target}: token id {bad} does not fit {dtype} (0 to {limit}); "
                            "write a wider dtype (uint32)"
                        )
                    out.write(ids.astype(dtype, copy=False).tobytes())
                    count += ids.size
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return count


def stdlib_corpus(directory: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """``(train.bin, val.bin)``: byte-level uint16 tokens (vocab 257, end-of-text 256) of the stdlib's ``.py`` files.

        train, val = stdlib_corpus()          # ~/.cache/ddpkit/stdlib-py3.11-bytes-v1/{train,val}.bin, built once

    The sources are ``sysconfig.get_paths()["stdlib"]``'s ``.py`` files in sorted order, without
    tests, idlelib and installed packages; every 20th file is held out for validation. Identical on
    machines with the same Python version and distribution. Cached under ``directory`` (default
    :func:`ddpkit.data.cache.cache_dir`, ``$DDPKIT_CACHE_DIR``, or the temp dir when caching is off).
    """
    base = Path(directory) if directory is not None else (cache_dir() or Path(tempfile.gettempdir()) / "ddpkit")
    folder = base / f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-bytes-{_CORPUS_VERSION}"
    train = folder / "train.bin"
    val = folder / "val.bin"
    if not (train.is_file() and val.is_file()):
        files = _stdlib_sources()
        for target, held_out in ((train, False), (val, True)):
            chosen = (f for i, f in enumerate(files) if (i % 20 == 19) == held_out)
            write_token_file(_byte_documents(chosen), target, dtype="uint16", eot=BYTE_EOT)
    return train, val


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = [
        p
        for p in root.rglob("*.py")
        # _sysconfigdata: the platform's build settings, which differ per machine.
        if not _SKIPPED_DIRS & set(p.relative_to(root).parts[:-1]) and not p.name.startswith("_sysconfigdata")
    ]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _byte_documents(files: Iterable[Path]) -> Iterator[list[np.ndarray]]:
    for file in files:
        yield [np.frombuffer(file.read_bytes(), dtype=np.uint8)]


def require_vocab_of(model: object, *datasets: object) -> None:
    """Hand ``model``'s vocabulary size (``model.vocab_size``, or a Hugging Face ``model.config.vocab_size``)
    to each dataset that checks token ids (``require_vocab``): an id out of range is then a clear DataError.
    With ``data.kwargs.document_mask`` the datasets' end-of-text id and position rule go to the model's
    ``use_documents`` (the one place where the data meets the model before training)."""
    # valid_vocab (gpt's padded vocabulary): the ids past it are padding, never a real token
    vocab_size = (
        getattr(model, "valid_vocab", None)
        or getattr(model, "vocab_size", None)
        or getattr(getattr(model, "config", None), "vocab_size", None)
    )
    for dataset in datasets:
        if isinstance(vocab_size, int) and callable(getattr(dataset, "require_vocab", None)):
            dataset.require_vocab(vocab_size)
    documents = next((d.documents for d in datasets if getattr(d, "documents", None)), None)
    # data.kwargs.document_mask: the model needs the end-of-text id to find documents.
    if documents is not None:
        if not callable(getattr(model, "use_documents", None)):
            raise ConfigError(
                f"data.kwargs.document_mask: {type(model).__name__} has no use_documents(eot=, "
                "restart_positions=) to keep attention inside documents; use model.name=gpt or drop it"
            )
        model.use_documents(**documents)
