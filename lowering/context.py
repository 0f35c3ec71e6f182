"""State shared by the op lowerings of one kernel, and small IR helpers."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from mlir import ir
from mlir.dialects import arith, gpu, llvm, nvvm

from ..dialects import layout as layouts, types as T

# tk op name -> its lowering rule, rule(ctx, op, *inputs) -> output. The
# walker (lowering/kernel.py) looks up what each operand became (a Fragment,
# a GlobalRef/SharedRef, an SSA value) and passes them in operand order; the
# rule returns what the op's result becomes (None for an op without one) and
# the walker binds it. Attributes are read from `op` (op.kind, op.axis, ...).
LOWERINGS: dict[str, Callable] = {}


def lowers(*names: str):
    def register(fn):
        for n in names:
            LOWERINGS[n] = fn
        return fn
    return register


def i32() -> ir.Type:
    return ir.IntegerType.get_signless(32)


def i64() -> ir.Type:
    return ir.IntegerType.get_signless(64)


def c32(v: int) -> ir.Value:
    return arith.constant(i32(), v)


def c64(v: int) -> ir.Value:
    return arith.constant(i64(), v)


def ptr(space: int) -> ir.Type:
    return ir.Type.parse(f"!llvm.ptr<{space}>")


@dataclass
class LoweringContext:
    num_warps: int
    smem_base: ir.Value | None = None          # !llvm.ptr<3>, set when the kernel uses smem
    values: dict = field(default_factory=dict)  # old SSA value -> new value / Fragment / Ref
    exchange_groups: dict = field(default_factory=dict)  # group id -> its tk.reduce ops
    tensor_maps: dict = field(default_factory=dict)   # TensorMapSpec -> its !llvm.ptr parameter
    # Accumulators of issued wgmma groups (tk value -> block depth where bound):
    # lowering/mma.py fences their registers at each tk.mma_wait.
    in_flight: dict = field(default_factory=dict)
    depth: int = 0                                    # nesting of the block being lowered
    cluster: int = 1                                  # blocks per cluster
    uses_setmaxnreg: bool = False                     # the kernel needs .minnctapersm
    fp_contract: bool = True                          # tile mul/add may fuse to fma
    widen_stores: bool = True                         # lane exchanges before global stores
    widened_stores: int = 0                           # stores they widened
    # False in a kernel that issues warpgroup MMAs: ptxas serializes every
    # wgmma of a function that makes a call (ptxas info C7510; see
    # BENCHMARKS.md), so no lowering may call a function there (printf).
    calls_allowed: bool = True
    _thread: dict = field(default_factory=dict)

    # Bindings that hold only inside one block (tk value -> [(anchor op, new)],
    # oldest first): the block holding the anchor and the blocks nested in it.
    # lowering/mma.py binds a fenced accumulator this way below a tk.mma_wait
    # nested under its definition: past the block the fenced registers would
    # not dominate their uses, and a path that skipped the wait never fenced.
    # The anchor is an op, so the binding follows it when an if's lowering
    # moves its branches (lowering/kernel.py).
    scoped: dict = field(default_factory=dict)

    def lookup(self, v: ir.Value):
        for anchor, new in reversed(self.scoped.get(v, ())):
            if _inside(ir.InsertionPoint.current.block, anchor.block):
                return new
        return self.values[v]

    def bind(self, old: ir.Value, new) -> None:
        self.values[old] = new

    def bind_in_block(self, old: ir.Value, new, anchor: ir.Operation) -> None:
        """Bind `old` to `new` in the block holding `anchor` (and below) only."""
        self.scoped.setdefault(old, []).append((anchor, new))

    # ---- where this thread is (computed once, at the top of the kernel)

    def tid(self) -> ir.Value:
        if "tid" not in self._thread:
            self._thread["tid"] = arith.index_cast(i32(), gpu.thread_id(gpu.Dimension.x))
        return self._thread["tid"]

    def lane(self) -> ir.Value:
        if "lane" not in self._thread:
            self._thread["lane"] = arith.andi(self.tid(), c32(31))
        return self._thread["lane"]

    def warp(self) -> ir.Value:
        if "warp" not in self._thread:
            self._thread["warp"] = arith.shrui(self.tid(), c32(5))
        return self._thread["warp"]

    def uniform_warp(self) -> ir.Value:
        """warp(), as lane 0's value shuffled to every lane: ptxas knows a
        shuffle from a fixed lane to be warp-uniform and keeps it, and what
        derives from it (a warpgroup's role, its tiles and their wgmma
        descriptors), in uniform registers. Made at the kernel's top, where
        every lane runs (lower_to_gpu), and dropped there if unused."""
        if "uniform_warp" not in self._thread:
            self._thread["uniform_warp"] = nvvm.shfl_sync(i32(), c32(-1), self.warp(), c32(0),
                                                          c32(31), nvvm.ShflKind.idx)
        return self._thread["uniform_warp"]

    def drop_unused_uniform_warp(self) -> None:
        """Erase the top's shuffle when no op used it (a shuffle is not
        dead code to MLIR: it synchronizes the warp)."""
        value = self._thread.get("uniform_warp")
        if value is not None and not list(value.uses):
            value.owner.erase()

    def warp_in_scope(self, scope: str) -> ir.Value:
        warps = T.SCOPES.get(scope)
        return self.warp() if warps is None else arith.andi(self.warp(), c32(warps - 1))

    def thread_position(self, layout: layouts.Layout, scope: str) -> list[ir.Value]:
        """This thread's element offset (i32 per axis) from its lane and warp bits."""
        pos = [c32(0) for _ in layout.shape]
        for bits, bases in ((self.lane(), layout.lane), (self.warp_in_scope(scope), layout.warp)):
            for i, b in enumerate(bases):
                if b is None:
                    continue
                bit = arith.andi(arith.shrui(bits, c32(i)), c32(1))
                pos[b[0]] = arith.ori(pos[b[0]], arith.shli(bit, c32(b[1])))
        return pos

    def is_first_replica(self, layout: layouts.Layout, scope: str) -> ir.Value | None:
        """i1: this thread is the first of the threads holding the same elements
        (None when no bit replicates). Stores use it to write each element once."""
        conds = []
        for bits, kind in ((self.lane(), "lane"), (self.warp_in_scope(scope), "warp")):
            mask = sum(1 << i for i in layout.replicated_bits(kind))
            if mask:
                conds.append(arith.cmpi(arith.CmpIPredicate.eq, arith.andi(bits, c32(mask)),
                                        c32(0)))
        return functools.reduce(arith.andi, conds) if conds else None


