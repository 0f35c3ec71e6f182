"""A kernel's source, read once when it is decorated.

The text read here is both what the cache key is computed from and what the
frontend parses, so a file edited after decoration can never put one
kernel's code under another's key. (No MLIR here: a cache hit never needs it.)
"""
from __future__ import annotations

import ast
import dis
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
    closure: tuple[str, ...] = ()   # names the function reads from enclosing functions

    @classmethod
    def of(cls, fn, what: str = "@tk.kernel") -> KernelSource:
        """The source of `fn`, a plain function defined with `def`, checked to
        be its own definition (`what`, the decorator, names it in errors)."""
        _check_decorated(fn, what)
        fn = inspect.unwrap(fn)     # (as inspect finds the source: through functools.wraps)
        try:
            lines, first_line = inspect.getsourcelines(fn)
        except (OSError, TypeError):
            raise CompilationError(f"{what} needs the source of {fn.__name__!r}: "
                                   f"{_DEFINE_IT}") from None
        raw = "".join(lines)
        text = textwrap.dedent(raw)
        indent = len(lines[0]) - len(lines[0].lstrip()) if lines else 0
        source = cls(text, inspect.getsourcefile(fn) or "<unknown>", first_line, indent,
                     fn.__code__.co_freevars)
        source._check_belongs_to(fn, what)
        return source

    def _check_belongs_to(self, fn, what: str) -> None:
        """The text found is `fn`'s own `def`: a function made by exec or
        compile() under the name of another real file would otherwise compile
        whatever that file holds at its line."""
        code = fn.__code__
        found = _parse_def(self.text)
        lines = [line for _, _, line in code.co_lines() if line is not None]
        if found is None or found.name != code.co_name or _arg_names(found) != _code_args(code) \
                or (lines and not self.first_line <= min(lines) <= max(lines) <=
                    self.first_line + found.end_lineno - 1) \
                or not _same_contents(code, _compiled(found)):
            shown = f"def {found.name}" if found is not None else "no matching def"
            raise CompilationError(
                f"{what}: the source at {self.filename}:{self.first_line} ({shown}) is not "
                f"the definition of {fn.__qualname__!r}; its code says it was compiled under "
                f"that file's name but from other text (exec/compile() with another file's "
                f"name?): {_DEFINE_IT}")

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
        node.tk_closure = self.closure     # (closure_names reads it)
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


def closure_names(node: ast.FunctionDef) -> tuple[str, ...]:
    """The names a function from KernelSource.function_ast reads from the
    functions around it (its closure): the frontend does not read them, and
    says so when one is used."""
    return getattr(node, "tk_closure", ())


_DEFINE_IT = "define it with `def` in a file or a notebook cell (not through exec or the plain REPL)"


def _check_decorated(fn, what: str) -> None:
    """`fn` is what `what` applies to: a plain Python function defined with
    `def` (not a class, a builtin, a lambda, a coroutine, another kernel)."""
    if inspect.isfunction(fn) and not inspect.iscoroutinefunction(fn) \
            and not inspect.isasyncgenfunction(fn) and fn.__name__ != "<lambda>":
        return
    raise CompilationError(f"{what} applies to a function defined with `def` "
                           f"(def name(X: tk.gl[tk.f32], ...): ...), not to {_describe(fn)}")


def _describe(obj) -> str:
    """What `obj` is, as an error about it says."""
    from .language import Func
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if type(obj).__name__ == "Kernel" and hasattr(obj, "fn"):
        return f"{obj!r}, which is a kernel already (apply @tk.kernel once)"
    if isinstance(obj, Func):
        return f"{obj!r}: a tk.func is inlined into kernels; a kernel is a plain def"
    if inspect.isclass(obj):
        return f"the class {name!r}"
    if inspect.isbuiltin(obj) or inspect.ismethoddescriptor(obj):
        return f"the built-in {name!r} (it has no Python source)"
    if inspect.isfunction(obj) and obj.__name__ == "<lambda>":
        return "a lambda"
    if inspect.iscoroutinefunction(obj) or inspect.isasyncgenfunction(obj):
        return f"the async function {name!r}"
    if inspect.ismethod(obj):
        return f"the bound method {name!r} (decorate the function in the class body)"
    if isinstance(obj, (staticmethod, classmethod)):
        return f"a {type(obj).__name__} object (put @{type(obj).__name__} above @tk.kernel)"
    return f"{obj!r} (a {type(obj).__name__})"


