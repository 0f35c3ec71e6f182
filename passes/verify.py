"""tk-verify: the tile rules, reported at the user's source line.

`check_op` is the single statement of the rules. The frontend calls it on
each op as it is built (so the error points at the line that made it) and
the verify pass calls it on every op of a module (so IR read back from text
is held to the same rules).
"""
from __future__ import annotations

from mlir import ir

from ..dialects import layout as layouts, tk, types as T
from ..errors import error_at

MAX_SHARED_BYTES = 227 * 1024


class _Fail(Exception):
    pass


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise _Fail(message)


def _show(t) -> str:
    if isinstance(t, T.RT):
        return f"{t.dtype} {t.rows}x{t.cols} tile ({t.layout}, {t.scope})"
    if isinstance(t, T.RV):
        return f"{t.dtype} vector of {t.length}"
    if isinstance(t, T.GL):
        return f"{t.dtype} global of rank {t.rank}"
    if isinstance(t, T.ST):
        return f"{t.dtype} {t.rows}x{t.cols} shared tile"
    return str(t)


def _layout_ok(t, num_warps: int) -> None:
    if not isinstance(t, T.RT):
        return
    _require(t.scope in ("warp", "warpgroup", "block"),
             f"scope must be warp, warpgroup or block, got {t.scope!r}")
    warps = T.SCOPES.get(t.scope, num_warps)
    _require(warps <= num_warps, f"a {t.scope}-scope tile needs {warps} warps, "
             f"the kernel has num_warps={num_warps}")
    try:
        layouts.tile_layout(t.layout, t.rows, t.cols, warps)
    except layouts.LayoutError as e:
        raise _Fail(f"{_show(t)}: {e}") from None


def _memory_access(op, mem, tile, n_indices: int, verb: str) -> None:
    if isinstance(mem, T.GL):
        _require(n_indices == mem.rank, f"{verb} needs {mem.rank} coordinates for a rank-"
                 f"{mem.rank} tensor (one per dim), got {n_indices}")
        tile_rank = 2 if isinstance(tile, T.RT) else 1
        _require(mem.rank >= tile_rank, f"a rank-{mem.rank} tensor cannot hold a "
                 f"{tile_rank}-D tile")
        _require(tile.dtype == mem.dtype, f"{verb}: the tile is {tile.dtype} but the tensor "
                 f"is {mem.dtype}; convert with .to(tk.{mem.dtype})")
    elif isinstance(mem, T.ST):
        _require(isinstance(tile, T.RT) and (tile.rows, tile.cols) == (mem.rows, mem.cols)
                 and tile.dtype == mem.dtype,
                 f"{verb}: {_show(tile)} does not match {_show(mem)}")


def _check(op: ir.OpView, num_warps: int) -> None:
    name = op.operation.name.removeprefix("tk.")
    operands = [T.parse(v.type) for v in op.operation.operands]
    results = [T.parse(r.type) for r in op.operation.results]
    for t in operands + results:
        _layout_ok(t, num_warps)
        _require(not (isinstance(t, (T.RT, T.RV)) and t.dtype.startswith("f8")),
                 f"fp8 ({t.dtype if isinstance(t, (T.RT, T.RV)) else ''}) register tiles are "
                 f"not lowered yet: fp8 can be declared (tk.gl[tk.f8e4m3]) but not loaded, "
                 f"converted or computed with")
    if name == "load":
        _memory_access(op, operands[0], results[0], len(operands) - 1, "tk.load")
    elif name == "store":
        _memory_access(op, operands[0], operands[1], len(operands) - 2, "tk.store")
    elif name == "copy":
        gl, st = (operands[0], operands[1]) if isinstance(operands[0], T.GL) else operands[1::-1]
        _require(gl.dtype == st.dtype, f"tk.copy: {_show(st)} and {_show(gl)} differ in dtype")
        _require(len(operands) - 2 == gl.rank, f"tk.copy needs {gl.rank} coordinates")
        _require(gl.rank >= 2, "tk.copy needs a tensor of rank 2 or more")
        _require(st.cols * T.itemsize(st.dtype) % 16 == 0,
                 "tk.copy moves 16-byte vectors: shared tile rows must be a multiple of 16 bytes")
    elif name in tk.BINARY:
        lhs, rhs = operands
        if rhs is not None:
            _require(type(lhs) is type(rhs) and lhs.shape == rhs.shape and lhs.dtype == rhs.dtype,
                     f"{name}: operands differ: {_show(lhs)} and {_show(rhs)}")
            if isinstance(lhs, T.RT):
                _require(lhs == rhs, f"{name}: operands differ in layout or scope: "
                         f"{_show(lhs)} and {_show(rhs)}")
        else:
            _require(isinstance(op.operation.operands[1].type, ir.F32Type),
                     f"{name}: a scalar operand must be f32")
    elif name == "cvt":
        _require(operands[0].shape == results[0].shape, "cvt changes the dtype only")
    elif name == "reduce":
        _require(isinstance(operands[0], T.RT), "reductions apply to register tiles")
        _require(op.kind in tk.REDUCTIONS, f"reduction kind must be one of {tk.REDUCTIONS}")
        _require(op.axis in tk.AXES, "reduction axis must be row or col")
    elif name == "broadcast":
        tile, vec = operands
        extent = tile.rows if op.axis == "row" else tile.cols
        _require(isinstance(vec, T.RV) and vec.length == extent,
                 f"{op.kind}_{op.axis}: needs a vector of {extent} "
                 f"({'one per row' if op.axis == 'row' else 'one per column'}), got {_show(vec)}")
        _require(vec.dtype == tile.dtype, f"{op.kind}_{op.axis}: the vector is {vec.dtype}, "
                 f"the tile {tile.dtype}; convert one with .to()")
    elif name == "alloc_st":
        st = results[0]
        _require(st.swizzle in T.SWIZZLES, f"swizzle must be one of {T.SWIZZLES} bytes")
        _require(st.nbytes <= MAX_SHARED_BYTES, f"{_show(st)} needs {st.nbytes} bytes; a block "
                 f"has {MAX_SHARED_BYTES} bytes of shared memory")


def check_op(op: ir.OpView, num_warps: int) -> None:
    """Raise a CompilationError at op's location if op breaks a tile rule."""
    try:
        _check(op, num_warps)
    except _Fail as e:
        raise error_at(op.location, str(e)) from None


def verify(module: ir.Module) -> None:
    """The tk-verify pass."""
    for func in module.body.operations:
        num_warps = ir.IntegerAttr(func.attributes["tk.num_warps"]).value
        def visit(op):
            if op.operation.name.startswith("tk."):
                check_op(op.opview, num_warps)
            return ir.WalkResult.ADVANCE
        func.operation.walk(visit)
