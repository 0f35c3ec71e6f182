"""tk-proxy-fences: order the threads' writes to a shared tile before an
async-proxy read of it.

Threads' ld/st go through the generic proxy, TMA and wgmma read through the
async proxy, and a barrier or semaphore orders one proxy only; between a
generic write and an async read of the same bytes there must be a
`fence.proxy.async.shared::cta` (PTX ISA, "Proxies"). The fence orders only
the fencing thread's own accesses, so every writing thread fences after its
writes and before the synchronisation that publishes them (as ThunderKittens
and CUTLASS do):

    each writing thread:  st.shared ... ; fence.proxy.async ; barrier/arrive
    the reading thread:   (after the barrier/wait)  wgmma / TMA store

This pass marks each hazardous write op (`proxy_fence`, dialects/contracts.py);
its lowering emits the fence right after its stores, before any barrier of
its own, hence before the user's synchronisation.

A write is hazardous when an async-proxy read (traits `writes` / `reads`) of
the same allocation (a `tk.shared_tiles` array or a tile with its subtiles)
may follow it: later in program order (unless the two sit in different
branches of a block-uniform if), anywhere in a loop enclosing both, or
anywhere at all when the read sits under an if on the thread, lane
or warp id (passes/uniform.py) below the innermost op enclosing both — the
threads that skip that branch may publish their write to those still to run
the read (warp-specialized roles). Writes no async read can follow get no
fence: a GEMM's TMA -> mbarrier -> wgmma chain gets none.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlir import ir

from ..dialects import contracts, tk
from .uniform import Uniformity

_LOOPS = ("scf.for", "scf.while", "scf.parallel")


@dataclass(frozen=True)
class _Step:
    """One level of an op's position: the enclosing op (its walk index), the
    region of it the op sits in, whether that op is a loop, and whether its
    regions may run at once in different threads (an if on the thread id)."""
    owner: int
    region: int
    loop: bool
    concurrent: bool


@dataclass
class _Access:
    op: ir.Operation
    root: ir.Value
    pos: int                       # pre-order index: program order
    path: tuple[_Step, ...]        # enclosing ops, outermost first


def _collect(block, path, counter, writes, reads, uniform: Uniformity) -> None:
    for op in block.operations:
        op = op.operation
        pos = counter[0]
        counter[0] += 1
        for kind, proxy, tile in tk.shared_accesses(op):
            access = _Access(op, tk.shared_root(tile), pos, path)
            if kind == "write" and proxy == tk.GENERIC:
                writes.append(access)
            elif kind == "read" and proxy == tk.ASYNC:
                reads.append(access)
        concurrent = op.name == "scf.if" and uniform.varies(op.operands[0])
        for i, region in enumerate(op.regions):
            step = _Step(pos, i, op.name in _LOOPS, concurrent)
            for inner in region.blocks:
                _collect(inner, path + (step,), counter, writes, reads, uniform)


def _reaches(w: _Access, r: _Access) -> bool:
    """Can r run after w (in this thread, or in another after synchronising)?"""
    common = 0
    for a, b in zip(w.path, r.path):
        if a.owner != b.owner:
            break
        if a.loop:
            return True            # a loop around both: r runs again after w
        if a.region != b.region:   # the two branches of one if: other threads may
            if a.concurrent:       # take the other one, unless all threads agree
                return True
            return False
        common += 1
    # Below the innermost op around both, r under an if on the thread id runs
    # in some threads only; the others go past it at once, to w wherever it is
    # (a later if on the thread id, or code all threads run), and may publish w
    # to the threads that are still to run r. Program order binds only when r
    # runs in every thread that reached the common level.
    if any(step.concurrent for step in r.path[common:]):
        return True
    return w.pos < r.pos


def insert_proxy_fences(module: ir.Module) -> None:
    for func in module.body.operations:
        writes: list[_Access] = []
        reads: list[_Access] = []
        _collect(func.regions[0].blocks[0], (), [0], writes, reads, Uniformity(func))
        for w in writes:
            if any(r.root == w.root and _reaches(w, r) for r in reads):
                contracts.PROXY_FENCE.set(w.op, True)
