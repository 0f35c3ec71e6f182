"""Values of a kernel under construction and the operators on them.

The frontend evaluates the kernel's expressions to Python constants (the
constexpr world, folded at compile time) or to the wrappers below, which
hold an SSA value and emit ops when combined. Every op is built at the
current insertion point and location, which the frontend sets to the user's
line before evaluating an expression.
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass

from mlir import ir
from mlir.dialects import arith

from .dialects import layout as layouts, tk, types as T
from .dialects.tile_rules import check_op
from .errors import CompilationError
from .language import dtype_name


@dataclass
class KernelState:
    num_warps: int
    cluster: int = 1          # blocks per cluster (tk.use_cluster)
    unrolled: int = 0         # loop bodies unrolled so far (frontend.MAX_UNROLLED)


# The kernel being built (its launch shape decides block-scope layouts).
current: contextvars.ContextVar[KernelState] = contextvars.ContextVar("tk_kernel")


def i32() -> ir.Type:
    return ir.IntegerType.get_signless(32)


def builds(*names: str):
    """Mark a builtin (or a method of a value class) with the tk ops it builds:
    tests/test_registry.py finds every op's builtin by this mark."""
    def mark(fn):
        fn.tk_ops = names
        return fn
    return mark


def emit(name: str, operands=(), result_type=None, **attrs):
    """Build tk.<name>, check it against its tile rule (dialects/tile_rules.py:
    the rule tk-verify applies too, here at the line that built it), return
    its result."""
    op = tk.build(name, [as_ir(o) for o in operands],
                  [] if result_type is None else [result_type], **attrs)
    check_op(op, current.get().num_warps)
    return op.result if result_type is not None else None


def as_ir(v) -> ir.Value:
    return v.value if isinstance(v, Value) else v


class Value:
    """An SSA value with its type."""
    param: str | None = None    # the kernel parameter it is, if one (for error hints)

    def __init__(self, value: ir.Value):
        self.value = value

    @property
    def ir_type(self) -> ir.Type:
        return self.value.type

    def __repr__(self):
        tk_type = T.parse(self.value.type)
        return f"<{type(self).__name__}: {T.show(tk_type) if tk_type else self.value.type}>"

    def __bool__(self):
        raise CompilationError(
            "a run-time value has no Python truth value here; use it in an `if` "
            "statement (it becomes scf.if) or compare it explicitly")


def wrap(v: ir.Value) -> Value:
    """The wrapper class for an SSA value, by its type."""
    t = T.parse(v.type)
    cls = {T.RT: Tile, T.RV: Vector, T.GL: Global, T.ST: Shared, T.SV: SharedVector,
           T.Sem: Semaphore, T.TT: TensorTile}.get(type(t), Scalar)
    return cls(v)


# ---------------------------------------------------------------- scalars

class Scalar(Value):
    @property
    def kind(self) -> str:
        t = self.value.type
        if isinstance(t, ir.IntegerType):
            return "bool" if ir.IntegerType(t).width == 1 else "int"
        return "float"


def constant(x) -> Scalar:
    if isinstance(x, bool):
        return Scalar(arith.constant(ir.IntegerType.get_signless(1), int(x)))
    if isinstance(x, int):
        if not -2**31 <= x < 2**31:
            raise CompilationError(f"integer {x} does not fit in i32")
        return Scalar(arith.constant(i32(), x))
    if isinstance(x, float):
        return Scalar(arith.constant(ir.F32Type.get(), x))
    raise CompilationError(f"cannot use {x!r} ({type(x).__name__}) as a kernel value")


# A tile dimension is at most this many elements: beyond any tile that fits in
# registers or shared memory, and small enough that sizes computed from it
# (bytes, registers) stay far inside the i64 attributes MLIR holds them in.
MAX_TILE_DIM = 1 << 16


