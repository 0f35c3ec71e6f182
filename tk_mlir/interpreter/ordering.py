"""Happens-before between blocks (and ranks) through global memory.

On the GPU nothing orders one block's global writes before another block's
reads but a flag: the writer releases it (tk.signal) after the writes, the
reader acquires it (tk.wait_signal) before the reads. The interpreter runs
blocks one after another, so a read with no wait in front of it would see
the data whenever the writer happened to run first; this module says
whether the program orders them, whatever the schedule.

Each block counts its releases. A global write is stamped with its block's
count at the time (memory.GlobalArray keeps a writer and a stamp per
element); a signal publishes into its flag what the block knows — the count
each block had reached when its releases reached this one, and its own —
and then counts one more; a wait that sees the flag up joins what the flag
holds. A block is ordered after another block's write when what it knows of
the writer's count is at least the write's stamp.

Knowledge is per block, not per warp: a warp that reads before another warp
of its block has waited (and met it at a barrier) is not told apart from
one after. That misses such races; it reports none that the program orders.
Adds (tk.atomic_add, TMA reduce-add) are not stamped: they accumulate in any
order.
"""
from __future__ import annotations

import numpy as np

ORDERED = np.iinfo(np.int64).max       # what a block knows of its own writes


class BlockOrder:
    """What one block knows of every block's releases, and its own count."""

    def __init__(self, name):
        self.name = name
        self.releases = 0
        self.known: dict = {}            # block name -> the release count it is ordered after

    def release(self) -> dict:
        """The knowledge a signal publishes; later writes are not covered."""
        clock = {**self.known, self.name: self.releases}
        self.releases += 1
        return clock

    def acquire(self, clock: dict | None) -> None:
        for name, count in (clock or {}).items():
            if name != self.name and count > self.known.get(name, -1):
                self.known[name] = count

    def of(self, name) -> int:
        """The count of `name`'s releases this block is ordered after."""
        return ORDERED if name == self.name else self.known.get(name, -1)


def publish(flags: dict, at: tuple, clock: dict, add: bool) -> None:
    """A signal on the flag at `at` (flags: an array's clocks by element): a
    store replaces what the flag held; an add joins it (an acquire that sees
    the sum is ordered after every add that made it)."""
    if add and at in flags:
        old = flags[at]
        clock = {n: max(c, old.get(n, -1)) for n, c in clock.items()} | \
            {n: c for n, c in old.items() if n not in clock}
    flags[at] = clock


class Accesses:
    """One kind of access (plain writes, or reads) to one array by the blocks
    of a launch: per element the last accessor (a number into `who`: (block
    name, "file:line"); 0: none) and its release count at the access."""

    def __init__(self, shape: tuple):
        self.shape = shape
        self.number: np.ndarray | None = None
        self.stamp: np.ndarray | None = None
        self.who: list = [None]
        self.numbers: dict = {}

    def record(self, index, order: BlockOrder, at: str) -> None:
        if self.number is None:
            self.number = np.zeros(self.shape, np.int32)
            self.stamp = np.zeros(self.shape, np.int64)
        number = self.numbers.get((order.name, at))
        if number is None:
            number = self.numbers[order.name, at] = len(self.who)
            self.who.append((order.name, at))
        self.number[index] = number
        self.stamp[index] = order.releases

    def unordered(self, index, order: BlockOrder, ok=None) -> tuple | None:
        """(element, (block name, "file:line")) of the first element at
        `index` (a window of ints and slices, or per-lane coordinate arrays
        with `ok` marking the real ones) whose last access was another
        block's, with nothing ordering it before `order`'s block now."""
        if self.number is None:
            return None
        prior = self.number[index]
        known = np.array([ORDERED] + [order.of(name) for name, _ in self.who[1:]], np.int64)
        late = known[prior] < self.stamp[index]
        if ok is not None:
            late &= ok
        if not late.any():
            return None
        first = tuple(np.argwhere(late)[0])
        rest = iter(first)
        element = tuple(int(i[first]) if isinstance(i, np.ndarray) else
                        int(i) if isinstance(i, (int, np.integer)) else i.start + int(next(rest))
                        for i in index)
        return element, self.who[prior[first]]
