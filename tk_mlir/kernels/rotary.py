"""Rotary position embeddings on torch tensors, forward and backward.

    from tk_mlir.kernels import rotary_embedding
    q = rotary_embedding(q, cos, sin)               # (B, N, H, D), GPT-NeoX halves
    q, k = rotary_embedding_qk(q, k, cos, sin)      # both, one call

Each block rotates the H heads of one (batch, position): the first and
second halves of D as two (H', D/2) register tiles (H' = H rounded up to a
power of two, the rows past H masked), multiplied by that position's cos and
sin rows. The backward rotates by the opposite angle. Math in f32.
"""
from __future__ import annotations

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels import checks, eager
from tk_mlir.kernels.column_pieces import column_piece, max_rows, tile_rows
from tk_mlir.runtime.arguments import contiguous_strides


@tk.func
def rotate(X, COS, SIN, Y, n, b, HB, HALF, PER_BATCH, INVERSE, INTERLEAVED):
    """Y[b, n] = X[b, n] (its <= HB heads) rotated by position n's angles, in
    column pieces of (HB, piece) tiles (column_pieces: within a register
    budget at any head count, whole tiles a register vector takes), walked
    by a run-time loop (unrolled, ptxas hoisted every piece's loads and
    spilled: 146 bytes at 256 heads of D=128, 702 at 1024)."""
    half = HALF
    angle = b * X.shape[1] + n if PER_BATCH else n       # the row of cos/sin, in halves
    if INTERLEAVED:
        # y_2i = x_2i·c - x_2i+1·s and y_2i+1 = x_2i+1·c + x_2i·s (pairs stay in a piece)
        piece = column_piece(2 * half, HB)
        pieces = 2 * half // piece
        for p in range(pieces):
            c = tk.load(COS, (angle * pieces + p,), (piece,)).to(f32)
            s = tk.load(SIN, (angle * pieces + p,), (piece,)).to(f32)
            x = tk.load(X, (b, n, 0, p), (HB, piece)).to(f32)
            odd = (x.col_indices() & 1) == 1
            sign = tk.where(odd, 1.0, -1.0) if not INVERSE else tk.where(odd, -1.0, 1.0)
            y = x.mul_col(c) + (x.swap_pairs() * sign).mul_col(s)
            tk.store(Y, y.to(Y.dtype), (b, n, 0, p))
    else:
        piece = column_piece(half, HB)
        pieces = half // piece
        for p in range(pieces):
            c = tk.load(COS, (angle * pieces + p,), (piece,)).to(f32)
            s = tk.load(SIN, (angle * pieces + p,), (piece,)).to(f32)
            if INVERSE:
                s = -s
            x1 = tk.load(X, (b, n, 0, p), (HB, piece)).to(f32)
            x2 = tk.load(X, (b, n, 0, pieces + p), (HB, piece)).to(f32)
            tk.store(Y, (x1.mul_col(c) - x2.mul_col(s)).to(Y.dtype), (b, n, 0, p))
            tk.store(Y, (x2.mul_col(c) + x1.mul_col(s)).to(Y.dtype), (b, n, 0, pieces + p))


@tk.kernel(num_warps=4)
def rotary_kernel(X: tk.gl, COS: tk.gl, SIN: tk.gl, Y: tk.gl, HB: tk.constexpr,
                  HALF: tk.constexpr, PER_BATCH: tk.constexpr = False,
                  INVERSE: tk.constexpr = False, INTERLEAVED: tk.constexpr = False):
    """Y[b, n, h] = X[b, n, h] rotated by position n's angles (GPT-NeoX: the
    pairs are (i, i + D/2)): y1 = x1·cos - x2·sin, y2 = x2·cos + x1·sin, with
    sin negated for INVERSE (the backward). X, Y: (B, N, H, D) with H <= HB
    and D = 2·HALF; COS, SIN: flat (N·HALF,), or (B·N·HALF,) with PER_BATCH.
    INTERLEAVED (GPT-J: the pairs are (2i, 2i + 1)): COS and SIN hold each
    angle twice, flat (N·D,) or (B·N·D,), and y = x·cos + x'·(∓sin), x' the
    tile with its column pairs swapped. Grid (N, B)."""
    rotate(X, COS, SIN, Y, tk.block_id(0), tk.block_id(1), HB, HALF, PER_BATCH, INVERSE,
           INTERLEAVED)


