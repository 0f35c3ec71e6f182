"""Happens-before between blocks (and ranks) through global memory.

On the GPU nothing orders one block's global writes before another block's
reads but a flag: the writer releases it (tk.signal) after the writes, the
reader acquires it (tk.wait_signal) before the reads. The interpreter runs
blocks one after another, so a read with no wait in front of it would see
the data whenever the writer happened to run first; this module says
whether the program orders them, whichever ran first here.

Each block counts its releases. A global write is stamped with its block's
count at the time (memory.GlobalArray keeps a writer and a stamp per
element); a signal publishes into its flag what the block knows — the count
each block had reached when its releases reached this one, and its own —
and then counts one more; a wait that sees the flag reach its count joins
what the signals up to the one that reached it published (none, when the
flag held the count before the launch's signals: a stale count orders
nothing). A block is ordered after another block's write when what it knows
of the writer's count is at least the write's stamp.

What it misses (each a race it does not report; it reports none that the
program orders): knowledge is per block, not per warp, so a warp that reads
before another warp of its block has waited (and met it at a barrier) is
not told apart from one after; a TMA store counts as written, and a TMA
load as read, when issued, not when complete; only the last reader of an
element is kept. Adds (tk.atomic_add, TMA reduce-add) are stamped like
writes but need no order among themselves: a read or plain write of an
element another block adds into must be ordered after the add, as after a
write (memory.GlobalArray.adds); as of readers, only an element's last
adder is kept, so a read ordered after it but not after an earlier adder
of another block is missed.
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


def publish(flags: dict, at: tuple, before: int, after: int, clock: dict, add: bool) -> None:
    """A signal on the flag at `at` (flags: an array's signals by element)
    that took it from `before` to `after` (u32 values) and published `clock`.
    A store starts the flag's history anew; an add extends it (an acquire
    that reads the sum is ordered after every add up to the one that made
    it: a release sequence)."""
    history = flags.get(at)
    if history is None or not add:
        history = flags[at] = {"start": before, "signals": []}
    history["signals"].append((after, clock))


def reached(value: int, expected: int) -> bool:
    """tk.wait_signal's compare: (value - expected) as a signed 32-bit number >= 0."""
    return ((value - expected) & 0xFFFFFFFF) < 1 << 31


def acquire(flags: dict, at: tuple, expected: int) -> dict:
    """What a wait that saw the flag at `at` reach `expected` is ordered
    after: the signals of this launch up to the first one that reached it;
    none when it held that much before them (a count of an earlier launch:
    the wait orders nothing)."""
    history = flags.get(at)
    if history is None or reached(history["start"], expected):
        return {}
    clock: dict = {}
    for value, published in history["signals"]:
        for name, count in published.items():
            clock[name] = max(count, clock.get(name, -1))
        if reached(value, expected):
            break
    return clock


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
        numbers, which = np.unique(prior, return_inverse=True)   # (the accessors here only)
        known = np.array([order.of(self.who[n][0]) if n else ORDERED for n in numbers], np.int64)
        late = known[which.reshape(prior.shape)] < self.stamp[index]
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
