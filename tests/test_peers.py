"""Peer tensors (tk.pgl) and signals without a GPU: the PTX has the
system-scope release/acquire, the fences, the trap on a timeout and a TMA
tensor map per rank; misuse is an error at its line; the arguments a tk.pgl
parameter takes are checked by name; the interpreter runs signals and refuses
peer tensors. tests/test_peers_gpu.py runs the kernels (every rank on one
GPU), tests/test_multi_gpu.py on two GPUs against NCCL."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import tk_mlir as tk
from tk_mlir import bf16, f32
from tk_mlir.interpreter import InterpretError
from tk_mlir.kernels import all_reduce_kernels as ar, gemm_rs

import error_checks

HERE = Path(__file__).resolve()
S, P = tk.spec, tk.peer_spec


def ptx_of(kernel, *args, **kwargs) -> str:
    return kernel.compile(*args, **kwargs).asm["ptx"]


# ------------------------------------------------------------ the PTX

@pytest.mark.parametrize("kernel", [ar.one_shot_kernel, ar.two_shot_kernel])
@pytest.mark.parametrize("world", [1, 2, 8])
def test_all_reduce_ptx_has_system_scope_signals(kernel, world):
    slots = 2 * world + (2 if kernel is ar.two_shot_kernel else 0)
    compiled = kernel.compile(S((7, 8192), bf16), P((slots, 16, 8192), bf16, world),
                              P((132, 2, 8), "i32", world), S((132,), "i32"), BLOCK=2048)
    ptx = compiled.asm["ptx"]
    assert "red.release.sys.global.add.u32" in ptx          # tk.signal
    assert "ld.acquire.sys.global.u32" in ptx               # tk.wait_signal's spin
    assert "%globaltimer" in ptx and "trap;" in ptx         # ... and its timeout
    assert "vprintf" in ptx                                 # which says where it waited
    assert "st.release.gpu.global.u32" in ptx               # the epoch, for the next launch
    # X, Epochs, and Buf's and Flags' local copy and one per rank: a pointer each
    assert sum(p.kind == "ptr" for p in compiled.params) == 2 + 2 * (1 + world)
    assert [p.kind for p in compiled.params].count("i32") == 2      # the ranks


def test_gemm_rs_ptx_reduces_into_peers_by_tma_and_fences_before_its_signal():
    ptx = ptx_of(gemm_rs.gemm_rs_kernel, S((2, 512, 512), bf16), S((768, 512), bf16),
                 P((512, 768), bf16, 2), P((2, 4), "i32", 2), S((4,), "i32"))
    assert "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in ptx
    # the adds complete (not the .read form), then a system fence, then the release
    body = ptx[ptx.rindex("cp.reduce.async.bulk.tensor"):]
    wait = re.search(r"cp\.async\.bulk\.wait_group\s+0;", body)
    assert wait, "no cp.async.bulk.wait_group 0 after the last reduce-add"
    fence = body.index("fence.acq_rel.sys;", wait.end())
    assert body.index("red.release.sys.global.add.u32", fence) > fence
    # one tensor map per rank's copy of C (its TMA adds pick one by the owner's rank)
    assert len(re.findall(r"\.param \.align 64 \.b8 \w+_param_\d+\[128\]", ptx)) >= 2 + 2


def test_a_run_time_rank_selects_among_every_copy_and_traps_outside():
    @tk.kernel(num_warps=4)
    def pick(X: tk.pgl[f32], Y: tk.gl[f32], r: int):
        tk.store(Y, tk.load(X[r], (0, 0), (16, 16)), (0, 0))

    ptx = ptx_of(pick, P((16, 16), f32, 4), S((16, 16), f32), 2)
    assert ptx.count("selp.b64") >= 3 and "trap;" in ptx


def test_a_compile_time_rank_is_that_copy_with_no_select():
    @tk.kernel(num_warps=4)
    def first(X: tk.pgl[f32], Y: tk.gl[f32]):
        tk.store(Y, tk.load(X[1], (0, 0), (16, 16)), (0, 0))

    ptx = ptx_of(first, P((16, 16), f32, 2), S((16, 16), f32))
    assert "selp.b64" not in ptx and "trap;" not in ptx


@pytest.mark.parametrize("scope", ["cta", "gpu", "sys"])
@pytest.mark.parametrize("mode, asm", [("add", "red.release.{}.global.add.u32"),
                                       ("set", "st.release.{}.global.u32")])
def test_signal_scopes_and_modes(scope, mode, asm):
    @tk.kernel(num_warps=4)
    def sig(F: tk.gl["i32"], SCOPE: tk.constexpr, MODE: tk.constexpr):
        if tk.thread_id() == 0:
            tk.fence(SCOPE)
            tk.signal(F, (tk.block_id(0),), 3, scope=SCOPE, mode=MODE)
            tk.wait_signal(F, (0,), 7, scope=SCOPE, timeout_ms=5)

    ptx = ptx_of(sig, S((8,), "i32"), SCOPE=scope, MODE=mode)
    assert asm.format(scope) in ptx
    assert f"ld.acquire.{scope}.global.u32" in ptx and f"fence.acq_rel.{scope};" in ptx
    assert re.search(r"setp\.\w+\.u64\s+%p\d+, %rd\d+, 500000[01];", ptx)   # 5 ms in ns


# ----------------------------------------------------- errors at their line

@tk.kernel(num_warps=4)
def not_a_rank(X: tk.pgl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X[2], (0, 0), (16, 16)), (0, 0))  # E:peer-rank


@tk.kernel(num_warps=4)
def float_rank(X: tk.pgl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X[0.5], (0, 0), (16, 16)), (0, 0))  # E:peer-float


@tk.kernel(num_warps=4)
def signal_after_tma(X: tk.pgl[bf16], F: tk.pgl["i32"], ADD: tk.constexpr = False,
                     READ: tk.constexpr = False, FENCE: tk.constexpr = "sys",
                     PROXY: tk.constexpr = True):
    """A TMA store (ADD: reduce-add) into rank 1's copy, its wait (READ: the
    .read form, which says only that the shared tile may be reused), a fence
    (FENCE None: none) and the signal that announces the store."""
    s = tk.shared_tile(bf16, (64, 64))
    tk.store(s, tk.zeros((64, 64), f32).to(bf16))
    if tk.thread_id() == 0:
        if ADD:
            tk.tma.reduce_add_async(X[1], s, (0, 0))
        else:
            tk.tma.store_async(X[1], s, (0, 0))
        tk.tma.store_commit()
        tk.tma.store_wait(0, read=READ)
        if FENCE is not None:
            tk.fence(FENCE, async_proxy=PROXY)
        tk.signal(F[1], (0,))  # E:signal-after-tma


@tk.kernel(num_warps=4)
def float_flags(F: tk.gl[f32]):
    tk.signal(F, (0,))  # E:signal-f32


@tk.kernel(num_warps=4)
def bad_scope(F: tk.gl["i32"]):
    tk.wait_signal(F, (0,), 1, scope="grid")  # E:signal-scope


@tk.kernel(num_warps=4)
def flag_coords(F: tk.gl["i32"]):
    tk.signal(F, (0, 0))  # E:signal-coords


PEERS = [P((64, 64), bf16, 2), P((4,), "i32", 2)]


@pytest.mark.parametrize("kernel, specs, constexprs, marker, at, message", [
    (not_a_rank, [P((16, 16), f32, 2), S((16, 16), f32)], {}, "peer-rank", "X[2]",
     "peer index 2 is not a rank: this peer tensor has 2 (ranks 0 to 1)"),
    (float_rank, [P((16, 16), f32, 2), S((16, 16), f32)], {}, "peer-float", "X[0.5]",
     "a peer tensor is indexed by a rank (an int)"),
    (signal_after_tma, PEERS, dict(READ=True), "signal-after-tma", "tk.signal",
     "may still be in flight: put tk.tma.store_wait(0, read=False)"),
    (signal_after_tma, PEERS, dict(ADD=True, FENCE=None), "signal-after-tma", "tk.signal",
     "without a fence: put tk.fence('sys', async_proxy=True)"),
    (signal_after_tma, PEERS, dict(FENCE="gpu"), "signal-after-tma", "tk.signal",
     "fenced only at scope 'gpu': use tk.fence('sys', async_proxy=True)"),
    (signal_after_tma, PEERS, dict(PROXY=False), "signal-after-tma", "tk.signal",
     "fenced without async_proxy=True: the writes went through the async proxy"),
    (float_flags, [S((4,), f32)], {}, "signal-f32", "tk.signal", "takes a flag in an i32 tensor"),
    (bad_scope, [S((4,), "i32")], {}, "signal-scope", "tk.wait_signal",
     "scope must be one of 'cta', 'gpu', 'sys'"),
    (flag_coords, [S((4,), "i32")], {}, "signal-coords", "tk.signal",
     "needs 1 element coordinates for a rank-1 flag tensor, got 2"),
])
def test_misuse_is_an_error_at_its_line(kernel, specs, constexprs, marker, at, message):
    with pytest.raises(tk.CompilationError) as info:
        kernel.compile(*specs, **constexprs)
    error_checks.check_error(info.value, marker, at, message, HERE)


def test_a_signal_after_completed_and_fenced_writes_compiles():
    assert "fence.acq_rel.sys;" in ptx_of(signal_after_tma, *PEERS)


# ------------------------------------------------------------ arguments

@tk.kernel(num_warps=4)
def copy_peer(X: tk.pgl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X[X.world_size - 1], (0, 0), (16, 16)), (0, 0))


def test_a_tensor_where_a_peer_tensor_goes_names_the_argument():
    with pytest.raises(tk.ArgumentError, match=r"argument 'X' is a tk.pgl parameter: it takes a "
                                               r"tk.PeerTensor"):
        copy_peer.compile(S((16, 16), f32), S((16, 16), f32))


def test_peer_copies_must_agree():
    copies = [np.zeros((16, 16), np.float32), np.zeros((16, 32), np.float32)]
    with pytest.raises(tk.ArgumentError, match=r"rank 1's copy has shape \(16, 32\)"):
        copy_peer.compile(tk.PeerTensor.from_tensors(copies, 0), S((16, 16), f32))


@pytest.mark.parametrize("rank", [-1, 2, True, 1.0])
def test_from_tensors_wants_a_rank(rank):
    with pytest.raises(tk.ArgumentError, match="rank must be an int from 0 to 1"):
        tk.PeerTensor.from_tensors([np.zeros(4), np.zeros(4)], rank)


def test_world_size_is_part_of_the_specialization():
    two = copy_peer.compile(P((16, 16), f32, 2), S((16, 16), f32))
    three = copy_peer.compile(P((16, 16), f32, 3), S((16, 16), f32))
    assert two is not three
    assert sum(p.kind == "ptr" for p in three.params) == sum(p.kind == "ptr" for p in two.params) + 1


def test_peer_spec_checks_the_world_size():
    with pytest.raises(tk.ArgumentError, match="world_size must be an int from 1 to 8"):
        P((16, 16), f32, 9)


# ------------------------------------------------------------ interpreter

@tk.kernel(num_warps=4)
def relay(F: tk.gl["i32"], X: tk.gl[f32], Y: tk.gl[f32]):
    """Block b waits for block b - 1, adds one to its tile and signals b + 1."""
    b = tk.block_id(0)
    if b > 0:
        if tk.thread_id() == 0:
            tk.wait_signal(F, (b - 1,), 1, scope="gpu")
        tk.barrier()
    tk.store(Y, tk.load(X, (b, 0), (16, 16)) + 1.0, (b, 0))
    tk.fence("gpu")
    tk.barrier()
    if tk.thread_id() == 0:
        tk.signal(F, (b,), 1, scope="gpu")


def test_interpreter_runs_signals_in_order():
    f = np.zeros(4, np.int32)
    x = np.random.default_rng().standard_normal((64, 16)).astype(np.float32)
    y = np.full_like(x, np.nan)
    relay.interpret[(4,)](f, x, y)
    assert f.tolist() == [1, 1, 1, 1]
    np.testing.assert_allclose(y, x + 1, rtol=1e-6)


def test_interpreter_reports_a_wait_no_block_can_answer():
    @tk.kernel(num_warps=4)
    def stuck(F: tk.gl["i32"]):
        if tk.thread_id() == 0:
            tk.wait_signal(F, (tk.block_id(0) + 1,), 1)

    with pytest.raises(InterpretError, match=r"flag \(1,\) of 'F' holds 0, waiting for 1"):
        stuck.interpret[(2,)](np.zeros(4, np.int32))


def test_interpreter_counts_wrap_as_u32():
    @tk.kernel(num_warps=4)
    def bump(F: tk.gl["i32"]):
        if tk.thread_id() == 0:
            tk.signal(F, (0,), 2)
            tk.wait_signal(F, (0,), -2**31 + 1)    # 2^31 + 1 as a u32: reached by wrapping

    f = np.array([2**31 - 1, 0, 0, 0], np.int32)
    bump.interpret[(1,)](f)
    assert f[0] == -2**31 + 1


def test_a_block_waiting_for_a_later_one_steps_aside():
    @tk.kernel(num_warps=4)
    def backwards(F: tk.gl["i32"], X: tk.gl[f32], Y: tk.gl[f32]):
        """Block b waits for block b + 1 (the last one goes first)."""
        b = tk.block_id(0)
        if b + 1 < tk.grid_dim(0):
            if tk.thread_id() == 0:
                tk.wait_signal(F, (b + 1,), 1, scope="gpu")
            tk.barrier()
            tk.store(Y, tk.load(Y, (b + 1, 0), (16, 16)) + tk.load(X, (b, 0), (16, 16)), (b, 0))
        else:
            tk.store(Y, tk.load(X, (b, 0), (16, 16)), (b, 0))
        tk.fence("gpu")
        tk.barrier()
        if tk.thread_id() == 0:
            tk.signal(F, (b,), 1, scope="gpu")

    x = np.random.default_rng().standard_normal((64, 16)).astype(np.float32)
    y = np.full_like(x, np.nan)
    backwards.interpret[(4,)](np.zeros(4, np.int32), x, y)
    ref = np.cumsum(x.reshape(4, 16, 16)[::-1], axis=0)[::-1].reshape(64, 16)
    np.testing.assert_allclose(y, ref, rtol=1e-5)


def test_a_rank_alone_deadlocks_at_its_wait():
    copies = [np.zeros((16, 16), np.float32)] * 2
    with pytest.raises(InterpretError, match=r"deadlock in block \(0, 0, 0\).*every other block "
                                             r"still running.*all_reduce_kernels.py:\d+ "
                                             r"\(tk.wait_signal\): flag \(0, 0, 1\)"):
        ar.one_shot_kernel.interpret[(1,)](
            torch.ones(1, 256, dtype=torch.bfloat16),
            tk.PeerTensor.from_tensors([torch.empty(4, 1, 256, dtype=torch.bfloat16)
                                        for _ in range(2)], 0),
            tk.PeerTensor.from_tensors([torch.zeros(1, 2, 4, dtype=torch.int32)] * 2, 0),
            torch.zeros(4, dtype=torch.int32), BLOCK=256)   # (rows of whole 16-byte vectors)


# -------------------------------------- the library's kernels, every rank on the CPU

def rel_err(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kernel, extra", [(ar.one_shot_kernel, 0), (ar.two_shot_kernel, 2)])
@pytest.mark.parametrize("world, T, N, grid", [(2, 5, 512, 3), (3, 2, 1000, 2)])
def test_all_reduce_kernels_interpreted(kernel, extra, world, T, N, grid):
    """Every rank's launch at once, twice: the epochs carry on with no reset."""
    bufs = [torch.empty((2 * world + extra, T, N), dtype=torch.bfloat16) for _ in range(world)]
    flags = [torch.zeros((grid, 2, 4), dtype=torch.int32) for _ in range(world)]
    epochs = [torch.zeros(-(-grid // 4) * 4, dtype=torch.int32) for _ in range(world)]
    for call in range(2):
        xs = [torch.randn(T, N).to(torch.bfloat16) for _ in range(world)]
        ref = sum(x.double() for x in xs)
        kernel.interpret_ranks[(grid,)](
            [(xs[r], tk.PeerTensor.from_tensors(bufs, r), tk.PeerTensor.from_tensors(flags, r),
              epochs[r]) for r in range(world)], BLOCK=ar._block(N))
        assert all(rel_err(x, ref) < 1e-2 for x in xs)
        assert all(torch.equal(x, xs[0]) for x in xs)
    assert all(e.tolist()[:grid] == [2] * grid for e in epochs)


@pytest.mark.parametrize("M, N, K, world", [(256, 256, 128, 2), (192, 128, 64, 3),
                                            (200, 128, 64, 2), (90, 128, 64, 3)])
def test_gemm_reduce_scatter_interpreted(M, N, K, world):
    """Each owner's rows tiled on their own: M / W need not be whole tiles."""
    rows, grid = M // world, 2
    outs = [torch.zeros((rows, N), dtype=torch.bfloat16) for _ in range(world)]
    flags = [torch.zeros((2, 4), dtype=torch.int32) for _ in range(world)]
    totals = [torch.zeros(4, dtype=torch.int32) for _ in range(world)]
    a = [torch.randn(M, K).to(torch.bfloat16) for _ in range(world)]
    b = [torch.randn(N, K).to(torch.bfloat16) for _ in range(world)]
    ref = sum(x.double() @ y.double().T for x, y in zip(a, b))
    gemm_rs.gemm_rs_kernel.interpret_ranks[(grid,)](
        [(a[r].unflatten(0, (world, rows)), b[r], tk.PeerTensor.from_tensors(outs, r),
          tk.PeerTensor.from_tensors(flags, r), totals[r]) for r in range(world)])
    for r in range(world):
        assert rel_err(outs[r], ref[r * rows:(r + 1) * rows]) < 1e-2
        assert totals[r].tolist()[:2] == [1, grid]


@pytest.mark.parametrize("world, rows, tile", [(2, 128, dict(BM=128)),
                                               (2, 100, dict(BM=128)),
                                               (3, 40, dict(BM=64, num_warps=8))])
def test_all_gather_gemm_interpreted(world, rows, tile):
    """The library's three launches per rank: ready, (the pushes), written, the
    GEMM; a tile holding rows of two ranks waits for both."""
    from tk_mlir.kernels import ag_gemm
    N, K, grid = 256, 64, 2
    bufs = [torch.zeros((world * rows, K), dtype=torch.bfloat16) for _ in range(world)]
    flags = [torch.zeros((2, 4), dtype=torch.int32) for _ in range(world)]
    totals = [torch.zeros(4, dtype=torch.int32) for _ in range(world)]
    for call in range(2):
        a = [torch.randn(rows, K).to(torch.bfloat16) for _ in range(world)]
        b = [torch.randn(N, K).to(torch.bfloat16) for _ in range(world)]
        c = [torch.full((world * rows, N), float("nan")).to(torch.bfloat16) for _ in range(world)]
        f = [tk.PeerTensor.from_tensors(flags, r) for r in range(world)]
        ag_gemm.ready_kernel.interpret_ranks[(1,)]([(f[r], totals[r], grid) for r in range(world)])
        for r in range(world):
            for buf in bufs:
                buf[r * rows:(r + 1) * rows].copy_(a[r])
        ag_gemm.written_kernel.interpret_ranks[(1,)]([(f[r], totals[r]) for r in range(world)])
        ag_gemm.ag_gemm_kernel.interpret_ranks[(grid,)](
            [(bufs[r], b[r], c[r], f[r], totals[r], rows) for r in range(world)], **tile)
        full = torch.cat(a).double()
        for r in range(world):
            assert rel_err(c[r], full @ b[r].double().T) < 1e-2
    assert totals[0].tolist()[:2] == [2, 2 * grid]


def test_interpret_ranks_wants_a_list_of_argument_tuples():
    with pytest.raises(tk.ArgumentError, match="interpret_ranks takes a list"):
        copy_peer.interpret_ranks[(1,)](np.zeros(4))


# ------------------------------------------------------- library wrappers

@pytest.mark.parametrize("t, kwargs, error, message", [
    (torch.zeros(4, 8, dtype=torch.int32), {}, TypeError, "t must be torch.bfloat16"),
    (torch.zeros(8, 4, dtype=torch.bfloat16).T, {}, ValueError, "t must be contiguous"),
    (torch.zeros(3, 5, dtype=torch.bfloat16), {}, ValueError, "multiple of 16 bytes"),
    (torch.zeros(4, 8, dtype=torch.bfloat16), {"algorithm": "ring"}, ValueError,
     "algorithm must be one of"),
    (torch.zeros(4, 8, dtype=torch.bfloat16), {"timeout_ms": 0}, ValueError,
     "timeout_ms must be an int"),
    (torch.zeros(4, 8, dtype=torch.bfloat16), {}, ValueError, "t must be on a CUDA device"),
])
def test_all_reduce_checks_its_arguments(t, kwargs, error, message):
    with pytest.raises(error, match=message):
        ar.all_reduce(t, **kwargs)


@pytest.mark.parametrize("a, b, kwargs, error, message", [
    (torch.zeros(128, 64, dtype=torch.float32), torch.zeros(64, 64), {}, TypeError,
     "a must be torch.bfloat16"),
    (torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16), {},
     ValueError, "inner dimensions differ"),
    (torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16),
     {"b_layout": "mn"}, ValueError, "b_layout must be"),
    (torch.zeros(2, 128, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 64, dtype=torch.bfloat16),
     {}, ValueError, "a must be 2-D"),
    (torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16),
     {"timeout_ms": True}, TypeError, "timeout_ms must be an int"),
    (torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16),
     {"timeout_ms": 1000.0}, TypeError, "timeout_ms must be an int"),
    (torch.zeros(128, 64, dtype=torch.bfloat16).requires_grad_(),
     torch.zeros(64, 64, dtype=torch.bfloat16), {}, RuntimeError,
     "not differentiable .* an input requires grad"),
    (torch.zeros(128, 60, dtype=torch.bfloat16), torch.zeros(64, 60, dtype=torch.bfloat16), {},
     ValueError, r"K \(60, a's columns\) must be a multiple of 8"),
    (torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(60, 64, dtype=torch.bfloat16), {},
     ValueError, r"N \(60, b's rows\) must be a multiple of 8"),
    (torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16), {},
     ValueError, "a must be on a CUDA device"),
])
@pytest.mark.parametrize("fn", ["matmul_reduce_scatter", "all_gather_matmul"])
def test_the_multi_gpu_matmuls_check_their_arguments_before_the_device(fn, a, b, kwargs, error,
                                                                        message):
    from tk_mlir.kernels import ag_gemm
    call = getattr(gemm_rs if fn == "matmul_reduce_scatter" else ag_gemm, fn)
    with pytest.raises(error, match=message):
        call(a, b, **kwargs)