@tk.kernel(num_warps=4)
def rotary_qk_kernel(Q: tk.gl, K: tk.gl, COS: tk.gl, SIN: tk.gl, YQ: tk.gl, YK: tk.gl,
                     HBQ: tk.constexpr, HBK: tk.constexpr, HALF: tk.constexpr,
                     PER_BATCH: tk.constexpr = False, INVERSE: tk.constexpr = False,
                     INTERLEAVED: tk.constexpr = False):
    """rotary_kernel on q (into YQ) and k (into YK) in one launch: Q, K of one
    (B, N, ., D), H_q <= HBQ and H_k <= HBK heads. Grid (N, B, 2): the last
    axis picks q or k."""
    n, b = tk.block_id(0), tk.block_id(1)
    if tk.block_id(2) == 0:
        rotate(Q, COS, SIN, YQ, n, b, HBQ, HALF, PER_BATCH, INVERSE, INTERLEAVED)
    else:
        rotate(K, COS, SIN, YK, n, b, HBK, HALF, PER_BATCH, INVERSE, INTERLEAVED)


def rotary_embedding(x, cos, sin, interleaved: bool = False):
    """x rotated by the angles whose cos and sin are given: for position n and
    pair i (GPT-NeoX / Llama layout: element i with element i + D/2),
    (x_i, x_{i+D/2}) -> (x_i·cos - x_{i+D/2}·sin, x_{i+D/2}·cos + x_i·sin).

    x: (B, N, H, D) bf16 or f16 CUDA tensor, any strides with a contiguous
    last dim (e.g. a view of a projection); D a multiple of 16. cos, sin:
    (N, D/2), or (B, N, D/2) for per-sequence positions, of x's dtype or
    float32, contiguous (or one table expanded over the batch, read as
    that table); a model's longer table, (N', D/2) or (1, N', D/2) with
    N' >= N, is read for its first N positions. interleaved=True takes
    the GPT-J layout instead:
    pair i is (x_2i, x_2i+1), with the same cos and sin (angle i at row i;
    the kernel reads them repeated, a copy made per call). Returns a new
    contiguous tensor. Differentiable in x (not in cos and sin); under
    torch.compile the custom op torch.ops.tk_mlir.rotary_embedding."""
    import torch
    if torch.compiler.is_compiling():
        _check(x, cos, sin)
        _check_interleaved(interleaved)
        checks.on_cuda("rotary_embedding", "x", x)
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir
        return torch.ops.tk_mlir.rotary_embedding(x, _positions(cos), _positions(sin), False,
                                                  interleaved)
    # eager: a signature seen before was checked then (eager.py)
    key = (eager.tensor_key(x), eager.tensor_key(cos), eager.tensor_key(sin),
           eager.option_key(interleaved), torch.is_grad_enabled())
    return _ROTARY.call(key, lambda: _prepare(x, cos, sin, interleaved), x, cos, sin)


# Eager calls by signature (eager.py).
_ROTARY = eager.Prepared()


def _prepare(x, cos, sin, interleaved):
    """After checking an eager call, `run(x, cos, sin)` for calls like it:
    through autograd when it records them."""
    _check(x, cos, sin)
    _check_interleaved(interleaved)
    checks.on_cuda("rotary_embedding", "x", x)
    _warn_tables_get_no_gradient("rotary_embedding", cos, sin)
    run = _planned_eager((x,), cos, interleaved)
    return lambda x, cos, sin: run(x, cos, sin)[0]


def _check_interleaved(interleaved, fn: str = "rotary_embedding") -> None:
    checks.flags(fn, interleaved=interleaved)


def rotary_embedding_qk(q, k, cos, sin, interleaved: bool = False):
    """(rotary_embedding(q, cos, sin), rotary_embedding(k, cos, sin)): q and k
    may have different head counts (GQA). Eager calls rotate both in one
    launch (and their gradients in one more) when they share (B, N, D),
    dtype, device and whether they require grad."""
    import torch
    if torch.compiler.is_compiling():
        return (rotary_embedding(q, cos, sin, interleaved),
                rotary_embedding(k, cos, sin, interleaved))
    # eager: a signature seen before was checked then (eager.py)
    key = (eager.tensor_key(q), eager.tensor_key(k), eager.tensor_key(cos),
           eager.tensor_key(sin), eager.option_key(interleaved), torch.is_grad_enabled())
    return _ROTARY_QK.call(key, lambda: _prepare_qk(q, k, cos, sin, interleaved), q, k, cos, sin)


_ROTARY_QK = eager.Prepared()


