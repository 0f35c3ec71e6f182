"""Semaphores (mbarriers) and named barriers, modeled exactly.

A semaphore counts phases. Each phase waits for `arrivals` arrivals and for
its expected transaction bytes to reach zero: `expect_bytes` adds bytes and
arrives, a TMA load's completion subtracts its bytes (possibly before the
expectation: the count may dip below zero while arrivals are pending, as on
the GPU). When both are zero the phase completes: the count of completed
phases goes up by one and the next phase starts with `arrivals` pending.
`wait(parity)` returns once the last completed phase has that parity (a
fresh semaphore counts as having completed a phase of parity 1).

Each also carries the happens-before clocks (races.py): what its arrivals
and loads published in the current phase, and what the last completed phase
released to waiters.
"""
from __future__ import annotations

import numpy as np

from .machine import error


class Semaphore:
    def __init__(self, ref, arrivals: int, num_slots: int):
        self.ref, self.arrivals = ref, arrivals
        self.slot = -1                      # its TMA agent's clock slot (set by the block)
        self.pending, self.tx, self.completed = arrivals, 0, 0
        self.loads_in_flight = 0
        self.armed = self.issued = 0        # this phase's expected bytes, and its loads'
        self.expects: list[str] = []        # this phase's expect_bytes lines
        self.loads: list[str] = []          # this phase's TMA load lines
        self.arrivers: dict = {}            # this phase's arriving warps -> their line
        self.seen: list = []                # this phase's (warp, line) of every arrival
        self.clock = np.zeros(num_slots, np.int64)      # published this phase
        self.released = np.zeros(num_slots, np.int64)   # by the last completed phase

    def describe(self) -> str:
        return self.ref.describe()

    def state(self) -> str:
        return (f"{self.completed} phase(s) completed, the current one (parity "
                f"{self.completed & 1}) waiting for {self.pending} of {self.arrivals} "
                f"arrival(s) and {self.tx} transaction byte(s)")

    def done(self, parity: int) -> bool:
        """Whether wait(parity) returns now."""
        return (self.completed & 1) != parity

    def arrive(self, n: int, clock: np.ndarray, loc, where: str, tx: int = 0,
               by: int | str | None = None, warp: int | None = None) -> None:
        """n arrivals (one per issuing thread), each expecting tx bytes first;
        `by`: the arriving warp (tk.arrive's), when known (a str naming another
        block's warp, for a remote arrival); `warp`: the
        arriving warp for error hints alone (expects too). One elected thread
        of a warp arriving again in one phase of a semaphore that waits for
        several arrivals, from another line, is an error: a stage released
        twice (the phase would complete before its other arrivers are done).
        (One line arriving in a loop, or a warp's lanes arriving apart, may
        mean to count several.)"""
        if by is not None and self.arrivals > 1 and n == 1:
            if self.arrivers.get(by, where) != where and self.pending:
                raise error(loc, f"warp {by} arrives on {self.describe()} at {where}, again in "
                                 f"one phase (it arrived at {self.arrivers[by]}; "
                                 f"{self.state()}): a stage released twice? Each arriver "
                                 f"arrives once per phase; the phase would complete before "
                                 f"the others are done, and its slot be refilled under them")
            self.arrivers[by] = where
        if n > self.pending:        # (0 pending: the phase waits for its bytes only)
            raise error(loc, f"arrival overflow: {n} thread(s) arrive at {where} on "
                             f"{self.describe()}, whose phase waits for "
                             f"{self.pending} more of its {self.arrivals} arrival(s) "
                             f"({self.state()}); arrive from one elected thread "
                             f"(tk.elect_leader), once per phase per expected arrival"
                             f"{self._per_warp_hint(warp, where)}")
        self.seen.append((warp, where))
        np.maximum(self.clock, clock, out=self.clock)
        if tx:
            self.expects.append(where)
        self.tx += n * tx
        self.armed += n * tx
        self.pending -= n
        self._maybe_complete(loc)

    def _per_warp_hint(self, warp, where: str) -> str:
        """When other warps arrived from the same line this phase: the likely
        cause, a warp-scope election where one thread of the warpgroup (or
        block) was meant."""
        others = sorted({w for w, at in self.seen if at == where and w not in (warp, None)})
        if warp is None or not others:
            return ""
        return (f"; warps {', '.join(map(str, others))} and {warp} each arrived from this "
                f"line: tk.elect_leader() elects one thread per warp, "
                f"tk.elect_leader(\"warpgroup\") one per warpgroup")

    def complete_tx(self, nbytes: int, clock: np.ndarray, loc, where: str, epoch: int) -> None:
        """A TMA load's bytes landed; epoch: the phase they count towards (the
        one running when the load was issued)."""
        self.loads_in_flight -= 1
        if epoch != self.completed + 1:
            raise error(loc, f"transaction-byte mismatch on {self.describe()}: the TMA load at "
                             f"{where} counts towards a phase that completed before its "
                             f"{nbytes} byte(s) landed, so a wait for that phase did not "
                             f"wait for them: its expect armed fewer bytes than its loads "
                             f"add up to; expect exactly the bytes of the tiles loaded "
                             f"(tk.tma.expect(sem, *tiles))")
        np.maximum(self.clock, clock, out=self.clock)
        self.tx -= nbytes
        if self.pending == 0 and self.tx < 0:
            raise self.mismatch(loc)
        self._maybe_complete(loc)

    def mismatch(self, loc):
        if not self.expects:            # loads completed bytes no expect announced
            return error(loc, f"{-self.tx if self.tx < 0 else self.tx} byte(s) of the "
                              f"{len(self.loads)} TMA load(s) at "
                              f"{', '.join(self.loads) or '(none)'} reached {self.describe()}, "
                              f"but no tk.tma.expect armed its phase (expect is also the "
                              f"arrival the phase waits for): call tk.tma.expect(sem, *tiles) "
                              f"before the loads, from the thread that issues them")
        # (totals, not self.tx: a load that lands first may overshoot an expect
        # that is short of the loads still in flight)
        return error(loc, f"transaction-byte mismatch on {self.describe()}: the "
                          f"expect at {', '.join(self.expects) or '(none)'} armed the phase "
                          f"with {self.armed} byte(s), but the {len(self.loads)} TMA load(s) "
                          f"at {', '.join(self.loads) or '(none)'} add up to {self.issued}: "
                          f"expect exactly the bytes of the tiles loaded "
                          f"(tk.tma.expect(sem, *tiles))")

    def _maybe_complete(self, loc) -> None:
        if self.pending == 0 and self.tx == 0:
            if self.loads_in_flight:    # (issued in this phase: the next has not begun)
                raise error(loc, f"transaction-byte mismatch on {self.describe()}: its phase "
                                 f"completed with {self.loads_in_flight} of the TMA loads at "
                                 f"{', '.join(self.loads)} still in flight, so a wait for "
                                 f"it would not wait for them: the expect at "
                                 f"{', '.join(self.expects) or '(none)'} armed "
                                 f"{self.armed} byte(s), fewer than the loads add up to "
                                 f"({self.issued}); expect exactly the bytes of the "
                                 f"tiles loaded (tk.tma.expect(sem, *tiles))")
            self.completed += 1
            self.pending, self.expects, self.loads = self.arrivals, [], []
            self.armed = self.issued = 0
            self.arrivers, self.seen = {}, []
            self.released = self.clock.copy()


