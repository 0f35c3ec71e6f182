"""The module-level values a kernel's code depends on, and a cheap test that
they have not changed since it was compiled.

A kernel that reads `SCALE` from its module bakes SCALE's value into its
code, so a changed SCALE must never run the old code (in a notebook this is
the everyday case). At compile time the kernel records one `GlobalRead` per
global it reads (and per global of each @tk.func it inlines, recursively):
the namespace dict, the name, the value seen, and the value's text (what the
cache key holds). Before reusing compiled code, each read is re-checked:

- an immutable value (number, str, tk dtype, tuple, function, tk.func,
  module): one dict lookup and an identity test; only when the identity
  differs (a cell re-ran `SCALE = 2.0`, a new float) is the text recomputed
  and compared, and an equal text adopts the new object so that the next
  check is an identity test again;
- a mutable value (list, dict, any other object, read by its repr: the kernel
  may read its attributes) can change in place, so its text is recomputed
  on every check. Slower, never stale;
- a tensor or array: by its type, shape, dtype and device (never its
  contents, which no compiled code depends on), checked by identity.
"""
from __future__ import annotations

import ast
import functools
import inspect

from .language import DType, Func

_MISSING = object()
_IMMUTABLE = (int, float, str, bool, bytes, DType, type(None))


class GlobalRead:
    """One global read by the code: `scope[name]` was `value`, shown as `text`."""

    __slots__ = ("scope", "name", "value", "text", "volatile", "label")

    def __init__(self, scope: dict, name: str, value, label: str):
        self.scope, self.name, self.value, self.label = scope, name, value, label
        self.text = _text(value)
        self.volatile = not _immutable(value)

    def fresh(self) -> bool:
        """True when scope[name] still gives the code this read saw."""
        value = self.scope.get(self.name, _MISSING)
        if value is self.value and not self.volatile:
            return True
        if value is _MISSING or _text(value) != self.text:
            return False
        self.value = value            # equal: the next check is an identity test
        return True

    def key_part(self) -> str:
        return f"{self.label}{self.text}"

    def __repr__(self):
        return f"<global {self.label.rstrip('=:')} = {self.text[:60]}>"


def global_reads(source: str, scope: dict) -> tuple[GlobalRead, ...]:
    """The reads of the code `source` (a kernel's), whose globals are `scope`,
    and those of the tk.funcs it inlines, recursively."""
    reads: list[GlobalRead] = []
    _collect(source, scope, "", reads, set())
    return tuple(reads)


def all_fresh(reads) -> bool:
    for r in reads:
        if not r.fresh():
            return False
    return True


def stale_names(reads) -> list[str]:
    return [r.label.rstrip("=:") for r in reads if not r.fresh()]


def key_text(reads) -> str:
    """The reads as the disk cache key's text."""
    return ";".join(r.key_part() for r in reads)


# ------------------------------------------------------------------ walk

@functools.lru_cache(maxsize=256)
def _names_in(source: str) -> tuple[str, ...]:
    """The names the code may read from its module: every name in the
    function's body but its parameters (bound from the start, so never looked
    up in the module; `X = torch.rand(...)` beside a kernel taking X is
    common). The decorators, annotations and defaults were evaluated once, at
    decoration. Names the body assigns stay: the frontend reads the global
    until they are bound."""
    tree = ast.parse(source)
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return tuple(sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}))
    names = {n.id for stmt in fn.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    a = fn.args
    names -= {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    names -= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    return tuple(sorted(names))


def _collect(source: str, scope: dict, prefix: str, reads: list, seen: set) -> None:
    for name in _names_in(source):
        if name not in scope:
            continue
        value = scope[name]
        sep = ":" if isinstance(value, Func) or inspect.isfunction(value) \
            or inspect.ismodule(value) or not _plain(value) else "="
        reads.append(GlobalRead(scope, name, value, f"{prefix}{name}{sep}"))
        if isinstance(value, Func):        # inlined: what it reads counts too
            if id(value) not in seen:
                seen.add(id(value))
                _collect(value.source.text, value.fn.__globals__, f"{prefix}{name}.", reads, seen)
        elif inspect.ismodule(value) and not value.__name__.startswith("tk_mlir"):
            # tk_mlir's own tk.funcs are covered by the source hash in the
            # cache key; a user module's are read here.
            attrs = vars(value)
            for attr, f in sorted(attrs.items()):
                if isinstance(f, Func) and id(f) not in seen:
                    seen.add(id(f))
                    reads.append(GlobalRead(attrs, attr, f, f"{prefix}{name}.{attr}:"))
                    _collect(f.source.text, f.fn.__globals__, f"{prefix}{name}.{attr}.",
                             reads, seen)


def _plain(value) -> bool:
    return isinstance(value, (int, float, str, bool, DType, tuple, list, dict)) or value is None


def _immutable(value) -> bool:
    if isinstance(value, tuple):
        return all(_immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE) or isinstance(value, Func) or \
        inspect.isfunction(value) or inspect.ismodule(value) or _is_array(value)


def _is_array(value) -> bool:
    """A tensor or array (torch, numpy, ...): read by what compile-time code
    can use of it (type, shape, dtype, device), never by its contents, and
    checked by identity (a resize_ in place goes unseen)."""
    return not isinstance(value, type) and hasattr(value, "shape") and \
        any(hasattr(value, a) for a in ("__array__", "__dlpack__", "__cuda_array_interface__"))


def _text(value) -> str:
    if _is_array(value):
        from .params import describe_value
        return describe_value(value)
    if isinstance(value, Func):
        return f"tk.func:{value.source.text}"
    if inspect.isfunction(value):      # a helper called at compile time: its code counts
        return _function_fingerprint(value)
    if inspect.ismodule(value):
        return f"module {value.__name__}"
    # Anything else by its repr: attributes the kernel may read show up there
    # (namespace(SCALE=2.0)); a repr with an address makes each process miss
    # the disk cache, which is slow but never stale.
    return repr(value)


def _function_fingerprint(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        code = fn.__code__
        return repr((code.co_code, code.co_consts, code.co_names))
