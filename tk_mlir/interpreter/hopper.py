"""The Hopper ops in the interpreter: semaphores, TMA, wgmma, named barriers,
elect and register reallocation — the asynchronous agents and what
synchronises with them.

These run per warp (their operands are scalars and shared refs): an op that
may wait, or that hands work to an agent, is a generator (`sync=True`) that
yields to the scheduler, so the warps of a producer/consumer kernel
interleave. Ops issued by every active lane are issued once per lane, as on
the GPU (an arrive under no elect_leader is 32 arrivals).

- A TMA load reads global memory when issued and lands in shared memory
  after a seeded random number of scheduler steps, then completes its bytes
  on its semaphore; until then the tile is being written (races.py).
- A TMA store (or reduce-add) reads its shared source when issued and
  writes global memory at once; the source counts as read until the issuing
  thread's tk.tma.store_wait covers its group.
- A wgmma computes acc + A·B in f32 when issued; its result is a
  program.Pending until each warp's tk.mma_wait covers its group, and its
  shared operands count as read until the first such wait.
- Clusters (machine.Cluster): a remote arrival or a multicast TMA load acts
  on the other block's semaphore and shared memory; tk.cluster_sync waits
  for every warp of the cluster; a wait in a cluster may step aside for the
  other blocks. Each block keeps its own clocks, so ordering across blocks
  is modelled, not checked for races.
"""
from __future__ import annotations

import numpy as np

from ..dialects import contracts, types as T
from ..dialects.tile_rules import tma_start_problem
from .machine import YIELD, Blocked, error, warp_scalar
from .races import BY_BARRIER, BY_SEMAPHORE
from .rules import interprets
from .semaphores import NamedBarrier


def _check(loc, problem):
    if problem is not None:
        raise error(loc, problem)


def _lanes(w) -> int:
    return len(w.active_lanes())


# ------------------------------------------------------------- semaphores

@interprets("tk.arrive", sync=True)
def _arrive(op, num_warps):
    loc, at = op.loc, op.at
    def arrive(w, sem):
        block = w.block
        block.semaphore(sem, loc).arrive(_lanes(w), w.clock, loc, at, by=w.index,
                                         warp=w.index)
        w.clock[w.index] += 1
        yield YIELD
    return arrive


@interprets("tk.expect_bytes", sync=True)
def _expect_bytes(op, num_warps):
    loc, at, nbytes = op.loc, op.at, op.bytes
    def expect(w, sem):
        w.block.semaphore(sem, loc).arrive(_lanes(w), w.clock, loc, at, tx=nbytes,
                                           warp=w.index)
        w.clock[w.index] += 1
        yield YIELD
    return expect


def _parity_wait(w, sem, parity: int, loc, waiting):
    """A warp's mbarrier parity wait on sem (as the GPU's: until the last
    completed phase has that parity), blocked with `waiting()` as its report;
    returns the semaphore and the phase it took as done. The caller checks
    that phase, then `_acquired`."""
    s = w.block.semaphore(sem, loc)
    yield YIELD
    # In a cluster another block may arrive (or multicast): step aside for it.
    remote = w.block.cluster is not None
    watch = ((w.block.cluster.waiters, None),) if remote else ()
    while not s.done(parity):       # (re-checked when resumed: a phase may pass meanwhile)
        yield Blocked(lambda: s.done(parity), lambda: waiting(s), loc, external=remote,
                      watch=watch, semaphore=True)
    return s, s.completed - 1


def _acquired(w, sem, s, seen: int) -> None:
    """The wait took phase `seen` of sem (s, its state) as done: the warp has
    seen it, and what its arrivals released."""
    w.seen[(sem.alloc.key, sem.index)] = seen
    w.block.acquire(w.index, s.released, BY_SEMAPHORE)
    w.block.shadow.passed[w.index] = None      # (the warp's last semaphore wait: _wait's note)


