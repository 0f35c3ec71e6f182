"""Lowering helpers run on the CPU: the IR a lowering rule builds for integer
address arithmetic, JIT-compiled by MLIR's ExecutionEngine, so tests can
check every thread's addresses without a GPU. A stand-in for the lowering
context supplies a lane and a warp as the function's arguments; in_place
(an empty PTX asm that only keeps LLVM from hoisting) is left out."""
from __future__ import annotations

import contextlib
import ctypes

from mlir import ir
from mlir.dialects import func, llvm
from mlir.execution_engine import ExecutionEngine
from mlir.passmanager import PassManager

from tk_mlir.lowering import memory
from tk_mlir.lowering.context import LoweringContext
from tk_mlir.lowering.fragments import GlobalRef, SharedRef

_TO_LLVM = "builtin.module(convert-arith-to-llvm,convert-func-to-llvm,reconcile-unrealized-casts)"


class Threads:
    """What address lowering asks of a LoweringContext: this thread's lane and
    warp (within the tile's scope), here two i32 arguments."""
    thread_position = LoweringContext.thread_position
    is_first_replica = LoweringContext.is_first_replica

    def __init__(self, lane: ir.Value, warp: ir.Value):
        self._lane, self._warp = lane, warp

    def lane(self) -> ir.Value:
        return self._lane

    def warp_in_scope(self, scope: str) -> ir.Value:
        return self._warp


@contextlib.contextmanager
def _no_asm():
    saved, memory.in_place = memory.in_place, lambda v: v
    try:
        yield
    finally:
        memory.in_place = saved


def run_i32_functions(count: int, body, calls) -> list[dict]:
    """JIT `count` functions of two i32 arguments returning an i64, the j-th's
    result built by body(j, a, b); each is called at every (a, b) of
    `calls`: per function, {(a, b): result}."""
    with _no_asm(), ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        with ir.InsertionPoint(module.body):
            for j in range(count):
                f = func.FuncOp(f"f{j}", ([i32, i32], [i64]))
                f.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
                with ir.InsertionPoint(f.add_entry_block()):
                    func.ReturnOp([body(j, *f.arguments)])
        PassManager.parse(_TO_LLVM).run(module.operation)
        engine = ExecutionEngine(module)
        results = []
        for j in range(count):
            out = {}
            for a, b in calls:
                x, y, res = ctypes.c_int32(a), ctypes.c_int32(b), ctypes.c_int64()
                engine.invoke(f"f{j}", ctypes.pointer(x), ctypes.pointer(y), ctypes.pointer(res))
                out[a, b] = res.value
            results.append(out)
        return results


def _count(accesses) -> int:
    """How many accesses `accesses(threads)` builds (in a throwaway module)."""
    with _no_asm(), ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        i32 = ir.IntegerType.get_signless(32)
        with ir.InsertionPoint(module.body):
            f = func.FuncOp("count", ([i32, i32], []))
            with ir.InsertionPoint(f.add_entry_block()):
                count = len(accesses(Threads(*f.arguments)))
                func.ReturnOp([])
    return count


def shared_offsets(st) -> dict:
    """memory.swizzled_offset for tile type `st` at every element: (row, col) -> bytes."""
    i64 = lambda: ir.IntegerType.get_signless(64)          # noqa: E731
    from mlir.dialects import arith
    calls = [(r, c) for r in range(st.rows) for c in range(st.cols)]
    return run_i32_functions(
        1, lambda j, row, col: arith.extui(i64(), memory.swizzled_offset(st, row, col)),
        calls)[0]


def access_offsets(st, layout, scope: str, matrices: bool):
    """The accesses a fragment in `layout` makes to a shared tile of type st:
    (pieces, offsets) — pieces as memory._matrix_pieces gives them ((first
    register, registers, trans)), or memory._shared_pieces ((first register,
    registers, None)); offsets[j][lane, warp] the byte offset access j
    addresses in that thread."""
    def accesses(ctx):
        ref = SharedRef(llvm.mlir_zero(ir.Type.parse("!llvm.ptr<3>")), st)
        if matrices:
            return [(r0, n, trans, addr) for r0, n, addr, trans in
                    memory._matrix_pieces(ctx, ref, layout, scope, st.dtype)]
        return [(r0, n, None, addr) for r0, n, addr in
                memory._shared_pieces(ctx, ref, layout, scope, st.dtype)]

    pieces = []

    def body(j, lane, warp):
        found = accesses(Threads(lane, warp))
        if not pieces:
            pieces.extend(p[:3] for p in found)
        return llvm.ptrtoint(ir.IntegerType.get_signless(64), found[j][3])

    count = _count(accesses)
    calls = [(lane, warp) for lane in range(32) for warp in range(1 << len(layout.warp))]
    return pieces, run_i32_functions(count, body, calls)


def global_pieces(gl, layout, scope: str, coords: tuple, strides: tuple):
    """The pieces a fragment in `layout` stored at tile coordinates `coords` of
    a tensor of type gl (its shape, row strides `strides` in elements) makes:
    (pieces (first register, registers), per piece {(lane, warp): (byte
    offset, in bounds)}), from memory.global_pieces' IR."""
    from mlir.dialects import arith
    from tk_mlir.lowering.fragments import Fragment

    def pieces(ctx):
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        g = GlobalRef(llvm.mlir_zero(ir.Type.parse("!llvm.ptr<1>")),
                      [arith.constant(i32, d) for d in gl.shape],
                      [arith.constant(i64, s) for s in strides], gl)
        frag = Fragment([None] * layout.num_regs, layout, gl.dtype, scope)
        at = [arith.constant(i32, c) for c in coords]
        return list(memory.global_pieces(ctx, g, frag, at))

    found = []

    def body(j, lane, warp):
        i64 = ir.IntegerType.get_signless(64)
        got = pieces(Threads(lane, warp))
        if not found:
            found.extend((r0, n) for r0, n, _, _ in got)
        r0, n, addr, conds = got[j]
        ok = conds[0] if conds else arith.constant(ir.IntegerType.get_signless(1), 1)
        for c in conds[1:]:
            ok = arith.andi(ok, c)
        # (offset << 1) | in-bounds, in one i64
        return arith.ori(arith.shli(llvm.ptrtoint(i64, addr), arith.constant(i64, 1)),
                         arith.extui(i64, ok))

    count = _count(pieces)
    calls = [(lane, warp) for lane in range(32) for warp in range(1 << len(layout.warp))]
    results = run_i32_functions(count, body, calls)
    return found, [{k: (v >> 1, bool(v & 1)) for k, v in r.items()} for r in results]
