"""`@tk.kernel`: a Python function that compiles, caches and launches.

    @tk.kernel
    def scale(X: tk.gl[tk.bf16], Y: tk.gl[tk.bf16], s: float, BM: tk.constexpr = 64): ...

    scale[grid](x, y, 2.0, BM=64)          # launch on torch's current stream
    scale.compile(tk.spec((M, N), tk.bf16), ..., BM=64).asm   # IR at every stage

Parameters annotated `tk.gl[...]` take tensors, `int`/`float` take Python
scalars (i32/f32 in the kernel), `tk.constexpr` take compile-time values
that specialize the code. A specialization is compiled once per process
(in-memory cache, lock + recheck) and once per machine (disk cache).
"""
from __future__ import annotations

import ast
import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable

from . import launcher
from .cache import always_compile
from .compiler import CompiledKernel, Specialization, compile_cached
from .errors import CompilationError
from .global_reads import GlobalRead, all_fresh, global_reads, key_text
from .source import KernelSource
from .language import DType, Func, GlobalAnnotation, constexpr, dtype_name, gl
from .runtime.arguments import ArgumentError, check_tensor, describe, tensor_info

DEFAULT_NUM_WARPS = 4
_NUM_WARPS_RULE = "must be from 1 to 32 and a power of two or a multiple of 4"
_MAX_PLANS = 8     # launch plans kept per kernel (one per argument signature seen)


@dataclass(frozen=True)
class _Param:
    name: str
    kind: str                         # "gl", "int", "float", "constexpr"
    dtype: str | None = None          # gl: the annotated dtype, if any
    shape: tuple | None = None        # gl: annotated static dims (None = dynamic)
    default: Any = inspect.Parameter.empty


def _classify(p: inspect.Parameter) -> _Param:
    ann = p.annotation
    if ann is gl:                          # bare tk.gl: any dtype, any shape
        ann = GlobalAnnotation()
    if isinstance(ann, GlobalAnnotation):
        return _Param(p.name, "gl", dtype_name(ann.dtype) if ann.dtype is not None else None,
                      ann.shape, p.default)
    if ann is constexpr:
        return _Param(p.name, "constexpr", default=p.default)
    if ann is int:
        return _Param(p.name, "int", default=p.default)
    if ann is float:
        return _Param(p.name, "float", default=p.default)
    raise CompilationError(f"kernel parameter '{p.name}' needs an annotation: tk.gl[dtype] for "
                           f"a tensor, int or float for a scalar, tk.constexpr for a "
                           f"compile-time constant")


