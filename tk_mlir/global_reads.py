"""The values a kernel's code read from outside it while it was compiled,
and a cheap test that they have not changed since.

A kernel that reads `SCALE` bakes its value into the code, so a changed SCALE
must never run the old code. While a kernel compiles, a `Recorder` (see
`recording`) collects one `GlobalRead` (scope, name, value) per value the
frontend resolved outside the kernel: globals (an unfound builtin name as
ABSENT), attributes of user modules, classes and recorded values, and the
source, defaults, globals and cells of plain functions called at compile
time (`_FOLLOW_DEPTH` deep). tk_mlir's own modules, the standard library and
installed packages are not followed (cache key, or unchanged in a process).
`fresh` checks a read: immutable values by identity, then `text`; mutable
ones by text on every check (`volatile`); tensors and arrays by type, shape,
dtype and device, held by weak reference.

On disk (`compile_cached`) the read sets that compiles of `base` (everything
known before compiling) recorded lie under `_index_key(base, n)`, each read
named by where it was found (`describe`); a lookup re-resolves a set
(`resolve`) and looks for code under base + set + current texts (`key_text`).
Sound because the frontend is deterministic: if every recorded read gives the
text it gave the compile, a compile now would emit the same code. This
assumes a value's text stands for all the compile used of it; a read that
cannot be described leaves its code off the disk (never stale).

`global_reads(source, scope)` guesses reads from the source's names, only for
`Kernel._globals_key` (the autotuner's key, needed before any compile).
"""
from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import inspect
import os
import sys
import types
import weakref

from .language import DType, Func

_MISSING = object()
ABSENT = _MISSING           # an absent name's `value`: what `scope.get(name, ABSENT)` gives
_DEAD = object()            # a weakly held value that is gone: never the current one
_IMMUTABLE = (int, float, str, bool, bytes, complex, DType, type(None))
_UNHELD = object()          # a read's value slot when the value is not kept (see _set)
_FOLLOW_DEPTH = 3           # plain functions followed into functions they name, this deep


def _has_plain_attr(obj, name: str) -> bool:
    """Is `name` a data attribute of obj, read without running user code
    (no property, no method, no __getattr__)?"""
    try:
        for klass in (obj if isinstance(obj, type) else type(obj)).__mro__:
            if name in vars(klass):
                a = vars(klass)[name]
                return not isinstance(a, (property, staticmethod, classmethod)) and \
                    not inspect.isfunction(a)
        return not isinstance(obj, type) and name in getattr(obj, "__dict__", {})
    except Exception:
        return False


class _Items:
    """A container's items as a scope: `.get(key)` is obj[key]. The
    container is held weakly when it can be."""

    __slots__ = ("_attrs",)

    def __init__(self, obj):
        self._attrs = _Attrs(obj)

    def get(self, key, default=None):
        obj = self._attrs.obj
        if obj is None:
            return _DEAD
        try:
            return obj[key]
        except Exception:         # KeyError, IndexError, TypeError
            return default

    def __repr__(self):
        return f"<items of {self._attrs.obj!r}>"


class _Attrs:
    """An object's attributes as a scope: `.get(name)` is getattr (a class's
    inherited attributes included). The object is held weakly when it can be."""

    __slots__ = ("_ref", "_strong", "__weakref__")

    def __init__(self, obj):
        try:
            self._ref, self._strong = weakref.ref(obj), None
        except TypeError:
            self._ref, self._strong = None, obj

    @property
    def obj(self):
        return self._strong if self._ref is None else self._ref()

    def get(self, name, default=None):
        obj = self.obj
        if obj is None:
            return _DEAD          # gone: no value is the one read (not even None)
        try:
            return getattr(obj, name)
        except Exception:         # AttributeError, or a property that raises
            return default

    def __repr__(self):
        return f"<attributes of {self.obj!r}>"


