"""Lowering of the thread-position ops and the block barrier."""
from __future__ import annotations

from mlir.dialects import arith, gpu, nvvm

from .context import LoweringContext, c32, i32, lowers

_DIMS = (gpu.Dimension.x, gpu.Dimension.y, gpu.Dimension.z)


@lowers("tk.block_id")
def lower_block_id(ctx: LoweringContext, op):
    return arith.index_cast(i32(), gpu.block_id(_DIMS[op.dim]))


@lowers("tk.grid_dim")
def lower_grid_dim(ctx: LoweringContext, op):
    return arith.index_cast(i32(), gpu.grid_dim(_DIMS[op.dim]))


@lowers("tk.thread_id")
def lower_thread_id(ctx: LoweringContext, op):
    return ctx.tid()


@lowers("tk.lane_id")
def lower_lane_id(ctx: LoweringContext, op):
    return ctx.lane()


@lowers("tk.warp_id")
def lower_warp_id(ctx: LoweringContext, op):
    return ctx.uniform_warp()


@lowers("tk.warpgroup_id")
def lower_warpgroup_id(ctx: LoweringContext, op):
    return arith.shrui(ctx.uniform_warp(), c32(2))


@lowers("tk.barrier")
def lower_barrier(ctx: LoweringContext, op) -> None:
    nvvm.barrier0()
