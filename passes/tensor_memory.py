"""The kernel-wide rules of Blackwell tensor memory (part of tk-verify).

A tensor tile (tk.tensor_tile) is allocated and freed by the whole block at
the kernel's top level (its tile rule), so one walk of the top level in
program order sees every allocation's lifetime:
  - the tiles live at any point fit tensor memory's 512 columns (each takes
    its power-of-two allocation);
  - every tile is freed once before the kernel ends (tcgen05.dealloc:
    tensor memory not given back stays taken for the next kernel on the
    SM), and no op uses it after;
  - every tcgen05.mma is followed by a tk.mma_commit: without one nothing
    can wait for the MMA, so no read of its tile is ordered after it;
  - pair=True MMAs (over a cluster's two blocks) need a cluster of 2, and
    make every tcgen05 op of the kernel the pair's (contracts.CTA_PAIR).
"""
from __future__ import annotations

from mlir import ir

from ..dialects import contracts, tk, types as T
from .. import target
from ..errors import error_at, line_of
from .walk import walk_ops

def _line(op) -> str:
    return line_of(op.location)


def _role(op) -> str | None:
    d = tk.op_def(op)
    return d.tensor_memory if d is not None else None


def _top_level(op, func) -> ir.Operation:
    while op.parent is not None and op.parent != func:
        op = op.parent
    return op


def check_tensor_memory(func) -> None:
    top = list(func.regions[0].blocks[0].operations)
    if not any(_role(op) == "alloc" for op in top):
        _check_mmas(func)
        return
    position = {op: i for i, op in enumerate(top)}
    budget = target.current().tmem_columns
    live: dict[ir.Operation, int] = {}         # alloc_tt -> its columns
    for op in top:
        op = op.operation
        if _role(op) == "alloc":
            live[op] = T.parse(op.results[0].type).allocated_columns
            used = sum(live.values())
            if used > budget:
                tiles = ", ".join(f"{c} at {_line(a)}" for a, c in live.items())
                raise error_at(op.location, f"tensor memory exhausted: the tensor tiles live "
                               f"here take {used} columns ({tiles}), a block has "
                               f"{budget}; free one first (tk.free_tensor_tile) or use "
                               f"fewer columns")
            _check_lifetime(func, op, position)
        elif _role(op) == "free":
            live.pop(op.operands[0].owner, None)
    _check_mmas(func)


def _check_lifetime(func, alloc, position) -> None:
    """One free of the tile, at the top level, after every other use."""
    tile = alloc.results[0]
    frees = [u.owner for u in tile.uses if _role(u.owner) == "free"]
    if not frees:
        raise error_at(alloc.location, "this tensor tile is never freed: call "
                       "tk.free_tensor_tile(t) after its last use (a kernel gives its tensor "
                       "memory back before it exits, or the next one on the SM waits for it)")
    frees.sort(key=lambda f: position[f])
    if len(frees) > 1:
        raise error_at(frees[1].location, f"this tensor tile was already freed at "
                       f"{_line(frees[0])}")
    end = position[frees[0]]
    for user in _users(tile):
        if user != frees[0] and position[_top_level(user, func)] > end:
            raise error_at(user.location, f"this uses a tensor tile freed at "
                           f"{_line(frees[0])}: its columns may belong to another tile by now")


def _users(tile):
    """The ops using a tensor tile, directly or through views of it."""
    for use in tile.uses:
        user = use.owner
        yield user
        d = tk.op_def(user)
        if d is not None and d.view_of is not None:
            yield from _users(user.results[0])


def _check_mmas(func) -> None:
    """No tcgen05.mma without a tk.mma_commit after it, in program order;
    the MMAs all pair blocks (in a cluster of 2: recorded for the lowering,
    whose every tcgen05 op is then cta_group::2) or none does."""
    pending, mmas, cluster = [], [], 1
    def visit(op):
        nonlocal cluster
        d = tk.op_def(op)
        if d is not None and d.cluster:
            cluster = op.opview.size
        if _role(op) == "async":
            pending.append(op)
            mmas.append(op)
        elif _role(op) == "commit":
            pending.clear()
    walk_ops(func.operation, visit)
    paired = [op for op in mmas if op.opview.pair]
    if paired and len(paired) < len(mmas):
        single = next(op for op in mmas if not op.opview.pair)
        raise error_at(single.location, f"this MMA is one block's, but the MMA at "
                       f"{_line(paired[0])} pairs blocks (pair=True): a kernel's tcgen05 ops "
                       f"all work on one block or all on the pair (cta_group)")
    if paired and cluster != 2:
        raise error_at(paired[0].location, f"pair=True is one MMA over the two blocks of a "
                       f"cluster: call tk.use_cluster(2) at the kernel's top level (it has "
                       f"{'no cluster' if cluster == 1 else f'clusters of {cluster}'})")
    if paired:
        contracts.CTA_PAIR.set(func, True)
        def mark(op):
            if _role(op) is not None:
                contracts.CTA_PAIR.set(op, True)
        walk_ops(func.operation, mark)
    if pending:
        raise error_at(pending[0].location, "no tk.mma_commit(sem) follows this MMA: it "
                       "completes asynchronously, and only a commit's semaphore phase tells "
                       "when (to read its tensor tile, or reuse its shared operands); commit "
                       "after the last MMA and tk.wait on that semaphore")
