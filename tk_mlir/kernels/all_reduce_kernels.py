"""all_reduce: a sum over the ranks of a process group, in place, by kernels
that write straight into the other GPUs' memory (tk.pgl peer tensors on
PyTorch's symmetric memory; no NCCL, no NVLink multicast).

One-shot: every rank pushes its whole tensor into every rank's buffer, then
each sums the W copies it holds: one exchange, the lowest latency (decode
sizes). Two-shot: tile t belongs to one rank; every rank pushes t to its
owner (a reduce-scatter), the owner sums and pushes the sum to every rank
(an all-gather): each rank sends 2/W of the data instead of all of it,
for larger tensors and more ranks.

How the ranks agree without a barrier or a reset:
- a fixed grid of G blocks; block b handles tiles b, b + G, ... on every
  rank, so block b of each rank exchanges only with block b of the others;
- block b counts its launches in `epochs[b]` (local memory, read at the
  start, written at the end), and the flags are counters that only grow: a
  round's wait is for `flags >= epoch`, so nothing is reset between launches
  and a CUDA graph replays the kernel unchanged;
- the buffer has two sets of slots, by the epoch's parity: a rank pushing
  launch e + 1 into a peer cannot overwrite what the peer still reads of
  launch e (and by launch e + 2 the peer has signalled that it is past e).
A wait that is never answered (a rank that did not call) traps after
TIMEOUT_MS with a message naming the line, instead of hanging the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels import symmetric
from tk_mlir.kernels.symmetric import DEFAULT_TIMEOUT_MS


@tk.kernel(num_warps=8)
def one_shot_kernel(X: tk.gl, Buf: tk.pgl, Flags: tk.pgl["i32"], Epochs: tk.gl["i32"],
                    BLOCK: tk.constexpr, TIMEOUT_MS: tk.constexpr = DEFAULT_TIMEOUT_MS):
    """X (T, N) <- the sum of every rank's X. Buf: (2W, rows >= T, N) slots,
    (parity * W + source rank); Flags: (G, 2, >= W) on every rank."""
    b, G = tk.block_id(0), tk.grid_dim(0)
    W, me = Buf.world_size, Buf.rank
    epoch = tk.load(Epochs, (b,)) + 1
    slots = (epoch & 1) * W
    cols = tk.cdiv(X.shape[1], BLOCK)
    for y in range(b, X.shape[0] * cols, G):
        x = tk.load(X, (y // cols, y % cols), (1, BLOCK))
        for p in tk.static_range(W):
            tk.store(Buf[p], x, (slots + me, y // cols, y % cols))
    exchange(Buf, Flags, b, 0, epoch, TIMEOUT_MS)
    for y in range(b, X.shape[0] * cols, G):
        total = tk.zeros((1, BLOCK), f32)
        for src in tk.static_range(W):      # the same order on every rank: the same sums
            total = total + tk.load(Buf, (slots + src, y // cols, y % cols), (1, BLOCK)).to(f32)
        tk.store(X, total.to(X.dtype), (y // cols, y % cols))
    if tk.thread_id() == 0:
        tk.signal(Epochs, (b,), epoch, mode="set", scope="gpu")


@tk.kernel(num_warps=8)
def two_shot_kernel(X: tk.gl, Buf: tk.pgl, Flags: tk.pgl["i32"], Epochs: tk.gl["i32"],
                    BLOCK: tk.constexpr, TIMEOUT_MS: tk.constexpr = DEFAULT_TIMEOUT_MS):
    """As one_shot_kernel, in two rounds. Buf: (2W + 2, rows >= T, N) slots:
    (parity * W + source) for the parts, 2W + parity for the sums. Block b's
    k-th tile (b + kG) belongs to rank k mod W."""
    b, G = tk.block_id(0), tk.grid_dim(0)
    W, me = Buf.world_size, Buf.rank
    epoch = tk.load(Epochs, (b,)) + 1
    parts, sums = (epoch & 1) * W, 2 * W + (epoch & 1)
    cols = tk.cdiv(X.shape[1], BLOCK)
    tiles = X.shape[0] * cols
    for y in range(b, tiles, G):            # reduce-scatter: each tile to its owner
        x = tk.load(X, (y // cols, y % cols), (1, BLOCK))
        tk.store(Buf[(y // G) % W], x, (parts + me, y // cols, y % cols))
    exchange(Buf, Flags, b, 0, epoch, TIMEOUT_MS)
    for y in range(b + me * G, tiles, W * G):     # this rank's tiles: sum, send to all
        total = tk.zeros((1, BLOCK), f32)
        for src in tk.static_range(W):
            total = total + tk.load(Buf, (parts + src, y // cols, y % cols), (1, BLOCK)).to(f32)
        s = total.to(X.dtype)
        for p in tk.static_range(W):
            tk.store(Buf[p], s, (sums, y // cols, y % cols))
    exchange(Buf, Flags, b, 1, epoch, TIMEOUT_MS)
    for y in range(b, tiles, G):            # all-gather: every sum into X
        tk.store(X, tk.load(Buf, (sums, y // cols, y % cols), (1, BLOCK)), (y // cols, y % cols))
    if tk.thread_id() == 0:
        tk.signal(Epochs, (b,), epoch, mode="set", scope="gpu")


@tk.func
def exchange(Buf, Flags, b, round_, epoch, TIMEOUT_MS):
    """Tell every rank that this block's pushes of `round_` are in its buffer
    (thread p signals rank p), and wait until every rank has said the same
    (thread p waits for rank p). The barriers order all the block's stores
    before the signals (the release is cumulative) and the waits before
    every thread's reads."""
    W, t = Buf.world_size, tk.thread_id()
    tk.barrier()
    if t < W:
        tk.signal(Flags[t], (b, round_, Buf.rank))
        tk.wait_signal(Flags, (b, round_, t), epoch, timeout_ms=TIMEOUT_MS)
    tk.barrier()


