"""GEMM configs side by side with hot inputs (a quick look, not the protocol):
tk_mlir.kernels' GEMM kernel under several constexpr configs, clusters included,
against torch.matmul (cuBLAS) on the same tensors, 10 warm-up and 50 timed
launches between two CUDA events, inputs resident in L2.

    python3 benchmarks/gemm_configs.py            # on the GPU machine

benchmarks/gemm.py is the measurement of record (L2-evicting inputs, 500
warm-up launches, Triton too); this one is for choosing configs quickly.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import protocol as P  # noqa: E402

from tk_mlir.kernels.gemm import gemm_kernel  # noqa: E402

CONFIGS = [dict(), dict(GROUP_M=16), dict(STAGES=3, EPI_N=256), dict(BN=128, STAGES=6),
           dict(TMA_STORE=False), dict(CLUSTER=2)]


def hot_ms(fn, warmup: int = 10, iters: int = 50) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    P.require_cuda("benchmarks/gemm_configs.py")
    kernel = gemm_kernel.kernel
    for n in (4096, 8192):
        a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
        rows = [("cublas A·Bᵀ", hot_ms(lambda: torch.matmul(a, b.T, out=c)))]
        for cfg in CONFIGS:
            grid = kernel.compile(a, b, c, **cfg).persistent_grid()
            rows.append((f"tk {cfg or 'default'}", hot_ms(lambda: kernel[(grid,)](a, b, c, **cfg))))
        for name, ms in rows:
            print(f"{n}³ {name}: {ms:.3f} ms, {P.tflops(2 * n ** 3, ms):.0f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
