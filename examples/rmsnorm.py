"""RMSNorm forward: y = x / sqrt(mean(x^2) + eps) * weight, one row per block.

A row of D elements is one 1 x D register tile spread over the block's warps
(each thread holds D / (32 * num_warps) elements, 8 contiguous at a time), so
the row sum is a register sum, 5 shuffles and one exchange through shared
memory. Rows are independent: grid = number of rows.
"""
import torch

import tk_mlir as tk
from tk_mlir import bf16, f32


@tk.kernel(num_warps=8)
def rmsnorm_kernel(X: tk.gl[bf16], W: tk.gl[bf16], Y: tk.gl[bf16], eps: float,
                   D: tk.constexpr):
    row = tk.block_id(0)
    x = tk.load(X, (row, 0), (1, D)).to(f32)
    w = tk.load(W, (0,), (D,)).to(f32)
    inv_rms = ((x * x).row_sum() * (1.0 / D) + eps).rsqrt()
    y = x.mul_row(inv_rms).mul_col(w)
    tk.store(Y, y.to(bf16), (row, 0))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out=None) -> torch.Tensor:
    """x: (rows, D) bf16, weight: (D,) bf16."""
    rows, d = x.shape
    out = torch.empty_like(x) if out is None else out
    rmsnorm_kernel[(rows,)](x, weight, out, eps, D=d)
    return out
