"""Row normalisations on torch tensors: rms_norm and layer_norm (bf16 or f16),
forward and backward.

A row is one 1 x BLOCK register tile spread over the block's 8 warps (each
thread holds BLOCK / 256 elements, 8 contiguous at a time: 16-byte loads),
so a row sum is a register sum, 5 shuffles and one exchange through shared
memory. Rows of any width D that is a multiple of 8 (whole 16-byte
vectors): BLOCK is the next power of two >= D (at least 256); the columns
past D read as 0 and are not written.
"""
from __future__ import annotations

import contextlib
import math

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels import checks, eager
from tk_mlir.kernels.device import num_sms
from tk_mlir.runtime.arguments import contiguous_strides


@tk.kernel(num_warps=8)
def rmsnorm_kernel(X: tk.gl, W: tk.gl, Y: tk.gl, eps: float,
                   BLOCK: tk.constexpr):
    """Y = X / sqrt(mean(X^2) + eps) * W, one row per block."""
    row = tk.block_id(0)
    x = tk.load(X, (row, 0), (1, BLOCK)).to(f32)
    w = tk.load(W, (0,), (BLOCK,)).to(f32)
    tk.store(Y, rms_normalized(x, w, eps, float(X.shape[1])).to(Y.dtype), (row, 0))


@tk.kernel(num_warps=8)
def layernorm_kernel(X: tk.gl, W: tk.gl, B: tk.gl, Y: tk.gl,
                     eps: float, BLOCK: tk.constexpr, RELOAD_WB: tk.constexpr = False):
    """Y = (X - mean) / sqrt(var + eps) * W + B, per row.

    Persistent: a grid of a few blocks per SM, each walking rows first,
    first + grid, ... and loading the *next* row before normalising the
    current one, so the memory system always has a row in flight per block
    (the loop carries the prefetched row as a register tile in X's dtype). The two
    reductions (mean, then the centred sum of squares: two passes,
    numerically safe) each cost one shared-memory exchange; the centred
    row is masked to 0 past D."""
    first, step = tk.block_id(0), tk.grid_dim(0)
    w = tk.load(W, (0,), (BLOCK,))
    b = tk.load(B, (0,), (BLOCK,))
    nxt = tk.load(X, (first, 0), (1, BLOCK))
    for row in range(first, X.shape[0], step):
        x = nxt.to(f32)
        nxt = tk.load(X, (row + step, 0), (1, BLOCK))     # past the last row: masked
        if RELOAD_WB:    # wide rows: re-read w, b (L1 hits) rather than hold them in registers
            w = tk.load(W, (0,), (BLOCK,))
            b = tk.load(B, (0,), (BLOCK,))
        y = layer_normalized(x, w.to(f32), b.to(f32), eps, X.shape[1])
        tk.store(Y, y.to(Y.dtype), (row, 0))


@tk.func
def rms_normalized(x, w, eps, d):
    """x / sqrt(mean(x^2) + eps) * w for an f32 row x (1 x BLOCK, zeros past
    its d columns) and an f32 w (BLOCK,)."""
    inv_rms = ((x * x).row_sum() * (1.0 / d) + eps).rsqrt()
    return x.mul_row(inv_rms).mul_col(w)


@tk.func
def standardized(x, eps, n):
    """(x - mean) / sqrt(var + eps) and 1 / sqrt(var + eps) of an f32 row x
    (1 x BLOCK, zeros past its n columns), the first 0 past n. The centred
    row is masked there, so the padding adds nothing to the sum of squares
    (subtracting its (BLOCK - n) * mean^2 instead cancels catastrophically
    when the mean is large against the spread)."""
    mean = x.row_sum() * (1.0 / float(n))
    xc = tk.where(x.col_indices() < n, x.sub_row(mean), 0.0)
    rstd = ((xc * xc).row_sum() * (1.0 / float(n)) + eps).rsqrt()
    return xc.mul_row(rstd), rstd