@interprets("tk.wait", sync=True)
def _wait(op, num_warps):
    loc, at = op.loc, op.at
    def wait(w, sem, phase):
        p = warp_scalar(w, phase, loc, "tk.wait: the phase parity")
        if p not in (0, 1):
            raise error(loc, f"tk.wait: the phase parity is {p}; it must be 0 or 1 (a "
                             f"ring's phase(i) is (i // stages) & 1)")
        s, seen = yield from _parity_wait(
            w, sem, p, loc, lambda s: f"at {at} for {s.describe()} to complete a phase of "
                                      f"parity {p} ({s.state()})")
        last = w.seen.get((sem.alloc.key, sem.index), -1)   # (a fresh semaphore: phase -1 done)
        if seen - last >= 2:
            raise error(loc, f"phase wrap-around: warp {w.index} waits at {at} for parity "
                             f"{p} on {s.describe()} and takes phase {seen} as done, but the "
                             f"last phase it waited for there was {last}: phase(s) "
                             f"{last + 1}..{seen - 1} went by unseen, and a parity cannot "
                             f"tell phases two apart (is the phase off by one, or a stage "
                             f"released twice?)")
        _acquired(w, sem, s, seen)
        # A wait that took no new phase passed at once: a parity-1 wait on a
        # semaphore with no phase completed (a ring's first empty-slot wait,
        # or a bug), or a wait for the phase the warp took last time (a parity
        # that does not flip in a loop). While it is the warp's last semaphore
        # wait, a race report of the warp says so (races.Shadow._hint).
        if seen < 0:
            w.block.shadow.passed[w.index] = (
                f"the tk.wait(s, 1) at {at} on {s.describe()} passed at once, no phase of "
                f"it having completed yet: a fresh semaphore counts as having completed a "
                f"phase of parity 1; to wait for its first phase, wait for parity 0, or use "
                f"tk.wait_phase(s, n), which checks the phase number")
        elif seen == last:
            w.block.shadow.passed[w.index] = (
                f"the tk.wait(s, {p}) at {at} on {s.describe()} passed at once, taking phase "
                f"{seen} as done, which this warp had waited for already: does its parity "
                f"flip each time round (a ring's phase(i) is (i // stages) & 1)? "
                f"tk.wait_phase(s, n) checks the phase number")
    return wait


@interprets("tk.wait_phase", sync=True)
def _wait_phase(op, num_warps):
    """tk.wait_phase: the GPU's parity wait, checked against the phase number:
    the phase it takes as done must be that one (not one before it, which
    the parity passes at once, nor one after, which it waits past)."""
    loc, at = op.loc, op.at
    def wait(w, sem, phase):
        n = warp_scalar(w, phase, loc, "tk.wait_phase: the phase number")
        if n < 0:
            raise error(loc, f"tk.wait_phase: the phase number is {n}; phases count from 0")

        def waiting(s):
            late = (f"; phase {n + 1} has completed too, so on the GPU this parity wait is "
                    f"for phase {n + 2}" if s.completed >= n + 2 else "")
            return f"at {at} for phase {n} of {s.describe()} ({s.state()}{late})"
        s, seen = yield from _parity_wait(w, sem, n & 1, loc, waiting)
        if seen != n:
            last = f"phase {seen} the last completed" if seen >= 0 else "no phase completed yet"
            raise error(loc, f"tk.wait_phase: warp {w.index} waits at {at} for phase {n} of "
                             f"{s.describe()}, but its parity passes with {last}: "
                             + (f"phase {n - 1} had not completed, so the GPU's wait returns "
                                f"at once" if seen < n else
                                f"phases {n + 1}..{seen} completed too, so the GPU's wait took "
                                f"phase {seen}, a later use of the semaphore, as its own"))
        _acquired(w, sem, s, n)
    return wait


# -------------------------------------------------------------------- TMA

def _nbytes(ref) -> int:
    t = ref.alloc.type
    return (ref.cols if isinstance(t, T.SV) else ref.rows * ref.cols) * T.itemsize(t.dtype)


@interprets("tk.tma_load", sync=True)
def _tma_load(op, num_warps):
    loc, at, elements = op.loc, op.at, op.hint(contracts.ELEMENTS, False)
    def load(w, dst, src, sem, *coords):
        coords = [warp_scalar(w, c, loc, "tk.tma.load_async: a coordinate") for c in coords]
        _starts(loc, "tk.tma.load_async", coords, dst.alloc.type.dtype, elements, False)
        for _ in range(_lanes(w)):
            _issue_load(w, w.block, dst, src, sem, coords, elements, loc, at)
        yield YIELD
    return load


