"""The library's kernels as torch custom ops, namespace `tk_mlir`:

    torch.ops.tk_mlir.matmul(a, b, b_layout="nk", out_dtype=None) -> c
    torch.ops.tk_mlir.matmul_grad_a(dc, b, b_layout) -> da
    torch.ops.tk_mlir.matmul_grad_b(dc, a, b_layout) -> db
    torch.ops.tk_mlir.grouped_matmul(a, b, sizes, b_layout="nk", out_dtype=None) -> c
    torch.ops.tk_mlir.grouped_matmul_grads(dc, a, b, sizes, b_layout, need_a, need_b)
                                           -> (da, db)
    torch.ops.tk_mlir.grouped_mm(a, b, offs) -> out
    torch.ops.tk_mlir.grouped_mm_grads(dc, a, b, offs, need_a, need_b) -> (da, db)
    torch.ops.tk_mlir.scaled_matmul(a, b, scale_a, scale_b, out_dtype) -> c
    torch.ops.tk_mlir.rms_norm(x, weight, eps) -> y
    torch.ops.tk_mlir.layer_norm(x, weight, bias, eps) -> y
    torch.ops.tk_mlir.fused_add_rms_norm(x, residual, weight, eps) -> (y, x + residual)
    torch.ops.tk_mlir.fused_add_layer_norm(x, residual, weight, bias, eps) -> (y, x + residual)
    torch.ops.tk_mlir.rms_norm_backward(dy, x, weight, eps, dh=None) -> (dx, dweight)
    torch.ops.tk_mlir.layer_norm_backward(dy, x, weight, eps, dh=None) -> (dx, dweight, dbias)
    torch.ops.tk_mlir.swiglu(gate, up) -> silu(gate) * up
    torch.ops.tk_mlir.swiglu_backward(dy, gate, up) -> (dgate, dup)
    torch.ops.tk_mlir.rotary_embedding(x, cos, sin, inverse=False, interleaved=False)
                                       -> rotated x
    torch.ops.tk_mlir.cross_entropy(logits, target, ignore_index, reduction,
                                    label_smoothing) -> (loss, lse)
    torch.ops.tk_mlir.cross_entropy_backward(dloss, logits, target, lse, ignore_index,
                                             reduction, label_smoothing) -> dlogits
    torch.ops.tk_mlir.linear_cross_entropy(h, weight, target, ignore_index, reduction,
                                           low_memory=False) -> (loss, lse)
    torch.ops.tk_mlir.linear_cross_entropy_backward(dloss, h, weight, target, lse,
                                                    ignore_index, reduction, need_h,
                                                    need_weight, low_memory=False)
                                                    -> (dh, dweight)
    torch.ops.tk_mlir.attention(q, k, v, causal, scale, deterministic=False, left=-1,
                                right=-1, softcap=0.0) -> (o, lse)
    torch.ops.tk_mlir.attention_backward(do, q, k, v, o, lse, causal, scale,
                                         deterministic=False, left=-1, right=-1,
                                         softcap=0.0) -> (dq, dk, dv)
    torch.ops.tk_mlir.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table,
                                             k, v, causal, scale, left=-1, right=-1,
                                             softcap=0.0) -> (o, lse)
                                             (writes k, v into the caches)
    torch.ops.tk_mlir.linear_attention(q, k, v, s0, z0, feature_map, causal, normalize, scale)
                                       -> (o, S, z)
    torch.ops.tk_mlir.linear_attention_backward(do, q, k, v, o, s0, z0, feature_map, causal,
                                                normalize, scale) -> (dq, dk, dv, dS0, dz0)
    torch.ops.tk_mlir.linear_attention_step(q, k, v, s0, z0, feature_map, normalize, scale)
                                            -> (o, S, z)
    torch.ops.tk_mlir.ssd(x, dt, A, B, C, D, h0) -> (y, final state)
    torch.ops.tk_mlir.ssd_backward(dy, dh1, x, dt, A, B, C, D, h0, h1)
                                   -> (dx, ddt, dA, dB, dC, dD, dh0)
    torch.ops.tk_mlir.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale,
                                       left=-1, right=-1, softcap=0.0) -> (o, lse)
    torch.ops.tk_mlir.attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q,
                                                cu_seqlens_k, causal, scale, left=-1,
                                                right=-1, softcap=0.0) -> (dq, dk, dv)

torch.compile cannot trace a cuda-python launch but traces a custom op as one
opaque node, given a fake implementation (output shapes, dtypes, strides), so
a compiled model calls the kernels without a graph break; matmul,
grouped_matmul, the norms, swiglu, rotary_embedding, cross_entropy,
linear_cross_entropy, attention, attention_varlen, linear_attention and ssd get
autograd through
register_autograd.

Contracts: the real implementations check their arguments with the public
wrappers' checks (calling torch.ops.tk_mlir.* directly is as safe); the fake
ones do not (Dynamo has run the wrappers' checks on fake tensors). Every op
allocates its outputs (mutates_args=()): a wrapper's `out=`/`c` is written in
place by eager calls and copied into under torch.compile. The one mutation is
attention_with_kvcache's, which appends the new tokens' k and v to the caches. Gradients are
first order: the backward ops have no autograd formula, and the eager classes' backward is
`first_order`, so a second derivative raises rather than coming back partial. Importing this
module imports torch and registers the ops; the wrappers import it on first
call, and resolving a public name does when torch is already loaded.
"""
from __future__ import annotations

import functools

import torch

from tk_mlir.kernels import (activations, checks, decode_attention, eager, flash_attention, gemm,
                             grouped_gemm, losses, norms, rotary, scaled_gemm,
                             chunked_linear_attention, state_space_duality,
                             taylor_linear_attention, varlen_attention)


# autograd.Function's C++ apply, under its Python layer (absent in a torch
# without it: EagerFunction then takes the public path).
_C_APPLY = getattr(torch._C, "_FunctionBase", type).__dict__.get("apply")
_UNWRAP_IF_DEAD = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)


class EagerFunction(torch.autograd.Function):
    """Base of the eager calls' autograd Functions: `apply` without
    autograd.Function.apply's Python layer, doing what that layer does for
    Functions whose forward takes ctx (no setup_context: nothing to bind):
    tensors left over from a finished functorch transform unwrapped, and
    under an active transform the public path (which refuses these). The
    layer is a few µs of an eager call with autograd (BENCHMARKS.md)."""

    @classmethod
    def apply(cls, *args):
        if _C_APPLY is None or _UNWRAP_IF_DEAD is None or \
                torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return _C_APPLY.__get__(None, cls)(
            *[_UNWRAP_IF_DEAD(a) if isinstance(a, torch.Tensor) else a for a in args])


