"""The GEMM's sliced-K schedule (gemm SLICED_K, tk.lcf(sliced=True)): two
consumer warpgroups compute each 64-row tile over alternate K steps, the
second's partial added to the first's through shared memory.

Without a GPU: the product in the interpreter against float64 (B as N x K
and K x N, A as K x M, C += the product, split-K, odd step counts, tiles cut
by the edges, blocks with one task, several or none), the argument rules,
and ptxas (no spill, no C75xx). With one (`-m gpu`): the candidate plans on
the GPU.
"""
from __future__ import annotations

import re

import pytest
import torch

import tk_mlir as tk
from tk_mlir.kernels import gemm
from torch_reference import gemm_operands, relative_error

SLICED = dict(BM=64, BN=128, STAGES=4, SLICED_K=True, num_warps=12)


@pytest.mark.parametrize("M, N, K, grid, b_kn", [
    (70, 136, 576, 1, False),       # 9 K steps: the first consumer takes one more
    (130, 256, 448, 3, True),       # 7 steps, tasks start on either consumer's stage
    (64, 128, 64, 2, False),        # one step: the second consumer has none; a block has no task
])
def test_sliced_product_in_the_interpreter(M, N, K, grid, b_kn):
    a, b, ref = gemm_operands(M, N, K, b_kn=b_kn)
    c = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    gemm.gemm_kernel.kernel.interpret[(grid,)](a, b, c, B_KN=b_kn, **SLICED)
    assert relative_error(c, ref) < 8e-3


@pytest.mark.parametrize("b_kn", [False, True])
def test_sliced_64_by_256_tiles_store_from_registers(b_kn):
    """sliced_config(256): four stages beside the 64 x 256 partial, C stored
    from registers (no staging tile fits); 5 K steps, tiles cut by M and N."""
    a, b, ref = gemm_operands(100, 328, 320, b_kn=b_kn)
    c = torch.full((100, 328), float("nan"), dtype=torch.bfloat16)
    config = gemm.sliced_config(256)
    assert config["STAGES"] == 4 and config["TMA_STORE"] is False
    gemm.gemm_kernel.kernel.interpret[(2,)](a, b, c, B_KN=b_kn, **config)
    assert relative_error(c, ref) < 8e-3


def test_sliced_a_given_as_k_by_m_accumulates_into_c():
    a, b, ref = gemm_operands(128, 64, 320, a_km=True)
    c0 = torch.empty(128, 64).uniform_(-1, 1).bfloat16()
    c = c0.clone()
    gemm.gemm_kernel.kernel.interpret[(1,)](a, b, c, A_KM=True, ACCUMULATE=True,
                                            **gemm.sliced_config(64))
    assert relative_error(c, ref + c0.double()) < 8e-3


def test_sliced_split_k_through_run_plan(interpret):
    """The split and unsplit sliced candidates, as the table script runs them."""
    a, b, ref = gemm_operands(100, 200, 1152)
    plans = [p for p in gemm.candidate_plans(100, 200, 1152, 8) if p.config.get("SLICED_K")]
    assert {p.kernel for p in plans} == {"tiles", "split_k"}
    for chosen in plans:
        c = torch.full((100, 200), float("nan"), dtype=torch.bfloat16)
        gemm.run_plan(chosen, a, b, c, "nk", "mk", 8)
        assert relative_error(c, ref) < 8e-3, chosen.why


@pytest.mark.parametrize("option, message", [
    (dict(BM=128), r"SLICED_K takes tiles of BM = 64 rows \(got 128\)"),
    (dict(STAGES=2), r"lcf\(sliced=True\) needs stages a multiple of the consumers .* at "
                     r"least two stages per consumer .*: stages=2 with consumers=2; try 4"),
    (dict(STAGES=5), r"stages=5 with consumers=2; try 4 \(or 6 if shared memory"),
    (dict(PINGPONG=True), "SLICED_K is built for .* no CLUSTER, CLUSTER_SPLIT, PINGPONG"),
])
def test_sliced_rules(option, message):
    a, b, _ = gemm_operands(256, 256, 128)
    c = torch.empty(256, 256, dtype=torch.bfloat16)
    with pytest.raises(tk.CompilationError, match=message):
        gemm.gemm_kernel.kernel.compile(a, b, c, **{**SLICED, **option})


@pytest.mark.parametrize("bn, split", [(0, False), (96, False), (192, False), (64.0, False),
                                       (256, True)])
def test_sliced_config_refuses_widths_it_cannot_take(bn, split):
    with pytest.raises(ValueError, match=rf"gemm.sliced_config: .*got bn={bn}"):
        gemm.sliced_config(bn, split=split)


