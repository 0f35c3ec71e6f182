"""Global arrays as the interpreter reads and writes them: numpy arrays and
CPU torch tensors, written in place, read and written as f32 (or i32) values.

Tile coordinates follow lowering/memory.py: the last dims (as many as the
tile has) are tile coordinates, scaled by the tile's shape; the outer dims
are element coordinates (all of them with `element_coords`: a TMA op's
`elements`). Elements outside the array (including negative coordinates:
the GPU compares unsigned) read `fill` and are not written.
"""
from __future__ import annotations

import sys

import numpy as np

from ..runtime.arguments import ArgumentError, canonical_dtype
from . import numerics
from .machine import Waiters
from .ordering import Accesses


# Unordered readers (and adders) of one element the race checks remember
# (ordering.Accesses): more are rare (a tile read by every block of a column,
# then written by one that waited for a few of them).
READERS = 4


class GlobalArray:
    """One tensor argument: its shape, tk dtype, and element access."""

    def __init__(self, obj, name: str):
        torch = sys.modules.get("torch")
        self.is_torch = torch is not None and isinstance(obj, torch.Tensor)
        if self.is_torch and obj.device.type != "cpu":
            raise ArgumentError(f"argument {name!r} is on {obj.device}; the interpreter runs "
                                f"on CPU arrays (pass a numpy array or x.cpu(), and copy the "
                                f"outputs back)")
        if hasattr(obj, "peers") and hasattr(obj, "local"):      # a tk.PeerTensor
            raise ArgumentError(f"argument {name!r} is a tk.gl parameter and takes one array; a "
                                f"{type(obj).__name__} (every rank's copy) goes to a tk.pgl "
                                f"parameter, or pass its .local")
        if not self.is_torch and not isinstance(obj, np.ndarray):
            raise ArgumentError(f"argument {name!r}: the interpreter takes numpy arrays or CPU "
                                f"torch tensors, got {type(obj).__name__}")
        # The GPU reads and writes a tensor's memory whatever autograd records
        # of it (a requires_grad input, or output, is no error there): so does
        # the interpreter, through a view of the same memory outside autograd.
        self.obj, self.name = (obj.detach() if self.is_torch else obj), name
        self.read_only = not self.is_torch and not obj.flags.writeable
        self.shape = tuple(int(d) for d in obj.shape)
        self.dtype = canonical_dtype(obj.dtype)
        # Plain writes, reads and adds (tk.atomic_add, TMA reduce-add) by the
        # blocks of this launch, which flags must order (ordering.py); adds
        # need no order among themselves.
        self.writes = Accesses(self.shape)
        self.reads, self.adds = Accesses(self.shape, READERS), Accesses(self.shape, READERS)
        self.flag_clocks: dict = {}              # element -> its signals (ordering.publish)
        self.counted_by: tuple | None = None     # (location, parts) of a tk.store_partial
        #                                          that counts in this array
        # Blocks stalled on a flag here (tk.wait_signal), by element: each
        # write wakes those of its elements (a tile's, all of them).
        self.waiters = Waiters()

    def elements(self, index: tuple, by: tuple | None = None) -> np.ndarray:
        """Elements at per-lane element coordinates (one int array per dim),
        as f32 or i32; 0 where a coordinate is outside the array. by=(the
        reader's BlockOrder, "file:line", location): a read that another
        block's write of one of them must be ordered before (else an
        InterpretError at the location)."""
        ok = np.ones(np.broadcast(*index).shape, bool)
        for i, d in zip(index, self.shape):
            ok &= (i >= 0) & (i < d)
        safe = tuple(np.where(ok, i, 0) for i in index)
        if by is not None:
            self._check_read(safe, by, ok)
        holder = np.int32 if self.dtype == "i32" else np.float32
        if self.is_torch:
            import torch
            values = self.obj[tuple(torch.from_numpy(np.asarray(i, np.int64)) for i in safe)]
            values = values.to(torch.int32 if holder is np.int32 else torch.float32).numpy()
        else:
            values = self.obj[safe].astype(holder)
        return np.where(ok, values, holder(0))

    def update_element(self, index: tuple, value: int, add: bool) -> tuple[int, int]:
        """Add `value` to (or store it in) one element of an i32 array, wrapping
        as a u32 counter does; (the old, the new value) as u32s. A coordinate
        outside the array is an IndexError."""
        if not all(0 <= i < d for i, d in zip(index, self.shape)):
            raise IndexError(f"element {index} is outside {self.name!r} of shape {self.shape}")
        self._check_writable()
        old = int(self.obj[index]) & 0xFFFFFFFF
        new = (old + value if add else value) & 0xFFFFFFFF
        self.obj[index] = new - (1 << 32) if new >= 1 << 31 else new
        self.waiters.wake(tuple(index))
        return old, new

    def overlaps(self, coords, tile_shape) -> bool:
        """Does the tile at `coords` hold any element of the array?"""
        return self._window(coords, tile_shape) is not None

    def _window(self, coords, tile_shape,
                element_coords: bool = False) -> tuple[tuple, tuple] | None:
        """(array index, tile index) of the in-bounds part of the tile at
        `coords` (tile coordinates in the tile's dims, elements outside
        them; all elements with element_coords), None when none of it is
        in bounds."""
        rank, tile_rank = len(self.shape), len(tile_shape)
        outer, inner = coords[:rank - tile_rank], coords[rank - tile_rank:]
        if any(not 0 <= c < d for c, d in zip(outer, self.shape)):
            return None
        src, dst = list(outer), []
        for c, n, extent in zip(inner, tile_shape, self.shape[rank - tile_rank:]):
            start = c if element_coords else c * n
            lo, hi = max(0, -start), min(n, extent - start)
            if hi <= lo:
                return None
            src.append(slice(start + lo, start + hi))
            dst.append(slice(lo, hi))
        return tuple(src), tuple(dst)

    def load(self, coords, tile_shape, dtype: str, fill, by: tuple | None = None,
             element_coords: bool = False) -> np.ndarray:
        """The tile at coords (`fill` outside the array, element_coords: as
        _window's); by: as `elements`."""
        out = np.full(tile_shape, numerics.scalar_for(dtype, fill), numerics.HOLDER[dtype])
        window = self._window(coords, tile_shape, element_coords)
        if window is not None:
            src, dst = window
            if by is not None:
                self._check_read(src, by)
            part = self.obj[src]
            if self.is_torch:
                import torch
                part = part.to(torch.float32 if dtype != "i32" else torch.int32).numpy()
            out[dst] = numerics.round_to(dtype, part)
        return out

    def store(self, coords, tile: np.ndarray, add: bool = False,
              by: tuple | None = None, element_coords: bool = False) -> str | None:
        """Write tile at coords (add: add it to what is there, in f32, then
        round: red.global.add and TMA reduce-add). by=(the writer's
        BlockOrder, "file:line") of a plain write; the problem when another
        block wrote one of these elements and nothing orders that write
        before this one (adds accumulate in any order). element_coords: as
        _window's."""
        window = self._window(coords, tile.shape, element_coords)
        if window is None:
            return None
        dst, src = window
        self._check_writable()
        value = tile[src]
        if add:
            value = self._held(dst) + value
        part = numerics.round_to(self.dtype, value)    # exact when the dtypes agree
        problem = None if by is None else self._add(dst, by) if add else \
            self._claim(dst, by, part)
        if self.is_torch:
            import torch
            self.obj[dst] = torch.from_numpy(np.ascontiguousarray(part)).to(self.obj.dtype)
        else:
            self.obj[dst] = part.astype(self.obj.dtype)
        self.waiters.wake()
        return problem

    def completed(self, coords, tile_shape, add: bool, by: tuple,
                  element_coords: bool = False) -> None:
        """A TMA write of the tile at coords (issued with a pending stamp,
        OrderView.pending) is complete: its elements' writer (or last adder)
        is restamped `by` = (the writer's order now, "file:line")."""
        window = self._window(coords, tile_shape, element_coords)
        if window is not None:
            (self.adds if add else self.writes).record(window[0], *by)

    def _check_writable(self) -> None:
        """The kernel writes this array: it must not be a read-only numpy array
        (the GPU writes its outputs in place; numpy refuses to here)."""
        if self.read_only:
            raise ArgumentError(f"argument {self.name!r} is a read-only numpy array (its "
                                f"flags.writeable is False: np.broadcast_to, np.frombuffer "
                                f"and some views make those), and the kernel writes it; pass "
                                f"a writable array, e.g. x.copy()")

    def _held(self, dst) -> np.ndarray:
        """The elements at window dst as they are now, in f32."""
        old = self.obj[dst]
        return np.asarray(old.to(__import__("torch").float32).numpy() if self.is_torch else old,
                          np.float32)

    def _claim(self, dst, by: tuple, values: np.ndarray) -> str | None:
        """Record `by` as the writer of the elements at dst (to hold `values`);
        what an earlier write or read of one of them by another block, not
        ordered before this write, says, or an earlier write by its own
        block's other warps of a different value, or None."""
        order, at = by
        late = self.writes.late(dst, order)
        if late is not None and late.any():     # its own block's: only the same values may
            held = self._held(dst)              # race
            differ = (held != values) & ~(np.isnan(held) & np.isnan(values))
            late &= differ
            first = self.writes.first(dst, late)
            if first is not None and first[1][0] == order.name:
                element, (_, written_at, stamp) = first
                return self._within_block(order, "writes", element, at, "wrote another value "
                                          "into", written_at, stamp)
        late = self.writes.unordered(dst, order, other_blocks=True)
        if late is not None:
            element, (first, first_at, _) = late
            return (f"blocks {first} and {order.name} both write element {element} of argument "
                    f"{self.name!r} (at {first_at} and {at}) with nothing ordering the two: "
                    f"each output element must have one writer (accumulate with "
                    f"tk.atomic_add or a TMA reduce-add), or the second must tk.wait_signal "
                    f"for a signal the first gives after its write")
        late = self.adds.unordered(dst, order)
        if late is not None:
            element, (adder, add_at, stamp) = late
            if adder == order.name:
                return self._within_block(order, "writes", element, at, "added into", add_at,
                                          stamp)
            return (f"block {order.name} writes element {element} of argument {self.name!r} "
                    f"(at {at}), which block {adder} adds into (at {add_at}) with nothing "
                    f"ordering the two, so the add may come before or after the write; make "
                    f"one of them the other kind (all adds, into zeros), or order them with "
                    f"tk.signal / tk.wait_signal")
        late = self.reads.unordered(dst, order)
        if late is not None:
            element, (reader, read_at, stamp) = late
            if reader == order.name:
                return self._within_block(order, "writes", element, at, "read", read_at,
                                          stamp)
            return (f"block {order.name} writes element {element} of argument {self.name!r}, "
                    f"which block {reader} read (at {read_at}) with nothing ordering that read "
                    f"before this write, so it may read either value (as when a wait lets it "
                    f"through too early: is the count it waits for this launch's?); the "
                    f"reader must tk.signal after its read and this block tk.wait_signal for "
                    f"that signal before writing")
        self.writes.record(dst, order, at)
        return None

    def _within_block(self, order, verb: str, element, at: str, did: str, then: str,
                      stamp: tuple) -> str:
        """An access of `element` at `at` by `order`'s warps that another
        access of its own block (stamped `stamp`, at `then`) is not ordered
        before."""
        return (f"data race in global memory: the code at {at} {verb} element {element} of "
                f"argument {self.name!r}, which {order.who(stamp)} of "
                f"the same block {did} at {then} with nothing ordering the two: a barrier "
                f"(tk.barrier(), tk.named_barrier) or a semaphore that both sides meet between "
                f"them orders them, or a tk.signal after the first (once all its warps are "
                f"done: a barrier among them first) that the second tk.wait_signals for (after "
                f"a TMA store: tk.tma.store_wait first)")

    def _add(self, dst, by: tuple) -> str | None:
        """Record `by` as an adder of the elements at dst; what an earlier
        plain write or read of one of them by another block, not ordered
        before this add, says, or None (adds in any order are fine)."""
        order, at = by
        late = self.writes.unordered(dst, order)
        if late is not None:
            element, (writer, written_at, stamp) = late
            if writer == order.name:
                return self._within_block(order, "adds into", element, at, "wrote",
                                          written_at, stamp)
            return (f"block {order.name} adds into element {element} of argument "
                    f"{self.name!r} (at {at}), which block {writer} wrote (at {written_at}) "
                    f"with nothing ordering the two, so the write may come after the add and "
                    f"undo it; make one of them the other kind (all adds, into zeros), or "
                    f"order them with tk.signal / tk.wait_signal")
        late = self.reads.unordered(dst, order)
        if late is not None:
            element, (reader, read_at, stamp) = late
            if reader == order.name:
                return self._within_block(order, "adds into", element, at, "read", read_at,
                                          stamp)
            return (f"block {order.name} adds into element {element} of argument "
                    f"{self.name!r} (at {at}), which block {reader} read (at {read_at}) with "
                    f"nothing ordering that read before this add, so it may read the value "
                    f"before or after it; order them with tk.signal / tk.wait_signal")
        self.adds.record(dst, order, at)
        return None

    def _check_read(self, src, by: tuple, ok=None) -> None:
        """Raise when another block's write of an element at src is not
        ordered before this read; then record the read."""
        from .machine import error
        order, at, loc = by
        late = self.writes.unordered(src, order, ok)
        if late is not None:
            element, (writer, written_at, stamp) = late
            if writer == order.name:
                raise error(loc, self._within_block(order, "reads", element, at, "wrote",
                                                    written_at, stamp))
            raise error(loc, f"block {order.name} reads element {element} of argument "
                             f"{self.name!r}, which block {writer} wrote (at {written_at}) with "
                             f"nothing ordering that write before this read: the writer must "
                             f"tk.signal after it (after TMA writes: tk.tma.store_wait(0, "
                             f"read=False) and tk.fence(scope, async_proxy=True) first) and "
                             f"this block tk.wait_signal for that signal before reading (in the "
                             f"reading warps, or in a warp that meets them at a barrier or "
                             f"semaphore after its wait)")
        late = self.adds.unordered(src, order, ok)
        if late is not None:
            element, (adder, added_at, stamp) = late
            if adder == order.name:
                raise error(loc, self._within_block(order, "reads", element, at, "added into",
                                                    added_at, stamp))
            raise error(loc, f"block {order.name} reads element {element} of argument "
                             f"{self.name!r}, which block {adder} adds into (at {added_at}: "
                             f"tk.atomic_add or a TMA reduce-add) with nothing ordering that add "
                             f"before this read, so it may read the sum before or after the "
                             f"add: the adder must tk.signal after it (after a TMA reduce-add: "
                             f"tk.tma.store_wait(0, read=False) and tk.fence(scope, "
                             f"async_proxy=True) first) and this block tk.wait_signal for it "
                             f"(in the reading warps, or in one that meets them after its wait)")
        self.reads.record(src if ok is None else tuple(i[ok] for i in src), order, at)
