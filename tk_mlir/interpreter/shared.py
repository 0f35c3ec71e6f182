"""Shared memory as the interpreter holds it: one numpy array per allocation.

tk-allocate-smem places every shared tile and vector at its own byte range
(no two allocations overlap), so a block's shared memory is held per
allocation op: an array of `count` tiles (or vectors), f32 values of the
tile's dtype (numerics.py), NaN until something writes them — a read of
memory nobody wrote shows up in the output.

A shared tile value in a warp is a `SharedRef`: which allocation, which
element of its array, and the rows and columns of it the value covers
(tk.subtile, tk.column_block). Refs are compared by value, so warps that
computed the same view separately hand a tile op the same tile.
Semaphores are refs too (`SemRef`); their state lives in sync.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..dialects import layout as layouts, types as T


@dataclass(frozen=True)
class Allocation:
    """One tk.alloc_st / alloc_sv / alloc_sem op: its type, array length,
    the line that made it, and its number in the program."""
    key: int
    type: object            # T.ST, T.SV or T.Sem
    count: int              # elements (1 for a single tile)
    is_array: bool          # made with a count (tk.index picks an element)
    where: str              # "file:line" of the allocation
    agent: int = -1         # semaphores: the clock slot of element 0's TMA agent (races.py)
    arrivals: int = 0       # semaphores: arrivals per phase
    nth: int = 0            # semaphores: how many were allocated at `where` before these


@dataclass(frozen=True)
class SharedRef:
    """A shared tile or vector: element `index` (None: the whole array) of
    allocation `alloc`, rows [row, row + rows) and columns [col, col + cols)."""
    alloc: Allocation
    index: int | None
    row: int
    rows: int
    col: int
    cols: int

    @property
    def shape(self):
        return (self.cols,) if isinstance(self.alloc.type, T.SV) else (self.rows, self.cols)

    def describe(self) -> str:
        at = f"[{self.index}]" if self.alloc.is_array and self.index is not None else ""
        part = "" if (self.row, self.rows) == (0, rows_of(self.alloc.type)) else \
            f" rows {self.row}-{self.row + self.rows - 1}"
        what = {T.TT: "tensor tile", T.SV: "shared vector"}.get(type(self.alloc.type),
                                                                 "shared tile")
        return f"the {what}{at}{part} allocated at {self.alloc.where}"


@dataclass(frozen=True)
class RemoteRef:
    """A shared tile as it is in block `rank` of the cluster (tk.in_block):
    `ref` names the tile, that block's shared memory holds it."""
    ref: SharedRef
    rank: int


@dataclass(frozen=True)
class SemRef:
    alloc: Allocation
    index: int | None

    def describe(self) -> str:
        """Named by its allocation's line; the second of two allocations
        there (a tk.ring's or tk.lcf's empty semaphores, after its full ones)
        says so."""
        at = "" if self.index is None else f"[{self.index}]"
        nth = self.alloc.nth
        ring = ": a tk.ring or tk.lcf makes its full ones, then its empty ones"
        again = "" if not nth else \
            f" (the {_ORDINALS[nth] if nth < len(_ORDINALS) else f'{nth + 1}th'} semaphores " \
            f"made there{ring if nth == 1 else ''})"
        return f"semaphore{at} allocated at {self.alloc.where}{again}"


_ORDINALS = ("first", "second", "third", "fourth")


def rows_of(t) -> int:
    return 1 if isinstance(t, T.SV) else t.rows


def cols_of(t) -> int:
    return t.length if isinstance(t, T.SV) else t.cols


def whole(alloc: Allocation):
    """The value tk.alloc_* gives: the whole array (or single tile)."""
    if isinstance(alloc.type, T.Sem):
        return SemRef(alloc, None if alloc.is_array else 0)
    return SharedRef(alloc, None if alloc.is_array else 0, 0, rows_of(alloc.type), 0,
                     cols_of(alloc.type))


class SharedMemory:
    """One block's shared tiles and vectors: allocation key -> array of
    shape (count, rows, cols) (vectors: rows = 1)."""

    def __init__(self):
        self.arrays: dict[int, np.ndarray] = {}

    def array(self, alloc: Allocation) -> np.ndarray:
        a = self.arrays.get(alloc.key)
        if a is None:
            t = alloc.type
            a = self.arrays[alloc.key] = np.full((alloc.count, rows_of(t), cols_of(t)), np.nan,
                                                 np.float32)
        return a

    def view(self, ref: SharedRef) -> np.ndarray:
        """The ref's elements, as a writable numpy view (vectors: 1-D)."""
        a = self.array(ref.alloc)[ref.index, ref.row:ref.row + ref.rows,
                                  ref.col:ref.col + ref.cols]
        return a[0] if isinstance(ref.alloc.type, T.SV) else a

    def read(self, ref: SharedRef) -> np.ndarray:
        return self.view(ref).copy()

    def write(self, ref: SharedRef, value: np.ndarray) -> None:
        self.view(ref)[...] = value


def _warp_masks(layout, axis: int, extent: int, n: int, holds_none=lambda k: False):
    """For each of n warps, a bool mask of the positions along `axis` (of
    `extent`) that its threads hold: the registers' and lanes' steps along
    it, moved by the warp's own; empty for a warp where holds_none(k)."""
    held = np.unique([layout.reg_position(r)[axis] for r in range(layout.num_regs)])
    for b in layout.lane:
        if b is not None and b[0] == axis:
            held = np.concatenate([held, held + (1 << b[1])])
    out = []
    for k in range(n):
        off = sum(1 << b[1] for bit, b in enumerate(layout.warp)
                  if k >> bit & 1 and b is not None and b[0] == axis)
        mask = np.zeros(extent, bool)
        if not holds_none(k):
            mask[(held + off) % extent] = True
        out.append(mask)
    return tuple(out)


@functools.lru_cache(maxsize=256)
def cols_by_warp(t, num_warps: int) -> tuple[np.ndarray | None, ...]:
    """For each warp of a register tile's scope, the tile columns it holds (a
    bool mask), or None for every warp when no warp bit steps along columns
    (each holds whole rows: rows_by_warp tells them apart). A col layout's
    warps split the columns; a vector's (a row sum of a tile whose warps
    stack along rows) its elements, a shared vector's columns."""
    n = T.scope_warps(t.scope, num_warps)
    layout = layouts.layout_of(t, num_warps)
    axis = 0 if isinstance(t, T.RV) else 1
    if not any(b is not None and b[0] == axis for b in layout.warp):
        return (None,) * n
    return _warp_masks(layout, axis, t.length if axis == 0 else t.cols, n)


@functools.lru_cache(maxsize=256)
def rows_by_warp(t, num_warps: int, store: bool = False) -> tuple[np.ndarray, ...]:
    """For each warp of a register tile's scope, the tile rows it holds (a
    bool mask), from the tile's layout: what a thread-side load of the tile
    touches in each warp's name. A vector: every warp row 0. store=True:
    what a store writes, by the first replica only (a warp holding a copy of
    another warp's elements, a replicated warp bit set, writes nothing; the
    lowering's is_first_replica)."""
    n = T.scope_warps(t.scope, num_warps)
    layout = layouts.layout_of(t, num_warps)
    replicas = sum(1 << bit for bit, b in enumerate(layout.warp) if b is None)
    if isinstance(t, T.RV):
        return tuple(np.full(1, not (store and k & replicas)) for k in range(n))
    return _warp_masks(layout, 0, t.rows, n, lambda k: store and k & replicas)
