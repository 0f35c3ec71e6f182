"""grouped_mm: packed (ragged) grouped products as torch._grouped_mm takes
them. The kernel's numerics run in the interpreter on CPU tensors (groups
that share a 128-row tile, end on a tile's edge, are empty, rows past the
last group), against float64; the same cases and larger ones on the GPU; the
wrapper's argument rules; the custom op's fake; PTX without spills; the
gradients (da by the same kernel, db by ragged_weight_grad_kernel) against
float64 autograd, interpreted and on the GPU."""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

import tk_mlir as tk  # noqa: E402
from tk_mlir.kernels import grouped_gemm, grouped_mm  # noqa: E402


def reference(a, b, offs):
    """float64 a[rows of g] @ b[g], zeros past the last group."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs):
        out[start:end] = a[start:end].double().cpu() @ b[g].double().cpu()
        start = end
    return out


def rel_err(out, ref) -> float:
    return ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def weights(G, K, N, layout, device="cpu", dtype=torch.bfloat16, gen=None):
    """b as (G, K, N): row-major ("kn"), or the transpose of (G, N, K) ("nk")."""
    if layout == "kn":
        return torch.randn(G, K, N, dtype=dtype, device=device, generator=gen)
    return torch.randn(G, N, K, dtype=dtype, device=device, generator=gen).transpose(1, 2)


# (T, K, N, offs): groups sharing a tile, ending on a tile's edge (128), empty
# groups (first, middle, last), rows past the last group, one group.
CASES = [
    (300, 64, 128, [0, 100, 128, 128, 250, 290]),
    (200, 72, 136, [70, 200, 200]),
    (129, 64, 256, [129]),
    (256, 64, 64, [1, 2, 3, 130]),
]


@pytest.fixture(params=[False, True], ids=["every-tile", "skip-empty"])
def skip_empty(request, monkeypatch):
    """Both schedules of ragged_gemm_kernel, whatever ragged_launch would
    choose for the shape: every slot a task, or empty products' slots skipped."""
    monkeypatch.setattr(grouped_gemm, "skip_empty_tiles", lambda T, G: request.param)
    return request.param


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("T, K, N, offs", CASES)
def test_interpreted_against_float64(interpret, skip_empty, T, K, N, offs, layout):
    gen = torch.Generator().manual_seed(T * 7 + K)
    a = torch.randn(T, K, dtype=torch.bfloat16, generator=gen)
    b = weights(len(offs), K, N, layout, gen=gen)
    out = grouped_mm(a, b, torch.tensor(offs, dtype=torch.int32))
    assert out.shape == (T, N) and out.dtype == a.dtype
    assert rel_err(out, reference(a, b, offs)) < 1e-2
    assert not out[offs[-1]:].any()                      # rows of no group


@pytest.mark.parametrize("offs", [[10, 20, 20, 30, 64, 70, 100, 300],   # ends sharing tiles
                                  [0, 0, 64, 64, 192, 200],              # on tile edges, rows past
                                  [0, 0, 0]])                             # no rows at all
def test_every_row_written_over_a_poisoned_output(interpret, skip_empty, offs):
    """ragged_launch into NaNs: the zero kernel clears exactly the tiles the
    GEMM adds into and the rows past the last group; nothing stays NaN."""
    a, b = cpu(300, 64), weights(len(offs), 64, 192, "kn")
    out = torch.full((300, 192), float("nan"), dtype=torch.bfloat16)
    grouped_gemm.ragged_launch(a, b, torch.tensor(offs, dtype=torch.int32), out)
    assert not out.isnan().any()
    assert rel_err(out, reference(a, b, offs)) < 1e-2 if offs[-1] else not out.any()
    assert not out[offs[-1]:].any()


def test_a_list_of_offs_and_f16(interpret):
    a = torch.randn(150, 64, dtype=torch.float16)
    b = weights(3, 64, 128, "nk", dtype=torch.float16)
    offs = [40, 40, 150]
    assert rel_err(grouped_mm(a, b, offs), reference(a, b, offs)) < 1e-2