def first_order(backward):
    """An eager autograd.Function's backward, differentiable once: under
    create_graph=True the gradients it returns are joined to the saved
    tensors that require grad, and those held on ctx.held (the inputs they
    depend on), by a node that raises when reached, so a second derivative
    with respect to any input raises rather than coming back partial, or as
    None under allow_unused.
    (once_differentiable marks its outputs only through stand-in leaves: a
    second derivative with respect to the inputs found no path and came back
    as None.)"""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not (torch.is_grad_enabled() and any(ctx.needs_input_grad)):
            return backward(ctx, *grads)
        anchors = [t for t in (*ctx.saved_tensors, *getattr(ctx, "held", ()), *grads)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        return _raising_when_differentiated(outputs, anchors)
    return wrapper


_TWICE = (b"tk_mlir: trying to differentiate twice a library kernel's gradient (its "
          b"backward is first order only)")


def _raising_when_differentiated(outputs, anchors):
    """outputs (a backward's gradients), the floating ones given a grad_fn that
    raises _TWICE and leads to `anchors` (stand-in leaves when there are none,
    so that differentiating them still raises)."""
    single = not isinstance(outputs, tuple)
    outputs = (outputs,) if single else outputs
    at = [i for i, g in enumerate(outputs) if isinstance(g, torch.Tensor) and
          g.is_floating_point()]
    if not at:
        return outputs[0] if single else outputs
    if not anchors:
        anchors = [outputs[i].detach().requires_grad_() for i in at]
    from torch._C import _functions
    marked = _functions.DelayedError(_TWICE, len(at) + len(anchors))(
        *(outputs[i] for i in at), *anchors)
    outputs = list(outputs)
    for i, g in zip(at, marked):
        outputs[i] = g
    return outputs[0] if single else tuple(outputs)


# ------------------------------------------------------------------ matmul

@torch.library.custom_op("tk_mlir::matmul", mutates_args=())
def matmul(a: torch.Tensor, b: torch.Tensor, b_layout: str = "nk",
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """C = A @ B.T ("nk") or A @ B ("kn") into a new (M, N) tensor of
    out_dtype (default a's dtype: bf16/f16, or f32)."""
    gemm.check(a, b, None, b_layout)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"matmul: out_dtype must be torch.bfloat16, torch.float16 or "
                        f"torch.float32, got {out_dtype}")
    c = torch.empty(gemm.output_shape(a, b, b_layout), dtype=out_dtype, device=a.device)
    gemm.launch(a, b, c, b_layout)
    return c


@matmul.register_fake
def _(a, b, b_layout="nk", out_dtype=None):
    return a.new_empty(gemm.output_shape(a, b, b_layout),
                       dtype=a.dtype if out_dtype is None else out_dtype)


@torch.library.custom_op("tk_mlir::matmul_grad_a", mutates_args=())
def matmul_grad_a(dc: torch.Tensor, b: torch.Tensor, b_layout: str) -> torch.Tensor:
    """dA of matmul(a, b, b_layout) given dC (gemm.grad_a)."""
    gemm.check_gradient("matmul_grad_a", dc, b, b_layout, of="a")
    return gemm.grad_a(dc, b, b_layout)


@matmul_grad_a.register_fake
def _(dc, b, b_layout):
    return b.new_empty(*dc.shape[:-1], b.shape[-1] if b_layout == "nk" else b.shape[-2])


@torch.library.custom_op("tk_mlir::matmul_grad_b", mutates_args=())
def matmul_grad_b(dc: torch.Tensor, a: torch.Tensor, b_layout: str) -> torch.Tensor:
    """dB of matmul(a, b, b_layout) given dC, in b's layout (gemm.grad_b)."""
    gemm.check_gradient("matmul_grad_b", dc, a, b_layout, of="b")
    return gemm.grad_b(dc, a, b_layout)


@matmul_grad_b.register_fake
def _(dc, a, b_layout):
    N, K = dc.shape[-1], a.shape[-1]
    return a.new_empty(*a.shape[:-2], *((N, K) if b_layout == "nk" else (K, N)))


def _matmul_setup_context(ctx, inputs, output):
    a, b, b_layout = inputs[:3]
    ctx.save_for_backward(a, b)
    ctx.b_layout = b_layout


def _matmul_backward(ctx, dc):
    """(dA, dB, None...) for the inputs that need them, by the grad ops."""
    a, b = ctx.saved_tensors
    da = matmul_grad_a(dc, b, ctx.b_layout) if ctx.needs_input_grad[0] else None
    db = matmul_grad_b(dc, a, ctx.b_layout) if ctx.needs_input_grad[1] else None
    return (da, db) + (None,) * (len(ctx.needs_input_grad) - 2)


matmul.register_autograd(_matmul_backward, setup_context=_matmul_setup_context)


class EagerMatmul(EagerFunction):
    """matmul's forward and backward for eager calls on checked tensors: the
    kernels launch directly, without the ops' dispatch (as EagerAttention)."""

    @staticmethod
    def forward(ctx, a, b, b_layout, planned, planned_grads):
        """planned: `run(a, b, None) -> c`, the product as an eager call like
        this one launches it (gemm._planned, remembered); planned_grads:
        gemm.planned_grads's run for the same signature."""
        c = planned(a, b, None)
        _matmul_setup_context(ctx, (a, b, b_layout), c)
        ctx.planned_grads = planned_grads
        return c

    @staticmethod
    @first_order
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        return (*ctx.planned_grads(dc, a, b, *ctx.needs_input_grad[:2]), None, None, None)


@torch.library.custom_op("tk_mlir::grouped_matmul", mutates_args=())
def grouped_matmul(a: torch.Tensor, b: torch.Tensor, sizes: torch.Tensor, b_layout: str = "nk",
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """grouped_gemm.grouped_matmul into a new zeroed (G, M, N) tensor of out_dtype
    (default a's dtype): the rows the kernel does not write are zeros here,
    so the op's result is a function of its inputs."""
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"grouped_matmul: out_dtype must be torch.bfloat16, torch.float16 or "
                        f"torch.float32, got {out_dtype}")
    c = torch.zeros(gemm.output_shape(a, b, b_layout), dtype=out_dtype, device=a.device)
    return grouped_gemm.grouped_matmul(a, b, sizes, c, b_layout=b_layout)


@grouped_matmul.register_fake
def _(a, b, sizes, b_layout="nk", out_dtype=None):
    return a.new_empty(gemm.output_shape(a, b, b_layout),
                       dtype=a.dtype if out_dtype is None else out_dtype)


@torch.library.custom_op("tk_mlir::grouped_matmul_grads", mutates_args=())
def grouped_matmul_grads(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         sizes: torch.Tensor, b_layout: str, need_a: bool,
                         need_b: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) of grouped_matmul (grouped_gemm.grouped_grads); one not
    needed is an empty tensor."""
    fn = "grouped_matmul_grads"
    gemm.check(a, b, None, b_layout, fn, device=False)
    if a.dim() != 3:
        raise ValueError(f"{fn}: a must be 3-D (G x M x K), got shape {tuple(a.shape)}")
    sizes = grouped_gemm.check_sizes(sizes, a, fn)
    checks.tensor(fn, "dc", dc, ndim=3, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    checks.like(fn, "dc", dc, "a", a, dtype=False)
    checks.shape(fn, "dc", dc, gemm.output_shape(a, b, b_layout), "G x M x N")
    checks.on_cuda(fn, "a", a)
    da, db = grouped_gemm.grouped_grads(dc, a, b, sizes.to(a.device), b_layout, need_a, need_b)
    empty = a.new_empty(0)
    return (empty if da is None else da), (empty if db is None else db)


@grouped_matmul_grads.register_fake
def _(dc, a, b, sizes, b_layout, need_a, need_b):
    return (torch.empty_like(a) if need_a else a.new_empty(0),
            torch.empty_like(b) if need_b else a.new_empty(0))


def _grouped_setup_context(ctx, inputs, output):
    a, b, sizes, b_layout = inputs[:4]
    ctx.save_for_backward(a, b, sizes)
    ctx.options = (b_layout,)


def _grouped_backward(ctx, dc, grads):
    """(da, db, None...) of a grouped product (grouped_matmul, grouped_mm),
    each for an input that needs it: grads(dc, *saved tensors, *ctx.options,
    need_a, need_b) — the op's grads op, or under an eager autograd.Function
    grouped_gemm's own function."""
    need_a, need_b = ctx.needs_input_grad[:2]
    da, db = grads(dc, *ctx.saved_tensors, *ctx.options, need_a, need_b)
    return ((da if need_a else None), (db if need_b else None)) + \
        (None,) * (len(ctx.needs_input_grad) - 2)


grouped_matmul.register_autograd(functools.partial(_grouped_backward, grads=grouped_matmul_grads),
                                 setup_context=_grouped_setup_context)


class EagerGroupedMatmul(EagerFunction):
    """grouped_matmul's forward (into zeros, as the op) and backward for eager
    calls on checked tensors."""

    @staticmethod
    def forward(ctx, a, b, sizes, b_layout, planned, planned_grads):
        """planned: grouped_gemm._planned's run for the call's signature (an
        eager call's, remembered), into zeros here; planned_grads:
        grouped_gemm.planned_grads's run for the same signature."""
        c = torch.zeros(gemm.output_shape(a, b, b_layout), dtype=a.dtype, device=a.device)
        planned(a, b, sizes, c)
        _grouped_setup_context(ctx, (a, b, sizes, b_layout), c)
        ctx.planned_grads = planned_grads
        return c

    @staticmethod
    @first_order
    def backward(ctx, dc):
        return _grouped_backward(ctx, dc, ctx.planned_grads)


@torch.library.custom_op("tk_mlir::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_gemm.grouped_mm: the packed products a[rows of g] @ b[g], g's
    rows ending at offs[g], into a new (T, N) tensor of a's dtype."""
    grouped_gemm.check_ragged(a, b, offs)
    return grouped_gemm.ragged_launch(a, b, grouped_gemm.check_offs(offs, a))


@grouped_mm.register_fake
def _(a, b, offs):
    return a.new_empty((a.shape[0], b.shape[2]))


@torch.library.custom_op("tk_mlir::grouped_mm_grads", mutates_args=())
def grouped_mm_grads(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                     need_a: bool, need_b: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) of grouped_mm (grouped_gemm.ragged_grads); one not needed is
    an empty tensor."""
    fn = "grouped_mm_grads"
    grouped_gemm.check_ragged(a, b, offs)
    checks.tensor(fn, "dc", dc, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    checks.like(fn, "dc", dc, "a", a, dtype=False)
    checks.shape(fn, "dc", dc, (a.shape[0], b.shape[2]), "T x N")
    da, db = grouped_gemm.ragged_grads(dc, a, b, grouped_gemm.check_offs(offs, a), need_a,
                                       need_b)
    empty = a.new_empty(0)
    return (empty if da is None else da), (empty if db is None else db)


@grouped_mm_grads.register_fake
def _(dc, a, b, offs, need_a, need_b):
    return (torch.empty_like(a) if need_a else a.new_empty(0),
            b.new_empty(b.shape) if need_b else a.new_empty(0))


def _grouped_mm_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.options = ()


grouped_mm.register_autograd(functools.partial(_grouped_backward, grads=grouped_mm_grads),
                             setup_context=_grouped_mm_setup_context)


class EagerGroupedMm(EagerFunction):
    """grouped_mm's forward and backward for eager calls on checked tensors."""

    @staticmethod
    def forward(ctx, a, b, offs):
        out = grouped_gemm.ragged_launch(a, b, offs)
        _grouped_mm_setup_context(ctx, (a, b, offs), out)
        return out

    @staticmethod
    @first_order
    def backward(ctx, dc):
        return _grouped_backward(ctx, dc, grouped_gemm.ragged_grads)


@torch.library.custom_op("tk_mlir::scaled_matmul", mutates_args=())
def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(a @ b) * scale_a * scale_b for fp8 a (M x K row-major) and b (K x N
    column-major), into a new (M, N) tensor of out_dtype (bf16, f16 or f32); see
    scaled_gemm.scaled_matmul."""
    scaled_gemm.check(a, b, scale_a, scale_b, out_dtype)
    return scaled_gemm.launch(a, b, scale_a, scale_b, out_dtype)


@scaled_matmul.register_fake
def _(a, b, scale_a, scale_b, out_dtype):
    return a.new_empty(scaled_gemm.output_shape(a, b), dtype=out_dtype)


# ------------------------------------------------------------------- norms

@torch.library.custom_op("tk_mlir::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight per row, into a new tensor like x."""
    eps = norms._check("rms_norm", x, eps, {}, weight=weight)
    y = x.new_empty(x.shape)
    norms.launch_rms_norm(x, weight, eps, y)
    return y


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("tk_mlir::layer_norm", mutates_args=())
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias per row, into a new tensor like x."""
    eps = norms._check("layer_norm", x, eps, {}, weight=weight, bias=bias)
    y = x.new_empty(x.shape)
    norms.launch_layer_norm(x, weight, bias, eps, y)
    return y


@layer_norm.register_fake
def _(x, weight, bias, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("tk_mlir::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual)."""
    eps = norms._check("fused_add_rms_norm", x, eps, {"residual": residual}, weight=weight)
    return norms.launch_fused_add("rms_norm", x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("tk_mlir::fused_add_layer_norm", mutates_args=())
def fused_add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual) * weight + bias, x + residual)."""
    eps = norms._check("fused_add_layer_norm", x, eps, {"residual": residual}, weight=weight,
                       bias=bias)
    return norms.launch_fused_add("layer_norm", x, residual, weight, bias, eps)


@fused_add_layer_norm.register_fake
def _(x, residual, weight, bias, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("tk_mlir::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      dh: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (+ dh), dweight) of rms_norm by its backward kernels."""
    eps = norms._check("rms_norm_backward", x, eps, _gradients(dy, dh), weight=weight)
    return norms.rms_norm_backward(dy, x, weight, eps, dh)


@rms_norm_backward.register_fake
def _(dy, x, weight, eps, dh=None):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


@torch.library.custom_op("tk_mlir::layer_norm_backward", mutates_args=())
def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                        dh: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx (+ dh), dweight, dbias) of layer_norm by its backward kernels."""
    eps = norms._check("layer_norm_backward", x, eps, _gradients(dy, dh), weight=weight)
    return norms.layer_norm_backward(dy, x, weight, eps, dh)


@layer_norm_backward.register_fake
def _(dy, x, weight, eps, dh=None):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _gradients(dy, dh) -> dict:
    """A norm backward's incoming gradients as norms._check's rows like x."""
    return {"dy": dy} if dh is None else {"dy": dy, "dh": dh}


def _norm_setup_context(ctx, inputs, output):
    x, weight, eps = inputs[0], inputs[1], inputs[-1]
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, dy, backward=None):
    """dx, dweight (`backward`: the op, or under EagerRmsNorm the kernels' own
    function)."""
    x, weight = ctx.saved_tensors
    dx, dw = (backward or rms_norm_backward)(dy, x, weight, ctx.eps)
    return dx, dw, None


def _layer_norm_backward(ctx, dy, backward=None):
    x, weight = ctx.saved_tensors
    dx, dw, db = (backward or layer_norm_backward)(dy, x, weight, ctx.eps)
    return dx, dw, db, None


def _fused_add_setup_context(ctx, inputs, output):
    """Saves the sum h (the norm's input) and the weight."""
    ctx.save_for_backward(output[1], inputs[2])
    ctx.eps = inputs[-1]


def _fused_add_backward(ctx, dy, dh, backward):
    """The norm's backward at h with dh added: x and residual share dx."""
    h, weight = ctx.saved_tensors
    dx, *dparams = backward(dy, h, weight, ctx.eps, dh)
    return (dx, dx, *dparams, None)


rms_norm.register_autograd(_rms_norm_backward, setup_context=_norm_setup_context)
layer_norm.register_autograd(_layer_norm_backward, setup_context=_norm_setup_context)
fused_add_rms_norm.register_autograd(
    lambda ctx, dy, dh: _fused_add_backward(ctx, dy, dh, rms_norm_backward),
    setup_context=_fused_add_setup_context)
fused_add_layer_norm.register_autograd(
    lambda ctx, dy, dh: _fused_add_backward(ctx, dy, dh, layer_norm_backward),
    setup_context=_fused_add_setup_context)


class EagerRmsNorm(EagerFunction):
    """rms_norm's forward and backward for eager calls on checked tensors: the
    kernels launch directly, without the op's dispatch (as EagerAttention)."""

    @staticmethod
    def forward(ctx, x, weight, eps, planned, planned_backward):
        """planned, planned_backward: norms.planned_rms_norm's and
        .planned_backward's launches for x's signature (an eager call's,
        remembered)."""
        y = eager.empty_rows(x)
        planned(x, weight, eps, y)
        _norm_setup_context(ctx, (x, weight, eps), y)
        ctx.planned_backward = planned_backward
        return y

    @staticmethod
    @first_order
    def backward(ctx, dy):
        sums = ctx.needs_input_grad[1]          # (no dweight, no column sum)
        return (*_rms_norm_backward(ctx, dy, functools.partial(ctx.planned_backward, sums=sums)),
                None, None)


class EagerLayerNorm(EagerFunction):
    """layer_norm's, as EagerRmsNorm."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, planned, planned_backward):
        y = eager.empty_rows(x)
        planned(x, weight, bias, eps, y)
        _norm_setup_context(ctx, (x, weight, bias, eps), y)
        ctx.planned_backward = planned_backward
        return y

    @staticmethod
    @first_order
    def backward(ctx, dy):
        sums = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        return (*_layer_norm_backward(ctx, dy, functools.partial(ctx.planned_backward,
                                                                  sums=sums)), None, None)


# -------------------------------------------------------------- activations

@torch.library.custom_op("tk_mlir::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up into a new tensor of gate's shape."""
    activations._check(gate, up)
    return activations.launch(gate, up)


@swiglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("tk_mlir::swiglu_backward", mutates_args=())
def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor,
                    up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of swiglu."""
    activations._check(gate, up, "swiglu_backward")
    checks.companion("swiglu_backward", "dy", dy, "gate", gate, tuple(gate.shape),
                     "gate's shape", dtypes=(gate.dtype,))
    return activations.swiglu_backward(dy, gate, up)


@swiglu_backward.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _swiglu_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy, backward=None):
    return (backward or swiglu_backward)(dy, *ctx.saved_tensors)


swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup_context)


class EagerSwiglu(EagerFunction):
    """swiglu's forward and backward for eager calls on checked tensors."""

    @staticmethod
    def forward(ctx, gate, up, planned, planned_backward):
        """planned, planned_backward: activations.planned's and
        .planned_backward's launches for gate's and up's signature (an eager
        call's, remembered)."""
        _swiglu_setup_context(ctx, (gate, up), None)
        ctx.planned_backward = planned_backward
        return planned(gate, up)

    @staticmethod
    @first_order
    def backward(ctx, dy):
        return (*_swiglu_backward(ctx, dy, ctx.planned_backward), None, None)


# ------------------------------------------------------------------ rotary

@torch.library.custom_op("tk_mlir::rotary_embedding", mutates_args=())
def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     inverse: bool = False, interleaved: bool = False) -> torch.Tensor:
    """x rotated by the angles of cos and sin (by their opposite with
    inverse: the backward), into a new contiguous tensor; interleaved: the
    GPT-J pairs (2i, 2i + 1)."""
    x = checks.kernel_operand(x)    # (as the backward hands it: any gradient, e.g. expanded)
    rotary._check(x, cos, sin)
    checks.on_cuda("rotary_embedding", "x", x)
    return rotary.launch(x, cos, sin, inverse, interleaved)


