"""ssd (tk_mlir/kernels/state_space_duality.py): Mamba-2's state-space
duality layer, chunked, forward and backward.

Without a GPU: the kernels in the interpreter against a float64 loop that
runs the recurrence token by token, for odd lengths (not a multiple of the
chunk), grouped B/C (g dividing h), a head dim over two column blocks, a
state size that is not a whole tile, D, initial and returned states, and
the gradient of every input (A and D included, and through the returned
state); torch.compile; the argument rules. With a GPU (`-m gpu`): the same
against float64 at a training shape.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tk_mlir.kernels import ssd  # noqa: E402

from torch_reference import assert_compiled_matches_eager  # noqa: E402
from torch_reference import relative_error as _rel  # noqa: E402

bf16 = torch.bfloat16
gpu = pytest.mark.gpu
NAMES = ("x", "dt", "A", "B", "C", "D", "initial_state")


def recurrence(x, dt, A, B, C, D=None, h0=None):
    """The definition, one token at a time: (y, final state (b, h, p, n))."""
    b, l, h, p = x.shape
    g = B.shape[2]
    Bh, Ch = (t.repeat_interleave(h // g, 2) for t in (B, C))
    H = x.new_zeros(b, h, p, B.shape[3]) if h0 is None else h0.to(x.dtype)
    ys = []
    for t in range(l):
        H = (torch.exp(dt[:, t] * A)[..., None, None] * H
             + dt[:, t, :, None, None] * x[:, t, :, :, None] * Bh[:, t, :, None, :])
        y = (H * Ch[:, t, :, None, :]).sum(-1)
        ys.append(y if D is None else y + D[:, None] * x[:, t])
    return torch.stack(ys, 1), H


def _inputs(b, l, h, p, g, n, seed, D=True, initial=False, device="cpu"):
    """Mamba-2-like inputs: dt through softplus (0.05 ... 0.7), A in [-4, -0.5]."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, l, h, p, generator=gen) * 0.5).to(bf16)
    dt = torch.nn.functional.softplus(torch.randn(b, l, h, generator=gen) - 2)
    A = -0.5 - 3.5 * torch.rand(h, generator=gen)
    B, C = ((torch.randn(b, l, g, n, generator=gen) * 0.3).to(bf16) for _ in range(2))
    Dv = torch.randn(h, generator=gen) if D else None
    h0 = torch.randn(b, h, p, n, generator=gen) if initial else None
    return [t if t is None else t.to(device) for t in (x, dt, A, B, C, Dv, h0)]


def _check(inputs, final_grad: bool, tol: float, device_ref: str = "cpu"):
    """y, the returned state and every input's gradient (of y·dy, plus
    state·dstate with final_grad) against the recurrence in float64, to tol;
    dA, the ill-conditioned one (a sum over the sequence of terms ~100x its
    size that cancel), to 2·tol: measured 1e-3 ... 1e-2, where a less
    careful backward misses by 5-17% at l=1000."""
    leaves = [t if t is None else t.clone().requires_grad_() for t in inputs]
    y, h1 = ssd(*leaves[:5], D=leaves[5], initial_state=leaves[6], return_state=True)
    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(y.shape, generator=gen).to(y.device)
    dh1 = torch.randn(h1.shape, generator=gen).to(y.device)
    wanted = [t for t in leaves if t is not None]
    loss = (y.float() * dy).sum() + ((h1 * dh1).sum() if final_grad else 0)
    grads = torch.autograd.grad(loss, wanted)
    ref = [t if t is None else t.detach().to(device_ref).double().requires_grad_()
           for t in leaves]
    ry, rh = recurrence(*ref)
    rloss = (ry * dy.to(device_ref).double()).sum()
    if final_grad:
        rloss = rloss + (rh * dh1.to(device_ref).double()).sum()
    ref_grads = torch.autograd.grad(rloss, [t for t in ref if t is not None])
    assert y.shape == inputs[0].shape and y.dtype == inputs[0].dtype
    assert _rel(y.to(device_ref), ry) < tol
    assert _rel(h1.to(device_ref), rh) < tol
    names = [n for n, t in zip(NAMES, leaves) if t is not None]
    for name, got, want in zip(names, grads, ref_grads):
        assert got.shape == want.shape and got.dtype == leaves[NAMES.index(name)].dtype
        assert _rel(got.to(device_ref), want) < (2 * tol if name == "A" else tol), name


