"""tk-allocate-smem: place shared tiles, semaphores and reduction scratch in
dynamic shared memory.

Shared tiles and vectors (and arrays of them) get consecutive offsets,
swizzled ones first (1024-byte aligned, as the hardware's swizzle patterns
repeat every 1024 bytes; 128 otherwise, which a TMA box needs), then the semaphores
(8 bytes each). Block reductions that cross warps exchange partial results
through f32 scratch after the tiles; reductions that can share one exchange
(one barrier) are grouped, and consecutive groups alternate between two
buffers so that none needs a barrier after it (see _place_exchanges). The
total is checked against the 227 KiB a block may use, at the line that
overflows it.
"""
from __future__ import annotations

from mlir import ir

from ..dialects import contracts, tk, types as T
from ..errors import error_at
from .. import target


def _max_shared() -> int:
    """Dynamic shared memory a block may have on the kernel's target."""
    return target.current().max_shared_bytes


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _scratch(op, num_warps: int) -> int:
    """Shared scratch bytes op needs (its `scratch` trait), 0 for most ops."""
    d = tk.op_def(op)
    return d.scratch(op, num_warps) if d is not None and d.scratch else 0


def _exchange_groups(func, num_warps: int) -> list[list]:
    """Reductions that cross warps, grouped so that each group shares one
    exchange (one barrier): a reduction joins the group before it when it sits
    in the same block and its operand already exists where that group starts."""
    groups: list[list] = []
    def scan(block):
        position = {}
        current: list = []
        for i, op in enumerate(block.operations):
            position[op.operation] = i
            for region in op.operation.regions:
                for inner in region.blocks:
                    scan(inner)
            if not _scratch(op.operation, num_warps):
                continue
            src = op.operation.operands[0]
            owner = src.owner if not isinstance(src, ir.BlockArgument) else None
            ready = owner is None or (owner in position and current and
                                      position[owner] < position[current[0]])
            if current and ready:
                current.append(op.operation)
            else:
                current = [op.operation]
                groups.append(current)
    scan(func.regions[0].blocks[0])
    return groups


def _place(op, top: int) -> int:
    """Give an allocation (a tile, a semaphore, or an array of either) its
    offset and the stride between its elements; return the new top."""
    t = T.parse(op.results[0].type)
    count = tk.array_count(op) or 1
    if isinstance(t, T.ST):
        # Swizzle patterns are computed on absolute address bits and repeat every
        # 8 rows of the swizzle span (at most 1024 bytes): align each element to it.
        align = target.current().swizzle_align if t.swizzle else target.current().smem_align
        stride = _align(t.nbytes, align)
    elif isinstance(t, T.SV):
        # Every element of an array may be a TMA destination: each 128-aligned.
        align = target.current().smem_align
        stride = _align(t.nbytes, align)
    else:
        align = stride = 8     # an mbarrier is one 8-byte word
    top = _align(top, align)
    contracts.OFFSET.set(op, top)
    contracts.STRIDE.set(op, stride)
    top += stride * count
    if top > _max_shared():
        raise error_at(op.location, f"shared memory exhausted: the tiles and semaphores "
                       f"allocated up to here need {top} bytes, a block has {_max_shared()}")
    return top


def allocate_smem(module: ir.Module) -> None:
    for func in module.body.operations:
        num_warps = contracts.NUM_WARPS.get(func)
        allocs = []
        def visit(op):
            if (d := tk.op_def(op)) is not None and d.allocates:
                allocs.append(op)
            return ir.WalkResult.ADVANCE
        func.operation.walk(visit)
        top = 0
        # Swizzled tiles first (1024-byte aligned), then other tiles and vectors
        # (128), then the 8-byte semaphores: no padding between classes.
        def order(op):
            t = T.parse(op.results[0].type)
            return (not isinstance(t, (T.ST, T.SV)), not getattr(t, "swizzle", 0))
        for op in sorted(allocs, key=order):
            top = _place(op, top)
        top = _place_exchanges(func, num_warps, _align(top, target.current().smem_align))
        swizzled = [op for op in allocs if getattr(T.parse(op.results[0].type), "swizzle", 0)]
        if swizzled:
            # lowering/kernel.py rounds the base up to this alignment at run time.
            contracts.SMEM_ALIGN.set(func, target.current().swizzle_align)
            top += target.current().swizzle_align
            if top > _max_shared():
                pad = target.current().swizzle_align
                raise error_at(swizzled[-1].location, f"shared memory exhausted: the tiles, "
                               f"semaphores and scratch need {top - pad} bytes, plus {pad} to "
                               f"align swizzled tiles, and a block has {_max_shared()}")
        contracts.SMEM_BYTES.set(func, top)


def _place_exchanges(func, num_warps: int, base: int) -> int:
    """Give each exchange group its scratch. Groups at the kernel's top level
    alternate between two buffers, so a group never overwrites the buffer the
    previous group's threads may still be reading (the barrier of the group in
    between orders them) and needs no barrier after it. A group inside a loop
    or branch may meet itself again with nothing in between: it keeps one,
    and a third buffer of its own."""
    groups = _exchange_groups(func, num_warps)
    if not groups:
        return base
    size = max(sum(_scratch(op, num_warps) for op in g) for g in groups)
    top_block = func.regions[0].blocks[0]
    parity, nested = 0, False
    for gid, group in enumerate(groups):
        at_top = group[0].block == top_block
        offset = base + (parity * size if at_top else 2 * size)
        parity ^= at_top
        nested |= not at_top
        for op in group:
            contracts.SCRATCH_OFFSET.set(op, offset)
            contracts.EXCHANGE_GROUP.set(op, gid)
            contracts.EXCHANGE_SYNC_AFTER.set(op, not at_top)
            offset += _scratch(op, num_warps)
    top = base + (3 if nested else 2) * size
    if top > _max_shared():
        raise error_at(groups[0][0].location, f"shared memory exhausted: tiles and reduction "
                       f"scratch need {top} bytes, a block has {_max_shared()}")
    return top
