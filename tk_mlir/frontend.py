"""The frontend: a kernel's Python AST -> a func.func of tk ops.

One visitor walks the function body. Expressions evaluate either to Python
values (constexprs, folded here, so `if D > 1024:` on a constexpr picks a
branch at compile time) or to SSA wrappers from values.py, whose operators
emit tk and arith ops. Every op carries the user's file:line:col: the
visitor sets the MLIR location to the node it is evaluating. `for ... in
range()` becomes scf.for with the variables it reassigns carried through
the loop; a run-time `if` becomes scf.if yielding the variables its branches
assign. Anything else raises a CompilationError at its line.
"""
from __future__ import annotations

import ast
import builtins
import collections.abc
import contextlib
import inspect
import itertools
import operator
import sys
from dataclasses import dataclass
from typing import Any

from . import mlir_import  # noqa: F401  (first: imports MLIR without numpy)
from mlir import ir
from mlir.dialects import arith, func, scf

from . import global_reads, language, values as V
from .dialects import contracts, types as T
from .errors import (CompilationError, InternalCompilerError, debug, in_tk_mlir_helpers,
                     nearest_names, raised_in_tk_mlir)
from .source import closure_names, ptx_symbol


@dataclass(frozen=True)
class FuncArg:
    """A kernel argument as the compiled function sees it."""
    name: str
    kind: str             # "gl", "i32", "f32"
    ir_type: ir.Type | None = None
    peer_of: str | None = None   # one of the arguments a tk.pgl parameter becomes


_BINOPS = {ast.Add: "add", ast.Pow: "pow", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div",
           ast.FloorDiv: "floordiv", ast.Mod: "mod", ast.BitAnd: "and", ast.BitOr: "or",
           ast.BitXor: "xor", ast.LShift: "lshift", ast.RShift: "rshift"}
# The operators' Python spelling, for messages.
_PY_SPELLING = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%",
                "pow": "**", "and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>"}
_CMPOPS = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}
# On compile-time values: Python's own operators (C functions, so an error in
# one has no frame of ours; see KernelBuilder.python).
_PY_BINOPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
              "div": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod,
              "and": operator.and_, "or": operator.or_, "xor": operator.xor,
              "lshift": operator.lshift, "rshift": operator.rshift, "max": max, "min": min,
              "pow": operator.pow}
_PY_CMPOPS = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
              "eq": operator.eq, "ne": operator.ne}
_PY_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_,
             ast.Invert: operator.invert}
# Python syntax a kernel cannot use, as its errors name it (else the AST class).
_SYNTAX = {"Break": "break (a loop runs all its iterations: guard the body with an if)",
           "Continue": "continue (guard the rest of the body with an if)",
           "NamedExpr": "the := operator",
           "Try": "try", "TryStar": "try", "With": "with", "AsyncWith": "async with",
           "Lambda": "lambda (define a function with def)", "Global": "global",
           "Nonlocal": "nonlocal", "Delete": "del", "Raise": "raise", "Assert": "assert",
           "ClassDef": "a class definition", "Import": "import", "ImportFrom": "import",
           "Yield": "yield", "YieldFrom": "yield from", "Await": "await",
           "GeneratorExp": "a generator expression (use a list comprehension)",
           "SetComp": "a set comprehension", "Set": "a set", "Match": "match",
           "MatMult": "@ (matrix products are tk.mma_AB, tk.mma_ABt, ...)"}
# Python builtins a kernel may call; on run-time values min/max emit ops.
_ALLOWED_BUILTINS = {"range", "min", "max", "float", "int", "abs", "len", "print", "isinstance",
                     "tuple", "list", "zip", "enumerate", "bool", "round", "pow", "sum", "all",
                     "any", "reversed", "divmod"}


def _layout_met(a: ir.Type, b: ir.Type) -> ir.Type | None:
    """The type two vector types both take where they differ only in that one's
    layout is not yet chosen ("auto": a tk.zeros / tk.full or a loaded vector):
    the other's, which the layout pass would give it anyway once a loop or an
    if joins them. None for any other pair."""
    ta, tb = T.parse(a), T.parse(b)
    if not (isinstance(ta, T.RV) and isinstance(tb, T.RV)) or \
            ta.with_layout("auto") != tb.with_layout("auto"):
        return None
    return b if ta.layout == "auto" and tb.layout != "auto" else \
        a if tb.layout == "auto" and ta.layout != "auto" else None


def _settle_auto_layout(new: ir.Value, init: ir.Value, *carried: ir.Value) -> None:
    """A loop-carried vector with no layout yet on one side of the loop —
    before it (init, with its block argument and the loop's result in
    `carried`) or after one iteration (new) — and one on the other: the side
    without takes it now, so that the scf.for's types agree (the layout pass
    would join them)."""
    t = _layout_met(init.type, new.type)
    if t is None:
        return
    for v in (new, init, *carried):
        if v.type != t:
            v.set_type(t)


def _is_runtime(v) -> bool:
    return isinstance(v, V.Value)


def _what(v) -> str:
    """A value the kernel cannot carry through a loop, in words."""
    if isinstance(v, (list, tuple)):
        kinds = sorted({type(x).__name__ for x in v})
        return f"a {type(v).__name__} of {len(v)} ({', '.join(kinds) or 'nothing'})"
    return f"a {type(v).__name__}"


def _carried(init) -> str:
    """A loop-carried value's start, in words: a number and its type, or the
    tile (vector, ...) it is."""
    return f"a number ({init.ir_type})" if isinstance(init, V.Scalar) else repr(init)


def _assigned_names(stmts) -> list[str]:
    """Names a block of statements (re)binds, in first-assignment order."""
    names: list[str] = []
    for stmt in stmts:
        for node in ast.walk(stmt):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.For):
                targets = [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name) and n.id not in names:
                        names.append(n.id)
    return names


# Inlined calls nest at most this deep: far beyond any helper chain a kernel
# needs, well before Python's own recursion limit.
MAX_INLINE_DEPTH = 64
# One expression nests at most this deep (`x + x + ... + x` with 101 terms is
# 100 deep): the frontend walks expressions recursively, and deeper ones would
# exhaust Python's stack (about 5 frames a level, with inlined calls above).
MAX_EXPRESSION_DEPTH = 100
# Compile-time unrolling: one tk.static_range (or comprehension) runs its body
# at most MAX_STATIC_RANGE times, and a kernel at most MAX_UNROLLED times in
# all (nested loops multiply). A body costs about a millisecond or more to
# build, so these keep a compile within seconds.
MAX_STATIC_RANGE = 1024
MAX_UNROLLED = 4096
_RUNTIME = object()    # stands for a run-time value when comparing calls


@dataclass(frozen=True)
class InlinedCall:
    """One call being inlined: which function, with which compile-time arguments
    (run-time ones count only as "some run-time value")."""
    name: str
    site: tuple            # (filename, line, col) of the function's def
    arguments: dict        # parameter name -> value

    def compile_time_args(self) -> tuple:
        return tuple((k, _compile_time_part(v)) for k, v in self.arguments.items())

    def repeats(self, other: InlinedCall) -> bool:
        """Whether self is other again: the same function with the same compile-time
        arguments. Inlining is deterministic in those, so it would recurse forever."""
        if self.site != other.site:
            return False
        try:
            return bool(self.compile_time_args() == other.compile_time_args())
        except Exception:           # values without a plain ==: assume progress
            return False