@tk.func
def layer_normalized(x, w, b, eps, n):
    """standardized(x) * w + b for f32 w, b (BLOCK,)."""
    xhat, _ = standardized(x, eps, n)
    return xhat.mul_col(w).add_col(b)


@tk.kernel(num_warps=8)
def add_rmsnorm_kernel(X: tk.gl, R: tk.gl, W: tk.gl, Y: tk.gl,
                       H: tk.gl, eps: float, BLOCK: tk.constexpr):
    """H = X + R, rounded to X's dtype as the unfused sum is, and Y = rms_norm(H) * W:
    a pre-norm block's residual add and norm in one pass, one row per block."""
    row = tk.block_id(0)
    h = (tk.load(X, (row, 0), (1, BLOCK)).to(f32) +
         tk.load(R, (row, 0), (1, BLOCK)).to(f32)).to(H.dtype)
    tk.store(H, h, (row, 0))
    w = tk.load(W, (0,), (BLOCK,)).to(f32)
    tk.store(Y, rms_normalized(h.to(f32), w, eps, float(X.shape[1])).to(Y.dtype),
             (row, 0))


@tk.kernel(num_warps=8)
def add_layernorm_kernel(X: tk.gl, R: tk.gl, W: tk.gl, B: tk.gl,
                         Y: tk.gl, H: tk.gl, eps: float, BLOCK: tk.constexpr):
    """H = X + R (in X's dtype) and Y = layer_norm(H) * W + B, one row per block."""
    row = tk.block_id(0)
    h = (tk.load(X, (row, 0), (1, BLOCK)).to(f32) +
         tk.load(R, (row, 0), (1, BLOCK)).to(f32)).to(H.dtype)
    tk.store(H, h, (row, 0))
    w, b = tk.load(W, (0,), (BLOCK,)).to(f32), tk.load(B, (0,), (BLOCK,)).to(f32)
    y = layer_normalized(h.to(f32), w, b, eps, X.shape[1])
    tk.store(Y, y.to(Y.dtype), (row, 0))



# ---------------------------------------------------------------- backward
#
# Both backward kernels are persistent as layernorm_kernel is (a grid of a
# few blocks per SM walking rows first, first + grid, ...): dX row by row,
# and each block's share of dW (and dB) summed over its rows in f32
# registers, written as one row of a (grid, D) f32 partial; column_sum_kernel
# then adds the partials' rows (the two-stage f32 reduction: no atomics, the
# same bits on every run).

@tk.kernel(num_warps=8)
def rmsnorm_backward_kernel(X: tk.gl, W: tk.gl, DY: tk.gl, DH: tk.gl,
                            DX: tk.gl, DW_PARTS: tk.gl[f32], eps: float,
                            BLOCK: tk.constexpr, ADD_DH: tk.constexpr = False):
    """dX of Y = X / rms(X) * W, and DW_PARTS[block] = this block's rows' sum
    of dY * X / rms(X). With g = dY * W and x̂ = X / rms(X), per row:
    dX = (g - x̂ * mean(g * x̂)) / rms(X), plus DH with ADD_DH (the gradient
    of add_rmsnorm_kernel's H; DH is not read otherwise). The columns past D
    read as 0 (x̂, g and so every sum is 0 there) and are not written."""
    first, step = tk.block_id(0), tk.grid_dim(0)
    d = float(X.shape[1])
    w = tk.load(W, (0,), (BLOCK,)).to(f32)
    dw = tk.zeros((1, BLOCK), f32)
    for row in range(first, X.shape[0], step):
        x = tk.load(X, (row, 0), (1, BLOCK)).to(f32)
        dy = tk.load(DY, (row, 0), (1, BLOCK)).to(f32)
        inv_rms = ((x * x).row_sum() * (1.0 / d) + eps).rsqrt()
        xhat = x.mul_row(inv_rms)
        g = dy.mul_col(w)
        dx = (g - xhat.mul_row((g * xhat).row_sum() * (1.0 / d))).mul_row(inv_rms)
        if ADD_DH:
            dx = dx + tk.load(DH, (row, 0), (1, BLOCK)).to(f32)
        tk.store(DX, dx.to(DX.dtype), (row, 0))
        dw = dw + dy * xhat
    tk.store(DW_PARTS, dw, (first, 0))


