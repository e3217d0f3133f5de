"""
Tests for nanospec/tokenizer.py: a tiny tokenizer trained in-process (no `make train`, no network).
The oracle is slow_encode (Python's `re` + an obvious merge loop); tiktoken must give the very same ids.
"""

import hashlib
import re
import sysconfig
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec.training.corpus import EOT
from nanospec.tokenizer import (PATTERN, Tokenizer, bpe, load_ranks, merge, render, save_tokenizer,
                                slow_encode, train_bpe)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
UNICODE = "héllo wörld, 日本語のテキスト, ﬁne 😀👍🏽 naïve café\n" * 20  # so that some merges are multi-byte
TRAIN_TEXT = (STDLIB / "textwrap.py").read_text() + EOT + (STDLIB / "string.py").read_text() + EOT + UNICODE
HELD_OUT = (STDLIB / "shlex.py").read_text()[:4000]  # real code the tokenizer was not trained on

EDGE_STRINGS = [
    "",
    " ",
    "?",
    "\n\n\n",
    "    \t  def f(x):\n        return x  # c\n",
    "héllo wörld",
    "日本語",
    "ﬁ",
    "😀👍🏽",
    EOT,  # typed by a user: plain text, not the special token
    "x = '<|endoftext|>'  \n",
    "\x00\x1c\x1f\x85 \u2028",
    "don't I'LL we've 's'",
    "x1234567 12 3.14159 0xFF 1e-9",
    "trailing   ",
    "\r\n\r\n  \t\f\v x",
    " " * 1000 + "long whitespace",  # tiktoken switches to another merge routine for long pieces
]


@pytest.fixture(scope="module")
def ranks():
    return train_bpe(TRAIN_TEXT, 400)


@pytest.fixture(scope="module")
def tok(ranks):
    return Tokenizer(ranks)


# -----------------------------------------------------------------------------
# training


def test_merge_example():
    assert merge([1, 2, 3, 1, 2], (1, 2), 4) == [4, 3, 4]
    assert merge([1, 1, 1], (1, 1), 4) == [4, 1]  # left to right, no overlaps


def test_train_classic_example():
    # (a,a) occurs 4 times -> "aa"; then (aa,a) and (a,b) tie at 2: the smaller pair (97, 98) wins -> "ab";
    # then (aa,ab) occurs twice -> "aaab". Wikipedia's ZabdZabac, Y=ab, X=ZY.
    ranks = train_bpe("aaabdaaabac", 256 + 3)
    merges = {token: rank for token, rank in ranks.items() if rank >= 256}
    assert merges == {b"aa": 256, b"ab": 257, b"aaab": 258}
    assert slow_encode("aaabdaaabac", ranks) == [258, ord("d"), 258, ord("a"), ord("c")]
    assert Tokenizer(ranks).encode("aaabdaaabac") == [258, 100, 258, 97, 99]


def test_train_is_deterministic_and_has_the_size_asked(ranks):
    assert train_bpe(TRAIN_TEXT, 400) == ranks
    assert len(ranks) == 400
    assert all(ranks[bytes([b])] == b for b in range(256))  # single bytes first, as their own values
    assert sorted(ranks.values()) == list(range(400))
    assert any(len(t.decode("utf-8", errors="ignore")) < len(t) and len(t) > 1 for t in ranks)  # multi-byte merges


def test_train_stops_when_nothing_is_left_to_merge():
    assert len(train_bpe("ab", 1000)) == 257  # one pair, one merge


def test_eot_is_never_learned():
    ranks = train_bpe(("x = 1" + EOT) * 50, 300)
    assert not any(b"<|" in t or b"|>" in t or b"endoftext" in t for t in ranks)
    # ...while the same characters as ordinary text are learned
    assert any(b"endoftext" in t for t in train_bpe("<|endoftext_marker|> " * 50, 300))


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match="256"):
        train_bpe("abc", 100)


# -----------------------------------------------------------------------------
# encoding: tiktoken against the slow oracle


