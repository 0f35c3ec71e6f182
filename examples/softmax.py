"""Row softmax: y[i] = exp(x[i] - max(x[i])) / sum(exp(x[i] - max(x[i]))).

ROWS rows per block, each row one warp's slice of a ROWS x BLOCK tile, so
both reductions stay inside a warp (shuffles only) up to 2048 columns; wider
rows take a whole block each (ROWS = 1) and their reductions add one
exchange through shared memory. Columns past the row's
end read as -inf, whose exp is 0: they drop out of the max and the sum.
Rows past the tensor's end are masked too, so any (M, N) works.

No GPU? `softmax_kernel.interpret[grid](x, y, ...)` runs the kernel in the CPU
interpreter on CPU tensors, and under TK_MLIR_INTERPRET=1 `softmax(x)` does.
"""
import torch

import tk_mlir as tk
from tk_mlir import f32


@tk.kernel(num_warps=4)
def softmax_kernel(X: tk.gl[f32], Y: tk.gl[f32], ROWS: tk.constexpr, BLOCK: tk.constexpr):
    tile = tk.block_id(0)
    x = tk.load(X, (tile, 0), (ROWS, BLOCK), fill=float("-inf"))
    e = x.sub_row(x.row_max()).exp()
    tk.store(Y, e.div_row(e.row_sum()), (tile, 0))


def softmax(x: torch.Tensor, out=None) -> torch.Tensor:
    """x: (M, N) float32, softmax over the last dim."""
    m, n = x.shape
    out = torch.empty_like(x) if out is None else out
    block = max(32, 1 << (n - 1).bit_length())
    rows = 4 if block <= 2048 else 1
    softmax_kernel[(tk.cdiv(m, rows),)](x, out, ROWS=rows, BLOCK=block)
    return out
