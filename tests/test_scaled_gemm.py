"""The fp8 GEMM (tk_mlir.kernels.scaled_gemm) without a GPU: its PTX (wgmma
k32 on e4m3/e5m2, TMA, setmaxnreg), the ptxas report (no spills, no wgmma
serialization), and scaled_matmul's argument checks, which run before
anything reaches the GPU, so CPU tensors show them. Numerics on the GPU:
test_scaled_gemm_gpu.py."""
import importlib
import re

import pytest

import tk_mlir as tk
from tk_mlir.toolchain import find_tool

# The module (the package's name `scaled_matmul` is the function).
scaled_gemm = importlib.import_module("tk_mlir.kernels.scaled_gemm")
PTX_TYPE = {"f8e4m3": "e4m3", "f8e5m2": "e5m2"}
HAS_NVDISASM = find_tool("nvdisasm") is not None


def compile_kernel(a="f8e4m3", b="f8e4m3", out="bf16", col_scale=True, config=0,
                   M=384, N=512, K=640):
    return scaled_gemm.scaled_gemm_kernel.compile(
        tk.spec((M, K), a), tk.spec((N, K), b), tk.spec((M, N), out), tk.spec((M,), "f32"),
        tk.spec((N,) if col_scale else (), "f32"), config=config)


@pytest.fixture(scope="module", params=[("f8e4m3", "f8e4m3", "bf16", True, 0),
                                        ("f8e4m3", "f8e5m2", "f32", True, 0),
                                        ("f8e5m2", "f8e4m3", "bf16", False, 2)],
                ids=lambda p: "-".join(map(str, p)))
def kernel(request, tmp_path_factory):
    a, b, out, col_scale, config = request.param
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TK_MLIR_CACHE_DIR", str(tmp_path_factory.mktemp("fp8-cache")))
        return request.param, compile_kernel(a, b, out, col_scale, config)


