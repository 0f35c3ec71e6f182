"""Attention over packed variable-length sequences, FlashAttention's varlen API.

    from tk_mlir.kernels import attention_varlen
    o = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         causal=True)         # q (total_q, H, D), k/v (total_k, H_kv, D)

Sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 of q
and its keys rows cu_seqlens_k[b] .. of k and v. The dense kernels
(flash_attention.py, VARLEN=True) attend the packed tensors as one sequence
each, (1, H, total, D) views, with each query row's visible keys in a side
table made on the GPU from the offsets (packed_sequences.py): no host
synchronisation, so a call can be captured in a CUDA graph. Forward and
backward; differentiable in q, k and v.
"""
from __future__ import annotations

import math

from tk_mlir.kernels import checks, flash_attention, packed_sequences, schedule
from tk_mlir.kernels.device import num_sms

FN = "attention_varlen"


def reach(q, k) -> int:
    """More than any distance between a query and a key of packed q, k
    (total, H, D): a window side this wide bounds nothing (checks.window)."""
    return q.shape[0] + k.shape[0]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool = False, scale: float | None = None,
                     window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     return_lse: bool = False):
    """softmax(q·kᵀ·scale)·v per packed sequence (flash_attn_varlen_func).

    q: (total_q, H, D); k, v: (total_k, H_kv, D), H_kv dividing H; bf16 or
    f16 on one CUDA device, last dim contiguous; D is 64 or 128 (256 forward
    only). cu_seqlens_q / cu_seqlens_k: (B+1,) int32 on q's device, 0 first,
    non-decreasing, total last; sequences may be empty. max_seqlen_q/k are
    FlashAttention's arguments, checked to be ints >= 0 and not otherwise
    needed (the kernels read the lengths on the GPU). causal: query i of a
    sequence sees its keys j <= i + len_k - len_q (bottom-right aligned);
    window=(left, right) and softcap as `attention`'s. A query that sees no
    key (an empty key sequence, or before the causal diagonal) gets output 0
    and lse -inf. Returns o (total_q, H, D), laid out like q, and with
    return_lse=True also lse (H, total_q) f32 (natural log; differentiable).

    The offsets are not read on the host: on the GPU, values that break the
    rules above give wrong results, unchecked; on the CPU (the interpreter)
    they are checked."""
    import numbers
    import torch
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{FN}: {name} must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"{FN}: {name} must be >= 0, got {value}")
    checks.flags(FN, causal=causal, return_lse=return_lse)
    scale, left, right, softcap = checks.attention_options(FN, q.shape[-1], reach(q, k), scale,
                                                           window, softcap)
    checks.on_cuda(FN, "q", q)
    from tk_mlir.kernels import custom_ops
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, left, right, softcap)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not torch.compiler.is_compiling():
        flash_attention.warn_if_forward_only(FN, q.shape[-1], grad)
    if torch.compiler.is_compiling():
        o, lse = torch.ops.tk_mlir.attention_varlen(*args)
    elif grad:
        o, lse = custom_ops.EagerAttentionVarlen.apply(*args)
    else:
        o, lse = forward(*args)
    return (o, lse) if return_lse else o


def _check(q, k, v, cu_q, cu_k) -> None:
    """Shapes, dtypes, devices and layouts, each with the rule it breaks."""
    import torch
    dtypes = (torch.bfloat16, torch.float16)
    checks.tensor(FN, "q", q, ndim=3, dtypes=dtypes)
    for name, t in (("k", k), ("v", v)):
        checks.tensor(FN, name, t, ndim=3, dtypes=dtypes)
        checks.like(FN, name, t, "q", q)
    _, H, D = q.shape
    if D not in (64, 128, 256):
        raise ValueError(f"{FN}: head dim D must be 64, 128 or 256, got {D}")
    if k.shape != v.shape:
        raise ValueError(f"{FN}: k and v must have one shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[2] != D:
        raise ValueError(f"{FN}: k and v must be (total_k, H_kv, D={D}), got {tuple(k.shape)}")
    if k.shape[1] == 0 or H % k.shape[1]:
        raise ValueError(f"{FN}: the K/V heads H_kv={k.shape[1]} must divide the query heads "
                         f"H={H} (GQA/MQA)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{FN}: {name}'s last dim (D) must be contiguous (stride 1), got "
                             f"strides {tuple(t.stride())}")
        if max(t.shape[0], 1) > packed_sequences.EMPTY_LO // 2:
            raise ValueError(f"{FN}: {name} holds {t.shape[0]} tokens, more than the "
                             f"{packed_sequences.EMPTY_LO // 2} the side table indexes")
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        checks.tensor(FN, name, t, ndim=1, dtypes=(torch.int32,))
        checks.like(FN, name, t, "q", q, dtype=False)
        if len(t) < 2:
            raise ValueError(f"{FN}: {name} must hold B+1 >= 2 offsets, got shape "
                             f"{tuple(t.shape)}")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"{FN}: cu_seqlens_q and cu_seqlens_k must have one length (B+1), "
                         f"got {len(cu_q)} and {len(cu_k)}")
    if cu_q.device.type == "cpu" and not torch.compiler.is_compiling():
        for name, t, total in (("cu_seqlens_q", cu_q, q.shape[0]),
                               ("cu_seqlens_k", cu_k, k.shape[0])):
            _check_offsets(name, t, total)