@pytest.mark.parametrize("b,l,h,p,g,n,D,initial,final_grad", [
    (2, 150, 4, 64, 1, 128, True, False, False),     # odd length, one group
    (1, 130, 4, 80, 2, 64, True, True, True),        # p over two blocks, g=2, the states
    (1, 70, 2, 64, 2, 48, False, True, False),       # n not a whole tile, a group per head
    (1, 64, 2, 128, 1, 128, False, False, True),     # one whole chunk
])
def test_matches_the_recurrence_forward_and_backward(interpret, b, l, h, p, g, n, D, initial,
                                                     final_grad):
    inputs = _inputs(b, l, h, p, g, n, seed=l + p + n, D=D, initial=initial)
    _check(inputs, final_grad, tol=1e-2)


def test_views_of_one_projection_and_short_heads(interpret):
    """x, B and C as Mamba-2 makes them, views into one projection's output
    (strided rows); p = 32 (half a column block); a sequence of one token."""
    b, l, h, p, g, n = 2, 33, 4, 32, 2, 16
    for length in (l, 1):
        gen = torch.Generator().manual_seed(length)
        xbc = (torch.randn(b, length, h * p + 2 * g * n + 8, generator=gen) * 0.4).to(bf16)
        x = xbc[..., :h * p].view(b, length, h, p)
        B = xbc[..., h * p:h * p + g * n].view(b, length, g, n)
        C = xbc[..., h * p + g * n:h * p + 2 * g * n].view(b, length, g, n)
        dt = torch.nn.functional.softplus(torch.randn(b, length, h, generator=gen) - 2)
        A = -0.5 - 3.5 * torch.rand(h, generator=gen)
        h0 = torch.randn(b, h, p, n, generator=gen)    # (dA is 0 for one token from 0)
        _check([x, dt, A, B, C, torch.randn(h, generator=gen), h0], True, tol=1e-2)


def test_dt_A_and_D_in_the_inputs_dtype(interpret):
    """dt, A and D may be bf16 (as a bf16 model holds them): gradients in it."""
    x, dt, A, B, C, D, _ = _inputs(1, 80, 2, 64, 1, 64, seed=5)
    dt, A, D = (t.to(bf16) for t in (dt, A, D))
    _check([x, dt, A, B, C, D, None], False, tol=1e-2)


def test_a_chunk_at_a_time_with_the_returned_state_is_the_whole_sequence(interpret):
    x, dt, A, B, C, D, _ = _inputs(1, 200, 2, 64, 1, 64, seed=3)
    y, h = ssd(x, dt, A, B, C, D=D, return_state=True)
    y1, h1 = ssd(x[:, :90], dt[:, :90], A, B[:, :90], C[:, :90], D=D, return_state=True)
    y2, h2 = ssd(x[:, 90:], dt[:, 90:], A, B[:, 90:], C[:, 90:], D=D, initial_state=h1,
                 return_state=True)
    assert _rel(torch.cat((y1, y2), 1), y) < 5e-3
    assert _rel(h2, h) < 5e-3


def test_an_empty_sequence_returns_the_initial_state(interpret):
    x, dt, A, B, C, D, h0 = _inputs(2, 0, 2, 64, 1, 64, seed=4, initial=True)
    y, h1 = ssd(x, dt, A, B, C, D=D, initial_state=h0, return_state=True)
    assert y.shape == x.shape and torch.equal(h1, h0)
    h0 = h0.clone().requires_grad_()
    _, h1 = ssd(x, dt, A, B, C, initial_state=h0, return_state=True)
    (g,) = torch.autograd.grad(h1.sum(), h0)
    assert torch.equal(g, torch.ones_like(g))


def test_compiled_matches_eager(interpret):
    x, dt, A, B, C, D, h0 = _inputs(1, 70, 2, 64, 1, 64, seed=6, initial=True)
    x, dt, B = (t.requires_grad_() for t in (x, dt, B))

    def f(x, dt, B):
        return ssd(x, dt, A, B, C, D=D, initial_state=h0)

    assert_compiled_matches_eager(f, x, dt, B)


