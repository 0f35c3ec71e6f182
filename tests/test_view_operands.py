"""Views the kernels cannot read as they lie — a weight with stride 2 or 0,
a column slice whose rows are not 16-byte aligned, a misaligned out= — taken
by the library wrappers (aligned copies in, a new output copied into out=)
with the same values as contiguous arguments, not refused by the launcher
with a kernel parameter's name; and the loss ops' own argument checks.
Interpreted on CPU tensors, against float64 torch."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tk_mlir.kernels import (cross_entropy, fused_add_rms_norm, layer_norm,  # noqa: E402
                             linear_cross_entropy, rms_norm, scaled_matmul, swiglu)

F = torch.nn.functional
bf = torch.bfloat16


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


def _misaligned(*shape, dtype=bf, seed=0):
    """A (…, n) view starting 8 bytes into its rows' storage (last dim
    contiguous, not 16-byte aligned), its values random."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape[:-1], shape[-1] + 4, generator=g).to(dtype)[..., 4:]


def test_ssd_takes_projection_views_that_start_mid_vector(interpreted):
    """x, B and C cut from one projection need not be 16-byte aligned: the
    same output as aligned copies of them (forward and gradients)."""
    from tk_mlir.kernels import ssd
    g = torch.Generator().manual_seed(3)
    x, B, C = _misaligned(1, 64, 2, 16, seed=1), _misaligned(1, 64, 1, 16, seed=2), \
        _misaligned(1, 64, 1, 16, seed=3)
    dt = F.softplus(torch.randn(1, 64, 2, generator=g)) * 0.1
    A = -torch.rand(2, generator=g) - 0.5
    dy = torch.randn(1, 64, 2, 16, generator=g).to(bf)
    outs = []
    for args in ((x, B, C), tuple(t.contiguous() for t in (x, B, C))):
        args = [t.detach().requires_grad_() for t in args]
        y = ssd(args[0], dt, A, args[1], args[2])
        outs.append((y, *torch.autograd.grad(y, args, dy)))
    for got, want in zip(*outs):
        assert torch.equal(got, want)


def test_rotary_takes_cos_and_sin_views_that_start_mid_vector(interpreted):
    from tk_mlir.kernels import rotary_embedding
    x = torch.randn(2, 16, 2, 32, generator=torch.Generator().manual_seed(4)).to(bf)
    cos, sin = (torch.randn(16 * 16 + 1, generator=torch.Generator().manual_seed(s))[1:]
                .view(16, 16) for s in (5, 6))             # contiguous, 4 bytes in
    assert cos.data_ptr() % 16
    assert torch.equal(rotary_embedding(x, cos, sin),
                       rotary_embedding(x, cos.contiguous(), sin.contiguous()))


# ------------------------------------------- outputs the caller gives, refused

@pytest.mark.parametrize("which", ["rms_norm", "layer_norm"])
def test_a_norms_out_overlapping_its_input_is_refused_and_out_x_is_in_place(interpreted, which):
    from tk_mlir.kernels import norms
    fn = getattr(norms, which)
    g = torch.Generator().manual_seed(7)
    buf = torch.randn(65, 64, generator=g).to(bf)
    w, b = torch.randn(64, generator=g).to(bf), torch.randn(64, generator=g).to(bf)
    args = (w,) if which == "rms_norm" else (w, b)
    with pytest.raises(ValueError, match=rf"{which}: out is written while x is read and must "
                                         rf"not share memory with it"):
        fn(buf[:-1], *args, out=buf[1:])
    x = buf[:-1].clone()
    want = fn(x, *args)
    assert fn(x, *args, out=x) is x and torch.equal(x, want)       # exactly x: in place
    out = torch.empty(64, 64, dtype=bf)
    with pytest.raises(ValueError, match="out is written while weight is read"):
        fn(x, out[0], *args[1:], out=out)


