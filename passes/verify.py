"""tk-verify: every op of a module held to its tile rule, and the checks
that need the whole function, reported at the user's source line.

The tile rules belong to the dialect (dialects/tile_rules.py: one per op,
applied to each op as the frontend builds it, too); this pass applies them
to IR however it was made (read back from text, say) and adds what one op
cannot show: no block barrier under thread-dependent control flow
(passes/uniform.py), no wgmma operand picked per thread, no shared tile
chosen at run time, no async result read before its wait
(passes/async_results.py), TMA writes done before a signal
(passes/signal_order.py), tensor memory's lifetimes and budget
(passes/tensor_memory.py).
"""
from __future__ import annotations

import functools
from typing import Callable

from mlir import ir

from ..dialects import contracts, tk, types as T
from ..dialects.tile_rules import check_op
from ..errors import error_at
from .async_results import check_async_results
from .uniform import Uniformity
from .signal_order import check_signals
from .tensor_memory import check_tensor_memory
from .walk import walk_ops


def _under_varying_control(op, uniform: Uniformity) -> bool:
    """Does an if or for around op take its path by a value `uniform` finds
    varying?"""
    parent = op.parent
    while parent is not None and parent.name != "func.func":
        if parent.name == "scf.if":
            conds = [parent.operands[0]]
        elif parent.name == "scf.for":
            conds = list(parent.operands)[:3]
        else:
            conds = []
        if any(uniform.varies(c) for c in conds):
            return True
        parent = parent.parent
    return False


def _check_uniform(op, num_warps: int, uniform: Uniformity,
                   lanes: Callable[[], Uniformity]) -> None:
    """A block barrier under control flow that differs between threads hangs
    (or worse): refuse it at its line. A named barrier may sit under a warp's
    or warpgroup's branch (it counts whole warps), but not under one that
    splits the lanes of a warp (`lanes()`: the function's lane uniformity)."""
    d = tk.op_def(op)
    if d is None:
        return
    if d.has_barrier(op, num_warps):
        if _under_varying_control(op, uniform):
            raise error_at(op.location, "this op synchronises the whole block (bar.sync), but "
                           "it sits under control flow that depends on the thread, lane or warp "
                           "id, so some threads would never reach it; move it out of that "
                           "if/for")
    elif d.named_barrier is not None and _under_varying_control(op, lanes()):
        raise error_at(op.location, f"this {tk.spelled(d)} counts whole warps (bar.sync and "
                       f"bar.arrive take every lane of a warp at once), but it sits under "
                       f"control flow that differs between the lanes of one warp (the lane "
                       f"or thread id, or tk.elect_leader()), so a warp would reach it with "
                       f"some lanes only; move it out of that if/for, or branch on a "
                       f"warp-uniform value (tk.warp_id(), tk.warpgroup_id())")


def _check_mma_operands(op, warpgroup: Callable[[], Uniformity]) -> None:
    """wgmma reads a shared operand at one address for the whole warpgroup:
    a view (tk.index / subtile / column_block) picked by a value that differs
    between its threads (from the lane, warp or thread id) is undefined.
    `warpgroup()` gives the function's warpgroup uniformity (built on first
    need: most functions have no MMA on a view)."""
    d = tk.op_def(op)
    if d is None or not d.async_result:      # a warpgroup MMA (its result is async)
        return
    for access in d.reads:
        v = op.operands[d.operands.index(access.operand)]
        while isinstance(v, ir.OpResult) and (vd := tk.op_def(v.owner)) is not None \
                and vd.view_of is not None:
            view = v.owner
            src = view.operands[vd.operands.index(vd.view_of)]
            if any(warpgroup().varies(x) for x in view.operands if x != src):
                raise error_at(view.location, f"this {view.name[3:]} picks a wgmma operand "
                               f"with a value that differs between the threads of a warpgroup "
                               f"(it depends on the lane, warp or thread id): the warpgroup's "
                               f"MMA reads one shared tile; pick it with a warpgroup-uniform "
                               f"value (e.g. tk.warpgroup_id())")
            v = src


def _check_remote_operands(op) -> None:
    """Another block's tile (an op with remote_view: tile.in_block) is taken
    only as an op's remote_operand (tk.load's source, tk.store's
    destination): wgmma, TMA and the views take this block's shared memory
    only."""
    for use in op.result.uses:
        user = use.owner
        d = tk.op_def(user)
        if d is None or d.remote_operand is None or \
                use.operand_number != d.operands.index(d.remote_operand):
            what = user.name[3:] if user.name.startswith("tk.") else user.name
            raise error_at(user.location, f"{what} takes a tile of another block of the "
                           f"cluster (tile.in_block(rank)), which only tk.load reads and "
                           f"tk.store writes (distributed shared memory); go through "
                           f"registers, or use this block's tile")


def _check_static_memory(op) -> None:
    """Which shared tile or semaphore an op uses is decided at compile time
    (its place in shared memory is a constant): one cannot come out of a
    run-time if, or change from one loop iteration to the next."""
    for r in op.results:
        t = T.parse(r.type)
        if isinstance(t, (T.ST, T.SV, T.Sem, T.TT)):
            what = {T.ST: "shared tile", T.SV: "shared vector",
                    T.TT: "tensor tile"}.get(type(t), "semaphore")
            how = ("chosen by a run-time if" if op.name == "scf.if" else
                   "changed from one loop iteration to the next")
            raise error_at(op.location, f"a {what} cannot be {how}: which {what} an op uses "
                           f"is fixed at compile time; make an array (tk.shared_tiles / "
                           f"tk.semaphores) and index it with the run-time value instead")


def verify(module: ir.Module) -> None:
    """The tk-verify pass."""
    for func in module.body.operations:
        num_warps = contracts.NUM_WARPS.get(func)
        uniform = Uniformity(func)
        warpgroup = functools.cache(lambda func=func: Uniformity(func, "warpgroup_varying"))
        lanes = functools.cache(lambda func=func: Uniformity(func, "lane_varying"))
        def visit(op: ir.Operation) -> None:
            if tk.op_def(op) is not None:
                check_op(op.opview, num_warps)
                _check_uniform(op, num_warps, uniform, lanes)
                _check_mma_operands(op, warpgroup)
                if tk.op_def(op).remote_view:
                    _check_remote_operands(op)
            elif op.name in ("scf.if", "scf.for"):
                _check_static_memory(op)
        walk_ops(func.operation, visit)
        check_async_results(func)
        check_signals(func.operation)
        check_tensor_memory(func)
