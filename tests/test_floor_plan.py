"""The floor plan is the architecture: nanospec/ has a folder per concern and the layers import downward only.

    model/    the GPT, its cache, the drafters' modules, checkpoints   imports no other folder
    rules/    sampling, the verification rules, references, trees      imports no other folder
    steps/    what the methods share: verify step, drafting, options   imports rules/ (and model/)
    decoding/ the ten methods and the registry                         imports steps/, rules/, model/
    fast/, training/, trace/, course/: layers around them              (no method imports them)
    bench/    measurement                                              may import any folder

Read from the source (ast), so a stray import fails here before it tangles the house."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanospec"
FOLDERS = ("model", "rules", "steps", "decoding", "fast", "training", "bench", "trace", "course")
MAY_IMPORT = {  # folder -> the folders (besides itself and the root's leaf modules) it may import; docs/design.md
    "model": set(),
    "rules": set(),
    "steps": {"rules", "model"},
    "decoding": {"steps", "rules", "model"},
    "fast": {"model"},
    "training": {"model"},
    "trace": {"steps", "rules"},
    "course": {"rules"},
}  # bench/ and the root's commands may import any folder


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path):
    """The nanospec modules a file imports, as dotted names (a `from package import module` names the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nanospec":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                where = ROOT / full.replace(".", "/")
                is_module = where.with_suffix(".py").exists() or where.is_dir()
                found.add(full if is_module else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "nanospec")
    return found


def folder(name):
    """'nanospec.steps.run' -> 'steps'; a module at the root -> None."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else None


GRAPH = {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def test_the_root_holds_folders_by_concern_and_only_a_handful_of_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= 4, modules
    assert all((PACKAGE / name).is_dir() for name in FOLDERS)


def wrong_imports(graph):
    wrong = []
    for module, targets in graph.items():
        allowed = MAY_IMPORT.get(folder(module))
        if allowed is None:
            continue
        for target in targets:
            there = folder(target)
            if there is not None and there != folder(module) and there not in allowed:
                wrong.append(f"{module} imports {target}")
    return wrong


def circle(graph):
    """One import circle as a list of modules, or None."""
    def visit(node, trail):
        if node in trail:
            return trail[trail.index(node):] + [node]
        for target in sorted(graph.get(node, ())):
            if target in graph and target != node.rpartition(".")[0]:  # a package's own __init__ is no circle
                found = visit(target, trail + [node])
                if found:
                    return found
        return None

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return None


def test_the_layers_import_downward_only():
    assert wrong_imports(GRAPH) == []


def test_no_import_circle():
    assert circle(GRAPH) is None


def test_the_rules_load_without_the_tokenizer():
    """The pure rules pull in neither tiktoken nor the tokenizer: a fresh interpreter imports them and looks."""
    code = ("import sys, nanospec.rules.verify, nanospec.rules.reference, nanospec.rules.tree; "
            "print(sorted(m for m in sys.modules if 'tiktoken' in m or m == 'nanospec.tokenizer'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_test_file_imports_another():
    """Shared helpers live in tests/toys.py and tests/laws.py, or in conftest's fixtures."""
    wrong = []
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            wrong += [f"{path.name} imports {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert not wrong, wrong


def test_the_checks_catch_a_wrong_import_and_a_circle():
    """Negative control: a rule that imports a method is seen, and so is the circle it closes."""
    graph = {module: set(targets) for module, targets in GRAPH.items()}
    graph["nanospec.rules.verify"].add("nanospec.decoding.eagle")
    assert wrong_imports(graph) == ["nanospec.rules.verify imports nanospec.decoding.eagle"]
    assert circle(graph) is not None
