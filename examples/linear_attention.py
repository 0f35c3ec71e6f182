"""Chunked linear attention from scratch, step by step.

    python examples/linear_attention.py                        # compile (and check on a GPU)
    TK_MLIR_INTERPRET=1 python examples/linear_attention.py    # no GPU: check it in the interpreter

Causal linear attention (no feature map, no normaliser) is a recurrence over
the tokens: a (D_k x D_v) state S gathers k_t v_tᵀ and each query reads it,

    S_t = S_{t-1} + k_t v_tᵀ,    o_t = q_tᵀ S_t.

Step 1 writes that in torch, one token at a time. Step 2 regroups it into
chunks of C = 64 tokens: within a chunk, o = mask(Q Kᵀ) V (the causal part of
a small attention matrix), plus Q S for everything before the chunk; then the
chunk's keys and values join the state, S += Kᵀ V. Every term is a matmul of
64-row tiles: what wgmma does. Step 3 is that loop as a tk_mlir kernel (one
warpgroup per (head, batch); S lives in wgmma accumulators in f32, and the
next chunk reads it as bf16 from shared memory). Step 4 checks it against
step 1 and, on a GPU, times it beside the library's `linear_attention`
(tk_mlir/kernels/chunked_linear_attention.py: feature maps, the normaliser,
states, the backward) and flash-linear-attention when it imports.
"""
import math

import torch

import tk_mlir as tk
from tk_mlir import f32

from helpers import check_on      # the GPU, the interpreter or neither

C = 64


# Step 1: the definition, token by token.
def recurrence(q, k, v):
    """q, k: (B, N, H, Dk); v: (B, N, H, Dv) -> o (B, N, H, Dv), float64."""
    q, k, v = q.double(), k.double(), v.double()
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[1]):
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1)


# Step 2: the same in chunks of C tokens, each term a matmul of tiles.
def chunked(q, k, v):
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))      # (B, H, N, D)
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    out = []
    for c in range(0, q.shape[2], C):
        qc, kc, vc = q[:, :, c:c + C], k[:, :, c:c + C], v[:, :, c:c + C]
        scores = (qc @ kc.transpose(-1, -2)).tril()            # causal within the chunk
        out.append(scores @ vc + qc @ S)                       # ... and everything before it
        S = S + kc.transpose(-1, -2) @ vc
    return torch.cat(out, 2).transpose(1, 2)


# Step 3: the loop of step 2 as a kernel.
@tk.kernel(num_warps=4)
def chunked_kernel(Q: tk.gl, K: tk.gl, V: tk.gl, O: tk.gl, D: tk.constexpr = 64):
    """Q, K, V, O: (B, H, N, D). Grid (H, B): one warpgroup walks a head's chunks."""
    h, b = tk.block_id(0), tk.block_id(1)
    ks = tk.shared_tile(K.dtype, (C, D), swizzle=128)      # this chunk's K and V ...
    vs = tk.shared_tile(V.dtype, (C, D), swizzle=128)
    ss = tk.shared_tile(Q.dtype, (D, D), swizzle=128)      # ... and the state before it
    S = tk.zeros((D, D), f32, layout="row", scope="warpgroup")
    tk.store(ss, S.to(Q.dtype))
    for c in range(tk.cdiv(Q.shape[2], C)):
        # K and V to shared memory (wgmma's B operands); Q stays in registers
        # (the A operand may come from there, in wgmma's row layout).
        tk.store(ks, tk.load(K, (b, h, c, 0), (C, D), layout="row", scope="warpgroup"))
        tk.store(vs, tk.load(V, (b, h, c, 0), (C, D), layout="row", scope="warpgroup"))
        q = tk.load(Q, (b, h, c, 0), (C, D), layout="row", scope="warpgroup")
        tk.barrier()                                        # every thread's stores are in
        o = tk.mma_AB(tk.zeros((C, D), f32, layout="row", scope="warpgroup"), q, ss)   # Q·S
        A = tk.mma_ABt(tk.zeros((C, C), f32, layout="row", scope="warpgroup"), q, ks)  # Q·Kᵀ
        tk.mma_wait(0)
        A = tk.where(A.col_indices() <= A.row_indices(), A, 0.0)                       # tril
        o = tk.mma_AB(o, A.to(Q.dtype), vs)                 # + mask(Q·Kᵀ)·V
        S = tk.mma_AtB(S, ks, vs)                           # S += Kᵀ·V
        tk.mma_wait(0)
        tk.store(O, o.to(O.dtype), (b, h, c, 0))
        tk.barrier()                                        # the MMAs that read ss are done
        tk.store(ss, S.to(Q.dtype))


def linear_attention_from_scratch(q, k, v):
    """(B, N, H, 64) bf16 in and out, the kernel on (B, H, N, D) views."""
    o = torch.empty_like(v)
    B, N, H, D = q.shape
    chunked_kernel[(H, B)](*(t.transpose(1, 2) for t in (q, k, v, o)), D=D)
    return o


def main() -> None:
    spec = tk.spec((4, 16, 4096, 64), tk.bf16)
    compiled = chunked_kernel.compile(spec, spec, spec, spec)
    print(compiled.info)                       # registers, spills, shared memory
    sass = compiled.asm["sass"]
    print("HGMMA:", sass.count("HGMMA"))
    device = check_on(__file__)
    if device is None:
        return
    B, N, H, D = (1, 150, 2, 64) if device == "cpu" else (4, 4096, 16, 64)
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.rand(B, N, H, D, generator=g) - 0.5).bfloat16().to(device)
               for _ in range(3))
    q = q / math.sqrt(D)
    small = (slice(None), slice(0, 300))       # the token-by-token loop is slow: 300 tokens
    ref = recurrence(*(t[small].cpu() for t in (q, k, v)))
    assert ((chunked(*(t[small].cpu() for t in (q, k, v))) - ref).norm() / ref.norm()) < 1e-9
    o = linear_attention_from_scratch(q, k, v)
    if device == "cuda":
        from tk_mlir.benchmarking import bench
        from tk_mlir.kernels import linear_attention
        runs = {"from scratch": linear_attention_from_scratch,
                "tk_mlir.kernels.linear_attention": lambda q, k, v: linear_attention(
                    q, k, v, normalize=False, scale=1.0)}
        try:
            from fla.ops.linear_attn import chunk_linear_attn
            runs["flash-linear-attention"] = lambda q, k, v: chunk_linear_attn(
                q, k, v, scale=1.0, normalize=False)[0]
        except ImportError:
            print("flash-linear-attention not importable: timed without it")
        def inputs(gen):        # fresh groups, cycled past the L2 by bench
            return tuple((torch.rand(B, N, H, D, device=device, generator=gen) - 0.5)
                         .bfloat16() / 8 for _ in range(3))
        for name, fn in runs.items():
            print(f"{name}: {bench(fn, inputs=inputs).ms * 1e3:.0f} µs")
    err = ((o[small].cpu().double() - ref).norm() / ref.norm()).item()
    print(f"{B}x{N}x{H}x{D} on {device}: rel. error vs float64: {err:.2e}")


if __name__ == "__main__":
    main()