def test_ptx_has_fp8_wgmma_tma_and_warp_specialization(kernel):
    (a, b, out, col_scale, config), compiled = kernel
    ptx = compiled.asm["ptx"]
    bn = 128 if config == 2 else 256
    wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx))
    assert wgmma == {f"m64n{bn}k32.f32.{PTX_TYPE[a]}.{PTX_TYPE[b]}"}
    # BK = 128 bytes of K per stage: four k32 wgmmas per group (LLVM may
    # duplicate the loop body, so count per group).
    groups = re.findall(r"wgmma\.fence\.sync\.aligned;(.*?)wgmma\.commit_group", ptx, re.S)
    assert groups and all(g.count("wgmma.mma_async") == 4 for g in groups)
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx
    # Each stage expects its A (128 x 128) and B (BN x 128) bytes.
    assert re.search(rf"mov\.b32\s+%r\d+, {128 * 128 + bn * 128};", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40", ptx)
    # Operand boxes: 128 one-byte columns (a 128-byte swizzled row) by the tile's rows.
    maps = sorted(compiled.tensor_maps)
    assert maps[:2] == [(0, 128, 128, 128, a), (1, bn, 128, 128, b)]
    stores = ptx.count("cp.async.bulk.tensor.2d.global.shared::cta")
    assert (stores > 0) == (out == "bf16") == (len(maps) == 3)


def test_ptxas_no_spills_no_serialization(kernel):
    _, compiled = kernel
    info, log = compiled.info, compiled.ptxas_log
    assert info["spill stores (bytes)"] == 0 and info["spill loads (bytes)"] == 0, log
    assert "C75" not in log, log      # setmaxnreg ignored (C7508), wgmma serialized (C7514), ...
    assert info["dynamic shared memory (bytes)"] <= 227 * 1024


@pytest.mark.skipif(not HAS_NVDISASM, reason="nvdisasm not installed")
def test_sass_qgmma_utma_and_no_serialization_loop(kernel):
    (a, b, _, _, config), compiled = kernel
    sass = compiled.asm["sass"]
    bn = 128 if config == 2 else 256
    assert f"QGMMA.64x{bn}x32.F32.{PTX_TYPE[a].upper()}.{PTX_TYPE[b].upper()}" in sass
    assert "UTMALDG.2D" in sass and "USETMAXREG" in sass
    assert "BRA.U.ANY" not in sass          # TMA issued under elect.sync, no loop


def test_scales_are_applied_in_the_epilogue(kernel):
    """The row scales once per tile (a vector of 64 rows per consumer), the
    column scales, when SB is a vector, slice by slice as the tile leaves."""
    (_, _, _, col_scale, _), compiled = kernel
    tk_ir = compiled.asm["tk"]
    broadcasts = re.findall(r'"tk.broadcast".*?axis = "(\w+)".*?kind = "(\w+)"', tk_ir)
    assert ("row", "mul") in broadcasts
    assert (("col", "mul") in broadcasts) == col_scale


# ------------------------------------------------------- argument checks

torch = pytest.importorskip("torch")
from tk_mlir.kernels import scaled_matmul  # noqa: E402

e4m3, e5m2, f32, bf16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float32, torch.bfloat16


def fp8(*shape, dtype=e4m3):
    return torch.zeros(*shape, dtype=dtype)


def col_major(k, n, dtype=e4m3):
    return fp8(n, k, dtype=dtype).t()


ONE = torch.ones(())

REJECTED = {
    "a not a tensor": (lambda: scaled_matmul([[1.0]], col_major(16, 8), ONE, ONE), TypeError,
                       r"scaled_matmul: a must be a torch.Tensor, got list"),
    "a bf16": (lambda: scaled_matmul(torch.zeros(8, 16, dtype=bf16), col_major(16, 8), ONE, ONE),
               TypeError, r"scaled_matmul: a must be torch.float8_e4m3fn or "
                          r"torch.float8_e5m2, got torch.bfloat16"),
    "b 3-D": (lambda: scaled_matmul(fp8(8, 16), fp8(2, 16, 8), ONE, ONE), ValueError,
              r"scaled_matmul: b must be 2-D, got shape \(2, 16, 8\)"),
    "inner dims": (lambda: scaled_matmul(fp8(8, 16), col_major(32, 8), ONE, ONE), ValueError,
                   r"inner dimensions differ: a is \(8, 16\) \(M x K\), b is \(32, 8\) "
                   r"\(K x N\)"),
    "a column-major": (lambda: scaled_matmul(fp8(16, 8).t(), col_major(16, 8), ONE, ONE),
                       ValueError, r"a must be row-major \(M x K, stride 1 along K\), got "
                                   r"strides \(1, 8\)"),
    "b row-major": (lambda: scaled_matmul(fp8(8, 16), fp8(16, 8), ONE, ONE), ValueError,
                    r"b must be column-major \(K x N, stride 1 along K: b = bt.t\(\)"),
    "K % 16": (lambda: scaled_matmul(fp8(8, 24), col_major(24, 8), ONE, ONE), ValueError,
               r"K \(a.shape\[1\]\) must be a multiple of 16, as torch._scaled_mm requires"),
    "out_dtype fp8": (lambda: scaled_matmul(fp8(8, 16), col_major(16, 8), ONE, ONE,
                                            out_dtype=e4m3), TypeError,
                      r"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got "
                      r"torch.float8_e4m3fn"),
    "N % 8 for bf16": (lambda: scaled_matmul(fp8(8, 16), col_major(16, 12), ONE, ONE),
                       ValueError, r"N \(b.shape\[1\]\) must be a multiple of 8 for "
                                   r"out_dtype=torch.bfloat16"),
    "N % 4 for f32": (lambda: scaled_matmul(fp8(8, 16), col_major(16, 6), ONE, ONE,
                                            out_dtype=f32), ValueError,
                      r"must be a multiple of 4 for out_dtype=torch.float32 .*got 6"),
    "scale_a a float": (lambda: scaled_matmul(fp8(8, 16), col_major(16, 8), 1.0, ONE), TypeError,
                        r"scale_a must be a torch.Tensor, got float"),
    "scale_a bf16": (lambda: scaled_matmul(fp8(8, 16), col_major(16, 8),
                                           torch.ones((), dtype=bf16), ONE), TypeError,
                     r"scale_a must be torch.float32, got torch.bfloat16"),
    "scale_a shape": (lambda: scaled_matmul(fp8(8, 16), col_major(16, 8), torch.ones(8), ONE),
                      ValueError, r"scale_a must have shape \(\), \(1,\) or \(1, 1\) \(per "
                                  r"tensor\) or "
                                  r"\(8, 1\) \(M x 1: one per row of a\), got \(8,\)"),
    "scale_b shape": (lambda: scaled_matmul(fp8(8, 16), col_major(16, 8), ONE,
                                            torch.ones(8, 1)), ValueError,
                      r"scale_b must have shape \(\), \(1,\) or \(1, 1\) \(per tensor\) or "
                      r"\(1, 8\) "
                      r"\(1 x N: one per column of b\), got \(8, 1\)"),
    "on the CPU": (lambda: scaled_matmul(fp8(8, 16), col_major(16, 8, dtype=e5m2),
                                         torch.ones(8, 1), torch.ones(1)), ValueError,
                   r"scaled_matmul: a must be on a CUDA device, got cpu"),
}


@pytest.mark.parametrize("case", REJECTED)
def test_scaled_matmul_rejects_bad_arguments_before_the_gpu(case):
    call, error, pattern = REJECTED[case]
    with pytest.raises(error, match=pattern):
        call()


def test_scaled_matmul_fake():
    import tk_mlir.kernels.custom_ops  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a = torch.empty(100, 64, dtype=e4m3, device="cuda")
        b = torch.empty(48, 64, dtype=e5m2, device="cuda").t()
        s = torch.empty((), dtype=f32, device="cuda")
        for out_dtype in (bf16, f32):
            c = torch.ops.tk_mlir.scaled_matmul(a, b, s, s, out_dtype)
            assert (c.shape, c.dtype, c.stride(), c.device.type) == \
                ((100, 48), out_dtype, (48, 1), "cuda")


def test_scale_operands_pass_scales_as_they_are():
    """Per-tensor scales go to the kernel as 0-d tensors (views, no
    arithmetic); rowwise ones as vectors, the rows' padded to a multiple of 4
    where needed, views of the caller's scales where not."""
    sa, sb = torch.tensor(2.0), torch.tensor([3.0])
    SA, SB = scaled_gemm.scale_operands(sa, sb)
    assert SA is sa and SB.shape == () and SB.data_ptr() == sb.data_ptr()
    ra, rb = torch.arange(5.0).reshape(5, 1), torch.arange(8.0).reshape(1, 8)
    SA, SB = scaled_gemm.scale_operands(ra, rb)
    assert SA.tolist() == [0, 1, 2, 3, 4, 0, 0, 0] and SB.tolist() == list(range(8))
    assert SB.data_ptr() == rb.data_ptr()
    r4 = torch.arange(16.0).reshape(8, 2)[:, :1]             # (8, 1), rows 2 apart
    SA, SB = scaled_gemm.scale_operands(r4, sb)
    assert SA.tolist() == [0, 2, 4, 6, 8, 10, 12, 14] and SA.stride() == (1,)
    # (1, 1), as torch._scaled_mm takes a per-tensor scale: one value, not a row's
    SA, SB = scaled_gemm.scale_operands(torch.tensor([[2.0]]), torch.tensor([[3.0]]))
    assert SA.shape == SB.shape == () and (SA.item(), SB.item()) == (2.0, 3.0)


def test_few_rows_take_narrow_tiles_and_many_the_autotuned_ones():
    """The measured choices (BENCHMARKS.md, FP8 GEMM with few rows): 64 x 128
    tiles up to 256 rows, K slices only for very few tiles and a long K."""
    plan = scaled_gemm.plan
    assert plan(16, 4096, 4096, 132).kernel == "split_k"
    assert plan(16, 4096, 4096, 132).config["SPLIT_K"] == 4
    for shape in [(64, 2048, 2048), (128, 4096, 4096), (256, 4096, 4096), (64, 8192, 8192)]:
        chosen = plan(*shape, 132)
        assert chosen.kernel == "tiles" and chosen.config["BM"] == 64, shape
    assert plan(4096, 4096, 4096, 132).kernel == "autotuned"


@pytest.mark.parametrize("M, N, K, out", [(16, 136, 4096, bf16), (40, 264, 1024, bf16),
                                          (130, 136, 512, f32), (300, 2048, 256, bf16)])
@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_matmul_by_every_plan_in_the_interpreter(interpret, monkeypatch, M, N, K, out,
                                                        rowwise):
    """scaled_matmul end to end on CPU tensors, planned for an H200's 132
    SMs: split-K (few rows: each part scaled before it is added), smaller
    tiles, and the scales of each kind; twice per signature (both through
    the launch the first planned, none through the per-call path), with new
    values."""
    from tk_mlir.kernels import eager
    monkeypatch.setattr(scaled_gemm, "num_sms", lambda device=None: 132)
    monkeypatch.setattr(scaled_gemm, "_PREPARED", eager.Prepared())
    per_call = []
    monkeypatch.setattr(scaled_gemm, "launch", lambda *args: per_call.append(args))
    kind = scaled_gemm.plan(M, N, K, 132).kernel
    assert kind == ("split_k" if K == 4096 else "tiles")
    gen = torch.Generator().manual_seed(M + N + rowwise)
    for _ in range(2):
        a = (torch.randn(M, K, generator=gen) * 2).to(e4m3)
        bt = (torch.randn(N, K, generator=gen) * 2).to(e4m3)
        sa = torch.rand(M, 1, generator=gen) + 0.5 if rowwise else torch.rand(()) + 0.5
        sb = torch.rand(1, N, generator=gen) + 0.5 if rowwise else torch.rand(1) + 1
        c = scaled_matmul(a, bt.t(), sa, sb, out_dtype=out)
        ref = (a.double() @ bt.double().T) * sa.double().reshape(-1, 1) * \
            sb.double().reshape(1, -1)
        assert c.dtype == out and ((c.double() - ref).norm() / ref.norm()).item() < 4e-3, kind
    assert len(scaled_gemm._PREPARED) == 1 and not per_call


@pytest.mark.parametrize("sa", [(40,), ()], ids=["rowwise", "per-tensor"])
def test_the_split_k_kernel_compiles_without_spills(sa):
    compiled = scaled_gemm.scaled_split_k_kernel.compile(
        tk.spec((40, 4096), "f8e4m3"), tk.spec((264, 4096), "f8e4m3"), tk.spec((40, 264), "bf16"),
        tk.spec(sa, "f32"), tk.spec((264,) if sa else (), "f32"), tk.spec((40, 264), "f32"),
        tk.spec((1024,), "i32"), SPLIT_K=4)
    assert compiled.info["spill stores (bytes)"] == 0 and compiled.info["spill loads (bytes)"] == 0
    assert "C75" not in compiled.ptxas_log, compiled.ptxas_log
    assert "red.global.add" in compiled.asm["ptx"]                   # the parts meet by atomics


def test_a_misaligned_rowwise_scale_is_copied_not_refused():
    buf = torch.rand(9)
    sa = buf[1:].view(8, 1)                                          # contiguous, 4 bytes in
    SA, _ = scaled_gemm.scale_operands(sa, torch.tensor(1.0))
    assert SA.data_ptr() % 16 == 0 and SA.tolist() == buf[1:].tolist()


def test_the_split_k_kernel_leaves_its_workspace_zeroed():
    M, N, K = 40, 256, 1024
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(M, K, generator=gen) * 2).to(e4m3)
    bt = (torch.randn(N, K, generator=gen) * 2).to(e5m2)
    sa, sb = torch.rand(M + 4 - M % 4, generator=gen) + 0.5, torch.tensor(2.0)
    c = torch.full((M, N), float("nan"), dtype=bf16)
    w = torch.zeros(M, N)
    f = torch.zeros(scaled_gemm.gemm.split_k_counters(M, N, 128), dtype=torch.int32)
    scaled_gemm.scaled_split_k_kernel.interpret[(5,)](a, bt, c, sa, sb, w, f, SPLIT_K=4)
    ref = (a.double() @ bt.double().T) * sa[:M, None].double() * 2
    assert ((c.double() - ref).norm() / ref.norm()).item() < 4e-3
    assert not w.any() and not f.any()


