"""Lowering of Blackwell tensor memory and its MMA (tcgen05, sm_100a).

A tensor tile lowers to a `TensorRef`: the 32-bit tensor-memory address of
its first cell (lane in bits 16-31, column in bits 0-15). Warp 0 allocates
it (tcgen05.alloc writes the address to the tile's 8-byte shared word), a
block barrier between tcgen05 fences publishes the address to every thread;
the last allocation of the kernel gives up the permit to allocate more
(relinquish_alloc_permit). Freeing is the mirror image: fences and a block
barrier, so that every thread's tensor-memory accesses are done, then warp 0
deallocates.

An MMA into the tile is the K / k tcgen05.mma instructions of the product
(kind::f16 for bf16/f16, kind::f8f6f4 for fp8; M = 128, cta_group::1),
each with its operands' descriptors (lowering/descriptors.py); the first
one's enable-input-d is the op's `accumulate`. tk.mma_commit is
tcgen05.commit onto the semaphore's mbarrier.

In a kernel whose MMAs pair the cluster's two blocks (pair=True), every
tcgen05 op is cta_group::2: both blocks allocate and free together, an MMA
is M = 256 (each block's 128 rows and half of B, at the same shared-memory
offsets in both), and a commit arrives on the semaphore in both blocks
(multicast mask 0b11).

tcgen05.ld/st move the tmem layout (dialects/layout.py): warp w of the
warpgroup reaches lanes 32w..32w+31, thread t holds lane 32w + t, its
registers the tile's columns in order, in .32x32b loads of at most 128
columns. Each is fenced after_thread_sync before (it follows a semaphore
wait or a barrier) and waited and fenced before_thread_sync after (a later
arrival or barrier then orders it).
"""
from __future__ import annotations

from dataclasses import dataclass

from mlir import ir
from mlir.dialects import arith, llvm, nvvm, scf, vector

from ..dialects import contracts, tk, types as T
from . import descriptors
from .context import LoweringContext, c32, i32, lowers, ptr
from .fragments import Fragment, SharedRef, layout_of
from .memory import smem_addr
from .mma import Descriptors, fence_registers

MAX_LOAD_COLUMNS = 128        # tcgen05.ld/st .32x32b: at most .x128 per instruction


@dataclass(frozen=True)
class TensorRef:
    """A tensor tile: its first cell's tensor-memory address (i32)."""
    addr: ir.Value
    type: T.TT


def _tmem(addr: ir.Value) -> ir.Value:
    return llvm.inttoptr(ptr(6), addr)


def _group(op):
    """The CTA group of a kernel's tcgen05 ops: the pair's when its MMAs pair
    blocks (contracts.CTA_PAIR, set on each by tk-verify), else one block's."""
    paired = contracts.CTA_PAIR.get(op, False)
    return nvvm.CTAGroupKind.CTA_2 if paired else nvvm.CTAGroupKind.CTA_1


def _fence(kind: str) -> None:
    nvvm.tcgen05_fence(getattr(nvvm.Tcgen05FenceKind, kind))


def _in_warp_0(ctx: LoweringContext, body) -> None:
    branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.eq, ctx.warp(), c32(0)))
    with ir.InsertionPoint(branch.then_block):
        body()
        scf.YieldOp([])


def _block_sync() -> None:
    """Order the block's tensor-memory accesses on either side of a barrier."""
    _fence("BEFORE_THREAD_SYNC")
    nvvm.barrier0()
    _fence("AFTER_THREAD_SYNC")


@lowers("tk.alloc_tt")
def lower_alloc_tt(ctx: LoweringContext, op) -> TensorRef:
    slot = smem_addr(ctx.smem_base, c32(contracts.OFFSET.get(op)))
    tile = T.parse(op.result.type)
    last = not any(getattr(tk.op_def(o), "tensor_memory", None) == "alloc" for o in _after(op))
    group = _group(op)

    def allocate():
        nvvm.tcgen05_alloc(slot, c32(tile.allocated_columns), group=group)
        if last:
            nvvm.tcgen05_relinquish_alloc_permit(group=group)
    _in_warp_0(ctx, allocate)
    _block_sync()
    return TensorRef(llvm.load(i32(), slot), tile)


def _after(op):
    """The ops after `op` in its block."""
    seen = False
    for o in op.operation.block.operations:
        if seen:
            yield o.operation
        seen = seen or o.operation == op.operation


@lowers("tk.free_tt")
def lower_free_tt(ctx: LoweringContext, op, tile: TensorRef) -> None:
    _block_sync()
    group = _group(op)
    columns = c32(tile.type.allocated_columns)
    _in_warp_0(ctx, lambda: nvvm.tcgen05_dealloc(_tmem(tile.addr), columns, group=group))


