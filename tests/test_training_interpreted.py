"""A training step through the library's differentiable functions on CPU
tensors, every kernel (forward and backward) run by the interpreter: the
autograd wiring (the eager autograd.Functions, which gradient goes where,
GEMMs reading transposed operands as K x M) checked in CI, without a GPU,
against the same step in float64 torch.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tk_mlir.kernels import (cross_entropy, fused_add_layer_norm, fused_add_rms_norm,  # noqa: E402
                             matmul, rms_norm, rotary_embedding, swiglu)

F = torch.nn.functional


def _block(x, params, ops):
    """A pre-norm MLP block and an output head, in `ops`' functions."""
    w_norm, w_gate, w_up, w_down, w_norm2, w_out = params
    h = ops["rms_norm"](x, w_norm)
    a = ops["swiglu"](ops["matmul"](h, w_gate), ops["matmul"](h, w_up, b_layout="kn"))
    y, res = ops["fused_add_rms_norm"](ops["matmul"](a, w_down), x, w_norm2)
    return ops["matmul"](y, w_out), res


TORCH = {
    "rms_norm": lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
    "swiglu": lambda g, u: F.silu(g) * u,
    "matmul": lambda a, b, b_layout="nk": a @ (b.T if b_layout == "nk" else b),
    "fused_add_rms_norm": lambda x, r, w: (TORCH["rms_norm"](x + r, w), x + r),
}
TK = {"rms_norm": rms_norm, "swiglu": swiglu, "matmul": matmul,
      "fused_add_rms_norm": fused_add_rms_norm}


def test_an_mlp_block_and_its_loss_train_like_torch(interpreted):
    g = torch.Generator().manual_seed(0)
    n, d, hidden, vocab = 64, 128, 256, 256

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    x = rnd(n, d)
    params = [rnd(d) + 1, rnd(hidden, d, scale=0.1), rnd(d, hidden, scale=0.1),
              rnd(d, hidden, scale=0.1), rnd(d) + 1, rnd(vocab, d, scale=0.1)]
    target = torch.randint(0, vocab, (n,), generator=g)
    target[::9] = -100
    ours = [p.clone().requires_grad_() for p in params]
    xs = x.clone().requires_grad_()
    logits, res = _block(xs, ours, TK)
    loss = cross_entropy(logits, target, label_smoothing=0.1) + res.float().square().mean()
    grads = torch.autograd.grad(loss, [xs, *ours])
    ref = [p.double().requires_grad_() for p in [x, *params]]
    ref_logits, ref_res = _block(ref[0], ref[1:], TORCH)
    ref_loss = F.cross_entropy(ref_logits, target, label_smoothing=0.1) + ref_res.square().mean()
    ref_grads = torch.autograd.grad(ref_loss, ref)
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * abs(ref_loss.item())
    for got, want, what in zip(grads, ref_grads, ["x", "w_norm", "w_gate", "w_up", "w_down",
                                                  "w_norm2", "w_out"]):
        assert got.shape == want.shape and got.dtype == torch.bfloat16, what
        assert ((got.double() - want).norm() / want.norm()).item() < 3e-2, what


@pytest.mark.parametrize("d", [32, 80, 112])      # (80, 112: halves in pieces of 8 columns)
def test_rotary_gradient_is_the_inverse_rotation(interpreted, d):
    g = torch.Generator().manual_seed(d)
    q = torch.randn(1, 8, 3, d, generator=g).to(torch.bfloat16).requires_grad_()
    angles = torch.rand(8, d // 2, generator=g) * 6.3
    cos, sin = angles.cos(), angles.sin()
    dy = torch.randn(1, 8, 3, d, generator=g).to(torch.bfloat16)
    y = rotary_embedding(q, cos, sin)
    (dq,) = torch.autograd.grad(y, (q,), dy)
    qd = q.detach().double().requires_grad_()
    x1, x2 = qd[..., :d // 2], qd[..., d // 2:]
    c, s = cos.double()[None, :, None], sin.double()[None, :, None]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    (ref,) = torch.autograd.grad(want, (qd,), dy.double())
    assert ((y.double() - want).norm() / want.norm()).item() < 1e-2
    assert ((dq.double() - ref).norm() / ref.norm()).item() < 1e-2


def _linear_ce_case(n, d, vocab, generator, ignore_every):
    """h (n, d) and w (vocab, d) bf16 requiring grad, targets with every
    ignore_every-th row ignored."""
    h = torch.randn(n, d, generator=generator).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, d, generator=generator) * 0.3).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=generator)
    t[::ignore_every] = -100
    return h, w, t


