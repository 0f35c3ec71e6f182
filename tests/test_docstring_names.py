"""A name a docstring puts in backticks names something that exists: a
function, class, variable, parameter, attribute or module of the project (or
a word its generated code or IR spells), a file of the repository, or an
attribute of a package it names (`torch.distributed...`). A docstring that
points at what was renamed or removed misleads the next reader."""
import ast
import builtins
import keyword
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("tk_mlir", "dialects", "passes", "lowering")
# Packages a docstring may point into; the name is theirs to keep.
OTHERS = ("torch", "triton", "numpy", "np", "mlir", "cuda", "jax", "ml_dtypes")
# `name`, ``name``, `a.b.c`, `name()`.
QUOTED = re.compile(r"(?<!`)``?([A-Za-z_][\w.]*?)(?:\(\))?``?(?!`)")
WORD = re.compile(r"[A-Za-z_]\w*")


def _sources(*folders):
    for folder in folders:
        yield from sorted((REPO / folder).rglob("*.py"))


def _docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "name", "<module>"), doc


def _known_names() -> set[str]:
    """Every name the repository's Python defines, binds or reads, and the
    words of its string literals (generated code, IR op names)."""
    names = set(dir(builtins)) | set(keyword.kwlist)
    for path in _sources(*PACKAGES, "tests", "examples", "benchmarks"):
        names.add(path.stem)
        names.update(path.relative_to(REPO).parts)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(doc) for _, doc in _docstrings(tree)}
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Name):
                names.add(n.id)
            elif isinstance(n, ast.Attribute):
                names.add(n.attr)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
            elif isinstance(n, ast.alias):
                names.update((n.asname or n.name).split("."))
            elif isinstance(n, ast.keyword) and n.arg:
                names.add(n.arg)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) \
                    and not n.value.startswith(("\n", " ")) and id(n.value) not in docs:
                names.update(WORD.findall(n.value))
    return names


def _stale(names: set[str]):
    for path in _sources(*PACKAGES):
        for where, doc in _docstrings(ast.parse(path.read_text(encoding="utf-8"))):
            for m in QUOTED.finditer(doc):
                quoted = m.group(1).rstrip(".")
                first, last = quoted.split(".")[0], quoted.split(".")[-1]
                if quoted.endswith(".py") or first in OTHERS or last in names \
                        or quoted.isupper():       # PTX / SASS spellings, metavariables
                    continue
                yield f"{path.relative_to(REPO)}: {where}: `{quoted}`"


def test_names_in_backticks_exist():
    stale = list(_stale(_known_names()))
    assert not stale, "docstrings name what does not exist:\n" + "\n".join(stale)
