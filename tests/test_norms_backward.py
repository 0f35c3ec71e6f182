"""rms_norm and layer_norm gradients (tk_mlir/kernels/norms.py): the backward
kernels and the two-stage f32 column sum of dweight/dbias; and
fused_add_rms_norm / fused_add_layer_norm (the residual add and the norm in
one pass), forward and backward.

Without a GPU: the kernels in the interpreter against float64 autograd, at
widths that are not the tile's and with fewer blocks than rows (the
persistent loop), and the ops' autograd wiring on fake tensors. With one
(`-m gpu`): eager autograd, torch.compile(fullgraph=True) and opcheck against
float64 references, with fresh random inputs every run.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tk_mlir.kernels import (fused_add_layer_norm, fused_add_rms_norm, layer_norm,  # noqa: E402
                             rms_norm)

from torch_reference import relative_error as _rel  # noqa: E402

bf16 = torch.bfloat16
gpu = pytest.mark.gpu


def _reference(fn, dy, *inputs, eps):
    """float64 gradients of the norm's torch definition w.r.t. every input."""
    xs = [t.detach().double().requires_grad_() for t in inputs]
    if fn == "rms_norm":
        x, w = xs
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    else:
        y = torch.nn.functional.layer_norm(xs[0], (xs[0].shape[-1],), *xs[1:], eps)
    return torch.autograd.grad(y, xs, dy.double())


# ------------------------------------------------------ in the interpreter