class _Cells:
    """A function's closure as a scope: `.get(name)` is the cell's contents."""

    __slots__ = ("_fn",)

    def __init__(self, fn):
        self._fn = fn

    def get(self, name, default=None):
        code, cells = self._fn.__code__, self._fn.__closure__ or ()
        try:
            return cells[code.co_freevars.index(name)].cell_contents
        except (ValueError, IndexError):
            return default

    def __repr__(self):
        return f"<closure of {self._fn.__qualname__}>"


class GlobalRead:
    """One read by the code: `scope.get(name)` was `value`, shown as `text`;
    `ref` says where scope is, for a new process (None: it cannot say)."""

    __slots__ = ("scope", "name", "value", "_weak", "text", "volatile", "label", "ref",
                 "absent", "state")

    def __init__(self, scope, name: str, value, label: str | None = None, ref=None):
        self.scope, self.name, self.ref = scope, name, ref
        self.label = label if label is not None else f"{name}="
        self.absent = value is _MISSING
        self._set(value)
        self.text = "<absent>" if self.absent else _text(value)
        # A function is one object whose code and defaults may be replaced in
        # place (f.__defaults__ = ...): checked on every launch, cheaply
        # while they are the objects seen (_function_state).
        self.state = None if self.absent else _function_state(value)
        self.volatile = not self.absent and (self.state is not None or not _immutable(value))

    def _set(self, value) -> None:
        """`value`: the value seen, for the launch plans' identity test. An
        absent name's is ABSENT, which `scope.get(name)` never gives: a plan
        testing `scope.get(name) is not value` calls fresh() on each launch
        for it (`scope.get(name, ABSENT)` would make it an identity test). A
        tensor or object is held weakly: `value` is then its weak reference,
        no scope's value, so a plan's identity test defers to fresh()."""
        self._weak = False
        if isinstance(value, (list, dict, tuple)) and _holds_arrays(value):
            self.value = _UNHELD      # compared by text: the tensors are not kept alive
            return
        if isinstance(value, types.MethodType) and not _is_array(value.__self__):
            self.value = value        # (made anew by each read: fresh() compares its parts)
            return
        if value is not _MISSING and not isinstance(
                value, (_IMMUTABLE, tuple, list, dict, types.ModuleType, types.FunctionType,
                        type, Func)):
            try:
                self.value, self._weak = weakref.ref(value), True
                return
            except TypeError:
                pass
        self.value = value

    def seen(self):
        """The value seen (a weakly held one that is gone: a private object
        that is no value's identity)."""
        if self._weak:
            v = self.value()
            return _DEAD if v is None else v
        return self.value

    def fresh(self) -> bool:
        """True when scope.get(name) still gives the code this read saw."""
        value = self.scope.get(self.name, _MISSING)
        if value is _DEAD:
            return False
        if self.absent or value is _MISSING:
            return self.absent and value is _MISSING
        seen = self.seen()
        same = value is seen or isinstance(value, types.MethodType) and \
            isinstance(seen, types.MethodType) and value.__self__ is seen.__self__ and \
            value.__func__ is seen.__func__   # (a bound method read again: a new object)
        if same and (not self.volatile or self.state is not None and
                     _unchanged_function(self.state, value)):
            return True
        if not same and not _adoptable(value):
            return False              # a new class/function/object: recompile
        if _text(value) != self.text:
            return False
        if not same:
            self._set(value)          # equal: the next check is an identity test
        self.state = _function_state(value)
        return True

    def key_part(self) -> str:
        return f"{self.label}{self.text}"

    def __repr__(self):
        return f"<global {self.label.rstrip('=:')} = {self.text[:60]}>"


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


# ------------------------------------------------------------------ recording

_current: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "tk_mlir_global_reads", default=None)


