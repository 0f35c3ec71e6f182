"""The library's Hopper GEMM (tk_mlir.kernels.gemm) against torch.matmul in float32/64 on
the GPU: both B layouts, bf16 and f16 inputs, 16-bit and f32 outputs,
square, skinny and odd shapes, fresh random inputs, poisoned outputs."""
import pytest

torch = pytest.importorskip("torch")

from tk_mlir.kernels import matmul  # noqa: E402
from tk_mlir.kernels.device import num_sms  # noqa: E402
from tk_mlir.kernels.gemm import gemm_kernel  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [(256, 256, 64), (1024, 1024, 1024), (2048, 512, 4096), (8, 4096, 1024),
          (4096, 16, 1024), (1000, 1000, 1000), (1537, 776, 1304), (3000, 5000, 136)]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def run(M, N, K, layout, dtype, out_dtype, **config):
    kn = layout == "kn"
    a = torch.empty(M, K, dtype=DTYPES[dtype], device="cuda").uniform_(-1, 1)
    b = torch.empty(*((K, N) if kn else (N, K)), dtype=DTYPES[dtype], device="cuda").uniform_(-1, 1)
    c = torch.full((M, N), float("nan"), dtype=DTYPES[out_dtype], device="cuda")
    if config:
        gemm_kernel.kernel[(num_sms(),)](a, b, c, B_KN=kn, **config)
    else:
        matmul(a, b, c, b_layout=layout)
    ref = a.double() @ (b.double() if kn else b.double().T)
    return ((c.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_bf16_shapes(shape, layout):
    assert run(*shape, layout, "bf16", "bf16", STAGES=4) < 5e-3   # bf16 rounding of C: ~1.7e-3


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype,out_dtype", [("f16", "f16"), ("bf16", "f32"), ("f16", "f32")])
def test_gemm_dtypes(layout, dtype, out_dtype):
    tol = 1e-5 if out_dtype == "f32" else 1e-3
    assert run(1000, 776, 1304, layout, dtype, out_dtype, STAGES=4) < tol


@pytest.mark.parametrize("config", [dict(BN=128, STAGES=6), dict(GROUP_M=16),
                                    dict(STAGES=3, EPI_N=256), dict(TMA_STORE=False)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_gemm_configs(config):
    assert run(1537, 776, 1304, "nk", "bf16", "bf16", **config) < 5e-3


def test_gemm_autotuned_entry_point():
    assert run(1024, 2048, 512, "nk", "bf16", "bf16") < 5e-3
    assert run(1024, 2048, 512, "kn", "bf16", "bf16") < 5e-3


# Small and skinny shapes: each of gemm.plan's kernels, odd sizes,
# both layouts; repeated calls find the split-K workspace and counters zero.
# (The kinds are the H200's, 132 SMs; other GPUs run the same shapes.)
PLANNED = {(16, 4096, 4096): "split_k", (64, 8192, 8192): "split_k",
           (128, 4096, 4096): "split_k", (1, 256, 1024): "split_k", (37, 1000, 3000): "split_k",
           (100, 8192, 1024): "split_k", (130, 2048, 8192): "split_k",
           (512, 4096, 4096): "tiles", (1024, 1024, 1024): "tiles", (256, 256, 8192): "split_k",
           (200, 136, 20000): "split_k", (1000, 8192, 1000): "autotuned",
           (256, 11008, 4096): "tiles", (384, 8192, 4096): "tiles"}


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("shape", PLANNED, ids=lambda s: "x".join(map(str, s)))
def test_gemm_planned_kernels(shape, layout):
    from tk_mlir.kernels.gemm import rules_plan
    if num_sms() == 132:            # (matmul may take the measured table's plan instead:
        assert rules_plan(*shape, 132).kernel == PLANNED[shape]   # test_gemm_plans.py)
    errors = [run(*shape, layout, "bf16", "bf16") for _ in range(2)]
    errors.append(run(*shape, layout, "f16", "f32"))
    assert max(errors[:2]) < 5e-3 and errors[2] < 1e-5, errors


@pytest.mark.parametrize("warm", [True, False], ids=["kept-workspace", "cold"])
def test_gemm_split_k_in_a_cuda_graph(warm):
    """Warmed up on the capture stream, the captured call uses the kept
    workspace; captured cold (a shape larger than any kept workspace), the
    graph makes and zeroes its own. Replays on new inputs match."""
    M, N, K = (64, 4096, 4096) if warm else (100, 8192, 8192)
    a = torch.empty(M, K, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    b = torch.empty(N, K, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    c = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream if warm else torch.cuda.current_stream()):
        matmul(a, b, c)                  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        matmul(a, b, c)
    for _ in range(3):
        a.uniform_(-1, 1)
        c.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = a.double() @ b.double().T
        assert ((c.double() - ref).norm() / ref.norm()).item() < 5e-3


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("shape", [(8, 16, 4096, 4096), (4, 512, 512, 4096), (3, 1000, 776, 1304),
                                   (64, 128, 128, 64), (2, 8192, 1024, 512)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemm_batched(shape, layout):
    """G products of one shape in one launch, whatever kernel the plan picks."""
    G, M, N, K = shape
    kn = layout == "kn"
    a = torch.empty(G, M, K, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    b = torch.empty(*((G, K, N) if kn else (G, N, K)), dtype=torch.bfloat16,
                    device="cuda").uniform_(-1, 1)
    for out in (torch.bfloat16, torch.float32):
        c = torch.full((G, M, N), float("nan"), dtype=out, device="cuda")
        matmul(a, b, c, b_layout=layout)
        ref = a.double() @ (b.double() if kn else b.double().transpose(1, 2))
        err = ((c.double() - ref).norm() / ref.norm()).item()
        assert err < (5e-3 if out == torch.bfloat16 else 1e-5), (out, err)


@pytest.mark.parametrize("dense", [False, True], ids=["in-place", "packed"])
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("sizes, M, N, K", [
    ([512, 0, 1, 129, 300, 512, 77, 256], 512, 4096, 1024),     # an MoE layer's experts
    ([7], 16, 136, 200), ([0, 0, 0], 128, 256, 64), ([3000, -4, 5], 2048, 1000, 776),
], ids=["experts", "one", "all-empty", "clamped"])
def test_grouped_gemm(sizes, M, N, K, layout, dense, monkeypatch):
    """Rows below each product's size match float64; rows past the tile that
    holds its last row keep the poison; sizes past M count as M. Both
    schedules (packed tiles, tiles skipped in place), whichever the shape
    would take."""
    from tk_mlir.kernels import eager, grouped_gemm, grouped_matmul
    monkeypatch.setattr(grouped_gemm, "dense_schedule", lambda *shape: dense)
    monkeypatch.setattr(grouped_gemm, "_PREPARED", eager.Prepared())   # (plans by the default)
    G, kn = len(sizes), layout == "kn"
    a = torch.empty(G, M, K, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    b = torch.empty(*((G, K, N) if kn else (G, N, K)), dtype=torch.bfloat16,
                    device="cuda").uniform_(-1, 1)
    c = torch.full((G, M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_matmul(a, b, torch.tensor(sizes, device="cuda"), c, b_layout=layout)
    ref = a.double() @ (b.double() if kn else b.double().transpose(1, 2))
    for g, n in enumerate(min(max(n, 0), M) for n in sizes):
        if n:
            err = ((c[g, :n].double() - ref[g, :n]).norm() / ref[g, :n].norm()).item()
            assert err < 5e-3, (g, err)
        assert c[g, -(-n // 128) * 128:].isnan().all()


@pytest.mark.parametrize("shape", [(0, 64, 64), (64, 0, 64), (64, 64, 0)])
def test_gemm_empty_products(shape):
    """An empty C launches nothing; K = 0 gives zeros (poison overwritten);
    grouped_matmul likewise, with M = 0 rows per product."""
    from tk_mlir.kernels import grouped_matmul
    M, N, K = shape
    a = torch.empty(M, K, dtype=torch.bfloat16, device="cuda")
    b = torch.empty(N, K, dtype=torch.bfloat16, device="cuda")
    c = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    matmul(a, b, c)
    assert not c.isnan().any() and not c.any()
    c3 = torch.full((2, M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_matmul(a.expand(2, M, K), b.expand(2, N, K), torch.tensor([M, 1], device="cuda"),
                   c3)
    assert not c3.isnan().any() and not c3.any()


class _ArrayInterface:
    """A tensor seen only through __cuda_array_interface__: the general launch
    path, which passes tensor maps by value through cuda-python."""

    def __init__(self, t):
        self._t = t
        self.__cuda_array_interface__ = t.__cuda_array_interface__


def test_gemm_general_launch_path_passes_tensor_maps():
    M, N, K = 512, 768, 320
    a = torch.empty(M, K, dtype=torch.float16, device="cuda").uniform_(-1, 1)
    b = torch.empty(N, K, dtype=torch.float16, device="cuda").uniform_(-1, 1)
    c = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")
    gemm_kernel.kernel[(num_sms(),)](_ArrayInterface(a), _ArrayInterface(b),
                                          _ArrayInterface(c), STAGES=4)
    torch.cuda.synchronize()
    ref = a.double() @ b.double().T
    assert ((c.double() - ref).norm() / ref.norm()).item() < 1e-3


def test_tma_alignment_is_checked_before_launch():
    import tk_mlir as tk
    a = torch.randn(256, 264, dtype=torch.bfloat16, device="cuda")[:, 1:257]   # misaligned base
    b = torch.randn(256, 256, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(256, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(tk.ArgumentError, match="'A'.*16-byte aligned"):
        gemm_kernel.kernel[(num_sms(),)](a, b, c)


@pytest.mark.parametrize("shape", [(1024, 1024, 1024), (1537, 776, 1304), (128, 512, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemm_cluster_multicast(shape):
    """Clusters of 2 blocks sharing B through TMA multicast, on a grid of the
    clusters that fit (CompiledKernel.persistent_grid)."""
    import tk_mlir as tk
    M, N, K = shape
    a = torch.empty(M, K, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    b = torch.empty(N, K, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    c = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernel = gemm_kernel.kernel
    grid = kernel.compile(a, b, c, CLUSTER=2).persistent_grid()
    assert grid % 2 == 0 and 0 < grid <= num_sms()
    kernel[(grid,)](a, b, c, CLUSTER=2)
    ref = a.double() @ b.double().T
    assert ((c.double() - ref).norm() / ref.norm()).item() < 5e-3
    with pytest.raises(tk.ArgumentError, match="multiple of 2"):
        kernel[(grid - 1,)](a, b, c, CLUSTER=2)


import tk_mlir as tk   # noqa: E402
from tk_mlir import f32  # noqa: E402


@tk.kernel(num_warps=4)
def mma_variant(A: tk.gl, B: tk.gl, C: tk.gl[f32], TA: tk.constexpr, TB: tk.constexpr,
                M: tk.constexpr, N: tk.constexpr, K: tk.constexpr):
    """One warpgroup: TMA the whole operands in, one tk.mma_*, store C."""
    a = tk.shared_tile(A.dtype, (K, M) if TA else (M, K), swizzle=128)
    b = tk.shared_tile(B.dtype, (K, N) if TB else (N, K), swizzle=128)
    sem = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.prefetch(A, a)
        tk.tma.expect(sem, a, b)
        tk.tma.load_async(a, A, (0, 0), sem)
        tk.tma.load_async(b, B, (0, 0), sem)
    tk.wait(sem, 0)
    mma = {(False, False): tk.mma_ABt, (False, True): tk.mma_AB,
           (True, False): tk.mma_AtBt, (True, True): tk.mma_AtB}[(TA, TB)]
    acc = mma(tk.zeros((M, N), f32, layout="row", scope="warpgroup"), a, b)
    tk.mma_wait(0)
    tk.store(C, acc, (0, 0))


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("mnk", [(64, 64, 64), (128, 128, 128), (64, 256, 64)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)],
                         ids=["ABt", "AB", "AtBt", "AtB"])
def test_every_mma_form(ta, tb, mnk, dtype):
    M, N, K = mnk
    dt = DTYPES[dtype]
    a = torch.empty(*((K, M) if ta else (M, K)), dtype=dt, device="cuda").uniform_(-1, 1)
    b = torch.empty(*((K, N) if tb else (N, K)), dtype=dt, device="cuda").uniform_(-1, 1)
    c = torch.full((M, N), float("nan"), dtype=torch.float32, device="cuda")
    mma_variant[(1,)](a, b, c, TA=ta, TB=tb, M=M, N=N, K=K)
    ref = (a.double().T if ta else a.double()) @ (b.double() if tb else b.double().T)
    assert ((c.double() - ref).norm() / ref.norm()).item() < 1e-5


@tk.kernel(num_warps=4)
def mma_register_a(A: tk.gl, B: tk.gl, C: tk.gl[f32], TB: tk.constexpr,
                   M: tk.constexpr, N: tk.constexpr, K: tk.constexpr):
    """A read into a register tile (the wgmma A fragment), B from shared memory."""
    a_s = tk.shared_tile(A.dtype, (M, K), swizzle=128)
    b = tk.shared_tile(B.dtype, (K, N) if TB else (N, K), swizzle=128)
    sem = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(sem, a_s, b)
        tk.tma.load_async(a_s, A, (0, 0), sem)
        tk.tma.load_async(b, B, (0, 0), sem)
    tk.wait(sem, 0)
    a = tk.load(a_s, layout="row", scope="warpgroup")
    mma = tk.mma_AB if TB else tk.mma_ABt
    acc = mma(tk.zeros((M, N), f32, layout="row", scope="warpgroup"), a, b)
    tk.mma_wait(0)
    tk.store(C, acc, (0, 0))


@pytest.mark.parametrize("mnk", [(64, 64, 64), (128, 128, 64), (64, 256, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("tb", [False, True], ids=["ABt", "AB"])
def test_mma_with_a_in_registers(tb, mnk):
    M, N, K = mnk
    a = torch.empty(M, K, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    b = torch.empty(*((K, N) if tb else (N, K)), dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    c = torch.full((M, N), float("nan"), dtype=torch.float32, device="cuda")
    mma_register_a[(1,)](a, b, c, TB=tb, M=M, N=N, K=K)
    ref = a.double() @ (b.double() if tb else b.double().T)
    assert ((c.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("M, N, K, b_layout", [(1000, 257, 250, "nk"), (513, 1030, 1001, "kn"),
                                               (64, 4097, 4090, "nk")])
def test_matmul_at_ragged_shapes(M, N, K, b_layout):
    """Rows that are not whole 16-byte vectors go through zero-padded copies
    (gemm.padded_rows): the product is the same as at aligned shapes."""
    from tk_mlir.kernels import matmul
    a = torch.empty(M, K, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    b = torch.empty(*((N, K) if b_layout == "nk" else (K, N)), dtype=torch.bfloat16,
                    device="cuda").uniform_(-1, 1)
    c = torch.full((M, N), float("nan"), device="cuda")
    matmul(a, b, c, b_layout=b_layout)
    ref = a.double() @ (b.double().T if b_layout == "nk" else b.double())
    assert ((c.double() - ref).norm() / ref.norm()).item() < 1e-5
