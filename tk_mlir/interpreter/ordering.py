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

Knowledge is per warp: a wait orders the warp that waited, and another warp
of the block learns it only through the block's own synchronization (a
barrier, a semaphore) that orders it after the wait: each warp keeps what
it knew at each of its waits, stamped with its own clock (machine.Block's
vector clocks, ticked at the wait), and a warp ordered after that clock
value (Block.acquire) joins it. An access by several warps at once (a tile
op of a warpgroup) counts as ordered only when all of them are.

What it misses (each a race it does not report; it reports none that the
program orders): releases are counted per block, so a signal covers the
block's writes before it, even those of a warp the signalling warp has not
met; a TMA store counts as written, and a TMA load as read, when issued,
not when complete; only the last reader of an element is kept. Adds (tk.atomic_add, TMA reduce-add) are stamped like
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
    """What each warp of one block knows of every block's releases, and the
    block's own count."""

    def __init__(self, name, num_warps: int = 1):
        self.name = name
        self.releases = 0
        # per warp: block name -> the release count it is ordered after
        self.known: list[dict] = [{} for _ in range(num_warps)]
        # per warp: (its own clock at a wait, what it knew then), in order
        self.history: list[list] = [[] for _ in range(num_warps)]

    def release(self, warp: int) -> dict:
        """The knowledge a signal by `warp` publishes; later writes are not
        covered."""
        clock = {**self.known[warp], self.name: self.releases}
        self.releases += 1
        return clock

    def acquire(self, warp: int, clock: dict | None, time: int) -> None:
        """`warp` waited at its own clock `time` and is ordered after `clock`."""
        known = self.known[warp]
        if _join(known, clock or {}, self.name):
            self.history[warp].append((time, dict(known)))

    def join(self, warp: int, clock) -> None:
        """`warp` is now ordered after the other warps' events up to their
        entries of the vector clock `clock` (machine.Block.acquire): it learns
        what each knew at its last wait at or before that."""
        known = self.known[warp]
        for other, history in enumerate(self.history):
            if other != warp and history:
                upto = clock[other]
                for time, theirs in reversed(history):
                    if time <= upto:
                        _join(known, theirs, self.name)
                        break

    def view(self, warps) -> "OrderView":
        """The order of an access by `warps` (indices) at once: ordered after a
        write only when every one of them is."""
        return OrderView(self, [self.known[w] for w in warps])


class OrderView:
    """What memory.GlobalArray asks of an accessor: its block's name and
    release count, and what it is ordered after (`of`)."""
    __slots__ = ("name", "releases", "_known")

    def __init__(self, order: BlockOrder, known: list):
        self.name, self.releases, self._known = order.name, order.releases, known

    def of(self, name) -> int:
        """The count of `name`'s releases these warps are all ordered after."""
        if name == self.name:
            return ORDERED
        return min(k.get(name, -1) for k in self._known)


def _join(known: dict, clock: dict, own) -> bool:
    """Raise `known` to `clock` (entries of `own` aside); whether it grew."""
    grew = False
    for name, count in clock.items():
        if name != own and count > known.get(name, -1):
            known[name] = count
            grew = True
    return grew


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

    def record(self, index, order: OrderView, at: str) -> None:
        if self.number is None:
            self.number = np.zeros(self.shape, np.int32)
            self.stamp = np.zeros(self.shape, np.int64)
        number = self.numbers.get((order.name, at))
        if number is None:
            number = self.numbers[order.name, at] = len(self.who)
            self.who.append((order.name, at))
        self.number[index] = number
        self.stamp[index] = order.releases

    def unordered(self, index, order: OrderView, ok=None) -> tuple | None:
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
