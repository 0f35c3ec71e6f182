"""Register tiles during lowering: per-thread registers plus their layout.

A `Fragment` is what a `!tk.rt` or `!tk.rv` value becomes: the SSA values a
thread holds (one scalar per register, in register-index order) and the
`Layout` saying which element each one is. Everything that moves or combines
tile data reads the layout rather than assuming a shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mlir import ir
from mlir.dialects import arith

from ..dialects import layout as layouts, types as T
from .context import ptr


F32 = "f32"


def convert(v: ir.Value, src: str, dst: str) -> ir.Value:
    """One register from dtype src to dst (through f32)."""
    if src == dst:
        return v
    if not (T.is_float(src) and T.is_float(dst)):
        return _convert_int(v, src, dst)
    if src != F32:
        v = arith.extf(ir.F32Type.get(), v)
    return v if dst == F32 else arith.truncf(T.element_type(dst), v)


def _convert_int(v: ir.Value, src: str, dst: str) -> ir.Value:
    """To or from i32 / bool as Python's int() and float() do (bool -> 0 or 1,
    float -> int rounds toward zero). A mask is made by a comparison, never
    converted to (tk-verify refuses cvt to bool)."""
    if src == "bool":
        v, src = arith.extui(ir.IntegerType.get_signless(32), v), "i32"
    if dst == "i32":
        return v if src == "i32" else arith.fptosi(T.element_type("i32"), convert(v, src, F32))
    return convert(arith.sitofp(ir.F32Type.get(), v), F32, dst)


@dataclass
class Fragment:
    """A thread's registers of a register tile or vector, and their layout.
    Elementwise behaviour lives here: a lowering rule says what to compute per
    register, the fragment applies it along its layout."""
    regs: list[ir.Value]
    layout: layouts.Layout
    dtype: str
    scope: str

    @classmethod
    def full(cls, value: ir.Value, t, num_warps: int) -> Fragment:
        """Every register of a tile or vector of tk type t holding `value`."""
        layout = layout_of(t, num_warps)
        return cls([value] * layout.num_regs, layout, t.dtype, t.scope)

    def like(self, regs: list[ir.Value], dtype: str | None = None) -> Fragment:
        return Fragment(regs, self.layout, dtype or self.dtype, self.scope)

    def astype(self, dtype: str) -> Fragment:
        return self.like([convert(r, self.dtype, dtype) for r in self.regs], dtype)

    def map(self, fn: Callable[[ir.Value], ir.Value], *, in_f32: bool = False) -> Fragment:
        """fn on each register (in_f32: computed in f32, then back to the dtype)."""
        if not in_f32:
            return self.like([fn(r) for r in self.regs])
        return self.like([convert(fn(convert(r, self.dtype, F32)), F32, self.dtype)
                          for r in self.regs])

    def zip_with(self, other, fn: Callable[[ir.Value, ir.Value], ir.Value]) -> Fragment:
        """fn on each pair of registers with a fragment of the same layout, or
        with one scalar (converted once to the fragment's dtype)."""
        if isinstance(other, Fragment):
            return self.like([fn(x, y) for x, y in zip(self.regs, other.regs)])
        s = convert(other, T.dtype_of(other.type), self.dtype)
        return self.like([fn(x, s) for x in self.regs])

    def broadcast(self, vec: Fragment, keep_axis: int,
                  fn: Callable[[ir.Value, ir.Value], ir.Value]) -> Fragment:
        """fn of each register and the vector register that holds its element
        along `keep_axis` (0: one per row, 1: one per column): the layout says which."""
        return self.like([fn(x, vec.regs[self.layout.slice_register(keep_axis, i)])
                          for i, x in enumerate(self.regs)])

    def select(self, picked: list[int], layout: layouts.Layout) -> Fragment:
        """The fragment of registers `picked` (no data moves), in `layout`."""
        return Fragment([self.regs[r] for r in picked], layout, self.dtype, self.scope)


layout_of = layouts.layout_of


@dataclass
class GlobalRef:
    """A global tensor argument: base pointer, extents and row strides."""
    ptr: ir.Value                       # !llvm.ptr<1>
    dims: list[ir.Value]                # i32, static dims as constants
    strides: list[ir.Value]             # i64 element strides of dims[:-1]
    type: T.GL


@dataclass
class SharedRef:
    """A shared tile or semaphore (or the first of an array of them)."""
    ptr: ir.Value                       # !llvm.ptr<3> to the first byte (<7>: another
    #                                     block's, tk.in_block)
    type: T.ST | T.SV | T.Sem
    stride: int = 0                     # bytes between the elements of an array

    @property
    def remote(self) -> bool:
        """Whether this is another block's tile (a shared::cluster address)."""
        return self.ptr.type == ptr(7)