@interprets("tk.tma_load_multicast", sync=True)
def _tma_load_multicast(op, num_warps):
    loc, at, elements = op.loc, op.at, op.hint(contracts.ELEMENTS, False)
    def load(w, dst, src, sem, mask, *coords):
        coords = [warp_scalar(w, c, loc, "tk.tma.load_async: a coordinate") for c in coords]
        _starts(loc, "tk.tma.load_async", coords, dst.alloc.type.dtype, elements, False)
        bits = warp_scalar(w, mask, loc, "tk.tma.load_async: the multicast mask")
        blocks = w.block.cluster.blocks
        if not 0 < bits < 1 << len(blocks):
            raise error(loc, f"multicast mask {bits:#x} names no block or blocks past the "
                             f"cluster's {len(blocks)}")
        for _ in range(_lanes(w)):
            for rank, peer in enumerate(blocks):
                if bits >> rank & 1:
                    _issue_load(w, peer, dst, src, sem, coords, elements, loc, at)
        yield YIELD
    return load


def _starts(loc, what: str, coords, dtype: str, elements: bool, writes: bool) -> None:
    """Run-time coordinates the copy engine faults on are an error here
    (dialects/tile_rules.py checks compile-time ones). A load at tile
    coordinates has none: it is not checked, every time it is issued."""
    if elements or writes:
        _check(loc, tma_start_problem(what, coords, dtype, elements, writes))


def _issue_load(w, block, dst, src, sem, coords, elements, loc, at) -> None:
    """One TMA load by warp w into `block`'s dst (w's own block, or a block of
    its cluster), counted on that block's sem; `elements`: the coordinates
    count elements, not tiles. Into another block the issuer's clock means
    nothing there: its ordering is not checked."""
    own = block is w.block
    if not own:
        w.block.reach(block, loc, "this multicast TMA load")
    s = block.semaphore(sem, loc)
    epoch = s.completed + 1      # the phase these bytes count towards
    clock = block.arrival_clock(w.block, w.clock.copy())
    seen = clock if own else block.foreign_clock()
    _check(loc, block.shadow.write(dst, w.index if own else 0, seen, at, "this TMA load",
                                   slot=s.slot, epoch=epoch))
    flight = block.shadow.start("TMA load", dst, at, writes=True)
    order = w.block.global_order([w.index])
    if own:     # the read is done once the phase is: stamped by the semaphore's slot
        order = order.stamped(((s.slot, epoch),))
    data = src.load(coords, dst.shape, dst.alloc.type.dtype, 0.0, by=(order, at, loc),
                    element_coords=elements)
    clock[s.slot] = max(clock[s.slot], epoch)
    s.loads.append(at)
    s.loads_in_flight += 1
    s.issued += _nbytes(dst)
    block.last_load[sem.alloc.key, sem.index] = (s.completed, loc)
    block.later(lambda: _land(block, data, flight, s, clock, loc, at, _nbytes(dst), epoch))


def _land(block, data, flight, sem, clock, loc, at, nbytes, epoch) -> None:
    block.smem.write(flight.ref, data)
    block.shadow.finish(flight)
    sem.complete_tx(nbytes, clock, loc, at, epoch)


class _Store:
    """A TMA store in flight: its shared source (`flight`) until a wait frees
    it, its global write until a store_wait(read=False) completes it."""
    def __init__(self, flight, loc, at, dst, coords, shape, add, elements):
        self.flight, self.loc, self.at = flight, loc, at
        self.dst, self.coords, self.shape, self.add = dst, coords, shape, add
        self.elements = elements

    def complete_write(self, w) -> None:
        self.dst.completed(self.coords, self.shape, self.add,
                           (w.block.global_order([w.index]), self.at),
                           element_coords=self.elements)


def _store_rule(add: bool, what: str):
    def factory(op, num_warps):
        loc, at, elements = op.loc, op.at, op.hint(contracts.ELEMENTS, False)
        def store(w, dst, src, *coords):
            block = w.block
            coords = [warp_scalar(w, c, loc, f"{what}: a coordinate") for c in coords]
            _starts(loc, what, coords, src.alloc.type.dtype, elements, True)
            for lane in w.active_lanes():
                _check(loc, block.shadow.read(src, w.index, w.clock, at, "this TMA store",
                                              record=False))
                flight = block.shadow.start("TMA store", src, at, writes=False)
                tile = block.smem.read(src)
                _check(loc, dst.store(coords, tile, add=add,
                                      by=(block.global_order([w.index]).pending(), at),
                                      element_coords=elements))
                w.bulk.setdefault(int(lane), [[]])[0].append(
                    _Store(flight, loc, at, dst, coords, tile.shape, add, elements))
            yield YIELD
        return store
    return factory


