"""The GEMM's ping-pong schedule (gemm PINGPONG, tk.lcf(pingpong=True)): two
consumer warpgroups take whole tiles in turn, their main loops ordered by
named barriers, and tk.wait_phase, whose interpreter check is by phase
number (a ping-pong consumer skips the other's phases).

Without a GPU: the product in the interpreter against float64 (plain,
batched, B as K x N, A as K x M, C += the product, f32 C, tiles cut by the
edges, blocks with one task or many), the interpreter reporting the schedule
without its turns, tk.wait_phase's check, the argument rules, and ptxas
(no spill, no C75xx). With one (`-m gpu`): the same products on the GPU.
"""
from __future__ import annotations

import re

import pytest
import torch

import tk_mlir as tk
from tk_mlir import f32, templates
from tk_mlir.interpreter import InterpretError
from tk_mlir.kernels import gemm
from torch_reference import gemm_operands, relative_error

gpu = pytest.mark.gpu
PINGPONG = gemm.pingpong_config(128, 128)


@pytest.mark.parametrize("M, N, K, grid, config", [
    (256, 128, 256, 1, PINGPONG),           # one task each
    (640, 128, 512, 2, PINGPONG),           # several tasks each, the ring wrapping in a task
    (200, 296, 200, 3, PINGPONG),           # tiles cut by every edge
    (130, 600, 104, 1, gemm.pingpong_config(64, 256)),
    (128, 128, 1000, 4, PINGPONG),          # one task for four blocks: three without any
])
@pytest.mark.parametrize("b_kn", [False, True])
def test_pingpong_product_in_the_interpreter(M, N, K, grid, config, b_kn):
    a, b, ref = gemm_operands(M, N, K, b_kn=b_kn)
    c = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    gemm.gemm_kernel.kernel.interpret[(grid,)](a, b, c, B_KN=b_kn, **config)
    assert relative_error(c, ref) < 8e-3


def test_pingpong_batched_a_given_as_k_by_m_into_f32():
    a, b, ref = gemm_operands(136, 200, 192, a_km=True, batch=3)
    c = torch.full((3, 136, 200), float("nan"))
    gemm.gemm_kernel.kernel.interpret[(2,)](a, b, c, A_KM=True, **PINGPONG)
    assert relative_error(c, ref) < 2e-3


def test_pingpong_accumulates_into_c():
    a, b, ref = gemm_operands(192, 128, 128)
    c0 = torch.empty(192, 128).uniform_(-1, 1).bfloat16()
    c = c0.clone()
    gemm.gemm_kernel.kernel.interpret[(2,)](a, b, c, ACCUMULATE=True, **PINGPONG)
    assert relative_error(c, ref + c0.double()) < 8e-3


def test_every_pingpong_candidate_plan_through_run_plan(interpret):
    """The plans candidate_plans offers the measured table, as the table
    script runs them."""
    a, b, ref = gemm_operands(300, 520, 136)
    plans = [p for p in gemm.candidate_plans(300, 520, 136, 3) if p.config.get("PINGPONG")]
    assert len(plans) == len(gemm.CANDIDATE_PINGPONG_TILES)
    for chosen in plans:
        c = torch.full((300, 520), float("nan"), dtype=torch.bfloat16)
        gemm.run_plan(chosen, a, b, c, "nk", "mk", 3)
        assert relative_error(c, ref) < 8e-3, chosen.why


@tk.func
def _no_barrier(id, warps):
    return None


def test_the_interpreter_reports_pingpong_without_its_turns(monkeypatch):
    """Without the named barriers ordering the main loops, the second
    consumer waits for a stage two phases on while the first has yet to see
    its data land: tk.wait_phase's check reports it."""
    monkeypatch.setattr(templates.tk, "named_barrier", _no_barrier)
    monkeypatch.setattr(templates.tk, "named_barrier_arrive", _no_barrier)
    # (store_in_pieces' epilogue barriers too: f32 C leaves from registers, without them)
    a, b, _ = gemm_operands(256, 128, 1024)
    c = torch.full((256, 128), float("nan"))
    with pytest.raises(InterpretError, match=r"tk\.wait_phase: warp \d+ waits .* for phase \d+"):
        gemm.gemm_kernel.kernel.interpret[(1,)](a, b, c, BM=128, BN=128, STAGES=3,
                                                PINGPONG=True, num_warps=12)


@tk.kernel(num_warps=1)
def _wait_for(X: tk.gl[f32], PHASE: tk.constexpr, ARRIVALS: tk.constexpr):
    sem = tk.semaphore()
    for _ in tk.static_range(ARRIVALS):
        if tk.elect_leader():
            tk.arrive(sem)
    tk.wait_phase(sem, PHASE)
    tk.store(X, tk.zeros((1, 32), f32), (0, 0))


