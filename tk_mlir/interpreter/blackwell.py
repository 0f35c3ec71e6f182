"""The Blackwell ops in the interpreter: tensor memory and tcgen05.

- Tensor memory is a per-block array of 128 lanes x 512 f32 columns
  (`TensorMemory`). tk.tensor_tile takes the first free, aligned run of its
  power-of-two columns (NaN until written), tk.free_tensor_tile gives them
  back; allocating a live tile again, going over the 512 columns, using or
  freeing a freed tile, and a block that ends holding columns are errors at
  the user's line. A tensor tile's value is a `shared.SharedRef` whose
  allocation's array is its columns of that memory, so the race checks of
  races.py (readers, writers, what is in flight) cover it as they cover
  shared tiles.
- tcgen05.mma is an asynchronous agent: issued by each active lane, it
  counts its shared operands as read and its tile as written from then on,
  and does nothing until the issuing thread's tk.mma_commit hands its MMAs
  to the agent; after a seeded random delay the agent computes them in
  issue order (f32), then arrives once on the commit's semaphore (one
  thread's commits complete in the order it made them). A read of
  the tile, or a write of an operand, before a wait on that phase is
  reported; so is a thread that exits with an MMA it never committed.
- pair=True (a cluster's two blocks): block 0's thread issues one MMA over
  both blocks' operands and tiles (M = 256: each block's 128 rows of a and
  of the tile, N: their halves of b), and a commit arrives in both blocks.
  In the other block only what is in flight is checked (no clocks across
  blocks: Block.foreign_clock).
- tcgen05.ld/st (tk.load / tk.store of a tensor tile) move a warpgroup's
  tmem-layout tile: warp w of the warpgroup reads or writes rows 32w..32w+31.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..dialects import contracts, types as T
from ..target import BLACKWELL
from .machine import YIELD, error, warp_scalar
from .rules import interprets
from .shared import rows_by_warp, whole

LANES, COLUMNS = BLACKWELL.tmem_lanes, BLACKWELL.tmem_columns


@dataclass
class _Tile:
    """A live tensor tile's columns and where it was allocated."""
    start: int
    columns: int
    where: str
    loc: object


class TensorMemory:
    """One block's tensor memory and which columns its live tiles hold."""

    def __init__(self):
        self.cells = np.full((LANES, COLUMNS), np.nan, np.float32)
        self.live: dict[int, _Tile] = {}       # allocation key -> its columns
        self.freed: dict[int, str] = {}        # allocation key -> where it was freed

    def allocate(self, block, alloc, columns: int, loc, at: str) -> None:
        if alloc.key in self.live:
            raise error(loc, f"double allocation: the tensor tile allocated at {at} is "
                             f"allocated again while it still holds its columns (free it with "
                             f"tk.free_tensor_tile first)")
        start = self._first_fit(columns)
        if start is None:
            held = ", ".join(f"{t.columns} at {t.where}" for t in self.live.values())
            raise error(loc, f"tensor memory exhausted: the tile allocated at {at} needs "
                             f"{columns} columns, and the live tiles hold {held} of the "
                             f"block's {COLUMNS}")
        self.live[alloc.key] = _Tile(start, columns, at, loc)
        self.freed.pop(alloc.key, None)
        self.cells[:, start:start + columns] = np.nan
        cols = alloc.type.cols
        block.smem.arrays[alloc.key] = self.cells[None, :, start:start + cols]

    def _first_fit(self, columns: int) -> int | None:
        taken = sorted((t.start, t.start + t.columns) for t in self.live.values())
        for start in range(0, COLUMNS - columns + 1, columns):
            if all(start + columns <= lo or hi <= start for lo, hi in taken):
                return start
        return None

    def holds(self, ref, loc, what: str) -> None:
        """Raise unless ref's tile is allocated (`what` uses it)."""
        key = ref.alloc.key
        if key in self.live:
            return
        if key in self.freed:
            raise error(loc, f"use after free: {what} uses the tensor tile allocated at "
                             f"{ref.alloc.where}, freed at {self.freed[key]}")
        raise error(loc, f"{what} uses the tensor tile allocated at {ref.alloc.where} "
                         f"before it is allocated")

    def free(self, block, ref, loc, at: str) -> None:
        key = ref.alloc.key
        if key not in self.live:
            if key in self.freed:
                raise error(loc, f"double free: the tensor tile allocated at "
                                 f"{ref.alloc.where} was freed at {self.freed[key]} already")
            self.holds(ref, loc, "tk.free_tensor_tile")
        for mmas in block.tc_pending.values():
            for m in mmas:
                if m.acc.alloc.key == key:
                    raise error(loc, f"tk.free_tensor_tile frees the tensor tile allocated at "
                                     f"{ref.alloc.where}, which the tcgen05.mma issued at "
                                     f"{m.where} writes, and that MMA was never committed: "
                                     f"nothing can wait for it (tk.mma_commit(sem) after the "
                                     f"last MMA, and tk.wait on that semaphore)")
        flight = block.shadow.in_flight_on(ref)
        if flight is not None:
            raise error(loc, f"tk.free_tensor_tile frees the tensor tile allocated at "
                             f"{ref.alloc.where} while the {flight.kind} issued at "
                             f"{flight.where} still uses it: wait on its commit's semaphore "
                             f"first")
        del self.live[key]
        del block.smem.arrays[key]
        self.freed[key] = at

    def check_released(self, block_name) -> None:
        """The block ends: it must hold no columns."""
        for t in self.live.values():
            raise error(t.loc, f"block {block_name} ends holding the {t.columns} "
                               f"tensor-memory columns allocated here: free the tile "
                               f"(tk.free_tensor_tile) after its last use")


