"""Lowering of tk.peer_select: the copy of a tk.pgl argument on a run-time rank.

A tk.pgl argument arrives as one GlobalRef per rank (lowering/kernel.py);
tk.peer_select picks one with a chain of selects (world sizes are small),
and a TMA op on the pick selects among the ranks' tensor maps the same way
(lowering/tma.py). A rank outside the group traps: the launch fails instead
of touching memory it does not own.
"""
from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, llvm

from .context import LoweringContext, c32, lowers
from .fragments import GlobalRef
from .memory import _guarded


def trap() -> None:
    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True)


def select_by_rank(rank: ir.Value, choices: list[ir.Value]) -> ir.Value:
    """choices[rank], trapping when rank is not one of their indices."""
    _guarded(arith.cmpi(arith.CmpIPredicate.uge, rank, c32(len(choices))), trap)
    picked = choices[0]
    for r, v in enumerate(choices[1:], 1):
        picked = arith.select(arith.cmpi(arith.CmpIPredicate.eq, rank, c32(r)), v, picked)
    return picked


@lowers("tk.peer_select")
def lower_peer_select(ctx: LoweringContext, op, rank: ir.Value, *peers: GlobalRef) -> GlobalRef:
    # Every rank's copy has the same extents and strides (runtime/peers.py checks).
    first = peers[0]
    return GlobalRef(select_by_rank(rank, [p.ptr for p in peers]), first.dims, first.strides,
                     first.type)