@lowers("tk.tensor_mma")
def lower_tensor_mma(ctx: LoweringContext, op, acc: TensorRef, a: SharedRef, b: SharedRef,
                     accumulate: ir.Value) -> None:
    trans_a, trans_b = bool(op.trans_a), bool(op.trans_b)
    ka = a.type.rows if trans_a else a.type.cols
    kind = descriptors.tcgen05_kind(a.type.dtype)
    group = _group(op)
    pair = group == nvvm.CTAGroupKind.CTA_2
    idesc = c32(descriptors.tcgen05_instruction(
        a.type.dtype, b.type.dtype, acc.type.rows * (2 if pair else 1), acc.type.cols,
        a_mn_major=trans_a, b_mn_major=trans_b))
    da = Descriptors(a, not trans_a, encode=descriptors.tcgen05_smem)
    db = Descriptors(b, not trans_b, encode=descriptors.tcgen05_smem)
    d = _tmem(acc.addr)
    _fence("AFTER_THREAD_SYNC")
    true = arith.constant(ir.IntegerType.get_signless(1), 1)
    for ks in range(ka // tk.wgmma_k(a.type.dtype)):
        nvvm.tcgen05_mma(getattr(nvvm.Tcgen05MMAKind, kind.upper()), group,
                         d, da.at(ks), db.at(ks), idesc, accumulate if ks == 0 else true)


@lowers("tk.tensor_columns")
def lower_tensor_columns(ctx: LoweringContext, op, src: TensorRef, start: ir.Value) -> TensorRef:
    return TensorRef(arith.addi(src.addr, start), T.parse(op.result.type))


@lowers("tk.mma_commit")
def lower_mma_commit(ctx: LoweringContext, op, sem: SharedRef) -> None:
    group = _group(op)
    if group == nvvm.CTAGroupKind.CTA_2:       # arrive on sem in both blocks of the pair
        mask = arith.constant(ir.IntegerType.get_signless(16), 0b11)
        nvvm.tcgen05_commit(sem.ptr, multicast_mask=mask, group=group)
    else:
        nvvm.tcgen05_commit(sem.ptr, group=group)


def _column_runs(cols: int):
    """(first column, count) of the tcgen05.ld/st instructions moving `cols`
    columns: powers of two of at most MAX_LOAD_COLUMNS."""
    start = 0
    while start < cols:
        n = MAX_LOAD_COLUMNS
        while n > cols - start:
            n //= 2
        yield start, n
        start += n


def _lane_base(ctx: LoweringContext, tile: TensorRef) -> ir.Value:
    """The address of this warp's 32 lanes of the tile (lane offset 32·(warp % 4))."""
    lanes = arith.shli(ctx.warp_in_scope("warpgroup"), c32(5 + 16))
    return arith.addi(tile.addr, lanes)


@lowers("tk.tensor_load")
def lower_tensor_load(ctx: LoweringContext, op, src: TensorRef) -> Fragment:
    t = T.parse(op.result.type)
    base = _lane_base(ctx, src)
    _fence("AFTER_THREAD_SYNC")
    words = []
    for col, n in _column_runs(t.cols):
        addr = _tmem(arith.addi(base, c32(col)))
        rtype = i32() if n == 1 else ir.VectorType.get([n], i32())
        v = nvvm.tcgen05_ld(rtype, nvvm.Tcgen05LdStShape.SHAPE_32X32B, addr)
        words += [v] if n == 1 else [vector.extract(v, [], [i]) for i in range(n)]
    nvvm.tcgen05_wait(nvvm.Tcgen05WaitKind.LOAD)
    # The registers hold their values only after the wait: fenced, so that
    # LLVM cannot move a use above it (nothing else ties the two).
    regs = [arith.bitcast(ir.F32Type.get(), w) for w in fence_registers(words, "r")]
    _fence("BEFORE_THREAD_SYNC")
    return Fragment(regs, layout_of(t, ctx.num_warps), t.dtype, t.scope)


@lowers("tk.tensor_store")
def lower_tensor_store(ctx: LoweringContext, op, dst: TensorRef, value: Fragment) -> None:
    base = _lane_base(ctx, dst)
    _fence("AFTER_THREAD_SYNC")
    for col, n in _column_runs(dst.type.cols):
        words = [arith.bitcast(i32(), r) for r in value.regs[col:col + n]]
        v = words[0] if n == 1 else vector.from_elements(ir.VectorType.get([n], i32()), words)
        nvvm.tcgen05_st(nvvm.Tcgen05LdStShape.SHAPE_32X32B, _tmem(arith.addi(base, c32(col))), v)
    nvvm.tcgen05_wait(nvvm.Tcgen05WaitKind.STORE)
    _fence("BEFORE_THREAD_SYNC")