def test_the_multi_gpu_wrappers_say_they_do_not_run_in_the_interpreter(monkeypatch):
    from tk_mlir.kernels import ag_gemm
    import sys
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_interpret_all", lambda: True)
    a, b = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16)
    for call in (lambda: ar.all_reduce(a), lambda: gemm_rs.matmul_reduce_scatter(a, b),
                 lambda: ag_gemm.all_gather_matmul(a, b)):
        with pytest.raises(ValueError, match="runs on GPUs only, not under TK_MLIR_INTERPRET"):
            call()


@tk.kernel(num_warps=4)
def proxy_flag(F: tk.gl["i32"], PROXY: tk.constexpr):
    tk.fence("sys", async_proxy=PROXY)  # E:fence-proxy


@tk.kernel(num_warps=4)
def big_count(F: tk.gl["i32"], VALUE: tk.constexpr):
    if tk.thread_id() == 0:
        tk.signal(F, (0,), VALUE)  # E:u32-count
        tk.wait_signal(F, (1,), VALUE)


def test_fence_takes_a_bool_and_counts_take_u32s():
    with pytest.raises(tk.CompilationError) as info:
        proxy_flag.compile(S((4,), "i32"), PROXY="no")
    error_checks.check_error(info.value, "fence-proxy", "tk.fence",
                            "tk.fence: async_proxy must be True or False, got 'no'", HERE)
    ptx = ptx_of(big_count, S((4,), "i32"), VALUE=2**32 - 1)
    assert "red.release.sys.global.add.u32" in ptx
    with pytest.raises(tk.CompilationError) as info:
        big_count.compile(S((4,), "i32"), VALUE=2**32)
    error_checks.check_error(info.value, "u32-count", "tk.signal",
                            "tk.signal's value must fit in 32 bits", HERE)
    f = np.zeros(4, np.int32)
    big_count.interpret[(1,)](f, VALUE=2**32 - 1)
    assert f[0] == -1