def constexpr_hint(*values) -> str:
    """What to do when a run-time value is among `values` where a compile-time
    one is needed: "; declare `BM: tk.constexpr`" for a kernel's int
    parameter (its value is then known when compiling), "" when none is."""
    flat = [x for v in values for x in (v if isinstance(v, (tuple, list)) else (v,))]
    for v in flat:
        if isinstance(v, Scalar) and v.param is not None:
            return (f"; {v.param} is an {v.kind} parameter, known only at run time: declare "
                    f"it `{v.param}: tk.constexpr` to use its value when compiling")
    if any(isinstance(v, Scalar) for v in flat):
        return ("; it is a run-time value: compute it from tk.constexpr parameters (or "
                "constants) instead")
    return ""


def tile_shape(shape, what: str, ranks: tuple[int, ...] = (1, 2)) -> tuple[int, ...]:
    """`shape` when it is a tile's shape ((rows, cols) or (length,), as
    `ranks` allow) of compile-time ints from 1 to MAX_TILE_DIM; else an error
    naming `what` (the builtin or argument), the rule and the fix."""
    form = " or ".join({1: "(length,)", 2: "(rows, cols)"}[r] for r in sorted(ranks, reverse=True))
    if not isinstance(shape, (tuple, list)) or len(shape) not in ranks:
        raise CompilationError(f"{what}: a shape is {form}, got {shape!r}")
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int):
            kind = "a bool" if isinstance(d, bool) else "a run-time value" \
                if isinstance(d, Value) else f"{type(d).__name__} {d!r}"
            raise CompilationError(f"{what}: a tile's shape is {form} of positive compile-time "
                                   f"ints, got {tuple(shape)!r} (with {kind})"
                                   f"{constexpr_hint(d)}")
        if not 1 <= d <= MAX_TILE_DIM:
            raise CompilationError(f"{what}: a tile's shape is {form} of positive compile-time "
                                   f"ints up to {MAX_TILE_DIM} (MAX_TILE_DIM), got "
                                   f"{tuple(shape)!r}")
    return tuple(shape)


def as_scalar(x) -> Scalar:
    return x if isinstance(x, Scalar) else constant(x)


def int_operand(x, least: int, rule: str) -> Scalar:
    """x as an int Scalar: a compile-time int >= least, or a run-time int
    (checked where it is used); else a CompilationError saying `rule`."""
    if isinstance(x, bool) or (isinstance(x, int) and x < least):
        raise CompilationError(f"{rule}, got {x!r}")
    if isinstance(x, (int, Scalar)):
        s = as_scalar(x)
        if s.kind == "int":
            return s
    raise CompilationError(f"{rule}, got {x!r}")


def to_float(s: Scalar) -> Scalar:
    if s.kind == "float":
        return s
    if s.kind == "bool":   # sitofp would make True -1.0
        return Scalar(arith.uitofp(ir.F32Type.get(), s.value))
    return Scalar(arith.sitofp(ir.F32Type.get(), s.value))


def to_int(s: Scalar) -> Scalar:
    return Scalar(arith.extui(i32(), s.value)) if s.kind == "bool" else s


def _python_mod(a: ir.Value, b: ir.Value) -> ir.Value:
    """a % b with the sign of b, as Python computes it (arith.remsi has C's)."""
    r = arith.remsi(a, b)
    zero = arith.constant(i32(), 0)
    fix = arith.andi(arith.cmpi(arith.CmpIPredicate.ne, r, zero),
                     arith.cmpi(arith.CmpIPredicate.ne,
                                arith.cmpi(arith.CmpIPredicate.slt, r, zero),
                                arith.cmpi(arith.CmpIPredicate.slt, b, zero)))
    # (r + b only where it is taken: an unused sum may leave 32 bits)
    return arith.addi(r, arith.select(fix, b, zero))


_INT_OPS = {"add": arith.addi, "sub": arith.subi, "mul": arith.muli, "floordiv": arith.floordivsi, "max": arith.maxsi, "min": arith.minsi,
            "and": arith.andi, "or": arith.ori, "xor": arith.xori,
            "lshift": arith.shli, "rshift": arith.shrsi}