@pytest.mark.parametrize("rowwise_a, rowwise_b", [(False, False), (True, True), (True, False),
                                                  (False, True)])
def test_interpreted_scales_against_float64(rowwise_a, rowwise_b):
    """The kernel in the interpreter, each pair of scale kinds (per-tensor
    ones read from 0-d tensors in the kernel), into a NaN-poisoned C."""
    gen = torch.Generator().manual_seed(7 + 2 * rowwise_a + rowwise_b)
    M, N, K = 130, 264, 256
    a = (torch.randn(M, K, generator=gen) * 2).to(e4m3)
    bt = (torch.randn(N, K, generator=gen) * 2).to(e5m2)
    sa = torch.rand(M, 1, generator=gen) + 0.5 if rowwise_a else torch.tensor(0.75)
    sb = torch.rand(1, N, generator=gen) + 0.5 if rowwise_b else torch.tensor([1.5])
    c = torch.full((M, N), float("nan"), dtype=bf16)
    scaled_gemm.scaled_gemm_kernel.kernel.interpret[(3,)](
        a, bt, c, *scaled_gemm.scale_operands(sa, sb), BN=128, STAGES=2)
    ref = (a.double() @ bt.double().T) * sa.double().reshape(-1, 1) * sb.double().reshape(1, -1)
    assert ((c.double() - ref).norm() / ref.norm()).item() < 4e-3


