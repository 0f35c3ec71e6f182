"""Blackwell (sm_100a) tensor memory and its MMA: `@tk.kernel(target="sm_100a")`.

Tensor memory (TMEM) is 128 lanes x 512 columns of 32-bit cells per block,
beside the tensor cores. A tensor tile is a part of it: 128 rows (lanes) by
`cols` f32 columns, the accumulator of tcgen05.mma.

    acc = tk.tensor_tile(tk.f32, (128, 256))   # allocated here (tcgen05.alloc)
    done = tk.semaphore(1)
    if tk.warp_id() == 0:
        if tk.elect_leader():                  # one thread issues the MMAs
            tk.mma_ABt(acc, a, b, accumulate=False)   # acc = a @ b.T  (tcgen05.mma)
            tk.mma_commit(done)                # done's phase completes with them
    tk.wait(done, 0)
    c = tk.load(acc)       # tcgen05.ld: (128, 256) f32, tmem layout, warpgroup scope
    tk.free_tensor_tile(acc)                   # tcgen05.dealloc

The MMA is asynchronous: it reads its shared operands and writes the tile
until the tk.mma_commit after it completes its semaphore's phase; a tk.wait
on that phase orders the tile's reads (and the operands' reuse) after it.
A tensor tile is allocated and freed by the whole block, at the kernel's
top level; the block's tiles live in 512 columns (tk-verify adds them up).
"""
from __future__ import annotations

from .dialects import types as T
from .errors import CompilationError
from .language import builtin, dtype_name
from .values import Semaphore, TensorTile, builds, emit, tile_shape

__all__ = ["tensor_tile", "free_tensor_tile", "mma_commit"]

@builtin
@builds("alloc_tt")
def tensor_tile(dtype, shape) -> TensorTile:
    """A (128, cols) f32 tile in tensor memory, cols a multiple of 16 up to
    512: the block allocates the next power of two of columns (at least
    32) here, and frees them at tk.free_tensor_tile."""
    rows, cols = tile_shape(shape, "tk.tensor_tile", ranks=(2,))
    tt = T.TT(dtype_name(dtype), rows, cols)
    return TensorTile(emit("alloc_tt", [], tt.to_mlir()))


@builtin
@builds("free_tt")
def free_tensor_tile(tile) -> None:
    """Give a tensor tile's columns back (the whole block, after its last use)."""
    if not isinstance(tile, TensorTile):
        raise CompilationError(f"tk.free_tensor_tile frees a tensor tile (tk.tensor_tile), "
                               f"got {tile!r}")
    emit("free_tt", [tile])


@builtin
@builds("mma_commit")
def mma_commit(sem) -> None:
    """One arrival on `sem` once every tk.mma_* into a tensor tile that this
    thread issued before it is complete (tcgen05.commit): wait on its phase
    before reading the tile or reusing the operands."""
    if not isinstance(sem, Semaphore):
        raise CompilationError(f"tk.mma_commit arrives on a semaphore (tk.semaphore), got {sem!r}")
    emit("mma_commit", [sem])
