"""What the error tests check of a CompilationError, shared by every test
file whose kernels are refused at a line marked `# E:<name>` (markers.py):
the message, the user's file, line and column, the rendered text
(file:line:col, the source line, a caret under the column), and a traceback
that shows no compiler internals."""
import re
import traceback
from pathlib import Path

import pytest

import markers
import tk_mlir as tk

# Modules of the compiler proper: none of their frames may reach the user.
INTERNAL = ("frontend.py", "values.py", "ops.py", "language.py", "compiler.py", "cache.py",
            "verify.py", "tile_rules.py", "smem.py", "layouts.py", "pipeline.py")


def tk_frames(tb) -> list[traceback.FrameSummary]:
    """The frames of tk_mlir's own files in a traceback (not the tests')."""
    pkg = Path(tk.__file__).resolve().parent.parent
    return [f for f in traceback.extract_tb(tb) if Path(f.filename).resolve().is_relative_to(pkg)
            and "tests" not in Path(f.filename).resolve().relative_to(pkg).parts]


def check_error(e: tk.CompilationError, marker: str, at: str, message: str | re.Pattern,
                path: Path):
    """e points at `at` on the line of `path` (the calling test file) marked
    `marker`, says `message`, renders with a caret and carries no compiler
    internals."""
    line, text = markers.marked(path, marker)
    col = text.index(at)
    if isinstance(message, re.Pattern):
        assert message.search(e.message), e.message
    else:
        assert message in e.message, e.message
    assert e.filename is not None and Path(e.filename).resolve() == path
    assert (e.line, e.col) == (line, col), (e.line, e.col, line, col)
    rendered = str(e).split("\n")
    assert rendered[0] == f"{e.filename}:{line}:{col + 1}: error: {e.message}"
    assert rendered[1] == "    " + text.rstrip()
    assert rendered[2] == "    " + " " * col + "^"
    # then the calls that led there, when the line is in a function inlined
    assert all(r.startswith(("  called from ", "  ... and ")) for r in rendered[3:]), rendered
    # What the user sees: raised `from None`, no chained compiler exception...
    assert e.__cause__ is None and e.__suppress_context__
    # ...and no frame of the frontend, the passes or the lowering.
    leaked = [f"{Path(f.filename).name}:{f.name}" for f in tk_frames(e.__traceback__)
              if Path(f.filename).name in INTERNAL or "lowering" in Path(f.filename).parts
              or "passes" in Path(f.filename).parts]
    assert not leaked, leaked


def compile_error(kernel, *args, **kwargs) -> tk.CompilationError:
    with pytest.raises(tk.CompilationError) as info:
        kernel.compile(*args, **kwargs)
    return info.value


class FakeCudaArray:
    """An object exposing __cuda_array_interface__ and no memory at all: a
    launch with it runs up to the driver, no further."""

    def __init__(self, shape, typestr, ptr=0x10000, strides=None):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (ptr, False), "version": 3,
                                         "strides": strides}