def test_an_output_that_requires_grad_is_refused(interpreted):
    """Written in place behind autograd's back: torch refuses out= tensors
    that require grad, and so do matmul's c and the norms' out."""
    from tk_mlir.kernels import matmul
    a, b = torch.randn(64, 32).to(bf), torch.randn(48, 32).to(bf)
    c = torch.zeros(64, 48, dtype=bf, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"matmul: c \(the output to write into\) requires "
                                           r"grad"):
        matmul(a, b, c)
    with torch.no_grad():
        matmul(a, b, c)                                   # (outside grad mode: fine)
    x, w = torch.randn(16, 64).to(bf), torch.randn(64).to(bf)
    with pytest.raises(RuntimeError, match=r"rms_norm: out \(the output to write into\) "
                                           r"requires grad"):
        rms_norm(x, w, out=torch.zeros(16, 64, dtype=bf, requires_grad=True))


def test_one_tensor_as_both_caches_is_refused_when_appending(interpreted):
    from tk_mlir.kernels import attention_with_kvcache
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 1, 2, 64, generator=g).to(bf)
    cache = torch.randn(1, 128, 1, 64, generator=g).to(bf)
    k = torch.randn(1, 1, 1, 64, generator=g).to(bf)
    lens = torch.tensor([40], dtype=torch.int32)
    attention_with_kvcache(q, cache, cache, lens)                 # (reading: fine)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"attention_with_kvcache: k_cache is written while "
                                         r"v_cache is read"):
        attention_with_kvcache(q, cache, cache, lens, k=k, v=k.clone())
    assert torch.equal(cache, before)                             # (refused before writing)


@pytest.mark.parametrize("fn", ["attention", "attention_varlen", "attention_with_kvcache"])
def test_return_lse_must_be_a_bool(fn):
    from tk_mlir import kernels
    q = torch.randn(1, 64, 2, 64).to(bf)
    args = {"attention": (q.transpose(1, 2),) * 3,
            "attention_varlen": (q[0],) * 3 + (torch.tensor([0, 64], dtype=torch.int32),) * 2
                                + (64, 64),
            "attention_with_kvcache": (q[:, :1], q, q, torch.tensor([64], dtype=torch.int32))}
    with pytest.raises(TypeError, match=rf"{fn}: return_lse must be a bool, got 'no'"):
        getattr(kernels, fn)(*args[fn], return_lse="no")


def test_a_target_outside_the_classes_gives_nan_gradients_too(interpreted):
    """Its loss is NaN (as documented); its row's gradient is NaN, not the
    softmax alone (the target's term silently missing)."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(8, 32, generator=g).requires_grad_()
    t = torch.randint(0, 32, (8,), generator=g)
    t[1] = 32
    (dx,) = torch.autograd.grad(cross_entropy(logits, t, reduction="sum"), (logits,))
    assert dx[1].isnan().all() and not dx[[0, *range(2, 8)]].isnan().any()


def test_disjoint_views_of_one_buffer_are_not_refused(interpreted):
    """Outputs checked against their inputs' memory by element, not by span:
    the halves of a packed K/V cache (interleaved, never one element) append
    as separate caches do; a norm writes one half of each row while reading
    the other."""
    from tk_mlir.kernels import attention_with_kvcache, rms_norm
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 1, 2, 64, generator=g).to(bf)
    kv = torch.randn(1, 128, 2, 1, 64, generator=g).to(bf)
    k, v = (torch.randn(1, 1, 1, 64, generator=g).to(bf) for _ in range(2))
    lens = torch.tensor([40], dtype=torch.int32)
    apart = [kv[:, :, i].clone() for i in (0, 1)]
    want = attention_with_kvcache(q, *apart, lens, k=k, v=v)
    got = attention_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], lens, k=k, v=v)
    assert torch.equal(got, want) and torch.equal(kv[:, :, 0], apart[0])
    buf = torch.randn(37, 128, generator=g).to(bf)
    w = torch.randn(64, generator=g).to(bf)
    x = buf[:, :64].clone()
    rms_norm(buf[:, :64], w, out=buf[:, 64:])
    assert torch.equal(buf[:, 64:], rms_norm(x, w)) and torch.equal(buf[:, :64], x)
