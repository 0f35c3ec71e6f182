"""A kernel's source, read once when it is decorated.

The text read here is both what the cache key is computed from and what the
frontend parses, so a file edited after decoration can never put one
kernel's code under another's key. (No MLIR here: a cache hit never needs it.)
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

from .errors import CompilationError


@dataclass(frozen=True)
class KernelSource:
    """A kernel's source as read once, at decoration: what is compiled is
    what the cache key was computed from, even if the file changes later."""
    text: str           # dedented
    filename: str
    first_line: int     # of the `def` (or its first decorator) in the file
    indent: int         # columns removed by dedenting

    @classmethod
    def of(cls, fn) -> KernelSource:
        try:
            lines, first_line = inspect.getsourcelines(fn)
        except (OSError, TypeError):
            raise CompilationError(f"@tk.kernel needs the source of {fn.__name__!r}: define it "
                                   f"in a file or a notebook cell (not through exec or the "
                                   f"plain REPL)") from None
        raw = "".join(lines)
        text = textwrap.dedent(raw)
        indent = len(lines[0]) - len(lines[0].lstrip()) if lines else 0
        return cls(text, inspect.getsourcefile(fn) or "<unknown>", first_line, indent)

    def function_ast(self) -> ast.FunctionDef:
        """The function's AST with the file's line and column numbers."""
        tree = ast.parse(self.text)
        ast.increment_lineno(tree, self.first_line - 1)
        for node in ast.walk(tree):
            if hasattr(node, "col_offset"):
                node.col_offset += self.indent
                if getattr(node, "end_col_offset", None) is not None:
                    node.end_col_offset += self.indent
        node = tree.body[0]
        if not isinstance(node, ast.FunctionDef):
            raise CompilationError("@tk.kernel applies to a function definition",
                                   self.filename, self.first_line, self.indent)
        return node

    def param_location(self, name: str, annotation: bool = False) -> tuple[str, int, int]:
        """(filename, line, col) of parameter `name` in the `def` (col 0-based,
        as CompilationError takes it), or of its annotation when `annotation`
        and it has one: errors about a parameter point there, not at the
        decorator. A name the function does not have gives the `def` itself."""
        fn = self.function_ast()
        a = fn.args
        for arg in [*a.posonlyargs, *a.args, a.vararg, *a.kwonlyargs, a.kwarg]:
            if arg is not None and arg.arg == name:
                node = arg.annotation if annotation and arg.annotation is not None else arg
                return self.filename, node.lineno, node.col_offset
        return self.filename, fn.lineno, fn.col_offset

    def param_error(self, name: str, message: str, annotation: bool = False) -> CompilationError:
        """A CompilationError at parameter `name` (see param_location)."""
        return CompilationError(message, *self.param_location(name, annotation))
