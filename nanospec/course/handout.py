"""
The handout: a copy of the project for students, where the chosen exercises' function bodies are replaced by
a `raise NotImplementedError` that says what to write.

    python -m nanospec.course.handout --ex 3,4 --out ../handout        (or: make handout EX=3,4 OUT=../handout)

A solution is marked once in the source, by a comment pair inside the function's body:

    def accept_prob(p, q, x):                   def accept_prob(p, q, x):
        \"""...docstring...\"""                      \"""...docstring...\"""
        # BEGIN SOLUTION ex3            ->          raise NotImplementedError("exercise 3: implement accept_prob
        p_x = p.gather(...)                                                   in nanospec/rules/verify.py, see EXERCISES.md")
        ...
        # END SOLUTION ex3

How it works, and what it checks:
  - the copy holds the files git tracks, and only those (a file not yet added, say a stray notes.txt, is not
    one): so no .git, no bytecode, no out/ or data/*.txt; and not the instructor's own tests and tools
    (tests/test_course*.py, nanospec/course/impostors.py), nor the `reference` files of a blanked exercise (the
    course's working copy that later exercises' tests use in its place);
  - README.md and EXERCISES.md are rewritten for the students: EXERCISES.md keeps only the handed-out
    exercises (their order, points, how to grade them locally), README.md's section for instructors gives way
    to one for students (`student_docs`);
  - each Python file is parsed (`ast`) to find its functions and their lines; comments are not in the syntax
    tree, so the markers are found with `tokenize`, and each pair must sit in the body of the function the
    registry names, after its docstring, at the body's indentation, around whole statements;
  - the marked lines are replaced by one `raise` at the same indentation; the markers of exercises not
    chosen are dropped and their code kept;
  - then every rewritten Python file must parse, every stub must keep its function's signature and docstring,
    and no line or comment of a removed body may appear anywhere in the copy (`find_leaks`).
Any failure is a one-line error and nothing is left half-written at --out.

Regeneration never destroys work: --out must be missing, empty, or an earlier handout (its handout.json lists
the files it wrote, with their hashes). Over an earlier handout only those files are rewritten or removed;
.git and every file the generator did not write stay as they are, and a generated file changed since (a
student's solution) stops the run with a one-line error unless --overwrite says to replace it. The moves into an
earlier handout run with Ctrl-C held back until the last is done: an interrupted run leaves the old handout or
the new one, never half of each.
"""
import sys

if __name__ == "__main__":  # first: Ctrl-C and a closed pipe end it in one line or quietly
    from nanospec.device import plain_exits
    plain_exits()

import argparse
import ast
import contextlib
import datetime
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import textwrap
import threading
import tokenize
from dataclasses import dataclass

from nanospec.course.registry import EXERCISES, VERSION, parse_selection

MARKER = re.compile(r"#\s*(BEGIN|END) SOLUTION ex(\d+)\s*$")
INSTRUCTOR_ONLY = re.compile(r"tests/test_course[^/]*\.py|nanospec/course/impostors\.py|docs/course\.md")  # the
# kit's own tests and its impostor search (they need the full source) and the instructors' page
STAMP = "handout.json"  # written at the copy's root: version, exercises, source commit (the grader reads it)
MIN_FRAGMENT = 16  # shorter pieces of a removed body (`n = 0`, `return path`) say nothing about it


class HandoutError(Exception):
    pass


@dataclass
class Region:
    path: str  # file, relative to the project root
    function: str  # qualified name: "lookup", "KVCache.compact"
    exercise: int
    begin: int  # line of `# BEGIN SOLUTION exN` (1-based)
    end: int  # line of `# END SOLUTION exN`
    indent: str  # the markers' indentation = the body's

    def stub(self):
        return (f'{self.indent}raise NotImplementedError("exercise {self.exercise}: implement {self.function} '
                f'in {self.path}, see EXERCISES.md")')


