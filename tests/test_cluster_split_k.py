"""gemm_cluster_split_k_kernel: split-K whose slices are the blocks of a
cluster, summed through distributed shared memory (no workspace, no
atomics). Against float64 in the interpreter at ragged shapes and both
layouts of B, in the PTX, and on the GPU (marked)."""
from __future__ import annotations

import pytest
import torch

import tk_mlir as tk
from tk_mlir import bf16
from tk_mlir.kernels import gemm


def _run(M, N, K, split, kn, bm, device="cpu"):
    g = torch.Generator(device=device).manual_seed(M + N + K + split)
    a = torch.randn(M, K, generator=g, device=device).bfloat16()
    b = torch.randn(*((K, N) if kn else (N, K)), generator=g, device=device).bfloat16()
    c = torch.full((M, N), float("nan"), device=device).bfloat16()
    grid = (tk.cdiv(M, bm) * tk.cdiv(N, 128) * split,)
    cfg = gemm.cluster_split_config(bm, 128, split)
    launch = gemm.gemm_cluster_split_k_kernel[grid] if device == "cuda" else \
        gemm.gemm_cluster_split_k_kernel.interpret[grid]
    launch(a, b, c, B_KN=kn, **cfg)
    ref = a.double() @ (b.double() if kn else b.double().T)
    return ((c.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("M, N, K, split, kn, bm", [
    (64, 128, 512, 2, False, 64),       # one tile, two slices
    (100, 200, 704, 4, False, 64),      # ragged M and N: rows and columns past C unwritten
    (130, 256, 304, 4, True, 128),      # B as K x N, two consumers, slices of unequal K
    (64, 128, 1024, 8, False, 64),      # eight slices of 8 rows each
    (16, 136, 96, 4, True, 64),         # fewer K steps than slices: some slices add zeros
])
def test_the_cluster_sums_its_slices(M, N, K, split, kn, bm):
    assert _run(M, N, K, split, kn, bm) < 4e-3


def test_it_compiles_to_distributed_shared_memory_and_no_atomics(ptxas):
    c = gemm.gemm_cluster_split_k_kernel.compile(
        tk.spec((128, 4096), bf16), tk.spec((4096, 4096), bf16), tk.spec((128, 4096), bf16),
        **gemm.cluster_split_config(64, 128, 4))
    ptx = c.asm["ptx"]
    assert "ld.shared::cluster" in ptx and "mapa.shared::cluster" in ptx
    assert "red.global" not in ptx and "atom.global" not in ptx
    assert ".reqnctapercluster 4" in ptx
    assert "C75" not in c.ptxas_log, c.ptxas_log
    assert c.info["spill stores (bytes)"] <= 8, c.ptxas_log
    assert c.info["dynamic shared memory (bytes)"] <= 232448


@pytest.mark.parametrize("split", [3, 16])
def test_a_split_the_cluster_cannot_take_is_refused(split):
    """3 blocks is not a cluster size the kernel takes; 16 is past the
    portable cluster size (and leaves 4 of 64 rows a block)."""
    with pytest.raises(tk.CompilationError, match=rf"CLUSTER_SPLIT={split}: 2, 4 or 8 blocks"):
        gemm.gemm_cluster_split_k_kernel.compile(
            tk.spec((64, 256), bf16), tk.spec((128, 256), bf16), tk.spec((64, 128), bf16),
            SPLIT=split, STAGES=4)


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, split, kn, bm", [(128, 4096, 4096, 4, False, 64),
                                                    (100, 1032, 2056, 8, True, 64),
                                                    (256, 512, 1024, 2, False, 128)])
def test_the_cluster_sums_its_slices_on_the_gpu(M, N, K, split, kn, bm):
    assert _run(M, N, K, split, kn, bm, device="cuda") < 4e-3