_FLOAT_OPS = {"add": arith.addf, "sub": arith.subf, "mul": arith.mulf, "div": arith.divf,
              "max": arith.maximumf, "min": arith.minimumf}
_CMP_INT = {name: i for name, (i, _) in tk.COMPARISONS.items()}
_CMP_FLOAT = {name: f for name, (_, f) in tk.COMPARISONS.items()}


def _power_of_two(x) -> int | None:
    """log2(x) for a compile-time int x that is a positive power of two, else None."""
    if type(x) is int and x > 0 and not x & (x - 1):
        return x.bit_length() - 1
    return None


def scalar_binary(op: str, a, b) -> Scalar:
    if op in ("floordiv", "mod") and (shift := _power_of_two(b)) is not None \
            and as_scalar(a).kind == "int":
        # By 2**k, Python's floor division is an arithmetic shift and its
        # modulo the low k bits, whatever a's sign (two's complement): one
        # instruction where floordivsi and _python_mod make several (a ring's
        # slot and phase, it % stages and it // stages, in every step).
        a = as_scalar(a).value
        if op == "floordiv":
            return Scalar(arith.shrsi(a, arith.constant(a.type, shift)))
        return Scalar(arith.andi(a, arith.constant(a.type, b - 1)))
    a, b = as_scalar(a), as_scalar(b)
    if a.kind == b.kind == "bool" and op in ("and", "or", "xor"):
        return Scalar(_INT_OPS[op](a.value, b.value))
    if "float" not in (a.kind, b.kind):            # ints (and bools, as 0/1)
        a, b = to_int(a), to_int(b)
    if a.kind == b.kind == "int" and op == "mod":  # Python's sign rule, like //
        return Scalar(_python_mod(a.value, b.value))
    if a.kind == b.kind == "int" and op in _INT_OPS:
        return Scalar(_INT_OPS[op](a.value, b.value))
    if op not in _FLOAT_OPS:
        raise CompilationError(f"operator {op!r} is not defined for {a.kind} and {b.kind} values")
    return Scalar(_FLOAT_OPS[op](to_float(a).value, to_float(b).value))


def compare(op: str, a, b) -> Scalar:
    a, b = as_scalar(a), as_scalar(b)
    if "float" not in (a.kind, b.kind):
        a, b = to_int(a), to_int(b)
    if a.kind == b.kind == "int":
        return Scalar(arith.cmpi(getattr(arith.CmpIPredicate, _CMP_INT[op]), a.value, b.value))
    return Scalar(arith.cmpf(getattr(arith.CmpFPredicate, _CMP_FLOAT[op]),
                             to_float(a).value, to_float(b).value))


# ------------------------------------------------------------------ tiles

class TileLike(Value):
    """Register tiles and register vectors: elementwise arithmetic and maps."""

    @property
    def tk_type(self):
        return T.parse(self.value.type)

    @property
    def dtype(self) -> str:
        return self.tk_type.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tk_type.shape

    @builds(*tk.UNARY)
    def _unary(self, name: str):
        return wrap(emit(name, [self], self.ir_type))

    def exp(self): return self._unary("exp")
    def exp2(self): return self._unary("exp2")
    def log(self): return self._unary("log")
    def abs(self): return self._unary("abs")
    def relu(self): return self._unary("relu")
    def sqrt(self): return self._unary("sqrt")
    def rsqrt(self): return self._unary("rsqrt")
    def rcp(self): return self._unary("rcp")      # 1/x by rcp.approx.ftz.f32
    def __neg__(self): return self._unary("neg")

    def __invert__(self):
        """~mask: the elementwise not of a bool tile (bitwise not of an i32 tile)."""
        if T.is_float(self.dtype):
            raise CompilationError(f"~ is defined on bool tiles (masks) and i32 tiles, not on "
                                   f"{self.dtype} tiles")
        return tile_binary("xor", self, True if self.dtype == "bool" else -1)

    @builds("tile_index")
    def _index(self, axis: int):
        t = self.tk_type
        return wrap(emit("tile_index", [self], t.with_dtype("i32").to_mlir(), axis=axis))

    @builds("cvt")
    def to(self, dtype):
        """Convert the element type (f32 <-> bf16 <-> f16; i32 and bool indices and
        masks to floats, as Python's float() does)."""
        name = dtype_name(dtype)
        if name == self.dtype:
            return self
        return wrap(emit("cvt", [self], self.tk_type.with_dtype(name).to_mlir()))


