"""Based's feature map for linear attention: feature_map="taylor2".

    o = linear_attention(q, k, v, feature_map="taylor2")   # q, k: (B, N, H, d), d <= 16

φ(x) = [1, x, vec(x ⊗ x) / √2], D_φ = 1 + d + d² features, of q·scale and
of k (scale multiplies q, as for every feature map): φ(q·s)·φ(k) = 1 + s q·k
+ (s q·k)² / 2, the second-order Taylor expansion of exp(s q·k). (Based
scales both q and k by √s: the same dot products.)

The features are made in torch (f32) and cut into slices of 128 (bf16 for
the kernels, also for f16 inputs: f16's range overflows on long sequences): the
numerator Σ_s (φ(q_t)·φ(k_s)) v_s is the sum over the slices of the chunked
kernels' linear attention (feature map None, scale 1, normalize=False) of
each slice, zero-padded; the normaliser φ(q_t)·z_t (z_t = Σ_{s<=t} φ(k_s))
is a cumulative sum of φ(k) in f32. The state is the slices' states, cut
back to D_φ, and z. Every part is differentiable; the kernels do the
quadratic work, torch the elementwise work (so it is slower than a fused
kernel would be: measured in BENCHMARKS.md when it has been).
"""
from __future__ import annotations

import math

MAX_DK = 16             # Based's feature dim: D_φ = 1 + 16 + 256 = 273
SLICE = 128             # features per kernel call (the kernels' D_k)


def feature_dim(d: int) -> int:
    """D_φ of taylor2 on d-dimensional q and k."""
    return 1 + d + d * d


def features(x):
    """φ(x) in f32: [1, x, vec(x ⊗ x) / √2] along the last dim."""
    import torch
    x = x.float()
    outer = (x[..., :, None] * x[..., None, :]).flatten(-2) / math.sqrt(2)
    return torch.cat((torch.ones_like(x[..., :1]), x, outer), -1)


def linear_attention(q, k, v, causal: bool, normalize: bool, scale: float, initial_state,
                     return_state: bool):
    """chunked_linear_attention.linear_attention with feature_map="taylor2",
    on checked arguments."""
    import torch
    from tk_mlir.kernels.chunked_linear_attention import linear_attention as chunked
    fq, fk = features(q.float() * scale), features(k)          # (B, N, H, D_φ) f32
    B, N, H, dphi = fq.shape
    padded = -(-dphi // SLICE) * SLICE
    pad = (0, padded - dphi)
    # bf16 for the kernels whatever q's dtype: the unnormalised numerators come
    # back in v's dtype and pass f16's 65504 on long sequences
    fq16 = torch.nn.functional.pad(fq, pad).to(torch.bfloat16)
    fk16 = torch.nn.functional.pad(fk, pad).to(torch.bfloat16)
    v16 = v.to(torch.bfloat16)
    s0, z0 = initial_state if initial_state is not None else (None, None)
    if s0 is not None:
        s0 = torch.nn.functional.pad(s0, (0, 0) + pad)         # (B, H, padded, D_v)
    o, states = None, []
    for first in range(0, padded, SLICE):
        part = slice(first, first + SLICE)
        init = None if s0 is None else \
            (s0[:, :, part].contiguous(), s0.new_zeros(B, H, SLICE))
        out = chunked(fq16[..., part], fk16[..., part], v16, None, causal, False, 1.0, init,
                      return_state)
        if return_state:
            out, (s, _) = out
            states.append(s)
        o = out.float() if o is None else o + out.float()
    z = None
    if normalize or return_state:
        z = fk.cumsum(1) if causal else fk.sum(1, keepdim=True).expand_as(fk)
        if z0 is not None:
            z = z + z0[:, None]
    if normalize:
        o = o / ((fq * z).sum(-1, keepdim=True) + 1e-6)
    o = o.to(v.dtype)
    if not return_state:
        return o
    if N:
        z_last = z[:, -1].contiguous()
    else:                                                      # no tokens: z as it came in
        z_last = z0.float().contiguous() if z0 is not None else fk.new_zeros(B, H, dphi)
    return o, (torch.cat(states, 2)[:, :, :dphi].contiguous(), z_last)