@rotary_embedding.register_fake
def _(x, cos, sin, inverse=False, interleaved=False):
    return x.new_empty(x.shape)


def _rotary_setup_context(ctx, inputs, output):
    x, cos, sin = inputs[:3]
    ctx.save_for_backward(cos, sin)
    ctx.inverse = len(inputs) > 3 and inputs[3]
    ctx.interleaved = len(inputs) > 4 and inputs[4]


def _rotary_backward(ctx, dy):
    """dx: dy rotated back (a rotation's transpose is its inverse)."""
    cos, sin = ctx.saved_tensors
    dx = rotary_embedding(dy, cos, sin, not ctx.inverse, ctx.interleaved)
    return dx, None, None, None, None


rotary_embedding.register_autograd(_rotary_backward, setup_context=_rotary_setup_context)


class EagerRotation(EagerFunction):
    """rotary_embedding's and rotary_embedding_qk's forward and backward for
    eager calls on checked tensors: `apply(*xs, cos, sin, rotate,
    rotate_back)`, xs one tensor or q and k, one launch each way, each
    planned for the call's signature (rotary.planned). q's and k's
    rotations may be differentiated one at a time, as two calls' would be:
    cos and sin (inputs without gradient) are held rather than saved (saved
    tensors are freed by the first backward), their versions checked as
    saving would, and an output without a gradient gives its input none."""

    @staticmethod
    def forward(ctx, *args):
        *xs, cos, sin, rotate, rotate_back = args
        ctx.held, ctx.versions = (cos, sin), _versions(cos, sin)
        ctx.like = [dict(size=x.shape, dtype=x.dtype, device=x.device) for x in xs]
        ctx.rotate_back = rotate_back
        ctx.set_materialize_grads(False)
        return rotate(*xs, cos, sin)          # (a tuple: of one for one tensor)

    @staticmethod
    @first_order
    def backward(ctx, *grads):
        if _versions(*ctx.held) != ctx.versions:
            raise RuntimeError("rotary_embedding: cos or sin was modified by an inplace "
                               "operation after the rotation, whose backward reads them")
        if all(g is None for g in grads):
            return (None,) * (len(grads) + 4)
        given = [torch.zeros(**like) if g is None else g for g, like in zip(grads, ctx.like)]
        dxs = ctx.rotate_back(*given, *ctx.held)
        return (*(None if g is None else dx for g, dx in zip(grads, dxs)), None, None, None,
                None)


