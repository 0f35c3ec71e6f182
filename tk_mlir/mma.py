"""Warpgroup MMA builtins (wgmma): `acc = tk.mma_ABt(acc, a, b)`.

The accumulator is an f32 register tile of warpgroup scope in the `row`
layout (the wgmma accumulator fragment), 64 rows per warpgroup call, N from
16 to 256 columns; b is a shared tile with a 32/64/128-byte swizzle, and a
either such a shared tile or (mma_AB, mma_ABt) a bf16/f16 register tile of
warpgroup scope in the `row` layout (the wgmma A fragment), e.g. the
probabilities of an attention kernel.
fp8 (f8e4m3, f8e5m2, in any pair) takes the mma_ABt form only, both operands
shared tiles: wgmma reads 8-bit operands K-major, with no transpose.
Each call issues the K/16 (fp8: K/32) wgmma instructions of the product after a
wgmma.fence and closes them with a commit: it is asynchronous, and the
accumulator may be read only after tk.mma_wait() (pending=1 lets the
newest group run on while the previous one is known complete).

    mma_AB   acc += a   @ b      a: M x K,  b: K x N
    mma_ABt  acc += a   @ b.T    a: M x K,  b: N x K
    mma_AtB  acc += a.T @ b      a: K x M,  b: K x N
    mma_AtBt acc += a.T @ b.T    a: K x M,  b: N x K

On Blackwell (target="sm_100a") the accumulator is a tensor tile instead
(tk_mlir/tensor_memory.py): the call issues tcgen05.mma from the thread
that runs it, writes the tile in place (acc = product, or acc + product
with accumulate=True, which may be a run-time bool such as k > 0) and
returns nothing; tk.mma_commit(sem) completes it on a semaphore. pair=True
(a cluster of 2, tk.use_cluster(2)): one MMA of M = 256 over both blocks,
issued from block 0, each block holding its 128 rows of a and of the tile
and half of b's N rows (or columns), at the same shared-memory places.
"""
from __future__ import annotations

from .errors import CompilationError
from .language import builtin, compile_time_int
from .values import Scalar, Shared, TensorTile, Tile, as_scalar, builds, emit

__all__ = ["mma_AB", "mma_ABt", "mma_AtB", "mma_AtBt", "mma_wait"]


def _mma(acc, a, b, trans_a: bool, trans_b: bool, name: str, accumulate, pair) -> Tile | None:
    if isinstance(acc, TensorTile):
        return _tensor_mma(acc, a, b, trans_a, trans_b, name, accumulate, pair)
    if accumulate is not True or pair is not False:
        raise CompilationError(f"{name}: accumulate= and pair= are for a tensor-tile "
                               f"accumulator (Blackwell); a register accumulator starts from "
                               f"tk.zeros")
    if not isinstance(acc, Tile):
        raise CompilationError(f"{name}: the accumulator must be a register tile (e.g. "
                               f"tk.zeros((64, N), tk.f32, layout='row', scope='warpgroup')), "
                               f"got {acc!r}")
    if not isinstance(a, (Shared, Tile)):
        raise CompilationError(f"{name}: a must be a shared tile or a register tile, got {a!r}")
    if not isinstance(b, Shared):
        raise CompilationError(f"{name}: b must be a shared tile, got {b!r}")
    return Tile(emit("mma", [acc, a, b], acc.ir_type, trans_a=int(trans_a),
                     trans_b=int(trans_b)))


def _tensor_mma(acc, a, b, trans_a: bool, trans_b: bool, name: str, accumulate, pair) -> None:
    """tcgen05.mma into a tensor tile: no result (the tile is memory)."""
    if not isinstance(pair, bool):
        raise CompilationError(f"{name}: pair must be a compile-time bool, got {pair!r}")
    for what, x in (("a", a), ("b", b)):
        if not isinstance(x, Shared):
            raise CompilationError(f"{name}: into a tensor tile, {what} must be a shared tile, "
                                   f"got {x!r}")
    if not isinstance(accumulate, (bool, Scalar)) or \
            isinstance(accumulate, Scalar) and accumulate.kind != "bool":
        raise CompilationError(f"{name}: accumulate must be a bool (a compile-time one, or a "
                               f"run-time comparison such as k > 0), got {accumulate!r}")
    emit("tensor_mma", [acc, a, b, as_scalar(accumulate)], trans_a=int(trans_a),
         trans_b=int(trans_b), pair=int(pair))


@builtin
@builds('mma', 'tensor_mma')
def mma_AB(acc, a, b, *, accumulate=True, pair=False) -> Tile | None:
    """acc + a @ b (a: M x K, b: K x N shared tiles)."""
    return _mma(acc, a, b, False, True, "tk.mma_AB", accumulate, pair)


@builtin
@builds('mma', 'tensor_mma')
def mma_ABt(acc, a, b, *, accumulate=True, pair=False) -> Tile | None:
    """acc + a @ b.T (a: M x K, b: N x K shared tiles)."""
    return _mma(acc, a, b, False, False, "tk.mma_ABt", accumulate, pair)


@builtin
@builds('mma', 'tensor_mma')
def mma_AtB(acc, a, b, *, accumulate=True, pair=False) -> Tile | None:
    """acc + a.T @ b (a: K x M, b: K x N shared tiles)."""
    return _mma(acc, a, b, True, True, "tk.mma_AtB", accumulate, pair)


@builtin
@builds('mma', 'tensor_mma')
def mma_AtBt(acc, a, b, *, accumulate=True, pair=False) -> Tile | None:
    """acc + a.T @ b.T (a: K x M, b: N x K shared tiles)."""
    return _mma(acc, a, b, True, False, "tk.mma_AtBt", accumulate, pair)


@builtin
@builds('mma_wait')
def mma_wait(pending=0) -> None:
    """Wait until at most `pending` MMA groups of this warpgroup are in flight."""
    emit("mma_wait", pending=compile_time_int(pending, "pending", 0, 7))