def test_weights_at_any_offset_are_copied_aligned(interpret):
    """A contiguous b whose data starts off a 16-byte boundary (an expert's
    weight cut from a flat parameter buffer) is read through an aligned copy,
    as every other layout the kernel cannot read in place."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(12, 16, dtype=torch.bfloat16, generator=g)
    for shift in (1, 4):
        flat = torch.randn(2 * 16 * 16 + shift, dtype=torch.bfloat16, generator=g)
        b = flat[shift:].view(2, 16, 16)
        assert b.is_contiguous() and b.data_ptr() % 16
        assert rel_err(grouped_mm(a, b, [3, 12]), reference(a, b, [3, 12])) < 1e-2


def test_empty_sizes_return_zeros(interpret):
    a = torch.randn(10, 64, dtype=torch.bfloat16)
    out = grouped_mm(a, weights(2, 64, 0, "kn"), [5, 10])
    assert out.shape == (10, 0)
    out = grouped_mm(torch.randn(0, 64, dtype=torch.bfloat16), weights(2, 64, 64, "kn"), [0, 0])
    assert out.shape == (0, 64)
    out = grouped_mm(a[:, :0], weights(2, 0, 64, "kn"), [5, 10])
    assert out.shape == (10, 64) and not out.any()


def cpu(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


BAD = {
    "a 3-D": (lambda: grouped_mm(cpu(2, 8, 8), cpu(2, 8, 8), [8, 16]), ValueError,
              r"grouped_mm: a must be 2-D, got shape \(2, 8, 8\)"),
    "b 2-D": (lambda: grouped_mm(cpu(16, 8), cpu(8, 8), [8, 16]), ValueError,
              r"grouped_mm: b must be 3-D"),
    "f32 a": (lambda: grouped_mm(cpu(16, 8, dtype=torch.float32), cpu(2, 8, 8), [8, 16]),
              TypeError, r"grouped_mm: a must be torch.bfloat16 or torch.float16"),
    "inner": (lambda: grouped_mm(cpu(16, 8), cpu(2, 16, 8), [8, 16]), ValueError,
              r"inner dimensions differ: a is \(16, 8\) \(T x K\), b is \(2, 16, 8\)"),
    "N % 8": (lambda: grouped_mm(cpu(16, 8), cpu(2, 8, 12), [8, 16]), ValueError,
              r"N must be a multiple of 8"),
    "offs length": (lambda: grouped_mm(cpu(16, 8), cpu(2, 8, 8), [16]), ValueError,
                    r"offs must be a 1-D int32 tensor of G=2 row ends"),
    "offs int64": (lambda: grouped_mm(cpu(16, 8), cpu(2, 8, 8), torch.tensor([8, 16])),
                   ValueError, r"offs must be a 1-D int32 tensor .* torch.int64"),
    "offs decreasing": (lambda: grouped_mm(cpu(16, 8), cpu(3, 8, 8), [8, 4, 16]), ValueError,
                        r"offs\[1\] is 4: row ends must be nondecreasing from 0 and at most "
                        r"T = 16"),
    "offs past T": (lambda: grouped_mm(cpu(16, 8), cpu(2, 8, 8), [8, 17]), ValueError,
                    r"offs\[1\] is 17"),
    "offs negative": (lambda: grouped_mm(cpu(16, 8), cpu(2, 8, 8), [-1, 16]), ValueError,
                      r"offs\[0\] is -1"),
    "offs numpy": (lambda: grouped_mm(cpu(16, 8), cpu(2, 8, 8),
                                      torch.tensor([8, 16], dtype=torch.int32).numpy()),
                   TypeError, r"offs must be a torch.Tensor \(int32\) or a list or tuple of "
                              r"ints \(G=2 row ends\), got numpy.ndarray"),
    "offs not ints": (lambda: grouped_mm(cpu(16, 8), cpu(2, 8, 8), [8.0, 16]), TypeError,
                      r"offs\[0\] must be an int"),
    "out_dtype": (lambda: grouped_mm(cpu(16, 8), cpu(2, 8, 8), [8, 16],
                                     out_dtype=torch.float32),
                  TypeError, r"out_dtype must be None or a's dtype torch.bfloat16"),
    "bias": (lambda: grouped_mm(cpu(16, 8), cpu(2, 8, 8), [8, 16], cpu(2, 8)), ValueError,
             r"grouped_mm: bias is not supported"),
    "on the CPU": (lambda: grouped_mm(cpu(16, 8), cpu(2, 8, 8), [8, 16]), ValueError,
                   r"grouped_mm: a must be on a CUDA device"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_arguments_are_named(case):
    fn, error, message = BAD[case]
    with pytest.raises(error, match=message):
        fn()


def reference_grads(a, b, offs, w):
    """float64 (da, db) of (out * w).sum() for out = reference(a, b, offs)."""
    a64 = a.detach().double().cpu().requires_grad_()
    b64 = b.detach().double().cpu().requires_grad_()
    pieces, start = [], 0
    for g, end in enumerate(offs):
        pieces.append(a64[start:end] @ b64[g])
        start = end
    pieces.append(a64.new_zeros(a.shape[0] - start, b.shape[2]))
    (torch.cat(pieces) * w.double().cpu()).sum().backward()
    return a64.grad, b64.grad


def check_grads(a, b, offs, fn=None, need=(True, True)):
    """grouped_mm's gradients through autograd against float64, every
    product's db (empty ones: zeros) and da (rows past the last product:
    zeros)."""
    a = a.detach().requires_grad_(need[0])
    b = b.detach().requires_grad_(need[1])
    w = torch.randn(a.shape[0], b.shape[2], device=a.device)
    out = (fn or grouped_mm)(a, b, torch.tensor(offs, dtype=torch.int32, device=a.device))
    (out.float() * w).sum().backward()
    da, db = reference_grads(a, b, offs, w)
    if need[0]:
        assert a.grad.shape == a.shape and a.grad.dtype == a.dtype
        assert rel_err(a.grad, da) < 1e-2 and not a.grad[offs[-1]:].any()
    if need[1]:
        assert b.grad.shape == b.shape and b.grad.dtype == b.dtype
        assert rel_err(b.grad, db) < 1e-2
        start = 0
        for g, end in enumerate(offs):
            assert (end > start) or not b.grad[g].any()
            start = max(start, end)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("T, K, N, offs", CASES + [(200, 200, 64, [0, 0, 65, 65, 130])])
def test_gradients_interpreted_against_float64(interpret, T, K, N, offs, layout):
    """Products sharing 64-row windows (db's first and last windows zero the
    other products' rows), ending on edges, empty (db zero), rows past the
    last product (da zero), K and N not whole tiles."""
    gen = torch.Generator().manual_seed(T + K + N)
    check_grads(torch.randn(T, K, dtype=torch.bfloat16, generator=gen),
                weights(len(offs), K, N, layout, gen=gen), offs)


@pytest.mark.parametrize("n", [8, 200])          # DC's tiles of 128 and 256 columns
def test_a_non_finite_gradient_row_stays_in_its_product(interpret, n):
    """NaN in the output gradient's row 2 (product 0's) leaves products 1
    and 2's db finite, and NaN past offs[-1] (rows that are zeros whatever
    a and b) leaves every db finite: the weight gradient zeroes the other
    products' rows of dc as of a (0 times NaN is NaN)."""
    g = torch.Generator().manual_seed(n)
    a = torch.randn(20, 16, generator=g).bfloat16().requires_grad_()
    b = torch.randn(3, 16, n, generator=g).bfloat16().requires_grad_()
    dc = torch.randn(20, n, generator=g).bfloat16()
    dc[2] = float("nan")
    (db,) = torch.autograd.grad(grouped_mm(a, b, [5, 12, 20]), (b,), dc)
    assert [bool(db[i].isfinite().all()) for i in range(3)] == [False, True, True]
    dc = torch.randn(20, n, generator=g).bfloat16()
    dc[12:] = float("nan")
    (db,) = torch.autograd.grad(grouped_mm(a, b, [5, 12, 12]), (b,), dc)
    ref = torch.stack([a[:5].double().T @ dc[:5].double(), a[5:12].double().T @ dc[5:12].double(),
                       torch.zeros(16, n, dtype=torch.float64)])
    assert db.isfinite().all() and ((db.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("need", [(True, False), (False, True)])
def test_only_the_gradient_asked_for(interpret, need):
    check_grads(cpu(150, 64), weights(3, 64, 128, "nk"), [40, 40, 150], need=need)


def test_no_gradient_under_no_grad(interpret):
    a = cpu(16, 8).requires_grad_()
    with torch.no_grad():
        out = grouped_mm(a, cpu(2, 8, 8), [8, 16])
    assert not out.requires_grad


def test_compiled_calls_check_like_eager_ones(interpret):
    """Under torch.compile, host offs are checked as eagerly (a float is not
    truncated), and gradients flow through the custom op as eagerly."""
    compiled = torch.compile(grouped_mm, backend="eager", fullgraph=True)
    a, b = cpu(150, 64), weights(3, 64, 128, "kn")
    with pytest.raises(Exception, match=r"offs\[0\] must be an int"):
        compiled(a, b, [40.7, 40, 150])
    out = compiled(a, b, torch.tensor([40, 40, 150], dtype=torch.int32))
    assert rel_err(out, reference(a, b, [40, 40, 150])) < 1e-2
    check_grads(a, b, [40, 40, 150], fn=compiled)


def test_fake_says_the_result():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from tk_mlir.kernels import custom_ops  # noqa: F401
    with FakeTensorMode():
        out = torch.ops.tk_mlir.grouped_mm(torch.empty(40, 64, dtype=torch.bfloat16),
                                           torch.empty(3, 64, 96, dtype=torch.bfloat16),
                                           torch.empty(3, dtype=torch.int32))
    assert out.shape == (40, 96) and out.dtype == torch.bfloat16


def test_custom_op_runs_interpreted(interpret):
    from tk_mlir.kernels import custom_ops  # noqa: F401
    a, b = cpu(150, 64), weights(3, 64, 128, "kn")
    offs = torch.tensor([40, 40, 150], dtype=torch.int32)
    out = torch.ops.tk_mlir.grouped_mm(a, b, offs)
    assert rel_err(out, reference(a, b, [40, 40, 150])) < 1e-2


def test_empty_tiles_are_skipped_when_products_average_under_a_tile():
    assert grouped_gemm.skip_empty_tiles(64, 256) and grouped_gemm.skip_empty_tiles(16, 8)
    assert not grouped_gemm.skip_empty_tiles(32768, 256)
    assert not grouped_gemm.skip_empty_tiles(8192, 8)


@pytest.mark.parametrize("kn, skip", [(False, False), (True, False), (False, True)])
def test_kernel_compiles_without_spills(kn, skip):
    b = tk.spec((6, 512, 384), "bf16") if kn else tk.spec((6, 384, 512), "bf16")
    compiled = grouped_gemm.ragged_gemm_kernel.compile(
        tk.spec((1000, 512), "bf16"), b, tk.spec((1000, 384), "bf16"), tk.spec((8,), "i32"),
        LOG_G=3, B_KN=kn, SKIP_EMPTY=skip)
    info = compiled.info
    assert info["spill stores (bytes)"] == 0 and info["spill loads (bytes)"] == 0
    assert "C75" not in compiled.ptxas_log, compiled.ptxas_log
    assert "cp.reduce.async.bulk.tensor" in compiled.asm["ptx"]     # rows added, not stored


@pytest.mark.parametrize("bn", [128, 256])
def test_weight_gradient_kernel_compiles_without_spills_or_serialized_mmas(bn):
    """Its first and last windows' masking is peeled out of the MMA pipeline
    (templates.lcf's prepare): a branch inside it would serialize the wgmmas."""
    compiled = grouped_gemm.ragged_weight_grad_kernel.compile(
        tk.spec((1000, 512), "bf16"), tk.spec((1000, 384), "bf16"), tk.spec((6, 512, 384), "bf16"),
        tk.spec((8,), "i32"), BN=bn)
    info = compiled.info
    assert info["spill stores (bytes)"] == 0 and info["spill loads (bytes)"] == 0
    assert "C75" not in compiled.ptxas_log, compiled.ptxas_log


# ------------------------------------------------------------------ GPU

def random_offs(T: int, G: int, rng: random.Random) -> list[int]:
    """G nondecreasing ends in [0, T], some groups empty, the last short of T
    at times."""
    cuts = sorted(rng.randint(0, T) for _ in range(G - 1))
    return cuts + [T if rng.random() < 0.7 else rng.randint(cuts[-1] if cuts else 0, T)]


# (T, K, N, G) on the GPU: K and N not whole tiles, products averaging a row
GPU_CASES = [(300, 64, 128, 6), (1000, 256, 384, 8), (4099, 512, 1032, 16), (77, 128, 256, 64),
             (2048, 1024, 256, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("T, K, N, G", GPU_CASES)
def test_gpu_against_float64(T, K, N, G, layout):
    rng = random.Random(T + G)
    gen = torch.Generator(device="cuda").manual_seed(T)
    a = torch.randn(T, K, dtype=torch.bfloat16, device="cuda", generator=gen)
    b = weights(G, K, N, layout, "cuda", gen=gen)
    offs = random_offs(T, G, rng)
    out = grouped_mm(a, b, torch.tensor(offs, dtype=torch.int32, device="cuda"))
    assert rel_err(out, reference(a, b, offs)) < 1e-2
    assert not out[offs[-1]:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("T, K, N, G", GPU_CASES)
def test_gpu_gradients_against_float64(T, K, N, G, layout):
    rng = random.Random(T * G)
    gen = torch.Generator(device="cuda").manual_seed(T + 1)
    check_grads(torch.randn(T, K, dtype=torch.bfloat16, device="cuda", generator=gen),
                weights(G, K, N, layout, "cuda", gen=gen), random_offs(T, G, rng))


@pytest.mark.gpu
def test_gpu_in_a_cuda_graph_with_device_offs():
    """Device offs are read by the GPU: the call captures, and a replay with
    new offs (same tensor) computes the new groups."""
    a = torch.randn(512, 128, dtype=torch.bfloat16, device="cuda")
    b = weights(4, 128, 256, "nk", "cuda")
    offs = torch.tensor([100, 200, 300, 512], dtype=torch.int32, device="cuda")
    grouped_mm(a, b, offs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_mm(a, b, offs)
    offs.copy_(torch.tensor([0, 256, 256, 400], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(a, b, [0, 256, 256, 400])) < 1e-2