def _versions(*tensors):
    """The tensors' version counters (None for inference tensors, which keep none)."""
    return tuple(None if t.is_inference() else t._version for t in tensors)

# ------------------------------------------------------------------ losses

@torch.library.custom_op("tk_mlir::cross_entropy", mutates_args=())
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                  label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse): the loss as losses.cross_entropy reduces it, and each
    row's log-sum-exp (N,) f32 for the backward (it carries no gradient)."""
    losses._check(logits, target, ignore_index, reduction, label_smoothing)
    return losses.launch(logits, target, ignore_index, reduction, label_smoothing)


@cross_entropy.register_fake
def _(logits, target, ignore_index, reduction, label_smoothing):
    n = logits.shape[0]
    loss = logits.new_empty((n,) if reduction == "none" else ())
    return loss, logits.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("tk_mlir::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                           lse: torch.Tensor, ignore_index: int, reduction: str,
                           label_smoothing: float) -> torch.Tensor:
    """d logits of cross_entropy."""
    fn = "cross_entropy_backward"
    losses._check(logits, target, ignore_index, reduction, label_smoothing, fn)
    _check_loss_gradient(fn, dloss, lse, "logits", logits, reduction)
    return losses.cross_entropy_backward(dloss, logits, target, lse, ignore_index, reduction,
                                         label_smoothing)