interprets("tk.tma_store", sync=True)(_store_rule(False, "tk.tma.store_async"))
interprets("tk.tma_reduce_add", sync=True)(_store_rule(True, "tk.tma.reduce_add_async"))


@interprets("tk.tma_commit")
def _tma_commit(op, num_warps):
    def commit(w):
        for lane in w.active_lanes():
            groups = w.bulk.setdefault(int(lane), [[]])
            if groups[0]:
                groups.append(groups[0])
                groups[0] = []
    return commit


@interprets("tk.tma_wait")
def _tma_wait(op, num_warps):
    pending, at, writes = op.pending, op.at, not op.read
    def wait(w):
        for lane in w.active_lanes():
            groups = w.bulk.get(int(lane))
            if groups is None:
                continue
            done = groups[1:len(groups) - pending] if pending else groups[1:]
            for group in done:
                for st in group:
                    w.block.shadow.finish(st.flight)
                    w.block.shadow.read_done(st.flight.ref, w.index, w.clock[w.index], at)
            del groups[1:1 + len(done)]
            # The writes: with read=False these groups' and every earlier one's
            # are done; with read=True they stay in flight (w.bulk_writes).
            unfinished = w.bulk_writes.setdefault(int(lane), [])
            unfinished += [st for group in done for st in group]
            if writes:
                for st in unfinished:
                    st.complete_write(w)
                unfinished.clear()
            if groups == [[]]:
                del w.bulk[int(lane)]
    return wait


@interprets("tk.tma_prefetch")
def _tma_prefetch(op, num_warps):
    return lambda w, src, like: None        # a cache hint: nothing to model


# ------------------------------------------------------------------ wgmma

@interprets("tk.mma")
def _mma(op, num_warps):
    from .program import Pending
    trans_a, trans_b, loc, at = bool(op.trans_a), bool(op.trans_b), op.loc, op.at
    def mma(scope, acc, a, b):
        block, warps = scope.block, scope.warps
        wg = warps[0].index // 4
        flights, values = [], []
        for x in (a, b):
            if isinstance(x, np.ndarray):       # register A
                values.append(x)
                continue
            for w in warps:
                _check(loc, block.shadow.read(x, w.index, w.clock, at, "this wgmma",
                                              record=False))
            flights.append(block.shadow.start("wgmma", x, at, writes=False))
            values.append(block.smem.read(x))
        A = values[0].T if trans_a else values[0]
        B = values[1] if trans_b else values[1].T
        base = acc.value if isinstance(acc, Pending) else acc
        result = (base + A.astype(np.float32) @ B.astype(np.float32)).astype(np.float32)
        group = block.mma_issued.get(wg, 0) + 1
        block.mma_issued[wg] = group
        block.mma.setdefault(wg, []).append((group, flights))
        block.mma_locs[wg, group] = loc
        return Pending(result, group, at)
    return mma


@interprets("tk.mma_wait")
def _mma_wait(op, num_warps):
    pending = op.pending
    def wait(w):
        block, wg = w.block, w.index // 4
        done = block.mma_issued.get(wg, 0) - pending
        if done <= w.mma_done:
            return
        w.mma_done = done
        slot = block.mma_slot(wg)
        w.clock[slot] = max(w.clock[slot], done)
        groups = block.mma.get(wg, [])
        while groups and groups[0][0] <= done:       # the first warp to wait ends the reads
            group, flights = groups.pop(0)
            for f in flights:                         # (read where the wgmma was issued)
                block.shadow.finish(f)
                block.shadow.read_done(f.ref, slot, group, f.where)
    return wait


# --------------------------------------------------- warps, lanes, registers

@interprets("tk.elect")
def _elect(op, num_warps):
    warpgroup = op.scope == "warpgroup"
    def elect(w):
        # elect.sync picks one active lane; the interpreter picks a random one
        # (code that assumes lane 0 shows itself). A warpgroup's: its first warp's.
        out = np.zeros(32, bool)
        if warpgroup and w.index % 4:
            return out
        lanes = w.active_lanes()
        out[lanes[int(w.block.rng.integers(len(lanes)))]] = True
        return out
    return elect