@tk.kernel(num_warps=8)
def layernorm_backward_kernel(X: tk.gl, W: tk.gl, DY: tk.gl, DH: tk.gl,
                              DX: tk.gl, DW_PARTS: tk.gl[f32], DB_PARTS: tk.gl[f32],
                              eps: float, BLOCK: tk.constexpr, ADD_DH: tk.constexpr = False):
    """dX of Y = (X - mean) / sqrt(var + eps) * W + B, and this block's rows'
    sums of dY * x̂ (DW_PARTS[block]) and of dY (DB_PARTS[block]). With
    g = dY * W and x̂ = (X - mean) * rstd, per row:
    dX = rstd * (g - mean(g) - x̂ * mean(g * x̂)), plus DH with ADD_DH (as
    rmsnorm_backward_kernel). Mean and variance are
    recomputed as the forward computes them; the columns past D read as 0,
    where x̂ is masked to 0 (X - mean is not) and g is 0."""
    first, step = tk.block_id(0), tk.grid_dim(0)
    d = float(X.shape[1])
    w = tk.load(W, (0,), (BLOCK,)).to(f32)
    dw = tk.zeros((1, BLOCK), f32)
    db = tk.zeros((1, BLOCK), f32)
    for row in range(first, X.shape[0], step):
        x = tk.load(X, (row, 0), (1, BLOCK)).to(f32)
        dy = tk.load(DY, (row, 0), (1, BLOCK)).to(f32)
        xhat, rstd = standardized(x, eps, X.shape[1])
        g = dy.mul_col(w)
        dx = g.sub_row(g.row_sum() * (1.0 / d)) - xhat.mul_row((g * xhat).row_sum() * (1.0 / d))
        dx = dx.mul_row(rstd)
        if ADD_DH:
            dx = dx + tk.load(DH, (row, 0), (1, BLOCK)).to(f32)
        tk.store(DX, dx.to(DX.dtype), (row, 0))
        dw = dw + dy * xhat
        db = db + dy
    tk.store(DW_PARTS, dw, (first, 0))
    tk.store(DB_PARTS, db, (first, 0))


@tk.kernel(num_warps=8)
def column_sum_kernel(PARTS: tk.gl[f32], OUT: tk.gl, ROWS: tk.constexpr = 32,
                      COLS: tk.constexpr = 256):
    """OUT[c] = sum over r of PARTS[r, c] in f32, in OUT's dtype: one block
    per COLS columns, adding ROWS rows at a time (out-of-range rows and
    columns read as 0) in a fixed order."""
    c0 = tk.block_id(0)
    acc = tk.zeros((ROWS, COLS), f32)
    for r in range(0, tk.cdiv(PARTS.shape[0], ROWS)):
        acc = acc + tk.load(PARTS, (r, c0), (ROWS, COLS))
    tk.store(OUT, acc.col_sum().to(OUT.dtype), (c0,))