def _check_loss_gradient(fn: str, dloss, lse, rows_name: str, rows, reduction: str) -> None:
    """A loss backward op's dloss (the loss's shape, `rows`' dtype or f32) and
    the forward's lse (f32, a value per row of `rows`)."""
    checks.tensor(fn, "lse", lse, ndim=1, dtypes=(torch.float32,))
    checks.like(fn, "lse", lse, rows_name, rows, dtype=False)
    if lse.shape[0] < rows.shape[0]:
        raise ValueError(f"{fn}: lse must hold one value per row of {rows_name} (at least "
                         f"{rows.shape[0]}), got shape {tuple(lse.shape)}")
    checks.companion(fn, "dloss", dloss, rows_name, rows,
                     (rows.shape[0],) if reduction == "none" else (),
                     f"the loss's shape for reduction={reduction!r}",
                     dtypes=(rows.dtype, torch.float32))


@cross_entropy_backward.register_fake
def _(dloss, logits, target, lse, ignore_index, reduction, label_smoothing):
    return logits.new_empty(logits.shape)     # (contiguous, whatever logits' strides)


def _cross_entropy_setup_context(ctx, inputs, output):
    logits, target, ctx.ignore_index, ctx.reduction, ctx.label_smoothing = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.set_materialize_grads(False)


def _cross_entropy_backward(ctx, dloss, dlse, backward=None):
    if dloss is None:
        return None, None, None, None, None
    logits, target, lse = ctx.saved_tensors
    dx = (backward or cross_entropy_backward)(dloss, logits, target, lse, ctx.ignore_index,
                                              ctx.reduction, ctx.label_smoothing)
    return dx, None, None, None, None


cross_entropy.register_autograd(_cross_entropy_backward,
                                setup_context=_cross_entropy_setup_context)


class EagerCrossEntropy(EagerFunction):
    """cross_entropy's forward and backward for eager calls on checked tensors."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, label_smoothing):
        out = losses.launch(logits, target, ignore_index, reduction, label_smoothing)
        _cross_entropy_setup_context(ctx, (logits, target, ignore_index, reduction,
                                           label_smoothing), out)
        ctx.mark_non_differentiable(out[1])
        return out

    @staticmethod
    @first_order
    def backward(ctx, dloss, dlse):
        return _cross_entropy_backward(ctx, dloss, dlse, losses.cross_entropy_backward)


@torch.library.custom_op("tk_mlir::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         ignore_index: int, reduction: str, low_memory: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) of cross_entropy(h @ weight.T, target), the logits a slice
    of the vocabulary at a time (losses.linear_cross_entropy)."""
    losses._check_linear(h, weight, target, ignore_index, reduction)
    return losses.linear_forward(h, weight, target, ignore_index, reduction, low_memory)


@linear_cross_entropy.register_fake
def _(h, weight, target, ignore_index, reduction, low_memory=False):
    n = h.shape[0]
    return h.new_empty((n,) if reduction == "none" else ()), h.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("tk_mlir::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(dloss: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                                  target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                                  reduction: str, need_h: bool, need_weight: bool,
                                  low_memory: bool = False
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, dweight) of linear_cross_entropy; one not needed is an empty tensor."""
    fn = "linear_cross_entropy_backward"
    losses._check_linear(h, weight, target, ignore_index, reduction, fn)
    _check_loss_gradient(fn, dloss, lse, "h", h, reduction)
    return losses.linear_backward(dloss, h, weight, target, lse, ignore_index, reduction,
                                  need_h, need_weight, low_memory)


@linear_cross_entropy_backward.register_fake
def _(dloss, h, weight, target, lse, ignore_index, reduction, need_h, need_weight,
      low_memory=False):
    return (torch.empty_like(h) if need_h else h.new_empty(0),
            torch.empty_like(weight) if need_weight else h.new_empty(0))


def _linear_ce_setup_context(ctx, inputs, output):
    h, weight, target, ctx.ignore_index, ctx.reduction, ctx.low_memory = inputs
    ctx.save_for_backward(h, weight, target, output[1])
    ctx.set_materialize_grads(False)


def _linear_ce_backward(ctx, dloss, dlse, backward=None):
    if dloss is None:
        return None, None, None, None, None, None
    h, weight, target, lse = ctx.saved_tensors
    need_h, need_weight = ctx.needs_input_grad[:2]
    dh, dw = (backward or linear_cross_entropy_backward)(dloss, h, weight, target, lse,
                                                         ctx.ignore_index, ctx.reduction,
                                                         need_h, need_weight, ctx.low_memory)
    return (dh if need_h else None), (dw if need_weight else None), None, None, None, None


linear_cross_entropy.register_autograd(_linear_ce_backward,
                                       setup_context=_linear_ce_setup_context)


@torch.library.custom_op("tk_mlir::linear_cross_entropy_with_grads", mutates_args=())
def linear_cross_entropy_with_grads(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                    ignore_index: int, reduction: str, need_h: bool,
                                    need_weight: bool, low_memory: bool = False
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dh, dweight) of a scalar linear_cross_entropy ("mean" or
    "sum"), the gradients those of dloss = 1, made in the forward
    (losses.linear_forward_with_grads: the logits made once, or twice with
    low_memory); one not needed is an empty tensor. Its autograd scales
    them by dloss. What torch.compile traces when h or weight requires
    grad."""
    fn = "linear_cross_entropy_with_grads"
    losses._check_linear(h, weight, target, ignore_index, reduction, fn)
    if reduction == "none":
        raise ValueError(f"{fn}: reduction must be 'mean' or 'sum' (a scalar loss, whose "
                         f"gradients the forward makes), got 'none'")
    loss, _lse, dh, dw = losses.linear_forward_with_grads(h, weight, target, ignore_index,
                                                          reduction, need_h, need_weight,
                                                          low_memory)
    return loss, dh, dw


@linear_cross_entropy_with_grads.register_fake
def _(h, weight, target, ignore_index, reduction, need_h, need_weight, low_memory=False):
    return (h.new_empty(()), torch.empty_like(h) if need_h else h.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0))


def _linear_ce_grads_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.set_materialize_grads(False)


def _linear_ce_grads_backward(ctx, dloss, ddh, ddw):
    need_h, need_weight = ctx.needs_input_grad[:2]
    if dloss is None:
        return (None,) * 8
    dh, dw = ctx.saved_tensors
    scale = dloss.to(dh.dtype)
    return (dh * scale if need_h else None), (dw * scale if need_weight else None), \
        None, None, None, None, None, None


linear_cross_entropy_with_grads.register_autograd(_linear_ce_grads_backward,
                                                  setup_context=_linear_ce_grads_setup_context)


class EagerLinearCrossEntropy(EagerFunction):
    """linear_cross_entropy's forward and backward for eager calls. A scalar
    loss ("mean", "sum") gets its gradients in the forward, for dloss = 1
    (losses.linear_forward_with_grads: no logits made twice, but with
    low_memory); the backward
    scales them in place (no pass over them for dloss = 1, the usual case)
    and hands them over (no second dweight-sized
    tensor), so a second backward through a retained graph makes them again
    from the saved inputs, as "none" always does."""

    @staticmethod
    def forward(ctx, h, weight, target, ignore_index, reduction, low_memory):
        args = h, weight, target, ignore_index, reduction, low_memory
        if reduction == "none":
            out = losses.linear_forward(*args)
            ctx.grads = None
        else:
            need_h, need_weight = ctx.needs_input_grad[:2]
            loss, lse, dh, dw = losses.linear_forward_with_grads(
                h, weight, target, ignore_index, reduction, need_h, need_weight, low_memory)
            out = loss, lse
            ctx.grads = dh, dw
        _linear_ce_setup_context(ctx, args, out)
        ctx.mark_non_differentiable(out[1])
        return out

    @staticmethod
    @first_order
    def backward(ctx, dloss, dlse):
        if ctx.grads is None:
            return _linear_ce_backward(ctx, dloss, dlse, losses.linear_backward)
        if dloss is None:
            return None, None, None, None, None, None
        need_h, need_weight = ctx.needs_input_grad[:2]
        (dh, dw), ctx.grads = ctx.grads, None
        losses.scale_unless_one([t for t, need in ((dh, need_h), (dw, need_weight)) if need],
                                dloss)
        return (dh if need_h else None), (dw if need_weight else None), None, None, None, None


