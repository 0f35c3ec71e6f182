"""SwiGLU, fused: y = silu(a) * b = a / (1 + exp(-a)) * b, in one pass.

A 2-D grid of BM x BN tiles; tiles that run past the tensor's edge are
masked, so any (M, N) with 16-byte rows works. Math in f32, I/O in bf16.
(The library's swiglu walks a 1-D grid columns first instead, so blocks that
run together stream whole rows: 4.5% faster on large tensors, BENCHMARKS.md.)

No GPU? `swiglu_kernel.interpret[grid](a, b, y)` runs the kernel in the CPU
interpreter on CPU tensors, and under TK_MLIR_INTERPRET=1 `swiglu(a, b)` does.
"""
import torch

import tk_mlir as tk
from tk_mlir import bf16, f32


@tk.kernel(num_warps=4)
def swiglu_kernel(A: tk.gl[bf16], B: tk.gl[bf16], Y: tk.gl[bf16],
                  BM: tk.constexpr = 32, BN: tk.constexpr = 256):
    i, j = tk.block_id(0), tk.block_id(1)
    a = tk.load(A, (i, j), (BM, BN)).to(f32)
    b = tk.load(B, (i, j), (BM, BN)).to(f32)
    y = a / (1.0 + (-a).exp()) * b
    tk.store(Y, y.to(bf16), (i, j))


def swiglu(a: torch.Tensor, b: torch.Tensor, out=None, BM: int = 32, BN: int = 256):
    m, n = a.shape
    out = torch.empty_like(a) if out is None else out
    swiglu_kernel[(tk.cdiv(m, BM), tk.cdiv(n, BN))](a, b, out, BM=BM, BN=BN)
    return out
