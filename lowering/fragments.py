"""Register tiles during lowering: per-thread registers plus their layout.

A `Fragment` is what a `!tk.rt` or `!tk.rv` value becomes: the SSA values a
thread holds (one scalar per register, in register-index order) and the
`Layout` saying which element each one is. Everything that moves or combines
tile data reads the layout rather than assuming a shape.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlir import ir

from ..dialects import layout as layouts, types as T


@dataclass
class Fragment:
    regs: list[ir.Value]
    layout: layouts.Layout
    dtype: str
    scope: str

    def like(self, regs: list[ir.Value], dtype: str | None = None) -> Fragment:
        return Fragment(regs, self.layout, dtype or self.dtype, self.scope)


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
    ptr: ir.Value                       # !llvm.ptr<3> to the first byte
    type: T.ST | T.Sem
    stride: int = 0                     # bytes between the elements of an array
