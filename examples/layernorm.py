"""LayerNorm forward: y = (x - mean) / sqrt(var + eps) * weight + bias.

Persistent: a grid of a few blocks per SM, each walking rows first, first +
grid, ... and loading the *next* row before normalising the current one, so
the memory system always has a row in flight per block (the loop carries the
prefetched row as a bf16 register tile). A row is one 1 x BLOCK tile spread
over the block's 8 warps; its two reductions (mean, then the centred sum of
squares: two passes, numerically safe) each cost one shared-memory exchange.

Rows of any width D: BLOCK = next power of two >= D; the columns past D read
as 0 and are not written. sum((x - mean)^2) over the tile then counts
(BLOCK - D) * mean^2 too many, which is subtracted exactly.
"""
import functools

import torch

import tk_mlir as tk
from tk_mlir import bf16, f32


@tk.kernel(num_warps=8)
def layernorm_kernel(X: tk.gl[bf16], W: tk.gl[bf16], B: tk.gl[bf16], Y: tk.gl[bf16],
                     eps: float, BLOCK: tk.constexpr, RELOAD_WB: tk.constexpr = False):
    first, step = tk.block_id(0), tk.grid_dim(0)
    d = float(X.shape[1])
    w = tk.load(W, (0,), (BLOCK,))
    b = tk.load(B, (0,), (BLOCK,))
    nxt = tk.load(X, (first, 0), (1, BLOCK))
    for row in range(first, X.shape[0], step):
        x = nxt.to(f32)
        nxt = tk.load(X, (row + step, 0), (1, BLOCK))     # past the last row: masked
        mean = x.row_sum() * (1.0 / d)
        xc = x.sub_row(mean)
        var = ((xc * xc).row_sum() - (BLOCK - d) * mean * mean) * (1.0 / d)
        if RELOAD_WB:    # wide rows: re-read w, b (L1 hits) rather than hold them in registers
            w = tk.load(W, (0,), (BLOCK,))
            b = tk.load(B, (0,), (BLOCK,))
        y = xc.mul_row((var + eps).rsqrt()).mul_col(w.to(f32)).add_col(b.to(f32))
        tk.store(Y, y.to(bf16), (row, 0))


@functools.cache
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
              out=None) -> torch.Tensor:
    """x: (rows, D) bf16; weight, bias: (D,) bf16."""
    rows, d = x.shape
    out = torch.empty_like(x) if out is None else out
    block = max(256, 1 << (d - 1).bit_length())
    sms = _sm_count(x.device.index)
    # Measured on H200 (BENCHMARKS.md): 3 blocks/SM for 4096-wide rows, 2 above.
    grid = min(rows, (3 if block <= 4096 else 2) * sms)
    layernorm_kernel[(grid,)](x, weight, bias, out, eps, BLOCK=block, RELOAD_WB=block > 4096)
    return out
