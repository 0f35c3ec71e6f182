"""The interpreter's machine: warps as coroutines, blocks one after another.

Each warp runs the kernel as a Python generator over 32-lane values: a
per-thread scalar is a numpy array of shape (32,), or of shape () when it is
the same in every lane (block ids, constants, loop counters: the fast path).
A warp inside an `if` whose condition differs between its lanes runs both
branches, each under an active-lane mask (`Warp.mask`).

Tile ops work at tile granularity: a tile of scope block, warpgroup or warp
is one numpy array per scope instance. A warp reaching a tile op yields a
`Arrival`; the scheduler resumes the warps of that scope instance with the
op's result once all of them have arrived at the same op. A tile op reached
under lane divergence, or by part of its scope while the rest is elsewhere
or has returned, is an error at the op's line.

Blocks run one after another, unless one waits for a flag in global memory
(tk.wait_signal) that no block has raised yet: then it steps aside and the
next block starts (`run_blocks`), as on a GPU whose blocks run at once, and
it resumes once the flag is written (it sleeps on what it waits for,
`Waiters`, rather than being polled). Every block waiting, none able to
start, is a deadlock reported at the first one's wait.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..dialects import types as T
from ..errors import CompilationError, error_at

LANES = 32


class InterpretError(CompilationError):
    """What the interpreter reports about a kernel, at the user's line."""


class Loc(NamedTuple):
    """An op's place in the user's source as plain data: a compiled Program
    holds these, never an MLIR Location (which would keep its Context, and
    every op of the module, alive for as long as the Program)."""
    filename: str | None
    line: int | None
    col: int | None

    @classmethod
    def of(cls, location) -> Loc:
        """The Loc of an MLIR Location (a tk_mlir helper's ops carry the
        user's call: frontend.py); all None when it names no line."""
        e = error_at(location, "")
        return cls(e.filename, e.line, e.col)

    @property
    def where(self) -> str:
        """"file:line", for messages that name two places."""
        return f"{self.filename}:{self.line}" if self.line else "an unknown line"


def error(loc: Loc, message: str) -> InterpretError:
    """An InterpretError at `loc`."""
    return InterpretError(message, *loc)


def warp_scalar(w, value, loc, what: str):
    """A per-thread scalar of warp w as one Python number over its active
    lanes (else an error at loc)."""
    if w.mask is not None and np.ndim(value):
        value = np.asarray(value)[w.mask]
    return uniform(value, loc, what)


