"""matmul and scaled_matmul for Blackwell (sm_100a): tcgen05 into tensor memory.

Never run on Blackwell hardware: ptxas, nvdisasm and the interpreter are its
only checks (tests/test_blackwell_gemm.py). `matmul` / `scaled_matmul`
launch it on a compute capability 10.0 device.

A persistent, warp-specialized kernel of 8 warps; each role loops over the
block's output tiles (BM x BN, L2-grouped) in the same order:
  warp 0, one thread   TMA producer: A and B tiles into a ring of STAGES
                       shared stages (`full` completes when a stage lands);
  warp 1, one thread   MMA issuer: waits for a stage, issues its tcgen05.mma
                       into the tile's accumulator, and commits onto the
                       stage's `empty` semaphore (the stage is free once the
                       MMA has read it); after the last K step it commits
                       onto the accumulator's `acc_full`;
  warps 4-7            epilogue warpgroup: waits for `acc_full`, reads the
                       accumulator EPI_N columns at a time (tcgen05.ld: warp w
                       reads lanes 32w..), scales, converts and stores them
                       (masked past M and N), then frees it (`acc_empty`:
                       every epilogue thread arrives after its own reads).
Two accumulators of BN columns (2 x 256 = all of tensor memory) alternate
between tiles, so the epilogue of one tile overlaps the MMAs of the next.
M, N and K need not be multiples of the tiles: TMA reads zeros past the
edges and the stores are masked.
"""
from __future__ import annotations

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels.device import num_sms

ARCH = "sm_100a"


@tk.kernel(num_warps=8, target=ARCH)
def blackwell_gemm_kernel(A: tk.gl, B: tk.gl, C: tk.gl, SA: tk.gl, SB: tk.gl,
                          B_KN: tk.constexpr = False, SCALED: tk.constexpr = False,
                          COL_SCALE: tk.constexpr = False, BM: tk.constexpr = 128,
                          BN: tk.constexpr = 256, BK: tk.constexpr = 64,
                          STAGES: tk.constexpr = 4, GROUP_M: tk.constexpr = 8,
                          EPI_N: tk.constexpr = 64):
    """C = A @ B.T (B: N x K), or A @ B (B_KN: K x N); SCALED: times SA (f32,
    one scale per row of A) and, with COL_SCALE, SB (f32, one per column of
    B). Unscaled, SA and SB are not read (any tensor stands in)."""
    M, K = A.shape
    N = B.shape[1] if B_KN else B.shape[0]
    tiles_m, tiles_n = tk.cdiv(M, BM), tk.cdiv(N, BN)
    tiles, k_steps = tiles_m * tiles_n, tk.cdiv(K, BK)
    a = tk.shared_tiles(A.dtype, (BM, BK), STAGES, swizzle=128)
    b = tk.shared_tiles(B.dtype, (BK, BN) if B_KN else (BN, BK), STAGES, swizzle=128)
    full, empty = tk.semaphores(STAGES), tk.semaphores(STAGES)
    acc_full, acc_empty = tk.semaphores(2), tk.semaphores(2, arrivals=128)
    accumulators = tk.tensor_tile(f32, (BM, 2 * BN))
    first, step = tk.block_id(0), tk.grid_dim(0)
    warp = tk.warp_id()

    if warp == 0:                                    # TMA producer
        if tk.elect_leader():
            i = 0
            for task in range(first, tiles, step):
                m, n = tk.grouped_tile(task, tiles_m, tiles_n, GROUP_M)
                for k in range(k_steps):
                    s = i % STAGES
                    tk.wait(empty[s], tk.ring_phase(i, STAGES) ^ 1)
                    tk.tma.expect(full[s], a[s], b[s])
                    tk.tma.load_async(a[s], A, (m, k), full[s])
                    tk.tma.load_async(b[s], B, (k, n) if B_KN else (n, k), full[s])
                    i += 1
    elif warp == 1:                                  # MMA issuer
        if tk.elect_leader():
            i, j = 0, 0
            for task in range(first, tiles, step):
                tk.wait(acc_empty[j % 2], tk.ring_phase(j, 2) ^ 1)
                acc = accumulators.columns((j % 2) * BN, BN)
                for k in range(k_steps):
                    s = i % STAGES
                    tk.wait(full[s], tk.ring_phase(i, STAGES))
                    if B_KN:
                        tk.mma_AB(acc, a[s], b[s], accumulate=k > 0)
                    else:
                        tk.mma_ABt(acc, a[s], b[s], accumulate=k > 0)
                    tk.mma_commit(empty[s])
                    i += 1
                tk.mma_commit(acc_full[j % 2])
                j += 1
    elif warp >= 4:                                  # epilogue warpgroup
        j = 0
        for task in range(first, tiles, step):
            m, n = tk.grouped_tile(task, tiles_m, tiles_n, GROUP_M)
            tk.wait(acc_full[j % 2], tk.ring_phase(j, 2))
            for e in tk.static_range(BN // EPI_N):
                part = tk.load(accumulators.columns((j % 2) * BN + e * EPI_N, EPI_N))
                if SCALED:
                    part = part.mul_row(tk.load(SA, (m,), (BM,), scope="warpgroup"))
                    if COL_SCALE:
                        col = n * (BN // EPI_N) + e
                        part = part.mul_col(tk.load(SB, (col,), (EPI_N,), scope="warpgroup"))
                tk.store(C, part.to(C.dtype), (m, n * (BN // EPI_N) + e))
            tk.arrive(acc_empty[j % 2])              # every thread, after its own reads
            j += 1
    tk.free_tensor_tile(accumulators)


def configuration(dtype) -> dict:
    """The tiles for an operand dtype: K steps of 128 bytes (the swizzle)."""
    import torch
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return dict(BK=128 if fp8 else 64, STAGES=3 if fp8 else 4)


def launch(a, b, c, b_layout: str) -> None:
    """C = A @ B.T ("nk") or A @ B ("kn") into c, for checked 2-D tensors."""
    if not (a.shape[0] and c.shape[1]):
        return
    if not a.shape[1]:
        c.zero_()                                    # a sum of no products
        return
    kn = b_layout == "kn"
    grid = (min(num_sms(a.get_device()), _tiles(a, c)),)
    blackwell_gemm_kernel[grid](a, b, c, c, c, B_KN=kn, **configuration(a.dtype))


def launch_scaled(a, b, scale_a, scale_b, out_dtype):
    """scaled_matmul's product on checked tensors (b: K x N, column-major),
    into a new tensor."""
    import torch
    from tk_mlir.kernels.scaled_gemm import scale_vectors
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if not (M and N and K):
        return c.zero_()
    rows, cols = scale_vectors(scale_a, scale_b, M, N)
    grid = (min(num_sms(a.get_device()), _tiles(a, c)),)
    blackwell_gemm_kernel[grid](a, b.t(), c, rows, rows if cols is None else cols,
                                SCALED=True, COL_SCALE=cols is not None, **configuration(a.dtype))
    return c


def _tiles(a, c, bm: int = 128, bn: int = 256) -> int:
    return max(1, -(-a.shape[0] // bm) * -(-c.shape[1] // bn))
