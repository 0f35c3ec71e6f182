"""What a kernel author writes: dtypes, annotations and the tk.* builtins.

The builtins are ordinary Python functions that emit tk ops at the current
MLIR insertion point; the frontend calls them while it walks the kernel's
AST. Called outside a kernel, they say so instead of failing obscurely.
"""
from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass

from .dialects import types as T
from .dtypes import MEMORY_DTYPES
from .errors import CompilationError

# Set by the frontend while it builds a kernel; builtins refuse to run without it.
_building: contextvars.ContextVar[bool] = contextvars.ContextVar("tk_building", default=False)


def builtin(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _building.get():
            raise RuntimeError(f"tk.{fn.__name__} can only be used inside a @tk.kernel function")
        return fn(*args, **kwargs)
    wrapper.__tk_builtin__ = True
    return wrapper


def compile_time_int(value, what: str, lo: int, hi: int, hi_text: str | None = None) -> int:
    """`value` when it is a compile-time int from lo to hi, else an error
    naming the argument and the range (the builtins' one check of this kind)."""
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CompilationError(f"{what} must be a compile-time int from {lo} to "
                               f"{hi_text or hi}, got {value!r}")
    return value


# ------------------------------------------------------------------ dtypes

@dataclass(frozen=True)
class DType:
    name: str

    def __repr__(self):
        return f"tk.{self.name}"


# tk.bf16 ...: the dtypes memory holds (tk_mlir/dtypes.py).
DTYPE_OBJECTS = {name: DType(name) for name in MEMORY_DTYPES}
bf16, f16, f32, f8e4m3, f8e5m2 = (DTYPE_OBJECTS[n] for n in ("bf16", "f16", "f32", "f8e4m3",
                                                             "f8e5m2"))
# tk.i32: index and mask tiles in registers, and the counters, flags and
# scalars an i32 tensor argument holds
i32 = DType("i32")


def dtype_name(d) -> str:
    if isinstance(d, DType):
        return d.name
    if isinstance(d, str) and d in T.TILE_DTYPES:
        return d
    raise CompilationError(f"expected a tk dtype (tk.bf16, tk.f16, tk.f32, ...), got {d!r}")


# ------------------------------------------------------------- annotations

class constexpr:
    """Annotation: this parameter is a compile-time constant; each value compiles anew."""


@dataclass(frozen=True)
class GlobalAnnotation:
    dtype: DType | None = None
    shape: tuple[int | None, ...] | None = None   # None entries: dynamic


class _GlFactory:
    """`tk.gl[bf16]`, `tk.gl[bf16, (None, 4096)]`: a global tensor argument."""

    def __getitem__(self, item) -> GlobalAnnotation:
        if not isinstance(item, tuple):
            return GlobalAnnotation(item)
        dtype, shape = item
        if not isinstance(shape, tuple) or not 1 <= len(shape) <= T.MAX_GL_RANK:
            raise TypeError(f"tk.gl shape must be a tuple of 1 to {T.MAX_GL_RANK} dims "
                            f"(int or None), got {shape!r}")
        return GlobalAnnotation(dtype, shape)


gl = _GlFactory()


@dataclass(frozen=True)
class PeerAnnotation(GlobalAnnotation):
    """tk.pgl[...]: a tensor on every rank of a process group (tk.PeerTensor)."""


class _PglFactory:
    """`tk.pgl[bf16, (None, 8192)]`: a peer tensor argument (ThunderKittens'
    pgl). In the kernel `X` is this rank's copy, `X[r]` rank r's (r from 0 to
    X.world_size - 1, a compile-time or run-time int), `X.rank` this rank."""

    def __getitem__(self, item) -> PeerAnnotation:
        g = gl[item]
        return PeerAnnotation(g.dtype, g.shape)


pgl = _PglFactory()


# ------------------------------------------------------------- tk.func

class Func:
    """`@tk.func`: a helper written like a kernel body, inlined where a kernel
    (or another tk.func) calls it. Its `for`/`if` on run-time values become
    scf ops like the kernel's own, its errors point at its own lines, and it
    may end with `return value` (a tile, a scalar, a tuple of them)."""

    def __init__(self, fn):
        from .source import KernelSource
        self.fn = fn
        self._source = KernelSource.of(fn, "@tk.func")  # (refuses what is not a def first)
        self._code = fn.__code__
        functools.update_wrapper(self, fn)

    @property
    def source(self):
        """The function's source as the frontend reads it; read again when its
        code was replaced in place (IPython's autoreload)."""
        if self._code is not self.fn.__code__:
            from .source import KernelSource
            self._source, self._code = KernelSource.of(self.fn, "@tk.func"), self.fn.__code__
        return self._source

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"tk.func {self.fn.__name__} can only be called inside a @tk.kernel "
                           f"function (it is inlined there)")

    def __repr__(self):
        return f"<tk.func {self.fn.__name__}>"

    def __get__(self, obj, objtype=None):
        """A tk.func defined in a class is a method: `ring.wait(i)` inlines
        `wait(ring, i)` (the object is a compile-time value, e.g. a tk.Ring)."""
        return self if obj is None else BoundFunc(self, obj)


@dataclass(frozen=True)
class BoundFunc:
    """A tk.func method bound to its object (see Func.__get__)."""
    func: Func
    obj: object

    def __call__(self, *args, **kwargs):
        self.func(*args, **kwargs)      # says where it can be called


def func(fn) -> Func:
    return Func(fn)


def static_range(*args):
    """`for i in tk.static_range(n)`: a loop unrolled at compile time."""
    return range(*args)
