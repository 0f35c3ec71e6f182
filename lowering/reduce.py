"""Lowering of tk.reduce, derived from the tile's layout in three steps:
combine the registers that hold one output element, then butterfly-shuffle
across the lane bits that step along the reduced axis, then exchange through
shared memory across such warp bits. Every thread ends with the whole result
(the output layout replicates those lane and warp bits). Partial results are
combined in f32 (an i32 tile's in i32, wrapping as its adds do) and in a
fixed order, so all replicas agree bit for bit.
"""
from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, llvm, nvvm

from ..dialects import contracts
from ..dialects import types as T
from .context import LoweringContext, c32, lowers, ptr
from .fragments import F32, Fragment, convert
from .memory import smem_addr

COMBINE = {F32: {"sum": arith.addf, "max": arith.maximumf, "min": arith.minimumf},
           "i32": {"sum": arith.addi, "max": arith.maxsi, "min": arith.minsi}}


def _partial_dtype(dtype: str) -> str:
    """The dtype a tile's partial results combine in: i32's own, else f32."""
    return "i32" if dtype == "i32" else F32


def _shuffle_xor(x: ir.Value, lane_mask: int) -> ir.Value:
    return nvvm.shfl_sync(x.type, c32(-1), x, c32(lane_mask), c32(31), nvvm.ShflKind.bfly)


@lowers("tk.reduce")
def lower_reduce(ctx: LoweringContext, op, src: Fragment) -> Fragment:
    if op.result in ctx.values:
        return ctx.lookup(op.result)   # lowered with the first reduction of its group
    if not contracts.EXCHANGE_GROUP.has(op):
        return _within_warps(ctx, op)[0]
    # The reductions of one exchange group share its barrier: lowered together,
    # at the first of them, which binds the others' results here.
    group = ctx.exchange_groups[contracts.EXCHANGE_GROUP.get(op)]
    partials = [_within_warps(ctx, member) for member in group]
    sync_after = contracts.EXCHANGE_SYNC_AFTER.get(op)
    results = _across_warps(ctx, group, partials, sync_after)
    for member, frag in zip(group, results):
        ctx.bind(member.result, frag)
    return ctx.lookup(op.result)


def _keep(op) -> int:
    return 0 if op.axis == "row" else 1


def _within_warps(ctx: LoweringContext, op) -> tuple[Fragment, list]:
    """Steps 1 and 2: registers, then lane shuffles. Returns the result as a
    fragment (complete when no warp bit is reduced) and the raw partials (f32,
    or i32 for an i32 tile)."""
    tile: Fragment = ctx.lookup(op.src)
    keep = _keep(op)
    inner = _partial_dtype(tile.dtype)
    combine = COMBINE[inner][op.kind]
    out_layout = tile.layout.slice(keep)
    partial: list = [None] * out_layout.num_regs
    for i, r in enumerate(tile.regs):
        j = tile.layout.slice_register(keep, i)
        x = convert(r, tile.dtype, inner)
        partial[j] = x if partial[j] is None else combine(partial[j], x)
    for bit, basis in enumerate(tile.layout.lane):
        if basis is not None and basis[0] != keep:
            partial = [combine(p, _shuffle_xor(p, 1 << bit)) for p in partial]
    assert T.scope_warps(tile.scope, ctx.num_warps) == ctx.num_warps or \
        not tile.layout.warp_bits_along(1 - keep), \
        "tk-verify refuses reductions across the warps of a tile narrower than the block"
    regs = [convert(p, inner, tile.dtype) for p in partial]
    return Fragment(regs, out_layout, tile.dtype, tile.scope), partial


def _across_warps(ctx, group, partials, sync_after: bool) -> list[Fragment]:
    """Step 3 for a group of reductions at once: every thread writes its
    partials, one barrier, every thread combines the partials of the warps
    that differ from its own only in reduced warp bits (in a fixed order, so
    all threads agree bit for bit)."""
    warp, lane = ctx.warp(), ctx.lane()
    def slot(base, w: ir.Value, n: int, j: int) -> ir.Value:   # (4-byte slots: f32 or i32)
        index = arith.addi(arith.muli(arith.addi(arith.muli(w, c32(32)), lane), c32(n)), c32(j))
        return llvm.getelementptr(ptr(3), base, [index], [-2**31], ir.F32Type.get(),
                                  llvm.GEPNoWrapFlags.inbounds)
    bases = [smem_addr(ctx.smem_base, c32(contracts.SCRATCH_OFFSET.get(op))) for op in group]
    for base, (_, partial) in zip(bases, partials):
        for j, p in enumerate(partial):
            llvm.store(p, slot(base, warp, len(partial), j), alignment=4)
    nvvm.barrier0()
    results = []
    for op, base, (frag, partial) in zip(group, bases, partials):
        tile = ctx.lookup(op.src)
        bits = tile.layout.warp_bits_along(1 - _keep(op))
        home = arith.andi(warp, c32(~sum(1 << b for b in bits)))
        inner = _partial_dtype(frag.dtype)
        combine = COMBINE[inner][op.kind]
        out = []
        for j in range(len(partial)):
            acc = None
            for s in range(1 << len(bits)):
                w = arith.ori(home, c32(sum(((s >> k) & 1) << b for k, b in enumerate(bits))))
                x = llvm.load(partial[j].type, slot(base, w, len(partial), j), alignment=4)
                acc = x if acc is None else combine(acc, x)
            out.append(convert(acc, inner, frag.dtype))
        results.append(frag.like(out))
    if sync_after:
        nvvm.barrier0()
    return results