# ---------------------------------------------------------------------------------------------------------
# Finding the regions


def functions(tree):
    """{qualified name: FunctionDef} for every function and method of a module, nested ones included."""
    found = {}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    found[name] = child
                walk(child, name + ".")

    walk(tree, "")
    return found


def marker_comments(text, path):
    """[(line, "BEGIN" or "END", exercise id, indentation)] for every marker comment in a Python source."""
    found = []
    lines = text.splitlines()
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError) as e:
        raise HandoutError(f"{path}: cannot tokenize: {e}") from None
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        m = MARKER.match(tok.string)
        if m is None:
            if re.match(r"#\s*(BEGIN|END)\s*SOLUTION", tok.string, re.IGNORECASE):  # a near miss
                raise HandoutError(f"{path}:{tok.start[0]}: malformed marker {tok.string!r}: "
                                   f"write '# BEGIN SOLUTION exN' or '# END SOLUTION exN'")
            continue
        line, col = tok.start
        if lines[line - 1][:col].strip():
            raise HandoutError(f"{path}:{line}: a solution marker must be alone on its line")
        found.append((line, m.group(1), int(m.group(2)), lines[line - 1][:col]))
    return found


def function_span(func, lines):
    """Lines (first, last) of a function, with the comments that follow its last statement at a deeper indent
    (where `# END SOLUTION` sits: comments are not in the syntax tree, so end_lineno stops before them)."""
    last = func.end_lineno
    while last < len(lines):
        nxt = lines[last]  # line last + 1
        stripped = nxt.strip()
        if stripped and not (stripped.startswith("#") and len(nxt) - len(nxt.lstrip()) > func.col_offset):
            break
        last += 1
    while last > func.end_lineno and not lines[last - 1].strip():  # trailing blank lines are not the function's
        last -= 1
    first = min([func.lineno] + [d.lineno for d in func.decorator_list])
    return first, last


def find_regions(text, path):
    """Every marked region of one source file, checked: each pair inside one function's body, after its
    docstring, at the body's indentation, around whole statements, one pair per function."""
    if "SOLUTION" not in text.upper():  # the cheap test first: most files have no marker to tokenize for
        return []
    markers = marker_comments(text, path)
    if not markers:
        return []
    lines = text.splitlines()
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise HandoutError(f"{path}: does not parse: {e}") from None
    funcs = functions(tree)
    spans = {name: function_span(f, lines) for name, f in funcs.items()}

    def owner(line):  # the innermost function whose span holds the line
        holding = [n for n, (a, b) in spans.items() if a <= line <= b]
        return max(holding, key=lambda n: spans[n][0]) if holding else None

    regions, open_marker = [], None
    for line, kind, ex, indent in markers:
        where = f"{path}:{line}"
        if kind == "BEGIN":
            if open_marker is not None:
                raise HandoutError(f"{where}: BEGIN SOLUTION ex{ex} inside the region opened at line {open_marker[0]}")
            open_marker = (line, ex, indent, owner(line))
            continue
        if open_marker is None:
            raise HandoutError(f"{where}: END SOLUTION ex{ex} without a BEGIN")
        begin, ex_begin, indent_begin, name = open_marker
        open_marker = None
        if ex != ex_begin or indent != indent_begin:
            raise HandoutError(f"{where}: END SOLUTION ex{ex} does not close BEGIN SOLUTION ex{ex_begin} "
                               f"(line {begin}) at the same indentation")
        if name is None or owner(line) != name:
            raise HandoutError(f"{path}:{begin}: a solution region must sit inside one function's body")
        func = funcs[name]
        body = func.body
        has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str)
        statements = body[1:] if has_doc else body
        if has_doc and begin <= body[0].end_lineno:
            raise HandoutError(f"{path}:{begin}: the region of {name} must start after its docstring")
        if not statements or indent != " " * statements[0].col_offset:
            raise HandoutError(f"{path}:{begin}: the markers of {name} must be indented like its body")
        for s in statements:
            if s.lineno < begin <= s.end_lineno or s.lineno <= line < s.end_lineno:
                raise HandoutError(f"{path}:{begin}: the region of {name} cuts statement {s.lineno} in two")
        if not any(begin < s.lineno and s.end_lineno < line for s in statements):
            raise HandoutError(f"{path}:{begin}: the region of {name} holds no statement")
        if any(r.function == name for r in regions):
            raise HandoutError(f"{path}:{begin}: {name} has two solution regions; mark one per function")
        regions.append(Region(path, name, ex, begin, line, indent))
    if open_marker is not None:
        raise HandoutError(f"{path}:{open_marker[0]}: BEGIN SOLUTION ex{open_marker[1]} is never closed")
    return regions