class Block:
    """One block of the grid and everything its warps share: shared memory,
    semaphores, named barriers, the asynchronous agents in flight (TMA
    copies land after a seeded random delay, counted in scheduler steps),
    wgmma groups per warpgroup, and the vector clocks of races.py."""

    def __init__(self, id, grid, num_warps: int, num_sems: int = 0, seed: int = 0,
                 rank: int | None = None):
        from .blackwell import TensorMemory
        from .ordering import BlockOrder
        from .races import UNORDERED, Shadow
        from .shared import SharedMemory
        self.id, self.grid, self.num_warps = id, grid, num_warps
        # What messages and the writers of global memory call it: its id, and
        # its rank's when several ranks' launches run at once (interpret_ranks).
        self.name = id if rank is None else f"{id} of rank {rank}"
        self.order = BlockOrder(self.name, num_warps)   # global memory's happens-before
        self.num_wgs = -(-num_warps // 4)
        self.num_slots = num_warps + num_sems + self.num_wgs
        self.rng = np.random.default_rng([seed, *id] if rank is None else [seed, rank, *id])
        self.step = 0
        self.smem = SharedMemory()
        self.sems: dict = {}                  # (allocation key, index) -> Semaphore
        self.named: dict = {}                 # id -> NamedBarrier
        self.cluster_epoch = [0] * num_warps  # per warp: the tk.cluster_syncs it passed
        self.agents: list = []                # heap of (due step, seq, callback)
        self.seq = 0
        self.clocks = np.zeros((num_warps, self.num_slots), np.int64)
        self.clocks[np.arange(num_warps), np.arange(num_warps)] = 1
        # What last ordered each warp after each slot's events (races.py: what
        # a race report says to do).
        self.via = np.full((num_warps, self.num_slots), UNORDERED, np.int8)
        self.shadow = Shadow(num_warps, self.num_slots, self.num_wgs, self.via)
        self.mma: dict[int, list] = {}        # warpgroup -> its groups, oldest first
        self.mma_issued: dict[int, int] = {}  # warpgroup -> groups issued so far
        self.mma_locs: dict = {}              # (warpgroup, group) -> the MMA's location
        self.last_load: dict = {}             # semaphore key -> (phase, location) of the
        #                                       last TMA load counted on it
        # Blackwell (blackwell.py): tensor memory; per issuing (warp, lane) its
        # uncommitted tcgen05.mma ops, its MMAs' accesses in flight, the clock
        # of its own MMAs that have completed (ordered before its next) ...
        self.tmem = TensorMemory()
        self.cluster, self.cluster_rank = None, 0   # (set by Cluster)
        self.ended = False                    # every warp has returned
        self._registers: list | None = None  # per warpgroup, once a setmaxnreg runs
        self.exits = [0] * self.num_wgs       # per warpgroup: its warps that returned
        self.tc_pending: dict = {}
        self.tc_flights: dict = {}
        self.tc_known: dict = {}
        self.tc_due: dict = {}                # ... and when its last commit completes

    @property
    def registers_per_thread(self) -> int:
        """Registers per thread the block starts with: the register file split
        evenly, as ptxas sizes a kernel that reallocates (target.py)."""
        from .. import target
        return target.current().launch_registers(32 * self.num_warps)

    def registers_held(self) -> list:
        """Registers per thread each warpgroup holds (setmaxnreg moves them; a
        warpgroup whose warps all returned holds none)."""
        if self._registers is None:
            self._registers = [self.registers_per_thread] * self.num_wgs
        return self._registers

    def later(self, callback, low: int = 1, high: int = 24, not_before: int = 0) -> int:
        """Run callback() after a random number of scheduler steps, not before
        step `not_before` (and after callbacks due then that were scheduled
        first); the step it is due at."""
        self.seq += 1
        due = max(self.step + int(self.rng.integers(low, high)), not_before)
        heapq.heappush(self.agents, (due, self.seq, callback))
        return due

    def fire_due(self) -> bool:
        """Run the callbacks due by now; whether any was."""
        fired = False
        while self.agents and self.agents[0][0] <= self.step:
            heapq.heappop(self.agents)[2]()
            fired = True
        return fired

    def semaphore(self, ref, loc):
        """The state of semaphore ref (created at its first use, as initialised)."""
        from .semaphores import Semaphore
        key = (ref.alloc.key, ref.index)
        s = self.sems.get(key)
        if s is None:
            if ref.index is None:
                raise error(loc, f"{ref.describe()} is an array of semaphores: pick one "
                                 f"(sems[i])")
            s = self.sems[key] = Semaphore(ref, ref.alloc.arrivals, self.num_slots)
            s.slot = ref.alloc.agent + ref.index
        return s

    def reach(self, peer, loc, what: str) -> None:
        """Raise unless `peer` (a block of this one's cluster) is still
        running: `what` would act on shared memory it has given up."""
        if peer.ended:
            raise error(loc, f"{what} acts on block {peer.name} of the cluster, which has "
                             f"already ended (its shared memory is gone): end the kernel with "
                             f"tk.cluster_sync() so that no block leaves while another may "
                             f"still reach it")

    def arrival_clock(self, source, clock: np.ndarray) -> np.ndarray:
        """The clock an event of block `source` at `clock` (an arrival, a
        copy's landing) carries here: itself from this block; nothing from
        another block of the cluster, whose clocks are its own."""
        return clock if source is self else np.zeros(self.num_slots, np.int64)

    def foreign_clock(self) -> np.ndarray:
        """The clock of an access from another block of the cluster: past
        every event here (ordering across blocks is not tracked; what is in
        flight is)."""
        return np.full(self.num_slots, np.iinfo(np.int64).max)

    def mma_slot(self, warpgroup: int) -> int:
        """The clock slot of a warpgroup's wgmma agent."""
        return self.num_slots - self.num_wgs + warpgroup

    def acquire(self, warp: int, clock: np.ndarray, via: int) -> None:
        """Order `warp` after what `clock` covers, learnt through `via`
        (races.BY_BARRIER or BY_SEMAPHORE)."""
        mine = self.clocks[warp]
        self.via[warp, clock > mine] = via
        np.maximum(mine, clock, out=mine)
        self.order.join(warp, clock)          # and after what those warps' waits learnt

    def acquire_global(self, warp: int, clock: dict) -> None:
        """`warp` waited on a flag and is ordered after `clock` (what the
        signals published, ordering.acquire): a tick of its own clock, so
        the warps it meets after this learn it and those before do not. A
        signal of its own block's warps orders it after them as a barrier
        would (their vector-clock entries)."""
        self.clocks[warp, warp] += 1
        for (name, other), time in (clock or {}).items():
            if name == self.name and other != warp:
                self.clocks[warp, other] = max(self.clocks[warp, other], time)
        self.order.acquire(warp, clock, int(self.clocks[warp, warp]))

    def release_global(self, warp: int) -> dict:
        """What a signal by `warp` publishes (ordering.BlockOrder.release),
        then a tick of its clock: its later accesses are not covered."""
        published = self.order.release(warp, self.clocks[warp])
        self.clocks[warp, warp] += 1
        return published

    def global_order(self, warps) -> "OrderView":
        """The global-memory order of an access by these warps (indices)."""
        return self.order.view(warps, self.clocks)


class Cluster:
    """The blocks of one cluster (tk.use_cluster), by rank: each block's
    `cluster` and `cluster_rank`. Each block keeps its own clocks: ordering
    across blocks (remote arrivals, multicast, a pair's MMA) is modelled for
    what it makes happen, not checked for races; thread loads and stores of
    the blocks' tiles from other blocks (tile.in_block) are, by cluster sync
    (cluster_access.py)."""

    def __init__(self, blocks: list):
        from .cluster_access import ClusterAccesses
        self.blocks = blocks
        self.accesses = ClusterAccesses()
        self.arrived: dict[int, int] = {}     # cluster_sync generation -> warps arrived
        self.warps = sum(b.num_warps for b in blocks)
        # Blocks of it stalled on what the others do (remote arrivals and
        # multicast landings, cluster syncs): woken whenever one goes on.
        self.waiters = Waiters()
        for rank, b in enumerate(blocks):
            b.cluster, b.cluster_rank = self, rank

    def sync_arrive(self, generation: int) -> None:
        self.arrived[generation] = self.arrived.get(generation, 0) + 1

    def synced(self, generation: int) -> bool:
        return self.arrived.get(generation, 0) == self.warps

    def describe(self, generation: int) -> str:
        names = ", ".join(str(b.name) for b in self.blocks)
        return (f"{self.arrived.get(generation, 0)} of the {self.warps} warps of the cluster "
                f"(blocks {names}) arrived")


class Warp:
    """One warp's registers: a value per SSA slot of the program."""

    def __init__(self, index: int, block: Block, num_slots: int):
        self.index, self.block = index, block
        self.values: list = [None] * num_slots
        self.mask: np.ndarray | None = None      # active lanes; None: all 32
        self.mma_done = 0                        # its warpgroup's groups it has waited for
        self.bulk: dict[int, list] = {}          # lane -> [open group, committed groups...]
        self.bulk_writes: dict[int, list] = {}   # lane -> TMA stores read, writes in flight
        self.seen: dict = {}                     # semaphore key -> last phase it waited on

    def lane_ids(self) -> np.ndarray:
        return np.arange(LANES, dtype=np.int32)

    def active_lanes(self) -> np.ndarray:
        return np.arange(LANES) if self.mask is None else np.flatnonzero(self.mask)

    @property
    def clock(self) -> np.ndarray:
        return self.block.clocks[self.index]


@dataclass
class Arrival:
    """A warp at a tile op: the op's step and the warp's operand values."""
    step: object
    operands: list
    warp: Warp = None


@dataclass
class Blocked:
    """A warp waiting (a semaphore phase, a named barrier): ready() says when
    it may go on; describe() what it waits for, for a deadlock report.
    `external`: for what other blocks (or ranks) do, so the block may step
    aside for them; `watch` then says what: (Waiters, part) pairs, whose
    wake(part) is the only thing that can make ready() true; `flag`: for a
    flag in global memory (tk.wait_signal), which a producer may set only
    after loads of its own, so a semaphore short of bytes is then not the
    likely cause of a deadlock; `semaphore`: for a semaphore's phase (a
    deadlock report then says how parities count, unless `barrier`: a warp
    waits at a named barrier, then it says how barriers count)."""
    ready: object
    describe: object
    loc: object
    external: bool = False
    flag: bool = False
    watch: tuple = ()
    semaphore: bool = False
    barrier: bool = False


class Waiters(dict):
    """Block runners stalled on parts of one object (a GlobalArray's flag
    elements, a Cluster): part -> the callbacks that make them runnable
    again (run_blocks). Whatever changes a part wakes them, so a stalled
    block is not polled while nothing it waits for changes (polling every
    stalled block whenever any other moved made a chain of n blocks, each
    waiting for the next, cost n^2 polls)."""

    def wake(self, part=None) -> None:
        """`part` changed (None: any part, or the whole): wake its waiters."""
        for p in list(self) if part is None else (part,):
            for wake in self.pop(p, ()):
                wake()


class Stall(NamedTuple):
    """What a block runner yields when its warps all wait for other blocks:
    whether any ran since its last yield, and what they wait on (each
    external Blocked's watch)."""
    progressed: bool
    watch: list


class _AllWaiting(Exception):
    """Thrown into a stalled block runner: no block of the launch can go on
    (`note`: why, for its deadlock report)."""

    def __init__(self, note: str = " (and so does every other block still running)"):
        super().__init__(note)
        self.note = note


YIELD = object()      # a warp's yield point: the scheduler may run another warp here


def instance(scope: str, warp: int, num_warps: int) -> range:
    """The warps of the scope instance `warp` belongs to."""
    n = T.scope_warps(scope, num_warps)
    first = warp // n * n
    return range(first, first + n)


def uniform(value, loc, what: str,
            why: str = "the interpreter does not model thread-varying values there yet"):
    """A per-thread scalar that must be one value (under the active lanes) as a
    Python number; else an error at loc (`why`: the rule it breaks)."""
    a = np.asarray(value)
    if a.ndim and not (a == a.flat[0]).all() and not (np.isnan(a).all()
                                                       if a.dtype.kind == "f" else False):
        raise error(loc, f"{what} differs between threads; {why}")
    return a.flat[0].item() if a.ndim else a.item()


def run_blocks(runners, resident: tuple[int, str] | None = None) -> None:
    """Run block runners (generators from `block_runner`, made lazily by the
    iterable `runners`) to their end: one at a time, the next one starting
    when every started one waits for another block (Stall); a deadlock when
    all wait and none is left to start, or when as many wait as can run at
    once on the GPU (`resident`: (that many, why)) and more are to start: on
    the GPU the waiting blocks hold every place a later one needs.

    A stalled runner sleeps until something it waits on changes (its Stall's
    watch: Waiters woken by global writes and cluster peers), so each block
    is resumed about as often as it can go on, not once per other block's
    move. Before a deadlock is reported every sleeper is resumed once (a
    sweep), so that a change no wake-up covered is still seen (a flag written
    through another view of its memory: Waiters are per GlobalArray)."""
    pending, started = iter(runners), {}
    ready: deque = deque()         # runners that may go on, in turn
    asleep: dict = {}              # stalled runner -> its nap (a wake-up's ticket)
    naps = 0
    progress = True                # any runner went on since the last sweep

    def waker(runner, nap: int):
        def wake():
            if asleep.get(runner) == nap:        # (not woken by another part since)
                del asleep[runner]
                ready.append(runner)
        return wake

    while True:
        if not ready:
            full = resident is not None and len(asleep) >= resident[0]
            runner = None if full else next(pending, None)
            if runner is not None:
                started[runner] = len(started)
                ready.append(runner)
            elif not asleep:
                return
            elif progress:             # a sweep: resume each sleeper once, oldest first
                progress = False
                ready.extend(sorted(asleep, key=started.get))
                asleep.clear()
            else:
                first = min(asleep, key=started.get)     # the one waiting longest
                first.throw(_AllWaiting(                 # raises its deadlock report
                    f" (and so do the other {len(asleep) - 1} blocks running: as many as a "
                    f"GPU runs at once ({resident[1]}), so the blocks still to start, which "
                    f"they may wait for, never do)" if full else
                    " (and so does every other block still running)"))
            continue
        runner = ready.popleft()
        try:
            got = next(runner)
        except StopIteration:
            progress = True
            continue
        if not isinstance(got, Stall):      # copies still landing in it: progress to come
            progress = True
            ready.append(runner)
            continue
        progress = progress or got.progressed
        naps += 1
        asleep[runner] = naps
        wake = waker(runner, naps)
        for waiters, part in got.watch:
            wakes = waiters.setdefault(part, [])
            if not wakes or wakes[-1] is not wake:      # (a warp's lanes on one flag: once)
                wakes.append(wake)


def block_runner(body, block: Block, num_slots: int, init):
    """Run one block: a coroutine per warp (`body(warp)`), interleaved in a
    seeded random order at their yield points (tile ops, semaphore and barrier
    waits, asynchronous issues), tile ops resumed by the rendezvous of their
    scope's warps; `init(warp)` binds the kernel's arguments. A generator: it
    yields a Stall when all its warps wait and some wait for other blocks
    (Blocked.external), True when it steps aside with copies in flight."""
    warps = [Warp(i, block, num_slots) for i in range(block.num_warps)]
    for w in warps:
        init(w)
    coroutines = [body(w) for w in warps]
    results: list = [None] * len(warps)
    waiting: dict[int, Arrival] = {}
    blocked: dict[int, Blocked] = {}
    returned: set[int] = set()
    runnable = list(range(len(warps)))
    rng = block.rng
    progressed = True
    while True:
        block.step += 1
        if block.fire_due():
            progressed = True
        for i in [i for i, b in blocked.items() if b.ready()]:
            del blocked[i]
            runnable.append(i)
        _rendezvous(waiting, block, results, runnable)
        if runnable:
            progressed = True
            i = runnable.pop(int(rng.integers(len(runnable))) if len(runnable) > 1 else 0)
            try:
                got = coroutines[i].send(results[i])
            except StopIteration:
                returned.add(i)
                _on_exit(warps[i])
                if len(returned) == len(warps):
                    _on_block_end(block, warps)
                continue
            results[i] = None
            if isinstance(got, Arrival):
                got.warp = warps[i]
                waiting[i] = got
            elif isinstance(got, Blocked):
                blocked[i] = got
            else:
                runnable.append(i)
        elif block.agents and not (any(b.external for b in blocked.values()) and
                                   rng.integers(2)):
            block.step = block.agents[0][0] - 1     # nothing runs until the next landing
        elif block.agents:
            # Waiting for another block with copies still landing here: step
            # aside before they land (a coin), so that the other blocks may run
            # while they are in flight; the landings are progress to come.
            _wake_peers(block, progressed)
            yield True
        elif not waiting and not blocked:
            _wake_peers(block, True)
            return
        elif any(b.external for b in blocked.values()):
            _wake_peers(block, progressed)
            try:
                yield Stall(progressed, [w for b in blocked.values() if b.external
                                         for w in b.watch])
            except _AllWaiting as stop:
                raise _deadlock(blocked, waiting, returned, block, stop.note) from None
            progressed = False
        elif blocked:
            raise _deadlock(blocked, waiting, returned, block)
        else:
            raise _stuck(waiting, returned, block)


def _wake_peers(block: Block, progressed: bool) -> None:
    """The block steps aside: if it did anything, the other blocks of its
    cluster may now go on (an arrival on their semaphores, a multicast into
    them, a cluster_sync arrival)."""
    if progressed and block.cluster is not None:
        block.cluster.waiters.wake()


def _rendezvous(waiting: dict, block: Block, results: list, runnable: list) -> None:
    """Run every tile op whose scope instance has all its warps here."""
    for i in sorted(waiting):
        if i not in waiting:
            continue
        arrival = waiting[i]
        members = instance(arrival.step.scope, i, block.num_warps)
        if all(m in waiting and waiting[m].step is arrival.step for m in members):
            out = arrival.step.execute(block, [waiting.pop(m) for m in members])
            for m in members:
                results[m] = out
            runnable.extend(members)


def _on_exit(w: Warp) -> None:
    """A warp returns: its threads' TMA stores and its warpgroup's MMAs must
    have been waited for (the block's shared memory goes away with it)."""
    from .blackwell import check_committed
    check_committed(w)
    wg = w.index // 4
    w.block.exits[wg] += 1
    if w.block.exits[wg] == min(4, w.block.num_warps - 4 * wg):
        w.block.registers_held()[wg] = 0
    if w.block.mma_issued.get(wg, 0) > w.mma_done:
        raise error(w.block.mma_locs[wg, w.mma_done + 1],
                    f"warp {w.index} of block {w.block.name} exits with the MMA issued here not "
                    f"waited for: it may still read shared memory the block is giving up; "
                    f"call tk.mma_wait(0) before the kernel ends")
    for lane, groups in w.bulk.items():
        for group in groups:
            for store in group:
                raise error(store.loc, f"warp {w.index} (lane {lane}) of block {w.block.name} "
                                       f"exits with the TMA store issued here outstanding: "
                                       f"its source is shared memory the block is giving "
                                       f"up; call tk.tma.store_wait(0) (after "
                                       f"tk.tma.store_commit) before the kernel ends")


def _on_block_end(block: Block, warps: list) -> None:
    """Every warp has returned: a TMA load whose semaphore phase no warp waited
    for may still be in flight on a GPU (whatever the interpreter's delays),
    and would land in shared memory the block has given up. Tensor memory
    must be given back."""
    block.ended = True
    block.tmem.check_released(block.name)
    for key, (phase, loc) in block.last_load.items():
        if max(w.seen.get(key, -1) for w in warps) < phase:
            raise error(loc, f"block {block.name} ends without waiting for the TMA load issued "
                             f"here (no warp waited for its semaphore's phase {phase}): on a "
                             f"GPU it may land in shared memory the block has given up; wait "
                             f"for it (or do not issue it) before the kernel ends"
                             f"{_unarmed_hint(block.sems.get(key), phase)}")


def _unarmed_hint(sem, phase: int) -> str:
    """Why a load may count towards a phase no one waits for: no expect armed
    that phase, the likelier cause when an expect before it was short (its
    phase completed with the loads issued so far, before this one)."""
    if sem is None or phase == 0 or sem.completed != phase or sem.armed or \
            sem.pending != sem.arrivals:
        return ""
    return (f"; no tk.tma.expect armed that phase: if this load belongs with the ones before "
            f"it, their expect armed fewer bytes than they add up to, and their phase "
            f"completed before this load was issued")


def _deadlock(blocked: dict, waiting: dict, returned: set, block: Block,
              others: str = "") -> InterpretError:
    """Every warp that has not returned waits and nothing is in flight."""
    # Bytes that can never come are the likelier cause, unless a warp waits
    # for a flag (a producer may have armed a phase, then waited to load).
    flag_wait = any(b.flag for b in blocked.values())
    for s in () if flag_wait else block.sems.values():
        if s.loads_in_flight == 0 and ((s.pending == 0 and s.tx > 0) or
                                       (s.tx < 0 and not s.expects)):
            first = blocked[min(blocked)]
            return s.mismatch(first.loc)
    states: dict[tuple, list[int]] = {}     # (verb, where and what) -> the warps there
    for i in sorted(blocked):
        states.setdefault(("wait", blocked[i].describe()), []).append(i)
    for i in sorted(waiting):
        states.setdefault(("be", f"at {waiting[i].step.describe()}"), []).append(i)
    verbs = {("wait", 1): "waits", ("wait", 2): "wait", ("be", 1): "is", ("be", 2): "are"}
    lines = [f"{_warps(ws)} {verbs[verb, min(len(ws), 2)]} {what}"
             for (verb, what), ws in states.items()]
    if returned:
        lines.append(f"{_warps(sorted(returned))} returned")
    first = blocked[min(blocked)]
    return error(first.loc, f"deadlock in block {block.name}: every warp is blocked and no "
                            f"TMA load is in flight{others}; " + "; ".join(lines) +
                 _deadlock_hint(blocked.values(), flag_wait))


def _deadlock_hint(blocked, flag_wait: bool) -> str:
    """How the waits in a deadlock count: named barriers first (a warp held at
    one also holds up every semaphore it would have arrived on after it),
    else semaphore parities."""
    if any(b.barrier for b in blocked):
        return (" (a named barrier lets its warps go once every warp it counts has reached a "
                "tk.named_barrier or tk.named_barrier_arrive on its id: look for a warp that "
                "skips its arrival, or arrives on another id or with another count)")
    if flag_wait or not any(b.semaphore for b in blocked):
        return ""
    return (" (a semaphore wait whose parity is one phase off returns at once where it should "
            "block, or blocks for good: phase k, counting from 0, completes with parity k & 1, "
            "and a fresh semaphore counts as having completed parity 1)")


def _warps(indices: list[int]) -> str:
    """"warp 3", "warps 0-7", "warps 0, 2, 5": a list of warp indices in
    runs."""
    if len(indices) == 1:
        return f"warp {indices[0]}"
    runs = [[indices[0], indices[0]]]
    for i in indices[1:]:
        if i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "warps " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _stuck(waiting: dict[int, Arrival], returned: set[int], block: Block) -> InterpretError:
    """Why no tile op can complete: the first waiting warp's scope is split."""
    i = min(waiting)
    step = waiting[i].step
    members = instance(step.scope, i, block.num_warps)
    here = [m for m in members if m in waiting and waiting[m].step is step]
    elsewhere = []
    for m in members:
        if m in returned:
            elsewhere.append(f"warp {m} has returned")
        elif m in waiting and waiting[m].step is not step:
            elsewhere.append(f"warp {m} waits at {waiting[m].step.describe()}")
    return error(step.loc, f"{step.name}: warp{'s' * (len(here) > 1)} "
                           f"{', '.join(map(str, here))} of block {block.name} reached this "
                           f"{step.scope}-scope op, but {'; '.join(elsewhere)}: every warp of "
                           f"its {step.scope} must reach it together (is it under an if or "
                           f"loop that depends on the warp?)")
