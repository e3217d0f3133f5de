"""Tests for nanospec/training/corpus.py: small corpora built from temp folders, and a 200 KB slice of the stdlib."""

import json

import pytest

from nanospec.training import corpus
from nanospec.training.corpus import EOT, build_corpus, print_stats, split_at_blank_lines


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
    assert split_at_blank_lines("a\n\nb\n\nc", chunk_bytes=3) == ["a\n\n", "b\n\n", "c"]
    assert split_at_blank_lines("a\nb\nc\nd\n", chunk_bytes=3) == ["a\nb\n", "c\nd\n"]  # no blank line: at line ends
    text = "\n\n".join(f"line {i}" for i in range(500))
    pieces = split_at_blank_lines(text, 100)
    assert "".join(pieces) == text and all(p.endswith("\n\n") for p in pieces[:-1])


def test_a_crlf_file_gives_the_documents_of_its_lf_copy(tmp_path):
    """Issue 33: a CRLF --corpus file was one document ("give more text") where its LF copy worked."""
    paragraphs = [f"paragraph {i}\n" + "word " * 50 for i in range(100)]
    (tmp_path / "lf.txt").write_bytes("\n\n".join(paragraphs).encode())
    (tmp_path / "crlf.txt").write_bytes("\r\n\r\n".join(p.replace("\n", "\r\n") for p in paragraphs).encode())
    lf = build_corpus(tmp_path / "lf", source=tmp_path / "lf.txt")
    crlf = build_corpus(tmp_path / "crlf", source=tmp_path / "crlf.txt")
    assert crlf["files"] == lf["files"] and lf["files"]["train"] >= 9
    for split in ("train.txt", "val.txt"):
        assert (tmp_path / "crlf" / split).read_bytes() == (tmp_path / "lf" / split).read_bytes()


