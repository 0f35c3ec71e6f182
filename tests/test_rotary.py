"""rotary_embedding (tk_mlir/kernels/rotary.py): GPT-NeoX rotary embeddings
on (B, N, H, D), forward and backward.

Without a GPU: the kernel in the interpreter against float64 (a head count
that is not a power of two, per-sequence angles, the inverse rotation), the
argument rules, the op's fake. With one (`-m gpu`): eager and compiled
autograd on strided q/k views of a projection against float64.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

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


def _angles(*shape, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.rand(*shape, generator=g, device=device) * 6.3
    return a.cos(), a.sin()


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
    (lambda x, c: rotary_embedding(x, c[:3], c[:3]), ValueError, r"cos must have shape \(5, 16\) "
                                                                 r"or \(2, 5, 16\)"),
    (lambda x, c: rotary_embedding(x, c, c.double()), TypeError, r"sin must be "),
    (lambda x, c: rotary_embedding(x, c, c), ValueError, r"rotary_embedding: x must be on a "
                                                         r"CUDA device"),
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
