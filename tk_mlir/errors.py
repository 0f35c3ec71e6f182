"""The errors tk_mlir shows its users.

A CompilationError points at the user's kernel source (file:line:col, the
line, a caret) and carries no compiler frames: it is raised `from None` and
its traceback is cut at the public entry point.
"""
from __future__ import annotations

import difflib
import functools
import linecache
import sys
from pathlib import Path


# The inlined calls an error shows under it (innermost first; a recursion
# that ran too deep would show hundreds).
MAX_CALLERS_SHOWN = 8


class CompilationError(Exception):
    def __init__(self, message: str, filename: str | None = None,
                 line: int | None = None, col: int | None = None):
        self.message, self.filename, self.line, self.col = message, filename, line, col
        self.callers: list[tuple[str, int]] = []    # inlined calls out to the kernel
        super().__init__(self._render())

    def _render(self) -> str:
        shown = self.callers[:MAX_CALLERS_SHOWN]
        more = len(self.callers) - len(shown)
        return _render(self.message, self.filename, self.line, self.col, "error") + "".join(
            f"\n  called from {f}:{n}: {linecache.getline(f, n).strip()}"
            for f, n in shown) + (f"\n  ... and {more} more call(s) out" if more else "")

    def called_from(self, filename: str, line: int) -> None:
        """Add the call (an inlined function's, innermost first) that led to
        the error, shown under it as a traceback would."""
        self.callers.append((filename, line))
        self.args = (self._render(),)


def _render(message: str, filename: str | None, line: int | None, col: int | None,
            kind: str) -> str:
    """`file:line:col: kind: message`, the source line and a caret."""
    if filename is None or line is None:
        return message
    col = col or 0
    head = f"{filename}:{line}:{col + 1}: {kind}: {message}"
    source = linecache.getline(filename, line).rstrip("\n")
    if not source:
        return head
    return f"{head}\n    {source}\n    {' ' * col}^"


def _where(loc) -> tuple[str, int, int] | None:
    """(file, line, 0-based column) of an MLIR FileLineColLoc, None if it is none."""
    import re
    m = re.search(r'loc\("([^"]+)":(\d+):(\d+)', str(loc))
    return (m.group(1), int(m.group(2)), int(m.group(3)) - 1) if m else None


def line_of(loc) -> str:
    """ "file:line" of an MLIR location, for messages that name a second place."""
    where = _where(loc)
    return f"{where[0]}:{where[1]}" if where else "an unknown line"


def error_at(loc, message: str) -> CompilationError:
    """A CompilationError at an MLIR FileLineColLoc (passes use this)."""
    where = _where(loc)
    return CompilationError(message, *where) if where else CompilationError(message)


def nearest_names(name: str, known, n: int = 1) -> list[str]:
    """Up to n of the names `known` nearest to a misspelt `name`: one equal to
    it but for case first (block for BLOCK: difflib's ratio misses it in
    short names), then difflib's closest."""
    known = list(known)
    same = [k for k in known if k != name and k.lower() == name.lower()]
    return (same + [c for c in difflib.get_close_matches(name, known, n=n)
                    if c not in same])[:n]


class TkLintWarning(UserWarning):
    """A kernel that compiles but shows a known pitfall (passes/lint.py): a TMA
    copy or arrival every thread issues, a register split that cannot be met,
    a cluster size that leaves SMs idle, a named barrier id used with two
    thread counts. Silence with warnings.filterwarnings("ignore",
    category=tk.TkLintWarning) (add message="...[rule]" for one rule)."""


def warn_at(loc, rule: str, message: str) -> None:
    """Warn (TkLintWarning) at an MLIR location, the message rendered as an
    error's (`file:line:col: warning: [rule] ...`) and the warning attributed
    to the user's line, so Python's filters (filename, lineno) apply to it."""
    warn_at_line(*(_where(loc) or (None, None, None)), rule, message, stacklevel=3)


def warn_at_line(filename: str, line: int, col: int | None, rule: str, message: str,
                 stacklevel: int = 2) -> None:
    """warn_at for a (file, line, col) of the user's source (None: unknown,
    the warning is then its caller's, `stacklevel` as warnings.warn's)."""
    import warnings
    text = _render(f"[{rule}] {message}", filename, line, col, "warning")
    if filename is None or line is None:
        warnings.warn(text, TkLintWarning, stacklevel=stacklevel)
    else:
        warnings.warn_explicit(text, TkLintWarning, filename, line)


class ArgumentError(TypeError):
    """A kernel argument that breaks a rule (device, dtype, rank, shape, strides,
    alignment); the message names the argument and the rule, and says what to do."""


# What to do where a kernel cannot launch (no cuda-bindings, no GPU, CPU
# tensors): every error that says so ends with it. Here, in the lowest layer,
# so that CudaUnavailable and the runtime's errors share one wording.
# TK_MLIR_INTERPRET is read once, at the process's first launch (kernel.py).
INTERPRET_HINT = ("run the kernel on the CPU in the interpreter: kernel.interpret[grid](...) "
                  "for one launch, or TK_MLIR_INTERPRET=1 in the environment (read at the "
                  "process's first launch) for every launch")


