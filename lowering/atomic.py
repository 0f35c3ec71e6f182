"""Lowering of tk.atomic_add (a register tile added into global memory) and
tk.store_partial (one of several partial sums of a tile, the last of which
stores the total).

Each piece of consecutive registers that tk.store would write with one
st.global.v{1,2,4} becomes one `red.global.add{.v2,.v4}.f32` (vector red:
PTX ISA 8.1, sm_90), under the same guard as the store: in bounds, and on
the first of the threads that hold the element (replicated layouts, e.g. a
row vector held by every lane of a quad, must add it once). The launch
checks that make a store's 16-byte vectors aligned make these aligned too.
`red` (no result) rather than `atom`: nothing waits for the old value.
f32 red flushes denormal inputs to zero (SASS REDG ... .FTZ), as atom.add.f32.
"""
from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, llvm, scf

from ..dialects import types as T
from .context import LoweringContext, build_vector, c32, constant, i32, lowers, ptr, split_vector
from .fragments import Fragment, GlobalRef, convert
from .memory import FROM_L2, _and, _guarded, _guarded_load, _lt, global_pieces


def _red_add(addr: ir.Value, regs: list[ir.Value]) -> None:
    n = len(regs)
    vec = "" if n == 1 else f".v{n}"
    vals = "$1" if n == 1 else "{" + ", ".join(f"${i + 1}" for i in range(n)) + "}"
    llvm.inline_asm(None, [addr, *regs], f"red.global.add{vec}.f32 [$0], {vals};",
                    ",".join(["l"] + ["f"] * n), has_side_effects=True)


@lowers("tk.atomic_add")
def lower_atomic_add(ctx: LoweringContext, op, dst: GlobalRef, frag: Fragment,
                     *indices: ir.Value) -> None:
    for r0, n, addr, conds in global_pieces(ctx, dst, frag, indices):
        regs = frag.regs[r0:r0 + n]
        _guarded(_and(conds), lambda: _red_add(addr, regs))


@lowers("tk.store_partial")
def lower_store_partial(ctx: LoweringContext, op, dst: GlobalRef, frag: Fragment,
                        workspace: GlobalRef, counters: GlobalRef, parts: ir.Value,
                        *indices: ir.Value) -> None:
    """Add the part into the workspace; count it on this thread's counter with
    an acq_rel atomic (its release orders the thread's adds before the count,
    its acquire makes the other parts' adds visible to the last one); the
    last part reads the sum back from L2, stores it and zeroes what it used.
    Counting per thread needs no barrier or broadcast: a thread holds the same
    elements in every part (one layout), so its counter covers exactly them.
    A tile wholly past dst's end is skipped: its number would be another
    tile's (the next outer index's first)."""
    _guarded(_tile_inside(dst, frag, indices),
             lambda: _add_and_count(ctx, dst, frag, workspace, counters, parts, indices))


def _tile_axes(dst: GlobalRef, frag: Fragment, indices):
    """Per dim of dst: (coordinate, its first element, the dim's extent, how
    many coordinates the dim has). Outer dims count elements, tile dims tiles."""
    shape = frag.layout.shape
    outer = len(dst.dims) - len(shape)
    for d, (c, extent) in enumerate(zip(indices, dst.dims)):
        if d < outer:
            yield c, c, extent, extent
        else:
            rows = c32(shape[d - outer])
            yield c, arith.muli(c, rows), extent, arith.ceildivui(extent, rows)


def _tile_inside(dst: GlobalRef, frag: Fragment, indices) -> ir.Value:
    """i1: the tile at `indices` starts inside dst."""
    return _and([_lt(first, extent) for _, first, extent, _ in _tile_axes(dst, frag, indices)])


def _add_and_count(ctx, dst, frag, workspace, counters, parts, indices) -> None:
    ws_pieces = list(global_pieces(ctx, workspace, frag, indices))
    for r0, n, addr, conds in ws_pieces:
        regs = frag.regs[r0:r0 + n]
        _guarded(_and(conds), lambda: _red_add(addr, regs))
    slot = _counter_slot(ctx, dst, frag, indices)
    counter = llvm.getelementptr(ptr(1), counters.ptr, [slot], [-2**31], i32(),
                                 llvm.GEPNoWrapFlags.inbounds)
    old = llvm.inline_asm(i32(), [counter], "atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;",
                          "=r,l", has_side_effects=True)
    last = arith.cmpi(arith.CmpIPredicate.eq, old, arith.subi(parts, c32(1)))
    _guarded(last, lambda: (_store_total(ctx, dst, frag, indices, ws_pieces),
                            llvm.store(c32(0), counter, alignment=4)))


def _counter_slot(ctx: LoweringContext, dst: GlobalRef, frag: Fragment, indices) -> ir.Value:
    """i64 index of this thread's counter: the tile's row-major number among
    dst's tiles (_tile_axes: outer dims count elements, tile dims tiles) times
    the threads of the scope, plus the thread's place in its scope (in i64:
    tiles x threads passes 2^31 from about 2^37 elements of dst)."""
    i64 = ir.IntegerType.get_signless(64)
    tile = arith.constant(i64, 0)
    for c, _, _, count in _tile_axes(dst, frag, indices):
        tile = arith.addi(arith.muli(tile, arith.extui(i64, count)), arith.extui(i64, c))
    threads = 32 * T.SCOPES.get(frag.scope, ctx.num_warps)
    place = arith.andi(ctx.tid(), c32(threads - 1)) if frag.scope != "block" else ctx.tid()
    return arith.addi(arith.muli(tile, arith.constant(i64, threads)), arith.extui(i64, place))


def _store_total(ctx: LoweringContext, dst: GlobalRef, frag: Fragment, indices,
                 ws_pieces) -> None:
    """The last part: the sum from the workspace (ld.global.cg: from L2, where
    the other blocks' adds landed) into dst, and zeros back into the workspace.
    Every load is issued before the first store: ptxas cannot move a load of
    the workspace above a store to dst (they may alias), so interleaved they
    would wait for L2 one piece at a time."""
    f32 = ir.F32Type.get()
    isz = T.itemsize(dst.type.dtype)
    totals = []
    for r0, n, ws_addr, ws_conds in ws_pieces:
        vtype = ir.VectorType.get([n], f32) if n > 1 else f32
        ok = _and(ws_conds)
        totals.append(_guarded_load(ws_addr, ok, vtype, _zeros(n), 4 * n, FROM_L2))
    for total, (_, n, addr, conds) in zip(totals, global_pieces(ctx, dst, frag, indices)):
        out = build_vector([convert(r, "f32", dst.type.dtype) for r in split_vector(total, n)],
                           dst.type.dtype)
        _guarded(_and(conds), lambda: llvm.store(out, addr, alignment=n * isz))
    for _, n, ws_addr, ws_conds in ws_pieces:
        _guarded(_and(ws_conds), lambda: llvm.store(_zeros(n), ws_addr, alignment=4 * n))


def _zeros(n: int) -> ir.Value:
    zero = constant(0.0, "f32")
    return build_vector([zero] * n, "f32") if n > 1 else zero