@builds(*tk.BINARY, *tk.LOGICAL)
def tile_binary(op: str, a, b):
    """a (op) b where at least one side is a tile or vector."""
    if not isinstance(a, TileLike):          # scalar (op) tile
        if op in ("add", "mul", "max", "min", *tk.LOGICAL):
            return tile_binary(op, b, a)
        if op == "sub" and T.is_float(b.dtype):
            return tile_binary("add", -b, a)
        if op == "sub":                      # i32: no neg, and a may be a run-time int
            return tile_binary("add", tile_binary("mul", b, -1), a)
        a = fill(b.shape, a, b.dtype, like=b)
    if not isinstance(b, TileLike):
        b = scalar_operand(a.dtype, b)
    return wrap(emit(op, [a, b], a.ir_type))


def scalar_operand(dtype: str, x) -> Scalar:
    """A number combined with a `dtype` tile, in the tile's arithmetic (f32 for
    float tiles, i32 for i32 tiles, as is for masks); a float with an i32 tile
    stays a float, for tk-verify to refuse at the user's line."""
    if T.is_float(dtype) and type(x) in (int, float):
        return constant(float(x))            # a compile-time number: no int constant + sitofp
    s = as_scalar(x)
    if T.is_float(dtype):
        return to_float(s)
    return to_int(s) if dtype == "i32" else s


_SWAPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


@builds("cmp")
def tile_compare(op: str, a, b):
    """a (op) b, a comparison where at least one side is a tile or vector: a
    bool tile of the tile's shape and layout."""
    if not isinstance(a, TileLike):          # scalar (op) tile == tile (swapped op) scalar
        return tile_compare(_SWAPPED[op], b, a)
    if not isinstance(b, TileLike):
        b = scalar_operand(a.dtype, b)
    return wrap(emit("cmp", [a, b], a.tk_type.with_dtype("bool").to_mlir(), predicate=op))


