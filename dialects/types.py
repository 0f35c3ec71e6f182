"""The tk dialect's types as Python values.

MLIR 22's Python API has no builder for IRDL-defined types, so a tk type is
made by parsing its text and read back by parsing its text. This module owns
both directions: the frozen dataclasses below are what passes and the
lowering reason about; `to_mlir()` and `parse()` cross to and from `ir.Type`.

    !tk.gl<bf16, array<i64: -1, 4096>>                  global layout, -1 = dynamic
    !tk.st<bf16, 64, 64, 128>                           shared tile, swizzle bytes
    !tk.rt<f32, 16, 4096, "vec", "block">               register tile
    !tk.rv<f32, 16, "r[]l[0,0,0,0,0]w[1,2,4]", "block"> register vector (see layout.py)
    !tk.sv<f32, 64>                                     shared vector
    !tk.sem                                             semaphore (mbarrier)
    !tk.tt<f32, 128, 256>                               tensor-memory tile (Blackwell TMEM)
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from .. import dtypes


# Element types: the rows of tk_mlir/dtypes.py that tiles hold.
TILE_DTYPES = dtypes.TILE_DTYPES
ARGUMENT_DTYPES = dtypes.ARGUMENT_DTYPES

SCOPES = {"warp": 1, "warpgroup": 4}   # warps per scope; "block" = all warps
TILE_LAYOUTS = ("vec", "row", "col", "tmem")
SWIZZLES = (0, 32, 64, 128)
MAX_GL_RANK = 4


def scope_warps(scope: str, num_warps: int) -> int:
    """How many warps hold a tile of this scope in a kernel of num_warps."""
    return SCOPES.get(scope, num_warps)


def itemsize(dtype: str) -> int:
    return TILE_DTYPES[dtype].itemsize


def _parse_type(text: str):
    # mlir is imported on first use, so that a cache hit never loads it.
    from mlir import ir
    return ir.Type.parse(text)


def element_type(dtype: str):
    return _parse_type(TILE_DTYPES[dtype].mlir)


def is_float(dtype: str) -> bool:
    return TILE_DTYPES[dtype].float


def in_memory(dtype: str) -> bool:
    """Whether shared tiles and memory ops take `dtype` (i32 and bool tiles
    live in registers only)."""
    return TILE_DTYPES[dtype].memory


def scalar_dtype(dtype: str) -> str:
    """The dtype of a scalar operand of a tile op on `dtype` tiles: f32 for the
    float tiles (converted to the tile's dtype when lowered), else its own."""
    return "f32" if is_float(dtype) else dtype


def dtype_of(t) -> str | None:
    """The tk dtype of an MLIR element type (f32, i32, i1 ...), None for others."""
    return dtypes.BY_MLIR.get(str(t))


@dataclass(frozen=True)
class GL:
    dtype: str
    shape: tuple[int | None, ...]   # None: known only at run time

    def to_mlir(self):
        dims = ", ".join("-1" if d is None else str(d) for d in self.shape)
        dims = f"array<i64: {dims}>" if dims else "array<i64>"
        return _parse_type(f"!tk.gl<{TILE_DTYPES[self.dtype].mlir}, {dims}>")

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class ST:
    dtype: str
    rows: int
    cols: int
    swizzle: int = 0

    def to_mlir(self):
        return _parse_type(
            f"!tk.st<{TILE_DTYPES[self.dtype].mlir}, {self.rows}, {self.cols}, {self.swizzle}>")

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * itemsize(self.dtype)

    # A swizzled tile is stored as column blocks of `swizzle` bytes per row
    # (the box TMA writes and wgmma reads); block j holds columns
    # j*block_cols .. of every row, rows consecutive, at j * rows * block_bytes.
    @property
    def row_bytes(self) -> int:
        return self.cols * itemsize(self.dtype)

    @property
    def block_bytes(self) -> int:
        return self.swizzle or self.row_bytes

    @property
    def block_cols(self) -> int:
        return self.block_bytes // itemsize(self.dtype)

    @property
    def blocks(self) -> int:
        return self.row_bytes // self.block_bytes

    def byte_offset(self, row: int, col: int) -> int:
        """Where element (row, col) lives, relative to the tile's (aligned) base:
        the reference the tests hold lowering/memory.py's swizzled_offset (which
        computes the same in IR) and the TMA pattern to."""
        block, inner = divmod(col, self.block_cols)
        off = block * self.rows * self.block_bytes + row * self.block_bytes + \
            inner * itemsize(self.dtype)
        if self.swizzle:
            off ^= ((off >> 7) & (self.swizzle // 16 - 1)) << 4
        return off


@dataclass(frozen=True)
class RT:
    dtype: str
    rows: int
    cols: int
    layout: str = "vec"
    scope: str = "block"

    def to_mlir(self):
        return _parse_type(f'!tk.rt<{TILE_DTYPES[self.dtype].mlir}, {self.rows}, {self.cols}, '
                             f'"{self.layout}", "{self.scope}">')

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def with_dtype(self, dtype: str) -> RT:
        return RT(dtype, self.rows, self.cols, self.layout, self.scope)


@dataclass(frozen=True)
class RV:
    dtype: str
    length: int
    layout: str = "auto"    # "auto" until the layout pass picks one
    scope: str = "block"

    def to_mlir(self):
        return _parse_type(f'!tk.rv<{TILE_DTYPES[self.dtype].mlir}, {self.length}, '
                             f'"{self.layout}", "{self.scope}">')

    @property
    def shape(self) -> tuple[int]:
        return (self.length,)

    def with_dtype(self, dtype: str) -> RV:
        return RV(dtype, self.length, self.layout, self.scope)

    def with_layout(self, layout: str) -> RV:
        return RV(self.dtype, self.length, layout, self.scope)


@dataclass(frozen=True)
class SV:
    dtype: str
    length: int

    def to_mlir(self):
        return _parse_type(f"!tk.sv<{TILE_DTYPES[self.dtype].mlir}, {self.length}>")

    @property
    def nbytes(self) -> int:
        return self.length * itemsize(self.dtype)


@dataclass(frozen=True)
class Sem:
    def to_mlir(self):
        return _parse_type("!tk.sem")


@dataclass(frozen=True)
class TT:
    """A tile in Blackwell tensor memory (TMEM): `rows` of its 128 lanes,
    `cols` of its 32-bit columns (one f32 element per lane and column)."""
    dtype: str
    rows: int
    cols: int

    def to_mlir(self):
        return _parse_type(f"!tk.tt<{TILE_DTYPES[self.dtype].mlir}, {self.rows}, {self.cols}>")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def allocated_columns(self) -> int:
        """The columns tcgen05.alloc takes for it: a power of two, at least 32."""
        return max(32, 1 << (self.cols - 1).bit_length())


TkType = GL | ST | RT | RV | SV | Sem | TT

_TYPE_RE = re.compile(r"!tk\.(\w+)(?:<(.*)>)?$", re.S)
_INT = r"(-?\d+)(?: : i64)?"


@functools.lru_cache(maxsize=4096)
def _parse_text(text: str) -> TkType | None:
    m = _TYPE_RE.match(text)
    if not m:
        return None
    kind, body = m.group(1), m.group(2) or ""
    if kind == "sem":
        return Sem()
    dtype_text, _, rest = body.partition(",")
    dtype = dtypes.BY_MLIR[dtype_text.strip()]
    if kind == "gl":
        dims = re.search(r"array<i64(?::(.*))?>", rest).group(1) or ""
        return GL(dtype, tuple(None if int(d) < 0 else int(d) for d in dims.split(",") if d.strip()))
    ints = [int(x) for x in re.findall(_INT, rest.split('"')[0])]
    strings = re.findall(r'"([^"]*)"', rest)
    if kind == "st":
        return ST(dtype, *ints)
    if kind == "rt":
        return RT(dtype, ints[0], ints[1], *strings)
    if kind == "rv":
        return RV(dtype, ints[0], *strings)
    if kind == "sv":
        return SV(dtype, ints[0])
    if kind == "tt":
        return TT(dtype, *ints)
    return None


def parse(t) -> TkType | None:
    """The tk type behind an `ir.Type`, or None for a non-tk type."""
    return _parse_text(str(t))


def show(t) -> str:
    """A tk type in words, as errors name it (f32 16x64 tile (vec, block))."""
    if isinstance(t, RT):
        return f"{t.dtype} {t.rows}x{t.cols} tile ({t.layout}, {t.scope})"
    if isinstance(t, RV):
        return f"{t.dtype} vector of {t.length} ({t.scope})"
    if isinstance(t, GL):
        return f"{t.dtype} global of rank {t.rank}"
    if isinstance(t, ST):
        return f"{t.dtype} {t.rows}x{t.cols} shared tile"
    if isinstance(t, SV):
        return f"{t.dtype} shared vector of {t.length}"
    if isinstance(t, TT):
        return f"{t.dtype} {t.rows}x{t.cols} tensor tile"
    return str(t)


def is_tile(t) -> bool:
    return isinstance(parse(t), (RT, RV))
