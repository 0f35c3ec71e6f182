"""tk_mlir/knobs.py is the one place that reads TK_MLIR_* environment
variables: each knob documented there, read when its function is called,
parsed strictly, and listed in README.md."""
import ast
import random
import re
from pathlib import Path

import pytest

from tk_mlir import cache, errors, knobs

ROOT = Path(__file__).resolve().parents[1]
# The package's sources (dialects/, passes/, lowering/ install as tk_mlir.*).
PACKAGE = [p for d in ("tk_mlir", "dialects", "passes", "lowering")
           for p in sorted((ROOT / d).rglob("*.py"))]
KNOB_NAME = re.compile(r"TK_MLIR_[A-Z0-9_]+")


@pytest.fixture(autouse=True)
def no_knobs_set(monkeypatch):
    for k in knobs.KNOBS:
        monkeypatch.delenv(k.name, raising=False)


# ------------------------------------------------------ one place reads them

def environment_reads(tree: ast.AST):
    """(line, text) of each use of os.environ / os.getenv / os.putenv whose
    variable is not a literal name outside TK_MLIR_* (a read of a knob, or
    of a name this test cannot see), and of each string that is a knob's
    name alone (a name passed around to be read somewhere)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv",
                                                             "environb", "unsetenv"):
            yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Name) and node.id in ("environ", "getenv"):
            yield node.lineno, node.id
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and KNOB_NAME.fullmatch(node.value):
            yield node.lineno, repr(node.value)


def other_environment_uses(tree: ast.AST) -> set[int]:
    """Lines where os.environ is used with a literal non-TK_MLIR name only
    (runtime/peers.py sets a torch variable): not a knob read."""
    ok = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and ast.unparse(node.func.value) == "os.environ" and node.args \
                and isinstance(node.args[0], ast.Constant) \
                and not str(node.args[0].value).startswith("TK_MLIR_"):
            ok.add(node.lineno)
    return ok


def test_only_knobs_py_reads_the_environment():
    found = []
    for path in PACKAGE:
        if path == ROOT / "tk_mlir" / "knobs.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        allowed = other_environment_uses(tree)
        found += [f"{path.relative_to(ROOT)}:{line}: {text}"
                  for line, text in environment_reads(tree) if line not in allowed]
    assert not found, "read knobs through tk_mlir/knobs.py:\n" + "\n".join(found)


def test_every_knob_named_in_the_package_is_a_documented_knob():
    """A TK_MLIR_* name in a docstring or message that knobs.py does not
    define is a typo or an undocumented knob."""
    named = {m for p in PACKAGE for m in KNOB_NAME.findall(p.read_text())}
    assert named <= {k.name for k in knobs.KNOBS}, named - {k.name for k in knobs.KNOBS}


def test_each_knob_is_documented():
    names = [k.name for k in knobs.KNOBS]
    assert len(set(names)) == len(names)
    for k in knobs.KNOBS:
        assert KNOB_NAME.fullmatch(k.name) and k.kind in ("bool", "path", "size")
        assert len(k.doc) > 20, k


def test_every_knob_is_in_the_readmes_knobs_section():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Knobs\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert section, "README.md has no '## Knobs' section listing knobs.py's knobs"
    missing = [k.name for k in knobs.KNOBS if k.name not in section[1]]
    assert not missing, f"README.md's Knobs section does not list {missing}"


# ----------------------------------------------------------------- reading

def test_knobs_are_read_when_called(monkeypatch, tmp_path):
    where = tmp_path / f"c{random.randrange(1 << 20)}"
    assert knobs.cache_dir() == Path.home() / ".cache" / "tk_mlir"
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(where))
    assert knobs.cache_dir() == cache.cache_dir() == where
    assert knobs.dump_dir() is None
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(where))
    assert knobs.dump_dir() == str(where)
    assert not errors.debug()
    monkeypatch.setenv("TK_MLIR_DEBUG", "1")
    assert errors.debug()


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False),
])
def test_bool_knobs(monkeypatch, value, expected):
    for k, read in ((knobs.ALWAYS_COMPILE, knobs.always_compile), (knobs.DEBUG, knobs.debug),
                    (knobs.INTERPRET, knobs.interpret),
                    (knobs.PRINT_AUTOTUNING, knobs.print_autotuning)):
        monkeypatch.setenv(k.name, value)
        assert read() is expected, k.name


def test_a_bool_knob_with_another_value_names_the_knob(monkeypatch):
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "maybe")
    with pytest.raises(ValueError, match=r"^TK_MLIR_ALWAYS_COMPILE='maybe': expected 1, true"):
        knobs.always_compile()


@pytest.mark.parametrize("value, size", [
    ("0", None), ("4096", 4096), ("500M", 500 << 20), ("2G", 2 << 30), ("2g", 2 << 30),
    ("1.5GiB", 3 << 29), ("64KB", 64 << 10), ("1T", 1 << 40), (" 3 M ", 3 << 20),
])
def test_cache_max_size(monkeypatch, value, size):
    monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", value)
    assert knobs.cache_max_size() == size


def test_cache_max_size_default_and_bad_values(monkeypatch):
    assert knobs.cache_max_size() == 1 << 30
    for bad in ("-1", "lots", "5X", "1e9"):
        monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", bad)
        with pytest.raises(ValueError, match=rf"^TK_MLIR_CACHE_MAX_SIZE='{bad}': expected a size"):
            knobs.cache_max_size()


def test_a_size_below_one_byte_is_refused_not_read_as_no_cap(monkeypatch):
    """int(0.5) would be 0, which means no cap: refused instead."""
    for tiny in ("0.5", "0.9B"):
        monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", tiny)
        with pytest.raises(knobs.KnobError, match="less than one byte"):
            knobs.cache_max_size()
    monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", "0.0")
    assert knobs.cache_max_size() is None


def test_a_bad_cache_max_size_is_refused_before_the_entry_is_written(monkeypatch, tmp_path):
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", "lots")
    with pytest.raises(knobs.KnobError):
        cache.DiskCache().put(cache.make_key(x=1), {"cubin": b"\0" * 16})
    assert not list(tmp_path.rglob(".manifest.json"))


@pytest.mark.parametrize("knob, value", [("TK_MLIR_CACHE_MAX_SIZE", "lots"),
                                         ("TK_MLIR_ALWAYS_COMPILE", "maybe"),
                                         ("TK_MLIR_DEBUG", "maybe")])
def test_a_bad_knob_stops_a_compile_before_it_starts(monkeypatch, tmp_path, knob, value):
    """Checked when a compile starts (not when it writes the cache, the work
    lost), and raised as the user's error: the traceback cut at the call."""
    import traceback

    import tk_mlir as tk

    @tk.kernel(num_warps=4)
    def copy_knob_case(X: tk.gl[tk.f32], Y: tk.gl[tk.f32]):
        tk.store(Y, tk.load(X, (0, 0), (16, 16)), (0, 0))

    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(knob, value)
    spec = tk.spec((16, 16), tk.f32)
    with pytest.raises(knobs.KnobError, match=rf"^{knob}='{value}'") as info:
        copy_knob_case.compile(spec, spec)
    frames = [Path(f.filename).name for f in traceback.extract_tb(info.value.__traceback__)]
    assert frames == ["test_knobs.py", "kernel.py"], frames      # (kernel.compile's raise)
    assert not list(tmp_path.rglob("*.cubin"))


def test_the_dump_dir_expands_the_home_folder(monkeypatch):
    """A path knob: `~` is the home folder (as TK_MLIR_CACHE_DIR's), not a
    folder named `~` in the working directory."""
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", "~/tk_dumps")
    assert knobs.dump_dir() == str(Path("~/tk_dumps").expanduser())


def test_a_bad_debug_value_while_reporting_an_error_is_warned_of(monkeypatch):
    """TK_MLIR_DEBUG is read while an error is reported: a bad value must not
    replace the user's error with one about the variable."""
    monkeypatch.setenv("TK_MLIR_DEBUG", "maybe")
    with pytest.warns(RuntimeWarning, match="TK_MLIR_DEBUG='maybe'.*read as 0"):
        assert errors.debug() is False