def test_wait_phase_checks_the_phase_number():
    x = torch.rand(1, 32)
    _wait_for.interpret[(1,)](x, PHASE=0, ARRIVALS=1)          # phase 0 done: passes
    _wait_for.interpret[(1,)](x, PHASE=1, ARRIVALS=2)
    assert not x.any()
    with pytest.raises(InterpretError, match="no phase completed yet: phase 0 had not "
                                             "completed, so the GPU's wait returns at once"):
        _wait_for.interpret[(1,)](x, PHASE=1, ARRIVALS=0)     # parity 1: passes on a fresh one
    with pytest.raises(InterpretError, match="phase 2 had not completed"):
        _wait_for.interpret[(1,)](x, PHASE=3, ARRIVALS=2)
    with pytest.raises(InterpretError, match=r"phases 1\.\.2 completed too, so the GPU's wait "
                                             r"took phase 2, a later use"):
        _wait_for.interpret[(1,)](x, PHASE=0, ARRIVALS=3)     # two phases behind
    with pytest.raises(InterpretError, match=r"phase 1 has completed too, so on the GPU this "
                                             r"parity wait is for phase 2"):
        _wait_for.interpret[(1,)](x, PHASE=0, ARRIVALS=2)     # one behind: the GPU hangs


@tk.kernel(num_warps=1)
def _wait_for_constant(X: tk.gl[f32], PHASE: tk.constexpr):
    sem = tk.semaphore()
    tk.wait_phase(sem, PHASE)      # E:wait-phase
    tk.store(X, tk.zeros((1, 32), f32), (0, 0))


@pytest.mark.parametrize("phase", [-1, True, 1.0])
def test_wait_phase_takes_a_phase_number(phase):
    with pytest.raises(tk.CompilationError, match=r"tk\.wait_phase: the phase number must be an "
                                                  r"int >= 0") as info:
        _wait_for_constant.compile(tk.spec((1, 32), tk.f32), PHASE=phase)
    assert info.value.line == _line_of("# E:wait-phase")


def _line_of(marker: str) -> int:
    import inspect
    lines, first = inspect.getsourcelines(_wait_for_constant.fn)
    return first + next(i for i, text in enumerate(lines) if text.rstrip().endswith(marker))


@pytest.mark.parametrize("option, message", [
    (dict(BM=128, BN=256), r"PINGPONG takes tiles of BM x BN <= 128 x 128 .*, got 128 x 256"),
    (dict(BM=128, BN=128, CLUSTER=2), "PINGPONG is built for plain and batched products: "
                                      "no SPLIT_K, CLUSTER"),
])
def test_pingpong_rules(option, message):
    a, b, _ = gemm_operands(256, 256, 128)
    c = torch.empty(256, 256, dtype=torch.bfloat16)
    with pytest.raises(tk.CompilationError, match=message):
        gemm.gemm_kernel.kernel.compile(a, b, c, PINGPONG=True, num_warps=12, **option)


@pytest.mark.parametrize("bm, bn", [(128, 256), (256, 128), (32, 128), (128, 0), (64, 72)])
def test_pingpong_config_refuses_tiles_it_cannot_take(bm, bn):
    with pytest.raises(ValueError, match=rf"gemm.pingpong_config: .*got {bm} x {bn}"):
        gemm.pingpong_config(bm, bn)


@tk.kernel(num_warps=8)
def _one_consumer(A: tk.gl, C: tk.gl[f32]):
    def load(task, k, a, sem):
        tk.tma.load_async(a, A, (task, k), sem)

    def setup(task, wg):
        return tk.zeros((64, 64), f32, layout="row", scope="warpgroup")

    def compute(acc, wg, a):
        return tk.mma_ABt(acc, a, a)

    def finish(acc, task, wg):
        tk.store(C, acc, (task, 0))

    tk.lcf(2, 2, [(A.dtype, (64, 64), 128)], load, setup, compute, finish, consumers=1,
           pingpong=True)


def test_pingpong_takes_two_consumers_or_more():
    with pytest.raises(tk.CompilationError, match=r"pingpong=True\) takes turns between "
                                                  r"consumer warpgroups: consumers >= 2, got 1"):
        _one_consumer.compile(tk.spec((128, 128), tk.bf16), tk.spec((128, 64), tk.f32))


@pytest.mark.parametrize("bm, bn", gemm.CANDIDATE_PINGPONG_TILES)
@pytest.mark.parametrize("b_kn", [False, True])
def test_pingpong_compiles_without_spills_or_serialized_mmas(bm, bn, b_kn):
    a, b, c = tk.spec((4096, 4096), tk.bf16), tk.spec((4096, 4096), tk.bf16), \
        tk.spec((4096, 4096), tk.bf16)
    compiled = gemm.gemm_kernel.kernel.compile(a, b, c, B_KN=b_kn,
                                               **gemm.pingpong_config(bm, bn))
    assert compiled.info["spill stores (bytes)"] == 0, compiled.ptxas_log
    assert not re.findall(r"C75\d\d", compiled.ptxas_log), compiled.ptxas_log
    assert compiled.info["dynamic shared memory (bytes)"] <= 227 * 1024
    ptx = compiled.asm["ptx"]
    assert ptx.count("bar.arrive") >= 1 and "wgmma.mma_async.sync.aligned.m64n" in ptx


@gpu
@pytest.mark.parametrize("b_kn", [False, True])
def test_pingpong_on_the_gpu(b_kn):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    for M, N, K, batch in [(1000, 3000, 2000, None), (4096, 4096, 4096, None), (300, 520, 136, 3)]:
        for config in (gemm.pingpong_config(128, 128), gemm.pingpong_config(64, 256)):
            a, b, ref = gemm_operands(M, N, K, b_kn=b_kn, batch=batch, device="cuda")
            c = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            gemm.gemm_kernel.kernel[(sms,)](a, b, c, B_KN=b_kn, **config)
            assert relative_error(c, ref) < 8e-3, (M, N, K, batch, config)
