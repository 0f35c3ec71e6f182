"""Losses on torch tensors: cross_entropy and linear_cross_entropy, forward
and backward.

    from tk_mlir.kernels import cross_entropy, linear_cross_entropy
    loss = cross_entropy(logits, target)          # as F.cross_entropy on (N, V) logits
    loss = linear_cross_entropy(h, weight, target)   # cross_entropy(h @ weight.T, target),
                                                     # never holding all the logits

One block per row of logits walks the vocabulary CHUNK columns at a time
with an online log-sum-exp (the running max and the sum rescaled to it), so
a 128k vocabulary never sits in registers at once; the backward walks it
again from the saved log-sum-exp, writing softmax minus the smoothed target
distribution, scaled by the row's share of the loss's gradient. Math in f32.
"""
from __future__ import annotations

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels import checks

CHUNK = 2048        # vocabulary columns a block reads per chunk (8 per thread of 8 warps)
FLOOR = -3.4028234663852886e38  # the running maxima's start: f32's lowest, at or below
                                 # every finite logit, and finite (-inf - -inf is NaN)


@tk.kernel(num_warps=8)
def cross_entropy_kernel(X: tk.gl, T: tk.gl["i32"], LOSS: tk.gl[f32], LSE: tk.gl[f32],
                         V: int, ignore_index: int, smoothing: float,
                         CHUNK: tk.constexpr = CHUNK, OUTSIDE_NAN: tk.constexpr = True):
    """Per row r of X's first V columns (N x V logits; X may be wider: its
    rows padded to whole 16-byte vectors) with target t = T[r]: LSE[r] =
    logsumexp(X[r]) and LOSS[r] = LSE[r] - (1 - smoothing)·X[r, t] -
    smoothing·mean(X[r]); 0 where t is ignore_index, NaN where t is outside
    [0, V) (a wrong target is never a silent number). Without OUTSIDE_NAN, X
    is one slice of a wider row's classes: a target outside it adds no
    logit. One row per block."""
    row_loss(X, T, LOSS, LSE, tk.block_id(0), V, ignore_index, smoothing, CHUNK, OUTSIDE_NAN)


@tk.func
def row_loss(X, T, LOSS, LSE, row, v, ignore_index, smoothing, CHUNK, OUTSIDE_NAN):
    """cross_entropy_kernel's work for one row of v classes: LOSS[row] and
    LSE[row]; returns the row's (target, lse vector)."""
    t = tk.load(T, (row,))
    # Each column of a CHUNK-wide tile keeps its own running max m, sum s (of
    # exp(x - m)), target logit and sum over the chunks it sees; the columns
    # meet once, at the end, so no step waits on a reduction across warps.
    m = tk.full((1, CHUNK), FLOOR)
    s, x_t, x_sum = tk.zeros((1, CHUNK)), tk.zeros((1, CHUNK)), tk.zeros((1, CHUNK))
    for c0 in range(0, tk.cdiv(v, CHUNK), 2):     # two chunks' loads issued together
        x0 = tk.load(X, (row, c0), (1, CHUNK)).to(f32)
        x1 = tk.load(X, (row, c0 + 1), (1, CHUNK)).to(f32)    # (zeros past V, masked)
        m, s, x_t, x_sum = logsumexp_step(x0, c0 * CHUNK, v, t, m, s, x_t, x_sum)
        m, s, x_t, x_sum = logsumexp_step(x1, (c0 + 1) * CHUNK, v, t, m, s, x_t, x_sum)
    top = m.row_max()
    log_s = (s * m.sub_row(top).exp()).row_sum().log()
    lse = top + log_s
    # lse - x_t as log_s + (top - x_t): top and x_t are logits (the difference
    # exact), so a large shared offset of the row does not round the loss away
    loss = log_s + (1.0 - smoothing) * (top - x_t.row_sum())
    if smoothing != 0.0:        # (0 · x_sum is NaN when a logit is -inf)
        loss = loss + smoothing * (top - x_sum.row_sum() * (1.0 / float(v)))
    if OUTSIDE_NAN:
        if (t < 0) | (t >= v):
            loss = loss * float("nan")
    # An ignored row's loss is replaced, not multiplied by 0 (0 · inf is NaN):
    # the scalar test as a mask, loss.indices() being 0.
    tk.store(LOSS, tk.where(loss.indices() + t == ignore_index, 0.0, loss), (row,))
    tk.store(LSE, lse, (row,))
    return t, lse


