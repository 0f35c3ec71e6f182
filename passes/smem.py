"""tk-allocate-smem: place shared tiles and reduction scratch in dynamic shared memory.

Shared tiles get consecutive offsets (1024-byte aligned when swizzled, as the
hardware's swizzle patterns repeat every 1024 bytes; 128 otherwise). Block
reductions that cross warps share one f32 scratch region after the tiles:
they run one at a time, each ending with a barrier. The total is checked
against the 227 KiB a block may use, at the line that overflows it.
"""
from __future__ import annotations

from mlir import ir

from ..dialects import layout as layouts, types as T
from ..errors import error_at
from .verify import MAX_SHARED_BYTES


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _i64(v: int) -> ir.Attribute:
    return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), v)


def _reduction_scratch(op, num_warps: int) -> int:
    tile = T.parse(op.operands[0].type)
    warps = T.SCOPES.get(tile.scope, num_warps)
    layout = layouts.tile_layout(tile.layout, tile.rows, tile.cols, warps)
    keep = 0 if ir.StringAttr(op.attributes["axis"]).value == "row" else 1
    if not layout.warp_bits_along(1 - keep):
        return 0
    return warps * 32 * layout.slice(keep).num_regs * 4


def allocate_smem(module: ir.Module) -> None:
    for func in module.body.operations:
        num_warps = ir.IntegerAttr(func.attributes["tk.num_warps"]).value
        tiles, reductions = [], []
        def visit(op):
            if op.name == "tk.alloc_st":
                tiles.append(op)
            elif op.name == "tk.reduce":
                reductions.append(op)
            return ir.WalkResult.ADVANCE
        func.operation.walk(visit)
        top = 0
        for op in tiles:
            st = T.parse(op.results[0].type)
            top = _align(top, 1024 if st.swizzle else 128)
            op.attributes["offset"] = _i64(top)
            top += st.nbytes
            if top > MAX_SHARED_BYTES:
                raise error_at(op.location, f"shared memory exhausted: the tiles allocated up "
                               f"to here need {top} bytes, a block has {MAX_SHARED_BYTES}")
        scratch = max([_reduction_scratch(op, num_warps) for op in reductions] + [0])
        if scratch:
            top = _align(top, 128)
            for op in reductions:
                op.attributes["scratch_offset"] = _i64(top)
            top += scratch
        if top > MAX_SHARED_BYTES:
            raise error_at(reductions[0].location, f"shared memory exhausted: tiles and "
                           f"reduction scratch need {top} bytes, a block has {MAX_SHARED_BYTES}")
        func.attributes["tk.smem_bytes"] = _i64(top)
        func.attributes["tk.smem_swizzled"] = ir.BoolAttr.get(
            any(T.parse(op.results[0].type).swizzle for op in tiles))
