"""The README's "Layout of the repository" names every module the source tree
has (and none it lacks): a renamed or added module updates it."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("tk_mlir", "tk_mlir/runtime", "tk_mlir/interpreter", "tk_mlir/kernels",
           "tk_mlir/integrations", "dialects", "passes", "lowering")


def _layout() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Layout of the repository\n")
    end = text.find("\n## ", start)
    return text[start:end if end >= 0 else len(text)]


def test_layout_names_every_module():
    named = set(re.findall(r"`([A-Za-z_]+\.py)`", _layout()))
    modules = {f.name for folder in FOLDERS for f in (ROOT / folder).glob("*.py")
               if f.name != "__init__.py"}
    assert modules - named == set(), "modules the README's layout does not name"
    tests = {f.name for f in (ROOT / "tests").glob("*.py")}
    assert named - modules - tests - {"setup.py"} == set(), "named, but not in the tree"