# --------------------------------------------------------------- attention

@torch.library.custom_op("tk_mlir::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: float, deterministic: bool = False, left: int = -1, right: int = -1,
              softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o laid out like q (torch.empty_like), lse (B, H, N) f32 as
    flash_attention.lse_like makes it. See flash_attention.attention for the arguments
    (deterministic is for the backward: autograd keeps it, as it keeps the
    window (left, right) and softcap)."""
    flash_attention._check(q, k, v)
    scale, left, right, softcap = checks.attention_options(
        "attention", q.shape[-1], flash_attention.reach(q, k), scale, (left, right), softcap)
    checks.on_cuda("attention", "q", q)
    given = q
    q, k, v = (checks.kernel_operand(t) for t in (q, k, v))   # (rows the kernels cannot read)
    o, lse = attention_forward(q, k, v, causal, scale, (left, right), softcap)
    return checks.laid_out_as_given(o, given, q), lse


def attention_forward(q, k, v, causal, scale, window=(-1, -1), softcap=0.0, planned=None):
    """(o, lse) of the forward kernel on checked tensors, as the op returns
    them (an eager call with nothing to differentiate calls this alone, with
    its launch `planned` by flash_attention.planned_launch)."""
    o, rows = torch.empty_like(q), flash_attention.lse_rows(q)
    if planned is None:
        planned = flash_attention.planned_launch(q, k, causal, scale, window, softcap)
    planned(q, k, v, o, rows)
    # (narrow costs a torch call, ~2 µs: skipped where the rows are not padded)
    return o, rows if rows.shape[-1] == q.shape[2] else rows.narrow(-1, 0, q.shape[2])


@attention.register_fake
def _(q, k, v, causal, scale, deterministic=False, left=-1, right=-1, softcap=0.0):
    return torch.empty_like(q), flash_attention.lse_like(q)


@torch.library.custom_op("tk_mlir::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                           k: torch.Tensor | None, v: torch.Tensor | None, causal: bool,
                           scale: float, left: int = -1, right: int = -1,
                           softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o (B, N_new, H, D), lse (B, H, N_new) f32), both contiguous; k and v,
    when given, are written into the caches first (the op's mutation). See
    decode_attention.attention_with_kvcache for the arguments."""
    fn = "attention_with_kvcache"
    decode_attention._check(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
    scale, left, right, softcap = checks.attention_options(
        fn, q.shape[-1], decode_attention.reach(q, k_cache, block_table), scale, (left, right),
        softcap)
    checks.on_cuda(fn, "q", q)
    if k is not None:
        decode_attention.written_apart(q, k_cache, v_cache, k, v)
    o, lse = decode_attention.forward(q, k_cache, v_cache, cache_seqlens, block_table, k, v,
                                      causal, scale, left, right, softcap)
    return o.contiguous(), lse.contiguous()


@attention_with_kvcache.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, k, v, causal, scale, left=-1, right=-1,
      softcap=0.0):
    B, N, H = q.shape[:3]
    return torch.empty_like(q, memory_format=torch.contiguous_format), \
        q.new_empty(B, H, N, dtype=torch.float32)


@torch.library.custom_op("tk_mlir::attention_backward", mutates_args=())
def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                       deterministic: bool = False, left: int = -1, right: int = -1,
                       softcap: float = 0.0, dlse: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of attention by the backward kernels, given the gradients
    of o (do) and of lse (dlse, or None): an op of its own, so that a
    compiled backward graph calls it as one node (it cannot trace into a
    cuda-python launch)."""
    fn = "attention_backward"
    flash_attention._check(q, k, v)
    _check_attention_backward(fn, do, o, dlse, lse, q, tuple(q.shape[:3]))
    scale, left, right, softcap = checks.attention_options(
        fn, q.shape[-1], flash_attention.reach(q, k), scale, (left, right), softcap)
    checks.on_cuda(fn, "q", q)
    if not q.numel() * k.numel():       # no rows or no keys: o does not depend on them
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    given = (q, k, v)
    q, k, v = (checks.kernel_operand(t) for t in given)
    grads = flash_attention.attention_backward(checks.kernel_operand(do, q.dtype), q, k, v, o,
                                               lse, causal, scale, deterministic, left, right,
                                               softcap, dlse)
    return tuple(checks.laid_out_as_given(g, t, u) for g, t, u in zip(grads, given,
                                                                      (q, k, v)))


def _check_attention_backward(fn: str, do, o, dlse, lse, q, lse_shape: tuple) -> None:
    """An attention backward op's saved o (q's shape and dtype) and lse (f32
    of lse_shape), both on q's device, and the gradients do (o's shape) and
    dlse (lse's shape, or None): an op called directly is checked as the
    public functions are."""
    checks.companion(fn, "o", o, "q", q, tuple(q.shape), "q's shape", dtypes=(q.dtype,))
    checks.companion(fn, "lse", lse, "q", q, lse_shape, "the forward's lse",
                     dtypes=(torch.float32,))
    for name, t, ref_name, ref in (("do", do, "o", o), ("dlse", dlse, "lse", lse)):
        if t is not None:
            checks.companion(fn, name, t, "q", q, tuple(ref.shape), f"{ref_name}'s shape",
                             dtypes=(torch.bfloat16, torch.float16, torch.float32))


@attention_backward.register_fake
def _(do, q, k, v, o, lse, causal, scale, deterministic=False, left=-1, right=-1, softcap=0.0,
      dlse=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, causal, scale, deterministic = inputs[:6]
    ctx.window = tuple(inputs[6:8]) or (-1, -1)
    ctx.softcap = inputs[8] if len(inputs) > 8 else 0.0
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic
    # An output no loss reached gets None, not zeros (no dlse term to add).
    ctx.set_materialize_grads(False)


def _attention_backward(ctx, do, dlse, backward=None):
    """dq, dk, dv by the backward kernel (`backward`: the op
    attention_backward, or under EagerAttention the kernels' own function),
    which takes dO, dLSE and the forward's o and lse; dk, dv are summed over
    the query heads of each K/V head (GQA)."""
    q, k, v, o, lse = ctx.saved_tensors
    if do is None and dlse is None:     # neither output reached the loss
        return (None,) * 9
    if do is None:                      # only lse did
        do = torch.zeros_like(o)
    if not q.numel() * k.numel():      # B = 0 or H = 0: empty gradients, no launch
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)) + (None,) * 6
    # e.g. the expanded gradient of o.sum(), for the op (the eager backward copies dO
    # into o's layout itself, eager.laid_out: not twice)
    if backward is None and do.stride() != o.stride():
        do = do.contiguous()
    args = (do, q, k, v, o, lse, ctx.causal, ctx.scale)
    backward = backward or attention_backward
    # deterministic and the masks passed only when set: the default call is the one it
    # always was
    extra = {"deterministic": True} if ctx.deterministic else {}
    if ctx.window != (-1, -1) or ctx.softcap:
        extra.update(left=ctx.window[0], right=ctx.window[1], softcap=ctx.softcap)
    if dlse is not None:
        extra.update(dlse=dlse)
    dq, dk, dv = backward(*args, **extra)
    return dq, dk, dv, None, None, None, None, None, None


attention.register_autograd(_attention_backward, setup_context=_attention_setup_context)


class EagerAttention(EagerFunction):
    """The attention op's forward and backward for eager calls on checked
    tensors: the kernels launch directly, without the op's dispatch (less
    host time, and no import of torch._dynamo, which the first call of any
    custom op's kernel makes). torch.compile traces the op instead."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, deterministic, left, right, softcap, planned,
                backward):
        """planned, backward: flash_attention's planned launch and backward for
        calls like this one (an eager call's, remembered)."""
        o, lse = attention_forward(q, k, v, causal, scale, (left, right), softcap, planned)
        _attention_setup_context(ctx, (q, k, v, causal, scale, deterministic, left, right,
                                       softcap), (o, lse))
        ctx.backward = backward
        return o, lse

    @staticmethod
    @first_order
    def backward(ctx, do, dlse):
        return (*_attention_backward(ctx, do, dlse, ctx.backward), None, None)


@torch.library.custom_op("tk_mlir::attention_varlen", mutates_args=())
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool,
                     scale: float, left: int = -1, right: int = -1, softcap: float = 0.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o laid out like q, lse (H, total_q) f32) of packed sequences. See
    varlen_attention.attention_varlen for the arguments."""
    fn = "attention_varlen"
    varlen_attention._check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    scale, left, right, softcap = checks.attention_options(
        fn, q.shape[-1], varlen_attention.reach(q, k), scale, (left, right), softcap)
    checks.on_cuda(fn, "q", q)
    return varlen_attention.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, left,
                                    right, softcap)


@attention_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, left=-1, right=-1, softcap=0.0):
    return torch.empty_like(q), varlen_attention.lse_like(q)


@torch.library.custom_op("tk_mlir::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                              causal: bool, scale: float, left: int = -1, right: int = -1,
                              softcap: float = 0.0, dlse: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of attention_varlen by the backward kernels, given the
    gradients of o (do) and of lse (dlse, or None)."""
    fn = "attention_varlen_backward"
    varlen_attention._check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    _check_attention_backward(fn, do, o, dlse, lse, q, (q.shape[1], q.shape[0]))
    scale, left, right, softcap = checks.attention_options(
        fn, q.shape[-1], varlen_attention.reach(q, k), scale, (left, right), softcap)
    checks.on_cuda(fn, "q", q)
    return varlen_attention.backward(checks.kernel_operand(do, q.dtype), q, k, v, o, lse,
                                     cu_seqlens_q, cu_seqlens_k, causal, scale, left, right,
                                     softcap, dlse)


