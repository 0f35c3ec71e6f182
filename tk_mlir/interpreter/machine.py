"""The interpreter's machine: warps as coroutines, blocks run one after another.

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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dialects import types as T
from ..errors import CompilationError, error_at

LANES = 32


class InterpretError(CompilationError):
    """What the interpreter reports about a kernel, at the user's line."""


def error(loc, message: str) -> InterpretError:
    e = error_at(loc, message)
    return InterpretError(e.message, e.filename, e.line, e.col)


@dataclass
class Block:
    """One block of the grid, as the ops of its tiles see it."""
    id: tuple[int, int, int]
    grid: tuple[int, int, int]
    num_warps: int


class Warp:
    """One warp's registers: a value per SSA slot of the program."""

    def __init__(self, index: int, block: Block, num_slots: int):
        self.index, self.block = index, block
        self.values: list = [None] * num_slots
        self.mask: np.ndarray | None = None      # active lanes; None: all 32

    def lane_ids(self) -> np.ndarray:
        return np.arange(LANES, dtype=np.int32)


@dataclass
class Arrival:
    """A warp at a tile op: the op's step and the warp's operand values."""
    step: object
    operands: list


def instance(scope: str, warp: int, num_warps: int) -> range:
    """The warps of the scope instance `warp` belongs to."""
    n = T.scope_warps(scope, num_warps)
    first = warp // n * n
    return range(first, first + n)


def uniform(value, loc, what: str):
    """A per-thread scalar that must be one value (under the active lanes) as a
    Python number; else an error at loc."""
    a = np.asarray(value)
    if a.ndim and not (a == a.flat[0]).all() and not (np.isnan(a).all()
                                                       if a.dtype.kind == "f" else False):
        raise error(loc, f"{what} differs between threads; the interpreter does not model "
                         f"thread-varying values there yet")
    return a.flat[0].item() if a.ndim else a.item()


def run_block(body, block: Block, num_slots: int, init) -> None:
    """Run one block: a coroutine per warp (`body(warp)`), resumed by the
    rendezvous of their tile ops; `init(warp)` binds the kernel's arguments."""
    warps = [Warp(i, block, num_slots) for i in range(block.num_warps)]
    for w in warps:
        init(w)
    coroutines = [body(w) for w in warps]
    results: list = [None] * len(warps)
    waiting: dict[int, Arrival] = {}
    returned: set[int] = set()
    ready = list(range(len(warps)))
    while True:
        for i in ready:
            try:
                waiting[i] = coroutines[i].send(results[i])
            except StopIteration:
                returned.add(i)
        if not waiting:
            return
        ready = []
        for i in sorted(waiting):
            if i not in waiting:
                continue
            arrival = waiting[i]
            members = instance(arrival.step.scope, i, block.num_warps)
            if all(m in waiting and waiting[m].step is arrival.step for m in members):
                out = arrival.step.execute(block, [waiting.pop(m) for m in members])
                for m in members:
                    results[m] = out
                ready.extend(members)
        if not ready:
            raise _stuck(waiting, returned, block)


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
                           f"{', '.join(map(str, here))} of block {block.id} reached this "
                           f"{step.scope}-scope op, but {'; '.join(elsewhere)}: every warp of "
                           f"its {step.scope} must reach it together (is it under an if or "
                           f"loop that depends on the warp?)")
