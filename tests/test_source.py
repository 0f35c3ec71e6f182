"""source.py: a kernel's source, read once at decoration.
KernelSource.param_location finds where a parameter (or its annotation) sits
in the user's file, so errors about it put the caret there; text exec'd or
compiled under a file's name that is not the function's own definition is
refused (the kernel would be another); a kernel of any Python name compiles,
under a PTX symbol (ptx_symbol) that is an identifier, one per name."""
from pathlib import Path

import pytest
import torch

import markers
import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.source import KernelSource, ptx_symbol

HERE = Path(__file__).resolve()


class Outer:
    @staticmethod
    def kernel_like(X: tk.gl[f32],
                    n: int, *rest,  # E:n
                    BM: tk.constexpr = 64, **extra):  # E:BM
        pass


def test_parameter_and_annotation_locations():
    src = KernelSource.of(Outer.kernel_like)
    line, text = markers.marked(HERE, "n")
    assert src.param_location("n") == (src.filename, line, text.index("n: int"))
    assert src.param_location("n", annotation=True) == (src.filename, line, text.index("int"))
    assert src.param_location("rest") == (src.filename, line, text.index("rest"))
    line, text = markers.marked(HERE, "BM")
    assert src.param_location("BM") == (src.filename, line, text.index("BM"))
    assert src.param_location("BM", annotation=True) == \
        (src.filename, line, text.index("tk.constexpr"))
    assert src.param_location("extra", annotation=True) == (src.filename, line,
                                                            text.index("extra"))


def test_unknown_name_points_at_the_def():
    src = KernelSource.of(Outer.kernel_like)
    _, line, col = src.param_location("nope")
    text = HERE.read_text().splitlines()[line - 1]
    assert text[col:].startswith("def kernel_like")


def test_param_error_renders_a_caret_under_the_parameter():
    e = KernelSource.of(Outer.kernel_like).param_error("BM", "bad BM", annotation=True)
    line, text = markers.marked(HERE, "BM")
    assert str(e).split("\n") == [f"{e.filename}:{line}:{text.index('tk.constexpr') + 1}: "
                                  f"error: bad BM", "    " + text.rstrip(),
                                  "    " + " " * text.index("tk.constexpr") + "^"]


# ------------------------------------------- the source found is the function's own

KERNEL_TEXT = """import tk_mlir as tk
from tk_mlir import f32


@tk.kernel(num_warps=4)
def copy(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, x{op}, (0, 0))
"""


@pytest.mark.parametrize("op", [" * 3.0", " + 1.0", ".exp()", " * x"])
def test_exec_under_another_files_name_is_refused(tmp_path, op):
    """exec/compile() of other text under a real file's name: inspect finds
    that file's text, which is not the function's; compiling it would run
    another kernel silently."""
    real = tmp_path / "real.py"
    real.write_text(KERNEL_TEXT.format(op=""))
    with pytest.raises(tk.CompilationError, match="is not the definition of 'copy'"):
        exec(compile(KERNEL_TEXT.format(op=op), str(real), "exec"), {})


@pytest.mark.parametrize("text", [
    "import tk_mlir as tk\n\n@tk.kernel\ndef other(X):\n    pass\n",       # another name
    "import tk_mlir as tk\n\n@tk.kernel\ndef copy(X, Z):\n    pass\n",     # other params
    "",                                                                    # nothing there
    "# a comment\n" * 20,
])
def test_exec_finding_another_def_or_none_is_refused(tmp_path, text):
    real = tmp_path / "real.py"
    real.write_text(text)
    with pytest.raises(tk.CompilationError, match="is not the definition of 'copy'|needs the "
                                                  "source of 'copy'"):
        exec(compile(KERNEL_TEXT.format(op=""), str(real), "exec"), {})


def test_exec_of_the_files_own_text_compiles(tmp_path):
    real = tmp_path / "real.py"
    real.write_text(KERNEL_TEXT.format(op=" * 2.0"))
    scope = {}
    exec(compile(real.read_text(), str(real), "exec"), scope)
    assert ".entry copy(" in scope["copy"].compile(tk.spec((64, 64), f32),
                                                  tk.spec((64, 64), f32)).asm["ptx"]


# ------------------------------------------------- any Python name compiles

@pytest.mark.parametrize("name", ["κ", "核函数", "Ünïcode_kernel", "naïve2", "_", "WARP_SZ",
                                  "__tk_private"])
def test_a_kernel_of_any_python_name_compiles_and_runs(tmp_path, name):
    path = tmp_path / "named.py"
    path.write_text(KERNEL_TEXT.replace("def copy", f"def {name}").format(op=" * 2.0"),
                    encoding="utf-8")
    scope = {}
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), scope)
    kernel = scope[name]
    compiled = kernel.compile(tk.spec((64, 64), f32), tk.spec((64, 64), f32))
    symbol = ptx_symbol(name)
    assert f".entry {symbol}(" in compiled.asm["ptx"]
    x, y = torch.randn(16, 64), torch.full((16, 64), float("nan"))
    kernel.interpret[(1,)](x, y)
    assert torch.equal(y, x * 2.0)


def test_ptx_symbols_are_identifiers_and_one_to_one():
    import re
    names = ["κ", "k", "_$$3ba$", "a_b", "a$b", "ab", "x" * 40, "核", "é", "e\u0301", "__tk_x"]
    symbols = [ptx_symbol(n) for n in names]
    assert len(set(symbols)) == len(names)
    for s in symbols:
        assert re.fullmatch(r"[a-zA-Z][a-zA-Z0-9_$]*|[_$%][a-zA-Z0-9_$]+", s), s
    assert ptx_symbol("softmax") == "softmax"
