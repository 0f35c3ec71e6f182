"""cross_entropy (tk_mlir/kernels/losses.py): F.cross_entropy on (N, V)
logits, a vocabulary chunk at a time, forward and backward.

Without a GPU: both kernels in the interpreter against float64 torch (a
vocabulary over several chunks and ragged, label smoothing, ignored rows,
an out-of-range target giving NaN, very negative logits), the argument
rules, the op's fake. With one (`-m gpu`): eager and compiled autograd for
every reduction against float64 torch, at a Llama-3 vocabulary.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from tk_mlir.kernels import cross_entropy, linear_cross_entropy  # noqa: E402

from torch_reference import relative_error as _rel  # noqa: E402

bf16 = torch.bfloat16
gpu = pytest.mark.gpu
F = torch.nn.functional


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_kernels_in_the_interpreter(smoothing):
    from tk_mlir.kernels.losses import cross_entropy_backward_kernel, cross_entropy_kernel
    g = torch.Generator().manual_seed(1)
    n, v = 6, 600                                        # 3 chunks of 256, the last ragged
    x = (torch.randn(n, v, generator=g) * 3).to(bf16)
    x[1] -= 1000                                         # exp(0 - max) would overflow
    t = torch.randint(0, v, (8,), generator=g, dtype=torch.int32)
    t[2], t[4] = -100, v + 3                             # ignored; out of range
    loss, lse = torch.full((8,), float("nan")), torch.full((8,), float("nan"))
    cross_entropy_kernel.interpret[(n,)](x, t, loss, lse, v, -100, smoothing, CHUNK=256)
    keep = [0, 1, 3, 5]
    ref = F.cross_entropy(x.double()[keep], t[keep].long(), reduction="none",
                          label_smoothing=smoothing)
    assert _rel(loss[keep], ref) < 1e-5
    assert loss[2] == 0 and loss[4].isnan()
    scale = torch.rand(8, generator=g)
    dx = torch.full_like(x, float("nan"))
    cross_entropy_backward_kernel.interpret[(n,)](x, t, lse, scale, dx, v, -100, smoothing,
                                                  CHUNK=256)
    xd = x.double().requires_grad_()
    per_row = F.cross_entropy(xd[keep], t[keep].long(), reduction="none",
                              label_smoothing=smoothing)
    (ref_dx,) = torch.autograd.grad((per_row * scale[keep].double()).sum(), xd)
    assert _rel(dx[keep], ref_dx[keep]) < 1e-2
    assert not dx[2].any()                               # an ignored row: no gradient
    inplace = x.clone()                                  # (linear_cross_entropy's use)
    cross_entropy_backward_kernel.interpret[(n,)](inplace, t, lse, scale, inplace, v, -100,
                                                  smoothing, CHUNK=256)
    assert torch.equal(inplace, dx)
    if smoothing == 0.0:        # the fused kernel (linear_cross_entropy's forward): the same bits
        from tk_mlir.kernels.losses import cross_entropy_with_grad_kernel
        fused, loss2, lse2 = x.clone(), torch.full_like(loss, float("nan")), torch.full_like(
            lse, float("nan"))
        cross_entropy_with_grad_kernel.interpret[(n,)](fused, t, loss2, lse2, scale, v, -100,
                                                       CHUNK=256)
        assert torch.equal(fused.nan_to_num(7.0), dx.nan_to_num(7.0))
        assert torch.equal(lse2[:n], lse[:n])
        assert torch.equal(loss2[:n].nan_to_num(-1.0), loss[:n].nan_to_num(-1.0))


def test_a_row_at_the_lowest_logit_keeps_a_finite_log_sum_exp():
    """Logits at bf16's (or f32's) lowest value, as masked_fill(min) leaves
    them, still raise the running max: lse is that value (log(V) is lost in
    f32 beside it, as in an f32 torch), never -inf, and the gradient finite."""
    from tk_mlir.kernels.losses import cross_entropy_backward_kernel, cross_entropy_kernel
    for x in (torch.full((1, 600), torch.finfo(bf16).min, dtype=bf16),
              torch.full((1, 600), torch.finfo(torch.float32).min)):
        t = torch.zeros(4, dtype=torch.int32)
        loss, lse = torch.full((4,), float("nan")), torch.full((4,), float("nan"))
        cross_entropy_kernel.interpret[(1,)](x, t, loss, lse, 600, -100, 0.0, CHUNK=256)
        assert lse[0] == x[0, 0].float() and loss[0].isfinite()
        dx = torch.full_like(x, float("nan"))
        cross_entropy_backward_kernel.interpret[(1,)](x, t, lse, torch.ones(4), dx, 600, -100,
                                                      0.0, CHUNK=256)
        assert dx.isfinite().all()


@pytest.mark.parametrize("shift", [1e6, 1e7])
def test_a_large_shared_offset_does_not_round_the_loss_away(interpret, shift):
    """Logits far from 0 (f32): the loss is log(sum) + (max - x_t), the
    difference of two logits exact, not lse - x_t of two large numbers
    (which lost 0.03 at 1e6 and 0.4 at 1e7)."""
    g = torch.Generator().manual_seed(int(shift) % 997)
    x = torch.randn(4, 300, generator=g) + shift
    t = torch.randint(0, 300, (4,), generator=g)
    ref = torch.nn.functional.cross_entropy(x.double(), t)
    assert abs(cross_entropy(x, t).item() - ref.item()) < 1e-5


@pytest.mark.parametrize("v, dtype, smoothing", [(10, bf16, 0.0), (50257, bf16, 0.1),
                                                (3, torch.float32, 0.2), (1, bf16, 0.0)])
def test_any_vocabulary_size_through_a_padded_copy(interpret, v, dtype, smoothing):
    """V not a multiple of 8 (10 classes, GPT-2's 50257, f32's 3): the kernels
    read a copy with whole 16-byte rows and take the true V, so the padding
    counts in no sum, mean or gradient; a strided view (every other column)
    too. Loss and gradient against float64 for each reduction."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(v)
    n = 5 if v > 1000 else 9
    wide = (torch.randn(n, 2 * v, generator=g) * 3).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[1] = -100
    for x in (wide[:, :v].contiguous(), wide[:, ::2]):
        for reduction in ("mean", "none"):
            xg = x.clone().requires_grad_() if x.is_contiguous() else x.detach().requires_grad_()
            loss = cross_entropy(xg, t, reduction=reduction, label_smoothing=smoothing)
            dloss = torch.rand(loss.shape, generator=g)
            (dx,) = torch.autograd.grad(loss, (xg,), dloss.to(loss.dtype))
            x64 = x.double().requires_grad_()
            ref = F.cross_entropy(x64, t, reduction=reduction, label_smoothing=smoothing)
            (ref_dx,) = torch.autograd.grad(ref, (x64,), dloss.double())
            assert dx.shape == x.shape and dx.is_contiguous()
            for got, want in ((loss, ref), (dx, ref_dx)):   # (V=1: both 0)
                assert (got.double() - want).norm() <= 1e-2 * want.norm() + 1e-6


