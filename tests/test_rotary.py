"""rotary_embedding (tk_mlir/kernels/rotary.py): GPT-NeoX (and GPT-J) rotary embeddings
on (B, N, H, D), forward and backward.

Without a GPU: the kernel in the interpreter against float64 (a head count
that is not a power of two, per-sequence angles, the inverse rotation), the
argument rules, the op's fake. With one (`-m gpu`): eager and compiled
autograd on strided q/k views of a projection against float64.
"""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import tk_mlir as tk  # noqa: E402
from tk_mlir.kernels import rotary_embedding, rotary_embedding_qk  # noqa: E402

from torch_reference import relative_error as _rel  # noqa: E402

bf16 = torch.bfloat16
gpu = pytest.mark.gpu


def _reference(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x.double()[..., :half], x.double()[..., half:]
    c, s = cos.double(), sin.double()
    c, s = (c[None, :, None] if c.dim() == 2 else c[:, :, None]), \
        (s[None, :, None] if s.dim() == 2 else s[:, :, None])
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


def _reference_interleaved(x, cos, sin):
    """GPT-J: pair i is (x_2i, x_2i+1)."""
    xe, xo = x.double()[..., 0::2], x.double()[..., 1::2]
    c, s = cos.double(), sin.double()
    c, s = (c[None, :, None] if c.dim() == 2 else c[:, :, None]), \
        (s[None, :, None] if s.dim() == 2 else s[:, :, None])
    return torch.stack((xe * c - xo * s, xo * c + xe * s), -1).flatten(-2)


def _angles(*shape, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.rand(*shape, generator=g, device=device) * 6.3
    return a.cos(), a.sin()


@pytest.mark.parametrize("per_batch", [False, True])
def test_interleaved_in_the_interpreter(monkeypatch, per_batch):
    """The GPT-J layout, forward against float64 and its gradient (the
    inverse rotation) against autograd's, through the library call."""
    import sys
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", True)
    g = torch.Generator().manual_seed(3)
    B, N, H, D = 2, 5, 3, 32
    x = torch.randn(B, N, H, D, generator=g).to(bf16).requires_grad_()
    cos, sin = _angles(*((B, N, D // 2) if per_batch else (N, D // 2)), seed=4)
    y = rotary_embedding(x, cos, sin, interleaved=True)
    xd = x.detach().double().requires_grad_()
    ref = _reference_interleaved(xd, cos, sin)
    assert _rel(y, ref) < 1e-2
    dy = torch.randn(B, N, H, D, generator=g).to(bf16)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    (ref_dx,) = torch.autograd.grad(ref, (xd,), dy.double())
    assert _rel(dx, ref_dx) < 1e-2
    q, k = rotary_embedding_qk(x.detach(), x.detach()[:, :, :1], cos, sin, interleaved=True)
    assert _rel(k, ref.detach()[:, :, :1]) < 1e-2
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        rotary_embedding(x, cos, sin, interleaved="gptj")


def test_swap_pairs_trades_column_neighbours():
    """Tile.swap_pairs in the interpreter for the vec and row layouts, and
    the rule that refuses a col layout tile at its line."""
    @tk.kernel(num_warps=4)
    def swap(X: tk.gl, Y: tk.gl, Z: tk.gl):
        tk.store(Y, tk.load(X, (0, 0), (16, 64)).swap_pairs(), (0, 0))
        tk.store(Z, tk.load(X, (0, 0), (64, 64), layout="row").swap_pairs(), (0, 0))

    x = torch.randn(64, 64)
    y, z = torch.full((16, 64), float("nan")), torch.full((64, 64), float("nan"))
    swap.interpret[(1,)](x, y, z)
    want = x.view(64, 32, 2).flip(-1).reshape(64, 64)
    assert torch.equal(y, want[:16]) and torch.equal(z, want)

    @tk.kernel(num_warps=4)
    def across_threads(X: tk.gl, Y: tk.gl):
        tk.store(Y, tk.load(X, (0, 0), (64, 64), layout="col").swap_pairs(), (0, 0))

    with pytest.raises(tk.CompilationError, match=r"swap_pairs: .* holds column pairs in two "
                                                  r"threads"):
        across_threads.compile(tk.spec((64, 64), tk.f32), tk.spec((64, 64), tk.f32))


@pytest.mark.parametrize("interleaved,per_batch", [(False, False), (True, True)])
def test_q_and_k_in_one_launch_each_way(interpret, monkeypatch, interleaved, per_batch):
    """rotary_embedding_qk on views of one projection (GQA head counts):
    forward and gradients against float64, one launch forward and one back."""
    from tk_mlir.kernels import rotary
    launches = []
    real = type(rotary.rotary_qk_kernel)._interpret
    monkeypatch.setattr(type(rotary.rotary_qk_kernel), "_interpret",
                        lambda self, grid, *a, **kw: launches.append((self.__name__, grid)) or
                        real(self, grid, *a, **kw))
    B, N, H, H_KV, D = 2, 5, 6, 2, 32
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(B, N, (H + 2 * H_KV) * D, generator=g).to(bf16).requires_grad_()
    q = qkv[..., :H * D].view(B, N, H, D)
    k = qkv[..., H * D:(H + H_KV) * D].view(B, N, H_KV, D)
    cos, sin = _angles(*((B, N, D // 2) if per_batch else (N, D // 2)), seed=8)
    rq, rk = rotary_embedding_qk(q, k, cos, sin, interleaved=interleaved)
    ref = _reference_interleaved if interleaved else _reference
    qd = qkv.detach().double().requires_grad_()
    rq64 = ref(qd[..., :H * D].view(B, N, H, D), cos, sin)
    rk64 = ref(qd[..., H * D:(H + H_KV) * D].view(B, N, H_KV, D), cos, sin)
    assert _rel(rq, rq64) < 1e-2 and _rel(rk, rk64) < 1e-2
    dq, dk = (torch.randn(t.shape, generator=g).to(bf16) for t in (rq, rk))
    (dqkv,) = torch.autograd.grad((rq, rk), (qkv,), (dq, dk))
    (ref_d,) = torch.autograd.grad((rq64, rk64), (qd,), (dq.double(), dk.double()))
    assert _rel(dqkv, ref_d) < 1e-2
    assert launches == [("rotary_qk_kernel", (N, B, 2))] * 2


def test_q_and_k_of_other_lengths_go_one_at_a_time(interpret):
    """q and k that cannot share a launch go through rotary_embedding each;
    errors name the tensor."""
    q = torch.randn(1, 4, 2, 32).to(bf16)
    k = torch.randn(1, 6, 2, 32).to(bf16)
    cos, sin = _angles(4, 16, seed=9)
    with pytest.raises(ValueError, match=r"rotary_embedding_qk: cos must have shape \(N', 16\) "
                                         r".* N' >= N=6.* for k of shape \(1, 6, 2, 32\)"):
        rotary_embedding_qk(q, k, cos, sin)
    with pytest.raises(ValueError, match=r"rotary_embedding_qk: k's last dim must be contiguous"):
        rotary_embedding_qk(q, torch.randn(1, 4, 2, 64).to(bf16)[..., ::2], cos, sin)
    with pytest.raises(ValueError, match=r"rotary_embedding_qk: k must be 4-D"):
        rotary_embedding_qk(q, k[0], cos, sin)
    with pytest.raises(ValueError, match=r"rotary_embedding_qk: k must be on q's device cpu, "
                                         r"got meta"):                # (not "cos must be ...")
        rotary_embedding_qk(q, k[:, :4].to("meta"), cos, sin)


def test_angle_tables_that_require_grad_are_warned_of(interpret):
    """The rotation is differentiable in x only: a learned table would get no
    gradient, silently, so a call autograd records says so."""
    x = torch.randn(1, 4, 2, 32).to(bf16).requires_grad_()
    angles = torch.randn(4, 16, requires_grad=True)
    for call in (lambda c, s: rotary_embedding(x, c, s),
                 lambda c, s: rotary_embedding_qk(x, x.detach(), c, s)):
        with pytest.warns(UserWarning, match=r"not in cos and sin: the angle tables"):
            call(angles.cos(), angles.sin())
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            call(angles.cos(), angles.sin())            # nothing recorded: no warning


def test_q_and_k_differentiated_one_at_a_time(interpret):
    """rotary_embedding_qk is two rotations: each output may be differentiated
    on its own, one backward after the other (the one launch saved nothing
    that the first backward frees), against float64."""
    B, N, H, H_KV, D = 1, 6, 3, 1, 32
    g = torch.Generator().manual_seed(12)
    q, k = (torch.randn(B, N, h, D, generator=g).to(bf16).requires_grad_() for h in (H, H_KV))
    cos, sin = _angles(N, D // 2, seed=13)
    rq, rk = rotary_embedding_qk(q, k, cos, sin)
    dq, dk = (torch.randn(t.shape, generator=g).to(bf16) for t in (rq, rk))
    rq.backward(dq)
    assert k.grad is None                       # (k's rotation got no gradient yet)
    rk.backward(dk)
    for x, d in ((q, dq), (k, dk)):
        x64 = x.detach().double().requires_grad_()
        _reference(x64, cos, sin).backward(d.double())
        assert _rel(x.grad, x64.grad) < 1e-2
    rq, _ = rotary_embedding_qk(q, k, cos, sin)
    cos.mul_(0.5)                               # read by the backward: as a saved tensor's
    with pytest.raises(RuntimeError, match=r"cos or sin was modified by an inplace operation"):
        rq.backward(dq)


@pytest.mark.parametrize("heads, d, interleaved", [(300, 128, False), (520, 64, True)])
def test_many_heads_go_in_column_pieces(interpret, heads, d, interleaved):
    """Heads x D past the register budget of one (heads, D/2) tile: the
    kernel walks column pieces (column_pieces), same results."""
    x = torch.randn(1, 2, heads, d, generator=torch.Generator().manual_seed(21)).to(bf16)
    cos, sin = _angles(2, d // 2, seed=22)
    y = rotary_embedding(x, cos, sin, interleaved=interleaved)
    want = _reference(x, cos, sin) if not interleaved else \
        _reference(x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2), cos, sin
                   ).unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
    assert _rel(y, want) < 1e-2


@pytest.mark.parametrize("heads, half, interleaved", [(1024, 64, False), (256, 64, False),
                                                    (1024, 64, True), (128, 128, False)])
def test_many_heads_compile_without_spills(ptxas, heads, half, interleaved):
    """The pieces walked by a run-time loop: unrolled, ptxas hoisted every
    piece's loads and spilled (146 bytes at 256 heads of D=128)."""
    from tk_mlir.kernels.rotary import rotary_kernel
    x = tk.spec((1, 4, heads, 2 * half), tk.bf16)
    table = tk.spec((4 * half * (2 if interleaved else 1),), tk.f32)
    c = rotary_kernel.compile(x, table, table, x, HB=heads, HALF=half, INTERLEAVED=interleaved)
    assert c.info["spill stores (bytes)"] == 0, c.ptxas_log


def test_an_expanded_table_is_read_as_its_one_table(interpret):
    """cos[None].expand(B, N, D/2), as a model may hand it, is the (N, D/2)
    table; a longer table expanded, (B, N', D/2), is its first N rows."""
    B, N, H, D = 2, 5, 2, 32
    x = torch.randn(B, N, H, D, generator=torch.Generator().manual_seed(14)).to(bf16)
    cos, sin = _angles(N + 3, D // 2, seed=15)
    want = _reference(x, cos[:N], sin[:N])
    for n in (N, N + 3):
        y = rotary_embedding(x, cos[None, :n].expand(B, n, D // 2),
                             sin[None, :n].expand(B, n, D // 2))
        assert _rel(y, want) < 1e-2


def test_q_alone_requiring_grad_leaves_k_out_of_the_graph(interpret):
    q = torch.randn(1, 4, 2, 32).to(bf16).requires_grad_()
    k = torch.randn(1, 4, 1, 32).to(bf16)
    cos, sin = _angles(4, 16, seed=10)
    rq, rk = rotary_embedding_qk(q, k, cos, sin)
    assert rq.requires_grad and not rk.requires_grad
    assert _rel(rk, _reference(k, cos, sin)) < 1e-2


@pytest.mark.parametrize("per_batch", [False, True])
def test_kernel_in_the_interpreter(per_batch):
    from tk_mlir.kernels.rotary import rotary_kernel
    B, N, H, D = 2, 5, 6, 64                             # 6 heads: 8 rows, 2 masked
    x = torch.randn(B, N, H, D, generator=torch.Generator().manual_seed(1)).to(bf16)
    cos, sin = _angles(*((B, N, D // 2) if per_batch else (N, D // 2)), seed=2)
    y, back = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    rotary_kernel.interpret[(N, B)](x, cos.reshape(-1), sin.reshape(-1), y, HB=8, HALF=D // 2,
                                    PER_BATCH=per_batch)
    assert _rel(y, _reference(x, cos, sin)) < 1e-2
    rotary_kernel.interpret[(N, B)](y, cos.reshape(-1), sin.reshape(-1), back, HB=8,
                                    HALF=D // 2, PER_BATCH=per_batch, INVERSE=True)
    assert _rel(back, x) < 1e-2                          # the inverse rotation undoes it


@pytest.mark.parametrize("call, error, rule", [
    (lambda x, c: rotary_embedding(x[..., :24], c, c), ValueError, r"head dim D must be a "
                                                                   r"multiple of 16"),
    (lambda x, c: rotary_embedding(x, c[:3], c[:3]), ValueError, r"cos must have shape \(N', "
                                                                 r"16\) or \(1, N', 16\) with "
                                                                 r"N' >= N=5 .* or \(2, 5, 16\)"),
    (lambda x, c: rotary_embedding(x, c.expand(2, 5, 16)[:, :4], c), ValueError,
     r"cos must have shape"),
    (lambda x, c: rotary_embedding(x, c, c.double()), TypeError, r"sin must be "),
    (lambda x, c: rotary_embedding(x, torch.cat((c, c), 1)[:, ::2], c), ValueError,
     r"cos must be contiguous \(or an expanded view"),
    (lambda x, c: rotary_embedding(x, c, c), ValueError, r"rotary_embedding: x must be on a "
                                                         r"CUDA device"),
    # one table expanded over the batch, the other per sequence: read alike or not at all
    (lambda x, c: rotary_embedding(x, c[None].expand(2, 5, 16), torch.randn(2, 5, 16)),
     ValueError, r"cos and sin must both be per sequence \(2, 5, 16\) or both one table"),
    (lambda x, c: rotary_embedding(torch.randn(1, 5, 1025, 32).to(bf16), c, c), ValueError,
     r"x has 1025 heads; a position's heads are one tile's rows, at most 1024"),
    # every rule before the device's
    (lambda x, c: rotary_embedding(x, c, c, interleaved=1), TypeError, r"interleaved"),
    (lambda x, c: rotary_embedding_qk(x, x[..., :24], c, c), ValueError,
     r"rotary_embedding_qk: k's head dim D must be a multiple of 16"),
    (lambda x, c: rotary_embedding_qk(x, x, c, c, interleaved="yes"), TypeError,
     r"rotary_embedding_qk: interleaved"),
])
def test_argument_rules(call, error, rule):
    with pytest.raises(error, match=rule):
        call(torch.randn(2, 5, 4, 32).to(bf16), torch.randn(5, 16))


def test_fake():
    import tk_mlir.kernels.custom_ops  # noqa: F401
    with FakeTensorMode():
        x = torch.empty(2, 7, 3, 64, dtype=bf16, device="cuda")
        c = torch.empty(7, 32, device="cuda")
        assert torch.ops.tk_mlir.rotary_embedding(x, c, c).shape == (2, 7, 3, 64)


@gpu
@pytest.mark.parametrize("per_batch", [False, True])
def test_interleaved_on_the_gpu(per_batch):
    B, N, H, D = 2, 77, 12, 128
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(B, N, H, D, device="cuda", generator=g).to(bf16).requires_grad_()
    cos, sin = _angles(*((B, N, D // 2) if per_batch else (N, D // 2)), seed=9, device="cuda")
    y = rotary_embedding(x, cos, sin, interleaved=True)
    xd = x.detach().double().requires_grad_()
    ref = _reference_interleaved(xd, cos, sin)
    assert _rel(y, ref) < 1e-2
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    (ref_dx,) = torch.autograd.grad(ref, (xd,), dy.double())
    assert _rel(dx, ref_dx) < 1e-2
    compiled = torch.compile(rotary_embedding, fullgraph=True)
    assert torch.equal(compiled(x.detach(), cos, sin, interleaved=True), y.detach())


@gpu
@pytest.mark.parametrize("per_batch", [False, True])
def test_eager_forward_and_gradients_on_projection_views(per_batch):
    B, N, H, H_KV, D = 2, 333, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = (torch.randn(B, N, (H + 2 * H_KV) * D, device="cuda", generator=g)).to(bf16)
    qkv.requires_grad_()
    q = qkv[..., :H * D].view(B, N, H, D)                 # strided views of one projection
    k = qkv[..., H * D:(H + H_KV) * D].view(B, N, H_KV, D)
    cos, sin = _angles(*((B, N, D // 2) if per_batch else (N, D // 2)), seed=4, device="cuda")
    rq, rk = rotary_embedding_qk(q, k, cos, sin)
    assert _rel(rq, _reference(q, cos, sin)) < 1e-2 and _rel(rk, _reference(k, cos, sin)) < 1e-2
    dq, dk = (torch.randn_like(t) for t in (rq, rk))
    (dqkv,) = torch.autograd.grad((rq, rk), (qkv,), (dq, dk))
    ref = qkv.detach().double().requires_grad_()
    rq64 = _reference(ref[..., :H * D].view(B, N, H, D), cos, sin)
    rk64 = _reference(ref[..., H * D:(H + H_KV) * D].view(B, N, H_KV, D), cos, sin)
    (ref_d,) = torch.autograd.grad((rq64, rk64), (ref,), (dq.double(), dk.double()))
    assert _rel(dqkv, ref_d) < 1e-2


@gpu
def test_compiled_matches_eager():
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(2, 64, 8, 64, device="cuda", generator=g).to(bf16)
    cos, sin = _angles(64, 32, seed=6, device="cuda")
    dy = torch.randn_like(x)
    grads = []
    for fn in (rotary_embedding, torch.compile(rotary_embedding, fullgraph=True)):
        xx = x.clone().requires_grad_()
        y = fn(xx, cos, sin)
        grads.append((y, *torch.autograd.grad(y, (xx,), dy)))
    for e, c in zip(*grads):
        assert torch.equal(e, c)


@pytest.mark.parametrize("leading", [(), (1,)])
def test_a_longer_table_is_read_for_its_first_positions(interpret, leading):
    """A model's precomputed (max_pos, D/2) table, or (1, max_pos, D/2), as
    FlashAttention's apply_rotary_emb takes it: rows past N unread; q and k
    together too; gradients against float64."""
    B, N, H, D = 2, 5, 3, 32
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, N, H, D, generator=g).to(bf16).requires_grad_()
    cos, sin = _angles(*leading, 11, D // 2, seed=9)
    y = rotary_embedding(x, cos, sin)
    xd = x.detach().double().requires_grad_()
    ref = _reference(xd, cos.reshape(11, D // 2)[:N], sin.reshape(11, D // 2)[:N])
    assert _rel(y, ref) < 1e-2
    dy = torch.randn(y.shape, generator=g).to(bf16)
    (dx,) = torch.autograd.grad(y, x, dy)
    (ref_dx,) = torch.autograd.grad(ref, xd, dy.double())
    assert _rel(dx, ref_dx) < 1e-2
    rq, rk = rotary_embedding_qk(x.detach(), x.detach()[:, :, :1], cos, sin)
    assert _rel(rq, ref) < 1e-2 and _rel(rk, ref[:, :, :1]) < 1e-2