def check_registry(regions):
    """The marked regions must be exactly the registry's: each listed function marked once, nothing else."""
    found = {(r.path, r.function): r for r in regions}
    wanted = {(path, fn): ex.id for ex in EXERCISES for path, fn in ex.regions}
    for key, ex in wanted.items():
        if key not in found:
            raise HandoutError(f"exercise {ex}: {key[1]} in {key[0]} has no '# BEGIN SOLUTION ex{ex}' region "
                               f"(renamed or moved? update nanospec/course/registry.py)")
        if found[key].exercise != ex:
            raise HandoutError(f"{key[0]}:{found[key].begin}: {key[1]} is marked ex{found[key].exercise} but the "
                               f"registry lists it under exercise {ex}")
    for key, r in found.items():
        if key not in wanted:
            raise HandoutError(f"{r.path}:{r.begin}: a region for exercise {r.exercise} in {r.function}, "
                               f"which the registry does not list")


# ---------------------------------------------------------------------------------------------------------
# Writing the copy


def source_files(root):
    """The files git tracks in the project (relative paths): a file not yet added, an instructor's notes.txt say,
    never goes to students."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        raise HandoutError(f"{root} is not a git checkout: the handout copies the files git tracks, so that "
                           f"nothing generated or ignored (out/, caches) goes to students") from None
    files = sorted({f for f in out.decode().split("\0") if f})
    return [f for f in files if os.path.isfile(os.path.join(root, f)) and not INSTRUCTOR_ONLY.fullmatch(f)]


def blank(text, regions, chosen):
    """The source with the chosen regions replaced by their stub and the other regions' markers dropped."""
    lines = text.splitlines(keepends=True)
    for r in sorted(regions, key=lambda r: r.begin, reverse=True):
        if r.exercise in chosen:
            lines[r.begin - 1:r.end] = [r.stub() + "\n"]
        else:
            del lines[r.end - 1]
            del lines[r.begin - 1]
    return "".join(lines)


def signature(func):
    """What a caller relies on: arguments with defaults and annotations, decorators, the return annotation."""
    return ast.dump(func.args) + "".join(ast.dump(d) for d in func.decorator_list) + \
        (ast.dump(func.returns) if func.returns else "")


def check_stubs(path, reference, written, regions, chosen):
    """Each blanked function keeps its signature and docstring, and its body raises."""
    if not any(r.exercise in chosen for r in regions):
        return
    ref, new = functions(ast.parse(reference)), functions(ast.parse(written))
    for r in regions:
        if r.exercise not in chosen:
            continue
        a, b = ref[r.function], new.get(r.function)
        if b is None or signature(a) != signature(b):
            raise HandoutError(f"{path}: the stub of {r.function} lost its signature")
        if ast.get_docstring(a, clean=False) != ast.get_docstring(b, clean=False):
            raise HandoutError(f"{path}: the stub of {r.function} lost its docstring")
        if not any(isinstance(s, ast.Raise) for s in b.body):
            raise HandoutError(f"{path}: the stub of {r.function} does not raise")


