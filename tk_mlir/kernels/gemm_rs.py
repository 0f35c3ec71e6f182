"""matmul_reduce_scatter: C = A @ B.T summed over the ranks of a group and
scattered by rows (a tensor-parallel layer's output: every rank holds a
K-slice of A and B), in one kernel: ThunderKittens' gemm_rs.

Each rank runs the Hopper GEMM (tk_mlir/kernels/gemm.py) on its K-slice, with
A seen as (W, M / W, K): rank r owns rows r * M / W to (r + 1) * M / W, tiled
on their own, so M / W need not be a multiple of a tile. Each 64-row piece of
a finished tile leaves by TMA reduce-add straight into its owner's copy of
the output (a tk.pgl on symmetric memory), so the reduce-scatter travels over
NVLink while the GEMM's pipeline keeps computing.

The ranks agree by signals, no barrier:
- each rank zeroes its copy before the kernel; its blocks tell every rank
  ("zeroed", round 0: any one block's word is enough), and a consumer waits
  for every owner's word before its first add;
- after its last add every block waits for its TMA writes, fences (system
  scope) and tells every rank ("done", round 1); block 0 of each rank waits
  until every block of every rank is done, so the kernel ends with the
  rank's rows complete.
Counters only grow: `totals` (local) holds how many of each a rank has seen;
block 0 advances it at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tk_mlir as tk

from tk_mlir.kernels import symmetric
from tk_mlir.kernels.gemm import gemm
from tk_mlir.kernels.symmetric import DEFAULT_TIMEOUT_MS


@tk.kernel(num_warps=12)
def gemm_rs_kernel(A: tk.gl, B: tk.gl, C: tk.pgl, Flags: tk.pgl["i32"], Totals: tk.gl["i32"],
                   B_KN: tk.constexpr = False, BM: tk.constexpr = 128, BN: tk.constexpr = 256,
                   BK: tk.constexpr = 64, STAGES: tk.constexpr = 4, GROUP_M: tk.constexpr = 8,
                   EPI_N: tk.constexpr = 64, EPI_BUFFERS: tk.constexpr = 2,
                   TIMEOUT_MS: tk.constexpr = DEFAULT_TIMEOUT_MS):
    """This rank's A @ B.T (B: N x K, or K x N with B_KN), A given as (W, M /
    W, K): rows A[r] are added into rank r's C (M / W, N); Flags (2, >= W)
    on every rank; Totals (>= 2,): the zeroed and done words this rank has
    had."""
    W, me, t, b = C.world_size, C.rank, tk.thread_id(), tk.block_id(0)
    zeroed = tk.load(Totals, (0,)) + 1
    done = tk.load(Totals, (1,)) + tk.grid_dim(0)
    if t < W:           # (the host zeroed C before the launch; any block may say so)
        tk.signal(Flags[t], (0, me), zeroed, mode="set")

    def owners_ready(task, wg):
        if task == b:   # this block's first tile: every owner has zeroed its copy
            if t % 128 == 0:
                for p in tk.static_range(W):
                    tk.wait_signal(Flags, (0, p), zeroed, timeout_ms=TIMEOUT_MS)
            tk.named_barrier(1 + wg, warps=4)
            tk.fence("sys", async_proxy=True)    # the zeros before this thread's TMA adds

    # Owners from the next rank on, this one's own rows last: the adds still
    # in flight when the block ends (its last tiles') are then local ones.
    # (A choice by reasoning: not yet measured on two GPUs.)
    gemm(A, B, C, B_KN, BM, BN, BK, STAGES, GROUP_M, True, EPI_N, 1, EPI_BUFFERS=EPI_BUFFERS,
         SCATTER=(owners_ready, (me + 1) % W))
    tk.tma.store_wait(0, read=False)     # this thread's adds are done ...
    tk.fence("sys", async_proxy=True)    # ... and ordered before the signal
    tk.barrier()
    if t < W:
        tk.signal(Flags[t], (1, me))
    if b == 0:
        if t < W:
            tk.wait_signal(Flags, (1, t), done, timeout_ms=TIMEOUT_MS)
        tk.barrier()
        if t == 0:
            tk.signal(Totals, (0,), zeroed, mode="set", scope="gpu")
            tk.signal(Totals, (1,), done, mode="set", scope="gpu")


@dataclass
class _Workspace:
    out: tk.PeerTensor          # (capacity, N): this rank's rows, added into by every rank
    flags: tk.PeerTensor        # (2, >= W) i32
    totals: object              # (4,) i32, local
    capacity: int               # rows
    views: dict = field(default_factory=dict)    # rows -> out's first rows, a PeerTensor

    def rows(self, n: int) -> tk.PeerTensor:
        """`out`'s first n rows on every rank (the same object for the same n:
        the launch plan holds it)."""
        if n not in self.views:
            self.views[n] = tk.PeerTensor.from_tensors([c[:n] for c in self.out.peers],
                                                       self.out.rank, self.out.handle)
        return self.views[n]


def _make_workspace(group, key: tuple, capacity: int) -> _Workspace:
    import torch
    dtype, n = key
    world = symmetric.world_size(group)
    out = tk.peer_tensor((capacity, n), dtype, group)
    flags = symmetric.zeroed_flags((2, symmetric.flag_width(world)), group)
    return _Workspace(out, flags, torch.zeros(4, dtype=torch.int32, device=out.local.device),
                      capacity)


_WORKSPACES = symmetric.Workspaces(_make_workspace)


def matmul_reduce_scatter(a, b, group=None, *, b_layout: str = "nk",
                          timeout_ms: int = DEFAULT_TIMEOUT_MS):
    """sum over the ranks of `group` of a @ b.T (b_layout "nk": b is N x K, a
    Linear weight) or a @ b ("kn"), scattered by rows: rank r gets rows
    r * M / W to (r + 1) * M / W, as torch.distributed.reduce_scatter_tensor
    of the products would give. a: (M, K) bf16 or f16, this rank's K-slice;
    M a multiple of W. Returns a new (M / W, N) tensor of a's dtype.
    The ranks' partial products are added in a's dtype in the order they
    arrive: with more than 2 ranks the roundings, so the last bits, vary
    from run to run.
    A call with more rows than the group's calls so far allocates symmetric
    memory (a collective)."""
    fn = "matmul_reduce_scatter"
    M, N = symmetric.check_matmul(fn, a, b, b_layout, timeout_ms)
    world = symmetric.world_size(group)
    if M % world:
        raise ValueError(f"{fn}: a's rows (M = {M}) must be a multiple of the world size "
                         f"({world}): each rank gets M / W of them")
    if M == 0 or N == 0:        # (every rank's shapes are the same: none of them adds)
        return a.new_empty(M // world, N)
    ws = _WORKSPACES.get(group, (a.dtype, N), M // world, fn)
    out = ws.rows(M // world)
    out.local.zero_()
    by_owner = a.unflatten(0, (world, M // world))     # (the rows each rank gets)
    gemm_rs_kernel[(symmetric.agreed_grid(group, fn),)](by_owner, b, out, ws.flags, ws.totals,
                                                        B_KN=b_layout == "kn",
                                                        TIMEOUT_MS=timeout_ms)
    return out.local.clone()
