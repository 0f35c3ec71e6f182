"""A kernel's parameters: the one typed description that binding, the
specialization key, the compiled kernel's ABI and the launch all read.

Two levels:

- `Param` / `KernelParams`: the Python function's parameters as the author
  annotated them: "gl" (tk.gl[dtype, shape] tensors), "pgl" (tk.pgl: a
  tensor on every rank of a group), "i32" (int), "f32" (float), "constexpr"
  (tk.constexpr). `KernelParams.bind` is the one
  binding routine (positional and keyword arguments, defaults, num_warps)
  used by Kernel, Autotuner and the CLI; `KernelParams.key` is the
  specialization: what changes the code.
- `AbiParam`: one parameter of the compiled kernel as lowering emits it
  (lowering/kernel.py): a tensor's data pointer, a dynamic dim, a stride, an
  i32 or f32 scalar, a TMA tensor map. Where each gets its launch value is
  launch code: launcher.launch_value_code.
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

from .dtypes import ARGUMENT_DTYPES, BY_TORCH_NAME, DTYPES
from .errors import ArgumentError, CompilationError, nearest_names
from .language import GlobalAnnotation, PeerAnnotation, constexpr, dtype_name, gl, pgl
from .runtime.peers import read_peers     # (the key reads a tk.pgl argument: tests/test_layers.py)

EMPTY = inspect.Parameter.empty
GL, PGL, I32, F32, CONSTEXPR = "gl", "pgl", "i32", "f32", "constexpr"
_WORDS = {GL: "tensor", PGL: "peer tensor", I32: "int", F32: "float", CONSTEXPR: "constexpr"}
TENSOR_KINDS = (GL, PGL)

DEFAULT_NUM_WARPS = 4
NUM_WARPS_RULE = "must be from 1 to 32 and a power of two or a multiple of 4"


def valid_num_warps(n) -> bool:
    """A power of two, or whole warpgroups (12 = a producer and two consumers)."""
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 32 and \
        (n & (n - 1) == 0 or n % 4 == 0)


# ------------------------------------------------------ the Python level

@dataclass(frozen=True)
class Param:
    name: str
    kind: str                         # GL, PGL, I32, F32, CONSTEXPR
    dtype: str | None = None          # GL, PGL: the annotated dtype, if any
    shape: tuple | None = None        # GL, PGL: annotated static dims (None = dynamic)
    default: Any = EMPTY

    @property
    def runtime(self) -> bool:
        return self.kind != CONSTEXPR

    def describe(self) -> str:
        """For messages: `X (bf16 tensor)`, `eps (float)`, `BM (constexpr)`."""
        return f"{self.name} ({self.dtype + ' ' if self.dtype else ''}{_WORDS[self.kind]})"


class BindError(ArgumentError):
    """Arguments that do not bind to the parameters: `missing` and
    `unexpected` name them (the CLI words them as its options)."""

    def __init__(self, message: str, missing=(), unexpected=()):
        super().__init__(message)
        self.missing, self.unexpected = tuple(missing), tuple(unexpected)


class KernelParams:
    """The parameters of one kernel, in order."""

    def __init__(self, name: str, params: Sequence[Param], num_warps: int = DEFAULT_NUM_WARPS):
        self.name, self.params, self.default_num_warps = name, tuple(params), num_warps
        self.index = {p.name: i for i, p in enumerate(self.params)}
        self.runtime = [i for i, p in enumerate(self.params) if p.runtime]
        self.tensors = [i for i, p in enumerate(self.params) if p.kind == GL]
        self.peer_tensors = [i for i, p in enumerate(self.params) if p.kind == PGL]
        self.constexprs = [i for i, p in enumerate(self.params) if p.kind == CONSTEXPR]
        self.names = [p.name for p in self.params]
        self._defaults = [(p.name, p.default) for p in self.params]

    @classmethod
    def of_function(cls, fn: Callable, node: ast.FunctionDef, filename: str,
                    num_warps: int = DEFAULT_NUM_WARPS) -> KernelParams:
        """Classify `fn`'s parameters by annotation; an error points at the
        offending parameter in `node` (the function's AST, file positions)."""
        where = {a.arg: a for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
        params = []
        for p in inspect.signature(fn).parameters.values():
            arg = where.get(p.name)
            try:
                params.append(_classify(p, fn))
            except CompilationError as e:
                at = (arg.annotation or arg) if arg is not None else node
                raise CompilationError(e.message, filename, at.lineno, at.col_offset) from None
        return cls(fn.__name__, params, num_warps)

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def __getitem__(self, i):
        return self.params[i]

    # ---------------------------------------------------------- binding

    def bind(self, args: tuple, kwargs: dict, *, unbound_ok=frozenset()) -> tuple[list, int]:
        """One value per parameter (defaults filled in) and num_warps.
        Names in `unbound_ok` may stay unbound (EMPTY): tk.autotune's configs
        set them later. (On every autotuned launch: the common cases are
        short.)"""
        num_warps = self.default_num_warps
        n_args = len(args)
        if kwargs:
            if "num_warps" in kwargs:
                kwargs = dict(kwargs)
                num_warps = kwargs.pop("num_warps")
            self._check_keywords(n_args, kwargs)
        elif n_args == len(self.params):
            return list(args), num_warps
        if n_args > len(self.params):
            n = len(self.params)
            raise BindError(f"{self.name}() takes {n} argument{'s' * (n != 1)} "
                            f"({', '.join(self.names)}), got {n_args}")
        values = list(args)
        for name, default in self._defaults[n_args:]:
            v = kwargs.get(name, default) if kwargs else default
            if v is EMPTY and name not in unbound_ok:
                raise self._missing(values, kwargs, unbound_ok)
            values.append(v)
        if num_warps is not self.default_num_warps and not valid_num_warps(num_warps):
            raise ArgumentError(f"num_warps {NUM_WARPS_RULE}, got {num_warps!r}")
        return values, num_warps

    def _missing(self, values, kwargs, unbound_ok) -> BindError:
        missing = [p.name for p in self.params[len(values):]
                   if p.default is EMPTY and p.name not in unbound_ok and
                   p.name not in (kwargs or ())]
        return BindError(f"{self.name}() missing argument{'s' * (len(missing) > 1)} "
                         f"{', '.join(map(repr, missing))}{self._shifted(values)}",
                         missing=missing)

    def _shifted(self, values) -> str:
        """Where a number sits in a tensor's place (or a tensor in a number's):
        a hint that an argument before it was left out."""
        for p, v in zip(self.params, values):
            number = type(v) in (int, float, bool)
            if (p.kind in TENSOR_KINDS) == number and p.kind != CONSTEXPR:
                got = repr(v) if number else "a tensor"
                return (f" ({p.name!r}, a {_WORDS[p.kind]}, got {got}: is an argument "
                        f"before it left out?)")
        return ""

    def _check_keywords(self, n_positional: int, kwargs: dict) -> None:
        unexpected = [k for k in kwargs if k not in self.index]
        if unexpected:
            k = unexpected[0]
            close = nearest_names(k, self.names + ["num_warps"])
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise BindError(f"{self.name}() got an unexpected argument {k!r}{hint}; its "
                            f"parameters are {', '.join(self.names)} and num_warps",
                            unexpected=unexpected)
        for k in kwargs:
            if self.index[k] < n_positional:
                raise BindError(f"{self.name}() got two values for {k!r}")

    # ------------------------------------------------- specialization key

    @staticmethod
    def tensor_rules(sig: tuple) -> dict[int, dict]:
        """check_tensor's rule (dtype, rank, static dims) per tensor parameter's
        position (tk.gl and tk.pgl: every copy obeys it), from a
        specialization key (`key`)."""
        return {i: dict(dtype=s[1], rank=len(s[2]), static_shape=s[2])
                for i, s in enumerate(sig[:-1]) if s[0] in TENSOR_KINDS}

    def key(self, values: list, num_warps: int, read_tensor: Callable) -> tuple:
        """The specialization of bound `values`: per parameter ("gl", dtype,
        static dims), ("i32",), ("f32",) or ("constexpr", value, type name),
        then num_warps. `read_tensor(value, name)` reads a tensor argument
        (describe, or tensor_info at launch)."""
        sig = []
        for p, v in zip(self.params, values):
            if p.kind == PGL:
                peers = read_peers(v, p.name, read_tensor)
                sig.append(self._tensor_key(p, peers.local) + (peers.world_size,))
            elif p.kind == GL:
                sig.append(self._tensor_key(p, read_tensor(v, p.name)))
            elif p.kind == I32:
                if not isinstance(v, int) or isinstance(v, bool) or _array(v):
                    raise ArgumentError(f"argument '{p.name}' must be an int, got "
                                        f"{describe_value(v)}{_scalar_hint(v)}")
                sig.append((I32,))
            elif p.kind == F32:
                if not isinstance(v, (int, float)) or isinstance(v, bool) or _array(v):
                    raise ArgumentError(f"argument '{p.name}' must be a float, got "
                                        f"{describe_value(v)}{_scalar_hint(v)}")
                sig.append((F32,))
            else:
                if _array(v):
                    raise ArgumentError(f"constexpr '{p.name}' = {describe_value(v)} must be "
                                        f"a Python value (an int, float, bool, str, tuple or "
                                        f"tk dtype): convert numpy and torch scalars with "
                                        f"int(x) or float(x)")
                if not hashable(v):
                    raise ArgumentError(f"constexpr '{p.name}' = {describe_value(v)} must be "
                                        f"hashable (an int, float, bool, str, tuple or tk "
                                        f"dtype)")
                # The types are part of the key: True, 1 and 1.0 compile
                # differently, and so do (1,) and (True,), 0.0 and -0.0.
                sig.append((CONSTEXPR, v, constexpr_tag(v)))
        return tuple(sig) + (num_warps,)

    @staticmethod
    def _tensor_key(p: Param, t) -> tuple:
        """(kind, dtype, static dims) of tensor argument `t` for parameter `p`."""
        if p.dtype is None and t.dtype not in ARGUMENT_DTYPES:   # bare tk.gl: any dtype
            raise ArgumentError(f"the dtype of argument '{p.name}' ({t.dtype}) is not an "
                                f"element type tk_mlir kernels take; the supported dtypes are "
                                f"{', '.join(ARGUMENT_DTYPES)}")
        static = p.shape if p.shape is not None else (None,) * len(t.shape)
        if len(static) != len(t.shape):
            raise ArgumentError(f"argument '{p.name}' has rank {len(t.shape)}, the "
                                f"annotation wants rank {len(static)}")
        return (p.kind, p.dtype or t.dtype, tuple(static))

    # ------------------------------------------------ the compiled kernel's

    def abi_arguments(self, values: list, infos: dict) -> tuple[list, dict, list[str]]:
        """The compiled kernel's arguments for bound `values` (`infos`: what
        was read of each tensor argument, by name): the runtime values, the
        TensorInfo of those that are tensors (by position) and a name for
        each. A tk.pgl argument X is several (expand_peers): X, X[0] ..
        X[W-1], X.rank."""
        runtime, tensors, names = [], {}, []
        for i in self.runtime:
            p, v = self.params[i], values[i]
            if p.kind == PGL:
                for name, kind, piece in peer_pieces(p.name, infos[p.name]):
                    if kind == GL:
                        tensors[len(runtime)] = piece
                    runtime.append(v if kind == GL else piece)
                    names.append(name)
                continue
            if p.kind == GL:
                tensors[len(runtime)] = infos[p.name]
            runtime.append(v)
            names.append(p.name)
        return runtime, tensors, names


def expand_peers(name: str, world_size: int) -> list[tuple[str, str]]:
    """The kernel arguments one tk.pgl parameter `name` becomes, as (name,
    kind): its local copy, each rank's copy, its rank."""
    return [(name, GL), *((f"{name}[{r}]", GL) for r in range(world_size)),
            (f"{name}.rank", I32)]


def peer_pieces(name: str, peers) -> list[tuple[str, str, Any]]:
    """The kernel arguments a read tk.pgl argument (runtime/peers.py PeerInfo)
    becomes, as (name, kind, value): each copy's TensorInfo, then the rank."""
    *copies, (rank_name, _) = expand_peers(name, peers.world_size)
    return [*((n, kind, info) for (n, kind), info in
              zip(copies, (peers.local, *peers.peers), strict=True)),
            (rank_name, I32, peers.rank)]


def constexpr_tag(v):
    """What tells apart constexpr values that compare equal but compile
    differently: the type, through tuples and lists, and a float's sign
    (0.0 == -0.0)."""
    t = type(v)
    if t is tuple or t is list or t is frozenset:
        return (t.__name__, tuple(constexpr_tag(x) for x in v))
    if t is float:
        return repr(v)
    return t.__name__


def _classify(p: inspect.Parameter, fn) -> Param:
    ann = p.annotation
    if isinstance(ann, str):                 # `from __future__ import annotations`
        try:
            ann = eval(ann, fn.__globals__)  # noqa: S307 (the author's own annotation)
        except Exception as e:
            raise CompilationError(f"kernel parameter '{p.name}': its annotation {ann!r} "
                                   f"does not evaluate ({type(e).__name__}: {e})") from None
    if ann is gl:                            # bare tk.gl: any dtype, any shape
        ann = GlobalAnnotation()
    if ann is pgl:
        ann = PeerAnnotation()
    if isinstance(ann, GlobalAnnotation):
        dtype = None
        if ann.dtype is not None:
            try:
                dtype = dtype_name(ann.dtype)
            except CompilationError as e:
                raise CompilationError(f"kernel parameter '{p.name}': {e.message}") from None
        kind = PGL if isinstance(ann, PeerAnnotation) else GL
        return Param(p.name, kind, dtype, ann.shape, p.default)
    kind = {constexpr: CONSTEXPR, int: I32, float: F32}.get(ann) if hashable(ann) else None
    if kind is None:
        got = "" if ann is EMPTY else f", got {ann!r}"
        raise CompilationError(f"kernel parameter '{p.name}' needs an annotation: tk.gl[dtype] "
                               f"for a tensor, int or float for a scalar, tk.constexpr for a "
                               f"compile-time constant{got}")
    return Param(p.name, kind, default=p.default)


def hashable(x) -> bool:
    try:
        hash(x)
        return True
    except TypeError:
        return False


def describe_value(v) -> str:
    """A value for an error message, never a tensor's whole contents:
    "a torch.Tensor of shape (4096, 4096) bf16 on cuda:0"."""
    shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
    if shape is not None and dtype is not None:
        kind = f"{type(v).__module__.split('.')[0]}.{type(v).__name__}"
        device = getattr(v, "device", None)
        return (f"a {kind} of shape {tuple(shape)} {_dtype_word(dtype)}"
                f"{f' on {device}' if device is not None else ''}")
    text = repr(v)
    return text if len(text) <= 80 else f"{text[:60]}... ({type(v).__name__})"


PYTHON_NUMBER = " (a Python number: convert numpy and torch scalars with int(x) or float(x))"


def _array(v) -> bool:
    """A tensor, an array or a numpy scalar (anything with a shape and a
    dtype; np.float64 is also a float)."""
    return hasattr(v, "shape") and hasattr(v, "dtype")


def _scalar_hint(v) -> str:
    """A hint where a scalar parameter was given a type (`compile(..., int)`:
    a kernel specializes on tensors' specs, and takes a sample value for a
    scalar) or a numpy or torch scalar (Python numbers only)."""
    if v in (int, float):
        return (f" (the type itself: a scalar parameter takes a value, also in compile(); "
                f"any {v.__name__} will do, e.g. {v(1)!r})")
    if getattr(v, "shape", None) == ():          # a numpy or 0-d torch scalar
        return PYTHON_NUMBER
    return ""


def _dtype_word(dtype):
    """A tensor's dtype by its tk name where dtypes.DTYPES has it (numpy's
    and tk's dtypes carry a `.name`; torch's print as `torch.<name>`), else
    as it prints itself."""
    name = getattr(dtype, "name", None)
    name = (name if isinstance(name, str) else str(dtype)).removeprefix("torch.")
    return name if name in DTYPES else BY_TORCH_NAME.get(name, dtype)


# ---------------------------------------------------------- the ABI level

class AbiParam(NamedTuple):
    """One parameter of the compiled kernel, and which argument it comes from."""
    arg: int            # index among the kernel's runtime parameters
    kind: str           # "ptr", "dim", "stride", "i32", "f32", "tmap"
    index: int = 0      # the dim for "dim" / "stride"; the tensor map's index for "tmap"

    @property
    def passed_as(self) -> str:
        """The C type the driver receives: "ptr", "i32", "i64", "f32", "tmap"."""
        return PASSED_AS[self.kind]


# How each kind of ABI parameter is passed to the driver.
PASSED_AS = {"ptr": "ptr", "dim": "i32", "stride": "i64", "i32": "i32", "f32": "f32",
             "tmap": "tmap"}