def body_fragments(text, region):
    """The pieces of a region's body that must not survive in the copy: each line's code and each comment,
    whitespace collapsed, at least MIN_FRAGMENT characters long."""
    lines = text.splitlines()[region.begin:region.end - 1]
    code = textwrap.dedent("\n".join(lines)) + "\n"
    pieces = []
    tokens = tokenize.generate_tokens(io.StringIO(code).readline)
    comments = {}
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.start[1]
            pieces.append(tok.string.lstrip("#"))
    for i, line in enumerate(code.splitlines(), start=1):
        pieces.append(line[:comments[i]] if i in comments else line)
    normal = {" ".join(p.split()) for p in pieces}
    return sorted(p for p in normal if len(p) >= MIN_FRAGMENT)


def normalise(text):
    return " ".join(text.split())


def find_leaks(folder, fragments):
    """[(fragment, file)] for every removed fragment found in any text file under folder."""
    leaks = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(dirpath, name)
            try:
                with open(full, encoding="utf-8") as f:
                    text = normalise(f.read())
            except (UnicodeDecodeError, OSError):
                continue  # not text: no source line can hide in it readably
            leaks += [(frag, os.path.relpath(full, folder)) for frag in fragments if frag in text]
    return leaks


def public_text(root, files, all_regions):
    """The project's Python code outside every solution region, one normalised string per file: a fragment
    found there (a shared idiom such as `rows = torch.arange(B, device=device)`, or a line of a slow oracle in
    the tests, which students are meant to read) stays in the copy anyway and reveals nothing the copy lacks.
    The graded tests are left out: they must not give an answer away, so they are searched like the docs."""
    graded = {ex.test_file for ex in EXERCISES}
    texts = []
    for rel in files:
        if rel.endswith(".py") and rel not in graded:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
            mine = [r for r in all_regions if r.path == rel]
            texts.append(normalise(blank(text, mine, chosen={r.exercise for r in mine})))
    return texts


def git_commit(root):
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, check=True)
        return out.stdout.decode().strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def sections(text):
    """Markdown -> [(title or None, lines)]: the text before the first '## ' heading, then one per heading."""
    out = [(None, [])]
    for line in text.splitlines():
        if line.startswith("## "):
            out.append((line[3:].strip(), []))
        out[-1][1].append(line)
    return out


def keep_line(line, chosen):
    """EXERCISES.md's handout marks: a line ending in `<!-- ex11 -->` stays only where exercise 11 is handed
    out, one ending in `<!-- instructor -->` never goes to students; the mark itself is dropped."""
    m = re.search(r"\s*<!--\s*(ex(\d+)|instructor)\s*-->\s*$", line)
    if m is None:
        return line
    if m.group(2) is not None and int(m.group(2)) in chosen:
        return line[:m.start()]
    return None


def student_exercises(text, exercises):
    """EXERCISES.md for a handout: only its exercises, their order and points, how to grade them; the
    methods table says what each method still needs in THIS copy; no changelog."""
    chosen = {ex.id for ex in exercises}
    auto = [ex for ex in exercises if not ex.manual]
    names = ", ".join(str(ex.id) for ex in exercises)
    lines = ["# nanospec exercises", "",
             f"This handout holds {len(exercises)} exercise{'s' * (len(exercises) != 1)} ({names}), in the order "
             f"below: {sum(ex.tests for ex in auto)} graded tests for {sum(ex.points for ex in auto)} points"
             + (f", and {sum(ex.points for ex in exercises if ex.manual)} points graded by hand"
                if any(ex.manual for ex in exercises) else "")
             + f". Course version **{VERSION}** (`handout.json` in your copy says which version and exercises you "
               f"have). Every other function of nanospec is complete.", ""]
    for title, body in sections(text)[1:]:
        m = re.match(r"(\d+)\.", title)
        if m and int(m.group(1)) not in chosen or title.lower().startswith("changelog"):
            continue
        table = None
        for line in body:
            line = keep_line(line, chosen)
            if line is None:
                continue
            if line.startswith("| # |"):
                table = "exercises"
            elif line.startswith("| method |"):
                table = "methods"
            elif not line.startswith("|"):
                table = None
            row = re.match(r"\| (\d+) \|", line)
            if table == "exercises" and row and int(row.group(1)) not in chosen:
                continue
            if table == "methods" and line.startswith("| `"):
                cells = line.split("|")  # ["", method, needs greedy, needs at temperature 1, ""]
                for i in range(2, len(cells) - 1):
                    needs = [n for n in re.findall(r"\d+", cells[i]) if int(n) in chosen]
                    rest = re.sub(r"[\d,\s]+", "", cells[i]).strip()  # "nothing: it runs in any handout"
                    cells[i] = f" {', '.join(needs) if needs else 'nothing left to write'} " if not rest or needs \
                        else cells[i]
                line = "|".join(cells)
            lines.append(line)
    return "\n".join(lines).rstrip("\n") + "\n"


