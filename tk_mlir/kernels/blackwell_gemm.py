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
Batches (3-D tensors) and A given as K x M (the gradients' dB) are the same
kernel: the task picks the product, the MMA reads A transposed.
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
                          BM: tk.constexpr = 128,
                          BN: tk.constexpr = 256, BK: tk.constexpr = 64,
                          STAGES: tk.constexpr = 4, GROUP_M: tk.constexpr = 8,
                          EPI_N: tk.constexpr = 64, A_KM: tk.constexpr = False):
    """C = A @ B.T (B: N x K), or A @ B (B_KN: K x N); A given as K x M with
    A_KM (a gradient's product: C = A.T @ ...); 3-D A, B and C: one product
    per index of their first dim. SCALED (2-D): times SA and SB (f32), each
    one value (a 0-d tensor) or a vector: SA one per row of A, SB one per
    column of B (scaled_gemm.scale_operands). Unscaled, SA and SB are not
    read (any tensor stands in)."""
    batched = len(A.shape) == 3
    M, K = (A.shape[-1], A.shape[-2]) if A_KM else (A.shape[-2], A.shape[-1])
    N = B.shape[-1] if B_KN else B.shape[-2]
    tiles_m, tiles_n = tk.cdiv(M, BM), tk.cdiv(N, BN)
    per_product, k_steps = tiles_m * tiles_n, tk.cdiv(K, BK)
    tiles = per_product * (A.shape[0] if batched else 1)
    a = tk.shared_tiles(A.dtype, (BK, BM) if A_KM else (BM, BK), STAGES, swizzle=128)
    b = tk.shared_tiles(B.dtype, (BK, BN) if B_KN else (BN, BK), STAGES, swizzle=128)
    full, empty = tk.semaphores(STAGES), tk.semaphores(STAGES)
    acc_full, acc_empty = tk.semaphores(2), tk.semaphores(2, arrivals=128)
    accumulators = tk.tensor_tile(f32, (BM, 2 * BN))
    first, step = tk.block_id(0), tk.grid_dim(0)
    warp = tk.warp_id()

    def tile_of(task):
        """(outer coordinates, m, n) of a task's output tile."""
        outer = (task // per_product,) if batched else ()
        m, n = tk.grouped_tile(task % per_product, tiles_m, tiles_n, GROUP_M)
        return outer, m, n

    if warp == 0:                                    # TMA producer
        if tk.elect_leader():
            i = 0
            for task in range(first, tiles, step):
                outer, m, n = tile_of(task)
                for k in range(k_steps):
                    s = i % STAGES
                    tk.wait(empty[s], tk.ring_phase(i, STAGES) ^ 1)
                    tk.tma.expect(full[s], a[s], b[s])
                    tk.tma.load_async(a[s], A, (*outer, k, m) if A_KM else (*outer, m, k),
                                      full[s])
                    tk.tma.load_async(b[s], B, (*outer, k, n) if B_KN else (*outer, n, k),
                                      full[s])
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
                    mma = ((tk.mma_AtB if B_KN else tk.mma_AtBt) if A_KM else
                           (tk.mma_AB if B_KN else tk.mma_ABt))
                    mma(acc, a[s], b[s], accumulate=k > 0)
                    tk.mma_commit(empty[s])
                    i += 1
                tk.mma_commit(acc_full[j % 2])
                j += 1
    elif warp >= 4:                                  # epilogue warpgroup
        j = 0
        for task in range(first, tiles, step):
            outer, m, n = tile_of(task)
            tk.wait(acc_full[j % 2], tk.ring_phase(j, 2))
            for e in tk.static_range(BN // EPI_N):
                part = tk.load(accumulators.columns((j % 2) * BN + e * EPI_N, EPI_N))
                if SCALED:
                    if len(SA.shape) > 0:
                        part = part.mul_row(tk.load(SA, (m,), (BM,), scope="warpgroup"))
                    else:
                        part = part * tk.load(SA, ())
                    if len(SB.shape) > 0:
                        col = n * (BN // EPI_N) + e
                        part = part.mul_col(tk.load(SB, (col,), (EPI_N,), scope="warpgroup"))
                    else:
                        part = part * tk.load(SB, ())
                tk.store(C, part.to(C.dtype), (*outer, m, n * (BN // EPI_N) + e))
            tk.arrive(acc_empty[j % 2])              # every thread, after its own reads
            j += 1
    tk.free_tensor_tile(accumulators)


def configuration(dtype) -> dict:
    """The tiles for an operand dtype: K steps of 128 bytes (the swizzle)."""
    import torch
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return dict(BK=128 if fp8 else 64, STAGES=3 if fp8 else 4)


def launch(a, b, c, b_layout: str, a_layout: str = "mk") -> None:
    """C = A @ B.T ("nk") or A @ B ("kn") into c for checked tensors (3-D: a
    batch); a_layout="km": a is given as K x M."""
    km = a_layout == "km"
    K = a.shape[-2] if km else a.shape[-1]
    if not c.numel():
        return
    if not K:
        c.zero_()                                    # a sum of no products
        return
    tiles = c.numel() // (c.shape[-2] * c.shape[-1]) * _tiles(c.shape[-2], c.shape[-1])
    grid = (min(num_sms(a.get_device()), tiles),)
    blackwell_gemm_kernel[grid](a, b, c, c, c, B_KN=b_layout == "kn", A_KM=km,
                                **configuration(a.dtype))


def launch_scaled(a, b, scale_a, scale_b, out_dtype):
    """scaled_matmul's product on checked tensors (b: K x N, column-major),
    into a new tensor."""
    import torch
    from tk_mlir.kernels.scaled_gemm import scale_operands
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if not (M and N and K):
        return c.zero_()
    grid = (min(num_sms(a.get_device()), _tiles(M, N)),)
    blackwell_gemm_kernel[grid](a, b.t(), c, *scale_operands(scale_a, scale_b), SCALED=True,
                                **configuration(a.dtype))
    return c


def _tiles(m: int, n: int, bm: int = 128, bn: int = 256) -> int:
    """Output tiles of one (m, n) product."""
    return max(1, -(-m // bm) * -(-n // bn))