def rms_norm(x, weight=None, eps: float = 1e-6, *, out=None):
    """y = x / sqrt(mean(x^2, per row) + eps) * weight.

    x: a (..., D) bf16 or f16 CUDA tensor (rows of D); weight: (D,), x's
    dtype and device, or None (no scale, as F.rms_norm's weight=None). out:
    a tensor like x to write into; by default a new one.
    Returns out. Statistics are computed in float32. Differentiable in x and
    weight (rms_norm_backward's kernels; not with out=). Under torch.compile
    it runs as the custom op torch.ops.tk_mlir.rms_norm (see matmul)."""
    import torch
    weight = _or_constant(weight, x, 1.0)
    if torch.compiler.is_compiling():
        eps = _check("rms_norm", x, eps, _out(out), weight=weight, device=False)
        _recorded("rms_norm", out, x, weight)
        checks.on_cuda("rms_norm", "x", x)
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir
        y = torch.ops.tk_mlir.rms_norm(x, weight, eps)
        return y if out is None else out.copy_(y)
    # eager: no op dispatch, and a signature seen before was checked then (eager.py),
    # but for out's memory against the inputs' (the same signature may alias)
    if out is not None:
        checks.written_apart("rms_norm", "out", out, ("x",), x=x, weight=weight)
    key = (eager.tensor_key(x), eager.tensor_key(weight), eager.tensor_key(out),
           eager.option_key(eps), torch.is_grad_enabled())
    return _RMS_NORM.call(key, lambda: _prepare("rms_norm", x, weight, None, eps, out),
                          x, weight, out)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, *, out=None):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, mean and (biased)
    variance per row, as torch.nn.functional.layer_norm over the last dim.

    x: a (..., D) bf16 or f16 CUDA tensor; weight, bias: (D,), x's dtype
    and device, or None (none, as F.layer_norm's: a LayerNorm without
    elementwise_affine, or with bias=False). out: a tensor like x to write
    into; by default a new one.
    Returns out. Statistics are computed in float32. Differentiable in x,
    weight and bias (layer_norm_backward's kernels; not with out=). Under
    torch.compile it runs as the custom op torch.ops.tk_mlir.layer_norm (see
    matmul)."""
    import torch
    weight, bias = _or_constant(weight, x, 1.0), _or_constant(bias, x, 0.0)
    if torch.compiler.is_compiling():
        eps = _check("layer_norm", x, eps, _out(out), weight=weight, bias=bias, device=False)
        _recorded("layer_norm", out, x, weight, bias)
        checks.on_cuda("layer_norm", "x", x)
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir
        y = torch.ops.tk_mlir.layer_norm(x, weight, bias, eps)
        return y if out is None else out.copy_(y)
    if out is not None:
        checks.written_apart("layer_norm", "out", out, ("x",), x=x, weight=weight, bias=bias)
    key = (eager.tensor_key(x), eager.tensor_key(weight), eager.tensor_key(bias),
           eager.tensor_key(out), eager.option_key(eps), torch.is_grad_enabled())
    return _LAYER_NORM.call(key, lambda: _prepare("layer_norm", x, weight, bias, eps, out),
                            x, weight, bias, out)


# Eager calls by signature (eager.py).
_RMS_NORM, _LAYER_NORM, _FUSED_ADD = eager.Prepared(), eager.Prepared(), eager.Prepared()
# The weights and biases that stand for None: (value, D, dtype, device) -> a (D,) tensor.
_CONSTANTS: dict = {}


def _or_constant(v, x, value: float):
    """v, or for None a (D,) vector of `value` (1: a weight, 0: a bias) in
    x's dtype and on its device, made once for each (D, dtype, device), so
    the kernels and their gradients stay those of an affine norm (the
    vector's gradient is never asked for). Left None where x is no row
    tensor: _check says what is wrong with x. Made outside inference mode
    (autograd saves it), and kept only when it is a plain tensor (not a
    fake one) made outside CUDA-graph capture (whose fill runs only on
    replay) and torch.compile."""
    import torch
    if v is not None or not isinstance(x, torch.Tensor) or x.is_nested or x.dim() < 1:
        return v
    key = (value, x.shape[-1], x.dtype, x.device)
    made = _CONSTANTS.get(key)
    if made is None:
        compiling = torch.compiler.is_compiling()
        # (asked only outside torch.compile, which traces no inference-mode query)
        switch = not compiling and torch.is_inference_mode_enabled()
        with torch.inference_mode(False) if switch else contextlib.nullcontext():
            made = torch.full(key[1:2], value, dtype=x.dtype, device=x.device)
        if type(made) is torch.Tensor and not (   # (not a fake tensor)
                compiling or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            _CONSTANTS[key] = made
    return made


def _prepare(fn: str, x, weight, bias, eps, out):
    """After checking an eager rms_norm (bias None) or layer_norm call, the
    function running calls like it: `run(x, weight, out)` or
    `run(x, weight, bias, out)`, through autograd when it records them."""
    from tk_mlir.kernels import custom_ops
    params = dict(weight=weight) if fn == "rms_norm" else dict(weight=weight, bias=bias)
    eps = _check(fn, x, eps, _out(out), device=False, **params)
    grads = _recorded(fn, out, x, *params.values())
    checks.on_cuda(fn, "x", x)
    back = eager.per_layout(lambda x, weight: planned_backward(fn, x, weight, same_signature=True),
                            2) if grads else None
    if fn == "rms_norm":
        launch = planned_rms_norm(x, same_signature=True)
        if grads:
            run = lambda x, weight, out: custom_ops.EagerRmsNorm.apply(x, weight, eps, launch,
                                                                       back)
        else:
            def run(x, weight, out):
                out = eager.empty_rows(x) if out is None else out
                launch(x, weight, eps, out)
                return out
    else:
        launch = planned_layer_norm(x, same_signature=True)
        if grads:
            run = lambda x, weight, bias, out: custom_ops.EagerLayerNorm.apply(
                x, weight, bias, eps, launch, back)
        else:
            def run(x, weight, bias, out):
                out = eager.empty_rows(x) if out is None else out
                launch(x, weight, bias, eps, out)
                return out
    # (decided once per signature: the layouts are in its key)
    return run if all(checks.readable(t) for t in (*params.values(), *_out(out).values())) \
        else _through_copies(run)


def _through_copies(run):
    """`run(x, *vectors, out)` for a weight or bias the kernels cannot read as
    it lies (a strided, expanded or misaligned view: an aligned copy) or an
    out they cannot write (a misaligned view: a new output copied into it)."""
    def run_copied(x, *vectors_and_out):
        *vectors, out = vectors_and_out
        y = run(x, *(checks.kernel_operand(v) for v in vectors), None)
        return y if out is None else out.copy_(y)
    return run_copied


def _out(out) -> dict:
    """_check's rows for an optional out=."""
    return {} if out is None else {"out": out}


def _recorded(fn: str, out, *inputs) -> bool:
    """Whether autograd records this call: grad mode is on and an input
    requires grad (out= is then refused, as torch refuses it)."""
    import torch
    checks.output_outside_autograd(fn, "out", out)
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
        return False
    if out is not None:
        raise RuntimeError(f"{fn}: out= does not take part in autograd, and an input requires "
                           f"grad; leave out out= (or call under torch.no_grad())")
    return True


def launch_rms_norm(x, weight, eps: float, out) -> None:
    """rmsnorm_kernel on checked tensors, into out (an output the kernel can
    write: torch.empty's)."""
    planned_rms_norm(x)(x, checks.kernel_operand(weight), eps, out)


def planned_rms_norm(x, same_signature: bool = False):
    """`launch(x, weight, eps, out)`: launch_rms_norm for tensors shaped like
    x, its grid and row tile chosen once. same_signature: every call's
    tensors have the first's layouts (an eager signature's: its kernel's
    _signature_launcher)."""
    rows, d = math.prod(x.shape[:-1]), x.shape[-1]
    if not rows:
        return lambda x, weight, eps, out: None
    kernel = eager.launcher(rmsnorm_kernel, same_signature)((rows,), BLOCK=_block(d))
    if checks.rows_as_they_lie(x):
        return lambda x, weight, eps, out: kernel(x, weight, out, eps)
    return lambda x, weight, eps, out: kernel(checks.as_rows(x), weight,
                                              checks.as_rows(out, view=True), eps)


def launch_layer_norm(x, weight, bias, eps: float, out) -> None:
    """layernorm_kernel on checked tensors, into out (an output the kernel can
    write: torch.empty's)."""
    planned_layer_norm(x)(x, checks.kernel_operand(weight), checks.kernel_operand(bias), eps,
                          out)


def planned_layer_norm(x, same_signature: bool = False):
    """`launch(x, weight, bias, eps, out)`: launch_layer_norm for tensors
    shaped like x, its grid and row tile chosen once (same_signature: as
    planned_rms_norm's)."""
    rows, d = math.prod(x.shape[:-1]), x.shape[-1]
    if not rows:
        return lambda x, weight, bias, eps, out: None
    block = _block(d)
    # 3 blocks per SM for rows up to 4096 wide, 2 above (BENCHMARKS.md).
    grid = min(rows, (3 if block <= 4096 else 2) * num_sms(x.get_device()))
    kernel = eager.launcher(layernorm_kernel, same_signature)((grid,), BLOCK=block,
                                                              RELOAD_WB=block > 4096)
    if checks.rows_as_they_lie(x):
        return lambda x, weight, bias, eps, out: kernel(x, weight, bias, out, eps)
    return lambda x, weight, bias, eps, out: kernel(checks.as_rows(x), weight, bias,
                                                    checks.as_rows(out, view=True), eps)


def rms_norm_backward(dy, x, weight, eps: float, dh=None):
    """(dx, dweight) of rms_norm(x, weight, eps) given dy, the gradient of its
    output; dweight summed over the rows in f32 (two stages, see the kernels).
    dh: a gradient added to dx (fused_add_rms_norm's sum output's)."""
    return planned_backward("rms_norm", x, weight, dh is not None)(dy, x, weight, eps, dh)


def layer_norm_backward(dy, x, weight, eps: float, dh=None):
    """(dx, dweight, dbias) of layer_norm(x, weight, bias, eps) given dy (the
    bias does not enter the gradients); dh as rms_norm_backward's."""
    return planned_backward("layer_norm", x, weight, dh is not None)(dy, x, weight, eps, dh)


def planned_backward(norm: str, x, weight, with_dh: bool = False,
                     same_signature: bool = False):
    """`run(dy, x, weight, eps, dh=None, sums=True) -> (dx, *sums)`: the backward
    kernel of `norm` ("rms_norm": dweight; "layer_norm": dweight, dbias, each
    the column sum of per-block f32 partials, in weight's dtype; None each
    with sums=False, when no parameter needs its gradient) for checked
    tensors laid out as x and weight, its grid and launches chosen once;
    with_dh: dh (like x) is added to dx. same_signature: x and weight are
    laid out as these on every call (an eager signature's saved tensors) and
    the launches read addresses alone (eager.launcher); dy and dh, whose
    layout autograd chooses, are copied into contiguous tensors of x's dtype
    where they are not."""
    import torch
    kernel, outputs = ((rmsnorm_backward_kernel, 1) if norm == "rms_norm" else
                       (layernorm_backward_kernel, 2))
    shape, dtype, device = tuple(x.shape), x.dtype, x.device
    rows, d = math.prod(shape[:-1]), shape[-1]
    if rows == 0:
        return lambda dy, x, weight, eps, dh=None, sums=True: (
            torch.empty(shape, dtype=dtype, device=device),
            *[torch.zeros_like(weight) if sums else None for _ in range(outputs)])
    grid = min(rows, 2 * num_sms(x.get_device()))
    main = eager.launcher(kernel, same_signature)((grid,), BLOCK=_block(d), ADD_DH=with_dh)
    column_sum = eager.launcher(column_sum_kernel, same_signature)((tk.cdiv(d, 256),))
    strides = contiguous_strides(shape)
    # (decided once: whether the kernels read such x and weight as they lie)
    x_as_rows = same_signature and checks.rows_as_they_lie(x)
    weight_as_is = same_signature and checks.kernel_operand(weight) is weight

    def gradient_rows(g):
        """A gradient like x as (rows, d) the kernel reads (bound: x's shape
        contiguous, a copy where autograd handed another layout)."""
        if not same_signature:
            return checks.as_rows(g)    # (an aligned copy of e.g. the expanded gradient of y.sum())
        return eager.laid_out(g, shape, strides, dtype).view(rows, d)

    def run(dy, x, weight, eps, dh=None, sums=True):
        dy = gradient_rows(dy)
        x = x if x_as_rows else checks.as_rows(x)
        dx = torch.empty(rows, d, dtype=dtype, device=device)
        parts = [torch.empty(grid, d, dtype=torch.float32, device=device)
                 for _ in range(outputs)]
        # (without dh, DH is not read: dy stands in for it)
        main(x, weight if weight_as_is else checks.kernel_operand(weight), dy,
             gradient_rows(dh) if with_dh else dy, dx, *parts, eps)
        if not sums:            # (the partials are written, not summed)
            return (dx.view(shape), *[None] * outputs)
        totals = [torch.empty(weight.shape, dtype=weight.dtype, device=device)
                  for _ in range(outputs)]
        for part, total in zip(parts, totals):
            column_sum(part, total)
        return (dx.view(shape), *totals)
    return run


def fused_add_rms_norm(x, residual, weight=None, eps: float = 1e-6):
    """(y, h): h = x + residual and y = rms_norm(h, weight, eps), in one pass
    (a pre-norm transformer block's residual add and norm; vLLM's
    fused_add_rms_norm, returning the sum instead of writing it over residual).

    x, residual: (..., D) bf16 or f16 CUDA tensors of one shape and dtype;
    weight: (D,) or None. h is rounded to that dtype before the norm reads it, as the unfused
    `rms_norm(x + residual)` computes. Differentiable in x, residual and
    weight; under torch.compile the custom op torch.ops.tk_mlir.fused_add_rms_norm."""
    return _fused_add("rms_norm", x, residual, weight, None, eps)


def fused_add_layer_norm(x, residual, weight=None, bias=None, eps: float = 1e-5):
    """(y, h): h = x + residual and y = layer_norm(h, weight, bias, eps), in one
    pass; as fused_add_rms_norm (op torch.ops.tk_mlir.fused_add_layer_norm;
    weight and bias may be None, as layer_norm's)."""
    return _fused_add("layer_norm", x, residual, weight, bias, eps)


def _fused_add(norm: str, x, residual, weight, bias, eps):
    import torch
    weight = _or_constant(weight, x, 1.0)
    bias = _or_constant(bias, x, 0.0) if norm == "layer_norm" else bias
    fn = f"fused_add_{norm}"
    if torch.compiler.is_compiling():
        inputs = _checked_fused_add(norm, x, residual, weight, bias, eps)
        return getattr(torch.ops.tk_mlir, fn)(*inputs)
    key = (norm, eager.tensor_key(x), eager.tensor_key(residual), eager.tensor_key(weight),
           eager.tensor_key(bias), eager.option_key(eps), torch.is_grad_enabled())
    return _FUSED_ADD.call(key, lambda: _prepare_fused_add(norm, x, residual, weight, bias, eps),
                           x, residual, weight, bias)


def _checked_fused_add(norm: str, x, residual, weight, bias, eps) -> tuple:
    """The op's arguments (x, residual, weight[, bias], eps), checked."""
    params = dict(weight=weight) if norm == "rms_norm" else dict(weight=weight, bias=bias)
    eps = _check(f"fused_add_{norm}", x, eps, {"residual": residual}, **params)
    from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir
    return (x, residual, *params.values(), eps)


def _prepare_fused_add(norm: str, x, residual, weight, bias, eps):
    """After checking an eager call, `run(x, residual, weight, bias)` for
    calls like it (bias None for rms_norm), through autograd when it records
    them."""
    from tk_mlir.kernels import custom_ops
    *inputs, eps = _checked_fused_add(norm, x, residual, weight, bias, eps)
    rms = norm == "rms_norm"
    launch = planned_fused_add(norm, x, same_signature=True)
    if _recorded(f"fused_add_{norm}", None, *inputs):
        # the backward's x is the sum h, a new contiguous tensor like x (unless a
        # saved-tensor hook hands it otherwise: eager.per_layout)
        back = eager.per_layout(lambda h, weight: planned_backward(
            norm, h, weight, with_dh=True, same_signature=True), 2)
        return lambda x, residual, weight, bias: custom_ops.EagerFusedAddNorm.apply(
            launch, back, x, residual, weight, *(() if rms else (bias,)), eps)
    return lambda x, residual, weight, bias: launch(
        x, residual, weight, *(() if rms else (bias,)), eps)


def launch_fused_add(norm: str, x, residual, weight, *bias_eps):
    """(y, h) of add_rmsnorm_kernel or add_layernorm_kernel on checked tensors;
    bias_eps: (bias, eps) for layer_norm, (eps,) for rms_norm."""
    return planned_fused_add(norm, x)(x, residual, weight, *bias_eps)


def planned_fused_add(norm: str, x, same_signature: bool = False):
    """`launch(x, residual, weight, *bias_eps) -> (y, h)`: launch_fused_add
    for tensors shaped like x, its grid and row tile chosen once
    (same_signature: as planned_rms_norm's)."""
    rows, d = math.prod(x.shape[:-1]), x.shape[-1]
    kernel = None if not rows else eager.launcher(
        add_rmsnorm_kernel if norm == "rms_norm" else add_layernorm_kernel,
        same_signature)((rows,), BLOCK=_block(d))

    def launch(x, residual, weight, *bias_eps):
        y, h = eager.empty_rows(x), eager.empty_rows(x)
        if kernel is not None:
            *bias, eps = bias_eps
            kernel(checks.as_rows(x), checks.as_rows(residual),
                   *[checks.kernel_operand(t) for t in (weight, *bias)],
                   checks.as_rows(y, view=True), checks.as_rows(h, view=True), eps)
        return y, h
    return launch


# The widest row: _block(D) 16-bit values in 8 warps' registers (65536 would take 256 a
# thread).
MAX_D = 32768


def _block(d: int) -> int:
    """The row tile's width: the next power of two >= d, at least 256 (one
    8-element vector per thread of the 8 warps)."""
    return max(256, 1 << (d - 1).bit_length())


def _check(fn: str, x, eps, rows: dict, *, device: bool = True, **params) -> float:
    """x is (..., D) bf16 or f16 on a CUDA device (rows of D: its leading dims
    flattened), each of `rows` (name -> tensor: out, residual) is like x,
    each of `params` a (D,) vector like it; returns eps as a float."""
    import torch
    dtypes = (torch.bfloat16, torch.float16)         # (statistics in f32 either way)
    checks.tensor(fn, "x", x, dtypes=dtypes)
    if x.dim() < 1:
        raise ValueError(f"{fn}: x must be at least 1-D (D, or rows x D), got shape "
                         f"{tuple(x.shape)}")
    if x.shape[-1] == 0 or x.shape[-1] % 8:
        raise ValueError(f"{fn}: x's last dim D must be a positive multiple of 8 (rows of whole "
                         f"16-byte vectors, as the kernels load them), got shape "
                         f"{tuple(x.shape)}")
    if x.shape[-1] > MAX_D:
        raise ValueError(f"{fn}: x's last dim D must be at most {MAX_D} (a row, rounded up to "
                         f"a power of two, is held in one block's registers), got shape "
                         f"{tuple(x.shape)}")
    for name, value in rows.items():
        checks.tensor(fn, name, value, ndim=x.dim(), dtypes=(x.dtype,))     # (x's)
        checks.like(fn, name, value, "x", x)
        checks.shape(fn, name, value, tuple(x.shape), "x's shape")
    if "out" in rows:
        checks.written_in_place(fn, "out", rows["out"])
        if rows["out"].stride(-1) != 1:
            raise ValueError(f"{fn}: out must have a contiguous last dim, got strides "
                             f"{tuple(rows['out'].stride())}")
    if x.dim() > 2 and "out" in rows and not rows["out"].is_contiguous():
        raise ValueError(f"{fn}: out must be contiguous when x has more than 2 dims (its rows "
                         f"are written as one (rows, D) view), got strides "
                         f"{tuple(rows['out'].stride())}")
    for name, value in params.items():
        checks.tensor(fn, name, value, ndim=1, dtypes=(x.dtype,))
        checks.like(fn, name, value, "x", x)
        checks.shape(fn, name, value, (x.shape[-1],), "one value per column of x")
    eps = checks.nonnegative(fn, "eps", eps)
    if device:
        checks.on_cuda(fn, "x", x)
    return eps