def student_readme(text, exercises, files):
    """README.md for a handout: the section for instructors (handouts, the kit's own tests, where the course's
    sources live) gives way to one for students; lines naming a file the handout lacks go."""
    ids = ", ".join(str(ex.id) for ex in exercises)
    student = [
        "## Your exercises", "",
        f"This copy of nanospec is a handout of the course in [EXERCISES.md](EXERCISES.md): exercise"
        f"{'s' * (len(exercises) != 1)} {ids}, whose functions' bodies are replaced by a `raise NotImplementedError`"
        f" that names the exercise. EXERCISES.md says, for each, what to write and how it is graded. Grade your "
        f"work locally with `make grade` (all your exercises) or `make grade EX=3` (one); the table ends with the "
        f"command that shows every failing test in full, `python -m pytest -m ex3 -x`. A law test (an exact "
        f"enumeration, a sampled law) gates its exercise: while it fails, the exercise scores zero.", ""]
    present = set(files)
    out = []
    for title, body in sections(text):
        if title is not None and title.lower().startswith(("exercises", "the course")):
            out += student
            continue
        for line in body:
            paths = re.findall(r"(?:tests|nanospec|scripts|docs)/[\w./-]+\.(?:py|md)", line)
            if any(p not in present for p in paths):
                continue
            line = re.sub(r"(twelve|thirteen|fourteen) (graded )?exercises", "the exercises of this handout", line)
            out.append(line.replace('"Exercises and handouts"', '"Your exercises"').replace(", changelog", ""))
    return "\n".join(out).rstrip("\n") + "\n"


def student_docs(root, exercises, files):
    """{relative path: text} of the documents rewritten for students (those the project has)."""
    docs = {}
    for rel, make in (("EXERCISES.md", lambda t: student_exercises(t, exercises)),
                      ("README.md", lambda t: student_readme(t, exercises, files))):
        if rel in files:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                docs[rel] = make(f.read())
    return docs


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def earlier_handout(out):
    """What an earlier handout at `out` wrote ({relative path: sha256}), {} if out is missing or empty; a
    HandoutError if out holds anything else (it is not ours to replace)."""
    if not os.path.exists(out):
        return {}
    if not os.path.isdir(out):
        raise HandoutError(f"--out {out} is a file: choose a folder")
    if not os.listdir(out):
        return {}
    stamp = os.path.join(out, STAMP)
    if not os.path.exists(stamp):
        raise HandoutError(f"--out {out} is not empty and not an earlier handout (no {STAMP}): choose an empty or "
                           f"new folder; nothing was written")
    try:
        with open(stamp) as f:
            generated = json.load(f)["generated"]
    except (OSError, ValueError, KeyError, TypeError):
        raise HandoutError(f"{stamp} does not list the files it wrote (made by an older kit, or edited): regenerate "
                           f"into a new folder; nothing was written") from None
    return dict(generated)


