"""The errors tk_mlir shows its users.

A CompilationError points at the user's kernel source (file:line:col, the
line, a caret) and carries no compiler frames: it is raised `from None` and
its traceback is cut at the public entry point.
"""
from __future__ import annotations

import linecache


class CompilationError(Exception):
    def __init__(self, message: str, filename: str | None = None,
                 line: int | None = None, col: int | None = None):
        self.message, self.filename, self.line, self.col = message, filename, line, col
        super().__init__(self._render())

    def _render(self) -> str:
        if self.filename is None or self.line is None:
            return self.message
        col = self.col or 0
        head = f"{self.filename}:{self.line}:{col + 1}: error: {self.message}"
        source = linecache.getline(self.filename, self.line).rstrip("\n")
        if not source:
            return head
        return f"{head}\n    {source}\n    {' ' * col}^"


def error_at(loc, message: str) -> CompilationError:
    """A CompilationError at an MLIR FileLineColLoc (passes use this)."""
    import re
    m = re.search(r'loc\("([^"]+)":(\d+):(\d+)', str(loc))
    if not m:
        return CompilationError(message)
    return CompilationError(message, m.group(1), int(m.group(2)), int(m.group(3)) - 1)


class ArgumentError(TypeError):
    """A kernel argument that breaks a rule (device, dtype, rank, shape, strides,
    alignment); the message names the argument and the rule, and says what to do."""


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
    """TK_MLIR_DEBUG=1: re-raise errors with their full traceback."""
    import os
    return os.environ.get("TK_MLIR_DEBUG", "") not in ("", "0")