@pytest.mark.parametrize("rows, d, grid", [(7, 200, 3), (4, 256, 4), (9, 600, 2)])
@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_backward_kernels_in_the_interpreter(fn, rows, d, grid):
    from tk_mlir.kernels import norms
    g = torch.Generator().manual_seed(rows * d + grid)
    x = (torch.randn(rows, d, generator=g) * 2 + 1).to(bf16)   # a mean the norm removes
    w, b, dy = (torch.randn(*s, generator=g).to(bf16) for s in ((d,), (d,), (rows, d)))
    eps = 1e-5
    dx = torch.full_like(x, float("nan"))
    parts = [torch.full((grid, d), float("nan")) for _ in range(1 if fn == "rms_norm" else 2)]
    kernel = norms.rmsnorm_backward_kernel if fn == "rms_norm" else \
        norms.layernorm_backward_kernel
    kernel.interpret[(grid,)](x, w, dy, dy, dx, *parts, eps, BLOCK=norms._block(d))
    sums = []
    for part in parts:
        sums.append(torch.full((d,), float("nan")))            # f32 out: the sums as they are
        norms.column_sum_kernel.interpret[(-(-d // 256),)](part, sums[-1])
    refs = _reference(fn, dy, x, w, *([b] if fn == "layer_norm" else []), eps=eps)
    assert _rel(dx, refs[0]) < 1e-2                            # bf16 dx
    for got, ref in zip(sums, refs[1:]):
        assert _rel(got, ref) < 1e-5                           # f32 sums of bf16 products


def test_column_sum_adds_rows_in_chunks_with_ragged_edges():
    from tk_mlir.kernels.norms import column_sum_kernel
    g = torch.Generator().manual_seed(3)
    parts = torch.randn(70, 296, generator=g)                 # 70 rows: 3 chunks of 32
    out = torch.full((296,), float("nan"), dtype=bf16)
    column_sum_kernel.interpret[(2,)](parts, out)
    assert _rel(out, parts.double().sum(0)) < 4e-3             # bf16 rounding of the sums


@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_fused_add_in_the_interpreter(fn):
    """The sum h in bf16 and the norm of h, then the backward with h's own
    gradient added (ADD_DH)."""
    from tk_mlir.kernels import norms
    rows, d, eps = 6, 200, 1e-5
    g = torch.Generator().manual_seed(21)
    x, r, dy, dh = (torch.randn(rows, d, generator=g).to(bf16) for _ in range(4))
    w, b = (torch.randn(d, generator=g).to(bf16) for _ in range(2))
    y, h = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    if fn == "rms_norm":
        norms.add_rmsnorm_kernel.interpret[(rows,)](x, r, w, y, h, eps, BLOCK=256)
    else:
        norms.add_layernorm_kernel.interpret[(rows,)](x, r, w, b, y, h, eps, BLOCK=256)
    assert torch.equal(h, x + r)                               # bf16 sum, as torch's
    params = (w,) if fn == "rms_norm" else (w, b)
    ref_y = h.double() * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + eps) * \
        w.double() if fn == "rms_norm" else torch.nn.functional.layer_norm(
            h.double(), (d,), w.double(), b.double(), eps)
    assert _rel(y, ref_y) < 1e-2
    dx = torch.full_like(x, float("nan"))
    parts = [torch.full((2, d), float("nan")) for _ in params]
    kernel = norms.rmsnorm_backward_kernel if fn == "rms_norm" else \
        norms.layernorm_backward_kernel
    kernel.interpret[(2,)](h, w, dy, dh, dx, *parts, eps, BLOCK=256, ADD_DH=True)
    ref_dx = _reference(fn, dy, h, *params, eps=eps)[0] + dh.double()
    assert _rel(dx, ref_dx) < 1e-2


@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_f16_norms_forward_and_backward_in_the_interpreter(interpret, fn):
    """f16 as bf16: outputs and gradients in f16 (f32 statistics), the fused
    add's sum rounded to f16 as torch's is, against float64."""
    g = torch.Generator().manual_seed(16)
    f16, d = torch.float16, 328
    x, r, dy = ((torch.randn(5, d, generator=g) * 2 + 0.5).to(f16) for _ in range(3))
    w, b = (torch.randn(d, generator=g).to(f16).requires_grad_() for _ in range(2))
    params = (w,) if fn == "rms_norm" else (w, b)
    xg = x.clone().requires_grad_()
    y = rms_norm(xg, w) if fn == "rms_norm" else layer_norm(xg, w, b)
    grads = torch.autograd.grad(y, (xg, *params), dy)
    eps = 1e-6 if fn == "rms_norm" else 1e-5
    refs = _reference(fn, dy, x, *params, eps=eps)
    assert y.dtype == f16 and all(t.dtype == f16 for t in grads)
    for got, ref in zip(grads, refs):
        assert _rel(got, ref) < 5e-3
    fused = fused_add_rms_norm if fn == "rms_norm" else fused_add_layer_norm
    y, h = fused(x, r, *params)
    assert h.dtype == f16 and torch.equal(h, x + r)
    h64 = (x + r).double()
    ref_y = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps) * w.double() \
        if fn == "rms_norm" else torch.nn.functional.layer_norm(h64, (d,), w.double(),
                                                                b.double(), eps)
    assert _rel(y, ref_y) < 5e-3


@pytest.mark.parametrize("weight, bias", [(False, False), (True, False), (False, True)])
def test_norms_without_weight_or_bias_in_the_interpreter(interpret, weight, bias):
    """weight=None / bias=None as F.layer_norm and F.rms_norm take them (a
    LayerNorm without elementwise_affine, or bias=False): outputs and x's
    gradient against float64, the fused add-norms too, and the given
    parameter's gradient."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(7 + 2 * weight + bias)
    d, eps = 200, 1e-5
    x, r, dy = ((torch.randn(6, d, generator=g) * 2 + 0.3).to(bf16) for _ in range(3))
    w = (torch.randn(d, generator=g) + 1).to(bf16).requires_grad_() if weight else None
    b = torch.randn(d, generator=g).to(bf16).requires_grad_() if bias else None
    xg = x.clone().requires_grad_()
    given = [t for t in (w, b) if t is not None]
    y = layer_norm(xg, w, b, eps)
    grads = torch.autograd.grad(y, (xg, *given), dy)
    x64 = x.double().requires_grad_()
    p64 = [t.detach().double().requires_grad_() for t in (w, b) if t is not None]
    it = iter(p64)
    ref = F.layer_norm(x64, (d,), next(it) if weight else None, next(it) if bias else None, eps)
    refs = torch.autograd.grad(ref, (x64, *p64), dy.double())
    assert _rel(y, ref) < 1e-2
    for got, want in zip(grads, refs):
        assert _rel(got, want) < 1e-2
    y2, h = fused_add_layer_norm(x, r, w, b, eps)
    assert torch.equal(y2, layer_norm(h, w, b, eps))
    if not bias:        # rms_norm's weight=None
        xg = x.clone().requires_grad_()
        y = rms_norm(xg, w, eps)
        x64 = x.double().requires_grad_()
        ref = F.rms_norm(x64, (d,), w.detach().double() if weight else None, eps)
        (dx,), (ref_dx,) = torch.autograd.grad(y, (xg,), dy), torch.autograd.grad(
            ref, (x64,), dy.double())
        assert _rel(y, ref) < 1e-2 and _rel(dx, ref_dx) < 1e-2
        y2, h = fused_add_rms_norm(x, r, w, eps)
        assert torch.equal(y2, rms_norm(h, w, eps))


def test_a_stand_in_made_under_inference_or_fake_mode_serves_later_training(interpret):
    """The weight a None stands for, first made under torch.inference_mode()
    or a FakeTensorMode, does not break a later call that autograd records
    (an inference tensor cannot be saved for backward; a fake one is no
    data)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from tk_mlir.kernels import norms
    x = torch.randn(4, 64).to(bf16)
    with torch.inference_mode():
        rms_norm(x)
    with FakeTensorMode(allow_non_fake_inputs=True):
        try:
            layer_norm(torch.empty(4, 64, dtype=bf16))
        except Exception:           # (the kernels take no fake tensors: its failure is fine)
            pass
    assert all(type(t) is torch.Tensor and not t.is_inference() for t in norms._CONSTANTS.values())
    for norm in (rms_norm, layer_norm):
        xg = x.clone().requires_grad_()
        (dx,) = torch.autograd.grad(norm(xg).float().sum(), (xg,))
        assert dx.isfinite().all()


def test_compiled_norms_without_weight_make_their_stand_in_in_the_graph(interpret,
                                                                          monkeypatch):
    """torch.compile(fullgraph=True) of layer_norm(x) and rms_norm(x) with no
    stand-in cached yet: made inside the traced call (no inference-mode
    query there), nothing cached, the results those of float64 torch."""
    from tk_mlir.kernels import norms
    monkeypatch.setattr(norms, "_CONSTANTS", {})
    F = torch.nn.functional
    x = torch.randn(4, 64).to(bf16)
    for norm, ref in ((layer_norm, F.layer_norm(x.double(), (64,))),
                      (rms_norm, F.rms_norm(x.double(), (64,), eps=1e-6))):
        assert _rel(torch.compile(norm, fullgraph=True)(x), ref) < 1e-2
    assert not norms._CONSTANTS


@gpu
def test_norms_without_weight_or_bias_on_the_gpu():
    """layer_norm(x) and rms_norm(x) on the GPU, eagerly and compiled, with
    gradients, against float64."""
    F = torch.nn.functional
    x, _, _, dy = _inputs(77, 1000, seed=3)
    for norm, ref_fn in ((layer_norm, lambda t: F.layer_norm(t, (1000,), eps=1e-5)),
                         (rms_norm, lambda t: F.rms_norm(t, (1000,), eps=1e-6))):
        for fn in (norm, torch.compile(norm, fullgraph=True)):
            xg = x.clone().requires_grad_()
            y = fn(xg)
            (dx,) = torch.autograd.grad(y, (xg,), dy)
            x64 = x.double().requires_grad_()
            ref = ref_fn(x64)
            (ref_dx,) = torch.autograd.grad(ref, (x64,), dy.double())
            assert _rel(y, ref) < 1e-2 and _rel(dx, ref_dx) < 1e-2


@pytest.mark.parametrize("d, base", [(1032, 100.0), (768, 10.0), (264, 1000.0)])
def test_layer_norm_of_rows_with_a_large_mean_and_a_padded_block(interpret, d, base):
    """Rows far from zero at widths that are not the block's: the centred
    row is masked past D (subtracting the padding's (BLOCK - D) * mean^2
    cancelled, giving NaN or percent errors)."""
    g = torch.Generator().manual_seed(d)
    x = (base + torch.randn(3, d, generator=g)).to(bf16)
    w, b = (torch.rand(d, generator=g) + 0.5).to(bf16), torch.randn(d, generator=g).to(bf16)
    ref = torch.nn.functional.layer_norm(x.double(), (d,), w.double(), b.double(), 1e-5)
    assert _rel(layer_norm(x, w, b), ref) < 4e-3
    r = torch.randn(3, d, generator=g).to(bf16)
    y, h = fused_add_layer_norm(x, r, w, b)
    ref = torch.nn.functional.layer_norm(h.double(), (d,), w.double(), b.double(), 1e-5)
    assert _rel(y, ref) < 4e-3


@pytest.mark.parametrize("call, rule", [
    (lambda x, w: fused_add_rms_norm(x, x[:, :8], w), r"fused_add_rms_norm: residual must have "
                                                      r"shape \(4, 16\) \(x's shape\)"),
    (lambda x, w: fused_add_layer_norm(x, x.float(), w, w), r"fused_add_layer_norm: residual "
                                                            r"must be torch.bfloat16"),
    (lambda x, w: fused_add_rms_norm(x, None, w), r"fused_add_rms_norm: residual must be a "
                                                  r"torch.Tensor"),
])
def test_fused_add_argument_rules(call, rule):
    x, w = torch.randn(4, 16).to(bf16), torch.randn(16).to(bf16)
    with pytest.raises((TypeError, ValueError), match=rule):
        call(x, w)


# ------------------------------------------------------------ on the GPU

def _inputs(rows, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.rand(rows, d, device="cuda", generator=g) * 4 - 1).to(bf16)
    w, b = ((torch.rand(d, device="cuda", generator=g) * 2 - 1).to(bf16) for _ in range(2))
    dy = (torch.rand(rows, d, device="cuda", generator=g) * 2 - 1).to(bf16)
    return x, w, b, dy


@gpu
@pytest.mark.parametrize("rows, d", [(1, 4096), (333, 4096), (1000, 5120), (77, 1000),
                                     (3000, 256), (64, 8192)])
@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_eager_gradients_match_float64(fn, rows, d):
    x, w, b, dy = _inputs(rows, d, seed=rows + d)
    inputs = [t.clone().requires_grad_() for t in ((x, w) if fn == "rms_norm" else (x, w, b))]
    y = rms_norm(*inputs) if fn == "rms_norm" else layer_norm(*inputs)
    grads = torch.autograd.grad(y, inputs, dy)
    refs = _reference(fn, dy, *inputs, eps=1e-6 if fn == "rms_norm" else 1e-5)
    for got, ref, t in zip(grads, refs, inputs):
        assert got.shape == t.shape and got.dtype == t.dtype
        assert _rel(got, ref) < 1e-2


@gpu
@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_f16_norms_match_float64_on_the_gpu(fn):
    """f16 inputs: outputs and gradients in f16, and the fused add-norm."""
    x, w, b, dy = (t.half() for t in _inputs(333, 4096, seed=16))
    inputs = [t.clone().requires_grad_() for t in ((x, w) if fn == "rms_norm" else (x, w, b))]
    y = rms_norm(*inputs) if fn == "rms_norm" else layer_norm(*inputs)
    grads = torch.autograd.grad(y, inputs, dy)
    refs = _reference(fn, dy, *inputs, eps=1e-6 if fn == "rms_norm" else 1e-5)
    assert y.dtype == torch.float16
    for got, ref in zip(grads, refs):
        assert got.dtype == torch.float16 and _rel(got, ref) < 5e-3
    fused = fused_add_rms_norm if fn == "rms_norm" else fused_add_layer_norm
    y2, h = fused(x, dy, *inputs[1:])
    assert torch.equal(h, x + dy)
    assert torch.equal(y2, rms_norm(h, w) if fn == "rms_norm" else layer_norm(h, w, b))


@gpu
@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_gradient_of_a_sum_and_of_one_input(fn):
    """An expanded (stride 0) output gradient, and weight alone requiring grad."""
    x, w, b, _ = _inputs(50, 696, seed=11)
    w = w.clone().requires_grad_()
    args = (x, w) if fn == "rms_norm" else (x, w, b)
    norm = rms_norm if fn == "rms_norm" else layer_norm
    (dw,) = torch.autograd.grad(norm(*args).float().sum(), (w,))
    ref = _reference(fn, torch.ones(50, 696, device="cuda"), *args,
                     eps=1e-6 if fn == "rms_norm" else 1e-5)[1]
    assert _rel(dw, ref) < 1e-2


@gpu
def test_out_is_refused_where_autograd_records():
    x, w, b, _ = _inputs(8, 256, seed=1)
    with pytest.raises(RuntimeError, match=r"rms_norm: out= does not take part in autograd"):
        rms_norm(x, w.requires_grad_(), out=torch.empty_like(x))
    with torch.no_grad():
        rms_norm(x, w, out=torch.empty_like(x))             # no grad mode: fine


@gpu
def test_compiled_training_step_matches_eager():
    x, w, b, dy = _inputs(300, 1536, seed=5)

    def f(x, w, b):
        return layer_norm(rms_norm(x, w), w, b)

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        inputs = [t.clone().requires_grad_() for t in (x, w, b)]
        grads.append(torch.autograd.grad(fn(*inputs), inputs, dy))
    for e, c in zip(*grads):
        assert torch.equal(e, c)          # the same kernels on the same inputs


@gpu
def test_opcheck_norms_with_autograd():
    import tk_mlir.kernels.custom_ops  # noqa: F401
    x, w, b, _ = _inputs(33, 320, seed=2)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    for op, args in ((torch.ops.tk_mlir.rms_norm.default, (x, w, 1e-6)),
                     (torch.ops.tk_mlir.layer_norm.default, (x, w, b, 1e-5))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                    "test_autograd_registration"))