def in_place(v: ir.Value) -> ir.Value:
    """v (i32 or i64) through an empty volatile asm, so that what is computed
    from it stays where it is used. LLVM hoists loop-invariant arithmetic out
    of loops: per-register tile indices, or a tile access's per-piece row
    offsets (row x the run-time stride, 64-bit), would each hold a register
    for the whole loop (in attention, enough of them to spill); recomputed in
    place they are an integer op or two per use."""
    wide = ir.IntegerType(v.type).width == 64
    return llvm.inline_asm(v.type, [v], "mov.b64 $0, $1;" if wide else "mov.b32 $0, $1;",
                           "=l,l" if wide else "=r,r", has_side_effects=True)


def vector_type(n: int, dtype: str) -> ir.Type:
    return ir.VectorType.get([n], T.element_type(dtype))


def split_vector(vec: ir.Value, n: int) -> list[ir.Value]:
    if n == 1 and not isinstance(vec.type, ir.VectorType):
        return [vec]
    return [llvm.extractelement(vec, c32(i)) for i in range(n)]


def build_vector(regs: list[ir.Value], dtype: str) -> ir.Value:
    if len(regs) == 1:
        return regs[0]
    vec = llvm.mlir_undef(ir.VectorType.get([len(regs)], regs[0].type))
    for i, r in enumerate(regs):
        vec = llvm.insertelement(vec, r, c32(i))
    return vec


def float_constant(value: float, dtype: str) -> ir.Value:
    return arith.constant(T.element_type(dtype), value)


def constant(value, dtype: str) -> ir.Value:
    """`value` as a register of any tile dtype (i32 and bool take ints)."""
    return float_constant(float(value), dtype) if T.is_float(dtype) else \
        arith.constant(T.element_type(dtype), int(value))


def _inside(block: ir.Block, outer: ir.Block) -> bool:
    """Is `block` the block `outer` or nested in it?"""
    while True:
        if block == outer:
            return True
        owner = block.owner
        if owner is None or owner.operation.parent is None:
            return False
        block = owner.operation.block