class Tile(TileLike):
    """A register tile (!tk.rt)."""

    @builds("reduce")
    def _reduce(self, kind: str, axis: str) -> Vector:
        t: T.RT = self.tk_type
        keep = 0 if axis == "row" else 1
        lay = layouts.layout_of(t, current.get().num_warps).slice(keep)
        rv = T.RV(t.dtype, t.shape[keep], lay.encode(), t.scope)
        return Vector(emit("reduce", [self], rv.to_mlir(), kind=kind, axis=axis))

    def row_sum(self): return self._reduce("sum", "row")
    def row_max(self): return self._reduce("max", "row")
    def row_min(self): return self._reduce("min", "row")
    def col_sum(self): return self._reduce("sum", "col")
    def col_max(self): return self._reduce("max", "col")
    def col_min(self): return self._reduce("min", "col")

    def row_indices(self) -> Tile:
        """An i32 tile like this one (shape, layout, scope) holding each element's
        row within the tile: `tk.where(t.col_indices() <= t.row_indices(), t, -inf)`."""
        return self._index(0)

    def col_indices(self) -> Tile:
        """An i32 tile like this one holding each element's column within the tile."""
        return self._index(1)

    @builds("swap_pairs")
    def swap_pairs(self) -> Tile:
        """The tile with columns 2i and 2i+1 traded, (x0, x1, x2, x3, ...) ->
        (x1, x0, x3, x2, ...): the partner of each element in an interleaved
        (GPT-J) rotary pair. vec and row layouts (each thread holds its
        columns in pairs: no data moves between threads)."""
        return wrap(emit("swap_pairs", [self], self.ir_type))

    @builds("transpose")
    def transpose(self) -> Tile:
        """The tile transposed, at no cost: a row-layout R x C tile becomes a
        col-layout C x R one (col is row transposed) holding the same registers,
        and back. E.g. an accumulator of dQᵀ stored into a shared tile as dQ
        (the store then writes columns: 4-byte pieces for f32)."""
        t: T.RT = self.tk_type
        layout = layouts.TRANSPOSED.get(t.layout, t.layout)     # (others: refused by the rule)
        return Tile(emit("transpose", [self], T.RT(t.dtype, t.cols, t.rows, layout,
                                                   t.scope).to_mlir()))

    @property
    def T(self) -> Tile:
        """`transpose()`, as numpy and torch spell it."""
        return self.transpose()

    @builds("slice")
    def slice(self, rows=None, cols=None) -> Tile:
        """Part of the tile: rows=(first, count), cols=(first, count), compile-time
        ints (e.g. the right half of an accumulator: acc.slice(cols=(128, 128))).
        It names registers the thread already holds, so it costs nothing; the
        layout must keep each part in whole registers (tk-verify says if not)."""
        t: T.RT = self.tk_type
        (r0, nr), (c0, nc) = (_span(rows, t.rows, "rows"), _span(cols, t.cols, "cols"))
        sub = T.RT(t.dtype, nr, nc, t.layout, t.scope)
        return Tile(emit("slice", [self], sub.to_mlir(), row=r0, col=c0))

    @builds("broadcast")
    def _broadcast(self, kind: str, axis: str, vec, **hints) -> Tile:
        if not isinstance(vec, Vector):
            raise CompilationError(f"{kind}_{axis} expects a register vector (e.g. from "
                                   f"x.{axis}_sum() or tk.load of a 1-D tensor), got {vec!r}")
        return Tile(emit("broadcast", [self, vec], self.ir_type, kind=kind, axis=axis, **hints))

    # x.sub_row(v): v[i] applied to every element of row i; *_col: v[j] to column j.
    def add_row(self, v): return self._broadcast("add", "row", v)
    def sub_row(self, v): return self._broadcast("sub", "row", v)
    def div_row(self, v): return self._broadcast("div", "row", v)
    def add_col(self, v): return self._broadcast("add", "col", v)
    def sub_col(self, v): return self._broadcast("sub", "col", v)
    def div_col(self, v): return self._broadcast("div", "col", v)

    def mul_row(self, v, *, skip_ones: bool = False):
        """Row i times v[i]. skip_ones=True: a warp whose factors are all 1
        branches over its multiplies (fewer instructions where most factors
        are 1, as an online softmax's rescale with a lazily updated max makes
        them); the multiplies, behind the branch, no longer fuse with a
        following add into an fma."""
        return self._broadcast("mul", "row", v, **_skip_ones(skip_ones))

    def mul_col(self, v, *, skip_ones: bool = False):
        """Column j times v[j]; skip_ones as mul_row's."""
        return self._broadcast("mul", "col", v, **_skip_ones(skip_ones))


def _skip_ones(skip: bool) -> dict:
    """mul_row / mul_col's skip_ones as the op's hint (absent when False)."""
    if not isinstance(skip, bool):
        raise CompilationError(f"skip_ones must be a compile-time True or False, got {skip!r}")
    return {"skip_ones": True} if skip else {}


def _span(span, extent: int, what: str) -> tuple[int, int]:
    if span is None:
        return 0, extent
    if not (isinstance(span, (tuple, list)) and len(span) == 2
            and all(isinstance(x, int) for x in span)):
        raise CompilationError(f"slice {what} must be (first, count) of compile-time ints, "
                               f"got {span!r}")
    first, count = span
    if count <= 0 or first < 0 or first + count > extent:
        raise CompilationError(f"slice {what}=({first}, {count}) is outside the tile's {extent} "
                               f"{what}: (first, count) takes {what} first .. first + count - 1, "
                               f"a count > 0 of them within 0 .. {extent - 1}")
    if first % count:
        raise CompilationError(f"slice {what}=({first}, {count}) must be an aligned part of "
                               f"the tile's {extent} {what} (first a multiple of count)")
    return first, count