@pytest.mark.parametrize("bn, b_kn", [(128, False), (64, True), (256, False), (256, True)])
def test_sliced_compiles_without_spills_or_serialized_mmas(bn, b_kn):
    spec = tk.spec((4096, 4096), tk.bf16)
    compiled = gemm.gemm_kernel.kernel.compile(spec, spec, spec, B_KN=b_kn,
                                               **gemm.sliced_config(bn))
    assert compiled.info["spill stores (bytes)"] == 0, compiled.ptxas_log
    assert not re.findall(r"C75\d\d", compiled.ptxas_log), compiled.ptxas_log
    assert compiled.info["dynamic shared memory (bytes)"] <= 227 * 1024
    ptx = compiled.asm["ptx"]
    assert ptx.count("bar.arrive") >= 2 and "wgmma.mma_async.sync.aligned.m64n" in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_sliced_plans_on_the_gpu(b_layout):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for M, N, K in [(256, 4096, 4096), (64, 4096, 4096), (200, 1000, 2000), (1, 520, 136)]:
        a, b, ref = gemm_operands(M, N, K, b_kn=b_layout == "kn", device="cuda")
        for chosen in gemm.candidate_plans(M, N, K, sms):
            if chosen.config.get("SLICED_K"):
                c = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
                gemm.run_plan(chosen, a, b, c, b_layout, "mk", sms)
                assert relative_error(c, ref) < 8e-3, (M, N, K, chosen.why)


@pytest.mark.parametrize("K, kernel, bn", [(1152, "split_k", 128), (256, "tiles", 256)])
def test_a_sliced_plan_accumulates_with_tiles_that_stage_c(interpret, K, kernel, bn):
    """c += the product with a sliced plan (linear_cross_entropy's dweight),
    ACCUMULATE adding through staging tiles: a split plan's tiles unsplit, the
    ring re-sized beside the staging tile (the split config's eight stages
    would not fit); a 64 x 256 one, which has no staging tile, as 64 x 128."""
    a, b, ref = gemm_operands(100, 200, K)
    chosen = next(p for p in gemm.candidate_plans(100, 200, K, 8)
                  if p.kernel == kernel and p.config.get("SLICED_K") and p.config["BN"] == bn)
    c0 = torch.empty(100, 200).uniform_(-1, 1).bfloat16()
    c = c0.clone()
    gemm._accumulate(a, b, c, chosen, 8, False, False)
    assert relative_error(c, ref + c0.double()) < 8e-3


@tk.kernel(num_warps=12)
def _sliced_lcf(A: tk.gl, C: tk.gl[tk.f32], CONSUMERS: tk.constexpr, PINGPONG: tk.constexpr):
    def load(task, k, a, sem):
        tk.tma.load_async(a, A, (task, k), sem)

    def setup(task, wg):
        return tk.zeros((64, 64), tk.f32, layout="row", scope="warpgroup")

    def compute(acc, wg, a):
        return tk.mma_ABt(acc, a, a)

    def finish(acc, task, wg):
        tk.atomic_add(C, acc, (task, 0))

    tk.lcf(2, 2, [(A.dtype, (64, 64), 128)], load, setup, compute, finish, stages=4,
           consumers=CONSUMERS, pingpong=PINGPONG, sliced=True)


@pytest.mark.parametrize("consumers, pingpong, message", [
    (2, True, r"lcf\(sliced=True\) and pingpong=True are two schedules .*: pick one"),
    (1, False, r"lcf\(sliced=True\) shares .* consumers >= 2, got 1"),
])
def test_lcf_sliced_rules(consumers, pingpong, message):
    with pytest.raises(tk.CompilationError, match=message):
        _sliced_lcf.compile(tk.spec((128, 128), tk.bf16), tk.spec((128, 64), tk.f32),
                            CONSUMERS=consumers, PINGPONG=pingpong,
                            num_warps=4 * (consumers + 1))


@tk.kernel(num_warps=12)
def _which_consumer(A: tk.gl, ITERS: tk.gl["i32"], C: tk.gl[tk.f32]):
    """Each consumer sums the stage tiles it took, per task, into C[task,
    consumer]: A's tile (task, k) holds 2^(its ring position)."""
    def load(task, k, a, sem):
        tk.tma.load_async(a, A, (task, k), sem)

    def setup(task, wg):
        return tk.zeros((64, 64), tk.f32, layout="row", scope="warpgroup")

    def compute(acc, wg, a):
        acc = acc + tk.load(a, layout="row", scope="warpgroup").to(tk.f32)
        tk.named_barrier(5 + wg, warps=4)        # every warp's read, before the release
        return acc

    def finish(acc, task, wg):
        tk.store(C, acc, (task, wg))

    def iters_of(task):
        return tk.load(ITERS, (task,))

    tk.lcf(ITERS.shape[0] - 1, 0, [(A.dtype, (64, 64), 128)], load, setup, compute, finish,
           stages=4, consumers=2, sliced=True, task_iters=iters_of)


def test_a_ring_position_always_goes_to_the_same_consumer():
    """lcf(sliced=True)'s invariant: consumer c takes the ring positions = c
    mod consumers, across tasks of odd iteration counts too (a task that
    started on consumer 0 whatever its first position would hand a stage to
    both consumers in turn, and one could then pass a wait two phases off)."""
    iters = [3, 1, 2]
    a = torch.zeros(3 * 64, 3 * 64, dtype=torch.bfloat16)
    position = 0
    for t, n in enumerate(iters):
        for k in range(n):
            a[t * 64:(t + 1) * 64, k * 64:(k + 1) * 64] = 2.0 ** position
            position += 1
    c = torch.full((3 * 64, 2 * 64), float("nan"))
    _which_consumer.interpret[(1,)](a, torch.tensor(iters + [0], dtype=torch.int32), c)
    # positions 0 2 | 1 (task 0), - | 3 (task 1), 4 | 5 (task 2)
    assert c[::64, ::64].tolist() == [[1 + 4, 2], [0, 8], [16, 32]]