@gpu
@pytest.mark.parametrize("rows, d", [(1, 4096), (333, 5120), (77, 1000)])
@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_fused_add_forward_and_gradients_match_float64(fn, rows, d):
    x, w, b, dy = _inputs(rows, d, seed=rows + d + 1)
    r, _, _, dh = _inputs(rows, d, seed=rows + d + 2)
    inputs = [t.clone().requires_grad_() for t in ((x, r, w) if fn == "rms_norm" else (x, r, w, b))]
    fused = fused_add_rms_norm if fn == "rms_norm" else fused_add_layer_norm
    y, h = fused(*inputs)
    assert torch.equal(h, x + r)
    grads = torch.autograd.grad((y, h), inputs, (dy, dh))
    # the reference: the unfused sum (bf16, as torch adds), its norm in float64
    h64 = (x + r).double().requires_grad_()
    params = [t.detach().double().requires_grad_() for t in inputs[2:]]
    eps = 1e-6 if fn == "rms_norm" else 1e-5
    ref_y = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps) * params[0] \
        if fn == "rms_norm" else torch.nn.functional.layer_norm(h64, (d,), *params, eps)
    assert _rel(y, ref_y) < 1e-2
    refs = torch.autograd.grad((ref_y, h64), [h64, *params], (dy.double(), dh.double()))
    for got, ref in zip(grads, (refs[0], refs[0], *refs[1:])):
        assert _rel(got, ref) < 1e-2
    with torch.no_grad():                       # no autograd: the forward kernel alone
        y2, h2 = fused(x, r, *inputs[2:])
    assert torch.equal(y2, y) and torch.equal(h2, h)