class Recorder:
    """The reads of one compile, in the order made, each once."""

    def __init__(self, constexprs: dict | None = None, kernel_globals: dict | None = None):
        self._kernel_globals = kernel_globals
        self.reads: list[GlobalRead] = []
        self._seen: dict[tuple, int] = {}          # (id of the scope's owner, name) -> index
        self._by_value: dict[int, int] = {}        # id(value) -> index of the read that gave it
        self._keep: list = []                      # the values above, alive while compiling
        self._followed: set[int] = set()
        self._constexprs = {id(v): k for k, v in (constexprs or {}).items()}

    # -- what the frontend calls
    def global_name(self, globals_: dict, name: str, value=_MISSING) -> None:
        """The frontend looked `name` up in `globals_` (value: what it found).
        tk_mlir's own tk.funcs (templates) read nothing a user changes: their
        sources are in every cache key."""
        if (globals_.get("__name__") or "").startswith("tk_mlir"):
            return
        self._add(globals_, globals_, name, value, ("dict", self._dict_ref(globals_)))

    def attribute(self, obj, name: str, value) -> None:
        """The frontend read `obj.name` (gave value)."""
        if isinstance(obj, types.ModuleType):
            # Any module but tk_mlir's and the standard library's: an installed
            # package's constant (`mylib.SCALE`) may change with an upgrade or
            # be set by the user; reading it costs one identity test a launch.
            module = getattr(obj, "__name__", "") or ""
            if module.startswith("tk_mlir") or \
                    module.partition(".")[0] in sys.stdlib_module_names:
                return
            d = vars(obj)
            if d.get(name, _MISSING) is value:
                self._add(d, d, name, value, ("dict", self._obj_ref(obj)))
                return
        elif not isinstance(obj, type) and (id(obj) not in self._by_value and
                                            id(obj) not in self._constexprs or _is_array(obj)):
            return     # derived from recorded reads (a call's result, a tile): nothing new
        elif isinstance(obj, type) and (obj.__module__ or "").startswith("tk_mlir"):
            return
        self._add(obj, _Attrs(obj), name, value, ("attr", self._obj_ref(obj)))

    def item(self, obj, index, value) -> None:
        """The frontend read `obj[index]` (gave value) of a value read from
        outside: an object there (`CONFIGS["gemm"]`) is a read of its own, so
        the attributes read of it are reads too (`CONFIGS["gemm"].scale`)."""
        if _plain(value) or _immutable(value) or \
                id(obj) not in self._by_value and id(obj) not in self._constexprs:
            return
        self._add(obj, _Items(obj), index, value, ("item", self._obj_ref(obj)))

    def called(self, fn) -> None:
        """The frontend calls fn, a plain Python function or a method, at
        compile time. A method's own object (a class for a classmethod) is
        read through its `self`/`cls`: the attributes its code names are
        reads of that object's."""
        if inspect.ismethod(fn):
            owner, fn = fn.__self__, fn.__func__
            if isinstance(owner, type) or id(owner) in self._by_value or \
                    id(owner) in self._constexprs:
                for attr in _code_names(fn.__code__):
                    v = getattr(owner, attr, _MISSING) if _has_plain_attr(owner, attr) \
                        else _MISSING
                    if v is not _MISSING and not inspect.isfunction(v) and \
                            not inspect.ismethod(v):
                        self.attribute(owner, attr, v)
        self._follow(fn, 0)

    # -- the rest
    def _add(self, owner, scope, name: str, value, ref) -> None:
        k = (id(owner), name)
        if k in self._seen:
            return
        self._seen[k] = len(self.reads)
        if ref[1] is None:
            ref = None
        self.reads.append(GlobalRead(scope, name, value, _label(ref, name, value), ref))
        if value is not _MISSING:
            self._by_value.setdefault(id(value), len(self.reads) - 1)
            self._keep.append(value)
            if inspect.isfunction(value):
                self._follow(value, 1)

    def _attributes_named(self, value, names, depth: int) -> None:
        """Record the attributes of `value` (a module, class or object a
        helper's code reached) whose names its code holds, and theirs, down
        to _FOLLOW_DEPTH (`Outer.Inner.V`, `CFG.scale`)."""
        if depth > _FOLLOW_DEPTH or _plain(value) or _is_array(value) or \
                isinstance(value, _IMMUTABLE) or inspect.isfunction(value):
            return
        if isinstance(value, types.ModuleType):
            if not _followed_module(value):
                return
            def get(a):
                return vars(value).get(a, _MISSING)
        else:
            if isinstance(value, type) and (value.__module__ or "").startswith("tk_mlir"):
                return
            def get(a):
                return getattr(value, a, _MISSING) if _has_plain_attr(value, a) else _MISSING
        for attr in names:
            v = get(attr)
            if v is not _MISSING and not inspect.isfunction(v):
                self.attribute(value, attr, v)
                self._attributes_named(v, names, depth + 1)

    def _dict_ref(self, d: dict):
        if d is self._kernel_globals:
            return ["kernel", ""]
        name = d.get("__name__")
        m = sys.modules.get(name) if isinstance(name, str) else None
        return ["mod", name] if m is not None and vars(m) is d else None

    def _obj_ref(self, obj):
        if isinstance(obj, types.ModuleType) and sys.modules.get(obj.__name__) is obj:
            return ["mod", obj.__name__]
        if id(obj) in self._by_value:
            return ["read", self._by_value[id(obj)]]
        if id(obj) in self._constexprs:
            return ["const", self._constexprs[id(obj)]]
        return None

    def _follow(self, fn, depth: int) -> None:
        """A plain function's code: the globals it names, its closure."""
        if id(fn) in self._followed or depth > _FOLLOW_DEPTH or not _followed_function(fn):
            return
        self._followed.add(id(fn))
        self._keep.append(fn)
        g = fn.__globals__
        names = _code_names(fn.__code__)
        for name in names:
            if name in g:
                value = g[name]
                self._add(g, g, name, value, ("dict", self._dict_ref(g)))
                if inspect.isfunction(value):
                    self._follow(value, depth + 1)
                else:
                    self._attributes_named(value, names, depth)
        if fn.__closure__:
            cells, ref = _Cells(fn), self._obj_ref(fn)
            for name in fn.__code__.co_freevars:
                value = cells.get(name, _MISSING)
                self._add(fn.__closure__, cells, name, value,
                          ("cell", ref))
                if inspect.isfunction(value):
                    self._follow(value, depth + 1)


