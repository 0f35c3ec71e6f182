"""Calling the library's Hopper GEMM, and reading its source.

    python examples/gemm.py            # compile (and, with a GPU, check it)
    TK_MLIR_INTERPRET=1 python examples/gemm.py   # no GPU: check it in the CPU interpreter

`tk_mlir.kernels.gemm` computes C = A @ B.T (B given as N x K, the layout
of a Linear weight) or C = A @ B (b_layout="kn", B given as K x N) on bf16 or
f16 torch tensors, accumulating in f32. Its kernel, `gemm_kernel`, is ~70
lines of tk_mlir in tk_mlir/kernels/gemm.py: TMA loads into a ring of
swizzled shared tiles, wgmma on two consumer warpgroups fed by a producer
warpgroup, a persistent grid. Open that file to read it; copy it to change it.

Without a GPU the kernel still compiles: `.compile` with tk.spec shapes gives
the PTX and SASS, which is what main() shows first; under TK_MLIR_INTERPRET=1
the CPU interpreter then runs it on small CPU tensors and checks it.
"""
import tk_mlir as tk
from tk_mlir.kernels import matmul
from tk_mlir.kernels.gemm import gemm_kernel

from helpers import check_on      # the GPU, the interpreter or neither

def main() -> None:
    M = N = K = 4096
    spec = tk.spec((M, K), tk.bf16)
    # gemm_kernel is autotuned over a few configs; config=0 compiles the first.
    compiled = gemm_kernel.compile(spec, spec, spec, config=0)
    print(compiled.info)
    sass = compiled.asm["sass"]
    print("HGMMA:", sass.count("HGMMA"), " UTMALDG:", sass.count("UTMALDG"))
    device = check_on(__file__)
    if device is None:
        return
    if device == "cpu":
        M, N, K = 128, 256, 256          # the CPU interpreter (~1 s): small shapes
    import torch
    a = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    b = torch.randn(N, K, dtype=torch.bfloat16, device=device)
    c = matmul(a, b)                         # C = A @ B.T
    ref = a.float() @ b.float().T
    print(f"{M}x{N}x{K} on {device}: rel. error vs float32:",
          ((c.float() - ref).norm() / ref.norm()).item())


if __name__ == "__main__":
    main()
