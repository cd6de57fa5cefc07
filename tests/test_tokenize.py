"""``ddpkit tokenize``: bytes round-trip with one end-of-text between documents, the summary, errors,
a real HF tokenizer.

    .venv/bin/pytest tests/test_tokenize.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from ddpkit.data.tokens import TokenFile
from ddpkit.errors import DataError
from ddpkit.tools.tokenize import input_files, main, tokenize


def _docs(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("second\n")
    (corpus / "sub" / "c.txt").write_text("third, é\n")  # utf-8: é is two bytes
    (tmp_path / "a.txt").write_text("first document")
    return tmp_path / "a.txt", corpus


def test_bytes_round_trip_with_one_eot_between_documents(tmp_path, capsys):
    first, corpus = _docs(tmp_path)
    out = tmp_path / "data" / "train.bin"
    assert main([str(first), str(corpus), "-o", str(out)]) == 0
    ids = np.fromfile(out, dtype=np.uint16)
    documents = [bytes(part.astype(np.uint8)) for part in np.split(ids, np.flatnonzero(ids == 256))]
    assert [documents[0], *(d[1:] for d in documents[1:])] == [b"first document", b"second\n", "third, é\n".encode()]
    assert (ids == 256).sum() == 2 and ids[-1] != 256  # between documents, not after the last
    line = capsys.readouterr().out.strip()
    assert line == (
        f"ddpkit tokenize: wrote {out}: 3 documents, {ids.size} tokens, {2 * ids.size} bytes, "
        "uint16 (vocab 257, end-of-text 256)"
    )
    assert [p.name for p in out.parent.iterdir()] == ["train.bin"]  # written through a temporary, renamed
    ds = TokenFile(out, seq_len=8, vocab_size=257)  # what training reads
    assert (
        bytes(ds[0][0].numpy().astype(np.uint8)) == b"first do"
        and bytes(ds[0][1].numpy().astype(np.uint8)) == b"irst doc"
    )


def test_directories_mean_their_files_sorted(tmp_path):
    first, corpus = _docs(tmp_path)
    assert input_files([str(corpus), str(first)]) == [corpus / "b.txt", corpus / "sub" / "c.txt", first]


def test_errors_are_one_line_with_the_fix(tmp_path, capsys):
    with pytest.raises(DataError, match=r"no such input file .*missing\.txt; give existing text files or directories"):
        tokenize([str(tmp_path / "missing.txt")], str(tmp_path / "o.bin"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="an empty directory"):
        tokenize([str(tmp_path / "empty")], str(tmp_path / "o.bin"), progress=False)
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DataError, match=r"ddpkit tokenize writes raw token files; name it .*o\.bin"):
        tokenize([str(tmp_path / "a.txt")], str(tmp_path / "o.npy"), progress=False)
    with pytest.raises(DataError, match="the end-of-text id must be 256 or more"):
        tokenize([str(tmp_path / "a.txt")], str(tmp_path / "o.bin"), eot=10, progress=False)
    # bad input fails the same way again: EXIT_CONFIG
    assert main([str(tmp_path / "missing.txt"), "-o", str(tmp_path / "o.bin")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddpkit tokenize: error: no such input file") and err.count("\n") == 1
    assert not (tmp_path / "o.bin").exists()


def test_the_cli_dispatches_tokenize(tmp_path, capsys):
    from ddpkit.cli import main as cli_main

    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(SystemExit) as done:
        cli_main(["tokenize", str(tmp_path / "a.txt"), "-o", str(tmp_path / "o.bin")])
    assert done.value.code == 0 and "1 documents, 5 tokens, 10 bytes, uint16" in capsys.readouterr().out
    assert np.fromfile(tmp_path / "o.bin", dtype=np.uint16).tolist() == list(b"hello")


def _word_tokenizer(tmp_path, eot_name: str | None = "<|endoftext|>"):
    """A real tokenizer.json, trained here: word-level over a tiny vocabulary (no download)."""
    tokenizers = pytest.importorskip(
        "tokenizers", reason="the tokenizers extra is not installed (pip install tokenizers)"
    )
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]", *([eot_name] if eot_name else [])]
    tok.train_from_iterator(["the cat sat on the mat", "a dog"], trainers.WordLevelTrainer(special_tokens=special))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok, path


def test_a_local_hugging_face_tokenizer_with_its_endoftext(tmp_path, capsys):
    tok, path = _word_tokenizer(tmp_path)
    (tmp_path / "1.txt").write_text("the cat sat")
    (tmp_path / "2.txt").write_text("a dog on the mat")
    out = tmp_path / "hf.bin"
    assert main([str(tmp_path / "1.txt"), str(tmp_path / "2.txt"), "-o", str(out), "--tokenizer", str(path)]) == 0
    eot = tok.token_to_id("<|endoftext|>")
    expected = tok.encode("the cat sat").ids + [eot] + tok.encode("a dog on the mat").ids
    assert np.fromfile(out, dtype=np.uint16).tolist() == expected
    vocab = tok.get_vocab_size()
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith(f"2 documents, 9 tokens, 18 bytes, uint16 (vocab {vocab}, end-of-text {eot})")
    )


def test_a_tokenizer_without_an_endoftext_needs_eot(tmp_path):
    tok, path = _word_tokenizer(tmp_path, eot_name=None)
    (tmp_path / "1.txt").write_text("the cat")
    with pytest.raises(DataError, match=r"no <\|endoftext\|> or </s> token; name the end-of-text id with --eot ID"):
        tokenize([str(tmp_path / "1.txt")], str(tmp_path / "o.bin"), tokenizer=str(path), progress=False)
    with pytest.raises(DataError, match="--eot 999: outside the tokenizer's vocabulary"):
        tokenize([str(tmp_path / "1.txt")], str(tmp_path / "o.bin"), tokenizer=str(path), eot=999, progress=False)
    summary = tokenize([str(tmp_path / "1.txt")], str(tmp_path / "o.bin"), tokenizer=str(path), eot=0, progress=False)
    assert summary.eot == 0 and summary.tokens == 2


def test_a_missing_tokenizers_library_names_the_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tokenizers(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError("No module named 'tokenizers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DataError, match="pip install tokenizers"):
        tokenize(
            [str(tmp_path / "a.txt")],
            str(tmp_path / "o.bin"),
            tokenizer=str(tmp_path / "tokenizer.json"),
            progress=False,
        )