def _label(ref, name: str, value) -> str:
    where = "?" if ref is None else ":".join(map(str, ref[1]))
    sep = ":" if isinstance(value, Func) or inspect.isfunction(value) \
        or inspect.ismodule(value) or not _plain(value) else "="
    return f"{ref[0] if ref else '?'}[{where}].{name}{sep}"


def current() -> Recorder | None:
    """The recorder of the compile under way (None: nothing records)."""
    return _current.get()


@contextlib.contextmanager
def recording(recorder: Recorder):
    token = _current.set(recorder)
    try:
        yield recorder
    finally:
        _current.reset(token)


@functools.lru_cache(maxsize=1024)
def _code_names_cached(code) -> tuple[str, ...]:
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names += _code_names_cached(c)
    return tuple(dict.fromkeys(names))


def _code_names(code) -> tuple[str, ...]:
    return _code_names_cached(code)


@functools.lru_cache(maxsize=512)
def _library_file(path: str) -> bool:
    """Installed packages, the standard library and tk_mlir: not followed."""
    if not path or path.startswith("<"):
        return False
    p = os.path.realpath(path)
    here = os.path.dirname(os.path.realpath(__file__))
    if p.startswith(here + os.sep):
        return True
    if "site-packages" in p.split(os.sep) or "dist-packages" in p.split(os.sep):
        return True
    stdlib = os.path.dirname(os.path.realpath(os.__file__))
    return p.startswith(stdlib + os.sep)


def _followed_module(m) -> bool:
    name = getattr(m, "__name__", "") or ""
    if name.startswith("tk_mlir") or name.partition(".")[0] in sys.stdlib_module_names:
        return False
    f = getattr(m, "__file__", None)
    return f is None and name == "__main__" or (f is not None and not _library_file(f))


def _followed_function(fn) -> bool:
    if (getattr(fn, "__module__", "") or "").startswith("tk_mlir"):
        return False
    return not _library_file(fn.__code__.co_filename)


# ------------------------------------------------------------------ disk