def test_interpret_ranks_checks_that_the_launches_are_one_group():
    xs = [np.zeros((16, 16), np.float32) for _ in range(2)]
    y = np.zeros((16, 16), np.float32)
    one = [tk.PeerTensor.from_tensors(xs, r) for r in range(2)]
    with pytest.raises(tk.ArgumentError, match=r"'X' of launch 1 is rank 0 of a 2-rank"):
        copy_peer.interpret_ranks[(1,)]([(one[0], y), (one[0], y)])
    with pytest.raises(tk.ArgumentError, match=r"launch r takes rank r's, one launch per rank "
                                               r"\(3 launches given\)"):
        copy_peer.interpret_ranks[(1,)]([(one[0], y), (one[1], y), (one[1], y)])
    other = tk.PeerTensor.from_tensors([np.zeros_like(x) for x in xs], 1)
    with pytest.raises(tk.ArgumentError, match="'X' of rank 1 holds other copies than rank 0's"):
        copy_peer.interpret_ranks[(1,)]([(one[0], y), (other, y)])


def test_a_peer_tensor_checks_its_rank():
    xs = [torch.zeros(4, 4) for _ in range(2)]
    for rank in (2, -1, "0", True):
        with pytest.raises(tk.ArgumentError, match="rank must be an int from 0 to 1"):
            tk.PeerTensor(xs[0], xs, rank)