def _prepare_qk(q, k, cos, sin, interleaved):
    """After checking an eager rotary_embedding_qk call, `run(q, k, cos, sin)`
    for calls like it: a pair (_pair) in one launch each way, through
    autograd when it records them; else each rotated on its own."""
    fn = "rotary_embedding_qk"
    _check(q, cos, sin, "q", fn=fn)
    if hasattr(k, "device"):        # (k on another device than q: said so, not of cos)
        checks.like(fn, "k", k, "q", q, dtype=False)
    pair = _pair(q, k)
    _check(k, _positions(cos), _positions(sin), "k", tables=not pair, fn=fn)  # (a pair's fit k)
    _check_interleaved(interleaved, fn)
    checks.on_cuda(fn, "q", q)
    checks.on_cuda(fn, "k", k)
    if not pair or q.requires_grad != k.requires_grad:   # (outputs need grad as inputs)
        return lambda q, k, cos, sin: (rotary_embedding(q, cos, sin, interleaved),
                                       rotary_embedding(k, cos, sin, interleaved))
    _warn_tables_get_no_gradient(fn, cos, sin)     # (one at a time: rotary_embedding's warn)
    return _planned_eager((q, k), cos, interleaved)


def _planned_eager(xs, cos, interleaved):
    """`run(*xs, cos, sin) -> ys` for eager calls like this checked one (one
    tensor, or q and k of a pair), its launches planned once and bound to the
    signature (planned), through autograd when it records them."""
    import torch
    per_batch = _positions(cos).dim() == 3
    forward = planned(xs, per_batch, interleaved, same_signature=True)
    if torch.is_grad_enabled() and xs[0].requires_grad:
        from tk_mlir.kernels import custom_ops
        backward = planned(xs, per_batch, interleaved, inverse=True, gradients=True)
        return lambda *args: custom_ops.EagerRotation.apply(
            *args[:-2], _positions(args[-2]), _positions(args[-1]), forward, backward)
    return lambda *args: forward(*args[:-2], _positions(args[-2]), _positions(args[-1]))


def _pair(q, k) -> bool:
    """Whether q and k can share one launch: 4-D tensors of one (B, N, ., D),
    dtype and device (otherwise each goes its own way, with its own checks)."""
    import torch
    return (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4
            and k.dim() == 4 and q.shape[:2] == k.shape[:2] and q.shape[3] == k.shape[3]
            and q.dtype == k.dtype and q.device == k.device)


def launch(x, cos, sin, inverse: bool = False, interleaved: bool = False):
    """rotary_kernel on checked tensors: a new output (rotated back with
    inverse). x may also be a gradient autograd hands over (expanded, at any
    offset): read from an aligned copy then."""
    return planned((x,), cos.dim() == 3, interleaved, inverse)(x, cos, sin)[0]


def planned(xs, per_batch: bool, interleaved: bool, inverse: bool = False,
            same_signature: bool = False, gradients: bool = False):
    """`launch(*xs, cos, sin) -> ys` (a tuple): the rotation of one checked tensor
    (rotary_kernel) or of q and k (rotary_qk_kernel) laid out as `xs` (cos
    and sin as the kernels index them, _positions), its launch made once.
    same_signature: every call's tensors are laid out as these (an eager
    signature's), and the launch reads their addresses alone
    (eager.launcher). gradients: the calls pass the gradients of the
    rotations' outputs (the backward, bound to their layout): each is copied
    into the outputs' (contiguous) where autograd hands it otherwise."""
    import torch
    shapes = [tuple(x.shape) for x in xs]
    B, N, _, D = shapes[0]
    heads = [tile_rows(shape[2]) for shape in shapes]
    kernel, grid, rows = ((rotary_kernel, (N, B), dict(HB=heads[0])) if len(xs) == 1 else
                          (rotary_qk_kernel, (N, B, 2), dict(HBQ=heads[0], HBK=heads[1])))
    run = eager.launcher(kernel, same_signature or gradients)(
        grid, **rows, HALF=D // 2, PER_BATCH=per_batch, INVERSE=inverse,
        INTERLEAVED=interleaved)
    dtype, device = xs[0].dtype, xs[0].device
    strides = [contiguous_strides(shape) for shape in shapes]
    # (decided once: whether the kernels read such tensors as they lie)
    as_they_lie = not gradients and all(checks.kernel_operand(x) is x for x in xs)
    empty = not any(x.numel() for x in xs)

    def launch(*args):
        *xs, cos, sin = args
        if gradients:
            xs = [eager.laid_out(x, shape, st, dtype) for x, shape, st in zip(xs, shapes, strides)]
        elif not as_they_lie:
            xs = [checks.kernel_operand(x) for x in xs]
        ys = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        if not empty:
            run(*xs, *_tables(cos, sin, interleaved), *ys)
        return tuple(ys)
    return launch