def describe(reads) -> list | None:
    """The reads as plain data (where each scope is, the name), for the disk
    index: a scope is a module's dict (by the module's name, or the kernel's
    own globals), the attributes of a module, a class or an object that an
    earlier read (by its index) or a constexpr gave, or a function's closure; None when one of them cannot be found again in a new process."""
    out = []
    for r in reads:
        if r.ref is None:
            return None
        out.append([r.ref[0], list(r.ref[1]), r.name])
    return out


def resolve(described: list, constexprs: dict, kernel_globals: dict
            ) -> tuple[GlobalRead, ...] | None:
    """The reads `described` (by describe) as found in this process now,
    with today's values; None when a scope cannot be found (a module not
    imported, an earlier read whose value is absent or gone)."""
    reads: list[GlobalRead] = []
    try:
        for kind, (root, where), name in described:
            if root == "mod":
                obj = sys.modules.get(where)
            elif root == "read":
                obj = reads[where].seen() if where < len(reads) and not reads[where].absent \
                    else None
            elif root == "const":
                obj = constexprs.get(where, None)
            elif root == "kernel":
                obj = kernel_globals
            else:
                return None
            if obj is None or obj is _DEAD:
                return None
            if kind == "dict":
                if root == "kernel":
                    scope = obj
                elif isinstance(obj, types.ModuleType):
                    scope = vars(obj)
                else:
                    return None
            elif kind == "attr":
                scope = _Attrs(obj)
            elif kind == "cell" and inspect.isfunction(obj):
                scope = _Cells(obj)
            elif kind == "item":
                scope = _Items(obj)
            else:
                return None
            value = scope.get(name, _MISSING)
            ref = (kind, [root, where])
            reads.append(GlobalRead(scope, name, value, _label(ref, name, value), ref))
    except (TypeError, ValueError):
        return None          # not what describe writes
    return tuple(reads)


# ------------------------------------------------------------------ the guess

