"""Calling the library's LayerNorm, and reading its source.

    python examples/layernorm.py       # compile (and, with a GPU, check it)
    TK_MLIR_INTERPRET=1 python examples/layernorm.py   # no GPU: check it in the CPU interpreter

`tk_mlir.kernels.layer_norm(x, weight, bias, eps=1e-5)` is
torch.nn.functional.layer_norm over the last dimension of a (rows, D) bf16
tensor. Its kernel, `layernorm_kernel` in tk_mlir/kernels/norms.py, is
persistent: a few blocks per SM walk the rows, each loading the next row
while it normalises the current one, so memory always has a row in flight.

Without a GPU the kernel still compiles to PTX, which main() shows first;
under TK_MLIR_INTERPRET=1 the CPU interpreter then runs it on small CPU
tensors and checks it.
"""
import tk_mlir as tk
from tk_mlir import bf16
from tk_mlir.kernels import layer_norm
from tk_mlir.kernels.norms import layernorm_kernel

from helpers import check_on      # the GPU, the interpreter or neither


def main() -> None:
    rows, d = 4096, 4096
    row, vec = tk.spec((rows, d), bf16), tk.spec((d,), bf16)
    compiled = layernorm_kernel.compile(row, vec, vec, row, 1e-5, BLOCK=d)
    print(compiled.info)
    device = check_on(__file__)
    if device is None:                      # no GPU: compiled only
        return
    if device == "cpu":                     # the CPU interpreter: small shapes
        rows, d = 16, 1024
    import torch
    x = torch.randn(rows, d, dtype=torch.bfloat16, device=device)
    w, b = (torch.randn(d, dtype=torch.bfloat16, device=device) for _ in range(2))
    y = layer_norm(x, w, b)
    ref = torch.nn.functional.layer_norm(x.float(), (d,), w.float(), b.float(), 1e-5)
    print(f"{rows}x{d} on {device}: rel. error vs float32:",
          ((y.float() - ref).norm() / ref.norm()).item())


if __name__ == "__main__":
    main()