def test_interpreter_traps_on_a_wait_outside_the_flags():
    @tk.kernel(num_warps=4)
    def far(F: tk.gl["i32"]):
        if tk.thread_id() == 0:
            tk.wait_signal(F, (9,), 0)

    with pytest.raises(InterpretError, match=r"element \(9,\) is outside 'F' of shape \(4,\)"):
        far.interpret[(1,)](np.zeros(4, np.int32))


def test_the_cli_compiles_a_peer_tensor_from_its_spec(capsys):
    from tk_mlir.cli import main
    call = [f"{HERE}::copy_peer", "--arg", "f32[16,16]x3", "--arg", "f32[16,16]"]
    assert main(["compile", *call]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["compile", *call[:2], "f32[16,16]", "--arg", "f32[16,16]"]) != 0
    assert "followed by xW, the world size" in capsys.readouterr().err


def test_workspaces_grow_by_doubling_and_keep_the_outgrown(monkeypatch):
    from tk_mlir.kernels import symmetric
    from types import SimpleNamespace
    monkeypatch.setattr(symmetric, "group_key", lambda group: ("g", 0))
    made = []
    def make(group, key, capacity):
        made.append((key, capacity))
        return SimpleNamespace(capacity=capacity)
    spaces = symmetric.Workspaces(make)
    first = spaces.get(None, ("k",), 5, "f")
    assert spaces.get(None, ("k",), 5, "f") is first and spaces.get(None, ("k",), 3, "f") is first
    second = spaces.get(None, ("k",), 6, "f")
    assert second.capacity == 10 and spaces.retired == [first]      # kept: graphs may use it
    assert spaces.get(None, ("k",), 30, "f").capacity == 30
    assert [m[1] for m in made] == [5, 10, 30]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="f: this call needs a new symmetric-memory workspace"):
        spaces.get(None, ("k",), 31, "f")
    assert spaces.get(None, ("k",), 30, "f").capacity == 30         # (no allocation: fine)


@tk.kernel(num_warps=4)
def gpu_scope_to_a_peer(F: tk.pgl["i32"]):
    if tk.thread_id() == 0:
        tk.signal(F[1], (0,), scope="gpu")  # E:peer-scope


@tk.kernel(num_warps=4)
def gpu_scope_wait_on_a_picked_peer(F: tk.pgl["i32"], r: int):
    if tk.thread_id() == 0:
        tk.wait_signal(F[r], (0,), 1, scope="gpu")  # E:peer-scope-picked


@tk.kernel(num_warps=4)
def gpu_scope_on_the_local_copy(F: tk.pgl["i32"]):
    if tk.thread_id() == 0:
        tk.signal(F, (0,), scope="gpu")
        tk.wait_signal(F, (0,), 1, scope="gpu")


@pytest.mark.parametrize("kernel, marker, at, args", [
    (gpu_scope_to_a_peer, "peer-scope", "tk.signal", ()),
    (gpu_scope_wait_on_a_picked_peer, "peer-scope-picked", "tk.wait_signal", (1,))])