def _linear_ce_reference(h, w, t, reduction):
    """float64 leaves hd, wd and F.cross_entropy(hd @ wd.T, t)."""
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    return hd, wd, F.cross_entropy(hd @ wd.T, t, reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_over_vocabulary_slices(interpreted, monkeypatch, reduction):
    """Three vocabulary slices (LOGITS_SLICE_BYTES made small): the loss and
    both gradients as torch's cross_entropy of the full logits; ignored rows,
    and a target outside the vocabulary giving NaN for its row only."""
    from tk_mlir.kernels import linear_cross_entropy, losses
    monkeypatch.setattr(losses, "LOGITS_SLICE_BYTES", 40 * 256 * 2)   # 256 classes a slice
    g = torch.Generator().manual_seed(2)
    h, w, t = _linear_ce_case(40, 64, 704, g, ignore_every=7)       # slices 256, 256, 192
    loss = linear_cross_entropy(h, w, t, reduction=reduction)
    hd, wd, ref = _linear_ce_reference(h, w, t, reduction)
    assert loss.shape == ref.shape and loss.dtype == torch.bfloat16
    assert ((loss.double() - ref).norm() / ref.norm()).item() < 1e-2
    dy = torch.rand(ref.shape, generator=g, dtype=torch.float64) + 0.5
    dh, dw = torch.autograd.grad(loss, (h, w), dy.to(torch.bfloat16))
    ref_dh, ref_dw = torch.autograd.grad(ref, (hd, wd), dy.to(torch.bfloat16).double())
    for got, want in ((dh, ref_dh), (dw, ref_dw)):
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2
    t[3] = w.shape[0] + 1                                            # outside the vocabulary
    rows = linear_cross_entropy(h.detach(), w.detach(), t, reduction="none")
    assert rows[3].isnan() and not rows[:3].isnan().any() and not rows[4:].isnan().any()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_low_memory(interpreted, reduction):
    """low_memory=True: vocabulary slices (H = 64: 256 classes, the least,
    of 700: three, the last short and not whole 16-byte vectors), a
    scalar loss's gradients from a second pass with dh summed in bf16 by
    the GEMM: loss and gradients as float64 torch, and as the default's;
    no rows at all gives zero gradients."""
    from tk_mlir.kernels import linear_cross_entropy, losses
    g = torch.Generator().manual_seed(4)
    h, w, t = _linear_ce_case(24, 64, 700, g, ignore_every=5)
    assert len(losses._slices(h, 704, True)) == 3
    hd, wd, ref = _linear_ce_reference(h, w, t, reduction)
    dy = torch.rand(ref.shape, generator=g, dtype=torch.float64) + 0.5
    want = torch.autograd.grad(ref, (hd, wd), dy.to(torch.bfloat16).double())
    for low_memory in (True, False):
        loss = linear_cross_entropy(h, w, t, reduction=reduction, low_memory=low_memory)
        assert ((loss.double() - ref).norm() / ref.norm()).item() < 1e-2
        got = torch.autograd.grad(loss, (h, w), dy.to(torch.bfloat16))
        for a, b in zip(got, want):
            assert a.shape == b.shape and ((a.double() - b).norm() / b.norm()).item() < 2e-2
    empty = h[:0].detach().requires_grad_()
    loss = linear_cross_entropy(empty, w, t[:0], reduction="sum", low_memory=True)
    dh, dw = torch.autograd.grad(loss, (empty, w))
    assert dh.shape == (0, 64) and dw.shape == w.shape and not dw.any()


def test_linear_cross_entropy_low_memory_is_a_bool(interpreted):
    from tk_mlir.kernels import linear_cross_entropy
    h = torch.randn(4, 8).to(torch.bfloat16)
    with pytest.raises(TypeError, match="linear_cross_entropy: low_memory must be a bool, "
                                        "got 'yes'"):
        linear_cross_entropy(h, torch.randn(16, 8).to(torch.bfloat16), torch.zeros(4).long(),
                             low_memory="yes")


def test_cross_entropy_edge_rows(interpreted):
    """-inf logits (a masked vocabulary) without smoothing, every row ignored
    under "mean" (loss NaN as torch, gradient 0 not NaN), and int64 targets
    that would wrap in 32 bits (NaN, never another class or "ignored")."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    x[:, 12:] = float("-inf")
    t = torch.tensor([1, 2, 3])
    assert torch.allclose(cross_entropy(x, t, reduction="none").double(),
                          F.cross_entropy(x.double(), t, reduction="none"), rtol=1e-2)
    xs = torch.randn(5, 8, generator=g).to(torch.bfloat16).requires_grad_()
    loss = cross_entropy(xs, torch.full((5,), -100))
    (dx,) = torch.autograd.grad(loss, (xs,))
    assert loss.isnan() and not dx.any()
    rows = cross_entropy(x.nan_to_num(neginf=0.0), torch.tensor([2**32 + 1, -100 + 2**32, 0]),
                         reduction="none")
    assert rows[0].isnan() and rows[1].isnan() and not rows[2].isnan()


def test_gradients_that_autograd_hands_over_misaligned_or_expanded(interpreted):
    """A backward's incoming gradient may sit at any offset (torch.cat's
    part) or be expanded (a sum's): the kernels get aligned copies."""
    from tk_mlir.kernels.checks import kernel_operand
    g = torch.Generator().manual_seed(4)
    a = torch.randn(64, 64, generator=g).to(torch.bfloat16).requires_grad_()
    b = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g).to(torch.bfloat16).requires_grad_()
    pad = torch.zeros(3, dtype=torch.bfloat16)
    for out in (lambda: matmul(a, b), lambda: rms_norm(a, w), lambda: swiglu(a, a)):
        (grad,) = torch.autograd.grad(torch.cat((pad, out().flatten())).float().sum(), (a,))
        assert grad.shape == a.shape and not grad.isnan().any()
    expanded = torch.ones(1, dtype=torch.bfloat16).expand(64, 64)
    assert kernel_operand(expanded).stride() == (64, 1)
    assert kernel_operand(b) is b


