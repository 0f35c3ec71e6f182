"""Global arrays as the interpreter reads and writes them: numpy arrays and
CPU torch tensors, written in place, read and written as f32 (or i32) values.

Tile coordinates follow lowering/memory.py: the last dims (as many as the
tile has) are tile coordinates, scaled by the tile's shape; the outer dims
are element coordinates. Elements outside the array (including negative
coordinates: the GPU compares unsigned) read `fill` and are not written.
"""
from __future__ import annotations

import sys

import numpy as np

from ..runtime.arguments import ArgumentError, canonical_dtype
from . import numerics


class GlobalArray:
    """One tensor argument: its shape, tk dtype, and element access."""

    def __init__(self, obj, name: str):
        torch = sys.modules.get("torch")
        self.is_torch = torch is not None and isinstance(obj, torch.Tensor)
        if self.is_torch and obj.device.type != "cpu":
            raise ArgumentError(f"argument {name!r} is on {obj.device}; the interpreter runs "
                                f"on CPU arrays (pass a numpy array or x.cpu(), and copy the "
                                f"outputs back)")
        if not self.is_torch and not isinstance(obj, np.ndarray):
            raise ArgumentError(f"argument {name!r}: the interpreter takes numpy arrays or CPU "
                                f"torch tensors, got {type(obj).__name__}")
        self.obj, self.name = obj, name
        self.shape = tuple(int(d) for d in obj.shape)
        self.dtype = canonical_dtype(obj.dtype)
        self.writer: np.ndarray | None = None    # per element: its writer's number + 1
        self.writers: list[tuple] = []           # (block name, "file:line") by number
        self.counted_by: tuple | None = None     # (location, parts) of a tk.store_partial
        #                                          that counts in this array

    def elements(self, index: tuple) -> np.ndarray:
        """Elements at per-lane element coordinates (one int array per dim),
        as f32 or i32; 0 where a coordinate is outside the array."""
        ok = np.ones(np.broadcast(*index).shape, bool)
        for i, d in zip(index, self.shape):
            ok &= (i >= 0) & (i < d)
        safe = tuple(np.where(ok, i, 0) for i in index)
        holder = np.int32 if self.dtype == "i32" else np.float32
        if self.is_torch:
            import torch
            values = self.obj[tuple(torch.from_numpy(np.asarray(i, np.int64)) for i in safe)]
            values = values.to(torch.int32 if holder is np.int32 else torch.float32).numpy()
        else:
            values = self.obj[safe].astype(holder)
        return np.where(ok, values, holder(0))

    def update_element(self, index: tuple, value: int, add: bool) -> None:
        """Add `value` to (or store it in) one element of an i32 array, wrapping
        as a u32 counter does; a coordinate outside the array is an IndexError."""
        if not all(0 <= i < d for i, d in zip(index, self.shape)):
            raise IndexError(f"element {index} is outside {self.name!r} of shape {self.shape}")
        old = int(self.obj[index])
        new = (old + value if add else value) & 0xFFFFFFFF
        self.obj[index] = new - (1 << 32) if new >= 1 << 31 else new

    def overlaps(self, coords, tile_shape) -> bool:
        """Does the tile at `coords` hold any element of the array?"""
        return self._window(coords, tile_shape) is not None

    def _window(self, coords, tile_shape) -> tuple[tuple, tuple] | None:
        """(array index, tile index) of the in-bounds part of the tile at
        `coords`, None when none of it is in bounds."""
        rank, tile_rank = len(self.shape), len(tile_shape)
        outer, inner = coords[:rank - tile_rank], coords[rank - tile_rank:]
        if any(not 0 <= c < d for c, d in zip(outer, self.shape)):
            return None
        src, dst = list(outer), []
        for c, n, extent in zip(inner, tile_shape, self.shape[rank - tile_rank:]):
            start = c * n
            lo, hi = max(0, -start), min(n, extent - start)
            if hi <= lo:
                return None
            src.append(slice(start + lo, start + hi))
            dst.append(slice(lo, hi))
        return tuple(src), tuple(dst)

    def load(self, coords, tile_shape, dtype: str, fill) -> np.ndarray:
        out = np.full(tile_shape, numerics.scalar_for(dtype, fill), numerics.HOLDER[dtype])
        window = self._window(coords, tile_shape)
        if window is not None:
            src, dst = window
            part = self.obj[src]
            if self.is_torch:
                import torch
                part = part.to(torch.float32 if dtype != "i32" else torch.int32).numpy()
            out[dst] = numerics.round_to(dtype, part)
        return out

    def store(self, coords, tile: np.ndarray, add: bool = False,
              by: tuple | None = None) -> str | None:
        """Write tile at coords (add: add it to what is there, in f32, then
        round: red.global.add and TMA reduce-add). by=(block name, "file:line"):
        a plain write's writer; the problem when another block wrote one of
        these elements (an output element has one writer; adds accumulate)."""
        window = self._window(coords, tile.shape)
        if window is None:
            return None
        dst, src = window
        problem = self._claim(dst, by) if by is not None and not add else None
        value = tile[src]
        if add:
            old = self.obj[dst]
            old = old.to(__import__("torch").float32).numpy() if self.is_torch else old
            value = np.asarray(old, np.float32) + value
        part = numerics.round_to(self.dtype, value)    # exact when the dtypes agree
        if self.is_torch:
            import torch
            self.obj[dst] = torch.from_numpy(np.ascontiguousarray(part)).to(self.obj.dtype)
        else:
            self.obj[dst] = part.astype(self.obj.dtype)
        return problem

    def _claim(self, dst, by: tuple) -> str | None:
        """Record `by` as the writer of the elements at dst; what another
        block's earlier write of one of them says, or None."""
        if self.writer is None:
            self.writer = np.zeros(self.shape, np.int32)
        if not self.writers or self.writers[-1] != by:
            self.writers.append(by)
        blocks = np.array([hash(b) for b, _ in self.writers] + [0])   # [-1]: no writer
        prior = self.writer[dst]
        other = blocks[prior - 1] != hash(by[0])
        other &= prior > 0
        if other.any():
            at = iter(np.argwhere(other)[0])
            element = tuple(i if isinstance(i, int) else i.start + int(next(at)) for i in dst)
            first = self.writers[prior[other].flat[0] - 1]
            return (f"blocks {first[0]} and {by[0]} both write element {element} of "
                    f"argument {self.name!r} (at {first[1]} and {by[1]}): each output "
                    f"element must have one writer (accumulate with tk.atomic_add or a "
                    f"TMA reduce-add)")
        self.writer[dst] = len(self.writers)
        return None