def _check_offsets(name: str, cu, total: int) -> None:
    """On the CPU (the interpreter) the offsets cost nothing to read: check them."""
    values = [int(x) for x in cu]
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"{FN}: {name} must start at 0 and end at the {total} packed tokens, "
                         f"got {values[0]} .. {values[-1]}")
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            raise ValueError(f"{FN}: {name} must not decrease, got {name}[{b}] = {values[b]} "
                             f"> {name}[{b + 1}] = {values[b + 1]}")


def _packed(t):
    """(total, H, D) as the kernels' (1, H, total, D) view."""
    return t.transpose(0, 1).unsqueeze(0)


def _table(cu_q, cu_k, tail_and_costs, heads: int, grid: int, call: tuple, pairs=None):
    """A kernel's TASKS: the schedule dealt on the GPU, padded to whole 64-entry
    vectors, then the packed sequences' tail. pairs=(cu, rows per task): the
    tasks paired along each sequence (causal: schedule.paired_table). The
    tail is made every call (the kernels' masks read it); the schedule is
    the last one made for the same cu_q and cu_k, unchanged since, and the
    same `call` (what else the costs depend on: schedule.kept_for), so the
    layers of a model that share a batch's offsets make it once."""
    import torch
    tail, costs = tail_and_costs

    def make():
        c = costs() + flash_attention.TASK_OVERHEAD_BLOCKS
        sched = (schedule.paired_table(c, heads, grid, *pairs) if pairs else
                 schedule.sorted_table(c, heads, grid))
        return torch.nn.functional.pad(sched, (0, -len(sched) % 64))

    key = (call, heads, grid, pairs and pairs[1], flash_attention.TASK_OVERHEAD_BLOCKS,
           schedule.PAIRED_MIN_TASKS)
    return torch.cat((schedule.kept_for((cu_q, cu_k), key, make), tail))


def lse_like(q):
    """(H, total_q) f32 as `forward` returns it: flash_attention.lse_like of
    the packed (1, H, total_q, D) view."""
    return flash_attention.lse_like(_packed(q))[0]


def forward(q, k, v, cu_q, cu_k, causal: bool, scale: float, left: int = -1, right: int = -1,
            softcap: float = 0.0):
    """(o laid out like q, lse (H, total_q) f32) on checked tensors."""
    import torch
    total_q, H, D = q.shape
    o, lse = torch.empty_like(q), lse_like(q)
    if not k.shape[0]:                  # no keys at all: every row sees none
        return o.zero_(), lse.fill_(float("-inf"))
    if total_q:
        q, k, v = (checks.kernel_operand(t) for t in (q, k, v))
        cfg = flash_attention._config(D, 0, causal)
        bm, bn = 64 * cfg["CONSUMERS"], cfg["BN"]
        grid = num_sms(q.get_device())
        # Paired (mirrored tiles of one sequence) where it pays for its table: at
        # D=64 the forward's kernel takes as long either way (BENCHMARKS.md).
        tasks = _table(cu_q, cu_k, packed_sequences.tail(
            cu_q, cu_k, total_q, k.shape[0], causal, (left, right), forward_tasks=(bm, bn)), H,
            grid, ("forward", total_q, k.shape[0], causal, left, right, bm, bn),
            pairs=(cu_q, bm) if causal and D > 64 else None)
        cap = dict(SOFTCAP=float(softcap)) if softcap else {}
        flash_attention.attention_kernel[(grid,)](
            _packed(q), _packed(k), _packed(v), _packed(o),
            flash_attention.padded_rows(lse.unsqueeze(0)), tasks,
            scale * math.log2(math.e), D=D, VARLEN=True, num_warps=4 * (cfg["CONSUMERS"] + 1),
            **cfg, **cap)
    return o, lse


def backward(do, q, k, v, o, lse, cu_q, cu_k, causal: bool, scale: float, left: int = -1,
             right: int = -1, softcap: float = 0.0, dlse=None):
    """(dq, dk, dv) of attention_varlen given o, its lse (H, total_q) and the
    gradients do and dlse (like lse, or None); dk, dv summed over the query
    heads of each K/V head (GQA)."""
    import torch
    total_q, H, D = q.shape
    if not total_q or not k.shape[0]:   # nothing attended: nothing to differentiate
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    q, k, v, o, do = (checks.kernel_operand(t) for t in (q, k, v, o, do))
    grid = num_sms(q.get_device())
    tasks = _table(cu_q, cu_k, packed_sequences.tail(
        cu_q, cu_k, total_q, k.shape[0], causal, (left, right)), k.shape[1], grid,
        ("backward", total_q, k.shape[0], causal, left, right),
        pairs=(cu_k, 128) if causal else None)
    dq32 = flash_attention.launch_backward(
        _packed(do), _packed(q), _packed(k), _packed(v), _packed(o), lse.unsqueeze(0),
        _packed(dk), _packed(dv), tasks, grid, scale,
        dlse=None if dlse is None else dlse.unsqueeze(0), VARLEN=True,
        **flash_attention._backward_config(D, softcap))
    _packed(dq).copy_(dq32)
    return dq, dk, dv