class CudaUnavailable(RuntimeError):
    """cuda-bindings cannot be imported, so nothing can run on a GPU here.
    Raised by the first import of runtime/driver.py, the one module that
    imports cuda-bindings: compiling and reading the stages up to PTX never
    import it, so they work where it has no wheels (macOS). The message ends
    with INTERPRET_HINT: the interpreter needs no cuda-bindings."""

    def __init__(self, reason: str):
        super().__init__(
            f"launching kernels (and encoding TMA tensor maps) needs cuda-bindings and an "
            f"NVIDIA GPU with its driver; cuda-bindings cannot be imported here ({reason}): "
            f"pip install cuda-bindings (Linux or Windows). kernel.compile(...) and its "
            f".asm stages up to PTX need neither. To {INTERPRET_HINT}")


class InternalCompilerError(RuntimeError):
    """A bug in tk_mlir, not in the user's kernel: shown as such (with the
    kernel and stage it happened in, when known), never dressed up as a
    CompilationError. `TK_MLIR_DEBUG=1` keeps the full traceback of every
    tk_mlir error instead of cutting it at the public entry point."""

    def __init__(self, message: str, kernel: str | None = None, stage: str | None = None):
        self.message, self.kernel, self.stage = message, kernel, stage
        where = " ".join(x for x in (f"in kernel {kernel}" if kernel else "",
                                     f"during {stage}" if stage else "") if x)
        super().__init__(f"internal compiler error{' ' + where if where else ''}: {message}\n"
                         f"(a bug in tk_mlir, not in your kernel; TK_MLIR_DEBUG=1 shows the "
                         f"full traceback)")


def debug() -> bool:
    """TK_MLIR_DEBUG=1: re-raise errors with their full traceback. Read while
    an error is being reported: a bad value is warned of (once) and read as
    0, so the user's error is what they see, not one about the variable."""
    from .knobs import KnobError, debug
    try:
        return debug()
    except KnobError as e:
        import warnings
        warnings.warn(f"{e}; read as 0", RuntimeWarning, stacklevel=user_stacklevel())
        return False


def for_the_user(e: BaseException) -> BaseException:
    """`e` as a public entry point (kernel.compile, a launch, tk.autotune)
    raises it: its traceback cut at that call and its chain dropped, so no
    compiler frames show — or, under TK_MLIR_DEBUG=1, whole. Use as
    `raise for_the_user(e)` in the entry point's except clause."""
    if not debug():
        e.__traceback__, e.__cause__, e.__suppress_context__ = None, None, True
    return e


# tk_mlir's own source folders: the package and, in a source checkout, the
# top-level dialects/, passes/ and lowering/ it maps in as subpackages.
_PACKAGE = Path(__file__).resolve().parent
_OWN_DIRS = (_PACKAGE, *(_PACKAGE.parent / d for d in ("dialects", "passes", "lowering")))


@functools.lru_cache(maxsize=None)
def _folders(filename: str) -> tuple[Path, ...]:
    """The folders a source file lies in (resolved once per file: asked at
    every inlined call)."""
    return tuple(Path(filename).resolve().parents)


def in_tk_mlir_source(filename: str | None) -> bool:
    """Whether a source file is tk_mlir's own (its templates, rings, kernels)."""
    return filename is not None and any(d in _folders(filename) for d in _OWN_DIRS)


_KERNELS = _PACKAGE / "kernels"


def in_tk_mlir_helpers(filename: str | None) -> bool:
    """Whether a source file holds tk_mlir's helpers (templates, rings, the
    language): its own source except the kernel library, whose kernels are
    written as a user's are (their errors and ops point at their own lines)."""
    return in_tk_mlir_source(filename) and _KERNELS not in _folders(filename)


def _owner(frame) -> str:
    """Whose code a frame runs: "tk_mlir", "library" (the standard library, MLIR's
    bindings, any installed package) or "user"."""
    name = frame.f_globals.get("__name__") or ""
    top = name.partition(".")[0]
    filename = frame.f_code.co_filename
    if top == "tk_mlir" or in_tk_mlir_source(filename):
        return "tk_mlir"
    if top in sys.stdlib_module_names or top == "mlir" or filename.startswith("<frozen") \
            or "site-packages" in filename or "dist-packages" in filename:
        return "library"
    return "user"


def user_stacklevel() -> int:
    """The warnings.warn stacklevel, for the function that calls this, of the
    nearest frame of the user's code (or the outermost frame): a warning shows
    the user's line that led to it, not one of tk_mlir's."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and _owner(frame) != "user":
        frame, level = frame.f_back, level + 1
    return level


def raised_in_tk_mlir(tb) -> bool:
    """Whether the exception with traceback `tb` is a bug in tk_mlir rather
    than in the user's own Python (a helper, a constexpr computation): decided
    by the innermost frame that is either, looking through the libraries both
    call (a user helper whose numpy call raises is the user's; a builtin that
    hands MLIR a bad value is tk_mlir's). No such frame: the user's."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        owner = _owner(frame)
        if owner != "library":
            return owner == "tk_mlir"
    return False
