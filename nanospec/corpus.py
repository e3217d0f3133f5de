"""
The training corpus: by default, the source of Python's own standard library.

Every machine that runs this code already has a few MB of clean, varied, UTF-8 Python on disk, so the
default corpus needs no download. Files are read in sorted order (by relative path) and taken until the
byte budget is full; each file is one "document". Every 10th document goes to validation, so validation
text is never seen in training (a held-out *file*, not a held-out slice of a file the model has read).

Worked example: a folder with the files a.txt, b.txt, ..., j.txt and val_every=10 ->
    data/train.txt = "<a><|endoftext|><b><|endoftext|>...<|endoftext|><i>"   (9 documents)
    data/val.txt   = "<j>"                                                  (the 10th)
    data/corpus.json: {"files": {"train": 9, "val": 1}, "val_files": ["j.txt"], ...}

    python -m nanospec.corpus                              # stdlib, 3 MB, into data/
    python -m nanospec.corpus --include-tests --budget-bytes 32000000   # stdlib with its tests, ~31 MB
    python -m nanospec.corpus --source book.txt --budget-bytes 1000000
"""

import argparse
import json
import os
import sys
import sysconfig
from collections import Counter
from pathlib import Path

from nanospec.tokenizer import EOT, write_atomic  # EOT separates documents in train.txt / val.txt

TEST_DIRS = {"test", "tests", "idle_test"}  # the stdlib's own tests: ~19 MB more Python, in by --include-tests
SKIP_DIRS = TEST_DIRS | {"site-packages", "dist-packages", "__pycache__"}  # not library code
STDLIB_DATA_DIRS = {"encodings"}  # stdlib only: ~100 generated codec tables ("LATIN CAPITAL LETTER A"), not code
MAX_FILE_BYTES = 200_000  # stdlib only: its bigger files are mostly generated (pydoc topics, unicode data)
CHUNK_BYTES = 20_000  # a single-file source is cut at blank lines into documents of about this size


def read_text(path):
    """The file's text if it is UTF-8 text (no NUL bytes), else None. Read as bytes: no newline translation."""
    data = path.read_bytes()
    if b"\x00" in data:
        return None  # binary files can be valid UTF-8 (all ASCII) but are not text
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def split_at_blank_lines(text, chunk_bytes=CHUNK_BYTES):
    r"""
    Cut one long text into pieces of about chunk_bytes, only at blank lines, so that a single-file source
    still has documents to split by. Joining the pieces with "\n\n" gives back the text.
    Example: split_at_blank_lines("a\n\nb\n\nc", chunk_bytes=5) -> ["a\n\nb", "c"]
    """
    pieces, current, size = [], [], 0
    for paragraph in text.split("\n\n"):
        current.append(paragraph)
        size += len(paragraph.encode("utf-8")) + 2  # + the blank line
        if size >= chunk_bytes:
            pieces.append("\n\n".join(current))
            current, size = [], 0
    if current:
        pieces.append("\n\n".join(current))
    return pieces


def why_unusable(text, max_bytes=None):
    """None if text can be a document, else the reason it cannot (counted in the corpus stats)."""
    if text is None:
        return "not UTF-8 text"
    if max_bytes is not None and len(text.encode("utf-8")) > max_bytes:
        return "too large"
    if not text.strip():
        return "empty"  # the stdlib has many empty __init__.py files
    if EOT in text:
        return "contains " + EOT  # it would be read back as a document boundary
    return None


