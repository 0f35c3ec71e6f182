"""Stream-K (gemm_split_k_kernel with STREAM_K): all tiles' K steps cut evenly
among the grid's blocks, each walking its share across tile boundaries; a
tile shared by blocks meets in the workspace through tk.store_partial with a
run-time number of parts.

Without a GPU: the product in the interpreter against float64 (grids that
cut tiles anywhere, more blocks than K steps, B as K x N, A as K x M,
batched products), the workspace and counters left zero, tk.store_partial
with a run-time part count, the argument rules, ptxas (no spill, no C75xx).
With one (`-m gpu`): the same products on the GPU.
"""
from __future__ import annotations

import re

import pytest
import torch

import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.interpreter import InterpretError
from tk_mlir.kernels import gemm
from torch_reference import gemm_operands, relative_error

gpu = pytest.mark.gpu


def _stream_k(a, b, c, grid, *, b_kn=False, a_km=False, bm=64, bn=128, interpret=True):
    """c = the product by stream-K on `grid` blocks; returns (workspace, counters)."""
    M, N = c.shape[-2:]
    batch = c.shape[0] if c.dim() == 3 else 1
    w = torch.zeros(c.shape, device=c.device)
    f = torch.zeros(gemm.split_k_counters(M, N, bn, batch), dtype=torch.int32, device=c.device)
    kernel = gemm.gemm_split_k_kernel.interpret if interpret else gemm.gemm_split_k_kernel
    kernel[(grid,)](a, b, c, w, f, SPLIT_K=1, STREAM_K=True, B_KN=b_kn, BM=bm, BN=bn,
                    STAGES=3, num_warps=4 * (bm // 64 + 1), **({"A_KM": True} if a_km else {}))
    return w, f


@pytest.mark.parametrize("M, N, K, grid, bm", [
    (128, 256, 640, 3, 64),          # 4 tiles of 10 K steps on 3 blocks: every tile shared
    (200, 264, 1000, 5, 64),         # edges cut; ranges of 19 and 20 steps
    (300, 520, 136, 7, 128),         # 3 K steps a tile
    (64, 128, 64, 4, 64),            # one K step in all: three blocks without any
    (136, 128, 4096, 2, 128),        # a block's range longer than a tile
])
@pytest.mark.parametrize("b_kn", [False, True])
def test_stream_k_product_in_the_interpreter(M, N, K, grid, bm, b_kn):
    a, b, ref = gemm_operands(M, N, K, b_kn=b_kn)
    c = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    w, f = _stream_k(a, b, c, grid, b_kn=b_kn, bm=bm)
    assert relative_error(c, ref) < 8e-3
    assert not w.any() and not f.any()          # left zero for the next launch


def test_stream_k_batched_a_given_as_k_by_m():
    a, b, ref = gemm_operands(72, 136, 320, a_km=True, batch=3)
    c = torch.full((3, 72, 136), float("nan"))
    w, f = _stream_k(a, b, c, 5, a_km=True)
    assert relative_error(c, ref) < 2e-3
    assert not w.any() and not f.any()


def test_stream_k_candidate_plans_through_run_plan(interpret):
    a, b, ref = gemm_operands(200, 264, 1000)
    # (11 SMs: every split tile makes fewer than two waves of tiles here)
    plans = [p for p in gemm.candidate_plans(200, 264, 1000, 11) if p.kernel == "stream_k"]
    assert {(p.config["BM"], p.config["BN"]) for p in plans} == set(gemm.CANDIDATE_SPLIT_TILES)
    for chosen in plans:
        c = torch.full((200, 264), float("nan"), dtype=torch.bfloat16)
        gemm.run_plan(chosen, a, b, c, "nk", "mk", 11)
        assert relative_error(c, ref) < 8e-3, chosen.why


def test_no_stream_k_candidates_where_tiles_fill_two_waves():
    assert not [p for p in gemm.candidate_plans(8192, 8192, 1024, 132) if p.kernel == "stream_k"]


@tk.kernel(num_warps=4)
def _runtime_parts(X: tk.gl[f32], Y: tk.gl[f32], W: tk.gl[f32], F: tk.gl["i32"], parts: int):
    j = tk.block_id(1)
    x = tk.load(X, (tk.block_id(0), j), (16, 64))
    tk.store_partial(Y, x, (0, j), parts=parts, workspace=W, counters=F)


def test_store_partial_takes_a_run_time_part_count():
    x = torch.empty(3 * 16, 128).uniform_(-1, 1)
    y, w = torch.full((16, 128), float("nan")), torch.zeros(16, 128)
    f = torch.zeros(2 * 128, dtype=torch.int32)
    _runtime_parts.interpret[(3, 2)](x, y, w, f, 3)
    assert torch.allclose(y, x.view(3, 16, 128).sum(0), atol=1e-6)
    assert not w.any() and not f.any()
    with pytest.raises(InterpretError, match="parts is 0; a tile has at least one part"):
        _runtime_parts.interpret[(3, 2)](x, y, w, f, 0)


def test_stream_k_rules():
    s = tk.spec
    with pytest.raises(tk.CompilationError, match="STREAM_K takes the workspace W and counters "
                                                  r"F of split-K \(SPLIT_K = 1\)"):
        gemm.gemm_split_k_kernel.compile(s((128, 256), "bf16"), s((128, 256), "bf16"),
                                         s((128, 128), "bf16"), s((128, 128), "f32"),
                                         s((1024,), "i32"), SPLIT_K=2, STREAM_K=True)


@pytest.mark.parametrize("bm, bn", gemm.CANDIDATE_SPLIT_TILES)
def test_stream_k_compiles_without_spills_or_serialized_mmas(bm, bn):
    s = tk.spec
    M, N, K = 256, 11008, 4096
    config = gemm.stream_k_config(bm, bn)
    compiled = gemm.gemm_split_k_kernel.compile(
        s((M, K), "bf16"), s((N, K), "bf16"), s((M, N), "bf16"), s((M, N), "f32"),
        s((gemm.split_k_counters(M, N, bn),), "i32"), **config)
    assert compiled.info["spill stores (bytes)"] == 0, compiled.ptxas_log
    assert not re.findall(r"C75\d\d", compiled.ptxas_log), compiled.ptxas_log
    assert "atom.acq_rel.gpu.global.add.u32" in compiled.asm["ptx"]


@gpu
@pytest.mark.parametrize("b_kn", [False, True])
def test_stream_k_on_the_gpu(b_kn):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for M, N, K, batch in [(256, 11008, 4096, None), (96, 12288, 4096, None),
                           (1000, 1000, 3000, None), (72, 136, 320, 3)]:
        for bm, bn in gemm.CANDIDATE_SPLIT_TILES:
            a, b, ref = gemm_operands(M, N, K, b_kn=b_kn, batch=batch, device="cuda")
            c = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
            w, f = _stream_k(a, b, c, sms, b_kn=b_kn, bm=bm, bn=bn, interpret=False)
            assert relative_error(c, ref) < 8e-3, (M, N, K, batch, bm, bn)
            assert not w.any() and not f.any()


def test_only_the_measured_table_chooses_ping_pong_or_stream_k():
    """Neither schedule has been timed: the rules never take them (a table
    row measured on a GPU may)."""
    for M in (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
        for N, K in [(4096, 4096), (11008, 4096), (14336, 4096), (4096, 14336), (1024, 8192)]:
            for batch in (1, 4):
                chosen = gemm.rules_plan(M, N, K, 132, batch)
                assert chosen.kernel != "stream_k" and not chosen.config.get("PINGPONG"), \
                    (M, N, K, batch, chosen)


def test_split_k_counts_of_zero_are_refused():
    s = tk.spec
    with pytest.raises(tk.CompilationError, match=r"SPLIT_K=0: the number of K slices, an int "
                                                  r">= 1"):
        gemm.gemm_split_k_kernel.compile(s((128, 256), "bf16"), s((128, 256), "bf16"),
                                         s((128, 128), "bf16"), s((128, 128), "f32"),
                                         s((1024,), "i32"), SPLIT_K=0)


def test_a_workspace_that_does_not_start_at_zero_is_reported():
    a, b, _ = gemm_operands(128, 256, 640)
    c = torch.full((128, 256), float("nan"), dtype=torch.bfloat16)
    w = torch.zeros(128, 256)
    w[3, 5] = 1.0
    f = torch.zeros(gemm.split_k_counters(128, 256, 128), dtype=torch.int32)
    with pytest.raises(InterpretError, match=r"the workspace 'W' must start as zeros \(1 "
                                             r"element\(s\) are not, the first at \(3, 5\), "
                                             r"holding \[1.0\]\): every part adds into it"):
        gemm.gemm_split_k_kernel.interpret[(3,)](a, b, c, w, f, SPLIT_K=1, STREAM_K=True,
                                                 STAGES=3)


def test_cdiv_on_the_host():
    import numpy as np
    assert tk.cdiv(np.int64(5), 2) == tk.cdiv(5, np.int32(2)) == 3 and tk.cdiv(8, 4) == 2
    for bad in [(5.0, 2), (5, "2")]:
        with pytest.raises(TypeError, match="tk.cdiv takes ints"):
            tk.cdiv(*bad)


def test_plan_functions_check_their_arguments():
    import numpy as np
    assert gemm.candidate_plans(np.int64(64), 4096, 4096, 132) == \
        gemm.candidate_plans(64, 4096, 4096, 132)
    with pytest.raises(ValueError, match="gemm.rules_plan: sms must be at least 1, got 0"):
        gemm.rules_plan(64, 4096, 4096, 0)
    with pytest.raises(ValueError, match="gemm.candidate_plans: M must be at least 0, got -64"):
        gemm.candidate_plans(-64, 64, 64, 4)
    with pytest.raises(TypeError, match="gemm.candidate_plans: M must be an int, got 64.0"):
        gemm.candidate_plans(64.0, 64, 64, 4)
