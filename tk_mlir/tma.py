"""TMA builtins (`tk.tma.*`): bulk tensor copies between global and shared
memory done by the copy engine, issued by one thread.

    if tk.elect_leader("warpgroup"):
        tk.tma.expect(full[s], a[s], b[s])             # bytes the stage will receive
        tk.tma.load_async(a[s], A, (m, k), full[s])    # completes on the semaphore
        tk.tma.load_async(b[s], B, (n, k), full[s])

Coordinates count tiles in the last two dims (as tk.load) and elements in the
outer ones; for a shared vector (a box of its length along the last dim) the
last counts vectors. With elements=True every coordinate counts elements: a
tile may start at any row (a sequence's first in a packed batch) and at any
column on a 16-byte boundary. A store's or reduce-add's coordinates, tile or
element, must not be negative (a load's may). The copy engine faults on
either (an unaligned column, a negative store coordinate):
dialects/tile_rules.py tma_start_problem. Reads past the tensor's edges fill
zeros and writes past its far edges are dropped, so tiles need not divide the
tensor; a write that must stop before the edge (at a sequence's end) is not
TMA's to make.
Each (tensor, tile shape, swizzle) used becomes a tensor map, encoded on the
host at launch (cached per pointer, shape and strides) and passed as a
128-byte __grid_constant__ parameter.
"""
from __future__ import annotations

from .errors import CompilationError
from .language import builtin, compile_time_int
from .ops import _indices
from .values import Global, Semaphore, Shared, SharedVector, as_scalar, builds, emit

__all__ = ["load_async", "store_async", "reduce_add_async", "store_commit", "store_wait", "expect",
           "expect_bytes", "prefetch"]


def _unit(elements, what: str) -> dict:
    """The op's `elements` attribute (dialects/contracts.py): set only when
    the coordinates count elements."""
    if not isinstance(elements, bool):
        raise CompilationError(f"{what}: elements must be True or False (a Python bool: "
                               f"whether the coordinates count elements), got {elements!r}")
    return {"elements": True} if elements else {}


def _check(st, gl, what: str) -> None:
    if not isinstance(st, Shared):
        raise CompilationError(f"{what}: expected a shared tile, got {st!r}")
    if not isinstance(gl, Global):
        raise CompilationError(f"{what}: expected a tk.gl tensor argument, got {gl!r}")


@builtin
@builds('tma_load', 'tma_load_multicast')
def load_async(dst, src, idx, sem, *, multicast=None, elements=False) -> None:
    """Copy the tile of `src` at tile coordinates `idx` into shared tile `dst`
    (or the vector into shared vector `dst`: `idx` = (outer elements..., vector
    index along the last dim)); the copy's bytes complete a transaction on
    `sem` (see tk.tma.expect). multicast=mask delivers it to `dst` and `sem`
    of every block of the cluster whose bit is set (tk.use_cluster).
    elements=True: `idx` is the element where the tile starts (its column on a
    16-byte boundary)."""
    if not isinstance(dst, SharedVector):
        _check(dst, src, "tk.tma.load_async")
    elif not isinstance(src, Global):
        raise CompilationError(f"tk.tma.load_async: expected a tk.gl tensor argument, got {src!r}")
    if not isinstance(sem, Semaphore):
        raise CompilationError(f"tk.tma.load_async: the semaphore the copy completes on comes "
                               f"after the coordinates, got {sem!r}")
    unit = _unit(elements, "tk.tma.load_async")
    if multicast is None:
        emit("tma_load", [dst, src, sem, *_indices(idx)], **unit)
        return
    from .sync import _in_cluster
    size = _in_cluster("tk.tma.load_async(..., multicast=)")
    if isinstance(multicast, int) and not 0 < multicast < 1 << size:
        raise CompilationError(f"multicast mask {multicast:#x} must name blocks 0..{size - 1} of "
                               f"the cluster")
    mask = as_scalar(multicast)
    if mask.kind != "int":
        raise CompilationError(f"multicast must be an int mask, got {multicast!r}")
    emit("tma_load_multicast", [dst, src, sem, mask, *_indices(idx)], **unit)


@builtin
@builds('tma_store')
def store_async(dst, src, idx, *, elements=False) -> None:
    """Copy shared tile `src` to the tile of `dst` at tile coordinates `idx`
    (elements=True: the element where it starts, its column on a 16-byte
    boundary), none of them negative.
    The threads that wrote `src` must have synchronised with the issuing
    thread first (e.g. tk.named_barrier); the compiler fences their writes
    for the async proxy (passes/fences.py)."""
    _check(src, dst, "tk.tma.store_async")
    emit("tma_store", [dst, src, *_indices(idx)], **_unit(elements, "tk.tma.store_async"))


@builtin
@builds('tma_reduce_add')
def reduce_add_async(dst, src, idx, *, elements=False) -> None:
    """Add shared tile `src` into the tile of `dst` at tile coordinates `idx`
    (elements=True: the element where it starts, its column on a 16-byte
    boundary; none negative; cp.reduce.async.bulk.tensor
    .add; f32, f16 or bf16; elements past the edges are skipped). Issued and
    completed as tk.tma.store_async: in the same bulk groups
    (tk.tma.store_commit / store_wait), fenced by the compiler."""
    if not isinstance(src, Shared):
        raise CompilationError(f"tk.tma.reduce_add_async: TMA adds a shared tile, got {src!r}; "
                               f"store a register tile into a shared tile first (tk.store), or "
                               f"add it directly with tk.atomic_add")
    _check(src, dst, "tk.tma.reduce_add_async")
    emit("tma_reduce_add", [dst, src, *_indices(idx)],
         **_unit(elements, "tk.tma.reduce_add_async"))


@builtin
@builds('tma_commit')
def store_commit() -> None:
    """Close the group of TMA stores issued since the last commit."""
    emit("tma_commit")


@builtin
@builds('tma_wait')
def store_wait(pending=0, *, read=True) -> None:
    """Wait until at most `pending` committed store groups are unfinished.
    read=True waits only until their shared sources may be reused;
    read=False until the writes are done (visible in global memory)."""
    emit("tma_wait", pending=compile_time_int(pending, "pending", 0, 7), read=bool(read))


@builtin
@builds('expect_bytes')
def expect_bytes(sem, nbytes) -> None:
    """Arrive on `sem` and expect `nbytes` of TMA transactions in this phase."""
    if not isinstance(sem, Semaphore):
        raise CompilationError(f"tk.tma.expect_bytes: expected a semaphore, got {sem!r}")
    emit("expect_bytes", [sem], bytes=compile_time_int(nbytes, "nbytes", 1, 2**20 - 1, "2**20-1"))


@builtin
def expect(sem, *tiles) -> None:
    """tk.tma.expect_bytes with the total size of the shared tiles and vectors
    that will arrive (a TMA load always delivers its full box, zero-filled past
    the end)."""
    if not tiles or not all(isinstance(t, (Shared, SharedVector)) for t in tiles):
        raise CompilationError("tk.tma.expect(sem, tile, ...) takes the shared tiles and "
                               "vectors the phase will receive")
    expect_bytes(sem, sum(t.tk_type.nbytes for t in tiles))


@builtin
@builds('tma_prefetch')
def prefetch(src, like) -> None:
    """Prefetch the tensor map TMA ops on `src` with tiles like `like` use."""
    _check(like, src, "tk.tma.prefetch")
    emit("tma_prefetch", [src, like])


