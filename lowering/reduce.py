"""Lowering of tk.reduce, derived from the tile's layout in three steps:
combine the registers that hold one output element, then butterfly-shuffle
across the lane bits that step along the reduced axis, then exchange through
shared memory across such warp bits. Every thread ends with the whole result
(the output layout replicates those lane and warp bits). Partial results are
combined in f32 and in a fixed order, so all replicas agree bit for bit.
"""
from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, llvm, nvvm

from ..dialects import types as T
from ..errors import error_at
from .compute import F32, convert
from .context import LoweringContext, c32, lowers, ptr
from .fragments import Fragment
from .memory import _smem_addr

COMBINE = {"sum": arith.addf, "max": arith.maximumf, "min": arith.minimumf}


def _shuffle_xor(x: ir.Value, lane_mask: int) -> ir.Value:
    return nvvm.shfl_sync(ir.F32Type.get(), c32(-1), x, c32(lane_mask), c32(31),
                          nvvm.ShflKind.bfly)


@lowers("tk.reduce")
def lower_reduce(ctx: LoweringContext, op) -> None:
    tile: Fragment = ctx.lookup(op.src)
    keep = 0 if op.axis == "row" else 1
    combine = COMBINE[op.kind]
    out_layout = tile.layout.slice(keep)
    partial: list = [None] * out_layout.num_regs
    for i, r in enumerate(tile.regs):
        j = tile.layout.slice_register(keep, i)
        x = convert(r, tile.dtype, F32)
        partial[j] = x if partial[j] is None else combine(partial[j], x)
    for bit, basis in enumerate(tile.layout.lane):
        if basis is not None and basis[0] != keep:
            partial = [combine(p, _shuffle_xor(p, 1 << bit)) for p in partial]
    if tile.layout.warp_bits_along(1 - keep):
        if tile.scope != "block":
            raise error_at(op.location, f"a {op.axis} reduction across the warps of a "
                           f"{tile.scope}-scope tile is not supported yet; use block scope")
        offset = ir.IntegerAttr(op.operation.attributes["scratch_offset"]).value
        partial = _across_warps(ctx, partial, tile.layout, keep, combine, offset)
    regs = [convert(p, F32, tile.dtype) for p in partial]
    ctx.bind(op.result, Fragment(regs, out_layout, tile.dtype, tile.scope))


def _across_warps(ctx, partial, layout, keep, combine, offset):
    bits = layout.warp_bits_along(1 - keep)
    n = len(partial)
    base = _smem_addr(ctx.smem_base, c32(offset))
    warp, lane = ctx.warp(), ctx.lane()
    def slot(w: ir.Value, j: int) -> ir.Value:
        index = arith.addi(arith.muli(arith.addi(arith.muli(w, c32(32)), lane), c32(n)), c32(j))
        return llvm.getelementptr(ptr(3), base, [index], [-2**31], ir.F32Type.get(),
                                  llvm.GEPNoWrapFlags.inbounds)
    for j, p in enumerate(partial):
        llvm.store(p, slot(warp, j), alignment=4)
    nvvm.barrier0()
    mask = sum(1 << b for b in bits)
    group = arith.andi(warp, c32(~mask))
    out = []
    for j in range(n):
        acc = None
        for s in range(1 << len(bits)):
            w_bits = sum(((s >> k) & 1) << b for k, b in enumerate(bits))
            x = llvm.load(ir.F32Type.get(), slot(arith.ori(group, c32(w_bits)), j), alignment=4)
            acc = x if acc is None else combine(acc, x)
        out.append(acc)
    nvvm.barrier0()   # the scratch may be reused by the next reduction
    return out
