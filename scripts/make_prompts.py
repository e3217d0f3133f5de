"""
Build the benchmark's prompt set, data/prompts.json, from the VALIDATION split only (data/val.txt): the
model never trained on these files, so a method cannot look good by reciting training text.

Each prompt is a run of whole lines cut from a validation file, ending at the end of a line (no newline: the
model's first token is the line break and indentation, as in the file). Three categories, told apart by what
follows the cut in the file:

    code     the next lines are code, and little of them appears in the prompt
    prose    the cut is inside a docstring or a block of comments, and the next lines are more of it
    repeat   most of what follows repeats the prompt: a method followed by the start of a near-copy of it,
             a table whose rows follow one pattern. Word 4-grams of the next ~250 characters that occur in
             the prompt: >= 50% for `repeat`, <= 20% for the other two.

Worked example of the `repeat` score: prompt "x = f(a, b)\\ny = f(a, c)", next line "z = f(a, d)":
words z = f ( a , d ) -> 4-grams (z,=,f,() (=,f,(,a) (f,(,a,,) ((,a,,,d) (a,,,d,)): 2 of 5 in the prompt -> 0.4.

A held-out file can still share boilerplate with training files, so a cut
whose prompt or continuation occurs word for word in data/train.txt is left out too.

Deterministic: the same val.txt gives the same file. Prompts are stored as text (tokenized by the benchmark),
so they survive retraining the tokenizer. Documents are visited in a seeded order, at most one prompt per
document and category per round, so the first few prompts of each category come from different files.

    python scripts/make_prompts.py                      # data/val.txt -> data/prompts.json, 16 per category
    python scripts/make_prompts.py --val /tmp/x/val.txt --out /tmp/x/prompts.json --per-category 10

On the default corpus (the tiny preset's 4 MB of Python 3.11's stdlib) it prints:
    code     16 prompts from 16 files, 329 characters on average
    prose    16 prompts from 16 files, 335 characters on average
    repeat   16 prompts from 16 files, 338 characters on average
"""
import argparse
import json
import random
import re
import sys
from pathlib import Path

EOT = "<|endoftext|>"  # the document separator of train.txt / val.txt (nanospec/training/corpus.py)
MIN_CHARS, MAX_CHARS = 180, 360  # ~3 bytes per token with the tiny preset's tokenizer: ~60-150 tokens
NEXT_CHARS = 250  # how much of what follows the cut decides the category
MAX_LINE = 160  # longer lines are data, not code or prose
REPEAT_MIN, FRESH_MAX = 0.5, 0.2  # share of the next 4-grams already in the prompt
CATEGORIES = ("code", "prose", "repeat")


def line_kinds(lines):
    """'blank', 'comment', 'string' (inside or opening a triple-quoted string: docstrings) or 'code' per line.
    A plain scan for triple quotes: good enough for library source, and deterministic."""
    kinds, quote = [], None
    for line in lines:
        s = line.strip()
        if quote is not None:  # inside a triple-quoted string
            kinds.append("string")
            if line.count(quote) % 2 == 1:
                quote = None
            continue
        opening = next((q for q in ('"""', "'''") if line.count(q) % 2 == 1), None)
        if not s:
            kinds.append("blank")
        elif s.startswith("#"):
            kinds.append("comment")
        elif s.lstrip("rbuRBU").startswith(('"""', "'''")):
            kinds.append("string")
        else:
            kinds.append("code")
        quote = opening if kinds[-1] != "comment" else None
    return kinds


def words(text):
    return re.findall(r"\w+|[^\w\s]", text)


def repeat_share(prompt, following, n=4):
    """Share of the word n-grams of `following` that occur somewhere in `prompt` (0 when it has none)."""
    seen = set(zip(*(words(prompt)[i:] for i in range(n))))
    grams = list(zip(*(words(following)[i:] for i in range(n))))
    return sum(g in seen for g in grams) / len(grams) if grams else 0.0


def is_table(lines):
    """True when most lines have the shape of the line before (words and spaces ignored): rows of a table,
    like `'X'  #  0x0058 -> LATIN CAPITAL LETTER X`. Easy to continue, but not what `code` should measure."""
    def shape(line):  # string literals -> s, runs of words -> w, no spaces: "'X'  # 0x58 -> X" -> "s#w->w"
        return re.sub(r"\s+", "", re.sub(r"\w+(\s+\w+)*", "w", re.sub(r"'[^']*'|\"[^\"]*\"", "s", line)))
    shapes = [shape(line) for line in lines if line.strip()]
    return sum(a == b for a, b in zip(shapes, shapes[1:])) >= len(shapes) // 2


def next_kinds(kinds, j, n):
    """Kinds of the first n non-blank lines after line j."""
    return [k for k in kinds[j + 1:] if k != "blank"][:n]


