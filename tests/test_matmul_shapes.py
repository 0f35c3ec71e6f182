"""matmul (and grouped_matmul) at any M, N, K (issue 26): operands whose rows are not whole
16-byte vectors (K or N not a multiple of 8 for 16-bit types, views that
start mid-vector) go through zero-padded copies, and the result through a
padded buffer; checked in the interpreter against float64, gradients too."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tk_mlir.kernels import gemm, matmul  # noqa: E402


def rel(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("M, N, K, b_layout", [(37, 257, 250, "nk"), (70, 131, 90, "kn"),
                                               (64, 128, 250, "kn"), (33, 100, 64, "nk")])
def test_ragged_shapes(interpret, M, N, K, b_layout):
    torch.manual_seed(M + N + K)
    a = torch.randn(M, K).bfloat16()
    b = torch.randn(N, K).bfloat16() if b_layout == "nk" else torch.randn(K, N).bfloat16()
    c = matmul(a, b, b_layout=b_layout)
    assert c.shape == (M, N) and c.dtype == torch.bfloat16
    ref = a.double() @ (b.double().T if b_layout == "nk" else b.double())
    assert rel(c, ref) < 1e-2


def test_a_given_output_with_ragged_rows_is_written_in_place(interpret):
    a, b = torch.randn(48, 250).half(), torch.randn(257, 250).half()
    c = torch.full((48, 257), float("nan"))
    out = matmul(a, b, c)
    assert out is c and rel(c, a.double() @ b.double().T) < 1e-3


def test_a_view_that_starts_mid_vector(interpret):
    big = torch.randn(64, 264).bfloat16()
    a = big[:, 1:257]                                   # 2 bytes past a 16-byte boundary
    b = torch.randn(128, 256).bfloat16()
    assert gemm.padded_rows(a) is not a and gemm.padded_rows(b) is b
    assert rel(matmul(a, b), a.double() @ b.double().T) < 1e-2


def test_a_batch_with_ragged_k(interpret):
    a, b = torch.randn(2, 40, 250).bfloat16(), torch.randn(2, 72, 250).bfloat16()
    assert rel(matmul(a, b), a.double() @ b.double().transpose(1, 2)) < 1e-2


@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_gradients_at_ragged_shapes(interpret, b_layout):
    """dA and dB are GEMMs of their own, with dC (M x N, N = 130) and A read
    K x M (M = 50): both pad."""
    torch.manual_seed(3)
    a = torch.randn(50, 90).bfloat16().requires_grad_()
    b = (torch.randn(130, 90) if b_layout == "nk" else torch.randn(90, 130)).bfloat16()
    b.requires_grad_()
    c = matmul(a, b, b_layout=b_layout)
    g = torch.randn_like(c)
    da, db = torch.autograd.grad(c, (a, b), g)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    c64 = a64 @ (b64.T if b_layout == "nk" else b64)
    da64, db64 = torch.autograd.grad(c64, (a64, b64), g.double())
    assert rel(da, da64) < 1e-2 and rel(db, db64) < 1e-2


@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_grouped_matmul_at_ragged_shapes(interpret, b_layout):
    """K = 90 and N = 130: the experts' products and their gradients."""
    from tk_mlir.kernels import grouped_matmul
    torch.manual_seed(5)
    G, M, N, K = 3, 70, 130, 90
    a = torch.randn(G, M, K).bfloat16().requires_grad_()
    b = (torch.randn(G, N, K) if b_layout == "nk" else torch.randn(G, K, N)).bfloat16()
    b.requires_grad_()
    sizes = [70, 33, 0]
    c = grouped_matmul(a, b, sizes, b_layout=b_layout)
    bt = b.detach().double() if b_layout == "kn" else b.detach().double().transpose(1, 2)
    for g, s in enumerate(sizes):
        if s:
            assert rel(c[g, :s], a.detach()[g, :s].double() @ bt[g]) < 1e-2
    g_c = torch.randn_like(c)
    da, db = torch.autograd.grad(c, (a, b), g_c)
    # (a product's rows up to its tile end, sizes[g] rounded up to 128 and at
    # most M, are computed and take gradients: grouped_gemm.grouped_grads)
    ends = [min(-(-s // 128) * 128, M) for s in sizes]
    kept = torch.arange(M)[None, :, None] < torch.tensor(ends)[:, None, None]
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    c64 = a64 @ (b64 if b_layout == "kn" else b64.transpose(1, 2))
    da64, db64 = torch.autograd.grad(c64, (a64, b64), torch.where(kept, g_c.double(), 0))
    assert rel(da * kept, da64) < 1e-2 and rel(db, db64) < 1e-2
