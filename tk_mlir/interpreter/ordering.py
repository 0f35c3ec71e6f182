"""Happens-before through global memory: between blocks (and ranks), and
between the warps of one block.

On the GPU nothing orders one block's global writes before another block's
reads but a flag: the writer releases it (tk.signal) after the writes, the
reader acquires it (tk.wait_signal) before the reads. The interpreter runs
blocks one after another, so a read with no wait in front of it would see
the data whenever the writer happened to run first; this module says
whether the program orders them, whichever ran first here.

Time is each warp's own entry of its block's vector clocks (machine.Block,
races.py), ticked at every signal and wait. A global access is stamped with
its block, and each of its warps with that warp's time (memory.GlobalArray
keeps an accessor per element). A signal by warp w publishes into its flag
what w knows: of its own block, every warp's time that w is ordered after
(its vector clock: its own events, and other warps' up to a barrier or
semaphore they met at), and what its waits and barriers taught it of other
blocks; a wait that sees the flag reach its count joins what the signals
up to the one that reached it published (none, when the flag held the count
before the launch's signals: a stale count orders nothing). An access is
ordered after another block's when, for each warp of that access, what it
knows of that warp's time is at least the stamp.

Knowledge is per warp: a wait orders the warp that waited, and another warp
of the block learns it only through the block's own synchronization (a
barrier, a semaphore) that orders it after the wait: each warp keeps what
it knew at each of its waits, stamped with its time then, and a warp
ordered after that time (Block.acquire) joins it. An access by several
warps at once (a tile op of a warpgroup) counts as ordered only when all of
them are, and needs all of its warps' times covered.

Within one block the same stamps are checked against the block's vector
clocks: an access is ordered after another of its block when each of its
warps has met (at a barrier, a semaphore, or through a flag) each warp of
the other access at or after its stamp. Two accesses that share a warp
count as ordered (program order for one warp; which threads of a shared
warp touched an element is not tracked), and two plain writes of one block
that store the same value are not a race (warps that each hold a copy of a
tile, scope="warp" in a larger block, all store it); different values are.

A TMA store's (or reduce-add's) write is stamped when it completes, at the
tk.tma.store_wait(..., read=False) that covers it: until then (a wait with
read=True only frees its shared source) no access is ordered after it, so a
signal given before that wait does not publish it. A TMA load's read is
stamped with its semaphore's clock slot and the phase it completes: what is
ordered after a wait for that phase is ordered after the read (a signal
before the wait, or the issuing warp's own write before it, is not).

Adds (tk.atomic_add, TMA reduce-add) are stamped like writes but need no
order among themselves: a read or plain write of an element another block
adds into must be ordered after the add, as after a write
(memory.GlobalArray.adds). Of an element's readers and adders, those that
no later one is ordered after are kept (Accesses), so a write must be
ordered after each read that may have come before it, not only the last.

What it misses (each a race it does not report; it reports none that the
program orders): within one block, accesses that share a warp (a tile op
of a warpgroup, then another of the same warpgroup that threads read
differently); past memory.READERS unordered readers (or adders) of one
element, the oldest.
"""
from __future__ import annotations

import numpy as np

class BlockOrder:
    """What each warp of one block knows of other blocks' warps' times."""

    def __init__(self, name, num_warps: int = 1):
        self.name = name
        # per warp: (block name, warp) -> the time of that warp it is ordered after
        self.known: list[dict] = [{} for _ in range(num_warps)]
        # per warp: (its time at a wait, what it knew then), in order
        self.history: list[list] = [[] for _ in range(num_warps)]

    def release(self, warp: int, clock) -> dict:
        """What a signal by `warp`, whose vector clock is `clock`, publishes:
        its knowledge, and its own block's warps' times (and semaphores'
        phases) it is ordered after."""
        published = dict(self.known[warp])
        for other in range(len(clock)):         # its warps, then its semaphores' phases
            published[self.name, other] = int(clock[other])
        return published

    def acquire(self, warp: int, clock: dict | None, time: int) -> None:
        """`warp` waited at its time `time` and is ordered after `clock`."""
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

    def view(self, warps, clocks) -> "OrderView":
        """The order of an access by `warps` (indices) at once, `clocks` the
        block's vector clocks: stamped with each one's time, ordered after
        another access only when every one of them is."""
        return OrderView(self.name, tuple((w, int(clocks[w, w])) for w in warps),
                         [self.known[w] for w in warps], [clocks[w].copy() for w in warps],
                         len(self.known))


PENDING = 2 ** 62       # a warp time no clock reaches: a TMA write not yet complete


