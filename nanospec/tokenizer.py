"""
A byte-level BPE tokenizer: trained by our own short trainer, then run by tiktoken (fast, in Rust).

Byte pair encoding starts from the 256 single bytes and repeatedly glues the most frequent adjacent pair
into a new token. Worked example (the classic one), train_bpe("aaabdaaabac", 256 + 3):
    count pairs: (a,a) 4, (a,b) 2, ...                     -> merge 256 = "aa"
    [aa][a][b][d][aa][a][b][a][c]: (aa,a) 2, (a,b) 2 -> tie -> merge 257 = "ab"  (tie: smaller pair ids win)
    [aa][ab][d][aa][ab][a][c]: (aa,ab) 2                  -> merge 258 = "aaab"
Text is first cut into chunks by a regex (PATTERN: words, numbers, punctuation, whitespace), and merges
never cross a chunk, so " the" can become a token but "e." cannot.

The trained ranks (token bytes -> id) are all tiktoken needs. The same ids come out of slow_encode below,
a dozen lines of obvious Python that the tests use as the oracle for tiktoken.

    ranks = train_bpe(text, 2048); save_tokenizer(ranks, "data/tok")   # data/tok.tiktoken, data/tok.vocab
    tok = Tokenizer.load("data/tok.tiktoken"); tok.encode("def f(x):")  # -> a list of ids
"""

import base64
import hashlib
import heapq
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

import tiktoken

EOT = "<|endoftext|>"  # the end-of-text special token: separates documents in the corpus (nanospec/training/corpus.py)

def write_atomic(path, data):
    """Write str/bytes to path so that readers never see half a file: temp file in the same dir, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private (0600); a data file is for everyone to read
        os.replace(tmp, path)  # atomic on POSIX and Windows when both are on the same filesystem
    except BaseException:
        os.unlink(tmp)
        raise


# Pre-tokenization: GPT-2's pattern with ASCII classes only. \s, \w and \p{L} mean different things to
# Python's `re` and to tiktoken's Rust regex on non-ASCII text; these classes mean the same in both, so
# slow_encode (Python) and tiktoken cut text into the very same chunks. Non-ASCII letters land in the
# "other" class, which is fine for a corpus of Python source.
PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)"""  # English contractions: 's 'd 'm 't 'll 've 're
    r"""| ?[A-Za-z_]+"""  # a word (identifiers include _), with its leading space
    r"""| ?[0-9]{1,3}"""  # numbers in groups of at most 3 digits
    r"""| ?[^ \t\n\r\f\vA-Za-z_0-9]+"""  # a run of punctuation / anything else, with its leading space
    r"""|[ \t\n\r\f\v]+(?![^ \t\n\r\f\v])"""  # whitespace, but leave the last space to the next word
    r"""|[ \t\n\r\f\v]+"""  # whitespace at the end of the text
)


# -----------------------------------------------------------------------------
# training


