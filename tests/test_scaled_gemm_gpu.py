"""fp8 on the GPU: one wgmma k32 tile for every e4m3/e5m2 pair, and
scaled_matmul (tk_mlir.kernels.scaled_gemm) against a float64 product of the
dequantized inputs and against torch._scaled_mm itself, at square, skinny and
odd shapes, per-tensor and rowwise scales, bf16 and f32 outputs, fresh random
inputs, poisoned outputs where the test owns them.

Tolerances: the products of fp8 values are exact in f32, but wgmma's fp8
accumulation keeps fewer bits than f32 (about 14, as DeepSeek-V3 measured on
Hopper), and the kernel accumulates in wgmma only, as
torch._scaled_mm(use_fast_accum=True) does: the error against float64 is set
by the hardware, a few 1e-3 at K = 4096 by that estimate. The tolerances
below leave room for it and still catch a misplaced tile, operand or scale
(errors of order 1); the test against torch._scaled_mm holds the kernel to
cuBLASLt's own error on the same inputs."""
import pytest

torch = pytest.importorskip("torch")

from tk_mlir.kernels import scaled_matmul  # noqa: E402
from tk_mlir.kernels.device import num_sms  # noqa: E402
from tk_mlir.kernels.scaled_gemm import scaled_gemm_kernel  # noqa: E402

pytestmark = pytest.mark.gpu

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
OUT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
SHAPES = [(4096, 4096, 4096), (256, 4096, 4096), (1000, 1000, 512), (1537, 776, 1312),
          (8, 4096, 1024), (128, 256, 16)]
ids = lambda s: "x".join(map(str, s))  # noqa: E731
TILE_TOL = 5e-3      # one tile, K <= 256: fp8 accumulation only


def tol(K: int) -> float:
    """bf16 rounding of C (~1.1e-3) and fp8 accumulation, which grows with K:
    ~1.2e-2 at K = 4096."""
    return 2e-3 + 2.5e-6 * K


def rel_err(got, ref) -> float:
    assert not got.isnan().any(), "an output element was not written"
    return ((got.double() - ref).norm() / ref.norm()).item()


def fp8(*shape, dtype="e4m3"):
    """Normal values quantized to fp8 (well inside either format's range)."""
    return (torch.randn(*shape, device="cuda") * 2).to(FP8[dtype])


def scales(M, N, rowwise):
    if rowwise:
        return (torch.rand(M, 1, device="cuda") + 0.5, torch.rand(1, N, device="cuda") + 0.5)
    return torch.rand((), device="cuda") + 0.5, torch.rand(1, device="cuda") + 0.5


def reference(a, b, sa, sb):
    return (a.double() @ b.double()) * sa.double() * sb.double()


# --------------------------------------------------------- one wgmma tile

def test_every_fp8_pair_in_one_tile():
    from test_fp8 import mma_fp8
    # (One warpgroup holds at most 128 f32 accumulator registers per thread: M x N <= 16384.)
    for (M, N, K) in [(64, 64, 128), (64, 256, 256), (128, 128, 256), (64, 16, 128)]:
        for da in FP8:
            for db in FP8:
                a, bt = fp8(M, K, dtype=da), fp8(N, K, dtype=db)
                c = torch.full((M, N), float("nan"), device="cuda")
                mma_fp8[(1,)](a, bt, c, M=M, N=N, K=K)
                assert rel_err(c, a.double() @ bt.double().T) < TILE_TOL, (M, N, K, da, db)


# ---------------------------------------------------------- scaled_matmul

