"""matmul: a Hopper GEMM on torch tensors.

C = A @ B.T (B given as N x K, b_layout="nk", the layout of a Linear weight)
or C = A @ B (B given as K x N, "kn"); bf16 or f16 inputs, f32 accumulation,
bf16/f16/f32 output.

The kernel: TMA loads into a ring of swizzled shared tiles, wgmma on two
consumer warpgroups, a producer warpgroup, a persistent grid walking output
tiles in L2-friendly groups. The load-compute-finish template (tk.lcf) does
the pipeline; the kernel says what to load, compute and store. M, N and K
need not be multiples of the tiles: TMA reads zeros past the edges (so the
K tail adds nothing) and the stores are masked. Rows must be 16-byte aligned
(K and N multiples of 8 for 16-bit types), as TMA requires; the launch
checks say so by argument.
"""
from __future__ import annotations

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels import checks
from tk_mlir.kernels.device import num_sms


@tk.autotune(configs=[tk.Config(BN=256, STAGES=4), tk.Config(BN=256, STAGES=4, GROUP_M=16),
                      tk.Config(BN=128, STAGES=6)],
             key=["A", "B", "C", "B_KN"])
@tk.kernel(num_warps=12)      # warpgroups 0, 1: consumers; 2: producer
def gemm_kernel(A: tk.gl, B: tk.gl, C: tk.gl, B_KN: tk.constexpr = False,
                BM: tk.constexpr = 128, BN: tk.constexpr = 256, BK: tk.constexpr = 64,
                STAGES: tk.constexpr = 4, GROUP_M: tk.constexpr = 8,
                TMA_STORE: tk.constexpr = True, EPI_N: tk.constexpr = 128,
                CLUSTER: tk.constexpr = 1):
    """C = A @ B.T, or A @ B with B_KN, on a persistent grid (one block per SM).
    Tiles of BM x BN, BK deep through a ring of STAGES shared tiles; GROUP_M
    tile rows share B tiles in L2; a 16-bit C leaves EPI_N columns at a time
    by TMA store (TMA_STORE); CLUSTER blocks share B tiles by TMA multicast."""
    M, K = A.shape
    N = B.shape[1] if B_KN else B.shape[0]
    tiles_m, tiles_n = tk.cdiv(M, BM), tk.cdiv(N, BN)
    # CLUSTER blocks take vertically adjacent tiles; each loads 1/CLUSTER of
    # the B tile they share and multicasts it to all (A·Bᵀ only).
    assert CLUSTER == 1 or not B_KN, "CLUSTER > 1 is built for B given as N x K"
    groups_m = tk.cdiv(tiles_m, CLUSTER)
    WG_M = BM // 2                          # rows per consumer warpgroup
    b_tile = (BK, BN) if B_KN else (BN, BK)
    # 16-bit results leave through shared memory and TMA stores, EPI_N columns
    # at a time (a staging tile per consumer); f32 ones from registers.
    TMA_STORE = TMA_STORE and C.dtype != "f32"
    EPI_N = min(EPI_N, BN)
    assert BN % EPI_N == 0, f"EPI_N={EPI_N} must divide BN={BN}"
    if TMA_STORE:
        c_tiles = tk.shared_tiles(C.dtype, (WG_M, EPI_N), 2, swizzle=128)

    def tile_of(task):
        m, n = tk.grouped_tile(task, groups_m, tiles_n, GROUP_M)
        return (m * CLUSTER + tk.cluster_rank(), n) if CLUSTER > 1 else (m, n)

    def load(task, k, a, b, sem):
        m, n = tile_of(task)
        tk.tma.load_async(a, A, (m, k), sem)
        if CLUSTER > 1:
            part = tk.cluster_rank()
            tk.tma.load_async(b.subtile(part, BN // CLUSTER), B, (n * CLUSTER + part, k), sem,
                              multicast=(1 << CLUSTER) - 1)
        else:
            tk.tma.load_async(b, B, (k, n) if B_KN else (n, k), sem)

    def setup(task, wg):
        return tk.zeros((WG_M, BN), f32, layout="row", scope="warpgroup")

    def compute(acc, wg, a, b):
        mma = tk.mma_AB if B_KN else tk.mma_ABt
        return mma(acc, a.subtile(wg, WG_M), b)

    def finish(acc, task, wg):
        m, n = tile_of(task)
        if TMA_STORE:
            out = acc.to(C.dtype)
            for h in tk.static_range(BN // EPI_N):
                tk.tma.store_wait(0)                 # the last store has read c_tiles[wg]
                tk.named_barrier(1 + wg, warps=4)
                tk.store(c_tiles[wg], out.slice(cols=(h * EPI_N, EPI_N)))
                tk.named_barrier(1 + wg, warps=4)    # all of it written
                if tk.elect_leader("warpgroup"):
                    tk.tma.store_async(C, c_tiles[wg], (2 * m + wg, n * (BN // EPI_N) + h))
                    tk.tma.store_commit()
        else:
            tk.store(C, acc.to(C.dtype), (2 * m + wg, n))

    tk.lcf(groups_m * tiles_n, tk.cdiv(K, BK), [(A.dtype, (BM, BK), 128), (A.dtype, b_tile, 128)],
           load, setup, compute, finish, stages=STAGES, cluster=CLUSTER)


def matmul(a, b, c=None, *, b_layout: str = "nk"):
    """C = A @ B.T (b_layout="nk": b is N x K) or C = A @ B ("kn": b is K x N).

    a: (M, K) and b: torch.bfloat16 or torch.float16 CUDA tensors of one dtype
    on one device. c: an (M, N) output of a 16-bit dtype or torch.float32 on
    their device, written in place; by default a new tensor of a's dtype.
    Returns c. The autotuned kernel picks a configuration per shape, dtype
    and layout on first use.

    Under torch.compile it runs as the custom op torch.ops.tk_mlir.matmul
    (tk_mlir/kernels/ops.py), traced as one node, its result copied into c;
    eager calls launch directly (the op's dispatch would add host time to
    every call)."""
    import torch
    check(a, b, c, b_layout)
    if not torch.compiler.is_compiling():
        if c is None:
            c = torch.empty(output_shape(a, b, b_layout), dtype=a.dtype, device=a.device)
        launch(a, b, c, b_layout)
        return c
    from tk_mlir.kernels import ops  # noqa: F401  registers torch.ops.tk_mlir on first use
    out = torch.ops.tk_mlir.matmul(a, b, b_layout, None if c is None else c.dtype)
    return out if c is None else c.copy_(out)


def check(a, b, c, b_layout: str) -> None:
    """The arguments of matmul, each rule with the argument that breaks it."""
    import torch
    if b_layout not in ("nk", "kn"):
        raise ValueError(f"matmul: b_layout must be 'nk' (b is N x K) or 'kn' (b is K x N), "
                         f"got {b_layout!r}")
    kn = b_layout == "kn"
    inputs = (torch.bfloat16, torch.float16)
    checks.tensor("matmul", "a", a, ndim=2, dtypes=inputs)
    checks.tensor("matmul", "b", b, ndim=2, dtypes=inputs)
    checks.like("matmul", "b", b, "a", a)
    M, K = a.shape
    N, Kb = (b.shape[1], b.shape[0]) if kn else b.shape
    if Kb != K:
        raise ValueError(f"matmul: inner dimensions differ: a is {tuple(a.shape)} (M x K), "
                         f"b is {tuple(b.shape)} ({'K x N' if kn else 'N x K'}, "
                         f"b_layout={b_layout!r})")
    if c is not None:
        checks.tensor("matmul", "c", c, ndim=2, dtypes=(*inputs, torch.float32))
        checks.like("matmul", "c", c, "a", a, dtype=False)
        checks.shape("matmul", "c", c, (M, N), "M x N")
    checks.on_cuda("matmul", "a", a)


def output_shape(a, b, b_layout: str) -> tuple[int, int]:
    """(M, N) of C for checked a, b."""
    return a.shape[0], (b.shape[1] if b_layout == "kn" else b.shape[0])


def launch(a, b, c, b_layout: str) -> None:
    """gemm_kernel on checked tensors, into c."""
    gemm_kernel[(num_sms(a.get_device()),)](a, b, c, B_KN=b_layout == "kn")