def test_a_permuted_view_reaches_the_kernels_as_it_lies():
    """(B, N, H, D) memory seen as (B, H, N, D) (attention's dO for a q from
    a projection) is read through its strides, not copied; dims that share
    memory (expanded, interleaved) or rows the kernels cannot read are."""
    from tk_mlir.kernels.checks import kernel_operand, overlapping
    t = torch.randn(2, 5, 3, 16).to(torch.bfloat16)
    assert kernel_operand(t.transpose(1, 2)) is not None
    assert kernel_operand(t.transpose(1, 2)).data_ptr() == t.data_ptr()
    assert kernel_operand(t.permute(2, 0, 1, 3)).data_ptr() == t.data_ptr()
    assert not overlapping(t.transpose(1, 2)) and not overlapping(t[:, ::2])
    assert overlapping(t[:, :1].expand(2, 5, 3, 16))
    assert overlapping(t.view(-1).as_strided((4, 16), (8, 1)))     # rows half over each other
    assert not overlapping(t.view(-1).as_strided((4, 2, 8), (16, 8, 1)))
    for bad in (t[..., 1:9], t.transpose(2, 3), t[:, :1].expand(2, 5, 3, 16)):
        assert kernel_operand(bad).is_contiguous()


def test_fused_add_layer_norm_checks_its_bias():
    """A bias that is neither a tensor nor None (none: as F.layer_norm's) is refused."""
    x = torch.randn(4, 16).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"fused_add_layer_norm: bias must be a torch.Tensor"):
        fused_add_layer_norm(x, x, x[0], [0.0] * 16)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_with_every_row_ignored(interpreted, reduction):
    """As torch's: "mean" is NaN (0 / 0), "sum" 0, "none" zeros; the
    gradients are zeros, not NaN (no row contributes)."""
    from tk_mlir.kernels import linear_cross_entropy
    g = torch.Generator().manual_seed(9)
    h = torch.randn(6, 64, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(128, 64, generator=g).to(torch.bfloat16).requires_grad_()
    t = torch.full((6,), -100)
    loss = linear_cross_entropy(h, w, t, reduction=reduction)
    ref = F.cross_entropy(h.double() @ w.double().T, t, reduction=reduction)
    assert loss.shape == ref.shape
    assert torch.equal(loss.double().isnan(), ref.isnan())
    assert torch.equal(loss.double().nan_to_num(), ref.nan_to_num())
    dh, dw = torch.autograd.grad(loss.sum(), (h, w))
    assert not dh.isnan().any() and not dh.any() and not dw.isnan().any() and not dw.any()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_frozen_weight(interpreted, monkeypatch, reduction):
    """No dweight is made for a weight that does not require grad: a scalar
    loss's gradients come with the forward, "none"'s in the backward."""
    from tk_mlir.kernels import linear_cross_entropy, losses
    calls = []
    which = "linear_backward" if reduction == "none" else "linear_forward_with_grads"
    real = getattr(losses, which)
    monkeypatch.setattr(losses, which, lambda *a: calls.append(a[-3:-1]) or real(*a))
    g = torch.Generator().manual_seed(5)
    h = torch.randn(8, 64, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    loss = linear_cross_entropy(h, w, torch.arange(8), reduction=reduction)
    (dh,) = torch.autograd.grad(loss.sum(), (h,))
    assert calls == [(True, False)] and dh.shape == h.shape   # no dweight asked for


def test_linear_cross_entropy_gradients_in_row_chunks(interpreted, monkeypatch):
    """A scalar loss's gradients made in the forward over three row chunks
    (128, 128 and 44 rows: LOGITS_SLICE_BYTES made small), dweight summed over
    them; scaled by the incoming gradient (1 too), also when backward runs
    again. ("sum" takes the same path, its row scale 1 not 1/count: the
    vocabulary-slice test covers it.)"""
    reduction = "mean"
    from tk_mlir.kernels import linear_cross_entropy, losses
    monkeypatch.setattr(losses, "LOGITS_SLICE_BYTES", 128 * 256 * 2)
    g = torch.Generator().manual_seed(6)
    h, w, t = _linear_ce_case(300, 64, 256, g, ignore_every=9)
    loss = linear_cross_entropy(h, w, t, reduction=reduction)
    hd, wd, ref = _linear_ce_reference(h, w, t, reduction)
    assert abs(loss.double() - ref) < 1e-2 * abs(ref)
    for factor in (1.5, 1.0, 1.5):      # (dloss = 1: the scaling kernel returns at once)
        want = torch.autograd.grad(ref * factor, (hd, wd), retain_graph=True)
        got = torch.autograd.grad(loss * factor if factor != 1 else loss, (h, w),
                                  retain_graph=True)
        for a, b in zip(got, want):
            assert ((a.double() - b).norm() / b.norm()).item() < 2e-2


@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_grouped_matmul_gradients(interpreted, b_layout):
    """da and db of the capacity-layout product, rows up to each product's
    128-row tile end counting (the function the kernel computes), a product
    of no rows and one of every row among them; NaN in the rows that do not
    count stays out of db."""
    from tk_mlir.kernels import grouped_matmul
    g = torch.Generator().manual_seed(6)
    G, M, K, N = 3, 256, 64, 128
    a = torch.randn(G, M, K, generator=g).to(torch.bfloat16).requires_grad_()
    b = torch.randn(*((G, N, K) if b_layout == "nk" else (G, K, N)), generator=g) \
        .to(torch.bfloat16).requires_grad_()
    sizes = [100, 0, 256]
    c = grouped_matmul(a, b, sizes, b_layout=b_layout)
    dc = torch.randn(G, M, N, generator=g).to(torch.bfloat16)
    da, db = torch.autograd.grad(c, (a, b), dc)
    ends = torch.tensor([128, 0, 256])                  # sizes rounded up to whole tiles
    kept = (torch.arange(M)[None, :] < ends[:, None])[..., None].double()
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = (a64 @ (b64.mT if b_layout == "nk" else b64)) * kept
    ref_da, ref_db = torch.autograd.grad(ref, (a64, b64), dc.double())
    assert ((c.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert ((da.double() - ref_da).norm() / ref_da.norm()).item() < 2e-2
    assert ((db.double() - ref_db).norm() / ref_db.norm()).item() < 2e-2
    assert not da[1].any() and not da[0, 128:].any()
    # rows that do not count hold NaN (uninitialised padding may): db is the same
    padded = a.detach().clone()
    padded[0, 128:], padded[1] = float("nan"), float("nan")
    padded.requires_grad_()
    (db2,) = torch.autograd.grad(grouped_matmul(padded, b, sizes, b_layout=b_layout), (b,), dc)
    assert db2.isfinite().all() and ((db2.double() - ref_db).norm() / ref_db.norm()) < 2e-2


def test_the_training_ops_compile_with_their_gradients(interpreted):
    """torch.compile(fullgraph=True) over the ops the Llama test does not
    reach (fused add norms, cross_entropy, grouped_matmul, matmul with B as
    K x N): the loss and gradients of eager (the same kernels; Inductor's
    glue between them rounds its own way)."""
    from tk_mlir.kernels import fused_add_layer_norm, grouped_matmul
    g = torch.Generator().manual_seed(7)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    x, r, w, b = rnd(64, 128), rnd(64, 128), rnd(128) + 1, rnd(128)
    wk, e = rnd(128, 64), rnd(2, 128, 64)
    target = torch.randint(0, 64, (64,), generator=g)
    sizes = torch.tensor([64, 30])

    def step(x, w, wk, e):
        y, h = fused_add_rms_norm(x, r, w)
        z, h = fused_add_layer_norm(y, h, w, b)
        logits = matmul(z, wk, b_layout="kn")
        experts = grouped_matmul(torch.stack((z, h)), e, sizes, b_layout="kn")
        return cross_entropy(logits + experts.sum(0)[:, :64], target) + h.float().mean()

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        inputs = [t.clone().requires_grad_() for t in (x, w, wk, e)]
        loss = fn(*inputs)
        results.append((loss, *torch.autograd.grad(loss, inputs)))
    for eager, compiled in zip(*results):
        assert ((compiled.double() - eager.double()).norm() / eager.double().norm()).item() < 1e-2


def test_norms_take_any_leading_dims(interpreted):
    """(B, N, D) hidden states as a model holds them: the rows are the
    leading dims flattened, forward and backward."""
    from tk_mlir.kernels import layer_norm
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16).requires_grad_()
    r = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(64, generator=g) + 1).to(torch.bfloat16).requires_grad_()
    for y in (rms_norm(x, w), layer_norm(x, w, w), fused_add_rms_norm(x, r, w)[0]):
        assert y.shape == x.shape
    y = rms_norm(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    x2 = x.detach().reshape(10, 64).requires_grad_()
    w2 = w.detach().requires_grad_()
    y2 = rms_norm(x2, w2)
    ref = torch.autograd.grad(y2, (x2, w2), torch.ones_like(y2))
    assert torch.equal(y.reshape(10, 64), y2) and torch.equal(dx.reshape(10, 64), ref[0])
    assert torch.equal(dw, ref[1])


@pytest.mark.parametrize("frozen, low_memory", [(False, False), (True, False), (False, True)])
def test_compiled_linear_cross_entropy_makes_its_gradients_in_the_forward(
        interpreted, monkeypatch, frozen, low_memory):
    """Under torch.compile(fullgraph=True) a scalar loss traces the op that
    makes the gradients with the logits (two row chunks here; low_memory:
    in vocabulary slices), scaled by the incoming gradient in the backward:
    the loss and gradients of eager; a frozen weight gets none made."""
    from tk_mlir.kernels import linear_cross_entropy, losses
    monkeypatch.setattr(losses, "LOGITS_SLICE_BYTES", 128 * 256 * 2)
    calls = []
    real = losses.linear_forward_with_grads
    monkeypatch.setattr(losses, "linear_forward_with_grads",
                        lambda *a: calls.append(a[-3:]) or real(*a))
    g = torch.Generator().manual_seed(9)
    h, w, t = _linear_ce_case(200, 64, 256, g, ignore_every=5)
    w.requires_grad_(not frozen)
    inputs = (h, w) if not frozen else (h,)
    results = []
    for fn in (linear_cross_entropy, torch.compile(linear_cross_entropy, fullgraph=True)):
        loss = fn(h, w, t, low_memory=low_memory) * 0.75
        results.append((loss, *torch.autograd.grad(loss, inputs)))
    for eager, compiled in zip(*results):
        assert torch.equal(compiled, eager)
    assert calls == [(True, not frozen, low_memory)] * 2   # eager's, then the compiled graph's


def test_opcheck_linear_cross_entropy_with_grads(interpreted):
    from tk_mlir.kernels import custom_ops  # noqa: F401  registers the ops
    g = torch.Generator().manual_seed(10)
    h, w, t = _linear_ce_case(40, 64, 128, g, ignore_every=7)
    op = torch.ops.tk_mlir.linear_cross_entropy_with_grads.default
    for args in ((h, w, t, -100, "mean", True, True, False),
                 (h, w, t, -100, "sum", True, False, False),
                 (h, w, t, -100, "mean", True, True, True)):
        result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                             "test_autograd_registration"))
        assert set(result.values()) == {"SUCCESS"}, result


def _second_derivative_cases():
    bf = torch.bfloat16

    def matmul_case():
        a = torch.randn(6, 8, dtype=bf, requires_grad=True)
        b = torch.randn(5, 8, dtype=bf, requires_grad=True)
        return matmul(a, b), a

    def grouped_case():
        from tk_mlir.kernels import grouped_matmul
        a = torch.randn(2, 20, 16, dtype=bf, requires_grad=True)
        b = torch.randn(2, 8, 16, dtype=bf, requires_grad=True)
        return grouped_matmul(a, b, [20, 3]), a

    def rms_norm_case():
        x = torch.randn(3, 64, dtype=bf, requires_grad=True)
        return rms_norm(x, torch.rand(64, dtype=bf) + 0.5), x

    def swiglu_case():
        g = torch.randn(3, 64, dtype=bf, requires_grad=True)
        return swiglu(g, torch.randn(3, 64, dtype=bf)), g
    return {"matmul": matmul_case, "grouped_matmul": grouped_case, "rms_norm": rms_norm_case,
            "swiglu": swiglu_case}


@pytest.mark.parametrize("name", list(_second_derivative_cases()))
def test_a_second_derivative_raises_even_from_a_plain_loss(interpreted, name):
    """create_graph=True from a loss whose incoming gradient needs no grad: the
    first-order gradient still depends on the saved inputs, so differentiating
    it again raises (it used to come back silently cut from the graph)."""
    out, x = _second_derivative_cases()[name]()
    (g,) = torch.autograd.grad(out.float().sum(), x, create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (g.float() ** 2).sum().backward()


@pytest.mark.parametrize("name", list(_second_derivative_cases()))
def test_a_second_derivative_with_respect_to_an_input_raises(interpreted, name):
    """d/d(input) of a first gradient taken with create_graph=True: the path
    to the inputs exists (it used to end at stand-in leaves, so
    allow_unused=True gave None where the true derivative is not zero)."""
    out, x = _second_derivative_cases()[name]()
    (g,) = torch.autograd.grad(out.float().sum(), x, create_graph=True)
    for unused in (False, True):
        with pytest.raises(RuntimeError, match="differentiate twice"):
            torch.autograd.grad((g.float() * torch.randn(g.shape)).sum(), x,
                                allow_unused=unused)


def test_a_gradient_taken_with_create_graph_keeps_its_values(interpreted):
    """create_graph=True changes nothing but the gradient's grad_fn."""
    a = torch.randn(9, 32, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    dc = torch.randn(9, 16)
    plain = torch.autograd.grad(matmul(a, b).float(), (a, b), dc)
    graphed = torch.autograd.grad(matmul(a, b).float(), (a, b), dc, create_graph=True)
    for p, g in zip(plain, graphed):
        assert g.requires_grad and torch.equal(p, g.detach())


def test_the_matmul_gradient_ops_check_their_arguments(interpreted):
    import tk_mlir.kernels.custom_ops  # noqa: F401  registers torch.ops.tk_mlir
    ops, bf = torch.ops.tk_mlir, torch.bfloat16
    dc, b, a = torch.randn(9, 16, dtype=bf), torch.randn(16, 24, dtype=bf), torch.randn(9, 24,
                                                                                         dtype=bf)
    assert ops.matmul_grad_a(dc, b, "nk").shape == (9, 24)
    assert ops.matmul_grad_b(dc, a, "nk").shape == (16, 24)
    with pytest.raises(ValueError, match="dc's columns must be b's N = 16"):
        ops.matmul_grad_a(torch.randn(9, 15, dtype=bf), b, "nk")
    with pytest.raises(ValueError, match="b_layout must be 'nk'"):
        ops.matmul_grad_a(dc, b, "xx")
    with pytest.raises(ValueError, match="dc's rows must be a's M = 9"):
        ops.matmul_grad_b(torch.randn(8, 16, dtype=bf), a, "nk")
    with pytest.raises(ValueError, match="dc must be 2-D"):
        ops.matmul_grad_a(torch.randn(16, dtype=bf), b, "nk")
    with pytest.raises(TypeError, match="b must be torch.bfloat16 or torch.float16"):
        ops.matmul_grad_a(dc, b.float(), "nk")
    A, B, DC = (torch.randn(*s, dtype=bf) for s in ((2, 20, 16), (2, 12, 16), (2, 20, 12)))
    with pytest.raises(ValueError, match="grouped_matmul_grads: sizes must be .* G=2 row"):
        ops.grouped_matmul_grads(DC, A, B, torch.tensor([20]), "nk", True, True)
    with pytest.raises(ValueError, match=r"sizes\[1\] is 99"):
        ops.grouped_matmul_grads(DC, A, B, torch.tensor([3, 99]), "nk", True, True)
    with pytest.raises(ValueError, match="dc must have shape"):
        ops.grouped_matmul_grads(DC[:, :, :8], A, B, torch.tensor([3, 9]), "nk", True, True)


def test_grouped_matmul_with_k_0_writes_only_the_rows_it_computes(interpreted):
    from tk_mlir.kernels import grouped_matmul
    bf = torch.bfloat16
    c = torch.full((2, 200, 8), 5.0, dtype=bf)
    grouped_matmul(torch.randn(2, 200, 0, dtype=bf), torch.randn(2, 8, 0, dtype=bf), [0, 1], c)
    assert (c[0] == 5).all()                  # no rows of the first product
    assert (c[1, :128] == 0).all() and (c[1, 128:] == 5).all()   # the second: one tile


@pytest.mark.parametrize("which", ["rms_norm", "layer_norm", "fused_add_rms_norm",
                                   "fused_add_layer_norm"])
def test_norms_with_frozen_parameters_give_dx_alone(interpreted, which):
    """A frozen weight (and bias): the backward skips their column sums and
    dx is the same as with them trained."""
    from tk_mlir import kernels
    fn = getattr(kernels, which)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    r = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(64, generator=g) + 1).to(torch.bfloat16)
    b = torch.randn(64, generator=g).to(torch.bfloat16)
    dy = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    dxs = []
    for trained in (True, False):
        xx, ww, bb = x.clone().requires_grad_(), w.clone().requires_grad_(trained), \
            b.clone().requires_grad_(trained)
        args = ((xx, r) if which.startswith("fused") else (xx,)) + \
            ((ww, bb) if "layer" in which else (ww,))
        y = fn(*args)
        y = y[0] if isinstance(y, tuple) else y
        y.backward(dy)
        dxs.append(xx.grad)
        assert (ww.grad is not None) == trained
    assert torch.equal(*dxs)


@pytest.mark.parametrize("frozen", [False, True])
def test_norms_backward_of_no_rows(interpreted, frozen):
    """No rows: dx empty, dweight zeros when trained (None when frozen)."""
    from tk_mlir.kernels import layer_norm
    x = torch.randn(0, 64).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(64) + 1).to(torch.bfloat16).requires_grad_(not frozen)
    for y in (rms_norm(x, w), layer_norm(x, w, w), fused_add_rms_norm(x, x, w)[0]):
        grads = torch.autograd.grad(y, (x, w) if not frozen else (x,), torch.ones_like(y))
        assert grads[0].shape == x.shape
        if not frozen:
            assert torch.equal(grads[1], torch.zeros(64, dtype=torch.bfloat16))
