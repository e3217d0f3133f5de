"""Tests for nanospec/corpus.py: small corpora built from temp folders, and a 200 KB slice of the stdlib."""

import json

import pytest

from nanospec import corpus
from nanospec.corpus import EOT, build_corpus, print_stats, split_at_blank_lines


def doc(i):
    return f"# document {i:02d}\ndef f{i}(x):\n    return x * {i}  # unique line {i}\n"


@pytest.fixture
def folder(tmp_path):
    """12 small text files (some nested) plus things that must be left out."""
    src = tmp_path / "src"
    for i in range(12):
        path = src / ("sub" if i % 3 == 0 else "") / f"f{i:02d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(doc(i))
    (src / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (src / "blob.bin").write_bytes(b"\x00\x01\x02")  # binary
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("hidden")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "f.py").write_text("cache")
    return src


def read_split(out, split):
    text = (out / f"{split}.txt").read_text()
    return text.split(EOT) if text else []


def test_split_by_file(folder, tmp_path):
    out = tmp_path / "out"
    stats = build_corpus(out, source=folder)
    train, val = read_split(out, "train"), read_split(out, "val")
    # sorted by relative path: f01, f02, f04, ..., then sub/f00, sub/f03, ...; the 10th (index 9) is held out
    names = sorted([f"f{i:02d}.py" for i in range(12) if i % 3] + [f"sub/f{i:02d}.py" for i in (0, 3, 6, 9)])
    assert stats["val_files"] == [names[9]] == ["sub/f03.py"]
    assert val == [doc(3)]
    assert len(train) == 11 and doc(3) not in (out / "train.txt").read_text()
    assert sorted(train + val) == sorted(doc(i) for i in range(12))  # nothing else: no hidden, binary, cached
    assert stats["files"] == {"train": 11, "val": 1}
    assert stats["bytes"]["train"] == (out / "train.txt").stat().st_size
    assert stats["skipped"] == {"not UTF-8 text": 2}
    assert json.loads((out / "corpus.json").read_text()) == stats


def test_deterministic(folder, tmp_path):
    build_corpus(tmp_path / "a", source=folder)
    build_corpus(tmp_path / "b", source=folder)
    for name in ("train.txt", "val.txt", "corpus.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["corpus.json", "train.txt", "val.txt"]  # no temp files


def test_budget_is_respected(folder, tmp_path):
    cost = len(doc(0)) + len(EOT)  # all documents have the same size
    stats = build_corpus(tmp_path / "out", source=folder, budget_bytes=5 * cost + 10)
    assert stats["files"] == {"train": 4, "val": 1}  # fewer than 10 documents: the last one is held out
    written = sum((tmp_path / "out" / f).stat().st_size for f in ("train.txt", "val.txt"))
    assert written <= 5 * cost + 10
    assert stats["val_files"] == ["f07.py"]  # a prefix of the sorted files: f01 f02 f04 f05 f07, the last held out


def test_single_file_source(tmp_path):
    paragraphs = [f"paragraph {i}\n" + "word " * 50 for i in range(100)]
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(paragraphs))
    stats = build_corpus(tmp_path / "out", source=path)
    train, val = read_split(tmp_path / "out", "train"), read_split(tmp_path / "out", "val")
    assert stats["files"]["train"] >= 9 and stats["files"]["val"] >= 1  # cut into ~10 documents
    assert stats["val_files"][0].startswith("book.txt#")
    text = path.read_text()
    assert sorted(train + val) == sorted(split_at_blank_lines(text, len(text) // 10))  # ~10 pieces
    assert not set(train) & set(val)


def test_split_at_blank_lines():
    assert split_at_blank_lines("a\n\nb\n\nc", chunk_bytes=5) == ["a\n\nb", "c"]
    text = "\n\n".join(f"line {i}" for i in range(500))
    assert "\n\n".join(split_at_blank_lines(text, 100)) == text


def test_missing_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="--source"):
        build_corpus(tmp_path / "out", source=tmp_path / "nope")


def test_no_usable_text(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "blob.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="no usable text"):
        build_corpus(tmp_path / "out", source=tmp_path / "src")
    (tmp_path / "src" / "a.txt").write_text("some text")
    with pytest.raises(ValueError, match="--budget-bytes"):  # text, but one document can't make train + val
        build_corpus(tmp_path / "out", source=tmp_path / "src")


def test_unusable_documents_are_skipped(folder, tmp_path):
    (folder / "f99.py").write_text("s = '" + EOT + "'\n")  # would be read back as two documents
    (folder / "sub" / "__init__.py").write_text("")
    stats = build_corpus(tmp_path / "out", source=folder)
    assert stats["skipped"] == {"contains " + EOT: 1, "empty": 1, "not UTF-8 text": 2}
    assert stats["files"]["train"] + stats["files"]["val"] == 12


def test_default_stdlib_corpus(tmp_path):
    stats = build_corpus(tmp_path / "a", budget_bytes=200_000)
    assert stats["bytes"]["train"] + stats["bytes"]["val"] <= 200_000
    assert stats["files"]["val"] >= 1 and stats["files"]["train"] >= 9 * stats["files"]["val"]
    assert not any(part in {"test", "tests", "site-packages"} for f in stats["val_files"] for part in f.split("/"))
    assert "def " in (tmp_path / "a" / "train.txt").read_text()
    build_corpus(tmp_path / "b", budget_bytes=200_000)
    assert (tmp_path / "a" / "train.txt").read_bytes() == (tmp_path / "b" / "train.txt").read_bytes()
    assert (tmp_path / "a" / "val.txt").read_bytes() == (tmp_path / "b" / "val.txt").read_bytes()


def test_print_stats(folder, tmp_path, capsys):
    stats = build_corpus(tmp_path / "out", source=folder)
    print_stats(stats, tokens_per_split={"train": 100, "val": 10})
    printed = capsys.readouterr().out
    assert "train" in printed and "11 files" in printed and "100 tokens" in printed and "not UTF-8" in printed


def test_cli(folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["corpus", "--source", str(folder), "--out-dir", str(tmp_path / "out"),
                                     "--budget-bytes", "100000"])
    corpus.main()
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "out" / "val.txt").read_text() == doc(3)