def _compile_time_part(v):
    if _is_runtime(v):
        return _RUNTIME
    if isinstance(v, (tuple, list)):
        return tuple(_compile_time_part(x) for x in v)
    return v


class KernelReturned(Exception):
    """A `return` reached under compile-time ifs only: the kernel's (or an
    inlined function's) body ends there, the statements after it not built;
    `value` is what an inlined function returns."""

    def __init__(self, value=None):
        super().__init__()
        self.value = value


class KernelBuilder(ast.NodeVisitor):
    """Emits one kernel. `scope` maps names to Python values or SSA wrappers."""

    def __init__(self, filename: str, globals_: dict, scope: dict[str, Any],
                 function: str | None = None, calls: tuple[InlinedCall, ...] = (),
                 kernel: str | None = None, site: ir.Location | None = None,
                 closure: tuple[str, ...] = ()):
        self.kernel = kernel         # its name, for internal errors
        self.closure = closure       # names of enclosing functions, not read (source.py)
        self.filename = filename
        self.site = site             # a tk_mlir helper's body: the user's call, its ops' location
        self.globals = globals_
        self.scope = dict(scope)
        self.gone: dict[str, str] = {}   # name -> why a run-time if or loop left it undefined
        self.function = function     # the tk.func being inlined (None: the kernel)
        self.runtime_bodies = 0      # run-time ifs and loops being built around this point
        self.calls = calls           # the inlined calls this body is nested in, outermost first
        self.recorder = global_reads.current()   # what is read from outside (global_reads.py)

    # ------------------------------------------------------------ plumbing

    def loc(self, node) -> ir.Location:
        if self.site is not None:
            return self.site
        return ir.Location.file(self.filename, node.lineno, node.col_offset + 1)

    def error(self, node, message: str) -> CompilationError:
        return CompilationError(message, self.filename, node.lineno, node.col_offset)

    @contextlib.contextmanager
    def at(self, node):
        """Ops built inside carry node's location; errors without one get it.
        Any other exception is the user's error at node when their own Python
        raised it (a helper they wrote), else a bug of ours (see failure)."""
        try:
            with self.loc(node):
                yield
        except CompilationError as e:
            if e.filename is None:
                raise self.error(node, e.message) from None
            raise
        except (InternalCompilerError, RecursionError, MemoryError, KernelReturned):
            raise
        except Exception as e:
            raise self.failure(node, e, raised_in_tk_mlir(e.__traceback__))

    def failure(self, node, e: Exception, ours: bool) -> Exception:
        """What exception e, raised while compiling node, is shown as: the user's
        CompilationError at node, or (ours) an InternalCompilerError naming the
        kernel and the line being compiled, chained to e. TK_MLIR_DEBUG=1 chains
        the user's errors to e too (their traceback kept). Raise it without
        `from`: the chaining is set here."""
        if ours:
            error = InternalCompilerError(
                f"{type(e).__name__}: {e} (compiling {self.filename}:{node.lineno}:"
                f"{node.col_offset + 1})", self.kernel, "frontend")
        else:
            error = self.error(node, f"{type(e).__name__}: {e}")
        error.__cause__ = e if ours or debug() else None
        error.__suppress_context__ = True
        return error

    def python(self, node, fn, /, *args, **kwargs):
        """fn(*args, **kwargs) on the user's behalf: their own Python run at
        compile time (a function their code calls, an operator on their
        constexprs). What it raises is their error at node, unless it came from
        inside tk_mlir (a builtin's bug) and not from calling it wrongly."""
        try:
            return fn(*args, **kwargs)
        except (CompilationError, InternalCompilerError):
            raise
        except Exception as e:
            # (calling fn wrongly, too many arguments or a missing one: the caller's mistake;
            # Python's own message says it well but for a method's, which counts self)
            unbound = _unbound_reason(fn, args, kwargs) if isinstance(e, TypeError) else None
            if unbound is not None:
                message = _bad_keyword(_signature(fn), _callee_name(fn), kwargs) or \
                    (unbound if inspect.ismethod(fn) else None)
                if message is not None:
                    raise self.error(node, message) from None
            inside = e.__traceback__.tb_next      # the frames below this one: fn's
            ours = inside is not None and raised_in_tk_mlir(inside) and unbound is None
            raise self.failure(node, e, ours)

    def eval(self, node):
        with self.at(node):
            return self.visit(node)

    def run(self, stmts) -> None:
        for stmt in stmts:
            with self.at(stmt):
                self.visit(stmt)

    @contextlib.contextmanager
    def runtime_body(self):
        """Building the body of a run-time if or loop (a `return` there cannot
        end the kernel at compile time)."""
        self.runtime_bodies += 1
        try:
            yield
        finally:
            self.runtime_bodies -= 1

    def generic_visit(self, node):
        what = type(node).__name__
        raise self.error(node, f"{_SYNTAX.get(what, what)} is not supported in a tk kernel")

    # --------------------------------------------------------- statements

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # docstring
        self.eval(node.value)

    def visit_Pass(self, node):
        pass

    def visit_Return(self, node):
        if self.function is not None:
            if self.runtime_bodies:
                raise self.error(node, f"return in tk.func {self.function} is only allowed as "
                                       f"its last statement or under ifs on compile-time "
                                       f"values (not inside a run-time if or loop)")
            raise KernelReturned(None if node.value is None else self.eval(node.value))
        if node.value is not None:
            raise self.error(node, "a kernel returns nothing; write results with tk.store")
        if self.runtime_bodies:
            raise self.error(node, "return inside a run-time if or loop of a kernel is not "
                                   "supported (its threads end together: barriers count on "
                                   "them); put the rest of the kernel in the if's other "
                                   "branch (a return under an if on a constexpr ends it)")
        raise KernelReturned    # (under compile-time ifs only: the kernel ends here)

    def visit_FunctionDef(self, node):
        """A function defined in a kernel: inlined where it is called, seeing
        the names defined before it (e.g. callbacks for a template)."""
        if node.decorator_list:
            raise self.error(node, "a function defined in a kernel takes no decorators")
        a = node.args
        if a.posonlyargs:
            raise self.error(node, "a function defined in a kernel takes no positional-only "
                                   "parameters")
        defaults = [self.eval(d) for d in a.defaults]
        kw_defaults = {k.arg: self.eval(d) for k, d in zip(a.kwonlyargs, a.kw_defaults)
                       if d is not None}
        P = inspect.Parameter
        params = [P(x.arg, P.POSITIONAL_OR_KEYWORD) for x in a.args]
        for i, d in enumerate(defaults):
            k = len(params) - len(defaults) + i
            params[k] = params[k].replace(default=d)
        if a.vararg:
            params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
        params += [P(x.arg, P.KEYWORD_ONLY, default=kw_defaults.get(x.arg, P.empty))
                   for x in a.kwonlyargs]
        if a.kwarg:
            params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
        self.scope[node.name] = LocalFunc(node, inspect.Signature(params), self.filename,
                                          self.globals, self)

    def _callback_call(self, node, callee) -> str:
        """For a user's function that a tk_mlir helper calls (a tk.lcf
        callback): how the helper calls it and how it is defined, since the
        error is shown at the user's call of the helper."""
        if not in_tk_mlir_helpers(self.filename) or in_tk_mlir_helpers(callee.filename):
            return ""
        return (f" (tk_mlir calls it as {ast.unparse(node)}; it is defined at "
                f"{callee.filename}:{callee.node.lineno} as "
                f"{callee.node.name}{callee.signature})")

    def inline(self, node, callee, args, kwargs):
        """Call a tk.func or a function defined in the kernel: run its body
        here, in a scope of its own."""
        if isinstance(callee, language.Func):
            callee = LocalFunc(callee.source.function_ast(), inspect.signature(callee.fn),
                               callee.source.filename, callee.fn.__globals__, None)
            check_nesting(callee.node, callee.filename)
        try:
            bound = callee.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise self.error(node, _bad_keyword(callee.signature, callee.node.name, kwargs)
                             or f"{callee.node.name}(): {e}{self._callback_call(node, callee)}"
                             ) from None
        bound.apply_defaults()
        call = InlinedCall(callee.node.name, (callee.filename, callee.node.lineno,
                                              callee.node.col_offset), dict(bound.arguments))
        self.check_recursion(node, call)
        inner = KernelBuilder(callee.filename, callee.globals,
                              {**callee.free_names(), **bound.arguments}, callee.node.name,
                              self.calls + (call,), self.kernel, self.helper_site(node, callee),
                              callee.definer.closure if callee.definer is not None
                              else closure_names(callee.node))
        body, result = callee.node.body, None
        if body and isinstance(body[-1], ast.Return):
            body, result = body[:-1], body[-1].value
        try:
            try:
                inner.run(body)
            except KernelReturned as returned:      # (under compile-time ifs)
                return returned.value
            return inner.eval(result) if result is not None else None
        except CompilationError as e:
            # A helper of tk_mlir's (a ring's method, a template) refusing its
            # arguments: the mistake is at the user's call.
            if type(e) is CompilationError and in_tk_mlir_helpers(e.filename) and \
                    not in_tk_mlir_helpers(self.filename):
                raise self.error(node, e.message) from None
            if e.filename is not None and not in_tk_mlir_helpers(self.filename) and \
                    (e.filename, e.line) != (self.filename, node.lineno):
                e.called_from(self.filename, node.lineno)     # (the user's own call)
            raise
        except RecursionError:
            # Python's stack ran out before MAX_INLINE_DEPTH (deeply nested
            # expressions in each call): the innermost call that can still
            # build an error reports it.
            raise self.error(node, f"calling {call.name} here nests inlined calls deeper than "
                                   f"Python's recursion limit ({len(self.calls) + 1} calls "
                                   f"deep); recursion is unrolled at compile time, so it must "
                                   f"end in fewer calls") from None

    def helper_site(self, node, callee) -> ir.Location | None:
        """Where the ops of an inlined body say they are: a helper of tk_mlir's
        (a ring's method, a template) called from the user's code is the
        user's call, so that what a pass, the lint or the interpreter reports
        there points at the user's line; a user's own function keeps its lines."""
        if not in_tk_mlir_helpers(callee.filename):
            return None
        if self.site is not None:
            return self.site
        return None if in_tk_mlir_helpers(self.filename) else self.loc(node)

    def check_recursion(self, node, call: InlinedCall) -> None:
        """Recursion is unrolled at compile time, so it must end on compile-time
        values: a call that repeats one it is nested in (same function, same
        compile-time arguments) would be inlined forever."""
        if any(call.repeats(outer) for outer in self.calls):
            runtime = [k for k, v in call.arguments.items() if _is_runtime(v)]
            # The scalars are what a recursion would end on (n == 0), not the tiles.
            named = [k for k in runtime if isinstance(call.arguments[k], V.Scalar)] or runtime
            if named:
                raise self.error(node, f"{call.name} calls itself with a run-time argument "
                                       f"({', '.join(named)}) and otherwise the same arguments; "
                                       f"recursion is unrolled at compile time only when it "
                                       f"ends on compile-time values (pass the count as a "
                                       f"tk.constexpr, or loop with for ... in range())")
            raise self.error(node, f"{call.name} calls itself with the same arguments, so the "
                                   f"recursion never ends")
        if len(self.calls) >= MAX_INLINE_DEPTH:
            chain = " -> ".join(c.name for c in self.calls[-4:])
            raise self.error(node, f"calling {call.name} here nests inlined calls more than "
                                   f"{MAX_INLINE_DEPTH} deep (... -> {chain} -> {call.name}); "
                                   f"recursion is unrolled at compile time, so it must end "
                                   f"within {MAX_INLINE_DEPTH} calls")

    def visit_Assign(self, node):
        value = self.eval(node.value)
        for target in node.targets:
            self.bind(target, value)

    def visit_AnnAssign(self, node):
        if node.value is None:
            raise self.error(node, "a declaration needs a value")
        self.bind(node.target, self.eval(node.value))

    def visit_AugAssign(self, node):
        if type(node.op) not in _BINOPS or isinstance(node.op, ast.Pow):
            what = type(node.op).__name__
            raise self.error(node, f"operator {_SYNTAX.get(what, what)} is not supported here")
        current = self.eval(ast.Name(node.target.id, ast.Load(), lineno=node.lineno,
                                     col_offset=node.col_offset)) \
            if isinstance(node.target, ast.Name) else None
        if current is None:
            raise self.error(node, "augmented assignment works on plain names")
        self.bind(node.target, self.binary(node, _BINOPS[type(node.op)], current,
                                           self.eval(node.value)))

    def bind(self, target, value):
        if isinstance(target, ast.Name):
            self.scope[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, V.GlobalShape):      # M, K = A.shape
                value = tuple(value)
            elts = target.elts
            stars = [i for i, t in enumerate(elts) if isinstance(t, ast.Starred)]  # (one at most)
            need = f"{len(elts) - 1} or more" if stars else f"{len(elts)}"
            if not isinstance(value, (tuple, list)) or \
                    len(value) < len(elts) - len(stars) or not stars and len(value) > len(elts):
                raise self.error(target, f"cannot unpack {value!r} into {need} names")
            if stars:       # *outer, M, N = X.shape: the starred name takes a list
                i, after = stars[0], len(elts) - stars[0] - 1
                value = [*value[:i], list(value[i:len(value) - after]),
                         *value[len(value) - after:]]
                elts = [*elts[:i], elts[i].value, *elts[i + 1:]]
            for t, v in zip(elts, value):
                self.bind(t, v)
        else:
            raise self.error(target, "only names and tuples of names can be assigned "
                                     "(shared tiles and tensors are written with tk.store)")

    def visit_Assert(self, node):
        test = self.eval(node.test)
        if _is_runtime(test):
            raise self.error(node, "assert needs a compile-time condition")
        if not self.python(node.test, bool, test):
            msg = self.eval(node.msg) if node.msg is not None else "assertion failed"
            raise self.error(node, str(msg))

    def visit_If(self, node):
        test = self.eval(node.test)
        if not _is_runtime(test):
            self.run(node.body if self.python(node.test, bool, test) else node.orelse)  # constexpr if
            return
        if not (isinstance(test, V.Scalar) and test.kind == "bool"):
            raise self.condition_error(node.test, test, "an if condition")
        self.emit_if(node, test)

    def condition_error(self, node, test, what: str) -> CompilationError:
        """`what` (a run-time condition) given something other than one bool:
        the error says what it got and how to write what was meant."""
        shown, rule = ast.unparse(node), f"{what} must be a comparison or a bool"
        if isinstance(test, V.TileLike):
            return self.error(node, f"{rule} (one truth value), but `{shown}` is a "
                                    f"{T.show(T.parse(test.ir_type))}, a value per element; "
                                    f"to choose per element write tk.where(mask, a, b), e.g. "
                                    f"tk.where({shown}, a, b)")
        if isinstance(test, V.Scalar):
            return self.error(node, f"{rule}, but `{shown}` is a run-time {test.kind}; compare "
                                    f"it explicitly (`{shown} != 0`)")
        return self.error(node, f"{rule}, got {test!r}")

    def emit_if(self, node, test: V.Scalar):
        # scf.if needs its result types up front, and they are only known once
        # both branches are built: build them in a result-less scf.if, then
        # move their ops into the real one.
        before = dict(self.scope)
        draft = scf.IfOp(test.value, [], has_else=True)
        branches = []
        for block, body in ((draft.then_block, node.body), (draft.else_block, node.orelse)):
            self.scope = dict(before)
            with ir.InsertionPoint(block), self.runtime_body():
                self.run(body)
            branches.append(self.scope)
        self.scope = before
        names, types = [], []
        for n in _assigned_names(node.body + node.orelse):
            if not all(n in b for b in branches) and n not in before:
                self.gone[n] = (f"assigned in only one branch of the run-time `if` at line "
                                f"{node.lineno}, so it has no value after it; give it a value "
                                f"before the `if` (or in both branches)")
            if all(n in b for b in branches):   # assigned in one branch only: gone after
                t = self._merged_type(node, n, branches[0][n], branches[1][n])
                if t is not None:
                    names.append(n)
                    types.append(t)
        final = scf.IfOp(test.value, types, has_else=True, ip=ir.InsertionPoint(draft))
        for old, new, scope in ((draft.then_block, final.then_block, branches[0]),
                                (draft.else_block, final.else_block, branches[1])):
            with ir.InsertionPoint(new):
                yield_op = scf.YieldOp([])
            for op in list(old.operations):
                op.move_before(yield_op)
            with ir.InsertionPoint(yield_op):
                vals = [self._materialize(node, n, scope[n], t) for n, t in zip(names, types)]
            yield_op.operation.erase()
            with ir.InsertionPoint(new):
                scf.YieldOp(vals)
        draft.operation.erase()
        for n, r in zip(names, final.results):
            self.scope[n] = V.wrap(r)
        for n in list(before):          # a branch's run-time loop took it as its variable
            if any(n not in b for b in branches):
                self.scope.pop(n, None)

    def _merged_type(self, node, name: str, a, b) -> ir.Type | None:
        """The type `name` has after a run-time if whose branches leave it as a
        and b; None when it is the same compile-time value either way."""
        if not _is_runtime(a) and not _is_runtime(b) and type(a) is type(b) and a == b:
            return None
        types = []
        for v in (a, b):
            if _is_runtime(v):
                types.append(v.ir_type)
            elif isinstance(v, (bool, int, float)):
                types.append(ir.IntegerType.get_signless(1) if isinstance(v, bool) else
                             V.i32() if isinstance(v, int) else ir.F32Type.get())
            else:
                raise self.error(node, f"'{name}' is given different compile-time values "
                                       f"({v!r}) in the branches of a run-time if; only tiles, "
                                       f"vectors and numbers can differ between branches")
        if types[0] == types[1]:
            return types[0]
        if (met := _layout_met(*types)) is not None:
            return met
        if {str(t) for t in types} == {"i32", "f32"}:
            return ir.F32Type.get()
        shown = [T.show(T.parse(t)) if T.is_tile(t) else str(t) for t in types]
        raise self.error(node, f"'{name}' is a {shown[0]} in one branch and a {shown[1]} in "
                               f"the other: a name assigned under a run-time if keeps one type "
                               f"(convert one, or give it another name)")

    def _materialize(self, node, name: str, value, ir_type: ir.Type) -> ir.Value:
        """`name`'s value at the end of a branch of the run-time if `node`, as
        the if's result type `ir_type` (_merged_type's) takes it."""
        s = value if _is_runtime(value) else V.constant(value)
        if s.ir_type == ir_type:
            return s.value
        if _layout_met(s.ir_type, ir_type) is not None:
            s.value.set_type(ir_type)    # an "auto" vector takes the other branch's layout
            return s.value
        if T.is_tile(s.ir_type):         # an "auto" vector another name gave its layout
            raise self.error(node, f"'{name}' holds one vector in a branch of this if that "
                                   f"another name holds too, and the two take different "
                                   f"layouts after it ({T.parse(s.ir_type).layout} and "
                                   f"{T.parse(ir_type).layout}, as the tiles they were "
                                   f"reduced from lay them out): give each name its own "
                                   f"tk.zeros / tk.full")
        return V.to_float(s).value       # the only widening _merged_type allows: i32 -> f32

    def visit_For(self, node):
        if node.orelse:
            raise self.error(node, "for ... else is not supported")
        callee = self.eval(node.iter.func) if isinstance(node.iter, ast.Call) else None
        if callee not in (range, language.static_range):
            items = self.eval(node.iter)
            if _is_runtime(items) or isinstance(items, (str, bytes)) or \
                    not isinstance(items, collections.abc.Iterable):
                raise self.error(node.iter, "a kernel loop iterates over range(...) "
                                            "(or tk.static_range(...) to unroll it), or over a "
                                            "compile-time sequence (a tuple, a list, zip(...), "
                                            "enumerate(...): unrolled)")
            # (at most one more than may unroll: an endless iterator is refused, not run)
            items = self.python(node.iter, tuple, itertools.islice(items, MAX_STATIC_RANGE + 1))
            self.unroll(node.iter, "a loop over a compile-time sequence", len(items))
            for item in items:          # unrolled, as tk.static_range
                self.bind(node.target, item)
                self.run(node.body)
            return
        args = [self.eval(a) for a in node.iter.args]
        if not 1 <= len(args) <= 3:
            raise self.error(node.iter, "range takes 1 to 3 arguments")
        start, stop, step = (0, args[0], 1) if len(args) == 1 else \
            (args[0], args[1], args[2] if len(args) == 3 else 1)
        if not isinstance(node.target, ast.Name):
            raise self.error(node.target, "the loop variable must be a plain name")
        if callee is language.static_range:
            if any(_is_runtime(x) for x in (start, stop, step)):
                raise self.error(node.iter, "tk.static_range needs compile-time bounds"
                                 + V.constexpr_hint(start, stop, step))
            items = self.python(node.iter, range, start, stop, step)
            self.unroll(node.iter, "tk.static_range", _length(items))
            for i in items:
                self.scope[node.target.id] = i
                self.run(node.body)
            return
        self.emit_for(node, start, stop, step)

    def unroll(self, node, what: str, count: int) -> None:
        """Account for `count` bodies unrolled at compile time by `what`
        (MAX_STATIC_RANGE per loop, MAX_UNROLLED per kernel)."""
        if count > MAX_STATIC_RANGE:
            raise self.error(node, f"{what} unrolls at most {MAX_STATIC_RANGE} iterations "
                                   f"(MAX_STATIC_RANGE), got {count}; write range(...) for a "
                                   f"loop that runs on the GPU (scf.for), or unroll fewer")
        state = V.current.get()
        state.unrolled += count
        if state.unrolled > MAX_UNROLLED:
            raise self.error(node, f"{what}: the kernel unrolls more than {MAX_UNROLLED} loop "
                                   f"bodies in all (MAX_UNROLLED; nested compile-time loops "
                                   f"multiply); write range(...) for the outer loops")

    def emit_for(self, node, start, stop, step, index=None):
        """scf.for over range(start, stop, step); the loop variable is the
        induction variable, or index(it) when given. A compile-time negative
        step counts down: a loop over its trip count, k -> start + k·step."""
        if not _is_runtime(step) and step < 0:
            b = lambda op, x, y: self.binary(node, op, x, y)     # noqa: E731
            trips = b("max", b("floordiv", b("add", b("sub", start, stop), -step - 1), -step), 0)
            return self.emit_for(node, 0, trips, 1, lambda k: b("add", start, b("mul", k, step)))
        if not _is_runtime(step) and step == 0:
            raise self.error(node.iter, "range step must not be zero")
        if any(_is_runtime(x) and not isinstance(x, V.Scalar) for x in (start, stop, step)):
            raise self.error(node.iter, f"range bounds must be integers, got "
                                        f"{', '.join(map(repr, (start, stop, step)))}")
        bounds = [V.as_scalar(x) for x in (start, stop, step)]
        if any(b.kind != "int" for b in bounds):
            raise self.error(node.iter, "range bounds must be integers")
        carried = [n for n in _assigned_names(node.body)
                   if n in self.scope and n != node.target.id
                   and (_is_runtime(self.scope[n]) or isinstance(self.scope[n], (int, float)))]
        fixed = {n: self.scope[n] for n in _assigned_names(node.body)
                 if n in self.scope and n != node.target.id and n not in carried}
        self._refuse_stale_inner_indices(node, carried)
        inits = [V.as_scalar(self.scope[n]) if not _is_runtime(self.scope[n]) else self.scope[n]
                 for n in carried]
        loop = scf.ForOp(bounds[0].value, bounds[1].value, bounds[2].value,
                         [v.value for v in inits])
        outer = dict(self.scope)
        with ir.InsertionPoint(loop.body), self.runtime_body():
            iv = V.Scalar(loop.induction_variable)
            self.scope[node.target.id] = iv if index is None else index(iv)
            for n, arg in zip(carried, loop.inner_iter_args):
                self.scope[n] = V.wrap(arg)
            self.run(node.body)
            # names a nested run-time loop took as its variable: no value after it
            ended = {n for n in (*fixed, *carried) if n not in self.scope}
            for n, before in fixed.items():
                if n in ended:
                    continue
                if self.scope[n] is not before and not (type(self.scope[n]) is type(before)
                                                        and self.scope[n] == before):
                    raise self.error(node, f"'{n}' ({type(before).__name__}) changes in the loop, "
                                           f"but only tiles, vectors and numbers can be carried "
                                           f"from one iteration to the next (split it into "
                                           f"separate variables)")
            yields = []
            for n, init, arg in zip(carried, inits, loop.inner_iter_args):
                v = self.scope.get(n, V.wrap(arg))
                if v is None:
                    raise self.error(node, f"'{n}' is {_carried(init)} before the loop and "
                                           f"None after one iteration: was it assigned the "
                                           f"result of a function (a helper, or a tk.lcf "
                                           f"callback) that ends without `return`?")
                if not _is_runtime(v) and not isinstance(v, (bool, int, float)):
                    raise self.error(node, f"'{n}' is {_carried(init)} before the loop and "
                                           f"{_what(v)} after one iteration: a name the loop "
                                           f"reassigns is carried from one iteration to the "
                                           f"next and keeps its type; give the new value "
                                           f"another name")
                v = v if _is_runtime(v) else V.as_scalar(v)
                _settle_auto_layout(v.value, init.value, arg, loop.results[len(yields)])
                if v.ir_type == ir.F32Type.get() and init.ir_type != v.ir_type:
                    raise self.error(node, f"'{n}' starts as an int and becomes a float in the "
                                           f"loop; initialise it with a float (e.g. 0.0)")
                if v.ir_type != init.ir_type:
                    raise self.error(node, f"'{n}' changes type in the loop: {init!r} before, "
                                           f"{v!r} after one iteration; a name the loop "
                                           f"reassigns keeps its type (convert the new value, "
                                           f"or give it another name)")
                yields.append(v.value)
            scf.YieldOp(yields)
        self.scope = outer
        # Python leaves the last index in the loop variable; the scf.for's
        # induction variable ends with the loop, so the name has no value after
        # it (not the value it had before the loop).
        self.scope.pop(node.target.id, None)
        self.gone[node.target.id] = (
            f"the loop variable of the run-time loop at line {node.lineno}, which has no "
            f"value after the loop (Python would leave the last index there): keep what "
            f"you need in a variable assigned before the loop and reassigned in it")
        for n in _assigned_names(node.body):
            if n not in outer and n != node.target.id:
                self.gone[n] = (f"first assigned inside the run-time loop at line {node.lineno}, "
                                f"so it has no value after the loop (the loop may not run); "
                                f"give it a value before the loop to carry it through")
        for n, r in zip(carried, loop.results):
            self.scope[n] = V.wrap(r)
        for n in ended:
            self.scope.pop(n, None)

    def _refuse_stale_inner_indices(self, node, carried) -> None:
        """A carried name that a run-time loop inside this one takes as its
        variable, read in this loop's body outside that inner loop: from the
        second iteration Python reads the inner loop's last index, which an
        scf.for does not keep (the read would silently see the value from
        before the loops)."""
        inner = {f.target.id: f for stmt in node.body for f in ast.walk(stmt)
                 if isinstance(f, ast.For) and isinstance(f.target, ast.Name)
                 and isinstance(f.iter, ast.Call) and isinstance(f.iter.func, ast.Name)
                 and f.iter.func.id == "range" and f.target.id in carried}
        if not inner:
            return

        def reads(n):       # Name loads of inner's names, not inside the loops binding them
            if isinstance(n, ast.For) and isinstance(n.target, ast.Name) and \
                    inner.get(n.target.id) is n:
                yield from (r for r in reads(n.iter))
                return
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in inner:
                yield n
            for child in ast.iter_child_nodes(n):
                yield from reads(child)
        for stmt in node.body:
            for r in reads(stmt):
                raise self.error(r, f"'{r.id}' is read in the run-time loop at line "
                                    f"{node.lineno} and is the variable of the run-time loop "
                                    f"inside it at line {inner[r.id].lineno}: from the second "
                                    f"iteration Python would read that loop's last index, "
                                    f"which a kernel loop does not keep; give the inner "
                                    f"loop's variable another name")

    def visit_While(self, node):
        raise self.error(node, "while loops are not supported; use for ... in range(...)")

    # -------------------------------------------------------- expressions

    def visit_Constant(self, node):
        return node.value

    def visit_Name(self, node):
        if node.id in self.scope:
            return self.scope[node.id]
        if node.id in self.gone:        # a local without a value: never a global's (as Python)
            raise self.error(node, self.undefined(node.id))
        if node.id in self.globals:
            value = self.globals[node.id]
            if self.recorder is not None:
                self.recorder.global_name(self.globals, node.id, value)
            return value
        if node.id in _ALLOWED_BUILTINS:
            if self.recorder is not None:     # a later global of this name would be read
                self.recorder.global_name(self.globals, node.id)
            return getattr(builtins, node.id)
        raise self.error(node, self.undefined(node.id))

    def undefined(self, name: str) -> str:
        """Why `name` has no value here, and what to do about it."""
        if name in self.gone:
            return f"'{name}' is {self.gone[name]}"
        if name in self.closure:
            return (f"'{name}' is a variable of the function this one is defined in (a "
                    f"closure), and kernels do not read closures: pass it as a parameter "
                    f"(`{name}: tk.constexpr` for a compile-time value, or `{name}: float` / "
                    f"`{name}: int`) or make it a module-level global")
        known = [n for n in (*self.scope, *self.globals, *_ALLOWED_BUILTINS)
                 if not n.startswith("__")]
        close = nearest_names(name, known)
        return f"name '{name}' is not defined" + (f"; did you mean '{close[0]}'?" if close
                                                   else "")

    def visit_Attribute(self, node):
        obj = self.eval(node.value)
        try:
            value = getattr(obj, node.attr)
        except AttributeError as e:
            message = str(e) if isinstance(obj, V.Global) else \
                f"{obj!r} has no attribute '{node.attr}'" + _attribute_hint(obj, node.attr)
            raise self.error(node, message) from None
        if self.recorder is not None and not _is_runtime(obj):
            self.recorder.attribute(obj, node.attr, value)
        return value

    def visit_Tuple(self, node):
        return tuple(self._elements(node.elts))

    def visit_List(self, node):
        return self._elements(node.elts)

    def _elements(self, elts) -> list:
        """The values of a tuple or list display or of call arguments; `*xs`
        spreads a compile-time sequence (outer coordinates: `(*outer, m, k)`;
        a tensor's dims: `*X.shape`)."""
        out = []
        for e in elts:
            if not isinstance(e, ast.Starred):
                out.append(self.eval(e))
                continue
            seq = self.eval(e.value)
            if isinstance(seq, V.GlobalShape):
                seq = tuple(seq)
            if not isinstance(seq, (tuple, list)):
                raise self.error(e, f"*{ast.unparse(e.value)} spreads a compile-time tuple or "
                                    f"list (or a tensor's shape), not {type(seq).__name__}")
            out.extend(seq)
        return out

    def visit_JoinedStr(self, node):
        """f-strings of compile-time values (assert messages)."""
        out = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                out.append(str(part.value))
                continue
            v = self.eval(part.value)
            if _is_runtime(v):
                raise self.error(part, "an f-string formats compile-time values only")
            spec = self.eval(part.format_spec) if part.format_spec is not None else ""
            conv = {-1: v, 115: str(v), 114: repr(v), 97: ascii(v)}[part.conversion]
            out.append(self.python(part, format, conv, spec))
        return "".join(out)

    def visit_Dict(self, node):
        if any(k is None for k in node.keys):
            raise self.error(node, "**mapping in a dict display is not supported")
        keys = [self.eval(k) for k in node.keys]
        if any(_is_runtime(k) for k in keys):
            raise self.error(node, "dict keys must be compile-time values")
        return self.python(node, dict, zip(keys, [self.eval(v) for v in node.values]))

    def visit_Subscript(self, node):
        obj, index = self.eval(node.value), self.eval(node.slice)
        if isinstance(obj, (V.Shared, V.SharedVector, V.Semaphore, V.PeerGlobal)):  # arrays
            return self.python(node, operator.getitem, obj, index)
        if isinstance(obj, V.Global):
            raise self.error(node, "a tensor is not indexed with []: tk.load / tk.store read and "
                                   "write it (tk.load(X, idx) one i32 element); X[r] picks rank "
                                   "r's copy of a tk.pgl argument, and that copy is one tensor")
        if _is_runtime(index) and not isinstance(obj, (tuple, list)):
            raise self.error(node, "indexing with a run-time value is not supported")
        if _is_runtime(index):
            raise self.error(node, "a tuple index must be a compile-time int")
        value = self.python(node, operator.getitem, obj, index)
        if self.recorder is not None and not _is_runtime(obj):
            self.recorder.item(obj, index, value)
        return value

    def visit_Slice(self, node):
        """`a[i:j:k]` of a compile-time sequence: a slice of compile-time bounds."""
        bounds = [None if e is None else self.eval(e) for e in (node.lower, node.upper, node.step)]
        if any(_is_runtime(b) for b in bounds):
            raise self.error(node, "slice bounds must be compile-time ints")
        return slice(*bounds)

    def visit_UnaryOp(self, node):
        v = self.eval(node.operand)
        if not _is_runtime(v):
            return self.python(node, _PY_UNARY[type(node.op)], v)
        if isinstance(node.op, ast.Invert) and isinstance(v, V.TileLike):
            return ~v
        if isinstance(node.op, ast.USub):
            if isinstance(v, V.TileLike):
                return -v
            return V.scalar_binary("sub", 0 if v.kind == "int" else 0.0, v)
        if isinstance(node.op, ast.Not) and isinstance(v, V.Scalar) and v.kind == "bool":
            return V.scalar_binary("xor", v, True)
        if isinstance(node.op, ast.Not) and isinstance(v, V.TileLike):
            raise self.error(node, "`not` needs one truth value; the elementwise not of a mask "
                                   "is ~mask")
        raise self.error(node, f"unary {type(node.op).__name__} is not supported on {v!r}")

    def binary(self, node, op: str, a, b):
        if not (_is_runtime(a) or _is_runtime(b)):
            return self.python(node, _PY_BINOPS[op], a, b)
        if isinstance(a, V.TileLike) or isinstance(b, V.TileLike):
            if op not in ("add", "sub", "mul", "div", "max", "min", "and", "or", "xor"):
                raise self.error(node, f"operator {_PY_SPELLING.get(op, op)} is not defined on "
                                       f"tiles (elementwise tiles take +, -, *, /, &, |, ^); "
                                       f"compute indices and offsets on scalars")
            return V.tile_binary(op, a, b)
        return V.scalar_binary(op, a, b)

    def visit_BinOp(self, node):
        if type(node.op) not in _BINOPS:
            what = type(node.op).__name__
            raise self.error(node, f"operator {_SYNTAX.get(what, what)} is not supported in a "
                                   f"kernel")
        a, b = self.eval(node.left), self.eval(node.right)
        if isinstance(node.op, ast.Pow) and (_is_runtime(a) or _is_runtime(b)):
            raise self.error(node, "** on run-time values is not supported (only on constexprs)")
        return self.binary(node, _BINOPS[type(node.op)], a, b)

    def visit_Compare(self, node):
        """`a < b`, and a chain `a < b <= c` as (a < b) and (b <= c), each
        operand evaluated once, left to right: a link false at compile time
        ends the chain there (the operands after it are not evaluated, as
        in Python); run-time links are and-ed (every operand evaluated, as
        `and` of run-time values is)."""
        if len(node.ops) == 1:
            return self._compare(node, type(node.ops[0]), self.eval(node.left),
                                 self.eval(node.comparators[0]))
        a, out = self.eval(node.left), True
        for op, right in zip(node.ops, node.comparators):
            b = self.eval(right)
            if isinstance(a, V.TileLike) or isinstance(b, V.TileLike):
                raise self.error(node, "a chained comparison of tiles: write each comparison "
                                       "and combine the masks with & (in parentheses: (a < b) "
                                       "& (b < c))")
            link = self._compare(node, type(op), a, b)
            if not _is_runtime(link):
                if not link:
                    return False
            else:
                out = link if out is True else V.scalar_binary("and", out, link)
            a = b
        return out

    def _compare(self, node, op, a, b):
        if op in (ast.Is, ast.IsNot) and (a is None or b is None):
            return (a is b) == (op is ast.Is)       # a run-time value is never None
        if op in (ast.Is, ast.IsNot, ast.In, ast.NotIn):
            if _is_runtime(a) or _is_runtime(b):
                raise self.error(node, "is/in compare compile-time values only")
            if op in (ast.Is, ast.IsNot):
                return (a is b) == (op is ast.Is)
            return self.python(node, operator.contains, b, a) == (op is ast.In)
        name = _CMPOPS[op]
        if not (_is_runtime(a) or _is_runtime(b)):
            return self.python(node, _PY_CMPOPS[name], a, b)
        if isinstance(a, V.TileLike) or isinstance(b, V.TileLike):
            return V.tile_compare(name, a, b)
        return V.compare(name, a, b)

    def visit_BoolOp(self, node):
        """`and` / `or`, left to right: a compile-time operand that decides
        (false in an `and`, true in an `or`) ends it there, the operands after
        it not evaluated, as in Python; one that does not is skipped (or is
        the value, when all are compile-time). Run-time operands are combined
        (each evaluated: a run-time value does not skip the rest)."""
        is_and, out = isinstance(node.op, ast.And), None
        for i, expr in enumerate(node.values):
            v = self.eval(expr)
            if isinstance(v, V.TileLike):
                raise self.error(node, "`and` / `or` need one truth value; combine masks "
                                       "elementwise with & and | (in parentheses: (a < b) & "
                                       "(c < d))")
            if _is_runtime(v):
                out = v if out is None else V.scalar_binary("and" if is_and else "or", out, v)
            elif bool(v) != is_and or (out is None and i == len(node.values) - 1):
                return v
        return out

    def _comprehension(self, node):
        """[expr for x in seq if cond]: unrolled at compile time (seq must be
        a compile-time sequence, e.g. a list of shared tiles or a range)."""
        if len(node.generators) != 1 or node.generators[0].is_async:
            raise self.error(node, "only single-`for` comprehensions are supported")
        gen = node.generators[0]
        seq = self.eval(gen.iter)
        if _is_runtime(seq) or not hasattr(seq, "__iter__"):
            raise self.error(gen.iter, "a comprehension iterates over a compile-time sequence")
        if isinstance(seq, range):
            self.unroll(gen.iter, "a comprehension", _length(seq))
        saved, out = dict(self.scope), []
        for item in seq:
            self.bind(gen.target, item)
            conds = [self.eval(c) for c in gen.ifs]
            if any(_is_runtime(c) for c in conds):
                raise self.error(gen, "a comprehension's `if` must be a compile-time condition")
            if all(conds):
                out.append(self.eval(node.elt))
        self.scope = saved
        return out

    def visit_ListComp(self, node):
        return self._comprehension(node)

    def visit_GeneratorExp(self, node):
        return tuple(self._comprehension(node))

    def visit_IfExp(self, node):
        test = self.eval(node.test)
        if _is_runtime(test):
            # arith.select on numbers; tiles take an `if` statement (scf.if).
            if not (isinstance(test, V.Scalar) and test.kind == "bool"):
                raise self.condition_error(node.test, test, "a condition")
            a, b = self.eval(node.body), self.eval(node.orelse)
            for side, v in ((node.body, a), (node.orelse, b)):
                if not (isinstance(v, V.Scalar) or isinstance(v, (bool, int, float))):
                    raise self.error(side, f"x if c else y with a run-time condition chooses "
                                           f"between numbers, not {v!r}; for tiles write an "
                                           f"if statement")
            a, b = V.as_scalar(a), V.as_scalar(b)
            if a.ir_type != b.ir_type:
                a, b = V.to_float(a), V.to_float(b)
            return V.Scalar(arith.select(test.value, a.value, b.value))
        return self.eval(node.body if self.python(node.test, bool, test) else node.orelse)

    def visit_Call(self, node):
        callee = self.eval(node.func)
        args = self._elements(node.args)       # f(*tiles): a compile-time sequence
        if any(k.arg is None for k in node.keywords):
            raise self.error(node, "**kwargs is not supported in calls")
        kwargs = {k.arg: self.eval(k.value) for k in node.keywords}
        if callee in (min, max) and any(_is_runtime(a) for a in args):
            out = args[0]   # elementwise on tiles (max(x, 0.0)), arith on scalars
            for a in args[1:]:
                out = self.binary(node, callee.__name__, out, a)
            return out
        if callee is sum and args and isinstance(args[0], (list, tuple)) and \
                any(_is_runtime(a) for a in args[0]):
            terms = list(args[0])   # tiles or scalars added in order, as Python's sum
            start = args[1] if len(args) > 1 else kwargs.get("start", 0)
            out = terms[0] if isinstance(start, int) and start == 0 else \
                self.binary(node, "add", start, terms[0])
            for t in terms[1:]:
                out = self.binary(node, "add", out, t)
            return out
        if callee is float and args and _is_runtime(args[0]):
            return V.to_float(args[0])
        if callee is abs and len(args) == 1 and _is_runtime(args[0]):
            x = args[0]         # a tile's .abs(); a scalar's max(x, -x)
            if isinstance(x, V.TileLike):
                return x.abs()
            if x.kind == "bool":
                raise self.error(node, "abs() of a truth value is not defined")
            return self.binary(node, "max", x,
                               V.scalar_binary("sub", 0 if x.kind == "int" else 0.0, x))
        if isinstance(callee, language.BoundFunc):       # obj.method(...) of a tk.func
            callee, args = callee.func, [callee.obj, *args]
        if isinstance(callee, (language.Func, LocalFunc)):
            return self.inline(node, callee, args, kwargs)
        if self.recorder is not None and (inspect.isfunction(callee) or
                                          inspect.ismethod(callee)):
            self.recorder.called(callee)      # its code's globals count too
        runtime_args = any(_is_runtime(a) for a in args + list(kwargs.values()))
        if (getattr(callee, "__tk_builtin__", False) or _is_method_of_value(callee)
                or not runtime_args):
            return self.python(node, callee, *args, **kwargs)
        name = getattr(callee, "__name__", repr(callee))
        rule = f"calling {name}() on run-time values is not supported in a kernel: only tk.* " \
               f"functions, tile methods and @tk.func helpers take them"
        if callee is range:
            raise self.error(node, f"{rule}. range() with a run-time bound makes no list (a "
                                   f"comprehension needs compile-time bounds, a tk.constexpr); "
                                   f"for a loop on the GPU write `for i in range(n):`")
        if inspect.isfunction(callee) or inspect.ismethod(callee):
            how = "define it with def and decorate it" if name == "<lambda>" else "decorate it"
            raise self.error(node, f"{rule}; {name} is a plain Python function, run only on "
                                   f"compile-time values: {how} with @tk.func to have it "
                                   f"inlined into the kernel")
        raise self.error(node, rule)


