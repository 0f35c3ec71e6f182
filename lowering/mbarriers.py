"""Lowering of semaphores (mbarriers), elect, setmaxnreg and named barriers.

Semaphores are initialised together at the top of the kernel (see
`init_semaphores`, called by lowering/kernel.py): one thread inits each
mbarrier, `fence.mbarrier_init` makes the inits visible, one block barrier
publishes them. Nothing else here fences: an mbarrier arrive/wait pair (and
the TMA complete_tx on it) already orders what it guards.
"""
from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, nvvm, scf

from ..dialects import contracts, tk, types as T
from .context import LoweringContext, c32, i64, lowers, ptr
from .fragments import SharedRef
from .memory import smem_addr


def init_semaphores(ctx: LoweringContext, allocs) -> None:
    """Init every semaphore of the kernel (alloc_sem ops, already placed).
    In a cluster, a cluster barrier follows even without semaphores: a block
    may touch another's shared memory (tile.in_block) only once that block
    has started."""
    if not allocs:
        if ctx.cluster > 1:
            nvvm.cluster_arrive_relaxed()
            nvvm.cluster_wait()
        return
    first = scf.IfOp(arith.cmpi(arith.CmpIPredicate.eq, ctx.tid(), c32(0)))
    with ir.InsertionPoint(first.then_block):
        for op in allocs:
            offset, stride = contracts.OFFSET.get(op), contracts.STRIDE.get(op)
            arrivals = op.opview.arrivals
            for i in range(tk.array_count(op) or 1):
                nvvm.mbarrier_init(smem_addr(ctx.smem_base, c32(offset + stride * i)),
                                   c32(arrivals))
        nvvm.fence_mbarrier_init()
        scf.YieldOp([])
    if ctx.cluster > 1:
        # Blocks of the cluster arrive on each other's semaphores (and TMA
        # multicasts complete on them): all of them must be initialised first.
        nvvm.cluster_arrive()
        nvvm.cluster_wait()
    else:
        nvvm.barrier0()


def _sem(ref: SharedRef) -> ir.Value:
    assert isinstance(ref.type, T.Sem)
    return ref.ptr


@lowers("tk.arrive")
def lower_arrive(ctx: LoweringContext, op, sem: SharedRef) -> None:
    nvvm.mbarrier_arrive(i64(), _sem(sem))


@lowers("tk.expect_bytes")
def lower_expect_bytes(ctx: LoweringContext, op, sem: SharedRef) -> None:
    nvvm.mbarrier_arrive_expect_tx(i64(), _sem(sem), c32(op.bytes))


@lowers("tk.wait")
def lower_wait(ctx: LoweringContext, op, sem: SharedRef, phase: ir.Value) -> None:
    # try_wait.parity in a loop (the op lowers to the PTX retry loop).
    nvvm.mbarrier_try_wait_parity(_sem(sem), phase, c32(10_000_000))


@lowers("tk.wait_phase")
def lower_wait_phase(ctx: LoweringContext, op, sem: SharedRef, phase: ir.Value) -> None:
    lower_wait(ctx, op, sem, arith.andi(phase, c32(1)))      # (the phase number's parity)


@lowers("tk.elect")
def lower_elect(ctx: LoweringContext, op) -> ir.Value:
    # elect.sync picks one lane without a loop over the active mask; for a
    # warpgroup, the elected lane of its first warp (warp-uniform test).
    elected = nvvm.elect_sync(ir.IntegerType.get_signless(1))
    if op.scope == "warpgroup":
        first_warp = arith.cmpi(arith.CmpIPredicate.eq, ctx.warp_in_scope("warpgroup"), c32(0))
        elected = arith.andi(first_warp, elected)
    return elected


@lowers("tk.set_registers")
def lower_set_registers(ctx: LoweringContext, op) -> None:
    action = nvvm.SetMaxRegisterAction.increase if op.action == "inc" else \
        nvvm.SetMaxRegisterAction.decrease
    nvvm.setmaxregister(op.count, action)
    ctx.uses_setmaxnreg = True


@lowers("tk.named_barrier")
def lower_named_barrier(ctx: LoweringContext, op, id: ir.Value) -> None:
    threads = c32(32 * op.warps)
    if op.mode == "arrive":      # bar.arrive: no wait (a producer/ping-pong signal)
        nvvm.barrier_arrive(threads, barrier_id=id)
    else:
        nvvm.barrier(None, barrier_id=id, number_of_threads=threads)


@lowers("tk.use_cluster")
def lower_use_cluster(ctx: LoweringContext, op) -> None:
    pass       # a kernel attribute (lowering/kernel.py); nothing runs here


@lowers("tk.cluster_rank")
def lower_cluster_rank(ctx: LoweringContext, op) -> ir.Value:
    return nvvm.read_ptx_sreg_cluster_ctarank(ir.IntegerType.get_signless(32))


@lowers("tk.cluster_sync")
def lower_cluster_sync(ctx: LoweringContext, op) -> None:
    nvvm.cluster_arrive()
    nvvm.cluster_wait()


@lowers("tk.arrive_remote")
def lower_arrive_remote(ctx: LoweringContext, op, sem: SharedRef, cta: ir.Value) -> None:
    remote = nvvm.mapa(ptr(7), _sem(sem), cta)
    nvvm.MBarrierArriveOp(None, remote, scope=nvvm.MemScopeKind.CTA)
