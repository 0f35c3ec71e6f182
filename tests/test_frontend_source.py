"""KernelSource.param_location: where a kernel's parameter (or its
annotation) sits in the user's file, so errors about it put the caret there."""
from pathlib import Path

import markers
import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.source import KernelSource

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
