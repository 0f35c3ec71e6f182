"""matmul's gradients (tk_mlir/kernels/gemm.py: grad_a, grad_b): dA and dB as
GEMMs of their own, the transposed operand read as K x M by the kernel
(A_KM), never copied.

Without a GPU: the A_KM kernels in the interpreter against float64, for both
layouts of B, the tile shapes the plan takes and edges that are not the
tile's; their PTX (transposed-A wgmma, no spills, no ptxas advisories); the
ops' fake implementations. With one (`-m gpu`): eager autograd,
torch.compile(fullgraph=True) and opcheck against float64 references.
"""
from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import tk_mlir as tk  # noqa: E402
from tk_mlir.kernels import matmul  # noqa: E402

from torch_reference import relative_error as _rel  # noqa: E402

bf16 = torch.bfloat16
gpu = pytest.mark.gpu


# ------------------------------------------------------ without a GPU

@pytest.mark.parametrize("m, n, k, b_kn, bm", [(200, 136, 96, False, 128), (64, 128, 128, True, 64),
                                               (136, 72, 64, True, 128), (72, 200, 136, False, 64)])
def test_a_given_as_k_by_m_in_the_interpreter(m, n, k, b_kn, bm):
    from tk_mlir.kernels.gemm import gemm_kernel
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(k, m, generator=g).to(bf16)
    b = torch.randn(*((k, n) if b_kn else (n, k)), generator=g).to(bf16)
    c = torch.full((m, n), float("nan"), dtype=bf16)
    gemm_kernel.kernel.interpret[(3,)](a, b, c, B_KN=b_kn, A_KM=True, BM=bm, BN=128, STAGES=2,
                                       num_warps=4 * (bm // 64 + 1))
    ref = a.double().T @ (b.double() if b_kn else b.double().T)
    assert _rel(c, ref) < 1e-2


def test_split_k_with_a_given_as_k_by_m_in_the_interpreter():
    from tk_mlir.kernels.gemm import gemm_split_k_kernel, split_k_counters
    g = torch.Generator().manual_seed(7)
    m, n, k = 40, 128, 512
    a, b = torch.randn(k, m, generator=g).to(bf16), torch.randn(k, n, generator=g).to(bf16)
    c = torch.full((m, n), float("nan"))
    w, f = torch.zeros(m, n), torch.zeros(split_k_counters(m, n, 128), dtype=torch.int32)
    gemm_split_k_kernel.interpret[(4,)](a, b, c, w, f, SPLIT_K=2, B_KN=True, A_KM=True)
    assert _rel(c, a.double().T @ b.double()) < 1e-5
    assert not w.any() and not f.any()                  # left zeros for the next launch


@pytest.mark.parametrize("b_kn", [False, True])
def test_a_km_ptx_reads_a_transposed_without_spills(b_kn):
    from tk_mlir.kernels.gemm import gemm_kernel
    s = tk.spec((4096, 4096), tk.bf16)
    c = gemm_kernel.kernel.compile(s, s, s, B_KN=b_kn, A_KM=True, BN=256, STAGES=4, EPI_N=64,
                                   EPI_BUFFERS=2)
    # wgmma's A from shared memory, transposed: imm-trans-a = 1 (B: 1 when given as K x N)
    wgmmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16[^;]*"
                        r"p, 1,\s*1, (\d),\s*(\d);", c.asm["ptx"])
    assert wgmmas and set(wgmmas) == {("1", "1" if b_kn else "0")}
    assert c.info["spill stores (bytes)"] == 0
    assert "C75" not in c.ptxas_log, c.ptxas_log


def test_gradient_ops_fake_shapes():
    import tk_mlir.kernels.custom_ops  # noqa: F401
    with FakeTensorMode():
        dc = torch.empty(3, 100, 48, dtype=bf16, device="cuda")
        a = torch.empty(3, 100, 64, dtype=bf16, device="cuda")
        for layout, b_shape, db_shape in (("nk", (3, 48, 64), (3, 48, 64)),
                                          ("kn", (3, 64, 48), (3, 64, 48))):
            b = torch.empty(*b_shape, dtype=bf16, device="cuda")
            assert torch.ops.tk_mlir.matmul_grad_a(dc, b, layout).shape == a.shape
            assert torch.ops.tk_mlir.matmul_grad_b(dc, a, layout).shape == db_shape


# ------------------------------------------------------------ on the GPU

def _inputs(shape_a, shape_b, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.rand(*s, device="cuda", generator=g) * 2 - 1).to(bf16)
            for s in (shape_a, shape_b)]