def _tables(cos, sin, interleaved: bool):
    """cos and sin flat, as the kernels read them; interleaved: each angle
    twice, for both elements of its pair (a copy per call)."""
    if interleaved:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    return checks.kernel_operand(cos.reshape(-1)), checks.kernel_operand(sin.reshape(-1))


def _positions(t):
    """A checked cos or sin table as the kernels index it: (N', D/2) (rows
    past N unread) or (B, N, D/2); a (1, N', D/2) one, or one whose batch
    dim steps by 0 (an expanded table), as (N', D/2)."""
    return t[0] if t.dim() == 3 and (t.shape[0] == 1 or t.stride(0) == 0) else t


def _warn_tables_get_no_gradient(fn: str, cos, sin) -> None:
    """A warning where autograd would record a call whose cos or sin requires
    grad: the rotation is differentiable in x only (a learned angle table
    would silently get none)."""
    import torch
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        import warnings
        from tk_mlir.errors import user_stacklevel
        warnings.warn(f"{fn} is differentiable in its inputs, not in cos and sin: the angle "
                      f"tables, which require grad, get no gradient from it (detach them, or "
                      f"rotate in torch to train them)", stacklevel=user_stacklevel())


def _check(x, cos, sin, what: str = "x", tables: bool = True,
           fn: str = "rotary_embedding") -> None:
    """x (named `what` in errors, of function `fn`), cos and sin as the
    kernels take them (without `tables`, cos and sin are known to fit x
    already)."""
    import torch
    checks.tensor(fn, what, x, ndim=4, dtypes=(torch.bfloat16, torch.float16))
    B, N, H, D = x.shape
    if D % 16:
        raise ValueError(f"{fn}: {what}'s head dim D must be a multiple of 16 (halves of whole "
                         f"16-byte vectors), got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{fn}: {what}'s last dim must be contiguous (stride 1), got strides "
                         f"{tuple(x.stride())}")
    if tile_rows(H) > max_rows(D // 2):
        raise ValueError(f"{fn}: {what} has {H} heads; a position's heads are one tile's rows, "
                         f"at most {max_rows(D // 2)} (rotate the heads in groups)")
    if tables:
        for name, t in (("cos", cos), ("sin", sin)):
            checks.tensor(fn, name, t, dtypes=(x.dtype, torch.float32))
            checks.like(fn, name, t, what, x, dtype=False)
            per_sequence = tuple(t.shape) == (B, N, D // 2)
            # (positions, D/2): as it is, or one _positions reads as that (of
            # batch 1, or expanded over the batch)
            table = t.dim() == 2 or _positions(t) is not t and t.shape[0] in (1, B)
            if not (per_sequence or table and t.shape[-2] >= N and t.shape[-1] == D // 2):
                raise ValueError(f"{fn}: {name} must have shape (N', {D // 2}) or (1, N', "
                                 f"{D // 2}) with N' >= N={N} (positions x half the head dim, "
                                 f"the first N read; or ({B}, N', {D // 2}) expanded from one), "
                                 f"or ({B}, {N}, {D // 2}) (per sequence), "
                                 f"for {what} of shape {tuple(x.shape)}; got "
                                 f"{tuple(t.shape)}")
            if not _positions(t).is_contiguous():
                raise ValueError(f"{fn}: {name} must be contiguous (or an expanded view of a "
                                 f"contiguous (N', {D // 2}) table), got strides "
                                 f"{tuple(t.stride())}")
        if cos.dtype != sin.dtype:
            raise TypeError(f"{fn}: cos and sin must have one dtype, got {cos.dtype} and "
                            f"{sin.dtype}")
        if cos.shape != sin.shape:
            raise ValueError(f"{fn}: cos and sin must have one shape, got {tuple(cos.shape)} and "
                             f"{tuple(sin.shape)}")
        if _positions(cos).dim() != _positions(sin).dim():     # (one reading for both)
            raise ValueError(f"{fn}: cos and sin must both be per sequence ({B}, {N}, {D // 2}) "
                             f"or both one table (2-D, batch 1, or expanded over the batch); "
                             f"got strides {tuple(cos.stride())} and {tuple(sin.stride())}")