class Kernel:
    def __init__(self, fn: Callable, num_warps: int = DEFAULT_NUM_WARPS):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._source = KernelSource.of(fn)
        self.source, self.filename = self._source.text, self._source.filename
        self.default_num_warps = num_warps
        if not _valid_num_warps(num_warps):
            raise CompilationError(f"num_warps {_NUM_WARPS_RULE}, got "
                                   f"{num_warps!r}", self.filename, self._source.first_line,
                                   self._source.indent)
        try:
            self.params = [_classify(p) for p in
                           inspect.signature(fn, eval_str=True).parameters.values()]
        except CompilationError as e:
            raise CompilationError(e.message, self.filename, self._source.first_line,
                                   self._source.indent) from None
        self.runtime = [i for i, p in enumerate(self.params) if p.kind != "constexpr"]
        # signature -> (the globals its code read, the code)
        self._compiled: dict[tuple, tuple[tuple[GlobalRead, ...], CompiledKernel]] = {}
        self._plans: list[Callable] = []
        self._constexpr_names = {p.name for p in self.params if p.kind == "constexpr"} | \
            {"num_warps"}
        self._lock = threading.Lock()

    def __repr__(self):
        return f"<tk.kernel {self.__name__}>"

    def __call__(self, *args, **kwargs):
        raise TypeError(f"launch a kernel with a grid: {self.__name__}[grid](...)")

    def __getitem__(self, grid) -> Callable:
        return functools.partial(self.launch, grid)

    # ------------------------------------------------------------ binding

    def _bind(self, args, kwargs) -> tuple[list, int]:
        num_warps = kwargs.pop("num_warps", self.default_num_warps)
        if len(args) > len(self.params):
            raise TypeError(f"{self.__name__}() takes {len(self.params)} arguments, "
                            f"got {len(args)}")
        values = list(args) + [inspect.Parameter.empty] * (len(self.params) - len(args))
        for i, p in enumerate(self.params):
            if p.name in kwargs:
                if i < len(args):
                    raise TypeError(f"{self.__name__}() got two values for '{p.name}'")
                values[i] = kwargs.pop(p.name)
            elif values[i] is inspect.Parameter.empty:
                if p.default is inspect.Parameter.empty:
                    raise TypeError(f"{self.__name__}() missing argument '{p.name}'")
                values[i] = p.default
        if kwargs:
            raise TypeError(f"{self.__name__}() got unexpected arguments {sorted(kwargs)}")
        if not _valid_num_warps(num_warps):
            raise ArgumentError(f"num_warps {_NUM_WARPS_RULE}, got {num_warps!r}")
        return values, num_warps

    def _signature(self, values, num_warps, describe_tensor) -> tuple:
        """The specialization: per runtime argument its kind/dtype/rank, the constexprs."""
        sig = []
        for p, v in zip(self.params, values):
            if p.kind == "gl":
                t = describe_tensor(v, p.name)
                static = p.shape if p.shape is not None else (None,) * len(t.shape)
                if len(static) != len(t.shape):
                    raise ArgumentError(f"argument '{p.name}' has rank {len(t.shape)}, the "
                                        f"annotation wants rank {len(static)}")
                sig.append(("gl", p.dtype or t.dtype, tuple(static)))
            elif p.kind == "int":
                if not isinstance(v, int) or isinstance(v, bool):
                    raise ArgumentError(f"argument '{p.name}' must be an int, got {v!r}")
                sig.append(("i32",))
            elif p.kind == "float":
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise ArgumentError(f"argument '{p.name}' must be a float, got {v!r}")
                sig.append(("f32",))
            else:
                try:
                    hash(v)
                except TypeError:
                    raise ArgumentError(f"constexpr '{p.name}' = {v!r} must be hashable (an int, "
                                        f"float, bool, str, tuple or tk dtype)") from None
                # The type is part of the key: True, 1 and 1.0 compile differently.
                sig.append(("constexpr", v, type(v).__name__))
        return tuple(sig) + (num_warps,)

    # ------------------------------------------------------------ compile

    def compile(self, *args, **kwargs) -> CompiledKernel:
        """Compile for argument descriptions (tk.spec, torch meta tensors, numpy
        arrays, or real tensors) without launching; works without a GPU."""
        try:
            values, num_warps = self._bind(args, kwargs)
            sig = self._signature(values, num_warps, describe)
            for p, v, s in zip(self.params, values, sig):
                if s[0] == "gl":   # the dtype and static dims hold for descriptions too
                    check_tensor(describe(v, p.name), p.name, dtype=s[1], rank=len(s[2]),
                                 static_shape=s[2])
            return self._get(sig)
        except (CompilationError, ArgumentError) as e:
            raise e.with_traceback(None) from None   # the user's frame, not ours

    def _get(self, sig: tuple) -> CompiledKernel:
        return self._entry(sig)[1]

    def _entry(self, sig: tuple) -> tuple[tuple[GlobalRead, ...], CompiledKernel]:
        """The code for `sig` and the globals it read; recompiled when one of
        those has changed since (never the old code for a new global)."""
        if always_compile():
            reads = self._global_reads()
            return reads, self._compile(sig, reads)
        entry = self._compiled.get(sig)
        if entry is None or not all_fresh(entry[0]):
            with self._lock:
                entry = self._compiled.get(sig)
                if entry is None or not all_fresh(entry[0]):
                    reads = self._global_reads()
                    entry = self._compiled[sig] = (reads, self._compile(sig, reads))
        return entry

    def _compile(self, sig: tuple, reads: tuple[GlobalRead, ...]) -> CompiledKernel:
        *per_param, num_warps = sig
        rt_args, names, consts = [], [], []
        for p, s in zip(self.params, per_param):
            if s[0] == "constexpr":
                consts.append((p.name, s[1]))
            else:
                rt_args.append(s)
                names.append(p.name)
        spec = Specialization(self.__name__, self.source, self.filename, tuple(rt_args),
                              tuple(names), tuple(consts), num_warps, key_text(reads),
                              self._source.first_line)
        try:
            return compile_cached(spec, self._ast, self.fn.__globals__)
        except CompilationError as e:
            raise CompilationError(e.message, e.filename, e.line, e.col) from None

    def _ast(self) -> ast.FunctionDef:
        return self._source.function_ast()

    def _global_reads(self) -> tuple[GlobalRead, ...]:
        """The module-level values the kernel reads (they change the code),
        and those of the tk.funcs it inlines, recursively."""
        return global_reads(self.source, self.fn.__globals__)

    def _globals_key(self) -> str:
        return key_text(self._global_reads())

    # ------------------------------------------------------------- launch

    def launch(self, grid, *args, **kwargs) -> None:
        try:
            for plan in self._plans:        # most recent first; usually the first fits
                if plan(grid, args, kwargs):
                    return
            plan = self._plan(args, kwargs)
            if plan is None:                # not all torch tensors: the general path
                self.launch_general(grid, args, kwargs)
                return
            self._plans.insert(0, plan)
            del self._plans[_MAX_PLANS:]
            plan(grid, args, kwargs)
        except (CompilationError, ArgumentError) as e:
            raise e.with_traceback(None) from None   # the user's frame, not ours

    def _plan(self, args, kwargs) -> Callable | None:
        """Compile for these arguments, check them, and make the launch plan for
        arguments of the same kinds (see launcher.py); None when some tensor
        argument is not a torch tensor."""
        from .runtime import driver
        values, num_warps = self._bind(args, dict(kwargs))
        tensors = launcher.torch_tensor_types()
        gl = [i for i, p in enumerate(self.params) if p.kind == "gl"]
        if not tensors or any(type(values[i]) not in tensors for i in gl) \
                or not self._constexpr_names.issuperset(kwargs):
            return None
        compiled, rules, _, reads = self._checked(values, num_warps)
        params = [(self.runtime[arg], kind, dim) for arg, kind, dim in compiled.params]
        kinds = tuple(launcher.PASSED_AS[k] for _, k, _ in params)
        device = driver.default_device()
        launch = driver.PackedLauncher(compiled.function(device), kinds).bind(
            compiled.num_threads, compiled.smem_bytes)
        constexprs = [i for i, p in enumerate(self.params) if p.kind == "constexpr"]
        return launcher.torch_plan([p.name for p in self.params], values, len(args), kwargs,
                                   constexprs, rules, params, launch, driver.current_stream,
                                   device, compiled.tensor_maps, compiled.cluster, reads)

    def _checked(self, values, num_warps) -> tuple[CompiledKernel, dict, dict, tuple]:
        """The compiled kernel for these argument values after checking them,
        the check for each tensor argument, what was read of each tensor, and
        the globals the code read."""
        from .runtime import driver
        infos = {}
        def read(v, name):
            infos[name] = tensor_info(v, name)
            return infos[name]
        sig = self._signature(values, num_warps, read)
        reads, compiled = self._entry(sig)
        rules = {i: dict(dtype=s[1], rank=len(s[2]), static_shape=s[2])
                 for i, s in enumerate(sig[:-1]) if s[0] == "gl"}
        device = driver.default_device()
        tensors = {i: infos[self.params[i].name] for i in rules}
        for i, rule in rules.items():
            check_tensor(tensors[i], self.params[i].name, **rule)
            launcher.check_device(tensors[i], self.params[i].name, device)
        return compiled, rules, tensors, reads

    def launch_general(self, grid, args, kwargs) -> None:
        """Any tensor-like arguments: read, check and launch, every call."""
        from .runtime import driver
        values, num_warps = self._bind(args, dict(kwargs))
        compiled, _, infos, _ = self._checked(values, num_warps)
        out, kinds = [], []
        for arg, kind, dim in compiled.params:
            pos = self.runtime[arg]
            if kind == "ptr":
                out.append(infos[pos].ptr)
            elif kind == "dim":
                out.append(infos[pos].shape[dim])
            elif kind == "stride":
                out.append(infos[pos].strides[dim])
            elif kind == "tmap":
                _, rows, cols, swizzle, _ = compiled.tensor_maps[dim]
                out.append(launcher.tensor_map_arg(infos[pos], (rows, cols, swizzle),
                                                   self.params[pos].name))
            else:
                launcher.check_scalar(self.params[pos].name, kind, values[pos])
                out.append(values[pos])
            kinds.append(driver.ctypes_type(launcher.PASSED_AS[kind]))
        g = launcher.normalize_grid(grid, {p.name: v for p, v in zip(self.params, values)},
                                    compiled.cluster)
        compiled.function(driver.default_device()).launch(
            g, (compiled.num_threads, 1, 1), compiled.smem_bytes, driver.current_stream(),
            tuple(out), tuple(kinds))


def _valid_num_warps(n) -> bool:
    """A power of two, or whole warpgroups (12 = a producer and two consumers)."""
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 32 and \
        (n & (n - 1) == 0 or n % 4 == 0)


def kernel(fn: Callable | None = None, *, num_warps: int = DEFAULT_NUM_WARPS):
    """Decorator: `@tk.kernel` or `@tk.kernel(num_warps=8)`."""
    if fn is None:
        return lambda f: Kernel(f, num_warps)
    return Kernel(fn, num_warps)