def _reference(a, b, dc, layout):
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    c = a64 @ (b64.mT if layout == "nk" else b64)
    return torch.autograd.grad(c, (a64, b64), dc.double())


@gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("m, n, k", [(256, 512, 384), (1000, 776, 520), (16, 4096, 4096),
                                     (4096, 1024, 8)])
def test_eager_gradients_match_float64(layout, m, n, k):
    a, b = _inputs((m, k), (n, k) if layout == "nk" else (k, n), seed=m + n + k)
    a.requires_grad_(), b.requires_grad_()
    c = matmul(a, b, b_layout=layout)
    dc = (torch.rand_like(c, dtype=torch.float32) * 2 - 1).to(bf16)
    da, db = torch.autograd.grad(c, (a, b), dc)
    ref_a, ref_b = _reference(a, b, dc, layout)
    assert da.shape == a.shape and db.shape == b.shape and db.dtype == bf16
    assert _rel(da, ref_a) < 1e-2 and _rel(db, ref_b) < 1e-2


@gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_batched_gradients_and_one_input(layout):
    g, m, n, k = 3, 200, 136, 264
    a, b = _inputs((g, m, k), (g, n, k) if layout == "nk" else (g, k, n), seed=4)
    b.requires_grad_()
    c = matmul(a, b, b_layout=layout)
    (db,) = torch.autograd.grad(c.float().sum(), (b,))            # an expanded f32 dC
    ref = _reference(a, b, torch.ones(g, m, n, device="cuda"), layout)[1]
    assert _rel(db, ref) < 1e-2


@gpu
def test_c_is_refused_where_autograd_records():
    a, b = _inputs((64, 64), (64, 64), seed=1)
    with pytest.raises(RuntimeError, match=r"matmul: c \(the output to write into\) does not"):
        matmul(a.requires_grad_(), b, torch.empty(64, 64, device="cuda", dtype=bf16))


@gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_compiled_gradients_match_eager(layout):
    a, b = _inputs((300, 256), (136, 256) if layout == "nk" else (256, 136), seed=9)
    dc = _inputs((300, 136), (1, 1), seed=10)[0]

    def f(a, b):
        return matmul(a, b, b_layout=layout)

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(x, y), (x, y), dc))
    for e, c in zip(*grads):
        assert torch.equal(e, c)          # the same kernels on the same inputs


@gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_opcheck_matmul_with_autograd(layout):
    import tk_mlir.kernels.custom_ops  # noqa: F401
    a, b = _inputs((200, 64), (136, 64) if layout == "nk" else (64, 136), seed=2)
    torch.library.opcheck(torch.ops.tk_mlir.matmul.default,
                          (a.requires_grad_(), b.requires_grad_(), layout, None),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


# ------------------------------------------------- accumulating into C

@pytest.mark.parametrize("m, n, k, b_kn, a_km", [(200, 136, 96, False, False),
                                                 (136, 256, 64, True, True),
                                                 (72, 200, 136, False, True)])
def test_accumulate_adds_the_product_into_c_in_the_interpreter(m, n, k, b_kn, a_km):
    """ACCUMULATE: C += A·B by TMA reduce-add, C's earlier values kept, the
    edges past M and N untouched."""
    from tk_mlir.kernels.gemm import gemm_kernel
    g = torch.Generator().manual_seed(m * n + k)
    a = torch.randn(*((k, m) if a_km else (m, k)), generator=g).to(bf16)
    b = torch.randn(*((k, n) if b_kn else (n, k)), generator=g).to(bf16)
    c0 = torch.randn(m, n, generator=g).to(bf16)
    c = c0.clone()
    gemm_kernel.kernel.interpret[(3,)](a, b, c, B_KN=b_kn, A_KM=a_km, ACCUMULATE=True, BM=128,
                                       BN=128, STAGES=2)
    ad, bd = (a.double().T if a_km else a.double()), (b.double() if b_kn else b.double().T)
    assert _rel(c, c0.double() + ad @ bd) < 1e-2


@pytest.mark.parametrize("m, n, k", [(130, 72, 40), (64, 4104, 96), (24, 40, 250), (16, 16, 0),
                                     (16, 128, 4096)])
def test_launch_accumulate_on_every_plan(interpret, m, n, k):
    """gemm.launch(..., accumulate=True) on the plan's kernels (tiles, split-K
    taken unsplit, padded rows through a buffer that starts as c, K = 0
    adding nothing): c + a·bᵀ."""
    from tk_mlir.kernels import gemm
    g = torch.Generator().manual_seed(m + n + k)
    a, b = torch.randn(m, k, generator=g).to(bf16), torch.randn(n, k, generator=g).to(bf16)
    c0 = torch.randn(m, n, generator=g).to(bf16)
    c = c0.clone()
    gemm.launch(a, b, c, "nk", accumulate=True)
    assert _rel(c, c0.double() + a.double() @ b.double().T) < 1e-2


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_launch_accumulate_batched(interpret, layout):
    """A batch of products, each added into its own c (the outer coordinate
    of the TMA reduce-add)."""
    from tk_mlir.kernels import gemm
    g = torch.Generator().manual_seed(3)
    G, m, n, k = 3, 130, 72, 40
    a = torch.randn(G, m, k, generator=g).to(bf16)
    b = torch.randn(G, *((n, k) if layout == "nk" else (k, n)), generator=g).to(bf16)
    c0 = torch.randn(G, m, n, generator=g).to(bf16)
    c = c0.clone()
    gemm.launch(a, b, c, layout, accumulate=True)
    bd = b.double().mT if layout == "nk" else b.double()
    assert _rel(c, c0.double() + a.double() @ bd) < 1e-2


def test_accumulate_refuses_an_f32_c(interpret):
    from tk_mlir.kernels import gemm
    from tk_mlir.kernels.gemm import gemm_kernel
    s, c = tk.spec((256, 256), tk.bf16), tk.spec((256, 256), tk.f32)
    with pytest.raises(tk.CompilationError, match="ACCUMULATE adds by TMA store pieces"):
        gemm_kernel.kernel.compile(s, s, c, ACCUMULATE=True)
    a = torch.randn(16, 0).to(bf16)                    # (even K = 0, which adds nothing)
    with pytest.raises(TypeError, match="accumulate=True adds into a 16-bit c"):
        gemm.launch(a, torch.randn(16, 0).to(bf16), torch.zeros(16, 16), "nk", accumulate=True)


def test_accumulate_ptx_adds_by_tma_reduce():
    from tk_mlir.kernels.gemm import gemm_kernel
    s = tk.spec((4096, 4096), tk.bf16)
    c = gemm_kernel.kernel.compile(s, s, s, B_KN=True, A_KM=True, ACCUMULATE=True, BN=256,
                                   STAGES=4, EPI_N=64, EPI_BUFFERS=2)
    ptx = c.asm["ptx"]
    assert "cp.reduce.async.bulk.tensor" in ptx and ".add" in ptx
    assert "cp.async.bulk.tensor.2d.global.shared" not in ptx        # no plain stores of C
    assert c.info["spill stores (bytes)"] == 0


@gpu
@pytest.mark.parametrize("m, n, k, a_km", [(4096, 2048, 256, True), (256, 4096, 8192, False),
                                           (1000, 776, 520, True)])
def test_launch_accumulate_on_the_gpu(m, n, k, a_km):
    """gemm.launch(..., accumulate=True) three times into one c (the
    autotuned kernel's tuned config, the split-K plan unsplit, padded
    edges): c0 + 3·a·b by TMA reduce-add in bf16."""
    from tk_mlir.kernels import gemm
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(*((k, m) if a_km else (m, k)), device="cuda", generator=g).to(bf16)
    b = torch.randn(k, n, device="cuda", generator=g).to(bf16)
    c0 = torch.randn(m, n, device="cuda", generator=g).to(bf16)
    c = c0.clone()
    for _ in range(3):
        gemm.launch(a, b, c, "kn", a_layout="km" if a_km else "mk", accumulate=True)
    ad = a.double().T if a_km else a.double()
    assert _rel(c, c0.double() + 3 * ad @ b.double()) < 1e-2