@gpu
def test_fused_add_compiled_matches_eager():
    x, w, b, dy = _inputs(300, 1536, seed=8)
    r = _inputs(300, 1536, seed=9)[0]

    def f(x, r, w, b):
        y, h = fused_add_rms_norm(x, r, w)
        z, h = fused_add_layer_norm(y, h, w, b)
        return z + h

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        inputs = [t.clone().requires_grad_() for t in (x, r, w, b)]
        grads.append(torch.autograd.grad(fn(*inputs), inputs, dy))
    for e, c in zip(*grads):
        assert torch.equal(e, c)


def test_norms_read_inputs_whose_last_dim_is_not_contiguous(interpret):
    g = torch.Generator().manual_seed(5)
    w = (torch.rand(64, generator=g) + 0.5).to(bf16)
    for x in (torch.randn(64, 2, generator=g).to(bf16).t(),
              torch.randn(1, 64, 2, generator=g).to(bf16).transpose(1, 2)):
        ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * \
            w.double()
        assert _rel(rms_norm(x, w), ref) < 1e-2
        r = torch.randn(x.shape, generator=g).to(bf16)
        y, h = fused_add_rms_norm(x, r.transpose(-1, -2).contiguous().transpose(-1, -2), w)
        assert torch.equal(h, x + r)