class Vector(TileLike):
    """A register vector (!tk.rv)."""

    def indices(self) -> Vector:
        """An i32 vector like this one holding each element's index in it."""
        return self._index(0)


@builds("fill")
def fill(shape, value, dtype, *, layout="vec", scope="block", like=None):
    """A tile (2-D shape) or vector (1-D) of one value."""
    if like is None:
        shape = tile_shape(shape, "tk.zeros / tk.full")
    if like is not None:
        t = like.tk_type.with_dtype(dtype_name(dtype))
    elif len(shape) == 2:
        t = T.RT(dtype_name(dtype), int(shape[0]), int(shape[1]), layout, scope)
    elif len(shape) == 1:
        t = T.RV(dtype_name(dtype), int(shape[0]), "auto", scope)
    else:
        raise CompilationError(f"a tile shape has 1 or 2 dims, got {shape!r}")
    if not isinstance(value, (int, float)):
        hint = "; for a run-time value v, tk.zeros(shape, dtype) + v" if isinstance(value, Scalar) \
            else ""
        raise CompilationError(f"fill value must be a compile-time number, got {value!r}{hint}")
    if t.dtype == "bool":           # Python's truth value (2 is True, not i1 0)
        return wrap(emit("fill", [], t.to_mlir(), value=int(bool(value))))
    if not T.is_float(t.dtype):     # i32: an exact int, not an f32 attribute
        if value != int(value) or not -2**31 <= int(value) < 2**31:
            raise CompilationError(f"an i32 tile's fill value must be an integer that fits in "
                                   f"i32, got {value!r}")
        return wrap(emit("fill", [], t.to_mlir(), value=int(value)))
    return wrap(emit("fill", [], t.to_mlir(), value=float(value)))


# ------------------------------------------------------------- memories

class Global(Value):
    """A global tensor argument (!tk.gl)."""

    @property
    def tk_type(self) -> T.GL:
        return T.parse(self.value.type)

    @property
    def shape(self) -> GlobalShape:
        return GlobalShape(self)

    @property
    def dtype(self) -> str:
        return self.tk_type.dtype

    def __getattr__(self, name):       # (only for attributes it does not have)
        if name.startswith("__"):
            raise AttributeError(name)
        if name in ("rank", "world_size"):
            raise AttributeError(f"`.{name}` belongs to a tk.pgl argument (X.{name}); this is "
                                 f"one tensor (a tk.gl argument, or one rank's copy X[r])")
        raise AttributeError(f"a tensor has no attribute {name!r} (it has .shape and .dtype)")


class GlobalShape:
    """`X.shape`: static dims are ints; a dynamic dim reads the kernel
    parameter (tk.gl_dim) only when it is used."""

    def __init__(self, g: Global):
        self._g, self._dims = g, g.tk_type.shape

    def __len__(self) -> int:
        return len(self._dims)

    @builds("gl_dim")
    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(len(self._dims))[i])
        rank = len(self._dims)
        if isinstance(i, bool) or not isinstance(i, int) or not -rank <= i < rank:
            raise CompilationError(f"a tensor of rank {rank} has dims 0 .. {rank - 1} (or -1 .. "
                                   f"-{rank}): .shape[{i!r}] is none of them")
        d = self._dims[i]
        i = i % len(self._dims)
        return d if d is not None else Scalar(emit("gl_dim", [self._g], i32(), dim=i))

    def __iter__(self):
        return (self[i] for i in range(len(self._dims)))