@dataclass(frozen=True)
class LocalFunc:
    """A function inlined at its calls: one defined in the kernel, which sees
    the names of the block that defined it as they are when it is *called*
    (Python's late binding: a loop-carried value is the current iteration's),
    or a tk.func (no enclosing names)."""
    node: ast.FunctionDef
    signature: inspect.Signature
    filename: str
    globals: dict
    definer: KernelBuilder | None

    def free_names(self) -> dict:
        return dict(self.definer.scope) if self.definer is not None else {}


def _attribute_hint(obj, name: str) -> str:
    """"; did you mean ...?" with the public attributes of obj that have
    `name` as a word (sum: row_sum, col_sum) or are spelled like it."""
    known = [n for n in dir(obj) if not n.startswith("_")]
    close = [n for n in known if name in n.split("_")][:3] or nearest_names(name, known, n=2)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def _unbound_reason(fn, args, kwargs) -> str | None:
    """Why fn's signature does not take these arguments (too many, a missing
    one), against the signature as the user calls it (a method's without
    self, which Python's own message counts and names by its class:
    "TileLike.exp() takes 1 positional argument but 2 were given"); None if
    it takes them or has no signature (some C functions)."""
    signature = _signature(fn)
    if signature is None:
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        return f"{_callee_name(fn)}({', '.join(signature.parameters)}): {e}"
    return None