def test_the_backward_ops_check_their_arguments(interpret):
    import tk_mlir.kernels.custom_ops  # noqa: F401  registers torch.ops.tk_mlir
    ops = torch.ops.tk_mlir
    x, w = torch.randn(3, 64).to(bf16), torch.rand(64).to(bf16) + 0.5
    with pytest.raises(ValueError, match=r"rms_norm_backward: dy must have shape \(3, 64\)"):
        ops.rms_norm_backward(torch.randn(2, 64).to(bf16), x, w, 1e-6)
    with pytest.raises(ValueError, match=r"rms_norm_backward: weight must have shape \(64,\)"):
        ops.rms_norm_backward(x, x, w[:32].contiguous(), 1e-6)
    with pytest.raises(ValueError, match=r"layer_norm_backward: dh must have shape \(3, 64\)"):
        ops.layer_norm_backward(x, x, w, 1e-5, torch.randn(3, 8).to(bf16))
    with pytest.raises(ValueError, match=r"swiglu_backward: dy must have shape \(3, 64\)"):
        ops.swiglu_backward(torch.randn(2, 64).to(bf16), x, x)
    logits, lse = torch.randn(3, 64), torch.randn(3)
    with pytest.raises(ValueError, match="cross_entropy_backward: target must have shape"):
        ops.cross_entropy_backward(torch.tensor(1.0), logits, torch.tensor([1, 2, 3, 4]), lse,
                                   -100, "mean", 0.0)
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none'"):
        ops.cross_entropy_backward(torch.tensor(1.0), logits, torch.tensor([1, 2, 3]), lse,
                                   -100, "avg", 0.0)
    with pytest.raises(ValueError, match=r"dloss must have shape \(3,\)"):
        ops.cross_entropy_backward(torch.tensor(1.0), logits, torch.tensor([1, 2, 3]), lse,
                                   -100, "none", 0.0)


