"""Token files (``data: {name: tokens}``): exact windows, every layout, the errors, a 20 GB file, workers,
the stdlib corpus.

    .venv/bin/pytest tests/test_tokens.py -q
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ddpkit.data.tokens import BYTE_EOT, TokenFile, stdlib_corpus, tokens, write_token_file
from ddpkit.errors import DataError
from ddpkit.registry import DATASETS


def _bin(tmp_path, ids, dtype="uint16", name="train.bin"):
    path = tmp_path / name
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32"])
def test_every_window_is_the_file_slice_and_its_shift_by_one(tmp_path, dtype):
    ids = np.random.default_rng(0).integers(0, 60_000, 1003)
    ds = TokenFile(_bin(tmp_path, ids, dtype), seq_len=10, dtype=dtype)
    assert len(ds) == (1003 - 1) // 10 == 100
    for i in (0, 1, 57, 99, -1):
        x, y = ds[i]
        start = (i % 100) * 10
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (10,)
        assert np.array_equal(x.numpy(), ids[start : start + 10]) and np.array_equal(
            y.numpy(), ids[start + 1 : start + 11]
        )
    with pytest.raises(IndexError):
        ds[100]


def test_len_uses_the_last_token_only_as_a_target(tmp_path):
    # 21 tokens: two windows of 10, each with its next token
    assert len(TokenFile(_bin(tmp_path, range(21)), seq_len=10)) == 2
    # 20 tokens: the second window would lack its last target
    assert len(TokenFile(_bin(tmp_path, range(20)), seq_len=10)) == 1


def test_npy_files_carry_their_own_dtype_and_header(tmp_path):
    ids = np.arange(70_000, 70_500, dtype=np.uint32)  # ids past uint16
    np.save(tmp_path / "t.npy", ids)
    ds = TokenFile(tmp_path / "t.npy", seq_len=7)
    assert ds.dtype == np.uint32 and ds.n_tokens == 500 and len(ds) == 499 // 7
    assert ds[3][0].tolist() == list(range(70_021, 70_028)) and ds[3][1][-1].item() == 70_028
    np.save(tmp_path / "f.npy", np.asfortranarray(np.zeros((4, 8), dtype=np.uint16)))
    with pytest.raises(
        DataError,
        match=r"f\.npy: a \.npy token file must be a 1-D C-order array, "
        r"this one has shape \(4, 8\) in Fortran order",
    ):
        TokenFile(tmp_path / "f.npy", seq_len=2)
    np.save(tmp_path / "float.npy", np.zeros(100, dtype=np.float32))
    with pytest.raises(DataError, match="must hold integers, this one holds float32"):
        TokenFile(tmp_path / "float.npy", seq_len=2)
    with pytest.raises(DataError, match="data.kwargs.dtype is uint16 but the .npy header says uint32"):
        TokenFile(tmp_path / "t.npy", seq_len=7, dtype="uint16")


def test_a_size_that_is_not_whole_tokens_names_the_file_the_bytes_and_the_fix(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\0" * 1001)
    with pytest.raises(DataError) as err:
        TokenFile(path, seq_len=8)
    message = str(err.value)
    assert message == (
        f"{path}: 1,001 bytes is not a whole number of uint16 tokens (2 bytes each); "
        "wrong data.kwargs.dtype, or a truncated file?"
    )
    assert "\n" not in message


def test_too_short_missing_and_bad_dtype_are_data_errors_at_start(tmp_path):
    with pytest.raises(
        DataError, match=r"short\.bin: 10 tokens, fewer than seq_len \+ 1 = 11 .*lower data.kwargs.seq_len"
    ):
        TokenFile(_bin(tmp_path, range(10), name="short.bin"), seq_len=10)
    with pytest.raises(
        DataError,
        match=r"no such token file .*nope\.bin; make one with "
        r"`ddpkit tokenize INPUT\.\.\. -o .*nope\.bin`",
    ):
        TokenFile(tmp_path / "nope.bin", seq_len=10)
    with pytest.raises(
        DataError, match="data.kwargs.dtype: 'int64' is not a token dtype; choose one of uint16, uint32, int32"
    ):
        TokenFile(_bin(tmp_path, range(100)), seq_len=10, dtype="int64")
    with pytest.raises(DataError, match="data.kwargs.path: not set"):
        tokens(seq_len=10)


def test_an_id_outside_the_vocabulary_names_the_file_and_its_absolute_offset(tmp_path):
    ids = np.zeros(1001, dtype=np.uint16)
    ids[537] = 50_000
    path = _bin(tmp_path, ids)
    ds = TokenFile(path, seq_len=100)
    assert ds[5][0].max().item() == 50_000  # unchecked until a vocabulary is known
    ds.require_vocab(50_000)
    assert ds[4][0].max().item() == 0  # windows without the bad id still read
    expected = (
        rf"{path}: token id 50000 at token offset 537 is outside the model's vocabulary \[0, 50000\); "
        r".*model.kwargs.vocab_size"
    )
    with pytest.raises(DataError, match=expected):
        ds[5]
    negative = np.zeros(30, dtype=np.int32)
    negative[12] = -3
    with pytest.raises(DataError, match="token id -3 at token offset 12"):
        TokenFile(_bin(tmp_path, negative, "int32", "neg.bin"), seq_len=10, dtype="int32", vocab_size=100)[1]
    with pytest.raises(DataError, match="vocab_size must be a positive integer"):
        ds.require_vocab(0)


def test_a_20_gb_sparse_file_opens_at_once_and_reads_its_last_window(tmp_path):
    n_tokens, seq_len = 10**10, 1024
    windows = (n_tokens - 1) // seq_len
    last_start = (windows - 1) * seq_len
    path = tmp_path / "huge.bin"
    with open(path, "wb") as f:
        f.truncate(2 * n_tokens)  # 10^10 uint16 zeros (20 GB) that use no disk
        for offset, token in ((last_start, 7), (last_start + seq_len - 1, 8), (last_start + seq_len, 9)):
            f.seek(2 * offset)
            f.write(np.array([token], dtype=np.uint16).tobytes())
    started = time.perf_counter()
    ds = TokenFile(path, seq_len=seq_len, vocab_size=50304)
    x, y = ds[len(ds) - 1]
    assert time.perf_counter() - started < 0.5
    assert len(ds) == windows == 9_765_624
    assert x[0].item() == 7 and x[-1].item() == 8 and x[1:-1].eq(0).all() and y[-2].item() == 8 and y[-1].item() == 9


def test_pickles_without_its_descriptor_and_reads_in_a_dataloader_worker(tmp_path):
    ids = np.arange(4001) % 997
    ds = TokenFile(_bin(tmp_path, ids), seq_len=16, vocab_size=997)
    ds[0]  # opens the file in this process
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._fd is None and torch.equal(clone[3][0], ds[3][0])
    loader = DataLoader(ds, batch_size=8, num_workers=1, shuffle=False)
    batches = list(loader)
    assert len(batches) == 32 and batches[0][0].shape == (8, 16) and batches[-1][0].shape == (2, 16)
    assert np.array_equal(torch.cat([b[0] for b in batches]).flatten().numpy(), ids[: 250 * 16])


def test_the_registry_builds_train_and_optional_val(tmp_path):
    train_path, val_path = _bin(tmp_path, range(300)), _bin(tmp_path, range(100), name="val.bin")
    train, val = DATASETS.build("tokens", key="data.name", kwargs={"path": str(train_path), "seq_len": 32})
    assert isinstance(train, TokenFile) and val is None and len(train) == 299 // 32
    train, val = DATASETS.build(
        "tokens",
        key="data.name",
        kwargs={"path": str(train_path), "val_path": str(val_path), "seq_len": 32, "vocab_size": 300},
    )
    assert len(val) == 99 // 32 and val.vocab_size == 300 and val[0][1][-1].item() == 32


def test_write_token_file_puts_one_eot_between_documents_atomically(tmp_path):
    out = tmp_path / "sub" / "w.bin"
    count = write_token_file(
        [[np.array([1, 2]), np.array([3])], [np.array([4])], []], out, dtype="uint16", eot=BYTE_EOT
    )
    assert count == 6 and np.fromfile(out, dtype=np.uint16).tolist() == [1, 2, 3, 256, 4, 256]
    with pytest.raises(DataError, match="token id 70000 does not fit uint16"):
        write_token_file([[np.array([70_000])]], out, dtype="uint16", eot=256)
    assert np.fromfile(out, dtype=np.uint16).tolist() == [1, 2, 3, 256, 4, 256]  # the old file is untouched
    assert [p.name for p in out.parent.iterdir()] == ["w.bin"]  # no temporary left behind


def test_the_stdlib_corpus_is_deterministic_cached_and_reachable_from_yaml(tmp_path, monkeypatch):
    train, val = stdlib_corpus(tmp_path / "a")
    again = stdlib_corpus(tmp_path / "b")
    assert train.read_bytes() == again[0].read_bytes() and val.read_bytes() == again[1].read_bytes()
    ids = np.fromfile(train, dtype=np.uint16)
    assert ids.size > 1_000_000 and ids.max() == BYTE_EOT and (ids == BYTE_EOT).sum() > 100
    assert 0.02 < val.stat().st_size / train.stat().st_size < 0.2  # every 20th file held out
    assert b"def " in ids[:100_000].astype(np.uint8).tobytes()
    mtime = train.stat().st_mtime_ns
    assert stdlib_corpus(tmp_path / "a") == (train, val) and train.stat().st_mtime_ns == mtime  # reused, not rebuilt
    monkeypatch.setenv("DDPKIT_CACHE_DIR", str(tmp_path / "a"))
    built, held_out = DATASETS.build("tokens", key="data.name", kwargs={"corpus": "stdlib", "seq_len": 128})
    assert built.path == str(train) and held_out.path == str(val) and built[0][0].shape == (128,)
    assert built.n_tokens == ids.size
    with pytest.raises(DataError, match="unknown corpus 'shakespeare'"):
        tokens(corpus="shakespeare")
