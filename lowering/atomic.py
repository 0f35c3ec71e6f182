"""Lowering of tk.atomic_add: a register tile added into global memory.

Each piece of consecutive registers that tk.store would write with one
st.global.v{1,2,4} becomes one `red.global.add{.v2,.v4}.f32` (vector red:
PTX ISA 8.1, sm_90), under the same guard as the store: in bounds, and on
the first of the threads that hold the element (replicated layouts, e.g. a
row vector held by every lane of a quad, must add it once). The launch
checks that make a store's 16-byte vectors aligned make these aligned too.
`red` (no result) rather than `atom`: nothing waits for the old value.
f32 red flushes denormal inputs to zero (SASS REDG ... .FTZ), as atom.add.f32.
"""
from __future__ import annotations

from mlir import ir
from mlir.dialects import llvm

from .context import LoweringContext, lowers
from .fragments import Fragment, GlobalRef
from .memory import _and, _guarded, global_pieces


def _red_add(addr: ir.Value, regs: list[ir.Value]) -> None:
    n = len(regs)
    vec = "" if n == 1 else f".v{n}"
    vals = "$1" if n == 1 else "{" + ", ".join(f"${i + 1}" for i in range(n)) + "}"
    llvm.inline_asm(None, [addr, *regs], f"red.global.add{vec}.f32 [$0], {vals};",
                    ",".join(["l"] + ["f"] * n), has_side_effects=True)


@lowers("tk.atomic_add")
def lower_atomic_add(ctx: LoweringContext, op, dst: GlobalRef, frag: Fragment,
                     *indices: ir.Value) -> None:
    for r0, n, addr, conds in global_pieces(ctx, dst, frag, indices):
        regs = frag.regs[r0:r0 + n]
        _guarded(_and(conds), lambda: _red_add(addr, regs))
