"""swiglu (tk_mlir/kernels/activations.py): silu(gate) * up, forward and backward.

Without a GPU: both kernels in the interpreter against float64 (edges that
are not the tile's, large |gate| where exp overflows), the argument rules,
the op's fake. With one (`-m gpu`): eager and compiled autograd against
float64, on strided halves of a fused gate/up projection.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from tk_mlir.kernels import swiglu  # noqa: E402

from torch_reference import relative_error as _rel  # noqa: E402

bf16 = torch.bfloat16
gpu = pytest.mark.gpu


def _reference(gate, up, dy):
    g, u = (t.detach().double().requires_grad_() for t in (gate, up))
    y = torch.nn.functional.silu(g) * u
    return (y, *torch.autograd.grad(y, (g, u), dy.double()))


def test_kernels_in_the_interpreter():
    from tk_mlir.kernels import activations
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(45, 264, generator=g) * 4).to(bf16)        # 45 x 264: ragged tiles
    gate[0, :8] = torch.tensor([-200.0, -90.0, -30.0, 0.0, 30.0, 90.0, 200.0, 1.0])
    up, dy = (torch.randn(45, 264, generator=g).to(bf16) for _ in range(2))
    y, dg, du = (torch.full_like(gate, float("nan")) for _ in range(3))
    grid, nj = activations._grid(*gate.shape)          # 3 row tiles x 2 column tiles
    assert grid == (6,) and nj == 2
    activations.swiglu_kernel.interpret[grid](gate, up, y, nj)
    activations.swiglu_backward_kernel.interpret[grid](gate, up, dy, dg, du, nj)
    ref_y, ref_dg, ref_du = _reference(gate, up, dy)
    for got, ref in ((y, ref_y), (dg, ref_dg), (du, ref_du)):
        assert not got.isnan().any() and _rel(got, ref) < 1e-2


@pytest.mark.parametrize("call, error, rule", [
    (lambda g: swiglu(g, g.float()), TypeError, r"swiglu: up must be torch.bfloat16 or "),
    (lambda g: swiglu(g, g[:2]), ValueError, r"swiglu: up must have shape \(4, 16\)"),
    (lambda g: swiglu(g[:, :12], g[:, :12]), ValueError, r"swiglu: the last dim must be a "
                                                         r"multiple of 8"),
    (lambda g: swiglu(g, g), ValueError, r"swiglu: gate must be on a CUDA device"),
])
def test_argument_rules(call, error, rule):
    with pytest.raises(error, match=rule):
        call(torch.randn(4, 16).to(bf16))


def test_fake():
    import tk_mlir.kernels.custom_ops  # noqa: F401
    with FakeTensorMode():
        g = torch.empty(2, 7, 64, dtype=bf16, device="cuda")
        assert torch.ops.tk_mlir.swiglu(g, g).shape == (2, 7, 64)
        assert [t.shape for t in torch.ops.tk_mlir.swiglu_backward(g, g, g)] == [g.shape] * 2


@gpu
@pytest.mark.parametrize("shape", [(4, 333, 1408), (1, 14336), (2048, 8)])
def test_eager_forward_and_gradients_on_projection_halves(shape):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    gate_up = ((torch.rand(*shape[:-1], 2 * shape[-1], device="cuda", generator=g) * 8 - 4)
               .to(bf16).requires_grad_())
    gate, up = gate_up.chunk(2, dim=-1)                 # strided views
    dy = (torch.rand(shape, device="cuda", generator=g) * 2 - 1).to(bf16)
    y = swiglu(gate, up)
    (dgu,) = torch.autograd.grad(y, (gate_up,), dy)
    ref_y, ref_dg, ref_du = _reference(gate, up, dy)
    assert _rel(y, ref_y) < 1e-2
    assert _rel(dgu, torch.cat((ref_dg, ref_du), -1)) < 1e-2
    with torch.no_grad():
        assert torch.equal(swiglu(gate, up), y)


@gpu
def test_compiled_matches_eager():
    g = torch.Generator(device="cuda").manual_seed(3)
    gate, up, dy = ((torch.rand(300, 512, device="cuda", generator=g) * 4 - 2).to(bf16)
                    for _ in range(3))
    grads = []
    for fn in (swiglu, torch.compile(swiglu, fullgraph=True)):
        x, w = gate.clone().requires_grad_(), up.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(x, w), (x, w), dy))
    for e, c in zip(*grads):
        assert torch.equal(e, c)