@pytest.mark.parametrize("text", EDGE_STRINGS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert all(0 <= i < tok.eot for i in ids)  # ordinary text never produces the special id


@pytest.mark.parametrize("text", EDGE_STRINGS + [HELD_OUT, UNICODE])
def test_tiktoken_matches_slow_encode(ranks, tok, text):
    assert tok.encode(text) == slow_encode(text, ranks)


def test_tokenizer_compresses_code(tok):
    assert len(tok.encode(HELD_OUT)) < 0.6 * len(HELD_OUT.encode("utf-8"))  # 144 merges: ~1.8 bytes per token


def test_encode_corpus_turns_the_separator_into_eot(tok):
    text = "def a(): pass" + EOT + "def b(): pass"
    ids = tok.encode_corpus(text)
    assert ids.count(tok.eot) == 1
    assert ids == tok.encode("def a(): pass") + [tok.eot] + tok.encode("def b(): pass")
    assert tok.decode(ids) == text
    assert tok.eot not in tok.encode(text)  # plain encode: the separator is just characters
    assert tok.eot == 400 and tok.vocab_size == 401


def test_decode_replaces_a_cut_utf8_character(tok):
    ids = tok.encode("😀")
    if len(ids) > 1:  # the emoji is several tokens: its first alone is a broken UTF-8 sequence
        assert tok.decode(ids[:1]) == "\ufffd"
    assert tok.decode_bytes(ids[:1]) == "😀".encode("utf-8")[: len(tok.decode_bytes(ids[:1]))]


# -----------------------------------------------------------------------------
# the pre-tokenization pattern means the same to Python's re and to tiktoken's Rust regex


def tiktoken_chunks(text, pattern=PATTERN):
    """How tiktoken cuts text: give it every substring of the text as a token, so each chunk is one token."""
    data = text.encode("utf-8")
    ranks = {bytes([b]): b for b in range(256)}
    for i in range(len(data)):
        for j in range(i + 2, len(data) + 1):
            ranks.setdefault(data[i:j], len(ranks))
    enc = tiktoken.Encoding("chunks", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    return [enc.decode_single_token_bytes(t).decode("utf-8") for t in enc.encode_ordinary(text)]


TRICKY = ["don't 'LL we've'", "a\u00a0b\u3000c\u2028d\x85e", "é1٣²x_y ab_1", "  x\n\n  \t y  \n", "x+=1;;  -> ...",
          "naïve Straße 日本 😀", "'s'd'm't", "\r\n\r\n", " 12345 1234567"]


@pytest.mark.parametrize("text", TRICKY + EDGE_STRINGS[:-1])
def test_pattern_same_in_python_and_tiktoken(text):
    assert tiktoken_chunks(text) == re.findall(PATTERN, text)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab_Z09 '\t\n\r\x0b\x0c\x85\xa0\u2028é日😀,.-s"), max_size=16)
       | st.text(max_size=12))  # a small alphabet of tricky characters, or any characters at all
def test_pattern_same_in_python_and_tiktoken_random(text):
    assert tiktoken_chunks(text) == re.findall(PATTERN, text)
    assert "".join(re.findall(PATTERN, text)) == text  # every character lands in some chunk


def test_pattern_check_catches_engine_differences():
    # negative control: GPT-2's \w/\s version of the pattern, where the engines disagree about "²"
    # (a digit to Python's \w, not to Rust's), so the test above has the power to notice
    gpt2_like = r"""'(?:[sdmt]|ll|ve|re)| ?\w+| ?[^\s\w]+|\s+(?!\S)|\s+"""
    text = "é1٣²x_y"
    assert tiktoken_chunks(text, gpt2_like) != re.findall(gpt2_like, text)
    assert tiktoken_chunks(text) == re.findall(PATTERN, text)


# -----------------------------------------------------------------------------
# saving and loading


def test_save_load_round_trip(tmp_path, ranks, tok):
    path = save_tokenizer(ranks, tmp_path / "tok")
    assert path == tmp_path / "tok.tiktoken"
    loaded = Tokenizer.load(path)
    assert loaded.ranks == ranks
    for text in EDGE_STRINGS + [HELD_OUT]:
        assert loaded.encode(text) == tok.encode(text)
    assert loaded.identity == tok.identity == hashlib.sha256(path.read_bytes()).hexdigest()
    assert path.read_text().splitlines()[97] == "YQ== 97"  # tiktoken's format: base64(b"a") rank


def test_vocab_file_is_readable(tmp_path):
    save_tokenizer(train_bpe("aaabdaaabac", 256 + 3), tmp_path / "tok")
    lines = (tmp_path / "tok.vocab").read_text().splitlines()
    assert lines[10] == r"[\n] 10"
    assert lines[97] == "[a] 97"
    assert lines[256:] == ["[a][a] -> [aa] 256", "[a][b] -> [ab] 257", "[aa][ab] -> [aaab] 258"]
    assert render(b"\tif\xe6\\n") == r"\tif\xe6\\n"


def test_retrained_file_at_the_same_path_is_reread(tmp_path):
    path = save_tokenizer(train_bpe("aaabdaaabac", 257), tmp_path / "tok")
    assert Tokenizer.load(path).encode("aaab") == [256, 97, 98]
    save_tokenizer(train_bpe("aaabdaaabac", 259), tmp_path / "tok")  # same path, new merges
    assert Tokenizer.load(path).encode("aaab") == [258]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="make train"):
        Tokenizer.load(tmp_path / "nope.tiktoken")


@pytest.mark.parametrize("contents", [
    b"",  # empty: no single bytes
    b"not-base64! 0\n",
    b"YQ== zero\n",
    b"YQ==\n",
    b"\n".join(f"{i} {i}".encode() for i in range(10)),  # valid-looking, but not 256 bytes
])
def test_corrupt_file(tmp_path, ranks, contents):
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(contents)
    with pytest.raises(ValueError):
        Tokenizer.load(path)


def test_gap_in_ranks_is_an_error(tmp_path, ranks):
    path = save_tokenizer(ranks, tmp_path / "tok")
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join(lines[:300] + lines[301:]) + b"\n")  # rank 300 missing
    with pytest.raises(ValueError, match="0..n-1"):
        load_ranks(path)


def test_bpe_max_rank():
    ranks = train_bpe("aaabdaaabac", 259)
    assert bpe(b"aaab", ranks) == [b"aaab"]
    assert bpe(b"aaab", ranks, max_rank=258) == [b"aa", b"ab"]  # how merge 258 was made
