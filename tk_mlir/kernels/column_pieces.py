"""Column pieces of a row-per-head tile: how kernels that hold all of a
token's heads as one tile's rows (rotary, the KV-cache append) cut its
columns so a tile stays within a register budget at any head count.

`column_piece(cols, rows)` is the widest piece a tile of `rows` rows may
take: a divisor of `cols` that register tiles can have (a power of two or a
multiple of 16), holding at most MAX_TILE_ELEMENTS elements when one does;
8 columns (16 bytes of 16-bit elements) at the least; `tile_rows(heads)`
the rows such a tile takes for `heads` heads. Compile-time arithmetic, for
the kernels' loops over pieces.
"""
from __future__ import annotations

# A (rows, piece) f32 tile over 4 warps at this size holds 64 registers a
# thread: room for the two or three such tiles a rotation keeps live.
MAX_TILE_ELEMENTS = 8192


def tile_rows(heads: int) -> int:
    """A tile's rows for `heads` heads: the next power of two (the rest masked)."""
    return max(1 << (heads - 1).bit_length(), 1)


def column_piece(cols: int, rows: int) -> int:
    """The widest width dividing `cols` (a multiple of 8) that a register tile
    takes, with rows x width <= MAX_TILE_ELEMENTS where 8 columns allow it."""
    widths = [w for w in range(8, cols + 1, 8)
              if cols % w == 0 and (w & (w - 1) == 0 or w % 16 == 0)]
    fitting = [w for w in widths if rows * w <= MAX_TILE_ELEMENTS]
    return max(fitting) if fitting else widths[0]


def max_rows(cols: int) -> int:
    """The most rows whose narrowest piece of `cols` columns still fits the
    budget: a kernel taking more refuses the shape (its tile would spill or
    exceed the registers)."""
    return MAX_TILE_ELEMENTS // column_piece(cols, MAX_TILE_ELEMENTS)
