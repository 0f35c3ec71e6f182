"""The library's Blackwell GEMM (tk_mlir/kernels/blackwell_gemm.py), checked
without the hardware: ptxas assembles every configuration the library
launches with no spills, nvdisasm shows the tensor-core instructions, and the
interpreter computes the products at shapes that are not multiples of the
tiles (bf16 both layouts of B; fp8 with row, column and per-tensor scales)
against float64. matmul and scaled_matmul route to it on a compute
capability 10.0 device. It has never run on a Blackwell GPU."""
from __future__ import annotations

import re

import pytest

import tk_mlir as tk
from tk_mlir.kernels import blackwell_gemm as bg, gemm, scaled_gemm
from tk_mlir.toolchain import find_tool

torch = pytest.importorskip("torch")
needs_nvdisasm = pytest.mark.skipif(find_tool("nvdisasm") is None or find_tool("ptxas") is None,
                                    reason="needs ptxas and nvdisasm")


def rel(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


@needs_nvdisasm
@pytest.mark.parametrize("dtype, b_kn, scaled, mma", [(tk.bf16, False, False, "UTCHMMA"),
                                                     (tk.f16, True, False, "UTCHMMA"),
                                                     (tk.f8e4m3, False, True, "UTCQMMA")])
def test_ptxas_assembles_each_configuration_without_spills(monkeypatch, dtype, b_kn, scaled,
                                                           mma):
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    M, N, K = 4096, 4096, 4096
    config = bg.configuration({tk.bf16: torch.bfloat16, tk.f16: torch.float16,
                               tk.f8e4m3: torch.float8_e4m3fn}[dtype])
    compiled = bg.blackwell_gemm_kernel.compile(
        tk.spec((M, K), dtype), tk.spec((K, N) if b_kn else (N, K), dtype),
        tk.spec((M, N), tk.bf16), tk.spec((M,), tk.f32), tk.spec((N,), tk.f32),
        B_KN=b_kn, SCALED=scaled, **config)
    assert compiled.arch == "sm_100a"
    assert compiled.info["spill stores (bytes)"] == 0
    assert compiled.info["spill loads (bytes)"] == 0
    sass = compiled.asm["sass"]
    for op in (mma, "UTCBAR", "LDTM"):
        assert re.search(rf"\b{op}\b", sass), op


@pytest.mark.parametrize("M, N, K, b_layout", [(200, 304, 176, "nk"), (136, 264, 120, "kn"),
                                               (128, 256, 64, "nk")])
def test_the_interpreter_computes_bf16_products_at_odd_shapes(interpret, M, N, K, b_layout):
    torch.manual_seed(M)
    a = torch.randn(M, K).bfloat16()
    b = torch.randn(N, K).bfloat16() if b_layout == "nk" else torch.randn(K, N).bfloat16()
    c = torch.full((M, N), float("nan")).bfloat16()
    bg.launch(a, b, c, b_layout)
    ref = a.double() @ (b.double().T if b_layout == "nk" else b.double())
    assert rel(c, ref) < 1e-2


@pytest.mark.parametrize("rowwise", [True, False])
def test_the_interpreter_computes_scaled_fp8_products(interpret, rowwise):
    torch.manual_seed(1)
    M, N, K = 160, 272, 256
    a = (torch.randn(M, K) * 2).to(torch.float8_e4m3fn)
    bt = (torch.randn(N, K) * 2).to(torch.float8_e5m2)
    sa = torch.rand(M, 1) + 0.5 if rowwise else torch.tensor(0.75)
    sb = torch.rand(1, N) + 0.5 if rowwise else torch.tensor(1.25)
    c = bg.launch_scaled(a, bt.t(), sa, sb, torch.float32)
    ref = (a.double() @ bt.double().T) * sa.double() * sb.double()
    assert rel(c, ref) < 1e-5


def test_matmul_and_scaled_matmul_route_to_it_on_blackwell(monkeypatch, interpret):
    """On a capability 10.0 device (here: CPU tensors in the interpreter,
    with the device check answering Blackwell) the library launches the
    sm_100a kernel: plain, scaled, batched, and the gradients' products."""
    calls = []
    for module in (gemm, scaled_gemm):
        monkeypatch.setattr(module, "is_blackwell", lambda device: True)
    for name in ("launch", "launch_scaled"):
        real = getattr(bg, name)
        monkeypatch.setattr(bg, name, lambda *args, _real=real, _name=name, **kw:
                            calls.append(_name) or _real(*args, **kw))
    a, b = torch.randn(96, 64).bfloat16(), torch.randn(80, 64).bfloat16()
    c = tk_matmul(a, b)
    assert calls == ["launch"] and rel(c, a.double() @ b.double().T) < 1e-2
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    out = scaled_gemm.scaled_matmul(a8, b8.t(), one, one, torch.float32)
    assert calls == ["launch", "launch_scaled"]
    assert rel(out, a8.double() @ b8.double().T) < 1e-5
    # a batch, and the gradients (dB reads a as K x M) go there too
    a3 = torch.randn(2, 96, 64).bfloat16().requires_grad_()
    b3 = torch.randn(2, 80, 64).bfloat16().requires_grad_()
    c3 = tk_matmul(a3, b3)
    assert rel(c3, a3.double() @ b3.double().transpose(1, 2)) < 1e-2
    g = torch.randn_like(c3)
    da, db = torch.autograd.grad(c3, (a3, b3), g)
    assert rel(da, g.double() @ b3.double()) < 1e-2
    assert rel(db, g.double().transpose(1, 2) @ a3.double()) < 1e-2
    assert calls.count("launch") >= 4


def tk_matmul(a, b):
    from tk_mlir.kernels import matmul
    return matmul(a, b)


def test_empty_products_launch_nothing(interpret):
    """K = 0 is a sum of no products (zeros, as on Hopper); M or N = 0 has
    nothing to write. Neither reaches the kernel (whose TMA needs rows)."""
    c = torch.full((64, 32), float("nan")).bfloat16()
    bg.launch(torch.empty(64, 0).bfloat16(), torch.empty(32, 0).bfloat16(), c, "nk")
    assert (c == 0).all()
    bg.launch(torch.empty(0, 16).bfloat16(), torch.empty(32, 16).bfloat16(),
              torch.empty(0, 32).bfloat16(), "nk")


@needs_nvdisasm
def test_ptxas_assembles_the_batched_and_transposed_a_forms(monkeypatch):
    """dB's product (A given as K x M, B as K x N) over a batch of 4."""
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    compiled = bg.blackwell_gemm_kernel.compile(
        tk.spec((4, 2048, 1024), tk.bf16), tk.spec((4, 2048, 512), tk.bf16),
        tk.spec((4, 1024, 512), tk.bf16), tk.spec((4,), tk.f32), tk.spec((4,), tk.f32),
        B_KN=True, A_KM=True)
    assert compiled.info["spill stores (bytes)"] == 0
    assert re.search(r"\bUTCHMMA\b", compiled.asm["sass"])


@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_the_interpreter_computes_transposed_a_products(interpret, b_layout):
    """A given as K x M (gradients' dB): C = A.T @ B(.T) at odd shapes."""
    torch.manual_seed(7)
    K, M, N = 136, 200, 144
    a = torch.randn(K, M).bfloat16()
    b = torch.randn(N, K).bfloat16() if b_layout == "nk" else torch.randn(K, N).bfloat16()
    c = torch.full((M, N), float("nan")).bfloat16()
    bg.launch(a, b, c, b_layout, a_layout="km")
    ref = a.double().T @ (b.double().T if b_layout == "nk" else b.double())
    assert rel(c, ref) < 1e-2