def _parse_def(text: str) -> ast.FunctionDef | None:
    """The `def` that `text` starts with (after its decorators), if any."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, ast.FunctionDef) else None


def _arg_names(node: ast.FunctionDef) -> tuple[str, ...]:
    """A def's parameter names in the order its code object lists them."""
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return tuple(names)


def _compiled(node: ast.FunctionDef):
    """The code object of `node` compiled on its own (at module level)."""
    module = compile(ast.Module([node], []), "<source>", "exec", dont_inherit=True)
    return next(c for c in module.co_consts if inspect.iscode(c) and c.co_name == node.name)


def _same_contents(code, found) -> bool:
    """Whether a function's code and that of the text found for it hold the
    same constants and names, whatever scope each was compiled in (a
    closure's names are globals at module level). pytest's assertion
    rewriting adds names no source can spell (`@py_assert1`), and constants
    and attribute names with them: code it rewrote must hold every name of
    the text found."""
    names, found_names = _names(code), _names(found)
    if any(n.startswith("@") for n in names):
        return found_names <= names
    return names == found_names and _constants(code) == _constants(found)


def _names(code) -> frozenset[str]:
    """Every name a function's code reads, its nested code's included."""
    nested = (_names(c) for c in code.co_consts if inspect.iscode(c))
    return frozenset(code.co_names).union(code.co_freevars, *nested)


def _constants(code) -> tuple:
    """A function's constants and operators (nested code objects by their
    own): what the text says, not how one compile path spells the loads and
    calls (those differ between a closure and a global, and between Pythons)."""
    consts = tuple(_constants(c) if inspect.iscode(c) else _constant(c) for c in code.co_consts)
    return consts, tuple((i.opname, i.argrepr) for i in dis.get_instructions(code)
                         if i.opname.startswith(_OPERATORS))


def _constant(c) -> tuple:
    """A constant as compared; a string by its lines' text (the text found is
    dedented, and with it the lines of a string that spans several)."""
    if isinstance(c, str):
        return "str", tuple(line.lstrip() for line in c.split("\n"))
    return type(c).__name__, repr(c)


_OPERATORS = ("BINARY_", "COMPARE_OP", "UNARY_", "IS_OP", "CONTAINS_OP")


def _code_args(code) -> tuple[str, ...]:
    """A code object's parameter names (positional, keyword-only, *args, **kwargs)."""
    n = code.co_argcount + code.co_kwonlyargcount
    n += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return code.co_varnames[:n]


# A PTX identifier is [a-zA-Z][a-zA-Z0-9_$]* or [_$%][a-zA-Z0-9_$]+; `$`, which
# no Python identifier holds, marks a mangled name. Kept as written: ASCII
# identifiers, except PTX's own names and tk_mlir's symbols (lowering/kernel.py).
_PTX_RESERVED = frozenset({"_", "WARP_SZ"})
_TK_SYMBOL_PREFIX = "__tk_"
_MANGLED_PREFIX = "_$"


def ptx_symbol(name: str) -> str:
    """The PTX symbol of a kernel named `name` (any string: a `def`'s
    name in any script, or whatever `__name__` was set to). Deterministic and
    one-to-one: an ASCII identifier stays as written; any other name becomes
    `_$` followed by its ASCII letters, digits and underscores as written and
    every other character as `$<hex code point>$` (`κ` -> `_$$3ba$`). The
    Python name stays the kernel's name everywhere else (errors, display)."""
    if name.isascii() and name.isidentifier() and name not in _PTX_RESERVED \
            and not name.startswith(_TK_SYMBOL_PREFIX):
        return name
    return _MANGLED_PREFIX + "".join(c if c.isascii() and (c.isalnum() or c == "_")
                                     else f"${ord(c):x}$" for c in name)
