"""grouped_matmul's `sizes` (defect 8): host sizes (a list, a tuple, a CPU
tensor) are checked, each in [0, M], before anything reaches the GPU; a size
past M is a ValueError naming sizes[g], its value and the rule, never a
silent clamp. Device sizes are not read on the host (that would wait for the
GPU) and are clamped by the kernel: tests/test_gemm_gpu.py's "clamped" case."""
import pytest

torch = pytest.importorskip("torch")
from tk_mlir.kernels import grouped_matmul  # noqa: E402
from tk_mlir.kernels.grouped_gemm import check_sizes  # noqa: E402


def cpu(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


A, B = cpu(3, 8, 16), cpu(3, 4, 16)        # G = 3 products of at most M = 8 rows


@pytest.mark.parametrize("sizes", [
    [2, 9, 1], (2, 9, 1), torch.tensor([2, 9, 1]), torch.tensor([2, 9, 1], dtype=torch.int32)],
    ids=["list", "tuple", "int64", "int32"])
def test_a_size_past_m_is_refused(sizes):
    with pytest.raises(ValueError, match=r"^grouped_matmul: sizes\[1\] is 9, outside \[0, M\] = "
                                         r"\[0, 8\]: each product has at most M rows "
                                         r"\(a is G x M x K = \(3, 8, 16\)\)$"):
        grouped_matmul(A, B, sizes)


def test_a_negative_size_is_refused():
    with pytest.raises(ValueError, match=r"sizes\[2\] is -1, outside \[0, M\] = \[0, 8\]"):
        grouped_matmul(A, B, [0, 8, -1])


def test_the_first_bad_size_is_named():
    with pytest.raises(ValueError, match=r"sizes\[0\] is 100,"):
        grouped_matmul(A, B, torch.tensor([100, -5, 9]))


def test_a_size_not_an_int_is_refused():
    with pytest.raises(TypeError, match=r"grouped_matmul: sizes\[1\] must be an int "
                                        r"\(a row count\), got float 2.5"):
        grouped_matmul(A, B, [1, 2.5, 3])


def test_numpy_ints_are_sizes_and_a_bare_int_is_refused(interpret):
    import numpy as np
    ref = grouped_matmul(A, B, [1, 2, 3])
    assert torch.equal(grouped_matmul(A, B, [np.int64(1), np.int32(2), 3]), ref)
    with pytest.raises(TypeError, match=r"grouped_matmul: sizes must be G=3 row counts, a list "
                                        r"of ints or a 1-D int32 or int64 tensor on cpu, got int"):
        grouped_matmul(A, B, 3)
    with pytest.raises(TypeError, match=r"got a numpy.ndarray of shape \(3,\) int64"):
        grouped_matmul(A, B, np.array([1, 2, 3]))         # (named: not a tensor's shape)


def test_sizes_of_another_length_are_refused():
    with pytest.raises(ValueError, match=r"sizes must be a 1-D int32 or int64 tensor of G=3 "
                                         r"row counts on cpu, got shape \(2,\) torch.int64"):
        grouped_matmul(A, B, [1, 2])


def test_good_host_sizes_pass_on_to_the_device_rule():
    # Every other rule holds: the CPU tensor a is refused last, for its device.
    for sizes in ([0, 8, 3], torch.tensor([8, 8, 8], dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"grouped_matmul: a must be on a CUDA device"):
            grouped_matmul(A, B, sizes)


def test_host_sizes_become_a_tensor():
    s = check_sizes((1, 2, 3), A)
    assert s.dtype == torch.int64 and s.tolist() == [1, 2, 3]


class _CudaLike:
    """A 3-D tensor's metadata on cuda:0, for the message's wording."""
    shape, device = (3, 8, 16), torch.device("cuda", 0)


def test_sizes_on_a_third_device_are_refused_naming_both_places():
    meta = torch.empty(3, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"row counts on the CPU or cuda:0, got shape \(3,\) "
                                         r"torch.int64 on meta"):
        check_sizes(meta, _CudaLike())


@pytest.mark.gpu
def test_host_sizes_on_the_gpu():
    """Checked host sizes are copied to a's device and used there."""
    G, M, N, K = 3, 256, 128, 64
    a = torch.empty(G, M, K, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    b = torch.empty(G, N, K, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    sizes = [256, 0, 130]
    for given in (sizes, torch.tensor(sizes)):
        c = grouped_matmul(a, b, given)
        ref = a.double() @ b.double().transpose(1, 2)
        for g, n in enumerate(sizes):
            if n:
                err = ((c[g, :n].double() - ref[g, :n]).norm() / ref[g, :n].norm()).item()
                assert err < 5e-3, (g, err)
    with pytest.raises(ValueError, match=r"sizes\[0\] is 257"):
        grouped_matmul(a, b, [257, 0, 0])


def test_sizes_reach_the_kernel_as_they_are_when_they_can():
    """The kernel reads the sizes itself (no schedule made in torch): int32
    sizes with rows of whole 16-byte vectors pass as they are, others as an
    int32 copy padded to a multiple of 4."""
    from tk_mlir.kernels.grouped_gemm import sizes_operand
    s = torch.tensor([5, 0, 7, 9], dtype=torch.int32)
    assert sizes_operand(s, 8) is s
    for sizes in (torch.tensor([5, 0, 7, 8]), torch.tensor([5, 0, 7], dtype=torch.int32)):
        operand = sizes_operand(sizes, 8)
        assert operand.dtype == torch.int32 and operand.shape[0] % 4 == 0
        assert operand[:len(sizes)].tolist() == sizes.tolist()
    # int64 sizes past int32 are clamped to [0, M] before the cast, not wrapped
    wide = sizes_operand(torch.tensor([2**32 + 1, 2**31, -5, 7]), 200)
    assert wide.tolist() == [200, 200, 0, 7]


def test_the_packed_schedule_needs_the_bits_of_g():
    import tk_mlir as tk
    from tk_mlir.kernels.grouped_gemm import grouped_gemm_kernel
    with pytest.raises(tk.CompilationError, match="DENSE takes LOG_G >= 1, the bits of G - 1"):
        grouped_gemm_kernel.compile(tk.spec((3, 256, 64), "bf16"), tk.spec((3, 128, 64), "bf16"),
                                    tk.spec((3, 256, 128), "bf16"), tk.spec((4,), "i32"),
                                    DENSE=True)


def test_many_waves_of_tiles_take_the_packed_schedule():
    from tk_mlir.kernels.grouped_gemm import dense_schedule
    assert dense_schedule(8, 2048, 4096, 256, 132)          # 2048 tiles: 15.5 waves
    assert not dense_schedule(8, 1024, 1024, 256, 132)      # 256 tiles
    assert not dense_schedule(8, 128, 1024, 256, 132)       # 32 tiles: host-bound


@pytest.mark.parametrize("kn, dense", [(False, False), (True, False), (False, True)])
def test_the_kernel_compiles_without_spills(kn, dense):
    import tk_mlir as tk
    from tk_mlir.kernels.grouped_gemm import grouped_gemm_kernel
    b = tk.spec((8, 1024, 4096) if kn else (8, 4096, 1024), "bf16")
    compiled = grouped_gemm_kernel.compile(tk.spec((8, 2048, 1024), "bf16"), b,
                                           tk.spec((8, 2048, 4096), "bf16"),
                                           tk.spec((12 if dense else 8,), "i32"), B_KN=kn,
                                           DENSE=dense, LOG_G=3 if dense else 0)
    assert compiled.info["spill stores (bytes)"] == 0 and compiled.info["spill loads (bytes)"] == 0
    assert "C75" not in compiled.ptxas_log, compiled.ptxas_log


@pytest.mark.parametrize("G, M, N, b_layout", [(3, 200, 136, "nk"),       # in place
                                               (5, 300, 72, "kn"),        # packed (> 4 waves)
                                               (2, 130, 100, "nk")])      # N: padded copies
def test_a_remembered_signature_computes_each_calls_sizes(interpret, monkeypatch, G, M, N,
                                                          b_layout):
    """grouped_matmul's eager path through the interpreter: a second call of
    one signature (its launch planned once, at the first: one launcher per
    signature; none where N needs padded copies) with other sizes, into a
    new c and into a given one, against float64; rows past a product's
    last tile stay as they were."""
    from tk_mlir.kernels import eager, grouped_gemm, grouped_matmul
    monkeypatch.setattr(grouped_gemm, "_PREPARED", eager.Prepared())
    kernel, launchers = grouped_gemm.grouped_gemm_kernel, []
    make = kernel._signature_launcher
    monkeypatch.setattr(kernel, "_signature_launcher",
                        lambda *a, **k: launchers.append(k) or make(*a, **k))
    g = torch.Generator().manual_seed(G * M + N)
    K = 64
    a = torch.randn(G, M, K, generator=g).bfloat16()
    b = torch.randn(*((G, K, N) if b_layout == "kn" else (G, N, K)), generator=g).bfloat16()
    ref = a.double() @ (b.double() if b_layout == "kn" else b.double().transpose(1, 2))
    for sizes in (torch.randint(0, M + 1, (G,), generator=g), torch.full((G,), M // 2)):
        for c in (None, torch.full((G, M, N), float("nan")).bfloat16()):
            out = grouped_matmul(a, b, sizes, c, b_layout=b_layout)
            assert c is None or out is c
            for i, n in enumerate(sizes.tolist()):
                if n:
                    err = (out[i, :n].double() - ref[i, :n]).norm() / ref[i, :n].norm()
                    assert err < 8e-3, (sizes, i)
                if c is not None:
                    assert out[i, -(-n // 128) * 128:].isnan().all()
    assert len(grouped_gemm._PREPARED) == 2         # (one signature with c, one without)
    assert len(launchers) == (0 if N % 8 else 2)
    tiles = G * -(-M // 128) * -(-N // (256 if N > 128 else 128))
    assert all(k["DENSE"] == (tiles > 4 * 3) for k in launchers)       # (3 simulated SMs)