def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):     # (some C functions have none)
        return None


def _callee_name(fn) -> str:
    """`fn`'s name as the user wrote it (tk.load for a builtin, tk.tma.load_async
    for one of a submodule the package exposes)."""
    name = getattr(fn, "__name__", None) or type(fn).__name__
    if not getattr(fn, "__tk_builtin__", False):
        return name
    module = (getattr(fn, "__module__", None) or "").rsplit(".", 1)[-1]
    package = sys.modules.get(__package__)      # (the package, loaded: not imported here)
    exposed = getattr(package, "_SUBMODULES", ())
    return f"tk.{module}.{name}" if module in exposed else f"tk.{name}"


def _bad_keyword(signature: inspect.Signature | None, name: str, kwargs: dict) -> str | None:
    """The error for a keyword argument that `name` does not take, with the
    nearest one it does ("did you mean 'fill'?"); None if every keyword fits."""
    if signature is None:
        return None
    params = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for k in kwargs:
        if k not in names:
            close = nearest_names(k, names)
            hint = f"did you mean '{close[0]}'?" if close else \
                f"it takes {', '.join(names) or 'no keyword arguments'}"
            return f"{name}() has no keyword argument '{k}'; {hint}"
    return None


def _length(items: range) -> int:
    """len(items), also past sys.maxsize (where len() raises)."""
    try:
        return len(items)
    except OverflowError:
        return (items.stop - items.start) // items.step


