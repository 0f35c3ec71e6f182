"""Lowering of signals: tk.signal, tk.wait_signal, tk.fence (PTX memory
model: release/acquire at a scope). A flag outside its tensor and a wait
past its timeout trap: the launch fails instead of writing memory it does
not own, or hanging.
"""
from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, gpu, llvm, scf

from ..errors import _where
from .context import LoweringContext, c32, i32, lowers
from .fragments import GlobalRef
from .memory import _guarded, element_address
from .peers import trap


def _flag(flags: GlobalRef, indices) -> ir.Value:
    """The flag's address; a flag outside its tensor traps."""
    addr, ok = element_address(flags, indices)
    if ok is not None:
        _guarded(arith.xori(ok, arith.constant(ir.IntegerType.get_signless(1), 1)), trap)
    return addr


@lowers("tk.signal")
def lower_signal(ctx: LoweringContext, op, flags: GlobalRef, value: ir.Value,
                 *indices: ir.Value) -> None:
    addr = _flag(flags, indices)
    text = {"add": f"red.release.{op.scope}.global.add.u32 [$0], $1;",
            "set": f"st.release.{op.scope}.global.u32 [$0], $1;"}[op.mode]
    llvm.inline_asm(None, [addr, value], text, "l,r", has_side_effects=True)


def _global_timer() -> ir.Value:
    return llvm.inline_asm(ir.IntegerType.get_signless(64), [], "mov.u64 $0, %globaltimer;",
                           "=l", has_side_effects=True)


@lowers("tk.wait_signal")
def lower_wait_signal(ctx: LoweringContext, op, flags: GlobalRef, expected: ir.Value,
                      *indices: ir.Value) -> None:
    """Spin on ld.acquire until (flag - expected) >= 0 as a signed difference;
    past the timeout (%globaltimer, ns) print where and trap (trap only, in a
    kernel whose MMAs a printf call would serialize: ctx.calls_allowed)."""
    addr = _flag(flags, indices)
    i64 = ir.IntegerType.get_signless(64)
    start = _global_timer()
    deadline = arith.constant(i64, op.timeout_ms * 1_000_000)
    loop = scf.WhileOp([], [])
    before, after = loop.before.blocks.append(), loop.after.blocks.append()
    with ir.InsertionPoint(before):
        seen = llvm.inline_asm(i32(), [addr], f"ld.acquire.{op.scope}.global.u32 $0, [$1];",
                               "=r,l", has_side_effects=True)
        waiting = arith.cmpi(arith.CmpIPredicate.slt, arith.subi(seen, expected), c32(0))
        late = arith.cmpi(arith.CmpIPredicate.ugt, arith.subi(_global_timer(), start), deadline)
        _guarded(arith.andi(waiting, late),
                 lambda: _time_out(op, seen, expected) if ctx.calls_allowed else trap())
        scf.ConditionOp(waiting, [])
    with ir.InsertionPoint(after):
        scf.YieldOp([])


def _time_out(op, seen: ir.Value, expected: ir.Value) -> None:
    where = _where(op.location)
    at = f"{where[0]}:{where[1]}" if where else "a tk.wait_signal"
    block = arith.index_cast(i32(), gpu.block_id(gpu.Dimension.x))
    thread = arith.index_cast(i32(), gpu.thread_id(gpu.Dimension.x))
    gpu.printf(f"tk.wait_signal timed out after {op.timeout_ms} ms at {at}: the flag holds "
               f"%u, waiting for %u (block %d, thread %d); trapping\n",
               seen, expected, block, thread)
    trap()


@lowers("tk.fence")
def lower_fence(ctx: LoweringContext, op) -> None:
    text = f"fence.acq_rel.{op.scope};"
    if op.async_proxy:
        text = "fence.proxy.async.global; " + text
    llvm.inline_asm(None, [], text, "", has_side_effects=True)