@functools.lru_cache(maxsize=256)
def _names_in(source: str) -> tuple[str, ...]:
    """The names the code may read from its module: every name in the
    function's body but its parameters and the names the body assigns."""
    tree = ast.parse(source)
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return tuple(sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}))
    loads, stores = set(), set()
    for stmt in fn.body:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Name):
                (stores if isinstance(n.ctx, (ast.Store, ast.Del)) else loads).add(n.id)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                stores.add(n.name)
    names = loads - stores
    a = fn.args
    names -= {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    names -= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    return tuple(sorted(names))


def global_reads(source: str, scope: dict) -> tuple[GlobalRead, ...]:
    """A guess before compiling, from the names in `source` (a kernel's, whose
    globals are `scope`) and in the tk.funcs it names, recursively: only for
    keys that must exist before any compile (the autotuner's choice). The
    code's own check is what a compile recorded (Recorder)."""
    reads: list[GlobalRead] = []
    _guess(source, scope, "", reads, set())
    return tuple(reads)


def _guess(source: str, scope: dict, prefix: str, reads: list, seen: set) -> None:
    for name in _names_in(source):
        if name not in scope:
            continue
        value = scope[name]
        sep = ":" if isinstance(value, Func) or inspect.isfunction(value) \
            or inspect.ismodule(value) or not _plain(value) else "="
        reads.append(GlobalRead(scope, name, value, f"{prefix}{name}{sep}"))
        if isinstance(value, Func) and id(value) not in seen:
            seen.add(id(value))
            _guess(value.source.text, value.fn.__globals__, f"{prefix}{name}.", reads, seen)


# ------------------------------------------------------------------ values

def _plain(value) -> bool:
    return isinstance(value, (int, float, str, bool, DType, tuple, list, dict)) or value is None


def _function_state(value):
    """What a function (a tk.func's function) holds that may be replaced in
    place: (code, defaults, keyword defaults' items); None for anything else.
    Objects held in defaults are not looked into (a memo dict a helper fills
    would make every check stale)."""
    fn = value.fn if isinstance(value, Func) else value
    if not inspect.isfunction(fn):
        return None
    return fn.__code__, fn.__defaults__, tuple((fn.__kwdefaults__ or {}).items())


def _unchanged_function(seen, value) -> bool:
    """Whether value's code and defaults are the very objects seen (identity
    tests only: a launch makes this check per function read)."""
    fn = value.fn if isinstance(value, Func) else value
    kw = fn.__kwdefaults__
    return fn.__code__ is seen[0] and fn.__defaults__ is seen[1] and (
        not kw and not seen[2] or kw is not None and len(kw) == len(seen[2]) and
        all(kw.get(k, _MISSING) is v for k, v in seen[2]))


def _immutable(value) -> bool:
    if isinstance(value, tuple):
        return all(_immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE) or isinstance(value, Func) or \
        inspect.isfunction(value) or inspect.ismodule(value) or isinstance(value, type) \
        or _is_array(value) or _numpy_scalar(value)


def _is_array(value) -> bool:
    """A tensor or array (torch, numpy, ...) of rank 1 or more: read by what
    compile-time code can use of it (type, shape, dtype, device), never by
    its contents, and checked by identity (a resize_ in place goes unseen).
    A 0-d one (a numpy scalar: `1 / np.sqrt(D)`) is a value, read by repr."""
    try:
        return not isinstance(value, type) and \
            any(hasattr(value, a) for a in ("__array__", "__dlpack__",
                                            "__cuda_array_interface__")) and \
            tuple(value.shape) != ()
    except Exception:       # no shape, or a __getattr__ that raises (an AttrDict)
        return False


def _holds_arrays(value) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return any(_is_array(v) or isinstance(v, (list, dict, tuple)) and _holds_arrays(v)
               for v in items)


def _numpy_scalar(value) -> bool:
    """A numpy scalar (np.float64(0.25), np.int64(4)): immutable, by value."""
    return type(value).__module__ == "numpy" and hasattr(value, "item") and \
        getattr(value, "shape", None) == ()


def _adoptable(value) -> bool:
    """May an equal value with another identity stand in for the one read?
    Plain values, containers of them, arrays (read by type and shape) and
    numpy scalars: yes. A class, function, module or other object: no — what
    was read through it (its attributes, closure cells) was read from the
    old one."""
    return _plain(value) or _is_array(value) or _numpy_scalar(value)


def _text(value) -> str:
    if _is_array(value):
        from .params import describe_value
        return describe_value(value)
    if isinstance(value, Func):        # its defaults too (`s=SCALE` at definition)
        return f"tk.func:{value.source.text}" + function_text(value.fn)
    if inspect.isfunction(value):      # a helper called at compile time: its code counts
        return function_text(value)
    if inspect.ismodule(value):
        return f"module {value.__name__}"
    if isinstance(value, type):        # its attributes read are reads of their own
        return f"class {value.__module__}.{value.__qualname__}"
    if type(value) in (list, tuple):   # elements by their text: a tensor's, not its contents
        inner = ", ".join(_text(v) for v in value)
        return f"[{inner}]" if type(value) is list else f"({inner}{',' if len(value) == 1 else ''})"
    if type(value) is dict:
        return "{" + ", ".join(f"{k!r}: {_text(v)}" for k, v in value.items()) + "}"
    # Anything else by its repr: attributes the kernel may read show up there
    # (namespace(SCALE=2.0)); a repr with an address makes each process miss
    # the disk cache, which is slow but never stale.
    try:
        return repr(value)
    except Exception:          # a user's __repr__ that raises: by identity
        return f"<{type(value).__qualname__} object at {id(value):#x}, no repr>"


def function_text(fn) -> str:
    """A plain function's identity for a key: its source (or code) and its
    defaults (`def f(b=BLOCK)` redefined with a new BLOCK has the same
    source). The globals and closure it reads are reads of their own."""
    try:
        body = inspect.getsource(fn)
    except (OSError, TypeError):
        code = fn.__code__
        body = repr((code.co_code, code.co_consts, code.co_names))
    return f"function {fn.__qualname__}:{body}defaults={fn.__defaults__!r}," \
           f"{fn.__kwdefaults__!r}"