# ------------------------------------------------------------ allocation

@interprets("tk.alloc_tt")
def _alloc_tt(op, num_warps):
    loc, at, columns = op.loc, op.at, T.parse(op.result_types[0]).allocated_columns
    def allocate(scope, alloc):
        scope.block.tmem.allocate(scope.block, alloc, columns, loc, at)
        return whole(alloc)
    return allocate


@interprets("tk.free_tt")
def _free_tt(op, num_warps):
    loc, at = op.loc, op.at
    def free(scope, tile):
        scope.block.tmem.free(scope.block, tile, loc, at)
    return free


@interprets("tk.tensor_columns")
def _tensor_columns(op, num_warps):
    count, loc = T.parse(op.result_types[0]).cols, op.loc
    def columns(w, src, start):
        first = int(warp_scalar(w, start, loc, "columns: the start"))
        if not 0 <= first <= src.cols - count:
            raise error(loc, f"columns({first}, {count}) of {src.describe()} ({src.cols} "
                             f"columns) reaches outside it")
        return dataclasses.replace(src, col=src.col + first, cols=count)
    return columns


# ------------------------------------------------------------- tcgen05.mma

@dataclass
class _Mma:
    """One issued tcgen05.mma: its operands (refs into each of `blocks`: the
    issuing block, and with pair=True its cluster peer) and, per block, its
    accesses in flight."""
    acc: object
    a: object
    b: object
    trans_a: bool
    trans_b: bool
    accumulate: bool
    blocks: tuple
    flights: list           # per block, its flights
    where: str
    loc: object

    def run(self) -> None:
        """acc = op(a) op(b) (+ acc): a pair's M = 256 is the blocks' a rows
        stacked, its N their halves of b; each block's tile takes its rows."""
        a = np.concatenate([b.smem.read(self.a).T if self.trans_a else b.smem.read(self.a)
                            for b in self.blocks])
        bs = [b.smem.read(self.b) for b in self.blocks]
        b = np.concatenate(bs, axis=1) if self.trans_b else np.concatenate(bs).T
        d = a.astype(np.float32) @ b.astype(np.float32)
        for i, blk in enumerate(self.blocks):
            view = blk.smem.view(self.acc)
            rows = d[i * view.shape[0]:(i + 1) * view.shape[0]]
            view[...] = rows + (view if self.accumulate else 0)


def _check(loc, problem):
    if problem is not None:
        raise error(loc, problem)


@interprets("tk.tensor_mma", sync=True)
def _tensor_mma(op, num_warps):
    trans_a, trans_b, loc, at = bool(op.trans_a), bool(op.trans_b), op.loc, op.at
    pair = bool(op.pair)
    def mma(w, acc, a, b, accumulate):
        flags = warp_scalar(w, accumulate, loc, "accumulate")
        blocks = (w.block,)
        if pair:
            if w.block.cluster_rank != 0:
                raise error(loc, f"a pair=True MMA is issued by block 0 of the pair, not by "
                                 f"block {w.block.cluster_rank} (issue it under "
                                 f"`if tk.cluster_rank() == 0:`)")
            blocks = tuple(w.block.cluster.blocks)
        for blk in blocks:
            blk.tmem.holds(acc, loc, "this tcgen05.mma" if blk is w.block else
                           f"this tcgen05.mma (pair=True: block {blk.name}'s tile)")
        for lane in w.active_lanes():
            thread = (w.index, int(lane))
            for x in (a, b):
                _check(loc, w.block.shadow.read(x, w.index, w.clock, at, "this tcgen05.mma",
                                                record=False))
                for peer in blocks[1:]:     # what is still in flight there (no clocks across)
                    _check(loc, peer.shadow.read(x, 0, peer.foreign_clock(), at,
                                                 f"this tcgen05.mma (pair=True: block "
                                                 f"{peer.name}'s operand)", record=False))
            # The thread's own earlier MMAs into the tile are ordered before
            # this one (the tensor core runs one thread's MMAs in order).
            own = w.block.tc_flights.setdefault(thread, [])
            clock = np.maximum(w.clock, w.block.tc_known.get(thread, 0))
            _check(loc, w.block.shadow.write(acc, w.index, clock, at, "this tcgen05.mma",
                                             ignore=own, record=False))
            flights = []
            for blk in blocks:      # (the peer's accesses are not ordered against it here)
                mine = blk.tc_flights.setdefault(thread, [])
                f = [blk.shadow.start("tcgen05.mma", x, at, writes=False) for x in (a, b)]
                f.append(blk.shadow.start("tcgen05.mma", acc, at, writes=True))
                mine += f
                flights.append(f)
            w.block.tc_pending.setdefault(thread, []).append(
                _Mma(acc, a, b, trans_a, trans_b, bool(flags), blocks, flights, at, loc))
        yield YIELD
    return mma