@attention_varlen_backward.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, causal, scale, left=-1, right=-1,
      softcap=0.0, dlse=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, causal, scale, left, right, softcap = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.masks = (causal, scale, left, right, softcap)
    ctx.set_materialize_grads(False)    # as attention's: an unused output gets None


def _varlen_backward(ctx, do, dlse, backward=None):
    """dq, dk, dv (`backward`: the op, or under EagerAttentionVarlen the
    kernels' own function), from the gradients of o and lse, as attention's."""
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    if do is None and dlse is None:
        return (None,) * 10
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = (backward or attention_varlen_backward)(do, q, k, v, o, lse, cu_q, cu_k,
                                                         *ctx.masks, dlse=dlse)
    return dq, dk, dv, None, None, None, None, None, None, None


attention_varlen.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


class EagerAttentionVarlen(EagerFunction):
    """attention_varlen's op for eager calls on checked tensors, launching
    directly (as EagerAttention)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale, left, right, softcap, planned,
                backward):
        """planned, backward: varlen_attention's planned forward and a backward
        for calls like this one (an eager call's, remembered)."""
        o, lse = planned(q, k, v, cu_q, cu_k)
        _varlen_setup_context(ctx, (q, k, v, cu_q, cu_k, causal, scale, left, right, softcap),
                              (o, lse))
        ctx.backward = backward
        return o, lse

    @staticmethod
    @first_order
    def backward(ctx, do, dlse):
        return (*_varlen_backward(ctx, do, dlse, ctx.backward), None, None)


@torch.library.custom_op("tk_mlir::linear_attention", mutates_args=())
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s0: torch.Tensor | None,
                     z0: torch.Tensor | None, feature_map: str, causal: bool, normalize: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, S, z): o like v (contiguous) and the final state (empty when not
    causal). See chunked_linear_attention.linear_attention for the arguments."""
    state = None if s0 is None else (s0, z0)
    fm = None if feature_map == "none" else feature_map
    chunked_linear_attention._check(q, k, v, fm, causal, normalize, state, False)
    checks.on_cuda("linear_attention", "q", q)
    return chunked_linear_attention.forward(q, k, v, s0, z0, feature_map, causal, normalize,
                                           scale)


@linear_attention.register_fake
def _(q, k, v, s0, z0, feature_map, causal, normalize, scale):
    B, N, H, DK = q.shape
    if feature_map == "taylor2":
        DK = taylor_linear_attention.feature_dim(DK)
    shape = (B, H, DK, v.shape[3]) if causal else (0,)
    return (torch.empty(v.shape, dtype=v.dtype, device=v.device),
            q.new_empty(shape, dtype=torch.float32),
            q.new_empty((B, H, DK) if causal else (0,), dtype=torch.float32))


@torch.library.custom_op("tk_mlir::linear_attention_backward", mutates_args=())
def linear_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, o: torch.Tensor, s0: torch.Tensor | None,
                              z0: torch.Tensor | None, feature_map: str, causal: bool,
                              normalize: bool, scale: float, ds1: torch.Tensor | None = None,
                              dz1: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dS0, dz0) of linear_attention by its backward kernel, given
    the gradients of o (do) and of the final state (ds1, dz1, or None) (dS0,
    dz0 empty without an initial state: an op returns tensors)."""
    fn = "linear_attention_backward"
    state = None if s0 is None else (s0, z0)
    chunked_linear_attention._check(q, k, v, None if feature_map == "none" else feature_map,
                                    causal, normalize, state, False, fn)
    for name, t in (("do", do), ("o", o)):
        checks.companion(fn, name, t, "q", q, tuple(v.shape), "v's shape",
                         dtypes=(torch.bfloat16, torch.float16, torch.float32))
    B, _, H, DK = q.shape
    if feature_map == "taylor2":
        DK = taylor_linear_attention.feature_dim(DK)
    for name, t, shape in (("ds1", ds1, (B, H, DK, v.shape[3])), ("dz1", dz1, (B, H, DK))):
        if t is not None:
            if not causal:
                raise ValueError(f"{fn}: {name} is a final state's gradient: causal=True only")
            checks.companion(fn, name, t, "q", q, shape, "the final state's shape",
                             dtypes=(torch.float32,))
    dq, dk, dv, ds0, dz0 = chunked_linear_attention.backward(do, q, k, v, o, s0, z0,
                                                             feature_map, causal, normalize,
                                                             scale, ds1=ds1, dz1=dz1)
    if s0 is None:      # (two tensors: an op's outputs may not alias each other)
        ds0, dz0 = (q.new_empty(0, dtype=torch.float32) for _ in range(2))
    return dq, dk, dv, ds0, dz0


@linear_attention_backward.register_fake
def _(do, q, k, v, o, s0, z0, feature_map, causal, normalize, scale, ds1=None, dz1=None):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device),
            q.new_empty(0 if s0 is None else s0.shape, dtype=torch.float32),
            q.new_empty(0 if z0 is None else z0.shape, dtype=torch.float32))