@tk.func
def logsumexp_step(x, first, v, t, m, s, x_t, x_sum):
    """The per-column running state after chunk x, whose first column is
    `first` (columns past v masked: -inf before exp, 0 in the sum). One
    exp per element: exp(min - max) of x and m is either s's rescaling (x
    above m: s·e + 1) or x's term (s + e)."""
    cols = x.col_indices() + first
    inside = cols < v
    xm = tk.where(inside, x, float("-inf"))
    m_new = max(m, xm)
    e = (min(m, xm) - m_new).exp()
    s = tk.where(xm > m, s * e + 1.0, s + e)
    return m_new, s, x_t + tk.where(cols == t, x, 0.0), x_sum + tk.where(inside, x, 0.0)


@tk.kernel(num_warps=8)
def cross_entropy_backward_kernel(X: tk.gl, T: tk.gl["i32"], LSE: tk.gl[f32],
                                  SCALE: tk.gl[f32], DX: tk.gl, V: int, ignore_index: int,
                                  smoothing: float, CHUNK: tk.constexpr = CHUNK):
    """DX[r] = SCALE[r]·(softmax(X[r]) - (1 - smoothing)·onehot(T[r]) -
    smoothing / V) over X's first V columns (DX's columns past them, if any,
    are 0), from the forward's LSE; 0 where T[r] is ignore_index. SCALE: the
    loss's gradient per row (for mean: dloss / count). DX may be X itself
    (the gradient in place: each step loads before it stores)."""
    row = tk.block_id(0)
    row_grad(X, DX, row, tk.load(T, (row,)), tk.load(LSE, (row,), (1,)), SCALE, V,
             ignore_index, smoothing, CHUNK)


@tk.kernel(num_warps=8)
def cross_entropy_with_grad_kernel(X: tk.gl, T: tk.gl["i32"], LOSS: tk.gl[f32],
                                   LSE: tk.gl[f32], SCALE: tk.gl[f32], V: int,
                                   ignore_index: int, CHUNK: tk.constexpr = CHUNK):
    """cross_entropy_kernel's LOSS and LSE (no smoothing, targets over the
    whole row of V classes), then X turned in place into its gradient as
    cross_entropy_backward_kernel makes it, by the same block: one launch
    for linear_cross_entropy's forward, which knows each row's SCALE then
    (its second walk of a row may find it in L2)."""
    row = tk.block_id(0)
    t, lse = row_loss(X, T, LOSS, LSE, row, V, ignore_index, 0.0, CHUNK, True)
    row_grad(X, X, row, t, lse, SCALE, V, ignore_index, 0.0, CHUNK)


@tk.func
def row_grad(X, DX, row, t, lse, SCALE, v, ignore_index, smoothing, CHUNK):
    """cross_entropy_backward_kernel's work for one row of v classes (t its
    target, lse its log-sum-exp as a vector of one)."""
    g = tk.load(SCALE, (row,), (1,))
    for c0 in range(0, tk.cdiv(v, CHUNK), 2):     # two chunks' loads, then their stores
        x0 = tk.load(X, (row, c0), (1, CHUNK)).to(f32)
        x1 = tk.load(X, (row, c0 + 1), (1, CHUNK)).to(f32)    # (past V: read 0, not stored)
        tk.store(DX, softmax_grad(x0, c0 * CHUNK, v, t, lse, g, ignore_index, smoothing)
                 .to(DX.dtype), (row, c0))
        tk.store(DX, softmax_grad(x1, (c0 + 1) * CHUNK, v, t, lse, g, ignore_index, smoothing)
                 .to(DX.dtype), (row, c0 + 1))