class PeerGlobal(Global):
    """A tk.pgl argument: this rank's copy (it is one: tk.load(X, ...) reads
    it), `X[r]` rank r's copy, `X.rank` this rank (a run-time i32) and
    `X.world_size` (a compile-time int)."""

    def __init__(self, local: Global, peers: list[Global], rank: Scalar):
        super().__init__(local.value)
        self.peers, self.rank = tuple(peers), rank

    @property
    def world_size(self) -> int:
        return len(self.peers)

    @builds("peer_select")
    def __getitem__(self, r) -> Global:
        if isinstance(r, tuple):
            raise CompilationError(f"a peer tensor is indexed by one rank (X[r]), got {r!r}")
        if isinstance(r, bool) or isinstance(r, int) and not 0 <= r < len(self.peers):
            raise CompilationError(f"peer index {r!r} is not a rank: this peer tensor has "
                                   f"{len(self.peers)} (ranks 0 to {len(self.peers) - 1})")
        if isinstance(r, int):
            return self.peers[r]
        s = as_scalar(r)
        if s.kind != "int":
            raise CompilationError(f"a peer tensor is indexed by a rank (an int), got {r!r}")
        return Global(emit("peer_select", [s, *self.peers], self.ir_type))

    def __repr__(self):
        return f"<PeerGlobal {self.value.type} x {len(self.peers)} ranks>"


@builds("index")
def _element(array: Value, i, what: str):
    v = array.value
    n = None if isinstance(v, ir.BlockArgument) else tk.array_count(v.owner)
    if n is None:
        raise CompilationError(f"this {what} is not an array; make one with a count "
                               f"(e.g. tk.shared_tiles(dtype, shape, count))")
    if isinstance(i, int) and not 0 <= i < n:
        raise CompilationError(f"index {i} is out of range for an array of {n} {what}s")
    s = as_scalar(i)
    if s.kind != "int":
        raise CompilationError(f"an array of {what}s is indexed with an int, got {i!r}")
    return type(array)(emit("index", [array, s], array.ir_type))


class Shared(Value):
    """A shared-memory tile (!tk.st), or an array of them (tk.shared_tiles)."""

    @property
    def tk_type(self) -> T.ST:
        return T.parse(self.value.type)

    @property
    def shape(self) -> tuple[int, int]:
        t = self.tk_type
        return (t.rows, t.cols)

    @property
    def dtype(self) -> str:
        return self.tk_type.dtype

    def __getitem__(self, i) -> Shared:
        return _element(self, i, "shared tile")

    @builds("column_block")
    def column_block(self, j) -> Shared:
        """Column block j of a swizzled tile: its rows x (swizzle bytes) columns,
        e.g. a bf16 64x128 tile with swizzle=128 is blocks 0 (columns 0-63) and
        1 (64-127), each a 64x64 tile of its own (a wgmma operand, a view: no
        data moves). j is a compile-time or run-time int (e.g. from the
        warpgroup's index: no branch, so no divergent wgmma)."""
        t = self.tk_type
        j = as_scalar(j) if not isinstance(j, bool) else j
        if not isinstance(j, Scalar) or j.kind != "int":
            raise CompilationError(f"column_block index must be an int, got {j!r}")
        sub = T.ST(t.dtype, t.rows, t.block_cols, t.swizzle)
        return Shared(emit("column_block", [self, j], sub.to_mlir()))

    @builds("in_block")
    def in_block(self, rank) -> Shared:
        """This tile as it is in block `rank` (0 .. cluster size - 1, a
        compile-time or run-time int) of this block's cluster: distributed
        shared memory, which `tk.load` reads into registers and `tk.store`
        writes from them (ld/st.shared::cluster), e.g. to sum the partial tiles
        the cluster's blocks computed. Nothing else takes it (no MMA, TMA or
        view of it). An access sees the other block's (and that block sees
        it) only across a tk.cluster_sync(), and a block must not end while
        another may still reach its tiles (end with one too); every block of
        the cluster has started before any runs past the kernel's first
        lines (a cluster kernel starts with a cluster barrier)."""
        from .sync import _in_cluster
        size = _in_cluster("tile.in_block(rank)")
        rank = as_scalar(rank) if not isinstance(rank, bool) else rank
        if not isinstance(rank, Scalar) or rank.kind != "int":
            raise CompilationError(f"in_block: the block's rank must be an int, got {rank!r}")
        known = tk.constant_int(rank.value)
        if known is not None and not 0 <= known < size:
            raise CompilationError(f"in_block: rank {known} is outside the cluster's blocks "
                                   f"0 .. {size - 1}")
        return Shared(emit("in_block", [self, rank], self.value.type))

    @builds("subtile")
    def subtile(self, i, rows: int) -> Shared:
        """Rows i*rows .. i*rows+rows-1 as a shared tile (i may be a run-time
        value, e.g. the warpgroup's index)."""
        t = self.tk_type
        if not isinstance(rows, int) or rows <= 0 or t.rows % rows:
            raise CompilationError(f"subtile rows must be a compile-time divisor of the tile's "
                                   f"{t.rows} rows, got {rows!r}")
        if isinstance(i, int) and not 0 <= i < t.rows // rows:
            raise CompilationError(f"subtile {i} of {rows} rows is outside the tile's {t.rows} "
                                   f"rows (0 <= i < {t.rows // rows})")
        first = scalar_binary("mul", i, rows)
        sub = T.ST(t.dtype, rows, t.cols, t.swizzle)
        return Shared(emit("subtile", [self, first], sub.to_mlir()))