def _linear_attention_setup_context(ctx, inputs, output):
    q, k, v, s0, z0, feature_map, causal, normalize, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], s0, z0)
    ctx.flags = (feature_map, causal, normalize, scale)
    ctx.set_materialize_grads(False)


def _linear_attention_backward(ctx, do, ds1, dz1, backward=None):
    """dq, dk, dv and the initial state's gradients, from the gradients of o
    and of the final state (S, z): a chunk at a time, a loss may reach both."""
    q, k, v, o, s0, z0 = ctx.saved_tensors
    if do is None and ds1 is None and dz1 is None:
        return (None,) * 9
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv, ds0, dz0 = (backward or linear_attention_backward)(do, q, k, v, o, s0, z0,
                                                                   *ctx.flags, ds1=ds1,
                                                                   dz1=dz1)
    if s0 is None:
        ds0 = dz0 = None
    return dq, dk, dv, ds0, dz0, None, None, None, None


linear_attention.register_autograd(_linear_attention_backward,
                                   setup_context=_linear_attention_setup_context)


class EagerLinearAttention(EagerFunction):
    """linear_attention's op for eager calls on checked tensors, launching
    directly (as EagerAttention)."""

    @staticmethod
    def forward(ctx, q, k, v, s0, z0, feature_map, causal, normalize, scale):
        out, ctx.starts = chunked_linear_attention.forward_and_starts(
            q, k, v, s0, z0, feature_map, causal, normalize, scale)
        _linear_attention_setup_context(ctx, (q, k, v, s0, z0, feature_map, causal, normalize,
                                              scale), out)
        return out

    @staticmethod
    @first_order
    def backward(ctx, do, ds1, dz1):
        # the forward's segment starts (an attribute, not saved tensors: intermediates
        # that saved-tensor hooks do not see): the backward does not sum the keys again
        backward = functools.partial(chunked_linear_attention.backward, starts=ctx.starts)
        return _linear_attention_backward(ctx, do, ds1, dz1, backward)


@torch.library.custom_op("tk_mlir::linear_attention_step", mutates_args=())
def linear_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s0: torch.Tensor,
                          z0: torch.Tensor, feature_map: str, normalize: bool, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, S, z) of one decoding step (no gradient). See
    chunked_linear_attention.linear_attention_step."""
    fm = None if feature_map == "none" else feature_map
    chunked_linear_attention._check(q, k, v, fm, True, normalize, (s0, z0), False)
    if feature_map == "taylor2":
        raise ValueError("linear_attention_step: the op takes feature_map 'none', 'elu1' or "
                         "'relu'; 'taylor2' runs as tk_mlir.kernels.linear_attention_step, "
                         "which steps through the chunked kernels")
    checks.on_cuda("linear_attention_step", "q", q)
    return chunked_linear_attention.step(q, k, v, s0, z0, feature_map, normalize, scale)


@linear_attention_step.register_fake
def _(q, k, v, s0, z0, feature_map, normalize, scale):
    return (torch.empty(v.shape, dtype=v.dtype, device=v.device),
            torch.empty(s0.shape, dtype=s0.dtype, device=s0.device),
            torch.empty(z0.shape, dtype=z0.dtype, device=z0.device))


# --------------------------------------------------------------------- ssd

@torch.library.custom_op("tk_mlir::ssd", mutates_args=())
def ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
        D: torch.Tensor | None, h0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, final state (b, h, p, n) f32). See state_space_duality.ssd for the
    arguments."""
    state_space_duality._check(x, dt, A, B, C, 64, D, h0, True)
    checks.on_cuda("ssd", "x", x)
    return state_space_duality.forward(x, dt, A, B, C, D, h0)


@ssd.register_fake
def _(x, dt, A, B, C, D, h0):
    b, _, h, p = x.shape
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            x.new_empty((b, h, p, B.shape[3]), dtype=torch.float32))


@torch.library.custom_op("tk_mlir::ssd_backward", mutates_args=())
def ssd_backward(dy: torch.Tensor | None, dh1: torch.Tensor | None, x: torch.Tensor,
                 dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor | None, h0: torch.Tensor | None, h1: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, ddt, dA, dB, dC, dD, dh0) of ssd by its backward kernel (dD, dh0
    empty without D, h0: an op returns tensors)."""
    fn = "ssd_backward"
    state_space_duality._check(x, dt, A, B, C, 64, D, h0, True)
    b, _, h, p = x.shape
    state = (b, h, p, B.shape[3])
    for name, t, dtype, want, why in (("h1", h1, torch.float32, state, "the final state's"),
                                      ("dy", dy, x.dtype, tuple(x.shape), "x's"),
                                      ("dh1", dh1, torch.float32, state, "the final state's")):
        if t is not None:
            checks.companion(fn, name, t, "x", x, want, f"{why} shape", dtypes=(dtype,))
    checks.on_cuda(fn, "x", x)
    dx, ddt, dA, dB, dC, dD, dh0 = state_space_duality.backward(dy, dh1, x, dt, A, B, C, D,
                                                                h0, h1)
    empty = (x.new_empty(0, dtype=torch.float32) for _ in range(2))
    return dx, ddt, dA, dB, dC, next(empty) if dD is None else dD, \
        next(empty) if dh0 is None else dh0


@ssd_backward.register_fake
def _(dy, dh1, x, dt, A, B, C, D, h0, h1):
    like = (lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device))
    return (like(x), like(dt), like(A), like(B), like(C),
            like(D) if D is not None else x.new_empty(0, dtype=torch.float32),
            like(h0) if h0 is not None else x.new_empty(0, dtype=torch.float32))


def _ssd_setup_context(ctx, inputs, output):
    x, dt, A, B, C, D, h0 = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, h0, output[1])
    ctx.set_materialize_grads(False)


def _ssd_backward(ctx, dy, dh1, backward=None):
    """Every input's gradient, the returned state's (dh1) included."""
    x, dt, A, B, C, D, h0, h1 = ctx.saved_tensors
    if dy is None and dh1 is None:
        return (None,) * 7
    dx, ddt, dA, dB, dC, dD, dh0 = (backward or ssd_backward)(dy, dh1, x, dt, A, B, C, D, h0,
                                                              h1)
    return dx, ddt, dA, dB, dC, dD if D is not None else None, dh0 if h0 is not None else None


ssd.register_autograd(_ssd_backward, setup_context=_ssd_setup_context)


class EagerSsd(EagerFunction):
    """ssd's op for eager calls on checked tensors, launching directly."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, h0):
        out = state_space_duality.forward(x, dt, A, B, C, D, h0)
        _ssd_setup_context(ctx, (x, dt, A, B, C, D, h0), out)
        return out

    @staticmethod
    @first_order
    def backward(ctx, dy, dh1):
        return _ssd_backward(ctx, dy, dh1, state_space_duality.backward)


class EagerFusedAddNorm(EagerFunction):
    """fused_add_rms_norm's and fused_add_layer_norm's forward and backward for
    eager calls on checked tensors (planned: norms.planned_fused_add's launch
    and planned_backward: norms.planned_backward's run, dh added, for the
    call's signature; then x, residual, weight, [bias,] eps)."""

    @staticmethod
    def forward(ctx, planned, planned_backward, x, residual, weight, *bias_eps):
        y, h = planned(x, residual, weight, *bias_eps)
        _fused_add_setup_context(ctx, (x, residual, weight, *bias_eps), (y, h))
        ctx.planned_backward = planned_backward
        return y, h

    @staticmethod
    @first_order
    def backward(ctx, dy, dh):
        sums = any(ctx.needs_input_grad[4:-1])   # (weight, and bias for layer_norm)
        return (None, None, *_fused_add_backward(ctx, dy, dh, functools.partial(
            ctx.planned_backward, sums=sums)))
