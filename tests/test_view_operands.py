"""Views the kernels cannot read as they lie — a weight with stride 2 or 0,
a column slice whose rows are not 16-byte aligned, a misaligned out= — taken
by the library wrappers (aligned copies in, a new output copied into out=)
with the same values as contiguous arguments, not refused by the launcher
with a kernel parameter's name; and the loss ops' own argument checks.
Interpreted on CPU tensors, against float64 torch."""
from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tk_mlir.kernel  # noqa: E402,F401  (the module: tk_mlir.kernel is the decorator)
from tk_mlir.kernels import (cross_entropy, fused_add_rms_norm, layer_norm,  # noqa: E402
                             linear_cross_entropy, rms_norm, scaled_matmul, swiglu)

F = torch.nn.functional
bf = torch.bfloat16


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", True)


def _close(out, ref, tol=1e-2):
    out, ref = out.double(), ref.double()
    assert (out - ref).norm() <= tol * ref.norm(), ((out - ref).norm() / ref.norm()).item()


def _rms(x, w, eps=1e-6):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _weight_views(d):
    """(name, a (d,) view the kernels cannot read as it lies)."""
    base = torch.randn(2 * d + 8, dtype=bf)
    return [("stride 2", base[::2][:d]), ("stride 0", base[3:4].expand(d)),
            ("misaligned", base[1:d + 1])]


@pytest.mark.parametrize("which", range(3))
def test_norms_take_weight_and_bias_views(interpreted, which):
    x = torch.randn(5, 32, dtype=bf)
    name, w = _weight_views(32)[which]
    _, b = _weight_views(32)[(which + 1) % 3]
    _close(rms_norm(x, w), _rms(x, w))
    _close(layer_norm(x, w, b),
           F.layer_norm(x.double(), (32,), w.double(), b.double(), 1e-5))
    res = torch.randn(5, 32, dtype=bf)
    y, h = fused_add_rms_norm(x, res, w)
    _close(h, x.double() + res.double())
    _close(y, _rms(h, w))


def test_norm_gradients_reach_a_weight_view(interpreted):
    base = torch.randn(64, dtype=bf, requires_grad=True)
    x = torch.randn(4, 32, dtype=bf, requires_grad=True)
    dy = torch.randn(4, 32)
    got = torch.autograd.grad(rms_norm(x, base[::2]).float(), (x, base), dy)
    x64, b64 = x.detach().double().requires_grad_(), base.detach().double().requires_grad_()
    want = torch.autograd.grad(_rms(x64, b64[::2]), (x64, b64), dy.double())
    for g, r in zip(got, want):
        _close(g, r)


def test_a_misaligned_out_is_written_through_a_copy(interpreted):
    x, w, b = torch.randn(6, 32, dtype=bf), torch.randn(32, dtype=bf), torch.randn(32, dtype=bf)
    store = torch.full((6, 33), float("nan"), dtype=bf)
    out = store[:, 1:]                          # rows at a 2-byte offset
    assert layer_norm(x, w, b, out=out) is out
    _close(out, F.layer_norm(x.double(), (32,), w.double(), b.double(), 1e-5))
    assert torch.isnan(store[:, 0]).all()       # nothing outside out written
    store = torch.full((6, 33), float("nan"), dtype=bf)
    assert rms_norm(x, w, out=store[:, 1:]) is not None
    _close(store[:, 1:], _rms(x, w))


def test_swiglu_takes_halves_whose_rows_are_not_aligned(interpreted):
    x = torch.randn(5, 66, dtype=bf, requires_grad=True)
    g, u = x[:, 1:33], x[:, 33:65]
    dy = torch.randn(5, 32)
    y = swiglu(g, u)
    x64 = x.detach().double().requires_grad_()
    ref = F.silu(x64[:, 1:33]) * x64[:, 33:65]
    _close(y, ref)
    _close(torch.autograd.grad(y.float(), x, dy)[0], torch.autograd.grad(ref, x64, dy.double())[0])


def test_cross_entropy_takes_a_column_slice_of_logits(interpreted):
    store = torch.randn(6, 41, dtype=bf, requires_grad=True)
    logits, target = store[:, 1:25], torch.randint(0, 24, (6,))
    loss = cross_entropy(logits, target)
    s64 = store.detach().double().requires_grad_()
    ref = F.cross_entropy(s64[:, 1:25], target)
    _close(loss, ref)
    _close(torch.autograd.grad(loss.float(), store)[0], torch.autograd.grad(ref, s64)[0])


def test_cross_entropy_takes_a_numpy_ignore_index(interpreted):
    logits, target = torch.randn(6, 24, dtype=bf), torch.randint(0, 24, (6,))
    target[2] = -100
    _close(cross_entropy(logits, target, ignore_index=np.int64(-100)),
           F.cross_entropy(logits.double(), target, ignore_index=-100))


def test_scaled_matmul_takes_a_column_slice_of_a(interpreted):
    a = torch.randn(17, 40).to(torch.float8_e4m3fn)[:, :32]
    bt = torch.randn(24, 32).to(torch.float8_e4m3fn)
    sa, sb = torch.tensor(0.5), torch.tensor(2.0)
    _close(scaled_matmul(a, bt.t(), sa, sb), a.double() @ bt.double().t())


def _lce_case():
    h, w = torch.randn(6, 16, dtype=bf), torch.randn(24, 16, dtype=bf)
    t = torch.randint(0, 24, (6,))
    return h, w, t


def test_the_linear_cross_entropy_backward_op_checks_its_arguments(interpreted):
    import tk_mlir.kernels.custom_ops  # noqa: F401  registers torch.ops.tk_mlir
    op = torch.ops.tk_mlir.linear_cross_entropy_backward
    h, w, t = _lce_case()
    _, lse = torch.ops.tk_mlir.linear_cross_entropy(h, w, t, -100, "none")
    dloss = torch.randn(6)
    dh, dw = op(dloss, h, w, t, lse, -100, "none", True, True)
    assert dh.shape == h.shape and dw.shape == w.shape
    with pytest.raises(ValueError, match="reduction must be"):
        op(dloss, h, w, t, lse, -100, "avg", True, True)
    with pytest.raises(TypeError, match="target must hold class indices"):
        op(dloss, h, w, t.float(), lse, -100, "none", True, True)
    with pytest.raises(TypeError, match="lse must be torch.float32"):
        op(dloss, h, w, t, lse.to(bf), -100, "none", True, True)
    with pytest.raises(ValueError, match="lse must hold one value per row of h"):
        op(dloss, h, w, t, lse[:3], -100, "none", True, True)
    with pytest.raises(ValueError, match="dloss must have shape"):
        op(torch.tensor(1.0), h, w, t, lse, -100, "none", True, True)
    with pytest.raises(TypeError, match="h must be"):
        op(dloss, h.float(), w, t, lse, -100, "none", True, True)


def test_the_linear_cross_entropy_with_grads_op_takes_a_scalar_loss_only(interpreted):
    import tk_mlir.kernels.custom_ops  # noqa: F401
    h, w, t = _lce_case()
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        torch.ops.tk_mlir.linear_cross_entropy_with_grads(h, w, t, -100, "none", True, True)
    loss, dh, dw = torch.ops.tk_mlir.linear_cross_entropy_with_grads(h, w, t, -100, "sum",
                                                                     True, True)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy(h64 @ w64.T, t, reduction="sum")
    _close(loss, ref)
    for g, r in zip((dh, dw), torch.autograd.grad(ref, (h64, w64))):
        _close(g, r)
    _close(linear_cross_entropy(h, w, t, reduction="sum"), ref)
