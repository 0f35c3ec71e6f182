"""Lowering of the TMA ops (tk.tma_load/store/reduce_add/commit/wait/prefetch).

Each (tensor argument, tile box) pair used by a TMA op is one tensor map,
a kernel parameter of its own (lowering/kernel.py adds them): a generic
pointer to the 128-byte __grid_constant__ map. A swizzled tile is moved one
column block (one box of block_cols columns) at a time; coordinates are the
element offsets of the box, innermost dim first: the op's tile coordinates
scaled by the tile's extents, or taken as they are when the op counts
elements (dialects/contracts.py ELEMENTS). A shared vector is one box of
(1, ..., 1, length), unswizzled: the map of a 1-row tile of its length.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlir import ir
from mlir.dialects import arith, llvm, nvvm

from ..dialects import contracts, types as T
from .context import LoweringContext, c32, lowers, ptr
from .fragments import GlobalRef, SharedRef
from .memory import smem_addr
from .peers import select_by_rank


@dataclass(frozen=True)
class TensorMapSpec:
    """The box of one tensor map: what the host encodes for argument `arg`."""
    arg: int
    rows: int
    cols: int          # the box's inner extent: one column block of the tile
    swizzle: int
    dtype: str


def tensor_map_spec(arg: int, st: T.ST | T.SV) -> TensorMapSpec:
    if isinstance(st, T.SV):
        return TensorMapSpec(arg, 1, st.length, 0, st.dtype)
    return TensorMapSpec(arg, st.rows, st.block_cols, st.swizzle, st.dtype)


def _boxes(op, g: GlobalRef, st: T.ST | T.SV, coords: list[ir.Value]):
    """(shared byte offset, coordinates innermost first) per column block."""
    rank = g.type.rank
    elements = contracts.ELEMENTS.get(op, False)
    scaled = (lambda c, n: c) if elements else (lambda c, n: arith.muli(c, c32(n)))
    if isinstance(st, T.SV):     # the last coordinate counts vectors, the outer ones elements
        yield 0, [scaled(coords[rank - 1], st.length), *coords[:rank - 1][::-1]]
        return
    row = scaled(coords[rank - 2], st.rows)
    col = scaled(coords[rank - 1], st.cols)
    outer = coords[:rank - 2][::-1]
    for j in range(st.blocks):
        c0 = arith.addi(col, c32(j * st.block_cols)) if j else col
        yield j * st.rows * st.block_bytes, [c0, row, *outer]


def tensor_arguments(gl_value: ir.Value) -> list[ir.BlockArgument]:
    """The kernel arguments a TMA op's tensor may be: itself, or each rank's
    copy when it is a tk.peer_select of a tk.pgl argument's copies."""
    if isinstance(gl_value, ir.OpResult) and gl_value.owner.name == "tk.peer_select":
        return [ir.BlockArgument(v) for v in list(gl_value.owner.operands)[1:]]
    return [ir.BlockArgument(gl_value)]


def _tensor_map(ctx: LoweringContext, gl_value, st: T.ST) -> ir.Value:
    maps = [ctx.tensor_maps[tensor_map_spec(a.arg_number, st)] for a in tensor_arguments(gl_value)]
    if len(maps) == 1:
        return maps[0]
    rank = ctx.lookup(gl_value.owner.operands[0])      # (tk.peer_select picks by rank)
    return select_by_rank(rank, maps)


@lowers("tk.tma_load")
def lower_tma_load(ctx: LoweringContext, op, dst: SharedRef, src: GlobalRef, sem: SharedRef,
                   *indices: ir.Value) -> None:
    _load_boxes(ctx, op, dst, src, sem, indices, None)


@lowers("tk.tma_load_multicast")
def lower_tma_load_multicast(ctx: LoweringContext, op, dst: SharedRef, src: GlobalRef,
                             sem: SharedRef, mask: ir.Value, *indices: ir.Value) -> None:
    _load_boxes(ctx, op, dst, src, sem, indices,
                arith.trunci(ir.IntegerType.get_signless(16), mask))


def _load_boxes(ctx, op, dst: SharedRef, src: GlobalRef, sem: SharedRef, indices, mask) -> None:
    tmap = _tensor_map(ctx, op.src, dst.type)
    for offset, coords in _boxes(op, src, dst.type, list(indices)):
        to = llvm.addrspacecast(ptr(7), smem_addr(dst.ptr, c32(offset)))
        nvvm.CpAsyncBulkTensorGlobalToSharedClusterOp(to, tmap, coords, sem.ptr, [],
                                                      multicastMask=mask)


@lowers("tk.tma_store")
def lower_tma_store(ctx: LoweringContext, op, dst: GlobalRef, src: SharedRef,
                    *indices: ir.Value) -> None:
    tmap = _tensor_map(ctx, op.dst, src.type)
    # No fence here: the threads that wrote the tile fence after their writes
    # (passes/fences.py), which also covers a tile written by TMA (none needed).
    for offset, coords in _boxes(op, dst, src.type, list(indices)):
        nvvm.CpAsyncBulkTensorSharedCTAToGlobalOp(tmap, smem_addr(src.ptr, c32(offset)), coords)


@lowers("tk.tma_reduce_add")
def lower_tma_reduce_add(ctx: LoweringContext, op, dst: GlobalRef, src: SharedRef,
                         *indices: ir.Value) -> None:
    # As tma_store (same tensor map, same bulk group, fenced by the writers);
    # the element type of the add is the tensor map's.
    tmap = _tensor_map(ctx, op.dst, src.type)
    for offset, coords in _boxes(op, dst, src.type, list(indices)):
        nvvm.CpAsyncBulkTensorReduceOp(tmap, smem_addr(src.ptr, c32(offset)),
                                       nvvm.TMAReduxKind.ADD, coords)


@lowers("tk.tma_commit")
def lower_tma_commit(ctx: LoweringContext, op) -> None:
    nvvm.cp_async_bulk_commit_group()


@lowers("tk.tma_wait")
def lower_tma_wait(ctx: LoweringContext, op) -> None:
    nvvm.cp_async_bulk_wait_group(op.pending, read=ir.UnitAttr.get() if op.read else None)


@lowers("tk.tma_prefetch")
def lower_tma_prefetch(ctx: LoweringContext, op, src: GlobalRef, like: SharedRef) -> None:
    tmap = _tensor_map(ctx, op.src, T.parse(op.like.type))
    nvvm.PrefetchOp(tmap, tensormap=ir.UnitAttr.get())
