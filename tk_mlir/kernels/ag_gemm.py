"""all_gather_matmul: C = all_gather(A) @ B.T on every rank of a group (a
tensor-parallel layer's column-parallel GEMM on sequence-sharded input),
with the gather inside the GEMM.

Every rank copies its rows of A into its copy of a peer tensor; the GEMM
(tk_mlir/kernels/gemm.py) then TMA-loads each A tile straight from the copy
of the rank that owns its rows (a tensor map per rank, picked by the tile's
owner), so the NVLink reads overlap the product instead of an all-gather
running first.

The ranks agree by signals, no barrier, in three launches on the stream:
- `ready_kernel`: wait until every rank's blocks have said they are done
  reading this rank's copy (round 1) for all earlier calls; only then may
  the copy be overwritten;
- the copy of A's rows into this rank's copy (torch);
- `ag_gemm_kernel`: every block says "written" (round 0, any block's word is
  enough), and the producer waits for a rank's word before its first load
  of that rank's rows; after its last load every block tells every rank it
  is done reading them (round 1).
Counters only grow; `totals` (local) holds the counts this rank expects, and
`ready_kernel` advances them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tk_mlir as tk

from tk_mlir.kernels import symmetric
from tk_mlir.kernels.device import num_sms
from tk_mlir.kernels.gemm import check, gemm, output_shape
from tk_mlir.kernels.symmetric import DEFAULT_TIMEOUT_MS


@tk.kernel(num_warps=4)
def ready_kernel(Flags: tk.pgl["i32"], Totals: tk.gl["i32"], BLOCKS: int,
                 TIMEOUT_MS: tk.constexpr = DEFAULT_TIMEOUT_MS):
    """Wait until every rank is done reading this rank's copy (all earlier
    calls); then count this call: Totals[0] += 1 (the "written" word to
    expect), Totals[1] += BLOCKS (the "done" words after it)."""
    t = tk.thread_id()
    if t < Flags.world_size:
        tk.wait_signal(Flags, (1, t), tk.load(Totals, (1,)), timeout_ms=TIMEOUT_MS)
    tk.barrier()
    if t == 0:
        tk.signal(Totals, (0,), 1, scope="gpu")
        tk.signal(Totals, (1,), BLOCKS, scope="gpu")


@tk.kernel(num_warps=12)
def ag_gemm_kernel(A: tk.pgl, B: tk.gl, C: tk.gl, Flags: tk.pgl["i32"], Totals: tk.gl["i32"],
                   B_KN: tk.constexpr = False, BM: tk.constexpr = 128, BN: tk.constexpr = 256,
                   BK: tk.constexpr = 64, STAGES: tk.constexpr = 4, GROUP_M: tk.constexpr = 8,
                   EPI_N: tk.constexpr = 64, EPI_BUFFERS: tk.constexpr = 2,
                   TIMEOUT_MS: tk.constexpr = DEFAULT_TIMEOUT_MS):
    """C (W * rows, N) = every rank's A (rows, K), stacked, @ B.T (B: N x K,
    or K x N with B_KN); Flags (2, >= W) on every rank; Totals (>= 2,)."""
    W, me, t = A.world_size, A.rank, tk.thread_id()
    written = tk.load(Totals, (0,))
    if t < W:           # (the host wrote this rank's A before the launch)
        tk.signal(Flags[t], (0, me), written, mode="set")

    def owner_written(owner):
        tk.wait_signal(Flags, (0, owner), written, timeout_ms=TIMEOUT_MS)
        tk.fence("sys", async_proxy=True)     # the rows before this thread's TMA loads

    gemm(A, B, C, B_KN, BM, BN, BK, STAGES, GROUP_M, True, EPI_N, 1, EPI_BUFFERS=EPI_BUFFERS,
         GATHER=owner_written)
    # Every TMA load of this block has landed (its consumers waited for them);
    # (its stores of C need not be done to say so, but a signal after TMA
    # writes is checked to wait for them: cheap, at the block's end).
    tk.tma.store_wait(0, read=False)
    tk.fence("sys", async_proxy=True)
    tk.barrier()
    if t < W:
        tk.signal(Flags[t], (1, me))


@dataclass
class _Workspace:
    a: tk.PeerTensor            # (capacity, K): this rank's rows, read by every rank
    flags: tk.PeerTensor        # (2, >= W) i32
    totals: object              # (4,) i32, local
    capacity: int               # rows
    views: dict = field(default_factory=dict)    # rows -> a's first rows, a PeerTensor

    def rows(self, n: int) -> tk.PeerTensor:
        if n not in self.views:
            self.views[n] = tk.PeerTensor.from_tensors([c[:n] for c in self.a.peers],
                                                       self.a.rank)
        return self.views[n]


def _make_workspace(group, key: tuple, capacity: int) -> _Workspace:
    import torch
    dtype, k = key
    world = symmetric.world_size(group)
    a = tk.peer_tensor((capacity, k), dtype, group)
    flags = symmetric.zeroed_flags((2, symmetric.flag_width(world)), group)
    return _Workspace(a, flags, torch.zeros(4, dtype=torch.int32, device=a.local.device),
                      capacity)


_WORKSPACES = symmetric.Workspaces(_make_workspace)


def all_gather_matmul(a, b, group=None, *, b_layout: str = "nk",
                      timeout_ms: int = DEFAULT_TIMEOUT_MS):
    """all_gather(a) @ b.T (b_layout "nk": b is N x K, a Linear weight) or
    @ b ("kn"), as torch.distributed.all_gather_into_tensor of a's rows then
    a matmul: a is this rank's (rows, K) bf16 or f16, rows a multiple of 64
    (whole tiles: 128-row tiles when rows allow, else 64); returns a new
    (W * rows, N) tensor of a's dtype. A call
    with more rows than the group's calls so far allocates symmetric memory
    (a collective)."""
    import torch
    fn = "all_gather_matmul"
    if getattr(a, "dim", lambda: 2)() != 2:
        raise ValueError(f"{fn}: a must be 2-D (rows x K), got shape {tuple(a.shape)}")
    check(a, b, None, b_layout, fn)
    symmetric.check_distributed(fn, "a", a)
    symmetric.check_timeout(fn, timeout_ms)
    rows, N = output_shape(a, b, b_layout)
    if rows % 64:
        raise ValueError(f"{fn}: a's rows ({rows}) must be a multiple of 64: each rank's rows "
                         f"are whole tiles of 64 or 128 rows")
    tile = dict(BM=128) if rows % 128 == 0 else dict(BM=64, num_warps=8)
    world = symmetric.world_size(group)
    ws = _WORKSPACES.get(group, (a.dtype, a.shape[1]), rows, fn)
    grid = num_sms(a.device.index)
    ready_kernel[(1,)](ws.flags, ws.totals, grid, TIMEOUT_MS=timeout_ms)
    copy = ws.rows(rows)
    copy.local.copy_(a)
    c = torch.empty(world * rows, N, dtype=a.dtype, device=a.device)
    ag_gemm_kernel[(grid,)](copy, b, c, ws.flags, ws.totals, B_KN=b_layout == "kn",
                            TIMEOUT_MS=timeout_ms, **tile)
    return c