@pytest.mark.parametrize("n, hidden, v", [(8192, 4096, 128256), (8192, 1024, 32000),
                                           (4096, 768, 50264), (6000, 2048, 151936),
                                           (1000, 4096, 32000), (8192, 8192, 128256)])
def test_low_memory_slices_hold_no_more_logits_than_liger(n, hidden, v):
    """low_memory's vocabulary slices tile [0, V) in order, each no wider than
    h (V > H) and its logits no more than Liger's row chunk's
    (next_power_of_2(ceil(N / ceil(V / H))) rows of V)."""
    from tk_mlir.kernels import losses
    slices = losses._slices(torch.empty(n, hidden), v, True)
    assert slices[0][0] == 0 and slices[-1][1] == v
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    per = -(-v // hidden)
    liger_rows = 1 << (-(-n // per) - 1).bit_length()
    widest = max(b - a for a, b in slices)
    assert widest <= hidden and n * widest <= liger_rows * v, (widest, liger_rows)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_of_a_vocabulary_off_whole_vectors(interpret, monkeypatch,
                                                                 reduction):
    """V = 300 (not a multiple of 8): the weight gets zero rows to 304 and
    the kernels mask them. "mean" with gradients takes the fused row-chunk
    path, "none" the vocabulary slices (two of 256, the last short): loss,
    dh and dweight against float64."""
    from tk_mlir.kernels import losses
    monkeypatch.setattr(losses, "LOGITS_SLICE_BYTES", 8 * 256 * 2)
    g = torch.Generator().manual_seed(300)
    n, d, v = 8, 64, 300
    h = torch.randn(n, d, generator=g).to(bf16).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.3).to(bf16).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[2], t[5] = -100, v - 1
    loss = linear_cross_entropy(h, w, t, reduction=reduction)
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(hd @ wd.T, t, reduction=reduction)
    assert _rel(loss, ref) < 1e-2
    dy = torch.rand(ref.shape, generator=g, dtype=torch.float64) + 0.5
    grads = torch.autograd.grad(loss, (h, w), dy.to(bf16))
    for got, want in zip(grads, torch.autograd.grad(ref, (hd, wd), dy.to(bf16).double())):
        assert got.shape == want.shape and _rel(got, want) < 2e-2


@pytest.mark.parametrize("call, error, rule", [
    (lambda x, t: cross_entropy(x, t.float()), TypeError, r"cross_entropy: target must hold "
                                                          r"class indices"),
    (lambda x, t: cross_entropy(x, t[:3]), ValueError, r"cross_entropy: target must have shape "
                                                       r"\(4,\)"),
    (lambda x, t: cross_entropy(x, t, reduction="avg"), ValueError, r"reduction must be 'mean', "
                                                                    r"'sum' or 'none'"),
    (lambda x, t: cross_entropy(x, t, label_smoothing=1.5), ValueError, r"label_smoothing must "
                                                                        r"be in \[0, 1\]"),
    (lambda x, t: cross_entropy(x, t), ValueError, r"cross_entropy: logits must be on a CUDA"),
    (lambda x, t: linear_cross_entropy(x, torch.randn(16, 8).to(bf16).T, t), ValueError,
     r"linear_cross_entropy: weight's last dim \(H\) must be contiguous \(stride 1\), got "
     r"strides \(1, 8\)"),
    (lambda x, t: linear_cross_entropy(x[:, :12], torch.randn(8, 12).to(bf16), t), ValueError,
     r"linear_cross_entropy: H \(h's last dim\) must be a multiple of 8"),
])
def test_argument_rules(call, error, rule):
    with pytest.raises(error, match=rule):
        call(torch.randn(4, 16).to(bf16), torch.zeros(4, dtype=torch.int64))


def test_fake():
    import tk_mlir.kernels.custom_ops  # noqa: F401
    with FakeTensorMode():
        x = torch.empty(5, 64, dtype=bf16, device="cuda")
        t = torch.empty(5, dtype=torch.int64, device="cuda")
        for reduction, shape in (("mean", ()), ("sum", ()), ("none", (5,))):
            loss, lse = torch.ops.tk_mlir.cross_entropy(x, t, -100, reduction, 0.0)
            assert loss.shape == shape and loss.dtype == bf16 and lse.shape == (5,)
        # the gradient is contiguous whatever the logits' strides, as the kernel writes it
        xt = torch.empty(10, 5, dtype=bf16, device="cuda").T
        dx = torch.ops.tk_mlir.cross_entropy_backward(
            torch.empty((), device="cuda"), xt, t, torch.empty(5, device="cuda"), -100, "mean",
            0.0)
        assert dx.shape == (5, 10) and dx.is_contiguous()


@gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("n, v, smoothing", [(333, 128256, 0.0), (64, 32000, 0.1), (1, 8, 0.0),
                                              (77, 50257, 0.1), (100, 10, 0.0)])
def test_eager_loss_and_gradient_match_float64(reduction, n, v, smoothing):
    g = torch.Generator(device="cuda").manual_seed(n + v)
    x = (torch.randn(n, v, device="cuda", generator=g) * 2).to(bf16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[1::7] = -100                                       # (a row of one: none ignored)
    loss = cross_entropy(x, t, reduction=reduction, label_smoothing=smoothing)
    xd = x.detach().double().requires_grad_()
    ref = F.cross_entropy(xd, t, reduction=reduction, label_smoothing=smoothing)
    assert loss.shape == ref.shape and loss.dtype == bf16
    assert _rel(loss, ref) < 1e-2
    dy = torch.rand_like(ref) + 0.5
    (dx,) = torch.autograd.grad(loss, (x,), dy.to(bf16))
    (ref_dx,) = torch.autograd.grad(ref, (xd,), dy.to(bf16).double())
    assert _rel(dx, ref_dx) < 1e-2


@gpu
def test_compiled_matches_eager():
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(100, 4096, device="cuda", generator=g).to(bf16)
    t = torch.randint(0, 4096, (100,), device="cuda", generator=g)
    grads = []
    for fn in (cross_entropy, torch.compile(cross_entropy, fullgraph=True)):
        xx = x.clone().requires_grad_()
        loss = fn(xx, t)
        grads.append((loss, *torch.autograd.grad(loss, (xx,))))
    for e, c in zip(*grads):
        assert torch.equal(e, c)


@gpu
@pytest.mark.parametrize("reduction, v", [("mean", 32000), ("none", 32000), ("mean", 30001),
                                          ("none", 30001)])
def test_linear_cross_entropy_matches_float64(reduction, v, monkeypatch):
    """Over 4 vocabulary slices, the last short (and, at V = 30001, not whole
    16-byte vectors of logits): loss and gradients against float64, the
    compiled op the same bits."""
    from tk_mlir.kernels import linear_cross_entropy, losses
    monkeypatch.setattr(losses, "LOGITS_SLICE_BYTES", 333 * 8192 * 2)   # 4 slices, the last short
    g = torch.Generator(device="cuda").manual_seed(7)
    n, d = 333, 1024
    h = torch.randn(n, d, device="cuda", generator=g).to(bf16).requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.05).to(bf16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[1::5] = -100
    loss = linear_cross_entropy(h, w, t, reduction=reduction)
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(hd @ wd.T, t, reduction=reduction)
    assert _rel(loss, ref) < 1e-2
    dy = torch.rand(ref.shape, device="cuda", dtype=torch.float64) + 0.5
    grads = torch.autograd.grad(loss, (h, w), dy.to(bf16))
    for got, want in zip(grads, torch.autograd.grad(ref, (hd, wd), dy.to(bf16).double())):
        assert _rel(got, want) < 2e-2
    compiled = torch.compile(linear_cross_entropy, fullgraph=True)
    assert torch.equal(compiled(h.detach(), w.detach(), t, reduction=reduction), loss.detach())


@gpu
@pytest.mark.parametrize("low_memory", [False, True])
def test_linear_cross_entropy_holds_little_beyond_its_gradients(low_memory):
    """A scalar loss's forward and backward allocate dweight, dh and one row
    chunk's logits (no larger than h, or MIN_CHUNK_ROWS rows; low_memory: one
    vocabulary slice's, no larger than h) beyond their inputs: each chunk's
    share of dweight is added into it in place (low_memory: each slice's
    share of dh), and the backward scales the gradients in place."""
    from tk_mlir.kernels import linear_cross_entropy, losses
    g = torch.Generator(device="cuda").manual_seed(8)
    n, d, v = 8192, 1024, 32000
    h = torch.randn(n, d, device="cuda", generator=g).to(bf16).requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) * 0.05).to(bf16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)

    def loss():
        return linear_cross_entropy(h, w, t, low_memory=low_memory)
    torch.autograd.grad(loss(), (h, w))                 # (tunes the GEMMs first)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    dh, dw = torch.autograd.grad(loss() * 0.5, (h, w))
    extra = torch.cuda.max_memory_allocated() - base
    grads = (v * d + n * d) * 2
    chunk = n * d * 2 if low_memory else \
        max(n * d, losses.MIN_CHUNK_ROWS * v) * 2        # one chunk's (slice's) logits
    assert extra <= grads + chunk + (4 << 20), (extra, grads, chunk)
    hd, wd = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = torch.autograd.grad(F.cross_entropy(hd @ wd.T, t) * 0.5, (hd, wd))
    assert _rel(dh, want[0]) < 2e-2 and _rel(dw, want[1]) < 2e-2