def candidates(name, text):
    """Every cut (after line j) of one document that fits a category: dicts with the prompt and its score."""
    lines = text.split("\n")
    kinds = line_kinds(lines)
    starts = [0]  # character offset of each line
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)
    found = []
    for j, line in enumerate(lines):
        if not line.strip() or len(line) > MAX_LINE:  # (a blank line inside a docstring is a 'string')
            continue
        i = j  # take whole lines back from line j while the prompt fits
        while i > 0 and starts[j + 1] - starts[i - 1] - 1 <= MAX_CHARS and len(lines[i - 1]) <= MAX_LINE:
            i -= 1
        prompt = "\n".join(lines[i:j + 1])
        while i < j and not lines[i].strip():  # no leading blank lines
            i += 1
            prompt = "\n".join(lines[i:j + 1])
        following = text[starts[j + 1]:starts[j + 1] + NEXT_CHARS]
        if len(prompt) < MIN_CHARS or len(following.strip()) < NEXT_CHARS // 2:
            continue
        share = repeat_share(prompt, following)
        after = next_kinds(kinds, j, 3)
        if share >= REPEAT_MIN:
            category = "repeat"
        elif share > FRESH_MAX or len(after) < 3 or is_table(lines[i:j + 1]):
            continue
        elif kinds[j] == "code" and after == ["code"] * 3:
            category = "code"
        elif kinds[j] in ("comment", "string") and all(k == kinds[j] for k in after[:2]) \
                and len(re.findall(r"[A-Za-z]{3,}", following)) >= 15:  # words, not a table in a string
            category = "prose"
        else:
            continue
        found.append(dict(category=category, source=name, line=i + 1, repeat_share=round(share, 2),
                          span=(starts[i], starts[j + 1] + NEXT_CHARS), lines=lines[i:j + 1], following=following))
    return found


def choose(documents, per_category, seed=0, train_text=""):
    """Pick per_category prompts of each category: documents in a seeded order, round after round, at most
    one prompt per document and category per round, no two prompts overlapping (prompt + what follows), none
    a near-copy of another, and none whose text or continuation also occurs word for word in `train_text`:
    a held-out file can still hold boilerplate that training files share (the stdlib's codec modules)."""
    by_doc = {name: candidates(name, text) for name, text in documents}
    taken = {name: [] for name in by_doc}  # chosen (start, end) spans per document
    chosen = {c: [] for c in CATEGORIES}

    def free(c):
        text = "\n".join(c["lines"])
        return all(c["span"][1] <= s or c["span"][0] >= e for s, e in taken[c["source"]]) and \
            all(repeat_share("\n".join(other["lines"]), text) < 0.5 for got in chosen.values() for other in got) \
            and text not in train_text and c["following"].strip() not in train_text

    for category in ("repeat", "prose", "code"):  # the scarcest first
        rng = random.Random(f"{seed}:{category}")  # a str seed is hashed the same way on every run
        order = sorted(by_doc)
        rng.shuffle(order)
        pools = {}
        for name in order:
            pool = [c for c in by_doc[name] if c["category"] == category]
            if category == "repeat":
                pool.sort(key=lambda c: -c["repeat_share"])  # the clearest repeats first
            else:
                rng.shuffle(pool)
            pools[name] = pool
        while len(chosen[category]) < per_category and any(pools.values()):
            for name in order:
                pool = pools[name]
                while pool and not free(pool[0]):
                    pool.pop(0)
                if pool and len(chosen[category]) < per_category:
                    c = pool.pop(0)
                    taken[name].append(c["span"])
                    chosen[category].append(c)
    return chosen


def main(argv=None):
    p = argparse.ArgumentParser(description="Build data/prompts.json from the validation split.")
    p.add_argument("--val", default="data/val.txt", help="validation text: documents joined by <|endoftext|>")
    p.add_argument("--corpus-json", default="data/corpus.json", help="its stats; names the documents (optional)")
    p.add_argument("--train", default="data/train.txt",
                   help="training text: prompts that also occur in it word for word are left out (optional)")
    p.add_argument("--out", default="data/prompts.json", help="where the prompts go")
    p.add_argument("--per-category", type=int, default=16, help="prompts per category (fewer if the text lacks them)")
    p.add_argument("--seed", type=int, default=0, help="seeds the order in which documents are visited")
    args = p.parse_args(argv)
    if not Path(args.val).exists():
        sys.exit(f"error: no {args.val}: run `make train` (its corpus stage) or `python -m nanospec.training.corpus` first")
    texts = Path(args.val).read_text(encoding="utf-8").split(EOT)
    names, corpus = [f"document {i}" for i in range(len(texts))], {}
    if Path(args.corpus_json).exists():
        corpus = json.loads(Path(args.corpus_json).read_text())
        if len(corpus["val_files"]) == len(texts):
            names = corpus["val_files"]
    train_text = ""
    if Path(args.train).exists():
        train_text = Path(args.train).read_text(encoding="utf-8")
    else:
        print(f"warning: no {args.train}: cannot leave out prompts that also occur in the training text")
    chosen = choose(list(zip(names, texts)), args.per_category, args.seed, train_text)
    prompts = [dict(id=f"{category}-{n:02d}", category=category, source=c["source"], line=c["line"],
                    repeat_share=c["repeat_share"], lines=c["lines"])
               for category in CATEGORIES for n, c in enumerate(chosen[category])]
    doc = {"about": "Benchmark prompts cut from the validation files of the corpus (never training text) by "
                    "scripts/make_prompts.py. A prompt's text is its lines joined by newlines. source/line: the "
                    "file and line it starts at. repeat_share: share of the word 4-grams of the next ~250 "
                    "characters in the file that occur in the prompt. No prompt, nor what follows it, occurs "
                    "word for word in the training text.",
           "val": args.val, "corpus_source": corpus.get("source"), "python": corpus.get("python"),
           "seed": args.seed, "prompts": prompts}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for category in CATEGORIES:
        got = chosen[category]
        files = len({c["source"] for c in got})
        chars = sum(len("\n".join(c["lines"])) for c in got) / max(1, len(got))
        print(f"{category:7s} {len(got):3d} prompts from {files:2d} files, {chars:.0f} characters on average")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