class SharedVector(Value):
    """A vector in shared memory (!tk.sv), or an array of them (tk.shared_vectors)."""

    @property
    def tk_type(self) -> T.SV:
        return T.parse(self.value.type)

    @property
    def shape(self) -> tuple[int]:
        return (self.tk_type.length,)

    def __getitem__(self, i) -> SharedVector:
        return _element(self, i, "shared vector")


class TensorTile(Value):
    """A tile in Blackwell tensor memory (!tk.tt, tk.tensor_tile): an MMA
    accumulator that tk.load / tk.store move to and from registers."""

    @property
    def tk_type(self) -> T.TT:
        return T.parse(self.value.type)

    @property
    def shape(self) -> tuple[int, int]:
        return self.tk_type.shape

    @property
    def dtype(self) -> str:
        return self.tk_type.dtype

    @builds("tensor_columns")
    def columns(self, start, count: int) -> TensorTile:
        """Columns start .. start + count of the tile, as a tensor tile of its
        own (a view: an MMA's accumulator, or the part of it one tk.load
        moves). count is a compile-time multiple of 16; start an int, a
        multiple of 16 when known at compile time."""
        t = self.tk_type
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise CompilationError(f"columns: count must be a positive compile-time int, got "
                                   f"{count!r}")
        start = as_scalar(start) if not isinstance(start, bool) else start
        if not isinstance(start, Scalar) or start.kind != "int":
            raise CompilationError(f"columns: start must be an int, got {start!r}")
        sub = T.TT(t.dtype, t.rows, count)
        return TensorTile(emit("tensor_columns", [self, start], sub.to_mlir()))


class Semaphore(Value):
    """A semaphore (!tk.sem), or an array of them (tk.semaphores)."""

    def __getitem__(self, i) -> Semaphore:
        return _element(self, i, "semaphore")


def ceil_div(a, b):
    """Python ints fold; run-time ints become arith (the grid helpers use this).
    By a positive compile-time b, (a + b - 1) // b (the kernels' loop bounds:
    an add and a shift by 2**k; a + b - 1 past 2**31 is the [overflow] lint's);
    by any other b, -(-a // b), the host's formula, right for every sign."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    if type(b) is int and b > 0:
        return scalar_binary("floordiv", scalar_binary("add", a, b - 1), b)
    return scalar_binary("sub", 0, scalar_binary("floordiv", scalar_binary("sub", 0, a), b))