ALGORITHMS = ("auto", "one_shot", "two_shot")
# One-shot sends every byte to every peer, two-shot 2 / W of them in two
# rounds: with 2 ranks both send the same bytes and one-shot has one round
# less; with more, two-shot past this size per rank (a choice by that
# count, not yet measured on more than one GPU).
ONE_SHOT_MAX_BYTES = 1 << 20
WIDTH = 2048     # columns of the 2-D view the kernels take of any tensor


def _block(n: int) -> int:
    """Columns per tile: 8 per thread (16-byte vectors of 16-bit types) and
    at most 2048, at least 256 (one 1 x BLOCK tile over 8 warps)."""
    return max(256, min(2048, 1 << (n - 1).bit_length()))


@dataclass
class _Workspace:
    buf: tk.PeerTensor      # (slots, capacity, width)
    flags: tk.PeerTensor    # (grid, 2, >= W) i32
    epochs: object          # (>= grid,) i32, local: this rank's launches, per block
    capacity: int           # rows


def _make_workspace(group, key: tuple, capacity: int) -> _Workspace:
    import torch
    algorithm, dtype, width, grid = key
    world = symmetric.world_size(group)
    slots = 2 * world + (2 if algorithm == "two_shot" else 0)
    buf = tk.peer_tensor((slots, capacity, width), dtype, group)
    flags = symmetric.zeroed_flags((grid, 2, symmetric.flag_width(world)), group)
    # (padded to whole 16-byte rows, as every tensor argument: grid may be 114)
    epochs = torch.zeros(-(-grid // 4) * 4, dtype=torch.int32, device=buf.local.device)
    return _Workspace(buf, flags, epochs, capacity)


_WORKSPACES = symmetric.Workspaces(_make_workspace)


def all_reduce(t, group=None, *, algorithm: str = "auto",
               timeout_ms: int = symmetric.DEFAULT_TIMEOUT_MS):
    """Sum `t` over the ranks of `group` (default: the world), in place, as
    torch.distributed.all_reduce(t, group=group); returns t.

    t: a contiguous bf16, f16 or f32 CUDA tensor on this rank's current
    device, of a multiple of 16 bytes; every rank calls with the same shape
    and dtype. algorithm: "one_shot", "two_shot" or "auto" (one-shot with 2
    ranks, and up to 1 MB per rank with more). A call needing a
    larger workspace than the group's calls so far allocates symmetric
    memory (a collective): make one such call before capturing a CUDA graph,
    which then replays the kernel as is. A rank that waits timeout_ms for
    another traps (the launch fails, with a message saying where) instead
    of hanging. The kernel's blocks wait for the same blocks of the other
    ranks: another kernel that fills a GPU and waits for a peer (e.g. NCCL
    on another stream) at the same time can stall it until the timeout."""
    import math
    fn = "all_reduce"
    key = (symmetric.resolve(group) if _initialized() else None, getattr(t, "shape", None),
           getattr(t, "dtype", None), getattr(t, "device", None), algorithm, timeout_ms)
    call = _CALLS.get(key) if type(timeout_ms) is int else None
    if call is not None and t.is_contiguous() and _on_current_device(t):
        kernel, grid, width, block, ws = call      # (a call like an earlier one: checked then)
        kernel[(grid,)](t.view(-1, width), ws.buf, ws.flags, ws.epochs, BLOCK=block,
                        TIMEOUT_MS=timeout_ms)
        return t
    _check(t, algorithm, timeout_ms)
    world = symmetric.world_size(group)
    nbytes = t.numel() * t.element_size()
    if algorithm == "auto":
        algorithm = "one_shot" if world <= 2 or nbytes <= ONE_SHOT_MAX_BYTES else "two_shot"
    if t.numel() == 0:
        return t
    width = math.gcd(t.numel(), WIDTH)      # (a multiple of 16 bytes: t's size is)
    x = t.view(-1, width)
    grid = symmetric.agreed_grid(group, fn)  # (block b pairs with block b of every rank)
    ws = _WORKSPACES.get(group, (algorithm, t.dtype, width, grid), x.shape[0], fn)
    kernel = one_shot_kernel if algorithm == "one_shot" else two_shot_kernel
    kernel[(grid,)](x, ws.buf, ws.flags, ws.epochs, BLOCK=_block(width), TIMEOUT_MS=timeout_ms)
    if len(_CALLS) >= 256:
        _CALLS.clear()
    _CALLS[key] = (kernel, grid, width, _block(width), ws)
    return t


# A call's (group, shape, dtype, device, algorithm, timeout) -> what it launched:
# a call like it skips the checks and lookups (host time: decode all-reduces
# are a few µs of GPU time). Every rank makes the same calls, so the same
# workspaces, outgrown ones included, pair up.
_CALLS: dict = {}


def _initialized() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _on_current_device(t) -> bool:
    import torch
    return t.device.index == torch.cuda.current_device()


def _check(t, algorithm, timeout_ms) -> None:
    import torch
    from tk_mlir.kernels import checks
    fn = "all_reduce"
    checks.tensor(fn, "t", t, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    if not t.is_contiguous():
        raise ValueError(f"{fn}: t must be contiguous (it is reduced in place), got strides "
                         f"{t.stride()} for shape {tuple(t.shape)}")
    if t.numel() * t.element_size() % 16:
        raise ValueError(f"{fn}: t must hold a multiple of 16 bytes ({16 // t.element_size()} "
                         f"{t.dtype} elements), got shape {tuple(t.shape)}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{fn}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    symmetric.check_timeout(fn, timeout_ms)
    symmetric.check_distributed(fn, "t", t)
