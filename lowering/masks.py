"""Lowering of the mask ops: tile_index, cmp, select (tk.where).

Indices come from the layout alone: register r of a thread holds the element
at thread_position (its lane and warp bits) + reg_position(r) (its register
bits), so a causal or ragged-tail mask costs a few integer ops per register
and no memory. Comparisons of bf16/f16 tiles are made in f32 (exact: every
bf16/f16 value is an f32), so a tile compares with an f32 scalar as Python
would compare the numbers.
"""
from __future__ import annotations

from mlir import ir
from mlir.dialects import arith

from ..dialects import tk, types as T
from .context import LoweringContext, c32, in_place, lowers
from .fragments import F32, Fragment, convert, layout_of


@lowers("tk.tile_index")
def lower_tile_index(ctx: LoweringContext, op, src: Fragment) -> Fragment:
    t = T.parse(op.result.type)
    layout, axis = layout_of(t, ctx.num_warps), op.axis
    base = in_place(ctx.thread_position(layout, t.scope)[axis])
    regs = [arith.addi(base, c32(layout.reg_position(r)[axis])) for r in range(layout.num_regs)]
    return Fragment(regs, layout, "i32", t.scope)


@lowers("tk.swap_pairs")
def lower_swap_pairs(ctx: LoweringContext, op, src: Fragment) -> Fragment:
    """A register permutation: the register holding (row, col ^ 1) of each one."""
    layout = src.layout
    where = {layout.reg_position(r): r for r in range(layout.num_regs)}
    partner = [where[(row, col ^ 1)] for row, col in map(layout.reg_position,
                                                          range(layout.num_regs))]
    return src.like([src.regs[p] for p in partner])


@lowers("tk.transpose")
def lower_transpose(ctx: LoweringContext, op, src: Fragment) -> Fragment:
    """No data moves: col is row's layout with the axes swapped
    (dialects/layout.py), so register r holds element (j, i) of the result
    where it held (i, j) of the source."""
    t = T.parse(op.result.type)
    return Fragment(src.regs, layout_of(t, ctx.num_warps), src.dtype, t.scope)


@lowers("tk.cmp")
def lower_cmp(ctx: LoweringContext, op, lhs: Fragment, rhs) -> Fragment:
    int_pred, float_pred = tk.COMPARISONS[op.predicate]
    if T.is_float(lhs.dtype):
        lhs = lhs.astype(F32)
        rhs = rhs.astype(F32) if isinstance(rhs, Fragment) else rhs   # a scalar is f32
        p = getattr(arith.CmpFPredicate, float_pred)
        out = lhs.zip_with(rhs, lambda x, y: arith.cmpf(p, x, y))
    else:
        p = getattr(arith.CmpIPredicate, int_pred)
        out = lhs.zip_with(rhs, lambda x, y: arith.cmpi(p, x, y))
    return out.like(out.regs, "bool")


@lowers("tk.select")
def lower_select(ctx: LoweringContext, op, mask: Fragment, a, b) -> Fragment:
    dtype = T.parse(op.result.type).dtype

    def registers(x) -> list[ir.Value]:    # a scalar is converted once, used by every register
        if isinstance(x, Fragment):
            return x.regs
        return [convert(x, T.dtype_of(x.type), dtype)] * len(mask.regs)
    return mask.like([arith.select(m, x, y) for m, x, y in
                      zip(mask.regs, registers(a), registers(b))], dtype)
