"""all_gather_matmul: C = all_gather(A) @ B.T on every rank of a group (a
tensor-parallel layer's column-parallel GEMM on sequence-sharded input).

Every rank pushes its rows of A into every rank's gather buffer (a peer
tensor on symmetric memory: rank r's rows at r * rows), then says so (a flag
per rank). The GEMM (tk_mlir/kernels/gemm.py) reads A from its own buffer,
starting with this rank's rows and waiting, before its first load of a
tile, for the word of each rank whose rows the tile holds: each byte crosses
NVLink once, and a rank's GEMM starts on its own rows while slower ranks'
pushes still arrive.

Everything runs on the caller's stream, in order: the GEMM's persistent
blocks spin on the words, so pushes on a side stream could find every SM
held by a GEMM that started first, which then waits until the timeout
(tests/test_peers_gpu.py keeps the case).

The ranks agree by signals, no barrier:
- `ready_kernel`: wait until every rank is done reading its buffer for all
  earlier calls (round 1), so the pushes may overwrite it; then count this
  call in `totals`;
- the pushes and `written_kernel`: the copies, then "written" (round 0) to
  every rank;
- `ag_gemm_kernel`: the GEMM, waiting per owner; after its last load every
  block tells every rank it is done reading (round 1).
Counters only grow; `totals` (local) holds the counts this rank expects.
"""
from __future__ import annotations

from dataclasses import dataclass

import tk_mlir as tk

from tk_mlir.kernels import symmetric
from tk_mlir.kernels.gemm import gemm
from tk_mlir.kernels.symmetric import DEFAULT_TIMEOUT_MS


@tk.kernel(num_warps=4)
def ready_kernel(Flags: tk.pgl["i32"], Totals: tk.gl["i32"], BLOCKS: int,
                 TIMEOUT_MS: tk.constexpr = DEFAULT_TIMEOUT_MS):
    """Wait until every rank is done reading its buffer (all earlier calls);
    then count this call: Totals[0] += 1 (its "written" word), Totals[1] +=
    BLOCKS (the "done" words each rank's blocks will send)."""
    t = tk.thread_id()
    if t < Flags.world_size:
        tk.wait_signal(Flags, (1, t), tk.load(Totals, (1,)), timeout_ms=TIMEOUT_MS)
    tk.barrier()
    if t == 0:
        tk.signal(Totals, (0,), 1, scope="gpu")
        tk.signal(Totals, (1,), BLOCKS, scope="gpu")


@tk.kernel(num_warps=4)
def written_kernel(Flags: tk.pgl["i32"], Totals: tk.gl["i32"]):
    """Tell every rank that this rank's rows are in its buffer (after the
    copies before this launch on its stream)."""
    t = tk.thread_id()
    tk.fence("sys", async_proxy=True)    # (the copies, done before this kernel, first)
    if t < Flags.world_size:
        tk.signal(Flags[t], (0, Flags.rank), tk.load(Totals, (0,)), mode="set")


