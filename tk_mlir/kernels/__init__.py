"""The kernel library: ready kernels on torch tensors, each the readable
tk_mlir source of its kernel beside a checked, torch-facing wrapper.

    from tk_mlir.kernels import (attention, grouped_matmul, matmul, rms_norm, layer_norm,
                                 scaled_matmul)

    c = matmul(a, b)                       # A @ B.T, B given as N x K (3-D: a batch)
    c = grouped_matmul(a, b, sizes)        # G products of sizes[g] rows (an MoE's experts)
    c = grouped_mm(a, b, offs)             # the same, rows packed, as torch._grouped_mm
    c = scaled_matmul(a8, b8, sa, sb)      # fp8 (A @ B) * scales, as torch._scaled_mm
    y = rms_norm(x, weight)                # x / rms(x) * weight, per row
    y = layer_norm(x, weight, bias)        # (x - mean) / std * weight + bias
    y, h = fused_add_rms_norm(x, res, w)   # h = x + res, y = rms_norm(h, w): one pass
    h = swiglu(gate, up)                   # silu(gate) * up
    loss = cross_entropy(logits, target)   # as F.cross_entropy, a vocabulary chunk at a time
    q = rotary_embedding(q, cos, sin)      # (B, N, H, D), GPT-NeoX halves
    loss = linear_cross_entropy(h, w, t)   # cross_entropy(h @ w.T, t), logits a slice at a time
    o = attention(q, k, v, causal=True)    # softmax(q kᵀ / sqrt(D)) v, (B, H, N, D)
    o = attention_with_kvcache(q, kc, vc, lens)  # decode over a (paged) KV cache, (B, N, H, D)
    o = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)  # packed sequences, (total, H, D)
    o = linear_attention(q, k, v, "elu1")  # chunked linear attention, (B, N, H, D)
    o, state = linear_attention_step(q, k, v, state)  # one decoding step of it
    y = ssd(x, dt, A, B, C, D=D)           # Mamba-2's state-space duality layer, (b, l, h, p)
    all_reduce(t, group)                   # in place over a group's GPUs (torchrun)
    c = matmul_reduce_scatter(a, w, group) # sum of a @ w.T over ranks, rows scattered
    c = all_gather_matmul(a, w, group)     # every rank's rows of a, stacked, @ w.T

Importing the library is cheap: neither torch nor MLIR loads until a name is
used, and then only its own module (MLIR at the kernel's first compile, not
at all on a disk-cache hit). The functions call the kernels as torch custom
ops, torch.ops.tk_mlir.* (custom_ops.py); matmul, the norms, swiglu,
rotary_embedding, the cross-entropies, attention, linear attention and ssd are
differentiable.
"""
from __future__ import annotations

import importlib
import sys

# Each public name and the module that defines it (a new kernel is one entry).
# Modules are named for their kernels, never like a public name: importing a
# submodule binds it on the package, and would shadow the function.
_LAZY = {
    "matmul": ".gemm",
    "grouped_matmul": ".grouped_gemm",
    "grouped_mm": ".grouped_gemm",
    "scaled_matmul": ".scaled_gemm",
    "rms_norm": ".norms",
    "layer_norm": ".norms",
    "fused_add_rms_norm": ".norms",
    "fused_add_layer_norm": ".norms",
    "swiglu": ".activations",
    "cross_entropy": ".losses",
    "linear_cross_entropy": ".losses",
    "rotary_embedding": ".rotary",
    "rotary_embedding_qk": ".rotary",
    "attention": ".flash_attention",
    "attention_with_kvcache": ".decode_attention",
    "attention_varlen": ".varlen_attention",
    "linear_attention": ".chunked_linear_attention",
    "linear_attention_step": ".chunked_linear_attention",
    "ssd": ".state_space_duality",
    "all_reduce": ".all_reduce_kernels",
    "matmul_reduce_scatter": ".gemm_rs",
    "all_gather_matmul": ".ag_gemm",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    if "torch" in sys.modules:      # torch is loaded: registering imports nothing more
        importlib.import_module(".custom_ops", __name__)
    globals()[name] = value         # resolved once: later lookups skip this hook
    return value


def __dir__():
    return sorted({*globals(), *_LAZY})


__all__ = list(_LAZY)