def check_nesting(fn: ast.FunctionDef, filename: str) -> None:
    """No expression in `fn` nests deeper than MAX_EXPRESSION_DEPTH: an error
    at the outermost expression of one that does (checked before building,
    without recursion, so it never meets Python's recursion limit)."""
    stack = [(fn, 0, None)]        # (node, expressions around it, the outermost one)
    while stack:
        node, depth, top = stack.pop()
        if isinstance(node, ast.expr):
            depth, top = depth + 1, top or node
            if depth > MAX_EXPRESSION_DEPTH:
                raise CompilationError(
                    f"this expression nests more than {MAX_EXPRESSION_DEPTH} operations "
                    f"deep (MAX_EXPRESSION_DEPTH; `a + b + ... + z` nests one per +); split "
                    f"it over several statements (s = a + b; s = s + c; ...)",
                    filename, top.lineno, top.col_offset)
        elif isinstance(node, ast.stmt):
            depth, top = 0, None
        stack.extend((child, depth, top) for child in ast.iter_child_nodes(node))


def _is_method_of_value(callee) -> bool:
    return isinstance(getattr(callee, "__self__", None), V.Value)


def build_kernel(fn_node: ast.FunctionDef, filename: str, globals_: dict, name: str,
                 params: list[FuncArg], constexprs: dict[str, Any], num_warps: int) -> ir.Module:
    """Emit the module holding `func.func @name` for one specialization."""
    module = ir.Module.create(ir.Location.file(filename, fn_node.lineno, fn_node.col_offset + 1))
    token_b = language._building.set(True)
    token_k = V.current.set(V.KernelState(num_warps))
    try:
        with ir.Location.file(filename, fn_node.lineno, fn_node.col_offset + 1):
            with ir.InsertionPoint(module.body):
                f = func.FuncOp(ptx_symbol(name), ([p.ir_type for p in params], []))
                contracts.NUM_WARPS.set(f, num_warps)
                entry = f.add_entry_block()
        scope = dict(constexprs)
        peers: dict[str, list] = {}
        for p, arg in zip(params, entry.arguments):
            if p.peer_of is None:
                scope[p.name] = V.wrap(arg)
                if isinstance(scope[p.name], V.Scalar):
                    scope[p.name].param = p.name     # (named in "declare it tk.constexpr")
            else:
                peers.setdefault(p.peer_of, []).append(V.wrap(arg))
        for name, (local, *copies, rank) in peers.items():
            scope[name] = V.PeerGlobal(local, copies, rank)
        if peers:
            contracts.PEER_COPIES.set(f, tuple(     # the ranks' copies X[r] (not X, X.rank)
                i for i, p in enumerate(params)
                if p.peer_of not in (None, p.name) and p.kind == "gl"))
        check_nesting(fn_node, filename)
        builder = KernelBuilder(filename, globals_, scope, kernel=name,
                                closure=closure_names(fn_node))
        body = fn_node.body
        if body and isinstance(body[-1], ast.Return) and body[-1].value is None:
            body = body[:-1]
        with ir.InsertionPoint(entry):
            try:
                builder.run(body)
            except KernelReturned:      # a return under compile-time ifs: nothing after it
                pass
            with builder.loc(fn_node):
                func.ReturnOp([])
    except RecursionError:
        # (MAX_EXPRESSION_DEPTH and MAX_INLINE_DEPTH keep below this)
        raise CompilationError(f"compiling {name} ran out of Python's stack (recursion "
                               f"limit {sys.getrecursionlimit()}): nest its expressions and "
                               f"inlined calls less deeply", filename, fn_node.lineno,
                               fn_node.col_offset) from None
    finally:
        V.current.reset(token_k)
        language._building.reset(token_b)
    return module
