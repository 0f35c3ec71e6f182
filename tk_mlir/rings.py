"""Rings of pipeline stages: what a producer warpgroup and its consumers share.

A ring is `stages` slots, each holding `count` shared tiles, a *full*
semaphore (the producer's TMA bytes land on it) and an *empty* one (each
consumer warpgroup arrives once when it is done with the slot). Producer and
consumers each count the ring's uses, i = 0, 1, 2, ...; the ring turns a use
number into its slot and the phase parity to wait for, so a kernel never
writes phase arithmetic:

    kv = tk.ring(K.dtype, (BN, D), stages=2, consumers=2)
    # the producer (one elected thread), i-th use:
    tile, sem = kv.fill(i)            # wait until the slot is free, arm sem with its bytes
    tk.tma.load_async(tile, K, (b, h, j, 0), sem)
    # each consumer warpgroup, the same i-th use:
    tile = kv.wait(i)                 # until the i-th fill has landed
    ...                               # MMAs reading it, then (once they are known done)
    kv.release(i)                     # one arrival per consumer warpgroup

Several rings released at different points (attention's K and V) are
several `tk.ring`s, each with its own count. The methods are tk.funcs,
inlined where they are called.
"""
from __future__ import annotations

import tk_mlir as tk

from .errors import CompilationError
from .language import builtin, compile_time_int, func


class Ring:
    """A ring of pipeline slots (make one with tk.ring inside a kernel): an
    array of stages * count shared tiles, slot s holding tiles s*count ...;
    its full and empty semaphore arrays."""

    def __init__(self, tiles, full, empty, stages: int, count: int):
        self.tiles, self.full, self.empty = tiles, full, empty
        self.stages, self.count = stages, count

    def __repr__(self):
        return f"<tk.Ring of {self.stages} slots x {self.count} tile(s)>"

    @func
    def slot(self, i):
        """The slot of the i-th use."""
        return i % self.stages

    @func
    def phase(self, i):
        """The parity of the full semaphore's phase that completes the i-th use
        (the empty semaphore's phase before it has the other parity)."""
        return (i // self.stages) & 1

    @func
    def fill(self, i):
        """Producer: wait until the i-th use's slot is free (its previous use
        released by every consumer; a fresh ring is free), arm its full
        semaphore with the bytes of its tiles; returns (tile or tiles, semaphore)
        for the TMA loads that fill it."""
        s = self.slot(i)
        tk.wait(self.empty[s], self.phase(i) ^ 1)
        tiles = self.tiles_at(s)
        tk.tma.expect(self.full[s], *tiles)
        return self.one_or_all(tiles), self.full[s]

    @func
    def wait(self, i, part=None):
        """Consumer: wait until the i-th fill has landed; returns its tile (or
        tiles), or with part=c (a run-time int too, e.g. the consumer's index)
        its c-th tile."""
        s = self.slot(i)
        tk.wait(self.full[s], self.phase(i))
        return self.one_or_all(self.tiles_at(s)) if part is None else part_of(self, s, part)

    @func
    def release(self, i):
        """Consumer: hand the i-th use's slot back (one arrival per consumer
        warpgroup: call it from the whole warpgroup, one thread arrives). Its
        readers must be done: after the tk.mma_wait that completes them. A
        slot read by threads (tk.load from its tiles or vectors) needs the
        warpgroup's warps synchronised first (tk.named_barrier(id, warps=4)):
        the one arriving thread speaks for the others' reads only then."""
        if tk.elect_leader("warpgroup"):
            tk.arrive(self.empty[self.slot(i)])

    @func
    def tiles_at(self, s):
        return [self.tiles[s * self.count + c] for c in tk.static_range(self.count)]

    @func
    def one_or_all(self, tiles):
        return tiles[0] if self.count == 1 else tiles


@builtin
def part_of(ring: Ring, s, part):
    """Tile `part` of slot s (part a compile-time or run-time int)."""
    from .values import scalar_binary
    if isinstance(part, int) and not 0 <= part < ring.count:
        raise CompilationError(f"ring.wait: part={part} is not one of the slot's {ring.count} "
                               f"tiles (0 to {ring.count - 1})")
    return ring.tiles[scalar_binary("add", scalar_binary("mul", s, ring.count), part)]


@builtin
def ring(dtype, shape, stages, *, count=1, consumers=1, swizzle=128) -> Ring:
    """A ring of `stages` slots of `count` shared tiles of (dtype, shape) each
    (or shared vectors, for a 1-D shape (length,); swizzle does not apply),
    with its full semaphores (one producer arrival plus the TMA bytes) and empty
    ones (`consumers` arrivals: one per consumer warpgroup)."""
    stages = compile_time_int(stages, "stages", 1, 16)
    count = compile_time_int(count, "count", 1, 8)
    consumers = compile_time_int(consumers, "consumers", 1, 8)
    if swizzle not in (0, 32, 64, 128):
        raise CompilationError(f"swizzle must be 0, 32, 64 or 128 (bytes), got {swizzle!r}")
    # One array, slot s holding tiles s*count .. s*count+count-1.
    if isinstance(shape, (tuple, list)) and len(shape) == 1:
        tiles = tk.shared_vectors(dtype, shape[0], stages * count)
    else:
        tiles = tk.shared_tiles(dtype, shape, stages * count, swizzle=swizzle)
    return Ring(tiles, tk.semaphores(stages), tk.semaphores(stages, arrivals=consumers),
                stages, count)