def merge(ids, pair, idx):
    """Replace every (left to right, non-overlapping) occurrence of pair in ids by idx.
    Example: merge([1, 2, 3, 1, 2], (1, 2), 4) -> [4, 3, 4]"""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(idx)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def train_bpe(text, vocab_size, pattern=PATTERN, verbose=False):
    """
    Learn byte-level BPE ranks from text: {token bytes: id}, the 256 single bytes as ids 0..255, then one
    id per merge. Deterministic: the most frequent pair wins, ties go to the smallest (left id, right id).
    EOT never takes part: text is split on it first. Stops early if no pair is left to merge.

    minbpe recounts every pair of the whole text for every merge (minutes on a few MB). Here we count
    each distinct chunk once (with its multiplicity) and, after a merge, recount only the chunks that
    contained the merged pair; a max-heap with lazy deletion picks the next pair.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be >= 256 (the single bytes), got {vocab_size}")
    words, counts, pair_counts, where = count_pairs(text, pattern)
    # heap of (-count, pair): heapq is a min-heap, so -count puts the most frequent pair on top, and the
    # tuple order breaks ties by the smallest pair. Counts change after every merge; instead of finding and
    # updating old entries we push new ones and drop stale ones when they surface ("lazy deletion").
    heap = [(-c, pair) for pair, c in pair_counts.items()]
    heapq.heapify(heap)

    vocab = [bytes([i]) for i in range(256)]  # id -> token bytes
    ranks = {b: i for i, b in enumerate(vocab)}  # token bytes -> id
    while len(vocab) < vocab_size and heap:
        neg_count, pair = heapq.heappop(heap)
        count = pair_counts[pair]
        if count != -neg_count:  # stale: the pair lost occurrences since this entry was pushed
            if count > 0:
                heapq.heappush(heap, (-count, pair))
            continue
        token = vocab[pair[0]] + vocab[pair[1]]
        # rarely, two different pairs spell the same bytes (e.g. [ab][c] and [a][bc]); tiktoken needs one
        # id per byte string, so the second pair merges into the existing token instead of a new one
        idx = ranks.get(token)
        if idx is None:
            idx = len(vocab)
            vocab.append(token)
            ranks[token] = idx
            if verbose and (idx + 1) % 256 == 0:
                print(f"merge {idx + 1 - 256}/{vocab_size - 256}: {token!r} occurs {count:,} times")
        # only pairs with the new token can have gained occurrences: they need (fresh) heap entries
        for p in merge_everywhere(words, counts, pair_counts, where, pair, idx):
            heapq.heappush(heap, (-pair_counts[p], p))
    return ranks


def count_pairs(text, pattern=PATTERN):
    """Cut text into chunks once and count them (Python source repeats a lot: "self", "    ", " return"), then
    count the adjacent pairs. Returns words (each distinct chunk as a list of byte ids), counts (how often each
    occurs), pair_counts (pair -> total count) and where (pair -> the words that contain it; may hold stale
    entries, see merge_everywhere)."""
    regex = re.compile(pattern)
    chunk_counts = Counter()
    for doc in text.split(EOT):
        chunk_counts.update(regex.findall(doc))
    words = [list(chunk.encode("utf-8")) for chunk in chunk_counts]
    counts = list(chunk_counts.values())
    pair_counts, where = Counter(), {}
    for i, (w, c) in enumerate(zip(words, counts)):
        for pair in zip(w, w[1:]):
            pair_counts[pair] += c
            where.setdefault(pair, set()).add(i)
    return words, counts, pair_counts, where


def merge_everywhere(words, counts, pair_counts, where, pair, idx):
    """Merge pair into idx in every word that contains it, updating the counts in place: take out all the old
    pairs of those words, put in the new ones. Returns the pairs with the new token (they gained occurrences)."""
    touched = set()
    for i in where.pop(pair):
        w, c = words[i], counts[i]
        new = merge(w, pair, idx)
        if len(new) == len(w):
            continue  # stale entry: an earlier merge already broke this pair up in word i
        for p in zip(w, w[1:]):
            pair_counts[p] -= c
        for p in zip(new, new[1:]):
            pair_counts[p] += c
            where.setdefault(p, set()).add(i)
            if idx in p:
                touched.add(p)
        words[i] = new
    return touched


# -----------------------------------------------------------------------------
# encoding, the slow and obvious way (the oracle for tiktoken)


def bpe(piece, ranks, max_rank=None):
    """
    Split bytes into tokens the way tiktoken does: start from single bytes, repeatedly merge the adjacent
    pair whose concatenation has the lowest rank (the leftmost one on a tie), until no pair is a token.
    max_rank: only use tokens with a smaller rank (how save_tokenizer finds the parts of a merged token).
    Example: with the ranks of the module docstring, bpe(b"aaab", ranks) -> [b"aaab"]
    """
    parts = [bytes([b]) for b in piece]
    while True:
        best = None  # (rank, position)
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (max_rank is None or rank < max_rank) and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            return parts
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def slow_encode(text, ranks, pattern=PATTERN):
    """Encode text with Python's `re` and bpe() above; must give the same ids as Tokenizer.encode."""
    ids = []
    for chunk in re.findall(pattern, text):
        piece = chunk.encode("utf-8")
        if piece in ranks:  # tiktoken's shortcut: a chunk that is a token is that token, whatever bpe says
            ids.append(ranks[piece])
        else:
            ids.extend(ranks[part] for part in bpe(piece, ranks))
    return ids


# -----------------------------------------------------------------------------
# saving and loading