def test_a_second_derivative_raises(interpret):
    """Gradients are first order: a second one raises, never comes back partial."""
    x, dt, A, B, C, D, _ = _inputs(1, 40, 2, 64, 1, 64, seed=8)
    dt, A = dt.requires_grad_(), A.requires_grad_()
    y = ssd(x, dt, A, B, C, D=D)
    (gdt,) = torch.autograd.grad(y.float().pow(2).sum(), dt, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gdt.sum().backward()


def test_dt_may_be_a_view_with_heads_not_innermost(interpret):
    """dt goes through torch before the kernels: a (b, h, l) tensor viewed as
    (b, l, h) is taken as it is."""
    x, dt, A, B, C, D, _ = _inputs(1, 70, 2, 64, 1, 64, seed=9)
    view = dt.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(ssd(x, view, A, B, C, D=D), ssd(x, dt, A, B, C, D=D))


def test_bad_arguments_are_refused_with_the_rule():
    x, dt, A, B, C, D, h0 = _inputs(1, 8, 4, 64, 2, 64, seed=7, initial=True)
    cases = [
        (dict(x=x.float()), TypeError, r"x must be torch.bfloat16 or torch.float16"),
        (dict(dt=dt[:, :4]), ValueError, r"dt must have shape \(1, 8, 4\)"),
        (dict(A=A[:2]), ValueError, r"A must have shape \(4,\) \(one per head\)"),
        (dict(B=B.float()), TypeError, r"B must be torch.bfloat16"),
        (dict(C=C[..., :32]), ValueError, r"C must have shape \(1, 8, 2, 64\)"),
        (dict(B=B[:, :, :1].expand(1, 8, 3, 64), C=C[:, :, :1].expand(1, 8, 3, 64)),
         ValueError, r"groups g=3 of B and C must divide the heads h=4"),
        (dict(B=torch.cat((B, B, B), -1), C=torch.cat((C, C, C), -1)), ValueError,
         r"state size n \(B's last dim\) must be a multiple of 8 from 8 to 128, got 192"),
        (dict(x=x[..., :12]), ValueError, r"head dim p .* multiple of 8"),
        (dict(D=D[:3]), ValueError, r"D must have shape \(4,\)"),
        (dict(initial_state=h0[..., :32]), ValueError,
         r"initial_state must have shape \(1, 4, 64, 64\) \(\(b, h, p, n\)\)"),
        (dict(initial_state=h0.to(bf16)), TypeError, r"initial_state must be torch.float32"),
        (dict(chunk_size=100), ValueError, r"chunk_size must be a positive multiple of 16"),
        (dict(chunk_size=True), TypeError, r"chunk_size must be an int"),
        (dict(return_state=1), TypeError, r"return_state must be a bool"),
        (dict(x=x.transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
         r"x's last dim must be contiguous"),
    ]
    for change, error, message in cases:
        args = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, initial_state=h0)
        args.update(change)
        with pytest.raises(error, match=message):
            ssd(**args)


# ------------------------------------------------------------------ GPU

@gpu
@pytest.mark.parametrize("g,D,initial", [(1, True, False), (8, False, True)])
def test_gpu_matches_the_recurrence(g, D, initial):
    inputs = _inputs(2, 1000, 8, 64, g, 128, seed=g, D=D, initial=initial, device="cuda")
    _check(inputs, initial, tol=1e-2, device_ref="cuda")


@pytest.mark.parametrize("min_segment,b,l,h,p,g,n,D,initial", [
    (1, 1, 200, 2, 64, 2, 48, False, True),     # a segment per chunk, from the initial state
    (2, 2, 330, 2, 80, 1, 128, True, False),    # 6 chunks in 2 segments of 3, p over two blocks
    (2, 1, 438, 2, 72, 1, 72, False, True),     # 7 chunks: 3, 3 and a last one of 1
])
def test_a_sequence_cut_into_segments_matches_the_recurrence(interpret, monkeypatch, min_segment,
                                                             b, l, h, p, g, n, D, initial):
    """The forward over segments of the sequence (each from the states the
    segments before it built, decayed) against the float64 recurrence: y,
    the final state and, through the backward, every gradient. Weak decays
    (A ~ -0.01), so the state carried across segments matters."""
    from tk_mlir.kernels import chunked_linear_attention as cla
    from tk_mlir.kernels import state_space_duality as sd
    monkeypatch.setattr(cla, "MIN_SEGMENT", min_segment)
    monkeypatch.setattr(sd, "num_sms", lambda device: 132)     # (fewer walks than SMs)
    chunks = -(-l // 64)
    assert sd.segments_of(b * h * -(-p // 64), chunks, -1) < chunks       # (several)
    inputs = _inputs(b, l, h, p, g, n, seed=l + p + n + min_segment, D=D, initial=initial)
    inputs[2] = inputs[2] * 0.01                        # A: weak decays
    _check(inputs, True, tol=1e-2)


def test_the_segment_kernels_compile_without_spills():
    """ptxas on the segmented forward's three kernels and the backward's
    gradient sums at Mamba-2's n = 128 (no GPU needed): no spill, no C75xx
    advisory."""
    import tk_mlir as tk
    from tk_mlir.kernels import state_space_duality as sd
    b, h, l, p, n, segs = 4, 64, 16384, 64, 128, 16
    x, bm = tk.spec((b, h, l, p), tk.bf16), tk.spec((b, 1, l, n), tk.bf16)
    per_token, per_chunk = tk.spec((b, h, l), tk.f32), tk.spec((b, h, l // 64), tk.f32)
    sums, state = tk.spec((b, h, segs * 128, p), tk.f32), tk.spec((b, h, n, p), tk.f32)
    flags = dict(NS=128, HG=h)
    kernels = {
        "sums": sd.ssd_segment_sums_kernel.compile(x, bm, per_token, per_token, per_chunk, sums,
                                                   16, **flags),
        "prefix": sd.ssd_segment_prefix_kernel.compile(sums, tk.spec((b, h, segs), tk.f32),
                                                       state, sums, state, segs, NS=128,
                                                       INITIAL=True),
        "forward": sd.ssd_kernel.compile(x, bm, bm, per_token, per_token, per_token, per_chunk,
                                         tk.spec((h,), tk.f32), x, sums, state, 16, HAS_D=True,
                                         INITIAL=True, **flags),
        "grad sums": sd.ssd_segment_grad_sums_kernel.compile(bm, per_token, per_chunk, x, sums,
                                                             16, **flags)}
    for name, c in kernels.items():
        assert c.info["spill stores (bytes)"] == c.info["spill loads (bytes)"] == 0, name
        assert "C75" not in c.ptxas_log, (name, c.ptxas_log)


@pytest.mark.parametrize("segments", [1, 16])
def test_the_backward_kernel_spills_little(segments):
    """ptxas on the backward at n = 128, one walk and 16 segments (no GPU
    needed): a few registers spill (40 and 52 bytes), no C75xx advisory. The
    segment count is a compile-time constant: divided by a run-time one, the
    batch and segment were held across the loops and 160 bytes spilled."""
    import tk_mlir as tk
    from tk_mlir.kernels import state_space_duality as sd
    b, h, l, p, n = 4, 64, 16384, 64, 128
    x, bm = tk.spec((b, h, l, p), tk.bf16), tk.spec((b, 1, l, n), tk.bf16)
    per_token, per_chunk = tk.spec((b, h, l), tk.f32), tk.spec((b, h, l // 64), tk.f32)
    states, sums = tk.spec((b, h, segments * 128, p), tk.f32), tk.spec((b, 1, l, n), tk.f32)
    c = sd.ssd_backward_kernel.compile(
        x, bm, bm, per_token, per_token, per_token, per_chunk, tk.spec((h,), tk.f32), x, states,
        states, x, sums, sums, per_token, per_token, tk.spec((b, h, n, p), tk.f32),
        l // 64 // segments, NS=128, HG=h, HAS_D=True, INITIAL=True, FINAL_GRAD=True,
        SEGMENTS=segments)
    assert c.info["spill stores (bytes)"] <= 64, c.ptxas_log
    assert "C75" not in c.ptxas_log, c.ptxas_log


def test_the_backward_cuts_a_power_of_two_of_whole_segments(monkeypatch):
    """backward_segments_of: every segment holds at least one chunk, the count
    is a power of two (the backward compiles once per count), and with as
    many walks as SMs the sequence is not cut."""
    from tk_mlir.kernels import state_space_duality as sd
    monkeypatch.setattr(sd, "num_sms", lambda device: 132)
    for units in (1, 3, 16, 40):
        for chunks in range(1, 400):
            seg = sd.backward_segments_of(units, chunks, 0)
            count = -(-chunks // seg)
            assert count & (count - 1) == 0 and seg * (count - 1) < chunks, (units, chunks)
    assert sd.backward_segments_of(66, 300, 0) == 300