class _Scaled(torch.nn.Module):
    def forward(self, a, bt, sa, sb):
        return scaled_matmul(a, bt.t(), sa, sb, out_dtype=f32)


def test_dynamo_traces_scaled_matmul_into_its_op():
    """torch.export (strict: a graph break fails): the wrapper's checks run
    on fake tensors, the launch and the scale vectors stay inside the op."""
    import tk_mlir.kernels.custom_ops  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        args = (torch.empty(64, 128, dtype=e4m3, device="cuda"),
                torch.empty(32, 128, dtype=e4m3, device="cuda"),
                torch.empty(64, 1, device="cuda"), torch.empty(1, 32, device="cuda"))
        graph = torch.export.export(_Scaled(), args, strict=True).graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert [t for t in targets if t.startswith("tk_mlir.")] == ["tk_mlir.scaled_matmul.default"]


def test_scaled_matmul_refuses_inputs_that_require_grad(interpret):
    scale = torch.tensor(2.0, requires_grad=True)
    with pytest.raises(RuntimeError, match="scaled_matmul: not differentiable"):
        scaled_matmul(fp8(8, 16), col_major(16, 8), scale, ONE)
    with torch.no_grad():
        assert scaled_matmul(fp8(8, 16), col_major(16, 8), scale, ONE).shape == (8, 8)