def render(token):
    r"""
    Token bytes as readable text: bytes that are not UTF-8 as \xNN, a backslash as \\, control characters
    escaped, so that a newline and a backslash-n in the source look different.
    Example: print(render(b"\tif\xe6\\n")) shows \tif\xe6\\n   (tab, "if", a lone byte, backslash, "n")
    """
    out = []
    for ch in token.decode("utf-8", errors="surrogateescape"):  # a bad byte 0xNN becomes U+DCNN
        if "\udc80" <= ch <= "\udcff":
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ch == "\\":
            out.append("\\\\")
        elif not ch.isprintable():  # \n, \t, \x85, \u2028, ...
            out.append(ch.encode("unicode_escape").decode("ascii"))
        else:
            out.append(ch)
    return "".join(out)


def ranks_file_contents(ranks):
    """tiktoken's .tiktoken format: one line per token, "base64(bytes) rank", in rank order."""
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    return "".join(f"{base64.b64encode(token).decode('ascii')} {rank}\n" for token, rank in by_rank).encode("ascii")


def save_tokenizer(ranks, path_prefix):
    """Write <prefix>.tiktoken (for tiktoken) and <prefix>.vocab (for people); return the .tiktoken path.
    A .vocab line: "[ ][re][turn] -> [ return] 300" is merge 300 and the tokens it is made of."""
    path_prefix = str(path_prefix)
    lines = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            lines.append(f"[{render(token)}] {rank}")
        else:  # the tokens tiktoken would glue into this one, using only earlier merges
            parts = "".join(f"[{render(p)}]" for p in bpe(token, ranks, max_rank=rank))
            lines.append(f"{parts} -> [{render(token)}] {rank}")
    write_atomic(path_prefix + ".tiktoken", ranks_file_contents(ranks))
    write_atomic(path_prefix + ".vocab", "\n".join(lines) + "\n")
    return Path(path_prefix + ".tiktoken")


def load_ranks(path):
    """
    Read a .tiktoken file into {token bytes: rank}. Our own few lines, not tiktoken.load.load_tiktoken_bpe:
    that one caches by path, so a tokenizer retrained to the same path would silently not be re-read.
    """
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"{path} is a folder, not a tokenizer file: pass the .tiktoken file that "
                                "`make train` wrote (or delete the folder and run `make train`)")
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}: run `make train` to build one (or pass the right path)")
    ranks = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:  # wrong number of fields, bad base64 (binascii.Error), or a rank that is no int
            raise ValueError(f"{path}:{lineno} is corrupt ({line[:40]!r}): delete it and run `make train` again"
                             ) from None
    check_ranks(ranks, path)
    return ranks


def check_ranks(ranks, where="ranks"):
    """Byte-level BPE needs every single byte and ranks 0..n-1, each once (or tiktoken fails later, obscurely)."""
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{where}: token ranks must be 0..n-1, each once: delete it and run `make train` again")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"{where}: some of the 256 single bytes are missing: delete it and run `make train` again")


class Tokenizer:
    """BPE ranks plus the EOT special token (id = len(ranks)), encoded and decoded by tiktoken."""

    def __init__(self, ranks, name="nanospec"):
        check_ranks(ranks)
        self.ranks = ranks
        self.eot = len(ranks)  # the one special token comes right after the merges
        self.vocab_size = len(ranks) + 1  # what the model's embedding needs: every id is < vocab_size
        # sha256 of the .tiktoken file's contents: a checkpoint records it to catch a retrained tokenizer
        self.identity = hashlib.sha256(ranks_file_contents(ranks)).hexdigest()
        self.enc = tiktoken.Encoding(name=name, pat_str=PATTERN, mergeable_ranks=ranks,
                                     special_tokens={EOT: self.eot}, explicit_n_vocab=self.vocab_size)

    @classmethod
    def load(cls, path):
        """Load a .tiktoken file written by save_tokenizer."""
        return cls(load_ranks(path))

    def encode(self, text):
        """Ordinary text -> ids. A literal "<|endoftext|>" typed by a user is just text here, not EOT."""
        return self.enc.encode_ordinary(text)

    def encode_corpus(self, text):
        """Corpus text (documents joined by EOT, see corpus.py) -> ids, each separator as the single id eot."""
        return self.enc.encode(text, allowed_special={EOT})

    def decode_bytes(self, ids):
        return self.enc.decode_bytes(ids)

    def show(self, token):
        """One token id as readable text (`render`): how the tree printouts label a guess."""
        return render(self.decode_bytes([token]))

    def decode(self, ids):
        """ids -> str; a token sequence that ends inside a UTF-8 character shows U+FFFD there."""
        return self.enc.decode(ids, errors="replace")
