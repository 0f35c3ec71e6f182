"""Thread loads and stores of a cluster's shared tiles, checked across its
blocks (distributed shared memory: tile.in_block).

Each block's own warps are race-checked by its vector clocks (races.py);
across blocks the interpreter keeps no clocks (machine.Cluster), and what
orders one block's thread accesses after another's is a tk.cluster_sync():
a barrier of every warp of the cluster. So the accesses to one block's tile
are kept per epoch (the cluster syncs a warp has passed): two from different
blocks in one epoch, at least one a store, touching the same elements, are
not ordered, and are reported (the reader may see either value; on the GPU,
neither is guaranteed). Accesses within one block are left to races.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from .shared import SharedRef


@dataclass(frozen=True)
class Access:
    """One thread load or store of part of a tile, in one epoch."""
    epoch: int
    block: str              # the accessing block's name
    writes: bool
    rows: tuple[int, int]   # [first, end) of the tile's rows
    cols: tuple[int, int]
    where: str


class ClusterAccesses:
    """A cluster's thread accesses of its blocks' tiles in the current epoch,
    per tile (owner block, allocation, array element)."""

    def __init__(self):
        self.by_tile: dict[tuple, list[Access]] = {}

    def check(self, owner, ref: SharedRef, block, epoch: int, writes: bool,
              where: str) -> str | None:
        """Record an access by `block` to `owner`'s tile ref; the race it
        makes with one of another block in the same epoch, as a sentence,
        or None."""
        key = (owner.name, ref.alloc.key, ref.index)
        kept = [a for a in self.by_tile.get(key, ()) if a.epoch == epoch]
        new = Access(epoch, block.name, writes, (ref.row, ref.row + ref.rows),
                     (ref.col, ref.col + ref.cols), where)
        for a in kept:
            if a.block != new.block and (writes or a.writes) and _overlap(a, new):
                this = "store into" if writes else "load of"
                other = "store" if a.writes else "load"
                whose = f"in block {owner.name}" if owner is block else \
                    f"in block {owner.name}, by block {block.name},"
                return (f"data race across the cluster: this {this} {ref.describe()} {whose} "
                        f"and the {other} at {a.where} by block {a.block} come between the "
                        f"same two tk.cluster_sync()s, and only a cluster sync orders one "
                        f"block's accesses after another's: put a tk.cluster_sync() between "
                        f"them")
        if new not in kept:
            kept.append(new)
        self.by_tile[key] = kept
        return None


def _overlap(a: Access, b: Access) -> bool:
    return a.rows[0] < b.rows[1] and b.rows[0] < a.rows[1] and \
        a.cols[0] < b.cols[1] and b.cols[0] < a.cols[1]
