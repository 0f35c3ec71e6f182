"""RMSNorm forward: y = x / sqrt(mean(x^2) + eps) * weight, one row per block.

A row is one 1 x BLOCK register tile spread over the block's 8 warps (each
thread holds BLOCK / 256 elements, 8 contiguous at a time: 16-byte loads), so
the row sum is a register sum, 5 shuffles and one exchange through shared
memory. Rows of any width D: columns past D read as 0 and are not written.
"""
import torch

import tk_mlir as tk
from tk_mlir import bf16, f32


@tk.kernel(num_warps=8)
def rmsnorm_kernel(X: tk.gl[bf16], W: tk.gl[bf16], Y: tk.gl[bf16], eps: float,
                   BLOCK: tk.constexpr):
    row = tk.block_id(0)
    x = tk.load(X, (row, 0), (1, BLOCK)).to(f32)
    w = tk.load(W, (0,), (BLOCK,)).to(f32)
    inv_rms = ((x * x).row_sum() * (1.0 / float(X.shape[1])) + eps).rsqrt()
    y = x.mul_row(inv_rms).mul_col(w)
    tk.store(Y, y.to(bf16), (row, 0))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out=None) -> torch.Tensor:
    """x: (rows, D) bf16, weight: (D,) bf16."""
    rows, d = x.shape
    out = torch.empty_like(x) if out is None else out
    block = max(256, 1 << (d - 1).bit_length())
    rmsnorm_kernel[(rows,)](x, weight, out, eps, BLOCK=block)
    return out