@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_one_row_as_a_vector_forward_and_backward(interpret, fn):
    """x of shape (D,), as F.rms_norm and F.layer_norm take it: one row, its
    output and gradients of x's shape, against float64."""
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(264, generator=g) * 4 - 1).to(bf16).requires_grad_()
    w, b = ((torch.rand(264, generator=g) + 0.5).to(bf16).requires_grad_() for _ in range(2))
    dy = (torch.rand(264, generator=g) * 2 - 1).to(bf16)
    inputs = (x, w) if fn == "rms_norm" else (x, w, b)
    y = rms_norm(*inputs) if fn == "rms_norm" else layer_norm(*inputs)
    assert y.shape == x.shape
    grads = torch.autograd.grad(y, inputs, dy)
    refs = _reference(fn, dy, *inputs, eps=1e-6 if fn == "rms_norm" else 1e-5)
    for got, ref, t in zip(grads, refs, inputs):
        assert got.shape == t.shape and _rel(got, ref) < 1e-2
    with torch.no_grad():
        out = torch.full_like(x, float("nan"))
        norm = rms_norm(x, w, out=out) if fn == "rms_norm" else layer_norm(x, w, b, out=out)
        assert norm is out and not out.isnan().any()
    h, r = fused_add_rms_norm(x.detach(), x.detach(), w.detach()) if fn == "rms_norm" else \
        fused_add_layer_norm(x.detach(), x.detach(), w.detach(), b.detach())
    assert h.shape == r.shape == x.shape