def iter_documents(source, skipped, include_tests=False, source_flag="--source"):
    """
    Yield (name, text) for every document of the source, in a deterministic order; count what is left
    out in `skipped` (a Counter of reasons). Lazy: the stdlib holds ~12 MB and we usually want 3.
    include_tests: walk the test folders too (the stdlib's hold ~19 MB more).
    """
    if source is None:  # the default: the running interpreter's standard library, *.py only
        root, only_py = Path(sysconfig.get_paths()["stdlib"]), True
    else:
        root, only_py = Path(source), False
    if root.is_file():
        text = read_text(root)
        if text is None:
            raise ValueError(f"{root} is not UTF-8 text: pass a UTF-8 text file or a folder of them as {source_flag}")
        # ~10 pieces at least, so that even a small file can give one to validation
        chunk_bytes = min(CHUNK_BYTES, max(len(text.encode("utf-8")) // 10, 1))
        documents = ((f"{root.name}#{i}", piece) for i, piece in enumerate(split_at_blank_lines(text, chunk_bytes)))
    else:
        # os.walk gives no order guarantee: collect relative posix paths, then sort them
        names = []
        for dirpath, dirnames, filenames in os.walk(root):
            skip = (SKIP_DIRS - TEST_DIRS if include_tests else SKIP_DIRS) | (
                STDLIB_DATA_DIRS if only_py and Path(dirpath) == root else set())
            dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
            for fn in filenames:
                if not fn.startswith(".") and (fn.endswith(".py") or not only_py):
                    names.append((Path(dirpath) / fn).relative_to(root).as_posix())
        documents = ((name, read_text(root / name)) for name in sorted(names))  # lazy: read only what we use
    for name, text in documents:
        reason = why_unusable(text, MAX_FILE_BYTES if only_py else None)
        if reason is None:
            yield name, text
        else:
            skipped[reason] += 1


def build_corpus(out_dir="data", source=None, budget_bytes=3_000_000, val_every=10, include_tests=False,
                 source_flag="--source", budget_flag="--budget-bytes"):
    """
    Write out_dir/train.txt, out_dir/val.txt (documents joined by EOT) and out_dir/corpus.json; return the
    stats dict that corpus.json holds. source=None: the stdlib; else a UTF-8 text file or a folder of them.
    Documents are taken in order while train.txt + val.txt stay within budget_bytes; document i (from 0)
    goes to validation when i % val_every == val_every - 1 (and the last one when that picks none).
    include_tests: test folders too. source_flag, budget_flag: the flags the error messages name (the
    caller's: train_tiny.py has --corpus and no budget flag).
    """
    if source is not None and not Path(source).exists():
        raise FileNotFoundError(f"corpus source {source} does not exist: pass an existing file or folder as "
                                f"{source_flag}")
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2 (got {val_every}): every val_every-th document is held out")
    skipped = Counter()
    docs, total, seen = [], 0, 0
    for name, text in iter_documents(source, skipped, include_tests, source_flag):
        seen += 1
        # a separator counted per document keeps train.txt + val.txt together within the budget
        cost = len(text.encode("utf-8")) + len(EOT)
        if total + cost > budget_bytes:
            break  # stop, rather than skip and go on: the corpus is always a prefix of the sorted documents
        docs.append((name, text))
        total += cost
    where = "the standard library" if source is None else str(source)
    if seen == 0:
        raise ValueError(f"no usable text in {where}: {source_flag} needs UTF-8 text files")
    if len(docs) < 2:
        raise ValueError(f"got {len(docs)} document(s) from {where} within {budget_bytes:,} bytes, need >= 2 to hold "
                         f"one out for validation: {f'raise {budget_flag} or ' if budget_flag else ''}give more text")

    is_val = [i % val_every == val_every - 1 for i in range(len(docs))]
    if not any(is_val):
        is_val[-1] = True  # fewer than val_every documents: still hold one out
    train = [text for (name, text), v in zip(docs, is_val) if not v]
    val = [text for (name, text), v in zip(docs, is_val) if v]
    train_text, val_text = EOT.join(train), EOT.join(val)

    stats = {
        "source": sysconfig.get_paths()["stdlib"] if source is None else os.path.abspath(source),
        "python": sys.version.split()[0],  # the stdlib corpus differs between Python versions
        "budget_bytes": budget_bytes,
        "tests": include_tests,  # test folders walked too
        "val_every": val_every,
        "files": {"train": len(train), "val": len(val)},
        "bytes": {"train": len(train_text.encode("utf-8")), "val": len(val_text.encode("utf-8"))},
        "val_files": [name for (name, text), v in zip(docs, is_val) if v],
        "skipped": dict(sorted(skipped.items())),
    }
    out_dir = Path(out_dir)
    write_atomic(out_dir / "train.txt", train_text)
    write_atomic(out_dir / "val.txt", val_text)
    write_atomic(out_dir / "corpus.json", json.dumps(stats, indent=2) + "\n")
    return stats


def print_stats(stats, tokens_per_split=None):
    """Print what build_corpus built; tokens_per_split={"train": n, "val": m} once the text is tokenized."""
    print(f"corpus from {stats['source']} (Python {stats['python']}, budget {stats['budget_bytes']:,} bytes)")
    for split in ("train", "val"):
        line = f"  {split:5s} {stats['files'][split]:6,} files {stats['bytes'][split]:11,} bytes"
        if tokens_per_split is not None:
            n = tokens_per_split[split]
            line += f" {n:11,} tokens ({stats['bytes'][split] / max(n, 1):.2f} bytes/token)"
        print(line)
    for reason, n in stats["skipped"].items():
        print(f"  skipped {n:,} file{'s' * (n != 1)}: {reason}")


def main():
    parser = argparse.ArgumentParser(description="Build data/train.txt and data/val.txt (default: Python's stdlib).")
    parser.add_argument("--source", default=None,
                        help="a UTF-8 text file or a folder of them (default: this Python's standard library)")
    parser.add_argument("--out-dir", default="data", help="where train.txt, val.txt and corpus.json go")
    parser.add_argument("--budget-bytes", type=int, default=3_000_000, help="at most this many bytes in train.txt + val.txt")
    parser.add_argument("--val-every", type=int, default=10, help="every n-th document goes to validation")
    parser.add_argument("--include-tests", action="store_true",
                        help="walk test folders too (the stdlib's tests: ~19 MB more Python, for a GPU preset)")
    args = parser.parse_args()
    try:
        stats = build_corpus(args.out_dir, args.source, args.budget_bytes, args.val_every, args.include_tests)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print_stats(stats)
    print(f"wrote {args.out_dir}/train.txt, {args.out_dir}/val.txt, {args.out_dir}/corpus.json")


if __name__ == "__main__":
    main()
