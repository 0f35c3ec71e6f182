"""Decoding over a paged KV cache with the library's attention_with_kvcache.

    python examples/paged_decode.py       # compile (and, with a GPU, run and check it)
    TK_MLIR_INTERPRET=1 python examples/paged_decode.py   # no GPU: the CPU interpreter

A serving engine keeps each sequence's keys and values in fixed-size pages
drawn from one pool, and a block table per sequence lists its pages in order
(vLLM's PagedAttention layout). `attention_with_kvcache(q, k_pages, v_pages,
cache_seqlens, block_table=table, k=k, v=v)` writes the new tokens' k and v
into their pages, then attends over every sequence's keys, with no host
synchronisation: the lengths and the table are read on the GPU. Its kernel,
`kv_cache_attention_kernel` in tk_mlir/kernels/decode_attention.py, packs the
query heads that share a K/V head into one tile's rows and splits each
sequence's keys over the SMs; a page smaller than its key block arrives as
one TMA load per page (into a row block of the shared tile).

Here: a pool of shuffled 16-key pages, three sequences of different lengths,
two decode steps, checked against float32 attention over the same keys
gathered densely.
"""
import math

import tk_mlir as tk
from tk_mlir.kernels import attention_with_kvcache
from tk_mlir.kernels.decode_attention import _config, kv_cache_attention_kernel

from helpers import check_on      # the GPU, the interpreter or neither


def main() -> None:
    B, H, H_KV, D, PAGE, MAX_PAGES = 3, 8, 2, 128, 16, 64
    cfg = _config(D, PAGE)
    compiled = kv_cache_attention_kernel.compile(
        tk.spec((B, H_KV, H // H_KV, D), tk.bf16), tk.spec((B * MAX_PAGES, H_KV, PAGE, D), tk.bf16),
        tk.spec((B * MAX_PAGES, H_KV, PAGE, D), tk.bf16),
        tk.spec((B * H_KV, 4, H // H_KV, D), tk.f32), tk.spec((B * H_KV, 4, 4), tk.f32),
        tk.spec((4,), "i32"), tk.spec((B, MAX_PAGES), "i32"),
        tk.spec((B, H_KV, H // H_KV, D), tk.bf16), tk.spec((B, H_KV, 4), tk.f32), tk.spec((4,), "i32"),
        0.1, 1, H // H_KV, 1024, -1, 0, 1.0,
        D=D, PAGE=PAGE, **cfg)
    print(compiled.info)
    device = check_on(__file__)
    if device is None:
        return
    import torch
    if device == "cpu":
        MAX_PAGES = 8                    # the CPU interpreter: a short cache
    g = torch.Generator().manual_seed(0)
    pool = B * MAX_PAGES
    k_pages = torch.randn(pool, PAGE, H_KV, D, generator=g).to(torch.bfloat16).to(device)
    v_pages = torch.randn(pool, PAGE, H_KV, D, generator=g).to(torch.bfloat16).to(device)
    table = torch.randperm(pool, generator=g).view(B, MAX_PAGES).int().to(device)
    lens = torch.tensor([PAGE * MAX_PAGES // 2, 5, PAGE * 3 + 1], dtype=torch.int32,
                        device=device)
    for step in range(2):
        q = torch.randn(B, 1, H, D, generator=g).to(torch.bfloat16).to(device)
        k = torch.randn(B, 1, H_KV, D, generator=g).to(torch.bfloat16).to(device)
        v = torch.randn(B, 1, H_KV, D, generator=g).to(torch.bfloat16).to(device)
        o = attention_with_kvcache(q, k_pages, v_pages, lens, block_table=table, k=k, v=v)
        lens += 1                                # the engine's bookkeeping: one more key each
        err = max(_error(o[b], q[b], k_pages, v_pages, table[b], int(lens[b]))
                  for b in range(B))
        print(f"step {step}, B={B} H={H}/{H_KV} D={D} pages of {PAGE} on {device}: "
              f"rel. error vs float32: {err}")
        assert err < 1e-2, "attention_with_kvcache disagrees with the float32 reference"


def _error(o, q, k_pages, v_pages, pages, n: int) -> float:
    """o (1, H, D) against float32 attention of q over the sequence's n keys."""
    import torch
    rows = (pages.long()[:, None] * k_pages.shape[1] + torch.arange(k_pages.shape[1],
                                                                    device=o.device)).flatten()[:n]
    k = k_pages.flatten(0, 1)[rows].float()      # (n, H_kv, D)
    v = v_pages.flatten(0, 1)[rows].float()
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("hd,khd->hk", q[0].float(), k.repeat_interleave(g, 1)) / math.sqrt(q.shape[-1])
    ref = torch.einsum("hk,khd->hd", torch.softmax(s, -1), v.repeat_interleave(g, 1))
    return ((o[0].float() - ref).norm() / ref.norm()).item()


if __name__ == "__main__":
    main()