class NamedBarrier:
    """bar.sync / bar.arrive id, counted in warps: a generation completes when
    `warps` warps have arrived; its sync waiters then go on."""

    def __init__(self, index: int, num_slots: int):
        self.index = index
        self.generation = 0
        self.warps: int | None = None       # this generation's count, from its first arrival
        self.first = ""                     # where that arrival was
        self.arrived: list[int] = []
        self.clock = np.zeros(num_slots, np.int64)
        self.released: dict[int, np.ndarray] = {}   # generation -> its joined clock

    def arrive(self, warp: int, warps: int, clock: np.ndarray, loc, where: str) -> int:
        """Count warp in; the generation it joined."""
        if self.warps is not None and warps != self.warps:
            raise error(loc, f"named barrier {self.index} reached at {where} with warps="
                             f"{warps}, but this use of it began at {self.first} with "
                             f"warps={self.warps} (warps {self.arrived} arrived there): "
                             f"every arrival of one use must count the same warps")
        if self.warps is None:
            self.warps, self.first = warps, where
        elif warp in self.arrived:
            raise error(loc, f"warp {warp} reaches named barrier {self.index} at {where} a second "
                             f"time in one use of it (begun at {self.first}; {self.state()}): "
                             f"the GPU counts its threads twice, so the barrier completes "
                             f"without the warps it waits for")
        self.arrived.append(warp)
        np.maximum(self.clock, clock, out=self.clock)
        gen = self.generation
        if len(self.arrived) == self.warps:
            self.released[gen] = self.clock.copy()
            self.released.pop(gen - 8, None)
            self.generation += 1
            self.warps, self.arrived = None, []
            self.clock = np.zeros_like(self.clock)
        return gen

    def state(self) -> str:
        if self.warps is None:
            return "no warp has arrived at it"
        return (f"{len(self.arrived)} of {self.warps} warp(s) arrived (warps "
                f"{self.arrived}, first at {self.first})")
