"""The Blackwell tile language (tk_mlir/tensor_memory.py, target="sm_100a"),
checked without the hardware: the PTX of each op (FileCheck), ptxas and
nvdisasm (UTCHMMA, UTCBAR, LDTM/STTM), the interpreter's numerics and
hazards, and the compile-time rules of tensor memory. None of it has run on
a Blackwell GPU."""
from __future__ import annotations

import re

import numpy as np
import pytest

import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.interpreter import InterpretError
from tk_mlir.toolchain import find_tool

from filecheck_util import filecheck

torch = pytest.importorskip("torch")
needs_ptxas = pytest.mark.skipif(find_tool("ptxas") is None, reason="needs ptxas")
needs_nvdisasm = pytest.mark.skipif(find_tool("nvdisasm") is None or find_tool("ptxas") is None,
                                    reason="needs ptxas and nvdisasm")


def mma_tile(A: tk.gl, B: tk.gl, C: tk.gl[f32], K: tk.constexpr, N: tk.constexpr,
             TRANSPOSE_B: tk.constexpr = False, WAIT: tk.constexpr = True,
             COMMIT: tk.constexpr = True, BK: tk.constexpr = 64):
    """C (128 x N, f32) = A (128 x K) @ B (N x K).T (or B (K x N)) through one
    tensor tile: TMA loads of BK-wide K steps (128 bytes), one thread's MMAs, a
    commit per step, tensor loads of at most 128 columns."""
    EPI = min(N, 128)
    a = tk.shared_tile(A.dtype, (128, BK), swizzle=128)
    b = tk.shared_tile(B.dtype, (BK, N) if TRANSPOSE_B else (N, BK), swizzle=128)
    loaded, done = tk.semaphore(1), tk.semaphore(1)
    acc = tk.tensor_tile(f32, (128, N))
    for k in range(K // BK):
        if tk.warp_id() == 0:
            if tk.elect_leader():
                tk.tma.expect(loaded, a, b)
                tk.tma.load_async(a, A, (0, k), loaded)
                tk.tma.load_async(b, B, (k, 0) if TRANSPOSE_B else (0, k), loaded)
                tk.wait(loaded, k % 2)
                if TRANSPOSE_B:
                    tk.mma_AB(acc, a, b, accumulate=k > 0)
                else:
                    tk.mma_ABt(acc, a, b, accumulate=k > 0)
                if COMMIT:
                    tk.mma_commit(done)
        if WAIT:
            tk.wait(done, k % 2)
    for j in tk.static_range(N // EPI):
        tk.store(C, tk.load(acc.columns(j * EPI, EPI)), (0, j))
    tk.free_tensor_tile(acc)


MMA_TILE = tk.kernel(mma_tile, num_warps=4, target="sm_100a")


def compile_mma(monkeypatch, dtype=tk.bf16, K=128, N=128):
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    return MMA_TILE.compile(tk.spec((128, K), dtype), tk.spec((N, K), dtype),
                            tk.spec((128, N), f32), K=K, N=N, BK=128 if dtype == tk.f8e4m3 else 64)


def test_the_ptx_of_each_tensor_memory_op(monkeypatch):
    ptx = compile_mma(monkeypatch, K=64, N=256).asm["ptx"]
    filecheck(ptx, """
        CHECK: tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32
        CHECK-NEXT: tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;
        CHECK: tcgen05.fence::before_thread_sync;
        CHECK: bar.sync 0;
        CHECK: tcgen05.fence::after_thread_sync;
        CHECK: tcgen05.mma.cta_group::1.kind::f16
        CHECK: tcgen05.mma.cta_group::1.kind::f16
        CHECK: tcgen05.mma.cta_group::1.kind::f16
        CHECK: tcgen05.mma.cta_group::1.kind::f16
        CHECK: tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64
        CHECK: mbarrier.try_wait.parity
        CHECK: tcgen05.fence::after_thread_sync;
        CHECK: tcgen05.ld.sync.aligned.32x32b.x128.b32
        CHECK: tcgen05.ld.sync.aligned.32x32b.x128.b32
        CHECK-NEXT: tcgen05.wait::ld.sync.aligned;
        CHECK: tcgen05.dealloc.cta_group::1.sync.aligned.b32
    """)
    # One instruction per 16 of K (one step of 64: 4), the allocation a power of two.
    assert len(re.findall(r"tcgen05\.mma\.", ptx)) == 4
    assert re.search(r"mov\.(b|u)32\s+%r\d+, 256;", ptx)


def test_the_instruction_descriptor_reaches_the_ptx(monkeypatch):
    """bf16 M=128 N=256 K-major: 0x08400490 = 138413200."""
    ptx = compile_mma(monkeypatch, K=64, N=256).asm["ptx"]
    assert "138413200" in ptx


def test_fp8_operands_are_kind_f8f6f4(monkeypatch):
    ptx = compile_mma(monkeypatch, dtype=tk.f8e4m3, K=128, N=64).asm["ptx"]
    assert "kind::f16" not in ptx
    # fp8: K = 32 per instruction, 4 per 128-column step.
    assert len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f8f6f4", ptx)) == 4


@needs_nvdisasm
@pytest.mark.parametrize("dtype, mma", [(tk.bf16, "UTCHMMA"), (tk.f8e4m3, "UTCQMMA")])
def test_ptxas_assembles_it_and_nvdisasm_shows_the_tensor_core_ops(monkeypatch, dtype, mma):
    compiled = compile_mma(monkeypatch, dtype=dtype, K=128, N=128)
    assert compiled.info["spill stores (bytes)"] == 0
    sass = compiled.asm["sass"]
    for op in (mma, "UTCBAR", "LDTM"):
        assert re.search(rf"\b{op}\b", sass), op


@tk.kernel(num_warps=4, target="sm_100a")
def pair_tile(A: tk.gl, B: tk.gl, C: tk.gl[f32], K: tk.constexpr,
              SHARED_B: tk.constexpr = False, EARLY: tk.constexpr = False):
    """C (256 x 256) = A @ B.T over a cluster of 2: block r loads rows 128r..
    of A and of B (SHARED_B: block 0 multicasts rows 0.. of B to both), block 0
    issues one M = 256 MMA per K step for both. EARLY: block 1 says its
    operands are in before its loads land (a race)."""
    tk.use_cluster(2)
    rank = tk.cluster_rank()
    a = tk.shared_tile(A.dtype, (128, 64), swizzle=128)
    b = tk.shared_tile(B.dtype, (128, 64), swizzle=128)
    loaded, ready, done = tk.semaphore(1), tk.semaphore(2), tk.semaphore(1)
    acc = tk.tensor_tile(f32, (128, 256))
    for k in range(K // 64):
        if tk.warp_id() == 0:
            if tk.elect_leader():
                tk.tma.expect(loaded, a, b)
                tk.tma.load_async(a, A, (rank, k), loaded)
                if SHARED_B:
                    if rank == 0:
                        tk.tma.load_async(b, B, (0, k), loaded, multicast=0b11)
                else:
                    tk.tma.load_async(b, B, (rank, k), loaded)
                if EARLY:
                    if rank == 1:
                        tk.arrive(ready, cta=0)        # too early: before its loads land
                tk.wait(loaded, k % 2)
                if not EARLY or rank == 0:
                    tk.arrive(ready, cta=0)            # both blocks' operands are in
                if rank == 0:
                    tk.wait(ready, k % 2)
                    tk.mma_ABt(acc, a, b, accumulate=k > 0, pair=True)
                    tk.mma_commit(done)                # arrives in both blocks
        tk.wait(done, k % 2)
    for j in tk.static_range(2):
        tk.store(C, tk.load(acc.columns(j * 128, 128)), (rank, j))
    tk.free_tensor_tile(acc)


def compile_pair(monkeypatch):
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    return pair_tile.compile(tk.spec((256, 64), tk.bf16), tk.spec((256, 64), tk.bf16),
                             tk.spec((256, 256), f32), K=64)


def test_a_pair_mma_is_cta_group_2_throughout(monkeypatch):
    ptx = compile_pair(monkeypatch).asm["ptx"]
    filecheck(ptx, """
        CHECK: tcgen05.alloc.cta_group::2.sync.aligned.shared::cta.b32
        CHECK-NEXT: tcgen05.relinquish_alloc_permit.cta_group::2.sync.aligned;
        CHECK: tcgen05.mma.cta_group::2.kind::f16
        CHECK: tcgen05.commit.cta_group::2.mbarrier::arrive::one.shared::cluster.multicast::cluster.b64
        CHECK: tcgen05.dealloc.cta_group::2.sync.aligned.b32
    """)
    assert "cta_group::1" not in ptx
    # M = 256 (16 << 24) by N = 256 (32 << 17), bf16 x bf16 -> f32.
    assert str(0x1040_0490) in ptx


@needs_nvdisasm
def test_nvdisasm_shows_the_two_cta_mma(monkeypatch):
    compiled = compile_pair(monkeypatch)
    assert compiled.info["spill stores (bytes)"] == 0
    sass = compiled.asm["sass"]
    assert re.search(r"\bUTCHMMA\.2CTA\b", sass) and re.search(r"\bUTCBAR\.2CTA\b", sass)


def test_the_interpreter_computes_a_pair_product():
    """Block 0 multiplies both blocks' halves; each block's tile takes its
    rows: C = A @ B.T over M = N = 256, two clusters of two blocks."""
    torch.manual_seed(2)
    a, b = torch.randn(256, 128).bfloat16(), torch.randn(256, 128).bfloat16()
    c = torch.full((256, 256), float("nan"))
    pair_tile.interpret[(2,)](a, b, c, K=128)
    assert rel_err(c, a.double() @ b.double().T) < 1e-6


def test_a_pair_mma_from_block_1_is_reported():
    @tk.kernel(num_warps=4, target="sm_100a")
    def wrong_block(A: tk.gl, C: tk.gl[f32]):
        tk.use_cluster(2)
        a = tk.shared_tile(A.dtype, (128, 64), swizzle=128)
        done = tk.semaphore(1)
        acc = tk.tensor_tile(f32, (128, 128))
        tk.copy(a, A, (0, 0))
        tk.cluster_sync()
        if tk.warp_id() == 0:
            if tk.elect_leader():
                if tk.cluster_rank() == 1:
                    tk.mma_ABt(acc, a, a.subtile(0, 64), accumulate=False, pair=True)
                    tk.mma_commit(done)
        tk.wait(done, 0)
        tk.free_tensor_tile(acc)
    with pytest.raises(InterpretError, match=r"a pair=True MMA is issued by block 0 of the "
                                             r"pair, not by block 1"):
        wrong_block.interpret[(2,)](torch.randn(128, 64).bfloat16(), torch.zeros(128, 128))


def test_a_pair_mma_reading_the_other_blocks_operand_in_flight_is_reported(monkeypatch):
    """Across blocks only what is in flight is checked, so the race shows
    under the schedules where block 1's loads have not landed yet."""
    from tk_mlir import interpreter
    a, b = torch.randn(256, 64).bfloat16(), torch.randn(256, 64).bfloat16()
    found = []
    for seed in range(6):
        monkeypatch.setattr(interpreter, "SEED", seed)
        try:
            pair_tile.interpret[(2,)](a, b, torch.zeros(256, 256), K=64, EARLY=True)
        except InterpretError as e:
            found.append(str(e))
    assert found and all(re.search(r"this tcgen05\.mma \(pair=True: block \(1, 0, 0\)'s "
                                    r"operand\) reads the shared tile allocated at .* while the "
                                    r"TMA load issued at .* is still writing it", m) for m in found)


def test_a_pair_takes_its_stages_by_multicast(monkeypatch):
    a, b = torch.randn(256, 128).bfloat16(), torch.randn(128, 128).bfloat16()
    c = torch.full((256, 256), float("nan"))
    pair_tile.interpret[(2,)](a, b, c, K=128, SHARED_B=True)
    both = torch.cat((b, b)).double()                 # each block's half of N is B's rows
    assert rel_err(c, a.double() @ both.T) < 1e-6
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    ptx = pair_tile.compile(tk.spec((256, 128), tk.bf16), tk.spec((128, 128), tk.bf16),
                            tk.spec((256, 256), f32), K=128, SHARED_B=True).asm["ptx"]
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes." \
           "multicast" in ptx and "tcgen05.mma.cta_group::2" in ptx


def rel_err(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------- interpreter

@pytest.mark.parametrize("dtype, transpose_b, N", [(torch.bfloat16, False, 128),
                                                   (torch.float16, True, 64),
                                                   (torch.bfloat16, False, 48)])
def test_the_interpreter_computes_the_product(dtype, transpose_b, N):
    K = 192
    a = torch.randn(128, K).to(dtype)
    b = torch.randn(K, N).to(dtype) if transpose_b else torch.randn(N, K).to(dtype)
    c = torch.full((128, N), float("nan"))
    MMA_TILE.interpret[(1,)](a, b, c, K=K, N=N, TRANSPOSE_B=transpose_b)
    ref = a.double() @ (b.double() if transpose_b else b.double().T)
    assert ((c.double() - ref).norm() / ref.norm()).item() < 1e-6


@tk.kernel(num_warps=4, target="sm_100a")
def biased_tile(A: tk.gl, Bias: tk.gl[f32], C: tk.gl[f32]):
    """C = Bias + A @ A.T: the bias goes into the tensor tile (tcgen05.st),
    the MMA accumulates onto it."""
    a = tk.shared_tile(A.dtype, (128, 64), swizzle=128)
    done = tk.semaphore(1)
    acc = tk.tensor_tile(f32, (128, 128))
    tk.store(acc, tk.load(Bias, (0, 0), (128, 128), layout="tmem", scope="warpgroup"))
    tk.copy(a, A, (0, 0))                   # (a block barrier: the stores are done)
    if tk.warp_id() == 0:
        if tk.elect_leader():
            tk.mma_ABt(acc, a, a)           # accumulate=True: onto the bias
            tk.mma_commit(done)
    tk.wait(done, 0)
    tk.store(C, tk.load(acc), (0, 0))
    tk.free_tensor_tile(acc)


def test_a_tensor_store_then_an_accumulating_mma(monkeypatch):
    a, bias = torch.randn(128, 64).bfloat16(), torch.randn(128, 128)
    c = torch.full((128, 128), float("nan"))
    biased_tile.interpret[(1,)](a, bias, c)
    assert rel_err(c, bias.double() + a.double() @ a.double().T) < 1e-6
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    ptx = biased_tile.compile(tk.spec((128, 64), tk.bf16), tk.spec((128, 128), f32),
                              tk.spec((128, 128), f32)).asm["ptx"]
    filecheck(ptx, """
        CHECK: tcgen05.st.sync.aligned.32x32b.x128.b32
        CHECK-NEXT: tcgen05.wait::st.sync.aligned;
        CHECK-NEXT: tcgen05.fence::before_thread_sync;
        CHECK: bar.sync 0;
        CHECK: tcgen05.fence::after_thread_sync;
        CHECK: tcgen05.mma.cta_group::1.kind::f16
    """)


def test_reading_the_tile_before_the_commits_phase_is_reported():
    a, b = torch.randn(128, 64).bfloat16(), torch.randn(64, 64).bfloat16()
    with pytest.raises(InterpretError, match=r"this tensor load \(tcgen05\.ld\) reads the "
                                             r"tensor tile allocated at .* while the "
                                             r"tcgen05\.mma issued at .* is still writing it: "
                                             r"wait on its semaphore first \(the phase of the "
                                             r"tk\.mma_commit after it\)"):
        MMA_TILE.interpret[(1,)](a, b, torch.zeros(128, 64), K=64, N=64, WAIT=False)


def test_a_read_after_the_mma_completed_but_before_its_wait_names_the_mma():
    """Under the seeds where the MMA has finished before the unwaited read,
    the report names the MMA that wrote the tile (it said 'the TMA load')."""
    import tk_mlir.interpreter as interpreter
    a, b = torch.randn(128, 64).bfloat16(), torch.randn(64, 64).bfloat16()
    messages = []
    for seed in range(12):
        interpreter.SEED = seed
        try:
            with pytest.raises(InterpretError) as e:
                MMA_TILE.interpret[(1,)](a, b, torch.zeros(128, 64), K=64, N=64, WAIT=False)
        finally:
            interpreter.SEED = 0
        messages.append(str(e.value))
    assert not any("TMA load" in m for m in messages), messages
    assert any("which the tcgen05.mma at" in m and "without waiting for the semaphore phase "
               "that tcgen05.mma completes" in m for m in messages), messages


@tk.kernel(num_warps=4, target="sm_100a")
def one_mma(A: tk.gl, C: tk.gl[f32], n: int, BUG: tk.constexpr):
    """C = A @ A.T by one thread's MMA, and then what BUG names, that a
    kernel must not do: "early_store" (a tensor store before the commit's
    phase), "early_copy" (overwrite the operand before it), "lost_commit"
    (the commit under a condition false at run time: n = 1)."""
    a = tk.shared_tile(A.dtype, (128, 64), swizzle=128)
    done = tk.semaphore(1)
    acc = tk.tensor_tile(f32, (128, 128))
    tk.copy(a, A, (0, 0))
    if tk.warp_id() == 0:
        if tk.elect_leader():
            tk.mma_ABt(acc, a, a, accumulate=False)
            if BUG != "lost_commit" or n > 1:
                tk.mma_commit(done)
    if BUG == "early_store":
        tk.store(acc, tk.zeros((128, 128), f32, layout="tmem", scope="warpgroup"))
    if BUG == "early_copy":
        tk.copy(a, A, (0, 1))
    if BUG != "lost_commit":
        tk.wait(done, 0)
        tk.store(C, tk.load(acc), (0, 0))
    tk.free_tensor_tile(acc)


@pytest.mark.parametrize("bug, message", [
    ("early_store", r"this tensor store \(tcgen05\.st\) writes the tensor tile allocated at .* "
                    r"while the tcgen05\.mma issued at .* still writes it"),
    ("early_copy", r"writes the shared tile allocated at .* while the tcgen05\.mma issued at .* "
                   r"still reads it"),
    ("lost_commit", r"frees the tensor tile allocated at .*, which the tcgen05\.mma issued at "
                    r".* writes, and that MMA was never committed"),
])
def test_mma_hazards_are_reported(bug, message):
    with pytest.raises(InterpretError, match=message):
        one_mma.interpret[(1,)](torch.randn(128, 128).bfloat16(), torch.zeros(128, 128), 1,
                                BUG=bug)


def test_tensor_memory_allocation_rules_in_the_interpreter():
    """The allocator itself (the compile-time rules keep kernels from
    reaching these): double allocation, over the budget, use after free,
    double free, a block ending with columns held."""
    from tk_mlir.dialects import types as T
    from tk_mlir.interpreter.machine import Block, Loc
    from tk_mlir.interpreter.shared import Allocation, whole
    block = Block((0, 0, 0), (1, 1, 1), 4)
    tmem, loc = block.tmem, Loc("k.py", 3, 0)      # (a blackwell.TensorMemory)
    big, small = (Allocation(i, T.TT("f32", 128, n), 1, False, f"k.py:{i}") for i, n in
                  ((1, 384), (2, 128)))
    tmem.allocate(block, big, 512, loc, "k.py:1")
    with pytest.raises(InterpretError, match="double allocation"):
        tmem.allocate(block, big, 512, loc, "k.py:1")
    with pytest.raises(InterpretError, match=r"tensor memory exhausted: .* needs 128 columns, "
                                             r"and the live tiles hold 512 at k.py:1"):
        tmem.allocate(block, small, 128, loc, "k.py:2")
    with pytest.raises(InterpretError, match="ends holding the 512 tensor-memory columns"):
        tmem.check_released("(0, 0, 0)")
    tmem.free(block, whole(big), loc, "k.py:9")
    with pytest.raises(InterpretError, match="use after free: .* freed at k.py:9"):
        tmem.holds(whole(big), loc, "this load")
    with pytest.raises(InterpretError, match="double free"):
        tmem.free(block, whole(big), loc, "k.py:10")
    tmem.allocate(block, small, 128, loc, "k.py:2")       # its columns are free again
    assert np.isnan(block.smem.read(whole(small))).all()


# ----------------------------------------------------- compile-time rules

def _compile(fn, *specs, **kw):
    return tk.kernel(fn, num_warps=4, target="sm_100a").compile(*specs, **kw)


SPEC_A = tk.spec((128, 64), tk.bf16)
SPEC_C = tk.spec((128, 128), tk.f32)


def test_a_tensor_tile_wider_than_tensor_memory_is_refused_at_its_line():
    def wide(C: tk.gl[f32]):
        acc = tk.tensor_tile(f32, (128, 640))
        tk.free_tensor_tile(acc)
    with pytest.raises(tk.CompilationError, match=r"a tensor tile's columns are a multiple of "
                       r"16 up to 512 .*, got f32 128x640 tensor tile") as e:
        _compile(wide, SPEC_C)
    assert "tk.tensor_tile(f32, (128, 640))" in str(e.value)


def test_tiles_over_the_column_budget_are_refused():
    def over(C: tk.gl[f32]):
        x = tk.tensor_tile(f32, (128, 256))
        y = tk.tensor_tile(f32, (128, 272))         # takes 512 columns
        tk.free_tensor_tile(y)
        tk.free_tensor_tile(x)
    with pytest.raises(tk.CompilationError, match=r"tensor memory exhausted: the tensor tiles "
                       r"live here take 768 columns \(256 at .*, 512 at .*\), a block has 512"):
        _compile(over, SPEC_C)


def test_freeing_first_makes_room():
    def reuse(C: tk.gl[f32]):
        x = tk.tensor_tile(f32, (128, 512))
        tk.free_tensor_tile(x)
        y = tk.tensor_tile(f32, (128, 256))
        tk.store(C, tk.load(y.columns(0, 128)), (0, 0))
        tk.free_tensor_tile(y)
    _compile(reuse, SPEC_C)


@pytest.mark.parametrize("body, message", [
    ("never_freed", r"this tensor tile is never freed: call tk.free_tensor_tile"),
    ("freed_twice", r"this tensor tile was already freed at"),
    ("used_after_free", r"this uses a tensor tile freed at"),
    ("no_commit", r"no tk.mma_commit\(sem\) follows this MMA"),
    ("in_a_loop", r"allocating a tensor tile is done by the whole block at the kernel's top "
                  r"level"),
    ("on_hopper", r"tk.tensor_tile is Blackwell's \(sm_100a"),
    ("register_operand", r"into a tensor tile, a must be a shared tile"),
    ("wide_n", r"tcgen05.mma's N is a multiple of 16 from 16 to 256, got 512"),
    ("load_layout", r"in the tmem layout: idx, shape, fill, dtype, cache, layout and scope do "
                    r"not apply"),
    ("pair_without_cluster", r"pair=True is one MMA over the two blocks of a cluster: call "
                             r"tk.use_cluster\(2\) at the kernel's top level \(it has no "
                             r"cluster\)"),
    ("pair_and_single", r"this MMA is one block's, but the MMA at .* pairs blocks"),
    ("columns_misaligned", r"columns\(8, 16\) of the f32 128x128 tensor tile: start must be a "
                           r"multiple of 16"),
    ("store_layout", r"f32 128x128 tensor tile moves to and from an f32 128x128 register tile "
                     r"in the tmem layout of warpgroup scope .*, got f32 128x128 tile \(vec, "
                     r"block\)"),
    ("load_too_wide", r"f32 128x256 tile \(tmem, warpgroup\) needs 256 registers per thread "
                      r".*; load the tensor tile a piece of columns at a time"),
    ("pair_shape", r"tk.mma_ABt\(pair=True\): each block's 128x64 rows of a by half of b "
                   r"\(64x128 here, N = 256 over the pair\) do not fit its f32 128x128 "
                   r"tensor tile"),
])
def test_tensor_memory_rules_are_refused_at_their_line(body, message):
    def kernel(A: tk.gl, C: tk.gl[f32], BODY: tk.constexpr):
        a = tk.shared_tile(A.dtype, (128, 64), swizzle=128)
        done = tk.semaphore(1)
        if BODY == "in_a_loop":
            for i in range(2):
                t = tk.tensor_tile(f32, (128, 128))
        acc = tk.tensor_tile(f32, (128, 512 if BODY == "wide_n" else 128))
        tk.copy(a, A, (0, 0))
        if tk.warp_id() == 0:
            if tk.elect_leader():
                if BODY == "register_operand":
                    tk.mma_ABt(acc, tk.load(A, (0, 0), (128, 64)), a)
                if BODY == "wide_n":
                    tk.mma_AB(acc, a, tk.shared_tile(A.dtype, (64, 512), swizzle=128))
                if BODY == "pair_and_single":
                    tk.mma_ABt(acc, a, a.subtile(0, 64), accumulate=False, pair=True)
                if BODY == "pair_shape":
                    tk.mma_ABt(acc, a, a, pair=True)
                if BODY == "pair_without_cluster":
                    tk.mma_ABt(acc, a, a.subtile(0, 64), accumulate=False, pair=True)
                else:
                    tk.mma_ABt(acc, a, a, accumulate=False)
                if BODY != "no_commit":
                    tk.mma_commit(done)
        tk.wait(done, 0)
        if BODY == "load_layout":
            tk.load(acc, layout="row")
        if BODY == "load_too_wide":
            wide = tk.tensor_tile(f32, (128, 256))
            tk.store(C, tk.load(wide), (0, 0))
            tk.free_tensor_tile(wide)
        if BODY == "columns_misaligned":
            tk.load(acc.columns(8, 16))
        if BODY == "store_layout":
            tk.store(acc, tk.zeros((128, 128), f32))
        if BODY != "never_freed":
            tk.free_tensor_tile(acc)
        if BODY == "freed_twice":
            tk.free_tensor_tile(acc)
        if BODY == "used_after_free":
            tk.store(C, tk.load(acc), (0, 0))
    k = tk.kernel(kernel, num_warps=4, target="sm_90a" if body == "on_hopper" else "sm_100a")
    with pytest.raises(tk.CompilationError, match=message):
        k.compile(tk.spec((128, 128), tk.bf16), SPEC_C, BODY=body)


@pytest.mark.filterwarnings("ignore:.*tk.mma_commit runs on every thread")
def test_an_mma_issued_by_every_thread_warns():
    def every(A: tk.gl, C: tk.gl[f32]):
        a = tk.shared_tile(A.dtype, (128, 64), swizzle=128)
        done = tk.semaphore(1)
        acc = tk.tensor_tile(f32, (128, 128))
        tk.copy(a, A, (0, 0))
        tk.mma_ABt(acc, a, a, accumulate=False)
        tk.mma_commit(done)
        tk.wait(done, 0)
        tk.free_tensor_tile(acc)
    with pytest.warns(tk.TkLintWarning, match=r"tk.tensor_mma runs on every thread of the "
                                              r"warp: each of a warp's threads issues its own "
                                              r"MMA"):
        _compile(every, tk.spec((128, 64), tk.bf16), SPEC_C)