def test_a_flag_on_a_peer_needs_system_scope(kernel, marker, at, args):
    with pytest.raises(tk.CompilationError) as info:
        kernel.compile(P((4,), "i32", 2), *args)
    error_checks.check_error(info.value, marker, at, "its scope must be 'sys', got 'gpu'", HERE)


def test_the_local_copy_may_take_a_narrower_scope():
    assert "red.release.gpu" in ptx_of(gpu_scope_on_the_local_copy, P((4,), "i32", 2))


@tk.kernel(num_warps=4)
def gpu_scope_wait_for_the_peers(F: tk.pgl["i32"]):
    if tk.thread_id() == 0:
        for r in tk.static_range(F.world_size):
            tk.signal(F[r], (F.rank,))
        tk.wait_signal(F, (0,), 1, scope="gpu")  # E:peer-signaled


@tk.kernel(num_warps=4)
def sys_scope_wait_for_the_peers(F: tk.pgl["i32"]):
    if tk.thread_id() == 0:
        tk.signal(F[1 - F.rank], (F.rank,))
        tk.wait_signal(F, (1 - F.rank,), 1)


def test_a_wait_on_the_local_copy_the_peers_signal_needs_system_scope():
    """The kernel signals every rank's copy of F, so its peers signal this
    rank's: an acquire at "gpu" would not see their release."""
    with pytest.raises(tk.CompilationError) as info:
        gpu_scope_wait_for_the_peers.compile(P((4,), "i32", 2))
    error_checks.check_error(info.value, "peer-signaled", "tk.wait_signal",
                             "its scope must be 'sys'", HERE)
    assert "the peers signal this flag tensor" in str(info.value)
    assert "ld.acquire.sys" in ptx_of(sys_scope_wait_for_the_peers, P((4,), "i32", 2))


def test_a_kernel_with_warpgroup_mmas_traps_on_timeout_without_a_printf_call():
    """A call anywhere in a kernel makes ptxas serialize its wgmmas (C7510: the
    GEMM + reduce-scatter ran 20% slower), so its waits trap without the message."""
    compiled = gemm_rs.gemm_rs_kernel.compile(S((2, 512, 512), bf16), S((768, 512), bf16),
                                              P((512, 768), bf16, 2), P((2, 4), "i32", 2),
                                              S((4,), "i32"))
    ptx = compiled.asm["ptx"]
    assert "ld.acquire.sys" in ptx and "trap;" in ptx and "%globaltimer" in ptx
    assert "vprintf" not in ptx and "C7510" not in compiled.asm["ptxas"]