def test_a_text_without_blank_lines_is_cut_at_line_ends(tmp_path):
    """Issue 33: a file without blank lines (one sentence per line) was one document, refused."""
    lines = [f"sentence number {i} says something about line {i}.\n" for i in range(400)]
    (tmp_path / "lines.txt").write_text("".join(lines))
    stats = build_corpus(tmp_path / "out", source=tmp_path / "lines.txt")
    assert stats["files"]["train"] >= 9 and stats["files"]["val"] >= 1
    docs = read_split(tmp_path / "out", "train") + read_split(tmp_path / "out", "val")
    assert all(d.endswith("\n") for d in docs)  # every cut at the end of a line
    assert sorted(docs) == sorted(split_at_blank_lines("".join(lines), len("".join(lines)) // 10))


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


# ----------------------------------------------------------------------------- the packages corpus (issue 35)


def module(name, lines=30):
    """A Python module whose lines are its own (long enough to count for the near-copy check)."""
    return "".join(f"def {name}_function_{i}(argument_{i}, other_{i}):  # in {name}\n" for i in range(lines))


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A fake standard library and site-packages: 24 packages of 2 files, plus what must be left out."""
    stdlib, site = tmp_path / "lib", tmp_path / "site"
    for root, prefix in ((stdlib, "std"), (site, "pkg")):
        for p in range(12):
            for f in range(2):
                path = root / f"{prefix}{p:02d}" / f"mod{f}.py"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(module(f"{prefix}{p}_{f}"))
    (stdlib / "single.py").write_text(module("single"))  # a one-file module is a package of its own
    (site / "pkg00" / "_vendor").mkdir()
    (site / "pkg00" / "_vendor" / "six.py").write_text(module("vendored"))  # a vendored copy: left out
    (site / "pkg01" / "table.py").write_text("# This file is generated by make_table.py. DO NOT EDIT.\nT = 1\n")
    (site / "pkg02" / "data.py").write_text("DATA = '" + "x" * 2000 + "'\n")  # a line of data, not code
    (site / "pkg03" / "copy.py").write_text(module("std0_0"))  # the very text of std00/mod0.py: a duplicate
    (site / "pkg00-1.0.dist-info").mkdir()
    monkeypatch.setattr(corpus, "package_roots", lambda: [("stdlib", str(stdlib)), ("site-packages", str(site))])
    return stdlib, site


def package_of(name):
    """stdlib/std07/mod0.py -> stdlib/std07; stdlib/single.py -> stdlib/single"""
    return "/".join(name.split("/")[:2]).removesuffix(".py")


def test_the_packages_corpus_holds_out_whole_packages(installed, tmp_path):
    stats = build_corpus(tmp_path / "out", packages=True, budget_bytes=10 ** 7, val_every=5)
    assert stats["holdout"] == "package" and stats["packages"]
    assert stats["skipped"] == {"a line over 1000 characters (data)": 1, "duplicate": 1, "generated": 1}
    val_packages = set(stats["val_packages"])
    assert val_packages and {package_of(n) for n in stats["val_files"]} <= val_packages
    train = (tmp_path / "out" / "train.txt").read_text()
    val = (tmp_path / "out" / "val.txt").read_text()
    assert "vendored" not in train + val and "DO NOT EDIT" not in train + val
    for package in val_packages:  # a package held out is not read in training at all
        name = package.split("/")[1]  # std07 -> functions "def std7_...", single -> "def single_..."
        stem = name[:3] + str(int(name[3:])) if name[3:].isdigit() else name
        assert f"def {stem}_" not in train and f"def {stem}_" in val
    # validation is within its share, several packages, and none of the training ones
    assert 0 < stats["bytes"]["val"] * 5 <= stats["bytes"]["train"] + stats["bytes"]["val"]
    assert stats["train_packages"] + len(val_packages) == 25
    assert [s["label"] for s in stats["sources"]] == ["stdlib", "site-packages"]
    assert sum(s["bytes"] for s in stats["sources"]) == stats["bytes"]["train"] + stats["bytes"]["val"] + len(EOT) * 2
    assert stats["sha256"] == corpus.sha256_of(tmp_path / "out" / "train.txt", tmp_path / "out" / "val.txt")
    again = build_corpus(tmp_path / "again", packages=True, budget_bytes=10 ** 7, val_every=5)
    assert again == stats  # a fixed order: the same files give the same corpus


def test_a_validation_file_copied_into_a_training_package_is_dropped(installed, tmp_path):
    stdlib, site = installed
    first = build_corpus(tmp_path / "a", packages=True, budget_bytes=10 ** 7, val_every=5)
    held_out = first["val_files"][0]  # e.g. stdlib/std07/mod0.py
    text = (stdlib.parent / ("lib" if held_out.startswith("stdlib") else "site") / held_out.split("/", 1)[1]).read_text()
    train_package = next(p for p in ("site-packages/pkg11", "site-packages/pkg10", "site-packages/pkg09")
                         if p not in first["val_packages"])
    # a near-copy (one line changed) in a package that training reads
    (site / train_package.split("/")[1] / "near.py").write_text(text.replace("argument_0", "arg_0", 1))
    second = build_corpus(tmp_path / "b", packages=True, budget_bytes=10 ** 7, val_every=5)
    if held_out in second["val_files"] or set(second["val_packages"]) != set(first["val_packages"]):
        pytest.skip("the added file moved the package choice")  # (sizes changed; not the case for these names)
    assert second["skipped"]["validation near-copy of a training file"] == 1
    assert text.splitlines()[5] not in (tmp_path / "b" / "val.txt").read_text()


def test_choose_val_packages():
    sizes = {f"p{i}": 100 for i in range(40)}
    val = corpus.choose_val_packages(sizes, 10)
    assert len(val) == 4 and val == corpus.choose_val_packages(dict(reversed(sizes.items())), 10)  # order-free
    assert "big" not in corpus.choose_val_packages({**sizes, "big": 10_000}, 10)  # no giant package held out
    assert corpus.choose_val_packages({"a": 100, "b": 50}, 10) == {"b"}  # none fits: the smallest but the first