@interprets("tk.mma_commit", sync=True)
def _mma_commit(op, num_warps):
    loc, at = op.loc, op.at
    pair = bool(op.hint(contracts.CTA_PAIR, False))
    def commit(w, sem):
        block = w.block
        # (the committing block first: its thread's clock goes on its own semaphore)
        blocks = (block, *(b for b in block.cluster.blocks if b is not block)) if pair \
            else (block,)
        for lane in w.active_lanes():
            thread = (w.index, int(lane))
            mmas = block.tc_pending.pop(thread, [])
            clock = w.clock.copy()
            # One thread's tcgen05 ops complete in order: no commit lands
            # before an earlier one of the same thread.
            block.tc_due[thread] = block.later(
                lambda t=thread, m=mmas, c=clock: _complete(blocks, t, m, sem, c, loc, at),
                not_before=block.tc_due.get(thread, 0))
        w.clock[w.index] += 1
        yield YIELD
    return commit


def _complete(blocks, thread, mmas, sem, clock, loc, at) -> None:
    """The agent runs a commit's MMAs in issue order, then arrives on sem (in
    each block of a pair): their reads and writes count as done, in each
    block, at the phase its arrival is part of."""
    issuer = blocks[0]
    for peer in blocks[1:]:
        issuer.reach(peer, loc, "this commit's arrival")
    known = issuer.tc_known.setdefault(thread, np.zeros_like(clock))
    np.maximum(clock, known, out=clock)        # its earlier MMAs are complete too
    clocks = []
    for blk in blocks:
        s = blk.semaphore(sem, loc)
        c = blk.arrival_clock(issuer, clock)
        epoch = s.completed + 1
        c[s.slot] = max(c[s.slot], epoch)
        clocks.append((s, c, epoch))
    known[clocks[0][0].slot] = max(known[clocks[0][0].slot], clocks[0][2])
    for m in mmas:
        m.run()
        for blk, flights, (s, c, epoch) in zip(m.blocks, m.flights, clocks):
            for f in flights:
                blk.shadow.finish(f)
                blk.tc_flights[thread].remove(f)
            for x in (m.a, m.b):
                blk.shadow.read_done(x, s.slot, epoch, m.where)
            seen = c if blk is issuer else blk.foreign_clock()
            _check(loc, blk.shadow.write(m.acc, thread[0] if blk is issuer else 0, seen,
                                         m.where, "tcgen05.mma", slot=s.slot, epoch=epoch,
                                         ignore=blk.tc_flights[thread]))
    for s, c, _ in clocks:
        s.arrive(1, c, loc, at)


def check_committed(w) -> None:
    """Warp w exits: every MMA its threads issued was committed."""
    for (warp, lane), mmas in w.block.tc_pending.items():
        if warp == w.index and mmas:
            raise error(mmas[0].loc, f"warp {warp} (lane {lane}) of block {w.block.name} exits "
                                     f"with the tcgen05.mma issued here never committed: "
                                     f"nothing can wait for it; tk.mma_commit(sem) after the "
                                     f"last MMA, and tk.wait on that semaphore")


# --------------------------------------------------------- tcgen05.ld / st

@interprets("tk.tensor_load")
def _tensor_load(op, num_warps):
    owners = rows_by_warp(T.parse(op.result_types[0]), num_warps)
    loc = op.loc
    def load(scope, src):
        block = scope.block
        block.tmem.holds(src, loc, "this tensor load (tcgen05.ld)")
        for k, w in enumerate(scope.warps):
            _check(loc, block.shadow.read(src, w.index, w.clock, scope.where,
                                          "this tensor load (tcgen05.ld)", rows=owners[k]))
        return block.smem.read(src)
    return load


@interprets("tk.tensor_store")
def _tensor_store(op, num_warps):
    owners = rows_by_warp(T.parse(op.operand_types[1]), num_warps, store=True)
    loc = op.loc
    def store(scope, dst, value):
        block = scope.block
        block.tmem.holds(dst, loc, "this tensor store (tcgen05.st)")
        for k, w in enumerate(scope.warps):
            _check(loc, block.shadow.write(dst, w.index, w.clock, scope.where,
                                           "this tensor store (tcgen05.st)", rows=owners[k]))
        block.smem.write(dst, value)
    return store