def changed_since(out, generated):
    """The generated files that were edited since (a solution, a note): [relative path]."""
    return sorted(rel for rel, digest in generated.items()
                  if os.path.isfile(os.path.join(out, rel)) and sha256(os.path.join(out, rel)) != digest)


def write_file(root, staging, rel, doc, text, regions, chosen):
    """Write one file of the handout into staging: a student document as given (doc), a file with no marked
    region as it is, a Python file with regions (text) with the chosen exercises' bodies blanked, checked to
    parse and to keep every stub's signature and docstring."""
    dest = os.path.join(staging, rel)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if doc is not None:
        with open(dest, "w", encoding="utf-8") as f:
            f.write(doc)
        return
    if text is None or not regions:  # not Python, or nothing marked: the file goes as it is
        shutil.copy2(os.path.join(root, rel), dest)
        return
    written = blank(text, regions, chosen)
    try:
        ast.parse(written)
    except SyntaxError as e:
        raise HandoutError(f"{rel}: the handout's version does not parse: {e}") from None
    check_stubs(rel, text, written, regions, chosen)
    with open(dest, "w", encoding="utf-8") as f:
        f.write(written)
    shutil.copymode(os.path.join(root, rel), dest)


def make_handout(root, out, exercises, overwrite=False):
    """Write the handout of `exercises` (registry entries) from the project at root to out. Returns what
    handout.json holds (version, exercises, blanked [path, function] pairs, source commit, date, the generated
    files with their sha256), plus "files" (how many were written), "secret_fragments" (the removed pieces
    searched for in the copy), "removed" (earlier generated files no longer generated) and "kept" (files at out
    the generator did not write, .git included, left as they were)."""
    root, out = os.path.abspath(root), os.path.abspath(out)
    if out == root or out.startswith(root + os.sep):
        raise HandoutError(f"--out {out} is inside the project: choose a folder outside it, e.g. ../handout")
    if os.path.exists(os.path.join(root, STAMP)):
        raise HandoutError(f"{root} is itself a handout ({STAMP}): make handouts from the full source")
    before = earlier_handout(out)
    edited = changed_since(out, before)
    if edited and not overwrite:
        raise HandoutError(f"{len(edited)} generated file(s) in {out} changed since the last handout (first: "
                           f"{edited[0]}): commit or copy them, then pass --overwrite; nothing was written")
    chosen = {ex.id for ex in exercises if not ex.manual}
    withheld = {f for ex in EXERCISES if ex.id in chosen for f in ex.reference}  # working copies of blanked ones
    files = [f for f in source_files(root) if f not in withheld]
    texts, regions = {}, []
    for rel in files:
        if rel.endswith(".py"):
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                texts[rel] = f.read()
            regions += find_regions(texts[rel], rel)
    check_registry(regions)
    docs = student_docs(root, exercises, files)

    os.makedirs(os.path.dirname(out), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".handout-", dir=os.path.dirname(out))  # moved to out when all checks pass
    try:
        for rel in files:
            write_file(root, staging, rel, docs.get(rel), texts.get(rel), [r for r in regions if r.path == rel],
                       chosen)
        removed = sorted({frag for r in regions if r.exercise in chosen for frag in body_fragments(texts[r.path], r)})
        public = public_text(root, files, regions)
        secret = [frag for frag in removed if not any(frag in text for text in public)]
        leaks = find_leaks(staging, secret)
        if leaks:
            frag, where = leaks[0]
            raise HandoutError(f"{where} holds {frag!r} from a removed solution ({len(leaks)} such leaks): "
                               f"reword it there, or it gives the answer away")
        generated = {rel: sha256(os.path.join(staging, rel)) for rel in files}
        summary = {"version": VERSION, "exercises": sorted(chosen),
                   "by_hand": sorted(ex.id for ex in exercises if ex.manual),  # graded by hand: listed, no stub
                   "blanked": [[r.path, r.function] for r in regions if r.exercise in chosen],
                   "source_commit": git_commit(root),
                   "made": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   "generated": generated}
        with open(os.path.join(staging, STAMP), "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
        with ctrl_c_held():
            gone, kept = install(staging, out, files, before)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {**summary, "files": len(files) + 1, "secret_fragments": secret, "removed": gone, "kept": kept,
            "updated": bool(before), "git": os.path.isdir(os.path.join(out, ".git"))}


@contextlib.contextmanager
def ctrl_c_held():
    """Hold Ctrl-C (and SIGTERM) back inside the block, delivered when it ends: the moves into an earlier handout
    are done all or not at all. Signals are caught by the main thread only: elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    held = [signal.SIGINT] + [signal.SIGTERM] * hasattr(signal, "SIGTERM")
    before = {sig: signal.signal(sig, lambda sig, frame: caught.append(sig)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):
            signal.raise_signal(sig)  # now, to the handler it would have met: Ctrl-C is a KeyboardInterrupt


def install(staging, out, files, before):
    """Move the checked copy from staging into out: every generated file (and handout.json) replaces its
    earlier version, earlier generated files no longer generated are removed (and folders they leave empty),
    nothing else at out is touched. Returns (removed paths, number of files kept that the generator did not
    write)."""
    if not os.path.exists(out) or not os.listdir(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if os.path.exists(out):
            os.rmdir(out)
        os.rename(staging, out)  # a new handout: one rename, nothing half-written
        return [], 0
    for rel in files + [STAMP]:
        dest = os.path.join(out, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.replace(os.path.join(staging, rel), dest)
    gone = sorted(set(before) - set(files))
    for rel in gone:
        path = os.path.join(out, rel)
        if os.path.isfile(path):
            os.remove(path)
        folder = os.path.dirname(path)
        while folder != out and os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)
            folder = os.path.dirname(folder)
    ours = set(files) | {STAMP}
    kept = 0
    for dirpath, dirnames, names in os.walk(out):
        if os.path.relpath(dirpath, out) == ".":
            kept += ".git" in dirnames  # the repository counts once; its insides are not ours to walk
            dirnames[:] = [d for d in dirnames if d != ".git"]
        kept += sum(os.path.relpath(os.path.join(dirpath, n), out).replace(os.sep, "/") not in ours for n in names)
    return gone, kept


def main(argv=None):
    p = argparse.ArgumentParser(description="Write a copy of nanospec with the chosen exercises' functions blanked.")
    p.add_argument("--ex", default="all", help="exercises to blank: 3,4 or 1-4 or all (default all)")
    p.add_argument("--out", required=True, help="the folder to write, outside this project: new, empty, or an "
                                                "earlier handout (only the files it wrote are replaced)")
    p.add_argument("--root", default=".", help="the project to copy (default: the current folder)")
    p.add_argument("--overwrite", action="store_true", help="over an earlier handout, also replace the generated "
                                                            "files that were edited since (a student's work)")
    args = p.parse_args(argv)
    try:
        exercises = parse_selection(args.ex)
        summary = make_handout(args.root, args.out, exercises, overwrite=args.overwrite)
    except (HandoutError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    done = "updated in" if summary["updated"] else "written to"
    print(f"handout v{summary['version']} {done} {args.out}: {summary['files']} files, "
          f"exercises {','.join(map(str, summary['exercises'])) or 'none'} blanked"
          + (f"; {len(summary['removed'])} earlier generated files removed" if summary["removed"] else "")
          + (f"; {summary['kept']} files it did not write{' (.git included)' * summary['git']} left as they were"
             if summary["kept"] else "")
          + f"; checked: stubs keep signatures and docstrings, none of {len(summary['secret_fragments'])} removed "
            f"lines is in the copy")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
