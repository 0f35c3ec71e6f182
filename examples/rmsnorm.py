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
import os

import tk_mlir as tk
from tk_mlir import bf16
from tk_mlir.kernels import rms_norm
from tk_mlir.kernels.norms import rmsnorm_kernel


def main() -> None:
    from tk_mlir.runtime import driver
    rows, d = 4096, 4096
    compiled = rmsnorm_kernel.compile(tk.spec((rows, d), bf16), tk.spec((d,), bf16),
                                      tk.spec((rows, d), bf16), 1e-6, BLOCK=d)
    print(compiled.info)
    if interpreting():
        device, rows, d = "cpu", 16, 1024      # the CPU interpreter: small shapes
    elif driver.has_gpu():
        device = "cuda"
    else:
        print("no GPU here: compiled only; run on a Hopper GPU to check it against torch, "
              "or check it in the CPU interpreter:\n"
              "  TK_MLIR_INTERPRET=1 python examples/rmsnorm.py")
        return
    import torch
    x = torch.randn(rows, d, dtype=torch.bfloat16, device=device)
    w = torch.randn(d, dtype=torch.bfloat16, device=device)
    y = rms_norm(x, w)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    print(f"{rows}x{d} on {device}: rel. error vs float32:",
          ((y.float() - ref).norm() / ref.norm()).item())


def interpreting() -> bool:
    """TK_MLIR_INTERPRET=1: every launch runs in the CPU interpreter, and the
    library takes CPU tensors."""
    return os.environ.get("TK_MLIR_INTERPRET", "") not in ("", "0")


if __name__ == "__main__":
    main()