class OrderView:
    """What memory.GlobalArray asks of an accessor: its block's name, its
    warps' times (`stamp`), and whether it is ordered after a stamp."""
    __slots__ = ("name", "stamp", "_known", "_clocks", "_warps")

    def __init__(self, name, stamp: tuple, known: list, clocks: list, warps: int):
        self.name, self.stamp, self._known, self._clocks = name, stamp, known, clocks
        self._warps = warps         # the block's: clock slots from there are its semaphores'

    def who(self, stamp: tuple) -> str:
        """Who made an access of this block stamped `stamp`, in words."""
        warps = [w for w, _ in stamp if w < self._warps]
        if not warps:
            return "a TMA load (its phase not waited for here)"
        return f"warp{'s' if len(warps) > 1 else ''} {', '.join(map(str, warps))}"

    def pending(self) -> "OrderView":
        """This view with its warps' times not yet reached: the stamp of a TMA
        write until a store_wait(read=False) completes it (`completed`), which
        nothing is ordered after."""
        return self.stamped(tuple((w, PENDING) for w, _ in self.stamp))

    def stamped(self, stamp: tuple) -> "OrderView":
        """This view (its warps' knowledge) recording accesses as `stamp`: a
        TMA load's read as (its semaphore's clock slot, the phase it
        completes), so what is ordered after the read is what is ordered
        after a wait for that phase."""
        return OrderView(self.name, stamp, self._known, self._clocks, self._warps)

    def after(self, name, stamp: tuple) -> bool:
        """Whether these warps are all ordered after the access of block
        `name` stamped `stamp`. Of their own block's: by its vector clocks
        (a barrier, a semaphore, a flag between them), for the earlier
        access's warps that are not among these (one warp's accesses are in
        program order; which thread of a shared warp touched an element is
        not known, so those count as ordered)."""
        if name == self.name:
            mine = {w for w, _ in self.stamp}
            return all(clock[warp] >= time for clock in self._clocks
                       for warp, time in stamp if warp not in mine)
        return all(k.get((name, warp), -1) >= time for k in self._known for warp, time in stamp)


def _join(known: dict, clock: dict, own) -> bool:
    """Raise `known` to `clock` (entries of block `own` aside); whether it grew."""
    grew = False
    for key, time in clock.items():
        if key[0] != own and time > known.get(key, -1):
            known[key] = time
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
    """One kind of access (plain writes, reads or adds) to one array by the
    blocks of a launch: per element its last `slots` accessors that no later
    one is ordered after (numbers into `who`: (block name, "file:line", its
    warps' times); 0: none). A new access replaces those it is ordered
    after: the order is transitive, so what is ordered after the new one is
    ordered after them too (FastTrack's read sets, bounded: past `slots`
    unordered accessors of one element, the oldest is forgotten). Plain
    writes keep one: a write another block's is not ordered after is
    reported there, and a block's own unordered writes must store the same
    values (ordering.py's docstring)."""

    def __init__(self, shape: tuple, slots: int = 1):
        self.shape, self.slots = shape, slots
        self.number: np.ndarray | None = None      # (slots, *shape)
        self.who: list = [None]
        self.numbers: dict = {}

    def record(self, index, order: OrderView, at: str) -> None:
        if self.number is None:
            self.number = np.zeros((self.slots,) + self.shape, np.int32)
        key = (order.name, at, order.stamp)
        number = self.numbers.get(key)
        if number is None:
            number = self.numbers[key] = len(self.who)
            self.who.append(key)
        where = (slice(None),) + tuple(index)
        if self.slots == 1:
            self.number[where] = number
            return
        prior = self.number[where]
        kept = (prior != 0) & ~self._ordered(prior, order)
        out = np.zeros_like(prior)
        out[0] = number
        if kept.any():              # unordered accessors stay, the newest first
            rank = np.cumsum(kept, axis=0)             # 1, 2, ... among the kept
            for s in range(self.slots):
                for d in range(1, self.slots):
                    out[d] = np.where(kept[s] & (rank[s] == d), prior[s], out[d])
        self.number[where] = out

    def _ordered(self, prior: np.ndarray, order: OrderView,
                 other_blocks: bool = False) -> np.ndarray:
        """Per entry of `prior` (accessor numbers): none, or an access that
        `order`'s warps are ordered after now (other_blocks: also any of
        its own block's)."""
        numbers, which = np.unique(prior, return_inverse=True)   # (the accessors here only)
        ordered = np.array([not n or (other_blocks and self.who[n][0] == order.name) or
                            order.after(self.who[n][0], self.who[n][2]) for n in numbers], bool)
        return ordered[which.reshape(prior.shape)]

    def unordered(self, index, order: OrderView, ok=None,
                  other_blocks: bool = False) -> tuple | None:
        """(element, (block name, "file:line", its warps' stamp)) of the first
        element at `index` (a window of ints and slices, or per-lane
        coordinate arrays with `ok` marking the real ones) one of whose kept
        accesses is not ordered before `order`'s warps now (other_blocks:
        only another block's counts)."""
        return self.first(index, self.late(index, order, other_blocks, ok))

    def late(self, index, order: OrderView, other_blocks: bool = False,
             ok=None) -> np.ndarray | None:
        """Per slot and element at `index`: a kept access not ordered before
        `order`'s warps now (see unordered); None before any access."""
        if self.number is None:
            return None
        late = ~self._ordered(self.number[(slice(None),) + tuple(index)], order, other_blocks)
        return late if ok is None else late & ok

    def first(self, index, late: np.ndarray | None) -> tuple | None:
        """unordered's (element, accessor) for the first element `late` marks."""
        if late is None:
            return None
        anywhere = late.any(axis=0)
        if not anywhere.any():
            return None
        first = tuple(np.argwhere(anywhere)[0])
        slot = int(np.argmax(late[(slice(None),) + first]))
        rest = iter(first)
        element = tuple(int(i[first]) if isinstance(i, np.ndarray) else
                        int(i) if isinstance(i, (int, np.integer)) else i.start + int(next(rest))
                        for i in index)
        prior = self.number[(slice(None),) + tuple(index)]
        return element, self.who[prior[(slot,) + first]]
