"""Calling the library's attention forward, and reading its source.

    python examples/attention.py       # compile (and, with a GPU, check it)
    TK_MLIR_INTERPRET=1 python examples/attention.py   # no GPU: check it in the CPU interpreter

`tk_mlir.kernels.attention(q, k, v, causal=False, scale=None, return_lse=False)`
is FlashAttention-3-style multi-head attention on (B, H, N, D) bf16/f16 torch
tensors: D = 64, 128 (or 256), any N, causal (bottom-right aligned) or not,
fewer K/V heads (GQA/MQA), strided (B, N, H, D) views. Its kernel,
`attention_kernel` in tk_mlir/kernels/flash_attention.py, is one tk_mlir
function: a producer warpgroup filling Q, K and V rings (`tk.ring`: slots,
semaphores and phases in one object) with TMA, consumer warpgroups doing the
online softmax between two wgmma products, P·V with P straight from
registers, a named-barrier ping-pong between the consumers, and masks
(`tk.where` on `S.col_indices()`) only in the blocks that need them.

Without a GPU the kernel still compiles: main() shows its PTX/SASS facts;
under TK_MLIR_INTERPRET=1 the CPU interpreter then runs it on small CPU
tensors and checks it.
"""
import math

import tk_mlir as tk
from tk_mlir.kernels import attention
from tk_mlir.kernels.flash_attention import _config, attention_kernel

from helpers import check_on      # the GPU, the interpreter or neither

def main() -> None:
    B, H, N, D = 4, 16, 4096, 128
    cfg = _config(D)
    q = tk.spec((B, H, N, D), tk.bf16)
    compiled = attention_kernel.compile(q, q, q, q, tk.spec((B, H, N), tk.f32),
                                        tk.spec((1024,), "i32"), 0.1, D=D,
                                        CAUSAL=True, num_warps=4 * (cfg["CONSUMERS"] + 1),
                                        **cfg)
    print(compiled.info)
    sass = compiled.asm["sass"]
    print("HGMMA:", sass.count("HGMMA"), " MUFU.EX2:", sass.count("MUFU.EX2"), " FFMA:",
          sass.count("FFMA"), " BAR.ARV:", sass.count("BAR.ARV"))
    device = check_on(__file__)
    if device is None:
        return
    if device == "cpu":
        B, H, N = 1, 2, 256              # the CPU interpreter (a few s): small shapes
    import torch
    q, k, v = (torch.randn(B, H, N, D, dtype=torch.bfloat16, device=device) for _ in range(3))
    o, lse = attention(q, k, v, causal=True, return_lse=True)
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool, device=device).triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ v.float()
    err = ((o.float() - ref).norm() / ref.norm()).item()
    lse_err = (lse - torch.logsumexp(s, -1)).abs().max().item()
    print(f"{B}x{H}x{N}x{D} on {device}: rel. error vs float32:", err,
          " LSE max abs error:", lse_err)
    assert err < 1e-2 and lse_err < 1e-3, "attention disagrees with the float32 reference"


if __name__ == "__main__":
    main()
