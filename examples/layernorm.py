"""LayerNorm forward: y = (x - mean) / sqrt(var + eps) * weight + bias, one row per block.

Rows of any width D: the tile is BLOCK = next power of two >= D columns wide
and the columns past D read as 0 (masked loads) and are never written
(masked stores). The variance subtracts the padding's share exactly:
sum((x - mean)^2) over the tile counts (BLOCK - D) * mean^2 too many.
"""
import torch

import tk_mlir as tk
from tk_mlir import bf16, f32


@tk.kernel(num_warps=8)
def layernorm_kernel(X: tk.gl[bf16], W: tk.gl[bf16], B: tk.gl[bf16], Y: tk.gl[bf16],
                     eps: float, BLOCK: tk.constexpr):
    row = tk.block_id(0)
    d = float(X.shape[1])
    x = tk.load(X, (row, 0), (1, BLOCK)).to(f32)
    mean = x.row_sum() * (1.0 / d)
    xc = x.sub_row(mean)
    var = ((xc * xc).row_sum() - (BLOCK - d) * mean * mean) * (1.0 / d)
    rstd = (var + eps).rsqrt()
    w = tk.load(W, (0,), (BLOCK,)).to(f32)
    b = tk.load(B, (0,), (BLOCK,)).to(f32)
    y = xc.mul_row(rstd).mul_col(w).add_col(b)
    tk.store(Y, y.to(bf16), (row, 0))


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
              out=None) -> torch.Tensor:
    """x: (rows, D) bf16; weight, bias: (D,) bf16."""
    rows, d = x.shape
    out = torch.empty_like(x) if out is None else out
    block = max(256, 1 << (d - 1).bit_length())
    layernorm_kernel[(rows,)](x, weight, bias, out, eps, BLOCK=block)
    return out