def test_the_example_compiles_and_says_how_to_run_it(capsys, monkeypatch):
    """Outside torchrun examples/multi_gpu.py shows its kernel's signals in PTX
    (tests/test_multi_gpu.py runs it on two GPUs)."""
    import runpy
    monkeypatch.delenv("RANK", raising=False)
    runpy.run_path(str(HERE.parents[1] / "examples" / "multi_gpu.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "red.release.sys.global.add.u32" in out and "ld.acquire.sys.global.u32" in out
    assert "not under torchrun: compiled and interpreted only" in out
    assert float(out.split("2 ranks in the CPU interpreter: rel. error ")[1].split()[0]) < 1e-2


def test_a_peer_tensor_where_a_tensor_goes_says_which_parameter_takes_it():
    with pytest.raises(tk.ArgumentError, match=r"argument 'Y' is a tk.gl parameter and takes one "
                                               r"tensor; a PeerSpec .* goes to a tk.pgl"):
        copy_peer.compile(P((16, 16), f32, 2), P((16, 16), f32, 2))


@pytest.mark.parametrize("a, b, error, message", [
    (torch.zeros(128, 64, dtype=torch.float16), torch.zeros(64, 64), TypeError,
     "b must be torch.bfloat16 or torch.float16"),
    (torch.zeros(2, 128, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 64, dtype=torch.bfloat16),
     ValueError, "a must be 2-D"),
    (torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16),
     ValueError, "a must be on a CUDA device"),
])
def test_all_gather_matmul_checks_its_arguments(a, b, error, message):
    from tk_mlir.kernels import all_gather_matmul
    with pytest.raises(error, match=f"all_gather_matmul: {message}"):
        all_gather_matmul(a, b)


@pytest.mark.parametrize("world", [1, 3, 8])
def test_the_gemms_compile_for_every_world_size(world):
    """One tensor map per rank's copy: 8 ranks still fit the kernel's parameters."""
    rs = gemm_rs.gemm_rs_kernel.compile(S((world, 512, 512), bf16), S((768, 512), bf16),
                                        P((512, 768), bf16, world), P((2, 8), "i32", world),
                                        S((4,), "i32"))
    assert sum(p.kind == "tmap" for p in rs.params) == 2 + world
    from tk_mlir.kernels import ag_gemm
    ag = ag_gemm.ag_gemm_kernel.compile(S((256 * world, 512), bf16), S((768, 512), bf16),
                                        S((256 * world, 768), bf16), P((2, 8), "i32", world),
                                        S((4,), "i32"), 256)
    assert sum(p.kind == "tmap" for p in ag.params) == 3


@tk.kernel(num_warps=4)
def pick_rank(X: tk.pgl[f32], Y: tk.gl[f32], r: int):
    tk.store(Y, tk.load(X[r], (0, 0), (16, 16)), (0, 0))  # E:run-time-rank


def test_a_run_time_rank_outside_the_group_is_an_error_at_its_line_in_the_interpreter():
    copies = [np.full((16, 16), float(r), np.float32) for r in range(2)]
    y = np.zeros((16, 16), np.float32)
    pick_rank.interpret[(1,)](tk.PeerTensor.from_tensors(copies, 0), y, 1)
    assert (y == 1).all()
    with pytest.raises(InterpretError) as info:
        pick_rank.interpret[(1,)](tk.PeerTensor.from_tensors(copies, 0), y, 2)
    error_checks.check_error(info.value, "run-time-rank", "X[r]",
                            "peer rank 2 is not a rank of this 2-rank peer tensor", HERE)


def test_a_cached_all_reduce_call_still_refuses_a_tensor_it_cannot_reduce_in_place(monkeypatch):
    """The per-call cache keys on shape, dtype and device, not strides: a
    transposed tensor of a cached shape still gets the contiguity error."""
    launched = []
    fake = type("Fake", (), {"__getitem__": lambda self, grid: lambda *a, **k: launched.append(a)})
    t = torch.zeros(8, 4, dtype=torch.bfloat16).T
    key = (None, t.shape, t.dtype, t.device, "auto", ar.DEFAULT_TIMEOUT_MS)
    monkeypatch.setitem(ar._CALLS, key, (fake(), 1, 8, 256, None))
    with pytest.raises(ValueError, match="t must be contiguous"):
        ar.all_reduce(t)
    assert not launched


def test_two_ranks_writing_one_element_of_a_copy_are_reported():
    """Writers are tracked per array, whichever rank's argument reaches it."""
    @tk.kernel(num_warps=4)
    def both_write_rank0(X: tk.pgl[f32]):
        tk.store(X[0], tk.full((16, 16), 1.0, f32), (0, 0))  # E:both-ranks

    copies = [np.zeros((16, 16), np.float32) for _ in range(2)]
    with pytest.raises(InterpretError, match=r"blocks \(0, 0, 0\) of rank 0 and \(0, 0, 0\) of "
                                             r"rank 1 both write element"):
        both_write_rank0.interpret_ranks[(1,)](
            [(tk.PeerTensor.from_tensors(copies, r),) for r in range(2)])


def test_a_launch_plan_passes_a_peer_tensor_as_the_general_path_does():
    """The plan's constants for a tk.pgl argument (launcher._abi_variables) and
    the general path's arguments (params.abi_arguments) give the same launch
    values, piece for piece (no TMA here: its maps need a GPU driver)."""
    from tk_mlir import launcher
    from tk_mlir.runtime.arguments import tensor_info
    from tk_mlir.runtime.peers import read_peers
    copies = [torch.randn(16, 16) for _ in range(3)]
    x, y = tk.PeerTensor.from_tensors(copies, 2), torch.zeros(16, 16)
    compiled = copy_peer.compile(x, y)
    params, values = copy_peer.params, [x, y]
    infos = {"X": read_peers(x, "X", tensor_info), "Y": tensor_info(y, "Y")}
    runtime, by_arg, _ = params.abi_arguments(values, infos)
    general = compiled.launch_values(runtime, by_arg)
    env = {"a1_ptr": y.data_ptr(), "a1_shape": y.shape, "a1_strides": y.stride()}
    arg_vars, source = launcher._abi_variables(params, values, ["a0", "a1"], {0}, env)
    assert source == [None] * 5 + [1]
    exprs = launcher.launch_value_code(compiled.params, arg_vars, compiled.tensor_maps, env)
    assert tuple(eval(e, env) for e in exprs) == tuple(general)


# ---- happens-before through flags (interpreter/ordering.py)

@tk.kernel(num_warps=4)
def hand_over(X: tk.gl[f32], Y: tk.gl[f32], F: tk.gl["i32"], WAIT: tk.constexpr,
              SIGNAL_FIRST: tk.constexpr = False):
    """Block 0 writes X and signals; block 1 copies X into Y, after waiting
    for the signal when WAIT (SIGNAL_FIRST: block 0 signals before its write)."""
    if tk.block_id(0) == 0:
        if SIGNAL_FIRST:
            if tk.thread_id() == 0:
                tk.signal(F, (0,), scope="gpu")
        tk.store(X, tk.full((16, 16), 2.0, f32), (0, 0))
        tk.barrier()
        if tk.thread_id() == 0:
            tk.signal(F, (1,), scope="gpu")
    else:
        if WAIT:
            if tk.thread_id() == 0:
                tk.wait_signal(F, (WAIT - 1,), 1, scope="gpu")
            tk.barrier()
        tk.store(Y, tk.load(X, (0, 0), (16, 16)), (0, 0))  # E:unordered-read


def test_a_read_of_another_blocks_write_needs_its_signal():
    """Blocks run one after another in the interpreter, so block 1 would see
    block 0's data anyway: the read is reported because nothing orders it."""
    x, y, f = np.zeros((16, 16), np.float32), np.full((16, 16), np.nan, np.float32), \
        np.zeros(4, np.int32)
    with pytest.raises(InterpretError) as info:
        hand_over.interpret[(2,)](x, y, f, WAIT=0)
    error_checks.check_error(info.value, "unordered-read", "tk.load",
                            "block (1, 0, 0) reads element (0, 0) of argument 'X', which block "
                            "(0, 0, 0) wrote", HERE)
    assert "nothing ordering that write before this read" in info.value.message


def test_a_signal_given_before_the_write_does_not_order_it():
    f = np.zeros(4, np.int32)
    with pytest.raises(InterpretError, match="reads element"):
        hand_over.interpret[(2,)](np.zeros((16, 16), np.float32),
                                  np.zeros((16, 16), np.float32), f, WAIT=1, SIGNAL_FIRST=True)


def test_a_read_after_the_writers_signal_passes():
    x, y, f = np.zeros((16, 16), np.float32), np.full((16, 16), np.nan, np.float32), \
        np.zeros(4, np.int32)
    hand_over.interpret[(2,)](x, y, f, WAIT=2, SIGNAL_FIRST=True)
    assert (y == 2.0).all() and f.tolist() == [1, 1, 0, 0]


@tk.kernel(num_warps=4)
def add_then_read(X: tk.gl[f32], Y: tk.gl[f32], F: tk.gl["i32"], WAIT: tk.constexpr,
                  STORE: tk.constexpr = False):
    """Block 0 adds into X (tk.atomic_add) and signals; block 1 copies X into
    Y (STORE: stores into X instead), after the signal when WAIT."""
    if tk.block_id(0) == 0:
        tk.atomic_add(X, tk.full((16, 16), 2.0, f32), (0, 0))
        tk.barrier()
        if tk.thread_id() == 0:
            tk.signal(F, (0,), scope="gpu")
    else:
        if WAIT:
            if tk.thread_id() == 0:
                tk.wait_signal(F, (0,), 1, scope="gpu")
            tk.barrier()
        if STORE:
            tk.store(X, tk.full((16, 16), 5.0, f32), (0, 0))  # E:store-over-add
        else:
            tk.store(Y, tk.load(X, (0, 0), (16, 16)), (0, 0))  # E:read-of-add


@pytest.mark.parametrize("store, marker, op, says", [
    (False, "read-of-add", "tk.load", "reads element (0, 0) of argument 'X', which block "
                                      "(0, 0, 0) adds into"),
    (True, "store-over-add", "tk.store", "writes element (0, 0) of argument 'X' (at")])
def test_an_add_needs_ordering_before_a_read_or_a_write_by_another_block(store, marker, op,
                                                                          says):
    """Adds need no order among themselves, but a read (or a plain write) of an
    element another block adds into sees the sum before or after the add."""
    x, y, f = np.ones((16, 16), np.float32), np.full((16, 16), np.nan, np.float32), \
        np.zeros(4, np.int32)
    with pytest.raises(InterpretError) as info:
        add_then_read.interpret[(2,)](x, y, f, WAIT=False, STORE=store)
    error_checks.check_error(info.value, marker, op, says, HERE)
    x, f = np.ones((16, 16), np.float32), np.zeros(4, np.int32)
    add_then_read.interpret[(2,)](x, y, f, WAIT=True, STORE=store)
    assert (x == 5.0).all() if store else (y == 3.0).all()


@tk.kernel(num_warps=4)
def overwrite_in_turn(X: tk.pgl[f32], F: tk.pgl["i32"], WAIT: tk.constexpr):
    """Rank 0 writes rank 0's X, then rank 1 overwrites it (after rank 0's
    signal when WAIT)."""
    me = X.rank
    if me == 1:
        if WAIT:
            if tk.thread_id() == 0:
                tk.wait_signal(F[0], (0,), 1)
            tk.barrier()
    tk.store(X[0], tk.full((16, 16), 1.0, f32) + me, (0, 0))  # E:overwrite
    if me == 0:
        tk.barrier()
        if tk.thread_id() == 0:
            tk.signal(F[0], (0,))


def test_a_second_writer_after_the_first_ones_signal_is_not_a_conflict():
    xs, fs = [np.zeros((16, 16), np.float32) for _ in range(2)], \
        [np.zeros(4, np.int32) for _ in range(2)]
    args = [(tk.PeerTensor.from_tensors(xs, r), tk.PeerTensor.from_tensors(fs, r))
            for r in range(2)]
    overwrite_in_turn.interpret_ranks[(1,)](args, WAIT=True)
    assert (xs[0] == 2.0).all()
    with pytest.raises(InterpretError) as info:
        overwrite_in_turn.interpret_ranks[(1,)](args, WAIT=False)
    error_checks.check_error(info.value, "overwrite", "tk.store",
                            "both write element (0, 0) of argument", HERE)
    assert "with nothing ordering the two" in info.value.message


@tk.kernel(num_warps=4)
def exchange(X: tk.pgl[f32], Y: tk.gl[f32], F: tk.pgl["i32"], epoch: int):
    """Each rank writes its tile into the other's X and says so; then it
    waits for the count `epoch` and copies its own X into Y."""
    me = X.rank
    other = 1 - me
    tk.store(X[other], tk.full((16, 16), 1.0, f32) + me, (0, 0))  # E:stale-write
    tk.barrier()
    if tk.thread_id() == 0:
        tk.signal(F[other], (0,))
        tk.wait_signal(F, (0,), epoch)
    tk.barrier()
    tk.store(Y, tk.load(X, (0, 0), (16, 16)), (0, 0))


def test_a_wait_for_a_stale_count_is_reported_at_the_write_it_let_a_read_overtake():
    """The interpreter runs rank 0's block first: with a count already met (0,
    where this launch's is 1) it reads its X before rank 1 writes it, which
    the write then reports, whatever the values read."""
    xs, ys = [np.zeros((16, 16), np.float32) for _ in range(2)], \
        [np.zeros((16, 16), np.float32) for _ in range(2)]
    fs = [np.zeros(4, np.int32) for _ in range(2)]
    args = lambda epoch: [(tk.PeerTensor.from_tensors(xs, r), ys[r],
                           tk.PeerTensor.from_tensors(fs, r), epoch) for r in range(2)]
    exchange.interpret_ranks[(1,)](args(1))
    assert (ys[0] == 2.0).all() and (ys[1] == 1.0).all()
    with pytest.raises(InterpretError) as info:
        exchange.interpret_ranks[(1,)](args(1))          # (the flags hold 1 already)
    error_checks.check_error(info.value, "stale-write", "tk.store",
                            "block (0, 0, 0) of rank 1 writes element (0, 0) of argument", HERE)
    assert "which block (0, 0, 0) of rank 0 read" in info.value.message
    assert "is the count it waits for this launch's?" in info.value.message
    for f in fs:
        f[0] = 1            # (as launch 1 left them: the failed launch signalled part way)
    exchange.interpret_ranks[(1,)](args(2))


@tk.kernel(num_warps=4)
def copy_indexed(X: tk.pgl[f32], Y: tk.gl[f32], HOW: tk.constexpr):
    if HOW == "copy[]":
        tk.store(Y, tk.load(X[1][0], (0, 0), (16, 16)), (0, 0))  # E:index-copy
    elif HOW == "tuple":
        tk.store(Y, tk.load(X[0, 1], (0, 0), (16, 16)), (0, 0))  # E:index-tuple
    else:
        tk.store(Y, tk.full((16, 16), 1.0, f32) * X[1].rank, (0, 0))  # E:index-rank


@pytest.mark.parametrize("how, marker, at, message", [
    ("copy[]", "index-copy", "X[1][0]", "a tensor is not indexed with []: tk.load / tk.store"),
    ("tuple", "index-tuple", "X[0, 1]", "a peer tensor is indexed by one rank (X[r]), got (0, 1)"),
    ("rank", "index-rank", "X[1].rank",
     "`.rank` belongs to a tk.pgl argument (X.rank); this is one tensor")])
def test_indexing_a_copy_says_what_a_copy_is(how, marker, at, message):
    with pytest.raises(tk.CompilationError) as info:
        copy_indexed.compile(P((16, 16), f32, 2), S((16, 16), f32), HOW=how)
    error_checks.check_error(info.value, marker, at, message, HERE)


def test_the_interpreter_says_where_a_peer_tensor_goes():
    xs = [np.zeros((16, 16), np.float32) for _ in range(2)]
    with pytest.raises(tk.ArgumentError, match=r"argument 'Y' is a tk.gl parameter and takes one "
                                               r"array; a PeerTensor"):
        copy_peer.interpret[(1,)](tk.PeerTensor.from_tensors(xs, 0),
                                  tk.PeerTensor.from_tensors(xs, 0))


@tk.kernel(num_warps=4)
def one_way(X: tk.pgl[f32], Y: tk.gl[f32], F: tk.pgl["i32"], epoch: int,
            PRODUCER: tk.constexpr):
    """Rank PRODUCER writes the other's X and signals; the other waits for
    `epoch` and copies its X into Y."""
    me, t = X.rank, tk.thread_id()
    if me == PRODUCER:
        tk.store(X[1 - PRODUCER], tk.full((16, 16), 1.0, f32) * epoch, (0, 0))
        tk.barrier()
        if t == 0:
            tk.signal(F[1 - PRODUCER], (0,))
    else:
        if t == 0:
            tk.wait_signal(F, (0,), epoch)
        tk.barrier()
        tk.store(Y, tk.load(X, (0, 0), (16, 16)), (0, 0))


@pytest.mark.parametrize("producer", [0, 1])
def test_a_stale_count_is_reported_whichever_rank_runs_first(producer):
    """A wait acquires the signals up to the one that reached its count, none
    when the flag held it before the launch: whether the producer's block
    runs before the consumer's or after."""
    xs, ys = [np.zeros((16, 16), np.float32) for _ in range(2)], \
        [np.zeros((16, 16), np.float32) for _ in range(2)]
    fs = [np.zeros(4, np.int32) for _ in range(2)]
    args = lambda epoch: [(tk.PeerTensor.from_tensors(xs, r), ys[r],
                           tk.PeerTensor.from_tensors(fs, r), epoch) for r in range(2)]
    one_way.interpret_ranks[(1,)](args(1), PRODUCER=producer)
    with pytest.raises(InterpretError, match="with nothing ordering"):
        one_way.interpret_ranks[(1,)](args(1), PRODUCER=producer)     # (the count of launch 1)
    for f in fs:
        f[0] = 1            # (as launch 1 left them: the failed launch signalled part way)
    one_way.interpret_ranks[(1,)](args(2), PRODUCER=producer)
    assert (ys[1 - producer] == 2.0).all()


def test_views_of_one_array_are_one_array_to_the_interpreter():
    """A PeerTensor built from another view object of a rank's flags: the
    signal, the wait and the read meet in one array's history."""
    xs, ys = [np.zeros((16, 16), np.float32) for _ in range(2)], \
        [np.zeros((16, 16), np.float32) for _ in range(2)]
    fs = [np.zeros(4, np.int32) for _ in range(2)]
    one_way.interpret_ranks[(1,)](
        [(tk.PeerTensor.from_tensors(xs, r), ys[r], tk.PeerTensor(fs[r].view(), fs, r), 1)
         for r in range(2)], PRODUCER=0)
    assert (ys[1] == 1.0).all()


def test_all_gather_gemm_waits_for_every_rank_whose_rows_a_tile_holds():
    """3 ranks of 20 rows: one 64-row tile holds them all. With rank 2's word
    missing, every rank's GEMM waits for it at that tile (the rows are there:
    only the wait tells)."""
    from tk_mlir.kernels import ag_gemm
    world, rows, N, K, grid = 3, 20, 128, 64, 1
    bufs = [torch.zeros((world * rows, K), dtype=torch.bfloat16) for _ in range(world)]
    flags = [torch.zeros((2, 4), dtype=torch.int32) for _ in range(world)]
    totals = [torch.zeros(4, dtype=torch.int32) for _ in range(world)]
    f = [tk.PeerTensor.from_tensors(flags, r) for r in range(world)]
    ag_gemm.ready_kernel.interpret_ranks[(1,)]([(f[r], totals[r], grid) for r in range(world)])
    for buf in bufs:
        buf.copy_(torch.randn(world * rows, K).to(torch.bfloat16))
    ag_gemm.written_kernel.interpret_ranks[(1,)]([(f[r], totals[r]) for r in range(world)])
    for r in range(world):
        flags[r][0, 2] -= 1                               # rank 2's word never came
    c = [torch.zeros((world * rows, N), dtype=torch.bfloat16) for _ in range(world)]
    b = torch.randn(N, K).to(torch.bfloat16)
    with pytest.raises(InterpretError, match=r"deadlock.*flag \(0, 2\) of 'Flags' holds 0, "
                                             r"waiting for 1"):
        ag_gemm.ag_gemm_kernel.interpret_ranks[(grid,)](
            [(bufs[r], b, c[r], f[r], totals[r], rows) for r in range(world)], BM=64,
            num_warps=8)


@tk.kernel(num_warps=4)
def signal_at_the_loop_top(X: tk.pgl[bf16], F: tk.pgl["i32"], n: int):
    """Each iteration announces the last one's TMA store, which may still be
    in flight: the writes come after the signal in the body, before it in time."""
    s = tk.shared_tile(bf16, (64, 64))
    tk.store(s, tk.zeros((64, 64), f32).to(bf16))
    if tk.thread_id() == 0:
        for i in range(n):
            tk.signal(F[1], (0,))  # E:signal-loop
            tk.tma.store_async(X[1], s, (0, 0))
            tk.tma.store_commit()


def test_a_signal_at_a_loop_top_sees_the_last_iterations_writes():
    with pytest.raises(tk.CompilationError) as info:
        signal_at_the_loop_top.compile(*PEERS, 3)
    error_checks.check_error(info.value, "signal-loop", "tk.signal",
                            "may still be in flight: put tk.tma.store_wait(0, read=False)", HERE)


@tk.kernel(num_warps=4)
def flag_past_the_end(F: tk.gl["i32", (4,)]):
    if tk.thread_id() == 0:
        tk.signal(F, (7,))  # E:flag-past


def test_a_compile_time_flag_past_its_tensor_is_an_error_at_the_line():
    with pytest.raises(tk.CompilationError) as info:
        flag_past_the_end.compile(S((4,), "i32"))
    error_checks.check_error(info.value, "flag-past", "tk.signal",
                            "tk.signal: flag coordinate 7 in dim 0 is outside the flags' 4", HERE)


def test_interpret_ranks_takes_each_ranks_own_views_of_the_shared_arrays():
    """Rank r's PeerTensor may be built from its own view objects: the copies
    are told apart by their memory, not by the objects."""
    xs = np.random.default_rng().standard_normal((2, 16, 16)).astype(np.float32)
    ys = [np.zeros((16, 16), np.float32) for _ in range(2)]
    copy_peer.interpret_ranks[(1,)](
        [(tk.PeerTensor.from_tensors([xs[0], xs[1]], r), ys[r]) for r in range(2)])
    assert all((y == xs[1]).all() for y in ys)


@tk.kernel(num_warps=4)
def hand_over_to_a_warp(X: tk.gl[f32], Y: tk.gl[f32], F: tk.gl["i32"], MEET: tk.constexpr):
    """Block 0 writes X and signals; in block 1 warp 0 waits for the signal
    and warp 1 copies X into Y, after meeting warp 0 at a barrier when MEET."""
    if tk.block_id(0) == 0:
        tk.store(X, tk.full((16, 16), 2.0, f32), (0, 0))
        tk.barrier()
        if tk.thread_id() == 0:
            tk.signal(F, (0,), scope="gpu")
    else:
        if tk.thread_id() == 0:
            tk.wait_signal(F, (0,), 1, scope="gpu")
        if MEET:
            tk.barrier()
        if tk.warp_id() == 1:
            tk.store(Y, tk.load(X, (0, 0), (16, 16), scope="warp"), (0, 0))  # E:warp-not-told


def test_only_the_warp_that_waited_is_ordered_until_its_block_meets_it(monkeypatch):
    """Knowledge from a wait is per warp (interpreter/ordering.py): warp 1
    reading what warp 0 waited for, with no barrier between them, is
    reported (whichever of the two warps the scheduler runs first); after a
    barrier it is ordered."""
    _reported_at_every_seed_until_they_meet(hand_over_to_a_warp, "warp-not-told", monkeypatch,
                                            seeds=range(8))


def _reported_at_every_seed_until_they_meet(kernel, marker, monkeypatch, seeds):
    """kernel.interpret[(2,)](X, Y, F, MEET=False) raises block 1's unordered
    read of X at `marker` under every seed; with MEET it copies X into Y."""
    from tk_mlir import interpreter
    x, y = np.zeros((16, 16), np.float32), np.full((16, 16), np.nan, np.float32)
    for seed in seeds:
        monkeypatch.setattr(interpreter, "SEED", seed)
        with pytest.raises(InterpretError) as info:
            kernel.interpret[(2,)](x, y, np.zeros(4, np.int32), MEET=False)
        error_checks.check_error(info.value, marker, "tk.load",
                                "block (1, 0, 0) reads element (0, 0) of argument 'X', which "
                                "block (0, 0, 0) wrote", HERE)
    for seed in seeds[:4]:
        monkeypatch.setattr(interpreter, "SEED", seed)
        y[:] = np.nan
        kernel.interpret[(2,)](x, y, np.zeros(4, np.int32), MEET=True)
        assert (y == 2.0).all()


@tk.kernel(num_warps=4)
def hand_over_from_a_warp(X: tk.gl[f32], Y: tk.gl[f32], F: tk.gl["i32"], MEET: tk.constexpr):
    """In block 0 warp 1 writes X and warp 0 signals, after meeting warp 1 at
    a barrier when MEET; block 1 waits for the signal and copies X into Y."""
    if tk.block_id(0) == 0:
        if tk.warp_id() == 1:
            tk.store(X, tk.full((16, 16), 2.0, f32, scope="warp"), (0, 0))
        if MEET:
            tk.barrier()
        if tk.thread_id() == 0:
            tk.signal(F, (0,), scope="gpu")
    else:
        if tk.thread_id() == 0:
            tk.wait_signal(F, (0,), 1, scope="gpu")
        tk.barrier()
        tk.store(Y, tk.load(X, (0, 0), (16, 16)), (0, 0))  # E:signal-not-covering


def test_a_signal_covers_only_the_writes_its_warp_is_ordered_after(monkeypatch):
    """A signal publishes its warp's vector clock (interpreter/ordering.py):
    another warp's write it never met at a barrier is not covered, at every
    seed; after a barrier it is."""
    _reported_at_every_seed_until_they_meet(hand_over_from_a_warp, "signal-not-covering",
                                            monkeypatch, seeds=range(6))