@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("out", ["bf16", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_scaled_matmul_against_float64(shape, out, rowwise):
    M, N, K = shape
    a, b = fp8(M, K), fp8(N, K).t()
    sa, sb = scales(M, N, rowwise)
    c = scaled_matmul(a, b, sa, sb, out_dtype=OUT[out])
    assert c.shape == (M, N) and c.dtype == OUT[out] and c.is_contiguous()
    assert rel_err(c, reference(a, b, sa, sb)) < tol(K)


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_scaled_matmul_f16_out(rowwise):
    M, N, K = 1537, 776, 1312
    a, b = fp8(M, K), fp8(N, K).t()
    sa, sb = scales(M, N, rowwise)
    c = scaled_matmul(a, b, sa, sb, out_dtype=torch.float16)
    assert c.dtype == torch.float16 and rel_err(c, reference(a, b, sa, sb)) < tol(K)


@pytest.mark.parametrize("dtypes", [("e5m2", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e5m2")],
                         ids="-".join)
@pytest.mark.parametrize("shape", [(1000, 1000, 512), (256, 4096, 4096)], ids=ids)
def test_scaled_matmul_e5m2(shape, dtypes):
    M, N, K = shape
    a, b = fp8(M, K, dtype=dtypes[0]), fp8(N, K, dtype=dtypes[1]).t()
    sa, sb = scales(M, N, rowwise=True)
    assert rel_err(scaled_matmul(a, b, sa, sb), reference(a, b, sa, sb)) < tol(K)


@pytest.mark.parametrize("mixed", ["tensor_a", "tensor_b"])
def test_scaled_matmul_one_scale_per_tensor_one_rowwise(mixed):
    """Beyond torch._scaled_mm: each scale per tensor or rowwise on its own."""
    M, N, K = 777, 512, 256
    a, b = fp8(M, K), fp8(N, K).t()
    (ra, rb), (ta, tb) = scales(M, N, True), scales(M, N, False)
    sa, sb = (ta, rb) if mixed == "tensor_a" else (ra, tb)
    assert rel_err(scaled_matmul(a, b, sa, sb, out_dtype=torch.float32),
                   reference(a, b, sa, sb)) < tol(K)


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (256, 4096, 4096), (8192, 8192, 8192),
                                   (1024, 1536, 2048)], ids=ids)
def test_scaled_matmul_against_torch_scaled_mm(shape, rowwise):
    """cuBLASLt on the same inputs: the kernel's error against float64 is
    within a small factor of cuBLASLt's with fast accumulation (the same
    accumulation in wgmma); cuBLASLt's default (partial sums promoted to f32)
    is printed beside it."""
    M, N, K = shape
    a, b = fp8(M, K), fp8(N, K).t()
    sa, sb = scales(M, N, rowwise)
    ref = reference(a, b, sa, sb)
    ours = scaled_matmul(a, b, sa, sb, out_dtype=torch.bfloat16)
    theirs = {fast: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
              for fast in (False, True)}
    err, err_fast, err_exact = (rel_err(c, ref) for c in (ours, theirs[True], theirs[False]))
    print(f"rel. error vs float64: tk_mlir {err:.2e}, cuBLASLt fast {err_fast:.2e}, "
          f"cuBLASLt default {err_exact:.2e}")
    assert err <= 2 * err_fast + 1e-3, (err, err_fast, err_exact)


@pytest.mark.parametrize("config", [dict(BN=256, STAGES=4), dict(BN=256, STAGES=4, GROUP_M=16),
                                    dict(BN=128, STAGES=6), dict(STAGES=3, GROUP_M=1)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("out", ["bf16", "f32"])
def test_every_config_writes_every_element(config, out):
    """The kernel itself, each autotune config, into a NaN-poisoned C."""
    M, N, K = 1537, 776, 1312
    a, bt = fp8(M, K), fp8(N, K)
    sa, sb = torch.rand(1540, device="cuda") + 0.5, torch.rand(N, device="cuda") + 0.5
    c = torch.full((M, N), float("nan"), dtype=OUT[out], device="cuda")
    scaled_gemm_kernel.kernel[(num_sms(),)](a, bt, c, sa, sb, **config)
    ref = (a.double() @ bt.double().T) * sa[:M, None].double() * sb[None, :].double()
    assert rel_err(c, ref) < tol(K)


def test_empty_and_zero_k():
    sa = torch.ones((), device="cuda")
    a, b = fp8(0, 32), fp8(16, 32).t()
    assert scaled_matmul(a, b, sa, sa).shape == (0, 16)
    a, b = fp8(8, 0), fp8(16, 0).t()
    c = scaled_matmul(a, b, sa, sa)
    assert c.shape == (8, 16) and (c == 0).all()


def test_under_torch_compile_and_opcheck():
    import tk_mlir.kernels.custom_ops  # noqa: F401
    M, N, K = 300, 256, 512
    a, b = fp8(M, K), fp8(N, K).t()
    sa, sb = scales(M, N, rowwise=True)
    compiled = torch.compile(lambda *x: scaled_matmul(*x), fullgraph=True)
    assert torch.equal(compiled(a, b, sa, sb), scaled_matmul(a, b, sa, sb))
    # Not test_schema: its checking mode multiplies the fp8 inputs, which torch's
    # CUDA fp8 tensors do not implement ("mul_cuda" not implemented for
    # 'Float8_e4m3fn', torch 2.13).
    torch.library.opcheck(torch.ops.tk_mlir.scaled_matmul.default,
                          (a, b, sa, sb, torch.bfloat16),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
