"""Calling the library's RMSNorm, and reading its source.

    python examples/rmsnorm.py         # compile (and, with a GPU, check it)
    TK_MLIR_INTERPRET=1 python examples/rmsnorm.py   # no GPU: check it in the CPU interpreter

`tk_mlir.kernels.rms_norm(x, weight, eps=1e-6)` computes
y = x / sqrt(mean(x^2) + eps) * weight per row of a (rows, D) bf16 tensor.
Its kernel, `rmsnorm_kernel` in tk_mlir/kernels/norms.py, is seven lines:
one row per block, the row a 1 x BLOCK register tile over 8 warps, so the
row sum is a register sum, 5 shuffles and one exchange through shared memory.

Without a GPU the kernel still compiles to PTX, which main() shows first;
under TK_MLIR_INTERPRET=1 the CPU interpreter then runs it on small CPU
tensors and checks it.
"""
import tk_mlir as tk
from tk_mlir import bf16
from tk_mlir.kernels import rms_norm
from tk_mlir.kernels.norms import rmsnorm_kernel

from helpers import check_on      # the GPU, the interpreter or neither


def main() -> None:
    rows, d = 4096, 4096
    compiled = rmsnorm_kernel.compile(tk.spec((rows, d), bf16), tk.spec((d,), bf16),
                                      tk.spec((rows, d), bf16), 1e-6, BLOCK=d)
    print(compiled.info)
    device = check_on(__file__)
    if device is None:                      # no GPU: compiled only
        return
    if device == "cpu":                     # the CPU interpreter: small shapes
        rows, d = 16, 1024
    import torch
    x = torch.randn(rows, d, dtype=torch.bfloat16, device=device)
    w = torch.randn(d, dtype=torch.bfloat16, device=device)
    y = rms_norm(x, w)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    print(f"{rows}x{d} on {device}: rel. error vs float32:",
          ((y.float() - ref).norm() / ref.norm()).item())


if __name__ == "__main__":
    main()