@tk.func
def softmax_grad(x, first, v, t, lse, g, ignore_index, smoothing):
    """A chunk's gradient, its first column `first`: g·(exp(x - lse) - the
    smoothed target), 0 in an ignored row (its lse may be -inf, its scale
    inf) and in the columns past v (a padded row's: a GEMM reads them)."""
    cols = x.col_indices() + first
    d = x.sub_row(lse).exp() - tk.where(cols == t, 1.0 - smoothing, 0.0) - smoothing / float(v)
    return tk.where((cols * 0 + t == ignore_index) | (cols >= v), 0.0, d.mul_row(g))


REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(logits, target, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0):
    """torch.nn.functional.cross_entropy for (N, V) logits and (N,) class
    targets: the loss per row is logsumexp(logits) - (1 - label_smoothing)·
    logits[target] - label_smoothing·mean(logits); rows whose target is
    ignore_index count 0 and are left out of the mean (all ignored: NaN, as
    torch). A target outside [0, V) gives NaN (torch asserts on the device).

    logits: bf16, f16 or f32 CUDA tensor of any V and strides (rows that are
    not whole 16-byte vectors, V not a multiple of 8 (f32: 4), and views the
    kernels cannot read as they lie go through a copy); target: an integer
    tensor on its device. reduction: "mean", "sum" or "none". Differentiable
    in logits; under torch.compile the custom op torch.ops.tk_mlir.cross_entropy."""
    import torch
    ignore_index, label_smoothing = _check(logits, target, ignore_index, reduction,
                                           label_smoothing)
    from tk_mlir.kernels import custom_ops
    args = (logits, target, ignore_index, reduction, label_smoothing)
    if torch.compiler.is_compiling():
        return torch.ops.tk_mlir.cross_entropy(*args)[0]
    if torch.is_grad_enabled() and logits.requires_grad:
        return custom_ops.EagerCrossEntropy.apply(*args)[0]
    return launch(*args)[0]