@tk.kernel(num_warps=12)
def ag_gemm_kernel(A: tk.gl, B: tk.gl, C: tk.gl, Flags: tk.pgl["i32"], Totals: tk.gl["i32"],
                   ROWS: int, B_KN: tk.constexpr = False, BM: tk.constexpr = 128,
                   BN: tk.constexpr = 256, BK: tk.constexpr = 64, STAGES: tk.constexpr = 4,
                   GROUP_M: tk.constexpr = 8, EPI_N: tk.constexpr = 64,
                   EPI_BUFFERS: tk.constexpr = 2, TIMEOUT_MS: tk.constexpr = DEFAULT_TIMEOUT_MS):
    """C (W * ROWS, N) = A @ B.T (B: N x K, or K x N with B_KN), where A's
    rows r * ROWS ... arrive from rank r, announced by its word in Flags
    (0, r); Flags (2, >= W) on every rank; Totals (>= 2,). A tile of BM rows
    may hold rows of several ranks (ROWS need not be a multiple of BM)."""
    W, me, t = Flags.world_size, Flags.rank, tk.thread_id()
    written = tk.load(Totals, (0,))

    def rows_arrived(m):
        """Every rank whose rows tile row m holds has announced them."""
        for owner in range(m * BM // ROWS, min((m * BM + BM - 1) // ROWS, W - 1) + 1):
            tk.wait_signal(Flags, (0, owner), written, timeout_ms=TIMEOUT_MS)
        tk.fence("sys", async_proxy=True)     # the rows before this thread's TMA loads

    gemm(A, B, C, B_KN, BM, BN, BK, STAGES, GROUP_M, True, EPI_N, 1, EPI_BUFFERS=EPI_BUFFERS,
         GATHER=(rows_arrived, me * ROWS // BM))   # (from the tile of this rank's first row)
    # Every TMA load of this block has landed (its consumers waited for them);
    # its stores of C need not be done to say so, but a signal after TMA
    # writes is checked to wait for them (cheap, at the block's end).
    tk.tma.store_wait(0, read=False)
    tk.fence("sys", async_proxy=True)
    tk.barrier()
    if t < W:
        tk.signal(Flags[t], (1, me))


@dataclass
class _Workspace:
    gathered: tk.PeerTensor     # (W * capacity, K): rank r's rows at r * rows, pushed here
    flags: tk.PeerTensor        # (2, >= W) i32
    totals: object              # (4,) i32, local
    capacity: int               # rows per rank
    grid: int                   # blocks of the GEMM, the same on every rank


def _make_workspace(group, key: tuple, capacity: int) -> _Workspace:
    import torch
    dtype, k = key
    world = symmetric.world_size(group)
    gathered = tk.peer_tensor((world * capacity, k), dtype, group)
    flags = symmetric.zeroed_flags((2, symmetric.flag_width(world)), group)
    device = gathered.local.device
    return _Workspace(gathered, flags, torch.zeros(4, dtype=torch.int32, device=device),
                      capacity, symmetric.agreed_grid(group, "all_gather_matmul"))


_WORKSPACES = symmetric.Workspaces(_make_workspace)
_COMPILED: set = set()      # the kinds of call whose GEMM has compiled


def all_gather_matmul(a, b, group=None, *, b_layout: str = "nk",
                      timeout_ms: int = DEFAULT_TIMEOUT_MS):
    """all_gather(a) @ b.T (b_layout "nk": b is N x K, a Linear weight) or
    @ b ("kn"), as torch.distributed.all_gather_into_tensor of a's rows then
    a matmul: a is this rank's (rows, K) bf16 or f16, every rank's the same
    shape, any rows (a tile may hold two ranks' rows: it waits for both);
    returns a new (W * rows, N) tensor of a's dtype. A call with
    more rows than the group's calls so far allocates symmetric memory (a
    collective)."""
    import torch
    fn = "all_gather_matmul"
    rows, N = symmetric.check_matmul(fn, a, b, b_layout, timeout_ms)
    world = symmetric.world_size(group)
    c = torch.empty(world * rows, N, dtype=a.dtype, device=a.device)
    if rows == 0 or N == 0:     # (every rank's shapes are the same: none of them gathers)
        return c
    tile = dict(BM=128) if rows >= 128 else dict(BM=64, num_warps=8)
    ws = _WORKSPACES.get(group, (a.dtype, a.shape[1]), rows, fn)
    me, gathered = ws.gathered.rank, ws.gathered.local[:world * rows]
    gemm_args = (gathered, b, c, ws.flags, ws.totals, rows)
    gemm_kwargs = dict(B_KN=b_layout == "kn", TIMEOUT_MS=timeout_ms, **tile)
    # Compiled before this call is counted (ready_kernel): a compile error
    # after it would leave this rank's counts a call ahead of the others'.
    # (Once per kind of call: the check alone costs more host time than a
    # small call's GPU time.)
    kind = (a.dtype, rows, tuple(b.shape), tuple(b.stride()), b_layout, timeout_ms)
    if kind not in _COMPILED:
        ag_gemm_kernel.compile(*gemm_args, **gemm_kwargs)
        _COMPILED.add(kind)
    ready_kernel[(1,)](ws.flags, ws.totals, ws.grid, TIMEOUT_MS=timeout_ms)
    for copy in ws.gathered.peers:       # every rank's buffer: rows me * rows ... of it
        copy[me * rows:(me + 1) * rows].copy_(a)
    written_kernel[(1,)](ws.flags, ws.totals)
    ag_gemm_kernel[(ws.grid,)](*gemm_args, **gemm_kwargs)
    return c
