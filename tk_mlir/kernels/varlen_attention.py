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

from tk_mlir.kernels import checks, eager, flash_attention, packed_sequences, schedule
from tk_mlir.kernels.device import num_sms

FN = "attention_varlen"


def reach(q, k) -> int:
    """More than any distance between a query and a key of packed q, k
    (total, H, D): a window side this wide bounds nothing (checks.window)."""
    return q.shape[0] + k.shape[0]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool = False, scale: float | None = None,
                     window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     return_lse: bool = False, *, softmax_scale: float | None = None,
                     window_size: tuple[int, int] | None = None):
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
    and lse -inf. Returns o (total_q, H, D), laid out as torch.empty_like(q)
    lays it out (q's own strides where q is dense; a packed view's, e.g.
    qkv[:, 0], gives a dense o), and with return_lse=True also lse (H,
    total_q) f32 (natural log; differentiable).

    The offsets are not read on the host: on the GPU, values that break the
    rules above give wrong results, unchecked; on the CPU (the interpreter)
    they are checked. FlashAttention's keywords softmax_scale and window_size
    are taken for scale and window.

    A NaN or inf in one sequence's q, k or v (or do) can reach the sequences
    packed beside it: a tile of 64 rows or keys spans sequences, and a masked
    weight of 0 times a NaN is NaN in the MMAs (o forward; dq, dk, dv
    backward). Finite inputs are independent per sequence."""
    import torch
    if softmax_scale is not None or window_size is not None:
        scale, window = checks.flash_names(FN, {"scale": scale, "window": window},
                                           {"softmax_scale": softmax_scale,
                                            "window_size": window_size})
    if torch.compiler.is_compiling():
        scale, left, right, softcap, _ = _checked_call(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
            window, softcap, return_lse)
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir
        o, lse = torch.ops.tk_mlir.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal,
                                                    scale, left, right, softcap)
        return (o, lse) if return_lse else o
    # eager: a signature seen before was checked then (eager.py); the max lengths,
    # which change with every batch and are not in the key, are checked every call
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    key = (*map(eager.tensor_key, tensors),
           eager.option_key(causal, scale, window, softcap, return_lse),
           torch.is_grad_enabled())
    run = _PREPARED.get(key)
    if run is None:
        run = _PREPARED.add(key, _prepare(*tensors, max_seqlen_q, max_seqlen_k, causal, scale,
                                          window, softcap, return_lse))
    else:
        _check_max_seqlens(max_seqlen_q, max_seqlen_k)
    return run(*tensors)


# Eager calls by signature (eager.py).
_PREPARED = eager.Prepared()


def _check_max_seqlens(max_seqlen_q, max_seqlen_k) -> None:
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if type(value) is not int:          # (the common case first: no ABC check)
            import numbers
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{FN}: {name} must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"{FN}: {name} must be >= 0, got {value}")


def _checked_call(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window,
                  softcap, return_lse) -> tuple:
    """Every rule of a call: (scale, left, right, softcap) as the kernels take
    them, and whether autograd records the call."""
    import torch
    _check(q, k, v, cu_q, cu_k)
    _check_max_seqlens(max_seqlen_q, max_seqlen_k)
    checks.flags(FN, causal=causal, return_lse=return_lse)
    scale, left, right, softcap = checks.attention_options(FN, q.shape[-1], reach(q, k), scale,
                                                           window, softcap)
    checks.on_cuda(FN, "q", q)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if not torch.compiler.is_compiling():
        flash_attention.warn_if_forward_only(FN, q.shape[-1], grad)
    return scale, left, right, softcap, grad


def _prepare(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap,
             return_lse):
    """After checking an eager call, `run(q, k, v, cu_q, cu_k)` for calls like
    it: through autograd (EagerAttentionVarlen) when it records them, else
    the forward alone, its launches planned here. On CPU tensors (the
    interpreter) the offsets are checked on every call."""
    from tk_mlir.kernels import custom_ops  # registers torch.ops.tk_mlir on first use
    scale, left, right, softcap, grad = _checked_call(q, k, v, cu_q, cu_k, max_seqlen_q,
                                                      max_seqlen_k, causal, scale, window,
                                                      softcap, return_lse)
    masks = (causal, scale, left, right, softcap)
    planned = planned_forward(q, k, v, *masks, same_signature=True)
    if grad:
        # planned at the first backward per layout of the saved tensors, then kept
        backward = eager.per_layout(lambda q, k, v, o, lse: planned_backward(
            q, k, *masks, same_signature=all(checks.kernel_operand(t) is t
                                             for t in (q, k, v, o))), 5)

        def remembered_backward(do, q, k, v, o, lse, cu_q, cu_k, *options, dlse=None):
            return backward(do, q, k, v, o, lse, cu_q, cu_k, dlse)

        def run(q, k, v, cu_q, cu_k):
            return custom_ops.EagerAttentionVarlen.apply(q, k, v, cu_q, cu_k, *masks, planned,
                                                         remembered_backward)
    else:
        run = planned
    if cu_q.device.type == "cpu":           # (the interpreter: offsets cost nothing to read)
        unchecked = run

        def run(q, k, v, cu_q, cu_k):
            _check_cpu_offsets(q, k, cu_q, cu_k)
            return unchecked(q, k, v, cu_q, cu_k)
    if return_lse:
        return run
    return lambda *tensors: run(*tensors)[0]


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
        _check_cpu_offsets(q, k, cu_q, cu_k)


def _check_cpu_offsets(q, k, cu_q, cu_k) -> None:
    for name, t, total in (("cu_seqlens_q", cu_q, q.shape[0]), ("cu_seqlens_k", cu_k, k.shape[0])):
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


def _table(cu_q, cu_k, tail, heads: int, grid: int, call: tuple, pairs=None):
    """A kernel's TASKS for cu_seqlens cu_q, cu_k: the schedule dealt on the
    GPU, padded to whole 64-entry vectors, then the packed sequences' tail,
    written in place by `tail` (packed_sequences.planned_tail's maker).
    pairs=(cu, rows per task): the tasks paired along each sequence (causal:
    schedule.paired_table). The tail is made every call (the kernels' masks
    read it); the schedule is the last one made for the same cu_q and cu_k,
    unchanged since, and the same `call` (what else the costs depend on:
    schedule.kept_for), so the layers of a model that share a batch's
    offsets make it once, and copy it in (one launch)."""
    import torch
    made = []

    def make():
        part, costs = tail(cu_q, cu_k)
        c = costs() + flash_attention.TASK_OVERHEAD_BLOCKS
        sched = (schedule.paired_table(c, heads, grid, *pairs) if pairs else
                 schedule.sorted_table(c, heads, grid))
        made.append(part)
        return torch.nn.functional.pad(sched, (0, -len(sched) % 64))

    key = (call, heads, grid, pairs and pairs[1], flash_attention.TASK_OVERHEAD_BLOCKS,
           schedule.PAIRED_MIN_TASKS)
    sched = schedule.kept_for((cu_q, cu_k), key, make)
    if made:                        # (its tail is made: one cat)
        return torch.cat((sched, made[0]))
    table = sched.new_empty(len(sched) + tail.size)
    table[:len(sched)].copy_(sched)
    tail(cu_q, cu_k, out=table[len(sched):])
    return table


def lse_like(q):
    """(H, total_q) f32 as `forward` returns it: flash_attention.lse_like of
    the packed (1, H, total_q, D) view."""
    return flash_attention.lse_like(_packed(q))[0]


def forward(q, k, v, cu_q, cu_k, causal: bool, scale: float, left: int = -1, right: int = -1,
            softcap: float = 0.0):
    """(o laid out like q, lse (H, total_q) f32) on checked tensors."""
    return planned_forward(q, k, v, causal, scale, left, right, softcap)(q, k, v, cu_q, cu_k)


def planned_forward(q, k, v, causal: bool, scale: float, left: int = -1, right: int = -1,
                    softcap: float = 0.0, same_signature: bool = False):
    """`run(q, k, v, cu_q, cu_k) -> (o, lse)`: `forward` for checked tensors
    shaped like q, k and v (and on their device), its configuration, grid and
    launches chosen once; same_signature: every call's tensors are laid out
    as these (eager.launcher), so whether they need copying into the
    kernels' layout (checks.kernel_operand) is decided here."""
    import torch
    total_q, H, D = q.shape
    if not k.shape[0]:                  # no keys at all: every row sees none
        return lambda q, *rest: (torch.zeros_like(q), lse_like(q).fill_(float("-inf")))
    if not total_q:
        return lambda q, *rest: (torch.empty_like(q), lse_like(q))
    cfg = flash_attention._config(D, 0, causal)
    bm, bn = 64 * cfg["CONSUMERS"], cfg["BN"]
    grid = num_sms(q.get_device())
    tail = packed_sequences.planned_tail(total_q, k.shape[0], causal, (left, right),
                                         forward_tasks=(bm, bn), same_signature=same_signature)
    cap = dict(SOFTCAP=float(softcap)) if softcap else {}
    kernel = eager.launcher(flash_attention.attention_kernel, same_signature)(
        (grid,), D=D, VARLEN=True, num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg, **cap)
    call = ("forward", total_q, k.shape[0], causal, left, right, bm, bn)
    # Paired (mirrored tiles of one sequence) where it pays for its table: at
    # D=64 the forward's kernel takes as long either way (BENCHMARKS.md).
    paired = causal and D > 64
    operands = not same_signature or any(checks.kernel_operand(t) is not t for t in (q, k, v))
    scale2 = scale * math.log2(math.e)

    def run(q, k, v, cu_q, cu_k):
        o, lse = torch.empty_like(q), lse_like(q)
        if operands:
            q, k, v = (checks.kernel_operand(t) for t in (q, k, v))
        tasks = _table(cu_q, cu_k, tail, H, grid, call,
                       pairs=(cu_q, bm) if paired else None)
        kernel(_packed(q), _packed(k), _packed(v), _packed(o),
               flash_attention.padded_rows(lse.unsqueeze(0)), tasks, scale2)
        return o, lse
    return run


def backward(do, q, k, v, o, lse, cu_q, cu_k, causal: bool, scale: float, left: int = -1,
             right: int = -1, softcap: float = 0.0, dlse=None):
    """(dq, dk, dv) of attention_varlen given o, its lse (H, total_q) and the
    gradients do and dlse (like lse, or None); dk, dv summed over the query
    heads of each K/V head (GQA)."""
    return planned_backward(q, k, causal, scale, left, right, softcap)(
        do, q, k, v, o, lse, cu_q, cu_k, dlse)


def planned_backward(q, k, causal: bool, scale: float, left: int = -1, right: int = -1,
                     softcap: float = 0.0, same_signature: bool = False):
    """`run(do, q, k, v, o, lse, cu_q, cu_k, dlse=None) -> (dq, dk, dv)`:
    `backward` for tensors shaped like q and k (and on their device), its
    configuration, grid and launches chosen once. same_signature: q, k, v
    and o are laid out alike on every call, as the kernels read them (a
    remembered eager forward's saved tensors): do, whose layout autograd
    chooses, is copied into o's where it differs, and the launches read
    addresses alone (eager.launcher)."""
    import torch
    total_q, H, D = q.shape
    if not total_q or not k.shape[0]:   # nothing attended: nothing to differentiate
        return lambda do, q, k, v, *rest: (torch.zeros_like(q), torch.zeros_like(k),
                                           torch.zeros_like(v))
    grid = num_sms(q.get_device())
    tail = packed_sequences.planned_tail(total_q, k.shape[0], causal, (left, right),
                                         same_signature=same_signature)
    kernels = flash_attention.backward_launcher(
        _packed(q).shape, grid, scale, same_signature=same_signature, VARLEN=True,
        **flash_attention._backward_config(D, softcap, fn=FN))
    call = ("backward", total_q, k.shape[0], causal, left, right)
    heads = k.shape[1]

    def run(do, q, k, v, o, lse, cu_q, cu_k, dlse=None):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if same_signature:
            do = eager.laid_out(do, o.shape, o.stride(), o.dtype)
        else:
            q, k, v, o, do = (checks.kernel_operand(t) for t in (q, k, v, o, do))
        tasks = _table(cu_q, cu_k, tail, heads, grid, call,
                       pairs=(cu_k, 128) if causal else None)
        dq32 = kernels(_packed(do), _packed(q), _packed(k), _packed(v), _packed(o),
                       lse.unsqueeze(0), _packed(dk), _packed(dv), tasks,
                       None if dlse is None else dlse.unsqueeze(0))
        _packed(dq).copy_(dq32)
        return dq, dk, dv
    return run