def launch(logits, target, ignore_index: int, reduction: str, label_smoothing: float):
    """(loss, lse) of cross_entropy_kernel on checked arguments: loss reduced
    as asked, lse (N,) f32 (kept for the backward)."""
    import torch
    from tk_mlir.kernels import gemm
    n, v = logits.shape
    x = gemm.padded_rows(logits)     # (rows not whole vectors: zeros past V, which it takes)
    rows = -(-n // 4) * 4                       # f32 vectors of whole 16-byte rows
    loss_rows = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if n:
        cross_entropy_kernel[(n,)](x, _targets(target, rows, v, ignore_index), loss_rows,
                                   lse, v, ignore_index, label_smoothing)
    return _reduced(loss_rows[:n], target, ignore_index, reduction).to(logits.dtype), lse[:n]


def _reduced(loss, target, ignore_index: int, reduction: str):
    """Per-row losses reduced as F.cross_entropy does: "none" as they are,
    "sum", or "mean" over the rows not ignored (NaN when all are, as torch)."""
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (target != ignore_index).sum()
    return loss


def cross_entropy_backward(dloss, logits, target, lse, ignore_index: int, reduction: str,
                           label_smoothing: float):
    """d logits of cross_entropy given the loss's gradient dloss (a scalar,
    or (N,) with reduction="none") and the forward's lse."""
    import torch
    from tk_mlir.kernels import gemm
    n, v = logits.shape
    x = gemm.padded_rows(logits)
    rows = -(-n // 4) * 4
    targets = _targets(target, rows, v, ignore_index)
    scale = _row_scale(dloss, targets, n, ignore_index, reduction, v)
    lse_rows = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse_rows[:n] = lse
    dx = torch.empty_like(x)
    if n:
        cross_entropy_backward_kernel[(n,)](x, targets, lse_rows, scale, dx, v, ignore_index,
                                            label_smoothing)
    del x               # (a padded copy: freed before dx's unpadded one is made)
    return dx if dx.shape[1] == v else dx[:, :v].contiguous()


def _row_scale(dloss, targets, n: int, ignore_index: int, reduction: str, v: int):
    """Each row's share of the loss's gradient, (rows,) f32 like `targets`
    (_targets' vector; the first n used): dloss per row ("none"), dloss
    ("sum") or dloss / the rows not ignored ("mean"); 0 for an ignored row
    (not an inf from 1/0 when every row is ignored), NaN for a target outside
    [0, v) (its loss is NaN: its gradient is never a silent number either)."""
    import torch
    target = targets[:n]
    per_row = dloss.float() if reduction == "none" else \
        (dloss.float() / ((target != ignore_index).sum() if reduction == "mean" else 1)).expand(n)
    per_row = torch.where(target == _outside(v, ignore_index), float("nan"), per_row)
    scale = torch.empty(targets.shape[0], dtype=torch.float32, device=targets.device)
    scale[:n] = torch.where(target == ignore_index, 0.0, per_row)
    return scale


def _outside(v: int, ignore_index: int) -> int:
    """What _targets makes of a target outside [0, v) that is not ignore_index."""
    return v if v != ignore_index else v + 1


def _targets(target, rows: int, v: int, ignore_index: int):
    """target as int32 in a vector of `rows` (N rounded up to whole 16-byte
    vectors; the kernels read the first N). A target outside [0, v) that is
    not ignore_index becomes _outside(v, ignore_index) first (an int64 one
    could otherwise wrap into a class or into ignore_index); ignore_index
    stays itself."""
    import torch
    valid = ((target >= 0) & (target < v)) | (target == ignore_index)
    target = torch.where(valid, target, _outside(v, ignore_index))
    out = torch.empty(rows, dtype=torch.int32, device=target.device)
    out[:target.shape[0]] = target
    return out


def _in_slice(targets, ignore_index: int, first: int):
    """_targets' vector as indices into the vocabulary slice starting at
    class `first` (ignore_index stays itself)."""
    import torch
    return targets if not first else \
        torch.where(targets == ignore_index, targets, targets - first)


def _check(logits, target, ignore_index, reduction, label_smoothing, fn="cross_entropy"):
    """The arguments of cross_entropy (or of `fn`, its backward op)."""
    import torch
    checks.tensor(fn, "logits", logits, ndim=2,
                  dtypes=(torch.bfloat16, torch.float16, torch.float32))
    if logits.shape[1] == 0:
        raise ValueError(f"{fn}: logits must have at least one class, got shape "
                         f"{tuple(logits.shape)}")
    ignore_index = _check_targets(fn, target, "logits", logits, ignore_index, reduction)
    label_smoothing = checks.number(fn, "label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{fn}: label_smoothing must be in [0, 1], got {label_smoothing}")
    checks.on_cuda(fn, "logits", logits)
    return ignore_index, label_smoothing


# ------------------------------------------------------ linear cross-entropy

# Logits a linear_cross_entropy step holds at once (bytes): the vocabulary is
# cut into slices of at most this many N x slice logits, and a scalar loss's
# rows into chunks of at most this many chunk x V logits.
LOGITS_SLICE_BYTES = 1 << 30
# A scalar loss's row chunks take at least this many rows: each chunk's share
# of dweight is added into it, a read and write of all of dweight, which
# costs as much as the share's product at ~400 rows on an H200, ~10% of it at
# 1024 (BENCHMARKS.md, issue 25). Lower it to hold fewer logits: at 256 (with
# 4096-wide h and a 128k vocabulary, Liger's own chunk) the peak is Liger's and
# the time 1.8x; at 512, 0.9x the peak for 1.2x the time.
MIN_CHUNK_ROWS = 1024
_NO_CLASS = -2**31        # an ignore_index no shifted target equals (ignored rows: scale 0)


def linear_cross_entropy(h, weight, target, ignore_index: int = -100, reduction: str = "mean",
                         low_memory: bool = False):
    """cross_entropy(h @ weight.T, target) without the (N, V) logits: the
    vocabulary is cut into slices (LOGITS_SLICE_BYTES of logits at a time);
    per slice a GEMM makes its logits and cross_entropy_kernel its
    log-sum-exp and target logit, combined over slices on the host's
    stream. The backward makes each slice's logits again, turns them into
    their gradient in place, and takes the slice's dweight rows and its
    share of dh as GEMMs (the transposed operand read as K x M). A call
    with a scalar loss ("mean", "sum") that needs gradients makes them in
    its forward instead, over chunks of rows and the whole vocabulary (the
    larger of h's size and MIN_CHUNK_ROWS rows of logits at a time), each
    chunk's share of dweight added into it: beyond the gradients it holds
    one chunk's logits (on Blackwell, whose GEMM only stores, also a
    dweight-sized product to add).

    low_memory=True holds less, for more work: every slice of logits is no
    larger than h, nor than Liger's row chunk (`_slices`; but at least 256
    classes, more than h for H < 256), and a scalar loss's gradients come
    from a second pass over the slices (as the backward's), each slice's
    dweight rows stored and its share of dh added into dh in h's dtype:
    beyond the gradients, one slice of logits (on Blackwell also a dh-sized
    product to add), for the work of 4 GEMMs instead of 3 (dh rounded once
    per slice, as Liger's dweight once per row chunk).

    h: (N, H) bf16 or f16; weight: (V, H), h's dtype (a Linear's weight;
    V not a multiple of 8, as GPT-2's 50257, through a copy with zero rows
    to whole 16-byte vectors of logits); target: (N,) class indices,
    ignore_index as cross_entropy. H a multiple of 8, h's and weight's last
    dim (H) contiguous. reduction:
    "mean", "sum" or "none". Differentiable in h and weight; under
    torch.compile the custom op
    torch.ops.tk_mlir.linear_cross_entropy, or
    torch.ops.tk_mlir.linear_cross_entropy_with_grads for a scalar loss
    whose h or weight requires grad."""
    import torch
    ignore_index = _check_linear(h, weight, target, ignore_index, reduction)
    if not isinstance(low_memory, bool):
        raise TypeError(f"linear_cross_entropy: low_memory must be a bool, got {low_memory!r}")
    args = (h, weight, target, ignore_index, reduction, low_memory)
    from tk_mlir.kernels import custom_ops
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if torch.compiler.is_compiling():
        if grads and reduction != "none":
            return torch.ops.tk_mlir.linear_cross_entropy_with_grads(
                *args[:5], h.requires_grad, weight.requires_grad, low_memory)[0]
        return torch.ops.tk_mlir.linear_cross_entropy(*args)[0]
    if grads:
        return custom_ops.EagerLinearCrossEntropy.apply(*args)[0]
    return linear_forward(*args)[0]


def _padded_vocabulary(weight):
    """weight (V, H), or for V not a multiple of 8 a copy with zero rows
    after it up to one (whose logits, 0, the kernels mask: they take the true
    V): the GEMMs' N or K is then whole 16-byte vectors of logits."""
    v = weight.shape[0]
    if v % 8 == 0:
        return weight
    padded = weight.new_zeros(-(-v // 8) * 8, weight.shape[1])
    padded[:v] = weight
    return padded


def _slices(h, v: int, low_memory: bool):
    """(first, end) of the vocabulary slices for h's rows: as many classes as
    LOGITS_SLICE_BYTES of logits hold, a multiple of 256. low_memory: at
    most V / ceil(V / H) classes (logits no larger than h, nor than Liger's
    row chunk, whose ceil(N / ceil(V / H)) rows it rounds up to a power of
    two), a multiple of 128 unless that is all of V; at least 256."""
    n, hidden = h.shape
    if low_memory:
        per = -(-v // hidden)
        width = v if per == 1 else max(256, v // per // 128 * 128)
    else:
        width = max(256, LOGITS_SLICE_BYTES // (2 * max(n, 1)) // 256 * 256)
    return [(v0, min(v0 + width, v)) for v0 in range(0, v, width)]


def linear_forward(h, weight, target, ignore_index: int, reduction: str,
                   low_memory: bool = False):
    """(loss, lse) of linear_cross_entropy on checked arguments: lse (N,) f32
    over the whole vocabulary, kept for the backward."""
    import torch
    from tk_mlir.kernels import gemm
    n, v = h.shape[0], weight.shape[0]
    weight = _padded_vocabulary(weight)
    rows = -(-n // 4) * 4
    lse_parts, x_t = [], torch.zeros(n, dtype=torch.float32, device=h.device)
    part_loss = torch.empty(rows, dtype=torch.float32, device=h.device)
    targets = _targets(target, rows, v, ignore_index)
    for v0, v1 in _slices(h, weight.shape[0], low_memory):
        logits = torch.empty(n, v1 - v0, dtype=h.dtype, device=h.device)
        gemm.launch(h, weight[v0:v1], logits, "nk")
        lse = torch.empty(rows, dtype=torch.float32, device=h.device)
        if n:
            cross_entropy_kernel[(n,)](logits, _in_slice(targets, ignore_index, v0),
                                       part_loss, lse, min(v1, v) - v0, _NO_CLASS, 0.0,
                                       OUTSIDE_NAN=False)
        lse_parts.append(lse[:n])
        x_t += lse[:n] - part_loss[:n]           # the target's logit, where it is in the slice
        del logits                                  # (freed before the next slice's)
    lse = torch.stack(lse_parts).logsumexp(0)
    mine = targets[:n]              # (an invalid target is _outside(v, ignore_index) there)
    loss = torch.where(mine == ignore_index, 0.0,
                       torch.where(mine == _outside(v, ignore_index), float("nan"), lse - x_t))
    return _reduced(loss, target, ignore_index, reduction).to(h.dtype), lse


def linear_forward_with_grads(h, weight, target, ignore_index: int, reduction: str,
                              need_h: bool, need_weight: bool, low_memory: bool = False):
    """(loss, lse, dh, dweight) of linear_cross_entropy for a scalar loss
    ("mean" or "sum"), the gradients those of dloss = 1 (the backward scales
    them): Liger's order, so the backward makes no logits again (3 GEMMs'
    work, not 4). Rows go in chunks (`_chunk_rows`) over the whole
    vocabulary, so each chunk's log-sum-exp is final and its logits turn
    into their gradient in place; each chunk's share of dweight is added
    into it by its GEMM (in dweight's dtype, as Liger's addmm does).
    low_memory: linear_forward's slices, then linear_backward's for dloss = 1
    (the logits made twice, in slices no larger than h)."""
    import torch
    from tk_mlir.kernels import gemm
    if low_memory:
        loss, lse = linear_forward(h, weight, target, ignore_index, reduction, True)
        dh, dw = linear_backward(torch.ones((), device=h.device), h, weight, target, lse,
                                 ignore_index, reduction, need_h, need_weight, True)
        return loss, lse, dh, dw
    n, v = h.shape[0], weight.shape[0]
    weight = _padded_vocabulary(weight)
    rows = -(-n // 4) * 4
    targets = _targets(target, rows, v, ignore_index)
    scale = _row_scale(torch.ones((), device=h.device), targets, n, ignore_index, reduction, v)
    loss_rows = torch.empty(rows, dtype=torch.float32, device=h.device)
    lse = torch.empty(rows, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if need_h else h.new_empty(0)
    dw = torch.empty_like(weight) if need_weight else weight.new_empty(0)
    chunk = _chunk_rows(n, h.shape[1], weight.shape[0])
    for r0 in range(0, n, chunk):
        r1 = min(r0 + chunk, n)
        logits = torch.empty(r1 - r0, weight.shape[0], dtype=h.dtype, device=h.device)
        gemm.launch(h[r0:r1], weight, logits, "nk")
        part = slice(r0, r0 + -(-(r1 - r0) // 4) * 4)           # whole 16-byte rows
        cross_entropy_with_grad_kernel[(r1 - r0,)](logits, targets[part], loss_rows[part],
                                                   lse[part], scale[part], v, ignore_index)
        if need_h:
            gemm.launch(logits, weight, dh[r0:r1], "kn")              # dh rows: dlogits·W
        if need_weight:                                               # dW (+)= dlogitsᵀ·h
            gemm.launch(logits, h[r0:r1], dw, "kn", a_layout="km", accumulate=r0 > 0)
        del logits                                  # (freed before the next chunk's)
    if not n and need_weight:
        dw.zero_()
    loss = _reduced(loss_rows[:n], target, ignore_index, reduction)
    return loss.to(h.dtype), lse[:n], dh, (dw[:v] if need_weight else dw)


# scale_unless_one_kernel's tile: 16-byte loads, 8 per thread of 4 warps.
SCALE_TILE = (16, 256)


@tk.kernel(num_warps=4)
def scale_unless_one_kernel(X: tk.gl, S: tk.gl[f32]):
    """X *= S (a 0-d f32 on the device) in place, unless S is 1: then every
    block returns at once. A persistent grid walks X's tiles. For gradients
    made for dloss = 1 ahead of the backward: the usual dloss is 1, and
    reading it on the host would wait for the GPU."""
    s = tk.load(S, ())
    if s != 1.0:
        cols = tk.cdiv(X.shape[1], SCALE_TILE[1])
        for t in range(tk.block_id(0), tk.cdiv(X.shape[0], SCALE_TILE[0]) * cols,
                       tk.grid_dim(0)):
            at = (t // cols, t % cols)
            tk.store(X, tk.load(X, at, SCALE_TILE) * s, at)


def scale_unless_one(grads, dloss) -> None:
    """Each of grads (2-D tensors with whole 16-byte rows, contiguous) *= dloss
    in place, no work when dloss is 1 (scale_unless_one_kernel)."""
    import torch
    from tk_mlir.kernels.device import num_sms
    s = dloss.to(torch.float32)
    for g in grads:
        if g.numel():
            tiles = tk.cdiv(g.shape[0], SCALE_TILE[0]) * tk.cdiv(g.shape[1], SCALE_TILE[1])
            scale_unless_one_kernel[(min(tiles, 4 * num_sms(g.get_device())),)](g, s)


def _chunk_rows(n: int, hidden: int, v: int) -> int:
    """Rows per chunk of linear_forward_with_grads, in multiples of 128: as
    many as keep the chunk's logits no larger than h (Liger's rule), but at
    least MIN_CHUNK_ROWS, and within LOGITS_SLICE_BYTES (at least 128)."""
    rows = max(n * hidden // v, MIN_CHUNK_ROWS)
    return max(128, min(rows, LOGITS_SLICE_BYTES // (2 * v)) // 128 * 128)


def linear_backward(dloss, h, weight, target, lse, ignore_index: int, reduction: str,
                    need_h: bool = True, need_weight: bool = True, low_memory: bool = False):
    """(dh, dweight) of linear_cross_entropy given the loss's gradient and the
    forward's lse; a gradient not needed is not computed (an empty tensor
    stands for it). dh sums a product per vocabulary slice: in f32, rounded
    once at the end; with low_memory in h's dtype, each added by its GEMM
    (no f32 copies of dh, a rounding per slice)."""
    import torch
    from tk_mlir.kernels import gemm
    n, v = h.shape[0], weight.shape[0]
    weight = _padded_vocabulary(weight)
    rows = -(-n // 4) * 4
    targets = _targets(target, rows, v, ignore_index)
    scale = _row_scale(dloss, targets, n, ignore_index, reduction, v)
    lse_rows = torch.empty(rows, dtype=torch.float32, device=h.device)
    lse_rows[:n] = lse
    dh = dh_part = None
    if need_h:
        dh = torch.empty_like(h) if low_memory else \
            torch.zeros(n, h.shape[1], dtype=torch.float32, device=h.device)
        dh_part = None if low_memory else torch.empty_like(dh)
    dw = torch.empty_like(weight) if need_weight else None
    for i, (v0, v1) in enumerate(_slices(h, weight.shape[0], low_memory)):
        logits = torch.empty(n, v1 - v0, dtype=h.dtype, device=h.device)
        w = weight[v0:v1]
        gemm.launch(h, w, logits, "nk")
        if n:       # the slice's logits become their gradient, in place
            cross_entropy_backward_kernel[(n,)](
                logits, _in_slice(targets, ignore_index, v0), lse_rows, scale, logits,
                min(v1, v) - v0, _NO_CLASS, 0.0)
        if need_weight:
            gemm.launch(logits, h, dw[v0:v1], "kn", a_layout="km")     # dW rows: dlogitsᵀ·h
        if need_h and low_memory:
            gemm.launch(logits, w, dh, "kn", accumulate=i > 0)          # dh (+)= dlogits·W
        elif need_h:
            gemm.launch(logits, w, dh_part, "kn")                        # dh += dlogits·W
            dh += dh_part
        del logits                                  # (freed before the next slice's)
    empty = h.new_empty(0)
    return (dh.to(h.dtype) if need_h else empty), (dw[:v] if need_weight else empty)


def _check_linear(h, weight, target, ignore_index, reduction,
                  fn: str = "linear_cross_entropy") -> int:
    """The arguments of linear_cross_entropy (or of `fn`, one of its ops):
    returns ignore_index as an int."""
    import torch
    checks.tensor(fn, "h", h, ndim=2, dtypes=(torch.bfloat16, torch.float16))
    checks.tensor(fn, "weight", weight, ndim=2, dtypes=(torch.bfloat16, torch.float16))
    checks.like(fn, "weight", weight, "h", h)
    if weight.shape[1] != h.shape[1]:
        raise ValueError(f"{fn}: weight must be (V, H={h.shape[1]}) (a Linear's weight), got "
                         f"{tuple(weight.shape)}")
    for name, t in (("h", h), ("weight", weight)):
        if t.shape[1] % 8:
            raise ValueError(f"{fn}: H ({name}'s last dim) must be a multiple of 8 (rows of "
                             f"whole 16-byte vectors), got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name}'s last dim (H) must be contiguous (stride 1), got "
                             f"strides {tuple(t.stride())} (a transposed view: pass "
                             f"{name}.contiguous())")
    if weight.shape[0] == 0:
        raise ValueError(f"{fn}: the vocabulary V (weight's rows) must not be empty, got "
                         f"shape {tuple(weight.shape)}")
    ignore_index = _check_targets(fn, target, "h", h, ignore_index, reduction)
    checks.on_cuda(fn, "h", h)
    return ignore_index


def _check_targets(fn: str, target, rows_name: str, rows, ignore_index, reduction) -> int:
    """target: one class index per row of `rows`, on its device; reduction and
    ignore_index are ones the kernels take. Returns ignore_index as an int."""
    import torch
    checks.tensor(fn, "target", target, dtypes=(target.dtype,) if isinstance(
        target, torch.Tensor) else ())                          # (a dense tensor; dtype below)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{fn}: target must hold class indices (torch.int64 or torch.int32), "
                        f"got {target.dtype}")
    checks.shape(fn, "target", target, (rows.shape[0],), f"one class per row of {rows_name}")
    checks.like(fn, "target", target, rows_name, rows, dtype=False)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return _check_ignore_index(fn, ignore_index)


def _check_ignore_index(fn: str, ignore_index) -> int:
    """ignore_index as an int (any integer, a numpy one too), in the kernels' range."""
    import numbers
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{fn}: ignore_index must be an int, got {ignore_index!r}")
    ignore_index = int(ignore_index)
    if not _NO_CLASS < ignore_index < 2**31:
        raise ValueError(f"{fn}: ignore_index must fit in 32 bits and not be -2**31 (reserved), "
                         f"got {ignore_index}")
    return ignore_index
