"""Race detection by happens-before: vector clocks and shadow shared memory.

Every warp carries a vector clock (one slot per warp, then one per semaphore
for the TMA loads that complete on it, then one per warpgroup for its wgmma
groups: a wgmma's operand reads end at group g, and a warp that waited for
group g has that slot at g or later). Clocks move only through what orders
memory on the GPU: an arrival publishes the arriving warp's clock into the
semaphore, a wait that sees a phase complete takes the clock the phase
published; a named or block barrier joins its warps; a TMA load's write
carries the issuing warp's clock plus its semaphore's slot set to the phase
it completes. A warp advances its own slot after each release, so what it
does next is not ordered before the receivers. Each warp also keeps, per
slot, what last moved its knowledge of that slot (`Block.via`: nothing yet,
a barrier, a semaphore wait): a race report says what to do from it.

Each shared allocation has a shadow per (element, row, 16 columns; a shared
vector's per element): the last write's (slot, clock, line) and, per slot,
the clock and line of the reads since. Runs of 16 columns (within one column
block of a swizzled tile) are told apart, so are a col layout's warps, which
hold 16 columns each, and a vector's warps, which may hold elements a few
apart (a row sum's);
the columns within one run are not (two accesses to different columns of
one run count as the same place: a race reported there may be a false one).
A thread read, a wgmma operand read or a TMA store read must follow the
last write; a write must follow the last write and every read since. A pair
that is not ordered is reported with both lines whatever the schedule was —
two accesses that happened to run apart are still a race when nothing
orders them. Asynchronous readers (wgmma, TMA store) are also *in flight*
from their issue until their wait: a write to what they read then, or a read
of a tile a TMA load is still writing, is reported as such.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..dialects import types as T

from .shared import SharedRef, cols_of, rows_of

# What ordered a warp after a clock slot's events (Block.via): nothing yet, a
# barrier (block or named), a semaphore wait.
UNORDERED, BY_BARRIER, BY_SEMAPHORE = 0, 1, 2


@dataclass
class InFlight:
    """An asynchronous access still running: a TMA load writing `ref`, a
    wgmma / TMA store reading it, or a tcgen05.mma reading or writing it,
    issued at `where`."""
    kind: str        # "TMA load", "wgmma", "TMA store", "tcgen05.mma"
    ref: SharedRef
    where: str
    writes: bool


def _column_width(t) -> int:
    """The columns one shadow cell covers: 16 of a shared tile's (within one
    column block of a swizzled one; the columns a col layout's warp holds
    apart from the next warp's), a tensor tile's 16 columns (an MMA's N
    granule), one element of a shared vector (whose warps may each hold
    elements a few apart: a row sum's)."""
    if isinstance(t, T.ST):
        return math.gcd(t.block_cols, 16)
    if isinstance(t, T.TT):
        return 16
    return 1


def _overlap(a: SharedRef, b: SharedRef) -> bool:
    return a.alloc.key == b.alloc.key and \
        (a.index is None or b.index is None or a.index == b.index) and \
        a.row < b.row + b.rows and b.row < a.row + a.rows and \
        a.col < b.col + b.cols and b.col < a.col + a.cols


class Shadow:
    """One block's shadow memory and in-flight asynchronous accesses; `via`:
    the block's Block.via (read when a race is reported)."""

    def __init__(self, num_warps: int, num_slots: int, num_wgs: int, via: np.ndarray):
        self.num_warps, self.num_slots, self.num_wgs = num_warps, num_slots, num_wgs
        self.via = via
        self.allocs: dict[int, dict] = {}
        self.in_flight: list[InFlight] = []
        # warp -> a note on its last semaphore wait, if that was a tk.wait that
        # passed at once, taking no new phase (hopper._wait): a race hint (`_hint`)
        self.passed: dict[int, str | None] = {}

    def _of(self, ref: SharedRef) -> dict:
        s = self.allocs.get(ref.alloc.key)
        if s is None:
            t = ref.alloc.type
            shape = (ref.alloc.count, rows_of(t), -(-cols_of(t) // _column_width(t)))
            s = self.allocs[ref.alloc.key] = {
                "w_slot": np.full(shape, -1, np.int64), "w_clock": np.zeros(shape, np.int64),
                "w_where": np.full(shape, None, object),
                "w_what": np.full(shape, None, object),  # what wrote: 'TMA load', ...
                "w_unfenced": np.zeros(shape, bool),    # a thread write, no proxy fence after
                "r_clock": np.zeros((self.num_slots, *shape), np.int64),
                "r_where": np.full((self.num_slots, *shape), None, object)}
        return s

    @staticmethod
    def _cells(ref: SharedRef, rows: np.ndarray | None, cols: np.ndarray | None = None):
        """(element index or slice, row indices, column-cell indices) of the ref
        (rows, cols: masks of the ref's rows and columns that this access
        touches; None: all), shaped to index their outer product."""
        idx = slice(None) if ref.index is None else ref.index
        r = np.arange(ref.row, ref.row + ref.rows)
        r = r if rows is None else r[rows[:ref.rows]]
        w = _column_width(ref.alloc.type)
        if cols is None:
            c = np.arange(ref.col // w, -(-(ref.col + ref.cols) // w))
        else:
            c = np.unique((ref.col + np.flatnonzero(cols[:ref.cols])) // w)
        return idx, r[:, None], c[None, :]

    # ------------------------------------------------------------ in flight

    def start(self, kind: str, ref: SharedRef, where: str, writes: bool) -> InFlight:
        f = InFlight(kind, ref, where, writes)
        self.in_flight.append(f)
        return f

    def finish(self, f: InFlight) -> None:
        self.in_flight.remove(f)

    def _in_flight(self, ref: SharedRef, writes_only: bool, ignore=()):
        for f in self.in_flight:
            if (f.writes or not writes_only) and _overlap(f.ref, ref) and \
                    not any(f is g for g in ignore):
                return f
        return None

    def writing(self, ref: SharedRef) -> InFlight | None:
        """An asynchronous write still running on ref (a TMA load), or None."""
        return self._in_flight(ref, writes_only=True)

    def in_flight_on(self, ref: SharedRef) -> InFlight | None:
        """An asynchronous access still running on ref, or None."""
        return self._in_flight(ref, writes_only=False)

    # -------------------------------------------------------------- checks

    def read(self, ref: SharedRef, warp: int, clock: np.ndarray, where: str, what: str,
             rows=None, record: bool = True, cols=None) -> str | None:
        """A read of ref by `warp` (clock: its vector clock) at `where`; the
        problem as a sentence, or None. Records the read (record=False: an
        asynchronous reader — wgmma, TMA store — recorded when it completes:
        `read_done`)."""
        f = self._in_flight(ref, writes_only=True)
        if f is not None:
            return self._hint(f"{what} reads {ref.describe()} while the {f.kind} issued at "
                              f"{f.where} is still writing it: wait on its semaphore first"
                              + (" (the phase of the tk.mma_commit after it)"
                                 if f.kind == "tcgen05.mma" else ""), warp)
        s, (idx, r, c) = self._of(ref), self._cells(ref, rows, cols)
        unfenced = s["w_unfenced"][idx, r, c]
        if not record and unfenced.any():
            k = np.flatnonzero(unfenced.ravel())[0]
            return (f"{what} reads {ref.describe()} through the async proxy, but the "
                    f"threads' write at {s['w_where'][idx, r, c].ravel()[k]} has no proxy fence "
                    f"(fence.proxy.async) after it; tk-proxy-fences marks such writes, so "
                    f"this is a compiler bug: please report it")
        slots, clocks = s["w_slot"][idx, r, c], s["w_clock"][idx, r, c]
        late = (slots >= 0) & (clock[np.maximum(slots, 0)] < clocks)
        if late.any():
            k = np.flatnonzero(late.ravel())[0]
            writer = s["w_where"][idx, r, c].ravel()[k]
            slot = slots.ravel()[k]
            if slot >= self.num_warps:
                kind = s["w_what"][idx, r, c].ravel()[k]
                return self._hint(f"{what} reads {ref.describe()}, which the {kind} at "
                                  f"{writer} writes, without waiting for the semaphore phase "
                                  f"that {kind} completes (a read before its {kind} was "
                                  f"waited for)", warp)
            return self._hint(f"data race: {what} reads {ref.describe()}, written at {writer} "
                              f"by warp {slot}, with nothing ordering the two: "
                              f"{self._fix(warp, slot, writer, None)}", warp, slot)
        if record:
            self.read_done(ref, warp, clock[warp], where, rows, cols)
        return None

    def read_done(self, ref: SharedRef, slot: int, epoch: int, where: str, rows=None,
                  cols=None):
        """Record a read by clock slot `slot` (a warp, or a warpgroup's wgmma
        agent) at `epoch`."""
        s, (idx, r, c) = self._of(ref), self._cells(ref, rows, cols)
        s["r_clock"][slot, idx, r, c] = epoch
        s["r_where"][slot, idx, r, c] = where

    def write(self, ref: SharedRef, warp: int, clock: np.ndarray, where: str, what: str,
              rows=None, slot: int | None = None, epoch: int | None = None,
              unfenced: bool = False, ignore=(), record: bool = True,
              cols=None, same_values=None) -> str | None:
        """A write of ref at `where`, ordered after what `clock` covers; recorded as
        by (slot, epoch) (default: the warp at its clock); unfenced: a thread
        write with no proxy fence after it; ignore: accesses in flight that are
        ordered before it (one thread's earlier tcgen05.mma); record=False: an
        asynchronous writer, recorded when it completes; same_values: None,
        or whether it stores what ref holds already (a function, asked only
        where a race is in question), so an unordered earlier store of a warp
        is no race (a warp-scope tile every warp stores). The problem, or
        None."""
        async_kind = _kind(what) if slot is not None else None
        f = self._in_flight(ref, writes_only=False, ignore=ignore)
        if f is not None:
            until = {"wgmma": "its tk.mma_wait", "TMA store": "tk.tma.store_wait",
                     "TMA load": "its semaphore's phase completes",
                     "tcgen05.mma": "the phase of the tk.mma_commit after it completes"
                     }[f.kind]
            verb = "writes" if f.writes else "reads"
            return self._hint(f"{what} writes {ref.describe()} while the {f.kind} issued at "
                              f"{f.where} still {verb} it (until {until})", warp)
        s, (idx, r, c) = self._of(ref), self._cells(ref, rows, cols)
        slots, clocks = s["w_slot"][idx, r, c], s["w_clock"][idx, r, c]
        late = (slots >= 0) & (clock[np.maximum(slots, 0)] < clocks)
        reads = s["r_clock"][:, idx, r, c]
        read_late = reads > clock.reshape((-1,) + (1,) * (reads.ndim - 1))
        # Where a warp stored these values unordered with this store, it stays
        # the writer and this store counts as a read of its values: a later
        # write must come after both, a later read after the first. (Nor does
        # a store of the values there race with reads of them.)
        keep = None
        if same_values is not None:
            keep = late & (slots < self.num_warps)
            if (keep.any() or read_late.any()) and same_values():
                late &= ~keep
                read_late[...] = False
            else:
                keep = None
        if late.any():
            k = np.flatnonzero(late.ravel())[0]
            writer, other = s["w_where"][idx, r, c].ravel()[k], int(slots.ravel()[k])
            # (who wrote, as a read-write race names its reader: a warp, or the
            # asynchronous writer, e.g. a TMA load)
            by = self._who(other) if other < self.num_warps else \
                f"the {s['w_what'][idx, r, c].ravel()[k]}"
            return self._hint(f"data race: {what} writes {ref.describe()}, also written at "
                              f"{writer} by {by}, with nothing ordering the two writes: "
                              f"{self._fix(warp, other, writer, async_kind)}", warp, other)
        if read_late.any():
            w = int(np.argwhere(read_late)[0][0])
            k = np.flatnonzero(read_late[w].ravel())[0]
            reader = s["r_where"][w][idx, r, c].ravel()[k]
            return self._hint(f"data race: {what} writes {ref.describe()}, which {self._who(w)} "
                              f"read at {reader}, with nothing ordering the read before the "
                              f"write: {self._fix(warp, w, reader, async_kind)}", warp, w)
        if not record:
            return None
        written = {"w_slot": warp if slot is None else slot,
                   "w_clock": clock[warp] if epoch is None else epoch, "w_where": where,
                   "w_what": _kind(what), "w_unfenced": unfenced}
        if keep is None or not keep.any():
            for name, value in written.items():
                s[name][idx, r, c] = value
            s["r_clock"][:, idx, r, c] = 0
            return None
        for name, value in written.items():
            s[name][idx, r, c] = np.where(keep, s[name][idx, r, c], value)
        reads, read_at = s["r_clock"][:, idx, r, c], s["r_where"][warp][idx, r, c]
        reads = np.where(keep, reads, 0)
        reads[warp] = np.where(keep, np.maximum(reads[warp], clock[warp]), 0)
        s["r_clock"][:, idx, r, c] = reads
        s["r_where"][warp][idx, r, c] = np.where(keep, where, read_at)
        return None

    # ------------------------------------------------------------ reports

    def _hint(self, problem: str, *warps: int) -> str:
        """A race report, with a note where one of its warps (clock slots) got
        through its last tk.wait at once, taking no new phase (hopper._wait:
        a parity-1 wait on a fresh semaphore, right for a ring's first
        empty-slot waits; a parity that did not flip): a hint, not an error
        at the wait, which may be meant."""
        notes = [self.passed[w] for w in dict.fromkeys(warps) if self.passed.get(w)]
        return f"{problem} (note: {'; and '.join(notes)})" if notes else problem

    def _who(self, slot: int) -> str:
        """What clock slot `slot` stands for, in a message."""
        if slot < self.num_warps:
            return f"warp {slot}"
        if slot >= self.num_slots - self.num_wgs:
            return f"the wgmma of warpgroup {slot - self.num_slots + self.num_wgs}"
        return "an asynchronous access (a TMA load or an MMA)"

    def _fix(self, warp: int, slot: int, earlier: str, writer: str | None) -> str:
        """What orders the access at `earlier` (by clock slot `slot`) before
        warp `warp`'s, from what orders the two so far (`via`): a semaphore
        that orders an earlier access but not this one asks for the arrival
        after the access; nothing (or a barrier before it), a barrier.
        writer: the asynchronous writer this access is ('TMA load',
        'tcgen05.mma'), or None for a warp's."""
        who = self._who(slot)
        if self.via[warp, slot] == BY_SEMAPHORE:
            return (f"warp {warp} is ordered after {who} through a semaphore, but not after "
                    f"its access at {earlier}: arrive only after that access (release a tile "
                    f"once its readers are done, a wgmma's operands after its tk.mma_wait), "
                    f"and have warp {warp} wait for that arrival's phase first (is the arrive "
                    f"before the access, or the wait for an earlier phase?)")
        if writer == "TMA load":
            return (f"a TMA load may overwrite a tile only once its readers are done with it: "
                    f"they arrive on a semaphore after their reads, and the load's issuer "
                    f"waits for that phase first (a ring's empty slot: tk.wait before "
                    f"tk.tma.load_async); where one thread arrives for several warps (an "
                    f"elected thread, as ring.release does), those warps meet at a "
                    f"tk.named_barrier first, or {who}'s read is not ordered before the "
                    f"arrival")
        if writer is not None:
            return (f"a {writer} may overwrite a tile only once its readers are done with it: "
                    f"they arrive on a semaphore after their reads, and the {writer}'s "
                    f"issuer waits for that phase first")
        if slot >= self.num_slots - self.num_wgs:
            return (f"{who} reads until that warpgroup's tk.mma_wait: order this access after "
                    f"the wait (an arrival after it that this warp waits for, or a barrier)")
        if slot >= self.num_warps:
            return ("wait for the semaphore phase that asynchronous access completes "
                    "(tk.wait) before this access")
        return ("put a barrier between the two: tk.barrier() (every warp of the block) or "
                "tk.named_barrier(id, warps=n) with n counting the warps of both sides "
                "(tk.named_barrier_arrive on the side that goes first); a named barrier "
                "whose warps= counts one side only completes once per side and orders "
                "nothing between them")


def _kind(what: str) -> str:
    """The operation an access's description names: 'this TMA load' and
    'this tcgen05.mma (pair=True: ...)' give 'TMA load' and 'tcgen05.mma'."""
    return what.removeprefix("this ").split(" (")[0]