@interprets("tk.set_registers", sync=True)
def _set_registers(op, num_warps):
    """setmaxnreg moves registers between the block's warpgroups; values are
    unaffected. An increase waits until the other warpgroups hold little
    enough (their decreases, or their exits, free registers), as on the GPU,
    so a split the block cannot make is a deadlock here, not a hang there."""
    count, increase, loc, at = op.count, op.action == "inc", op.loc, op.at
    def set_registers(w):
        block, wg = w.block, w.index // 4
        held = block.registers_held()
        start = block.registers_per_thread
        def others() -> int:
            return sum(held) - held[wg]
        def free() -> bool:
            return start * len(held) - others() >= count
        while increase and not free():
            yield Blocked(free, lambda: f"at {at}: tk.increase_registers({count}) waits for "
                                        f"registers: the other warpgroups hold {others()} per "
                                        f"thread of the {len(held)} x {start} the block starts "
                                        f"with, and only a decrease or an exit frees any", loc)
        held[wg] = count
    return set_registers


@interprets("tk.named_barrier", sync=True)
def _named_barrier(op, num_warps):
    loc, at, warps, sync = op.loc, op.at, op.warps, op.mode == "sync"
    def barrier(w, index):
        i = warp_scalar(w, index, loc, "tk.named_barrier: the id")
        if not 1 <= i <= 15:
            raise error(loc, f"named barrier id {i} is out of range: ids are 1 to 15 (0 is "
                             f"the block barrier, tk.barrier)")
        if not 1 <= warps <= w.block.num_warps:
            raise error(loc, f"named barrier {i}: warps={warps}, but the block has "
                             f"{w.block.num_warps} warps")
        b = w.block.named.get(i)
        if b is None:
            b = w.block.named[i] = NamedBarrier(i, w.block.num_slots)
        gen = b.arrive(w.index, warps, w.clock, loc, at)
        w.clock[w.index] += 1
        yield YIELD
        if not sync:
            return
        while b.generation <= gen:
            yield Blocked(lambda: b.generation > gen,
                          lambda: f"at {at} on named barrier {i} ({b.state()})", loc,
                          barrier=True)
        w.block.acquire(w.index, b.released[gen], BY_BARRIER)
    return barrier


# --------------------------------------------------------------- clusters

@interprets("tk.use_cluster")
def _use_cluster(op, num_warps):
    return lambda w: None           # (the Program groups the blocks: its `cluster`)


@interprets("tk.cluster_rank")
def _cluster_rank(op, num_warps):
    return lambda w: np.int32(w.block.cluster_rank)


@interprets("tk.arrive_remote", sync=True)
def _arrive_remote(op, num_warps):
    loc, at = op.loc, op.at
    def arrive(w, sem, cta):
        r = warp_scalar(w, cta, loc, "tk.arrive: cta")
        blocks = w.block.cluster.blocks
        if not 0 <= r < len(blocks):
            raise error(loc, f"tk.arrive(..., cta={r}): the cluster has blocks "
                             f"0..{len(blocks) - 1}")
        peer = blocks[r]
        if peer is not w.block:
            w.block.reach(peer, loc, "this remote arrival")
        # the arriver, for the check of a stage released twice in one phase: a
        # warp of this block is itself, one of another block names its block
        by = w.index if peer is w.block else f"{w.index} of block {w.block.name}"
        peer.semaphore(sem, loc).arrive(_lanes(w), peer.arrival_clock(w.block, w.clock), loc,
                                        at, by=by)
        w.clock[w.index] += 1
        yield YIELD
    return arrive


@interprets("tk.cluster_sync", sync=True)
def _cluster_sync(op, num_warps):
    loc, at = op.loc, op.at
    def sync(w):
        block, cluster = w.block, w.block.cluster
        b = block.named.get("cluster")
        if b is None:
            b = block.named["cluster"] = NamedBarrier("cluster", block.num_slots)
        gen = b.arrive(w.index, block.num_warps, w.clock, loc, at)
        cluster.sync_arrive(gen)
        w.clock[w.index] += 1
        yield YIELD
        while not cluster.synced(gen):
            yield Blocked(lambda: cluster.synced(gen),
                          lambda: f"at {at} in tk.cluster_sync ({cluster.describe(gen)})", loc,
                          external=True, watch=((cluster.waiters, None),))
        block.acquire(w.index, b.released[gen], BY_BARRIER)
        block.cluster_epoch[w.index] += 1
    return sync
