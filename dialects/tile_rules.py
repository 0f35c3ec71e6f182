"""The tile rules: what each tk op accepts — its operands' and results'
shapes, dtypes, layouts, scopes and memory kinds — reported at the user's
source line.

A rule is part of the op's definition: its row in tk.py says what the op is,
its rule here says which types make a valid one. Each op's rule is
registered under its name (`@rule`, one per op; tests/test_registry.py
checks every op has one), beside the rules every op obeys (`_common`).
`check_op` applies them, to one op and nothing around it: the frontend calls
it on each op as it is built (tk_mlir/values.py: the error points at the
line that made it), and the tk-verify pass on every op of a module (so IR
read back from text is held to the same rules), before the checks that need
the whole function (passes/verify.py).
"""
from __future__ import annotations

from typing import Callable

from mlir import ir

from . import contracts, layout as layouts, tk, types as T
from ..errors import error_at
from .. import target


class _Fail(Exception):
    pass


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise _Fail(message)




def _side_ok(n: int, what: str) -> None:
    try:
        layouts.split(n, what)
    except layouts.LayoutError as e:
        raise _Fail(str(e)) from None


def _layout_ok(t, num_warps: int) -> None:
    if isinstance(t, T.RV):
        _side_ok(t.length, "a register vector's length")
        _require(t.scope in ("warp", "warpgroup", "block"),
                 f"scope must be warp, warpgroup or block, got {t.scope!r}")
    if not isinstance(t, T.RT):
        return
    _require(t.scope in ("warp", "warpgroup", "block"),
             f"scope must be warp, warpgroup or block, got {t.scope!r}")
    warps = T.scope_warps(t.scope, num_warps)
    _require(warps <= num_warps, f"a {t.scope}-scope tile needs {warps} warps, "
             f"the kernel has num_warps={num_warps}")
    try:
        layout = layouts.tile_layout(t.layout, t.rows, t.cols, warps)
    except layouts.LayoutError as e:
        raise _Fail(f"{T.show(t)}: {e}") from None
    # A thread holds its share of the tile in registers: past the hardware's
    # limit per thread it would all spill to local memory. 16- and 8-bit
    # elements of the row and vec layouts pack two and four to a 32-bit
    # register (a thread's neighbours in a row); col's are a column apart
    # and take one each (measured: a bf16 16x512 col tile spills), as masks
    # and indices do.
    packed = T.in_memory(t.dtype) and t.layout in ("row", "vec")
    size = T.itemsize(t.dtype) if packed else 4
    regs = -(-layout.num_regs * size // 4)
    limit = target.current().max_registers_per_thread
    # (where warps already hold copies of the tile, more warps would only add copies)
    fix = ("load the tensor tile a piece of columns at a time (tk.load(acc.columns(start, "
           "128)))" if t.layout == "tmem" else "use a smaller tile"
           + ("" if layout.replicated_bits("warp") else " or more warps"))
    _require(regs <= limit, f"{T.show(t)} needs {regs} registers per thread "
             f"(at most {limit} for one tile); {fix}")


def _in_memory(dtype: str, what: str) -> None:
    _require(T.in_memory(dtype), f"{what}: {dtype} tiles live in registers only "
             f"(indices and masks): no load, store, shared tile, TMA or MMA takes them; "
             f"convert with .to(tk.f32) or pick values with tk.where")


def _float(t, what: str) -> None:
    _require(T.is_float(t.dtype), f"{what} is defined on float tiles, not on {T.show(t)}"
             + ("; combine masks with & | ^ ~ and pick values with tk.where"
                if t.dtype == "bool" else "; convert with .to(tk.f32)"))


def _scalar_ok(name: str, tile, scalar: ir.Value) -> None:
    """A scalar operand is in the tile's arithmetic (T.scalar_dtype): f32 with
    float tiles, i32 with i32 tiles, a bool with bool tiles."""
    want = T.scalar_dtype(tile.dtype)
    got = T.dtype_of(scalar.type) or str(scalar.type)
    _require(got == want, f"{name}: {T.show(tile)} cannot be combined with a scalar of type "
             f"{got} (it takes {want} scalars)"
             + ("; convert the tile with .to(tk.f32)" if want == "i32" and got == "f32" else ""))


def _same_tiles(name: str, a, b) -> None:
    """Two tile operands of an elementwise op: one shape, dtype, layout and scope
    (a vector's layout is settled by tk-assign-layouts)."""
    broadcast = ""
    if type(a) is not type(b) and name in ("add", "sub", "mul", "div"):
        broadcast = (f"; apply a vector along a tile's rows or columns with x.{name}_row(v) or "
                     f"x.{name}_col(v)")
    elif type(a) is not type(b) and name == "comparison":
        broadcast = ("; compare with a vector along the rows by making it a tile first, "
                     "x < (x * 0).add_row(v) (one compare an element; x.sub_row(v) < 0 "
                     "costs an add as well), or along the columns with add_col")
    _require(type(a) is type(b) and a.shape == b.shape,
             f"{name}: operands differ: {T.show(a)} and {T.show(b)}{broadcast}")
    _require(a.dtype == b.dtype, f"{name}: operands differ in dtype: {T.show(a)} and "
             f"{T.show(b)}; convert one first (x.to(tk.{a.dtype}) or y.to(tk.{b.dtype}))")
    if isinstance(a, T.RT):
        _require(a == b, f"{name}: operands differ in layout or scope: {T.show(a)} and {T.show(b)}")
    else:
        _require(a.scope == b.scope, f"{name}: a {a.scope}-scope vector and a {b.scope}-scope "
                 f"vector cannot be combined")


def _memory_access(op, mem, tile, n_indices: int, verb: str) -> None:
    if isinstance(mem, T.GL):
        _require(n_indices == mem.rank, f"{verb} needs {mem.rank} coordinates for a rank-"
                 f"{mem.rank} tensor (one per dim), got {n_indices}")
        tile_rank = 2 if isinstance(tile, T.RT) else 1
        _require(mem.rank >= tile_rank, f"a rank-{mem.rank} tensor cannot hold a "
                 f"{tile_rank}-D tile")
        if not _int_vector_access(op, tile):
            _in_memory(tile.dtype, verb)
        _require(tile.dtype == mem.dtype, f"{verb}: the tile is {tile.dtype} but the tensor "
                 f"is {mem.dtype}; convert with .to(tk.{mem.dtype})")
    elif isinstance(mem, T.ST):
        _in_memory(tile.dtype, verb)
        _require(isinstance(tile, T.RT) and (tile.rows, tile.cols) == (mem.rows, mem.cols)
                 and tile.dtype == mem.dtype,
                 f"{verb}: {T.show(tile)} does not match {T.show(mem)}")
    elif isinstance(mem, T.SV):
        _require(isinstance(tile, T.RV) and tile.length == mem.length and
                 tile.dtype == mem.dtype, f"{verb}: {T.show(tile)} does not match {T.show(mem)} "
                 f"(a shared vector is read and written whole, as a register vector of its "
                 f"dtype and length)")


def _whole_arrays(op) -> None:
    """An array of tiles or semaphores is used element by element (arr[i])."""
    if tk.op_def(op).takes_arrays:
        return
    for v in op.operation.operands:
        n = tk.array_count(v.owner) if isinstance(v, ir.OpResult) else None
        if n is not None:
            what = {T.ST: "shared tiles", T.SV: "shared vectors"}.get(
                type(T.parse(v.type)), "semaphores")
            raise _Fail(f"{op.operation.name} is given a whole array of {n} {what}; use one "
                        f"element of it (arr[i])")


# ------------------------------------------------------------ rules per op

# tk op name -> its tile rule, rule(op, operands, results, num_warps), where
# operands/results are the parsed tk types (None for scalars). Every op has an
# entry (tests/test_registry.py): ops with nothing to check beyond the rules
# every op obeys (_common) name `no_extra_rule`.
RULES: dict[str, Callable] = {}


def rule(*names: str):
    def register(fn):
        for n in names:
            assert n in tk.OPS_BY_NAME and n not in RULES, n
            RULES[n] = fn
        return fn
    return register


def no_extra_rule(op, operands, results, num_warps: int) -> None:
    """Nothing to check beyond the rules every op obeys."""


rule("block_id", "grid_dim", "thread_id", "lane_id", "warp_id", "warpgroup_id", "gl_dim",
     "barrier", "index", "arrive", "expect_bytes", "wait", "wait_phase", "tma_commit", "tma_wait",
     "mma_wait", "elect", "set_registers", "cluster_rank", "cluster_sync", "arrive_remote",
     "named_barrier", "fill")(no_extra_rule)


def _common(op, operands, results, num_warps: int) -> None:
    """The rules every tk op obeys: whole arrays are used element by element,
    register tiles have a valid layout, fp8 stays in memory, i32 and bool in
    registers."""
    _whole_arrays(op)
    d = tk.op_def(op)
    if d.peer_copies is not None:     # any copy of a peer tensor, and the one picked
        int_tensors = range(len(d.operands), len(operands) + len(results))
    else:
        int_tensors = (d.operands.index(d.int_tensor),) if d.int_tensor else ()
        vector = results[0] if op.operation.name == "tk.load" and results else \
            operands[1] if op.operation.name == "tk.store" and len(operands) > 1 else None
        if _int_vector_access(op, vector):
            int_tensors = (0,)
    for i, t in enumerate(operands + results):
        _layout_ok(t, num_warps)
        if isinstance(t, T.GL) and t.dtype == "i32":
            _require(i in int_tensors, f"{T.show(t)}: an i32 tensor holds counters "
                     f"(tk.store_partial's counters=), scalars (tk.load(X, idx) reads one) or "
                     f"vectors (tk.load(X, idx, (n,)) and tk.store), not tiles: no tile load, "
                     f"store, TMA or MMA takes it")
        elif isinstance(t, (T.GL, T.ST, T.SV)):
            _in_memory(t.dtype, T.show(t))
        _require(not (isinstance(t, (T.RT, T.RV)) and t.dtype.startswith("f8")),
                 f"fp8 ({t.dtype if isinstance(t, (T.RT, T.RV)) else ''}) register tiles are "
                 f"not lowered yet: fp8 moves between global and shared memory (TMA, "
                 f"tk.copy) and "
                 f"feeds tk.mma_ABt from shared tiles, but is not loaded into registers, "
                 f"converted or computed with")


def _int_vector_access(op, vector) -> bool:
    """tk.load or tk.store of an i32 register vector (`vector`) from or to an
    i32 tensor: per-row indices or bounds a kernel reads or writes."""
    return op.operation.name in ("tk.load", "tk.store") and isinstance(vector, T.RV) and \
        vector.dtype == "i32"


@rule("load")
def _load(op, operands, results, num_warps: int) -> None:
    _memory_access(op, operands[0], results[0], len(operands) - 1, op.operation.name)


@rule("store")
def _store(op, operands, results, num_warps: int) -> None:
    _memory_access(op, operands[0], operands[1], len(operands) - 2, op.operation.name)


@rule("atomic_add")
def _atomic_add(op, operands, results, num_warps: int) -> None:
    # red.global.add is lowered for f32 only (f16/bf16 red would round every
    # partial sum: accumulate in f32 and convert once).
    dst, tile, name = operands[0], operands[1], op.operation.name
    _require(isinstance(dst, T.GL), f"{name} adds into a tk.gl tensor (global memory), "
             f"not into {T.show(dst) if dst is not None else 'a scalar'}")
    _require(dst.dtype == "f32", f"{name} adds into an f32 tensor (red.global.add.f32), "
             f"got {T.show(dst)}; accumulate into an f32 buffer and convert once at the end")
    _require(isinstance(tile, (T.RT, T.RV)) and tile.dtype == "f32",
             f"{name} adds an f32 register tile or vector, got "
             f"{T.show(tile) if tile is not None else 'a scalar'}"
             + ("; convert it with .to(tk.f32)" if tile is not None else ""))
    _memory_access(op, dst, tile, len(operands) - 2, name)


@rule("load_scalar")
def _load_scalar(op, operands, results, num_warps: int) -> None:
    src, name = operands[0], op.operation.name
    _require(isinstance(src, T.GL) and src.dtype in ("i32", "f32"),
             f"tk.load(X, idx) without a shape reads one element of an i32 or f32 tensor, "
             f"got {T.show(src) if src is not None else 'a scalar'}")
    _require(len(operands) - 1 == src.rank, f"tk.load(X, idx) of one element needs {src.rank} "
             f"element coordinates for a rank-{src.rank} tensor, got {len(operands) - 1}")


@rule("peer_select")
def _peer_select(op, operands, results, num_warps: int) -> None:
    rank, *peers = operands
    _require(rank is None and all(p == results[0] for p in peers),
             "tk.pgl: a rank (an i32) picks one of a peer tensor's copies, which share one type")


@rule("signal", "wait_signal")
def _signal(op, operands, results, num_warps: int) -> None:
    flags, value = operands[:2]
    what = op.operation.name
    _require(isinstance(flags, T.GL) and flags.dtype == "i32",
             f"{what} takes a flag in an i32 tensor, got "
             f"{T.show(flags) if flags is not None else 'a scalar'}")
    _require(value is None, f"{what}: the value is an int scalar")
    _require(len(operands) - 2 == flags.rank, f"{what} needs {flags.rank} element coordinates "
             f"for a rank-{flags.rank} flag tensor, got {len(operands) - 2}")
    _require(op.scope in tk.SCOPES, f"{what}: scope must be one of {tk.SCOPES}")


@rule("fence")
def _fence(op, operands, results, num_warps: int) -> None:
    _require(op.scope in tk.SCOPES, f"tk.fence: scope must be one of {tk.SCOPES}")


@rule("store_partial")
def _store_partial(op, operands, results, num_warps: int) -> None:
    dst, tile, ws, counters = operands[:4]
    name = op.operation.name
    _require(isinstance(tile, (T.RT, T.RV)) and tile.dtype == "f32",
             f"{name} stores an f32 register tile or vector (the partial sums add in f32), got "
             f"{T.show(tile) if tile is not None else 'a scalar'}")
    for what, g in (("dst", dst), ("workspace", ws), ("counters", counters)):
        _require(isinstance(g, T.GL), f"{name}: {what} must be a tk.gl tensor (global memory), "
                 f"not {T.show(g) if g is not None else 'a scalar'}")
    _require(dst.dtype in ("f32", "bf16", "f16"), f"{name} stores into an f32, bf16 or f16 "
             f"tensor, got {T.show(dst)}")
    _require(ws.dtype == "f32" and ws.rank == dst.rank,
             f"{name}: the workspace must be an f32 tensor of dst's shape (the partial sums "
             f"add there), got {T.show(ws)}")
    _require(counters.dtype == "i32" and counters.rank == 1,
             f"{name}: counters must be a 1-D i32 tensor (one counter per tile and thread), "
             f"got {T.show(counters)}")
    parts = op.operation.operands[4].type
    _require(str(parts) == "i32", f"{name}: parts must be an i32 scalar (the tile's number of "
             f"partial sums), got {parts}")
    _memory_access(op, ws, tile, len(operands) - 5, name)


@rule("copy")
def _copy(op, operands, results, num_warps: int) -> None:
    gl, st = (operands[0], operands[1]) if isinstance(operands[0], T.GL) else operands[1::-1]
    _require(gl.dtype == st.dtype, f"tk.copy: {T.show(st)} and {T.show(gl)} differ in dtype")
    _require(len(operands) - 2 == gl.rank, f"tk.copy needs {gl.rank} coordinates")
    _require(gl.rank >= 2, "tk.copy needs a tensor of rank 2 or more")
    _require(st.cols * T.itemsize(st.dtype) % 16 == 0,
             "tk.copy moves 16-byte vectors: shared tile rows must be a multiple of 16 bytes")


@rule(*tk.BINARY)
def _binary(op, operands, results, num_warps: int) -> None:
    name = op.operation.name[3:]
    lhs, rhs = operands
    _require(lhs.dtype != "bool", f"{name} is not defined on {T.show(lhs)} (a mask); combine "
             f"masks with & | ^ ~, or pick values with tk.where(mask, a, b)")
    _require(name != "div" or T.is_float(lhs.dtype), f"div is not defined on {T.show(lhs)}; "
             f"convert with .to(tk.f32)")
    _elementwise(name, lhs, rhs, op.operation.operands[1])


def _elementwise(name: str, lhs, rhs, rhs_value: ir.Value) -> None:
    if rhs is None:
        _scalar_ok(name, lhs, rhs_value)
    else:
        _same_tiles(name, lhs, rhs)


@rule(*tk.UNARY)
def _unary(op, operands, results, num_warps: int) -> None:
    _float(operands[0], op.operation.name[3:])


@rule(*tk.LOGICAL)
def _logical(op, operands, results, num_warps: int) -> None:
    name, lhs = op.operation.name[3:], operands[0]
    _require(not T.is_float(lhs.dtype), f"{name} (the operator {_SYMBOL[name]}) is defined on "
             f"bool tiles (masks) and i32 tiles, not on {T.show(lhs)}")
    _elementwise(name, lhs, operands[1], op.operation.operands[1])


_SYMBOL = {"and": "&", "or": "|", "xor": "^"}


@rule("cmp")
def _cmp(op, operands, results, num_warps: int) -> None:
    lhs, rhs = operands
    _require(op.predicate in tk.COMPARISONS, f"cmp predicate must be one of "
             f"{tuple(tk.COMPARISONS)}, got {op.predicate!r}")
    _require(lhs.dtype != "bool" or op.predicate in ("eq", "ne"), f"{T.show(lhs)} (a mask) "
             f"compares with == and != only")
    _elementwise("comparison", lhs, rhs, op.operation.operands[1])
    _require(results[0].dtype == "bool" and _placed_alike(results[0], lhs), f"cmp: the result "
             f"is {T.show(results[0])}, expected {T.show(lhs.with_dtype('bool'))}")


def _placed_alike(a, b) -> bool:
    """Same kind, shape and scope, and for tiles the same layout: the elements
    sit in the same registers of the same threads (vectors: once tk-assign-layouts
    has joined them, which the ops' `layout="same"` trait asks for)."""
    return type(a) is type(b) and a.shape == b.shape and a.scope == b.scope and \
        (isinstance(a, T.RV) or a.layout == b.layout)


@rule("swap_pairs")
def _swap_pairs(op, operands, results, num_warps: int) -> None:
    src = operands[0]
    _require(isinstance(src, T.RT), f"swap_pairs: expected a register tile, got {T.show(src)}")
    _require(src.cols % 2 == 0, f"swap_pairs: {T.show(src)} has an odd number of columns")
    _require(src.layout in ("vec", "row"), f"swap_pairs: {T.show(src)} holds column pairs in "
             f"two threads; swap the pairs of a vec or row layout tile")


@rule("transpose")
def _transpose(op, operands, results, num_warps: int) -> None:
    src, out = operands[0], results[0]
    _require(isinstance(src, T.RT) and src.layout in layouts.TRANSPOSED,
             f"transpose: expected a register tile in the row or col layout (col is row "
             f"transposed: the same registers), got {T.show(src)}")
    want = T.RT(src.dtype, src.cols, src.rows, layouts.TRANSPOSED[src.layout], src.scope)
    _require(out == want, f"transpose: the result is {T.show(out)}, expected {T.show(want)}")


@rule("tile_index")
def _tile_index(op, operands, results, num_warps: int) -> None:
    src, out = operands[0], results[0]
    _require(isinstance(src, (T.RT, T.RV)) and 0 <= op.axis < len(src.shape),
             f"tile_index: axis {op.axis} of {T.show(src)}")
    _require(out.dtype == "i32" and _placed_alike(out, src), f"tile_index: the result is "
             f"{T.show(out)}, expected an i32 tile like {T.show(src)}")


@rule("select")
def _select(op, operands, results, num_warps: int) -> None:
    mask, out = operands[0], results[0]
    _require(mask is not None and mask.dtype == "bool", f"tk.where: the mask must be a bool "
             f"tile or vector (e.g. from a comparison), got "
             f"{T.show(mask) if mask is not None else op.operation.operands[0].type}")
    _require(_placed_alike(out, mask), f"tk.where: the result {T.show(out)} does not match "
             f"the mask {T.show(mask)}")
    for what, t, v in (("a", operands[1], op.operation.operands[1]),
                       ("b", operands[2], op.operation.operands[2])):
        if t is None:
            _scalar_ok(f"tk.where ({what})", out, v)
        else:
            _require(_placed_alike(t, mask), f"tk.where: {what} ({T.show(t)}) does not match "
                     f"the mask ({T.show(mask)}): same shape, layout and scope")
            _require(t.dtype == out.dtype, f"tk.where: {what} is {t.dtype}, the result "
                     f"{out.dtype}; convert one with .to()")


@rule("cvt")
def _cvt(op, operands, results, num_warps: int) -> None:
    _require(operands[0].shape == results[0].shape, "cvt changes the dtype only")
    _require(results[0].dtype != "bool", f"cvt: a mask is made by a comparison (x != 0), "
             f"not converted from {T.show(operands[0])}")


@rule("reduce")
def _reduce(op, operands, results, num_warps: int) -> None:
    _require(isinstance(operands[0], T.RT), "reductions apply to register tiles")
    _require(operands[0].dtype != "bool", f"{op.kind} reduction is defined on float and i32 "
             f"tiles, not on {T.show(operands[0])} (a mask); count its elements with "
             f"mask.to(tk.i32).row_sum() (or col_sum)")     # (i32 sums wrap, as its adds do)
    _require(op.kind in tk.REDUCTIONS, f"reduction kind must be one of {tk.REDUCTIONS}")
    _require(op.axis in tk.AXES, "reduction axis must be row or col")
    tile = operands[0]
    # Warps exchange partials across a block barrier: a tile whose scope is
    # less than the block (a warpgroup of 8 warps) cannot take part in one.
    if T.scope_warps(tile.scope, num_warps) != num_warps:
        layout = layouts.layout_of(tile, num_warps)
        _require(not layout.warp_bits_along(1 if op.axis == "row" else 0),
                 f"a {op.axis} reduction across the warps of a {tile.scope}-scope tile "
                 f"({T.show(tile)}, {tile.layout} layout) in a kernel of {num_warps} warps is "
                 f"not supported yet; make the tile with layout=\"{op.axis}\" (its warps "
                 f"split the other axis: no exchange between them), or use block scope (or "
                 f"a kernel of one {tile.scope})")


@rule("broadcast")
def _broadcast(op, operands, results, num_warps: int) -> None:
    tile, vec = operands
    extent = tile.rows if op.axis == "row" else tile.cols
    if not (tile.dtype == "i32" and op.kind != "div"):     # i32: indices against bounds
        _float(tile, f"{op.kind}_{op.axis}")
    _require(isinstance(vec, T.RV) and vec.length == extent,
             f"{op.kind}_{op.axis}: needs a vector of {extent} "
             f"({'one per row' if op.axis == 'row' else 'one per column'}), got {T.show(vec)}")
    _require(vec.dtype == tile.dtype, f"{op.kind}_{op.axis}: the vector is {vec.dtype}, "
             f"the tile {tile.dtype}; convert one with .to()")
    _require(vec.scope == tile.scope, f"{op.kind}_{op.axis}: a {vec.scope}-scope vector "
             f"cannot be applied to a {tile.scope}-scope tile (load it with "
             f"scope={tile.scope!r})")
    if contracts.SKIP_ONES.get(op, False):
        _require(op.kind == "mul", f"{op.kind}_{op.axis}: skip_ones is mul_row's and mul_col's")
        _require(T.is_float(tile.dtype),
                 f"{op.kind}_{op.axis}(skip_ones=True) takes a float tile, got {T.show(tile)}")


def _swizzle_that_fits(row_bytes: int) -> str:
    """The hint for a row too narrow for its swizzle: the widest that fits."""
    fits = [s for s in sorted(T.SWIZZLES, reverse=True) if s and row_bytes % s == 0]
    return f"; swizzle={fits[0]} fits rows of {row_bytes} bytes" if fits else \
        "; swizzle=0 takes rows of any width"


@rule("alloc_st")
def _alloc_st(op, operands, results, num_warps: int) -> None:
    st = results[0]
    _require(st.swizzle in T.SWIZZLES, f"swizzle must be one of {T.SWIZZLES} bytes")
    _require(st.rows % 8 == 0 or not st.swizzle, f"a swizzled shared tile has a multiple "
             f"of 8 rows (the swizzle pattern repeats every 8 rows), got {st.rows}")
    _require(st.row_bytes % st.block_bytes == 0,
             f"{T.show(st)}: with swizzle={st.swizzle} a row is stored in blocks of "
             f"{st.swizzle} bytes, so it must be a multiple of {st.swizzle} bytes "
             f"({st.swizzle // T.itemsize(st.dtype)} {st.dtype}), got {st.row_bytes}"
             f"{_swizzle_that_fits(st.row_bytes)}")
    count = tk.array_count(op) or 1
    what = f"{T.show(st)} needs" if count == 1 else f"{count} x {T.show(st)} need"
    limit = target.current().max_shared_bytes
    _require(st.nbytes * count <= limit, f"{what} {st.nbytes * count} bytes; a "
             f"block has {limit} bytes of shared memory")


@rule("alloc_sv")
def _alloc_sv(op, operands, results, num_warps: int) -> None:
    sv, count = results[0], tk.array_count(op) or 1
    _side_ok(sv.length, "a shared vector's length (it is read as a register vector)")
    limit = target.current().max_shared_bytes
    _require(sv.nbytes * count <= limit, f"{count} x {T.show(sv)} need {sv.nbytes * count} "
             f"bytes; a block has {limit} bytes of shared memory")


@rule("alloc_sem")
def _alloc_sem(op, operands, results, num_warps: int) -> None:
    _require(op.operation.parent.name == "func.func", "semaphores are allocated (and "
             "initialised) once, at the kernel's top level, not inside an if or a loop")


@rule("use_cluster")
def _use_cluster(op, operands, results, num_warps: int) -> None:
    _require(op.operation.parent.name == "func.func", "tk.use_cluster is called at the "
             "kernel's top level")


@rule("subtile")
def _subtile(op, operands, results, num_warps: int) -> None:
    src, sub = operands[0], results[0]
    _require(src.blocks == 1, f"subtile: {T.show(src)} is stored in {src.blocks} column "
             f"blocks of {src.swizzle} bytes, so its rows are not contiguous; only tiles of "
             f"one column block (row bytes = swizzle, or swizzle 0) can be split by rows")
    _require(sub.rows % 8 == 0 or not src.swizzle, "subtile: a swizzled tile splits into "
             "multiples of 8 rows")


@rule("in_block")
def _in_block(op, operands, results, num_warps: int) -> None:
    _require(isinstance(operands[0], T.ST), f"in_block: {T.show(operands[0])} is not a shared "
             f"tile: only shared tiles are read from another block of the cluster")
    rank = tk.constant_int(op.rank)     # (a run-time rank is the kernel's to keep in range)
    _require(rank is None or 0 <= rank < 8, f"in_block: rank {rank} is outside a cluster's "
             f"blocks (0 .. 7 at most)")


@rule("column_block")
def _column_block(op, operands, results, num_warps: int) -> None:
    src, sub = operands[0], results[0]
    _require(src.swizzle > 0, f"column_block: {T.show(src)} is not swizzled: its rows are "
             f"contiguous, it has no column blocks")
    j = tk.constant_int(op.index)       # (a run-time index is the kernel's to keep in range)
    _require(j is None or 0 <= j < src.blocks, f"column_block: {T.show(src)} has {src.blocks} "
             f"column block(s) of {src.block_cols} columns, no block {j}")
    _require((sub.rows, sub.cols, sub.swizzle) == (src.rows, src.block_cols, src.swizzle),
             f"column_block: the block of {T.show(src)} is {src.rows}x{src.block_cols}")


@rule("tma_load", "tma_load_multicast", "tma_store", "tma_prefetch")
def _tma(op, operands, results, num_warps: int) -> None:
    d = tk.op_def(op)
    name = tk.spelled(d)
    gl, st = (T.parse(v.type) for v in tk.tma_operands(op))
    _require(gl.dtype == st.dtype, f"{name}: {T.show(st)} and {T.show(gl)} differ in dtype")
    # Rank 2 for vectors too: the driver refuses a rank-1 map (box 64 f32:
    # cuTensorMapEncodeTiled returns CUDA_ERROR_INVALID_VALUE).
    _require(2 <= gl.rank <= 5, f"{name} needs a tensor of rank 2 to 5 (view a 1-D tensor as "
             f"(1, n)), got rank {gl.rank}")
    if d.variadic:
        n_idx = len(operands) - len(d.operands)
        _require(n_idx == gl.rank, f"{name} needs one coordinate per dim of the tensor "
                 f"({gl.rank}), got {n_idx}")
    # Constant coordinates the copy engine faults on fail here, at the user's
    # line; run-time ones are the interpreter's to report (no GPU-side check).
    starts = [tk.constant_int(v) for v in list(op.operands)[len(d.operands):]]
    problem = tma_start_problem(name, starts, st.dtype, contracts.ELEMENTS.get(op, False),
                                writes=d.name in ("tma_store", "tma_reduce_add"))
    _require(problem is None, problem or "")
    if isinstance(st, T.SV):
        _tma_vector_box(name, st)
        return
    _require(st.rows <= 256, f"{name}: a TMA box has at most 256 rows, {T.show(st)} has "
             f"{st.rows}")
    _require(st.block_bytes <= 256 * T.itemsize(st.dtype) and st.block_bytes % 16 == 0,
             f"{name}: a TMA box row is a multiple of 16 bytes and at most 256 elements; "
             f"{T.show(st)} with swizzle {st.swizzle} has {st.block_bytes}-byte rows")


def tma_start_problem(name: str, coords: list, dtype: str, elements: bool,
                      writes: bool) -> str | None:
    """Why a TMA copy cannot start at `coords` (ints, None where unknown;
    None when it can): the copy engine faults (illegal instruction, measured
    on H100) on an element-coordinate column off a 16-byte boundary, and on a
    store or reduce-add at any negative coordinate. Loads may start anywhere
    else, before the tensor's edges too (those elements read zeros)."""
    column = coords[-1] if coords else None
    per16 = 16 // T.itemsize(dtype)
    if elements and column is not None and column % per16:
        return (f"{name}(..., elements=True): the column coordinate {column} is not on a "
                f"16-byte boundary; the copy engine faults on it: start at a multiple of "
                f"{per16} columns ({dtype}; rows may start anywhere)")
    negative = [(i, c) for i, c in enumerate(coords) if c is not None and c < 0]
    if writes and negative:
        i, c = negative[0]
        return (f"{name}: coordinate {i} of idx (0-based) is {c}; TMA stores and reduce-adds "
                f"must not start at a negative coordinate (the copy engine faults); loads may")
    return None


def _tma_vector_box(name: str, sv: T.SV) -> None:
    """A vector is one box of `length` elements along the tensor's last dim:
    TMA moves whole 16-byte units of at most 256 elements."""
    _require(sv.nbytes % 16 == 0 and sv.length <= 256, f"{name}: a TMA box of a shared "
             f"vector is a multiple of 16 bytes and at most 256 elements; {T.show(sv)} has "
             f"{sv.nbytes} bytes (use a length that is a multiple of "
             f"{16 // T.itemsize(sv.dtype)}, up to 256)")


# cp.reduce.async.bulk.tensor .add: the element type is the tensor map's; PTX
# defines .add on f32, f16 and bf16 (and integers, which tk tiles do not hold).
TMA_REDUCE_ADD_DTYPES = ("f32", "f16", "bf16")


@rule("tma_reduce_add")
def _tma_reduce_add(op, operands, results, num_warps: int) -> None:
    st = T.parse(op.src.type)
    _require(isinstance(st, T.ST), f"tk.tma.reduce_add_async: TMA reads a shared tile, got "
             f"{T.show(st)}")
    _tma(op, operands, results, num_warps)
    _require(st.dtype in TMA_REDUCE_ADD_DTYPES, f"tk.tma.reduce_add_async: TMA adds f32, f16 "
             f"or bf16 tiles, not {T.show(st)}")


@rule("slice")
def _slice(op, operands, results, num_warps: int) -> None:
    src, sub = operands[0], results[0]
    _require(isinstance(src, T.RT), "slice applies to register tiles")
    _require(slice_registers(src, sub, op.row, op.col, num_warps) is not None,
             f"slice: in the {src.layout} layout, rows {op.row}..{op.row + sub.rows - 1} and "
             f"columns {op.col}..{op.col + sub.cols - 1} of {T.show(src)} are not held in "
             f"whole registers by the same threads; slice along register bits (e.g. "
             f"halves of the columns of a row-layout tile)")


@rule("mma")
def _mma(op, operands, results, num_warps: int) -> None:
    chip = target.current()
    _require(chip.arch == "sm_90a", f"tk.mma_* into a register tile is wgmma, Hopper's "
             f"(sm_90a) warpgroup MMA; {chip.arch} has none: its MMA is tcgen05, which "
             f"accumulates into a tensor tile (acc = tk.tensor_tile(tk.f32, (128, N)))")
    _check_mma(op, *operands)


def _check(op: ir.OpView, num_warps: int) -> None:
    operands = [T.parse(v.type) for v in op.operation.operands]
    results = [T.parse(r.type) for r in op.operation.results]
    _common(op, operands, results, num_warps)
    RULES[op.operation.name[3:]](op, operands, results, num_warps)


def slice_registers(src: T.RT, sub: T.RT, row: int, col: int, num_warps: int):
    """Which register of src holds each register of the slice sub at (row,
    col), or None when the slice does not select whole registers."""
    warps = T.scope_warps(src.scope, num_warps)
    try:
        outer = layouts.tile_layout(src.layout, src.rows, src.cols, warps)
        inner = layouts.tile_layout(sub.layout, sub.rows, sub.cols, warps)
    except layouts.LayoutError:
        return None
    if (outer.lane, outer.warp) != (inner.lane, inner.warp):
        return None
    where = {outer.reg_position(r): r for r in range(outer.num_regs)}
    picked = [where.get((p[0] + row, p[1] + col))
              for p in map(inner.reg_position, range(inner.num_regs))]
    return None if None in picked else picked


MMA_DTYPES = ("bf16", "f16")      # a and b of one dtype; A from shared memory or registers
FP8_DTYPES = ("f8e4m3", "f8e5m2")  # any pair of them; A and B from shared memory, K-major


def _check_mma(op, acc, a, b) -> None:
    """The wgmma shapes: per warpgroup M = 64 x m, N from 8 to 256 in steps
    of 8 (16 here: the accumulator layout), K a multiple of the instruction's
    (16 for 16-bit types, 32 for fp8)."""
    ta, tb = bool(op.trans_a), bool(op.trans_b)
    _require(isinstance(acc, T.RT) and acc.dtype == "f32" and acc.scope == "warpgroup" and
             acc.layout == "row", f"mma: the accumulator must be an f32 tile of warpgroup scope "
             f"in the row layout, got {T.show(acc)}")
    (m, k_a), (k_b, n) = ((a.cols, a.rows) if ta else (a.rows, a.cols),
                          (b.rows, b.cols) if tb else (b.cols, b.rows))
    fp8 = a.dtype in FP8_DTYPES and b.dtype in FP8_DTYPES
    _require(fp8 or (a.dtype == b.dtype and a.dtype in MMA_DTYPES), f"mma: a and b must both "
             f"be bf16, both f16, or both fp8 (f8e4m3/f8e5m2, in any pair), got {a.dtype} and "
             f"{b.dtype}")
    if fp8:
        _check_fp8_mma(op, a, b)
    k_inst = tk.wgmma_k(a.dtype)
    _require(k_a == k_b and k_a % k_inst == 0, f"mma: the K extents of a ({T.show(a)}) and b "
             f"({T.show(b)}) must agree and be a multiple of {k_inst}, got {k_a} and {k_b}")
    _require((acc.rows, acc.cols) == (m, n), f"mma: a {m}x{k_a} by {k_b}x{n} product does not "
             f"fit the {acc.rows}x{acc.cols} accumulator")
    _require(m % 64 == 0, f"mma: M must be a multiple of 64 (one wgmma per 64 rows), got {m}")
    _require(16 <= n <= 256 and n % 16 == 0, f"mma: N must be a multiple of 16 from 16 to 256, "
             f"got {n}")
    if isinstance(a, T.RT):        # A from registers: the wgmma A fragment is the row layout
        _require(not ta and a.layout == "row" and a.scope == "warpgroup",
                 f"mma: a register-tile A must be M x K in the row layout of warpgroup scope "
                 f"(the wgmma A fragment), got {T.show(a)}{' transposed' if ta else ''}")
    for what, t in (("a", a), ("b", b)):
        _require(isinstance(t, T.RT) or t.swizzle != 0, f"mma: {what} ({T.show(t)}) must be a "
                 f"swizzled shared tile (swizzle=128, 64 or 32): wgmma reads the swizzled layouts")


def _check_fp8_mma(op, a, b) -> None:
    """wgmma on 8-bit types has no transpose: both operands are read K-major
    (A as M x K, B as N x K, rows along K), both from shared memory."""
    _require(not op.trans_a and not op.trans_b, f"mma: fp8 wgmma reads both operands K-major "
             f"(it has no transpose for 8-bit types): use tk.mma_ABt with a as M x K and b as "
             f"N x K, got tk.{_MMA_NAME[bool(op.trans_a), bool(op.trans_b)]} "
             f"({T.show(a)}, {T.show(b)}); lay the operands out K-major in memory")
    _require(isinstance(a, T.ST), f"mma: fp8 wgmma reads a from shared memory, not from "
             f"registers ({T.show(a)})")


_MMA_NAME = {(False, False): "mma_ABt", (False, True): "mma_AB", (True, False): "mma_AtBt",
             (True, True): "mma_AtB"}


# ---------------------------------------- Blackwell: tensor memory and tcgen05

def _blackwell(what: str) -> None:
    chip = target.current()
    _require(chip.arch == "sm_100a", f"{what} is Blackwell's (sm_100a: tensor memory and "
             f"tcgen05); {chip.arch} has neither: declare the kernel "
             f"@tk.kernel(target=\"sm_100a\")")


def _top_level(op, what: str) -> None:
    _require(op.operation.parent.name == "func.func", f"{what} is done by the whole block at "
             f"the kernel's top level (one warp's tcgen05.alloc/dealloc and a block barrier), "
             f"not inside an if or a loop")


@rule("alloc_tt")
def _alloc_tt(op, operands, results, num_warps: int) -> None:
    _blackwell("tk.tensor_tile")
    lanes, columns = target.current().tmem_lanes, target.current().tmem_columns
    _top_level(op, "allocating a tensor tile")
    tt = results[0]
    _require(tt.dtype == "f32", f"a tensor tile holds the f32 accumulator of tcgen05.mma, got "
             f"{tt.dtype}")
    _require(tt.rows == lanes, f"a tensor tile has {lanes} rows (tensor memory's lanes; an "
             f"MMA of M = 128 fills them), got {T.show(tt)}")
    _require(tt.cols % 16 == 0 and tt.cols <= columns, f"a tensor tile's columns are a "
             f"multiple of 16 up to {columns} (tensor memory's columns), got {T.show(tt)}")


@rule("free_tt")
def _free_tt(op, operands, results, num_warps: int) -> None:
    _blackwell("tk.free_tensor_tile")
    _top_level(op, "freeing a tensor tile")


@rule("tensor_mma")
def _tensor_mma(op, operands, results, num_warps: int) -> None:
    """tcgen05.mma: M = 128 per block (the tile's lanes; a pair's 256), N a
    multiple of 16 from 16 to 256 (a pair's blocks hold N/2 of b each), K a
    multiple of the instruction's (16 for 16-bit types, 32 for fp8); both
    operands swizzled shared tiles."""
    _blackwell("tk.mma_* into a tensor tile (tcgen05.mma)")
    acc, a, b, _ = operands
    name = f"tk.{_MMA_NAME[bool(op.trans_a), bool(op.trans_b)]}"
    for what, t in (("a", a), ("b", b)):
        _require(isinstance(t, T.ST) and t.swizzle != 0, f"{name}: {what} must be a swizzled "
                 f"shared tile (swizzle=128, 64 or 32), got {T.show(t)}")
    (m, k_a), (k_b, n) = ((a.cols, a.rows) if op.trans_a else (a.rows, a.cols),
                          (b.rows, b.cols) if op.trans_b else (b.cols, b.rows))
    fp8 = a.dtype in FP8_DTYPES and b.dtype in FP8_DTYPES
    _require(fp8 or (a.dtype == b.dtype and a.dtype in MMA_DTYPES), f"{name}: a and b must "
             f"both be bf16, both f16, or both fp8 (f8e4m3/f8e5m2), got {a.dtype} and {b.dtype}")
    _require(not fp8 or not (op.trans_a or op.trans_b), f"{name}: fp8 operands are read "
             f"K-major here: use tk.mma_ABt with a as M x K and b as N x K")
    k_inst = tk.wgmma_k(a.dtype)
    _require(k_a == k_b and k_a % k_inst == 0, f"{name}: the K extents of a ({T.show(a)}) and "
             f"b ({T.show(b)}) must agree and be a multiple of {k_inst}, got {k_a} and {k_b}")
    if op.pair:        # each block holds half of B: the pair's N is twice the block's
        _require((acc.rows, acc.cols) == (m, 2 * n), f"{name}(pair=True): each block's "
                 f"{m}x{k_a} rows of a by half of b ({k_b}x{n} here, N = {2 * n} over the "
                 f"pair) do not fit its {T.show(acc)}")
        n *= 2
    else:
        _require((acc.rows, acc.cols) == (m, n), f"{name}: a {m}x{k_a} by {k_b}x{n} product "
                 f"does not fit the {T.show(acc)}")
    _require(16 <= n <= 256, f"{name}: tcgen05.mma's N is a multiple of 16 from 16 to 256, "
             f"got {n} (split a wider tile into tensor tiles of at most 256 columns)")


@rule("tensor_columns")
def _tensor_columns(op, operands, results, num_warps: int) -> None:
    _blackwell("a tensor tile's columns")
    src, sub = operands[0], results[0]
    _require(sub.cols % 16 == 0, f"columns: count must be a multiple of 16, got {sub.cols}")
    start = tk.constant_int(op.start)
    if start is not None:
        _require(start % 16 == 0 and 0 <= start and start + sub.cols <= src.cols,
                 f"columns({start}, {sub.cols}) of the {T.show(src)}: start must be a multiple "
                 f"of 16 and the columns inside the tile")
    else:
        _require(sub.cols <= src.cols, f"columns(..., {sub.cols}) of the {T.show(src)}: more "
                 f"columns than the tile has")


@rule("mma_commit")
def _mma_commit(op, operands, results, num_warps: int) -> None:
    _blackwell("tk.mma_commit (tcgen05.commit)")


@rule("tensor_load", "tensor_store")
def _tensor_move(op, operands, results, num_warps: int) -> None:
    _blackwell("tk.load / tk.store of a tensor tile (tcgen05.ld/st)")
    tt, rt = (operands[0], results[0]) if results else operands
    _require(isinstance(rt, T.RT) and (rt.dtype, rt.rows, rt.cols, rt.layout, rt.scope) ==
             (tt.dtype, tt.rows, tt.cols, "tmem", "warpgroup"), f"{T.show(tt)} moves to and "
             f"from an {tt.dtype} {tt.rows}x{tt.cols} register tile in the tmem layout of "
             f"warpgroup scope (warp w of a warpgroup reaches lanes 32w..32w+31), got "
             f"{T.show(rt)}")
    _require(num_warps % 4 == 0, f"{T.show(tt)}: tcgen05.ld/st move it by warpgroups; the "
             f"kernel has {num_warps} warp(s)")


def check_op(op: ir.OpView, num_warps: int) -> None:
    """Raise a CompilationError at op's location if op breaks a tile rule."""
    try:
        _check(op, num_warps)
    except _Fail as e:
        raise error_at(op.location, str(e)) from None
