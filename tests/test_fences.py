"""tk-proxy-fences (passes/fences.py): a shared tile written by threads and
then read through the async proxy (wgmma, TMA store) gets
fence.proxy.async after the writes, on every path that needs it and on no
other. The GPU test runs such a kernel against torch."""
from __future__ import annotations

import re

import pytest

import tk_mlir as tk
from tk_mlir import bf16, f32

FENCE = "fence.proxy.async.shared::cta;"


@tk.kernel(num_warps=4)
def store_then_mma(A: tk.gl[bf16], B: tk.gl[bf16], C: tk.gl[f32]):
    """C = (A / 2) @ B.T: A's tile is built in registers and stored to a
    swizzled shared tile; B's is copied in by the threads; wgmma reads both."""
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    b = tk.shared_tile(bf16, (64, 64), swizzle=128)
    x = tk.load(A, (0, 0), (64, 64)).to(f32) * 0.5
    tk.store(a, x.to(bf16))
    tk.copy(b, B, (0, 0))
    acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
    acc = tk.mma_ABt(acc, a, b)
    tk.mma_wait(0)
    tk.store(C, acc, (0, 0))


def _spec(dtype="bf16"):
    return tk.spec((64, 64), dtype)


def _lines(ptx: str) -> list[str]:
    return [line.strip() for line in ptx.splitlines()]


def test_store_then_mma_fences_between_the_writes_and_the_wgmma():
    ptx = store_then_mma.compile(_spec(), _spec(), _spec("f32")).asm["ptx"]
    lines = _lines(ptx)
    first_mma = next(i for i, l in enumerate(lines) if l.startswith("wgmma.mma_async"))
    fences = [i for i, l in enumerate(lines) if l == FENCE]
    # One for the tk.store, one for the tk.copy, both before the wgmma ...
    assert len(fences) == 2 and all(i < first_mma for i in fences), fences
    # ... each after the st.shared of its op and before the bar.sync that publishes them.
    stores = [i for i, l in enumerate(lines) if l.startswith("st.shared")]
    syncs = [i for i, l in enumerate(lines) if re.match(r"(bar\.sync|barrier\.sync)", l)]
    for f in fences:
        assert any(s < f for s in stores)
        assert any(f < s < first_mma for s in syncs), "the fence comes before the barrier"
    # The store's fence follows all of the store's writes, before the copy's writes.
    assert max(s for s in stores if s < fences[0]) < fences[0]


@tk.kernel(num_warps=4)
def store_then_load(A: tk.gl[bf16], C: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    tk.store(a, tk.load(A, (0, 0), (64, 64)))
    tk.store(C, tk.load(a), (0, 0))


def test_no_fence_when_only_threads_read_the_tile():
    ptx = store_then_load.compile(_spec(), _spec()).asm["ptx"]
    assert "fence.proxy" not in ptx


@tk.kernel(num_warps=4)
def branches(A: tk.gl[bf16], C: tk.gl[f32], n: int, LOOP: tk.constexpr, AFTER: tk.constexpr):
    """A write and an mma of the same tile, in the two branches of an if, or
    the write after the mma (AFTER); inside a loop or not (LOOP)."""
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)

    def body(acc, i):
        if AFTER:
            acc = tk.mma_ABt(acc, a, a)
            tk.mma_wait(0)
            tk.store(a, tk.load(A, (0, 0), (64, 64)))
        elif i + n > 3:
            tk.store(a, tk.load(A, (0, 0), (64, 64)))
        else:
            acc = tk.mma_ABt(acc, a, a)
            tk.mma_wait(0)
        return acc

    acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
    if LOOP:
        for i in range(n):
            acc = body(acc, i)
    else:
        acc = body(acc, n)
    tk.store(C, acc, (0, 0))


@pytest.mark.parametrize("loop,after,fenced", [
    (False, False, False),   # then-branch writes, else-branch reads: never both on a path
    (True, False, True),     # ... but in a loop the next iteration may take the other branch
    (False, True, False),    # written after the only read
    (True, True, True),      # ... which the next iteration repeats
])
def test_fence_follows_the_paths(loop, after, fenced):
    compiled = branches.compile(_spec(), _spec("f32"), 1, LOOP=loop, AFTER=after)
    assert (FENCE in compiled.asm["ptx"]) == fenced
    assert ("nvvm.fence.proxy" in compiled.asm["tk-to-gpu"]) == fenced


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_store_then_mma_on_the_gpu(seed):
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(64, 64, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(64, 64, device="cuda", generator=g).to(torch.bfloat16)
    c = torch.full((64, 64), float("nan"), device="cuda")
    store_then_mma[(1,)](a, b, c)
    torch.cuda.synchronize()
    ref = (a.float() * 0.5).to(torch.bfloat16).float() @ b.float().T
    assert torch.allclose(c, ref, rtol=1e-3, atol=1e-3), (c - ref).abs().max()


@tk.kernel(num_warps=8)
def warp_specialized(A: tk.gl[bf16], C: tk.gl[f32], UNIFORM: tk.constexpr):
    """Warpgroup 1 builds a tile in registers and stores it; warpgroup 0 waits
    on a semaphore and reads it with wgmma: the two branches run at once in
    different threads (UNIFORM: the same shape of code under a condition all
    threads agree on, where only one branch runs)."""
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    ready = tk.semaphore(128)
    cond = tk.block_id(0) == 0 if UNIFORM else tk.warpgroup_id() == 1
    if cond:
        tk.store(a, tk.load(A, (0, 0), (64, 64), scope="warpgroup"))
        tk.arrive(ready)
    else:
        tk.wait(ready, 0)
        acc = tk.mma_ABt(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), a, a)
        tk.mma_wait(0)
        tk.store(C, acc, (0, 0))


@pytest.mark.parametrize("uniform", [False, True])
def test_branches_on_the_thread_run_at_once(uniform):
    ptx = warp_specialized.compile(_spec(), _spec("f32"), UNIFORM=uniform).asm["ptx"]
    assert (FENCE in ptx) == (not uniform)
    if not uniform:      # the fence follows the stores and comes before the arrival
        lines = _lines(ptx)
        fence = lines.index(FENCE)
        assert any(l.startswith("st.shared") for l in lines[:fence])
        assert any(l.startswith("mbarrier.arrive") for l in lines[fence:])


@tk.kernel(num_warps=8)
def two_ifs(A: tk.gl[bf16], C: tk.gl[f32], UNIFORM: tk.constexpr, READER_FIRST: tk.constexpr):
    """The warp-specialized roles of `warp_specialized` written as two ifs,
    the reader's first or second (READER_FIRST); under conditions on the
    warpgroup (both ifs run at once, in different threads) or on the block
    (UNIFORM: every thread takes the same path, in program order)."""
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    ready = tk.semaphore(128)
    who = tk.block_id(0) if UNIFORM else tk.warpgroup_id()

    def reader():
        if who == 0:
            tk.wait(ready, 0)
            acc = tk.mma_ABt(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), a, a)
            tk.mma_wait(0)
            tk.store(C, acc, (0, 0))

    def writer():
        if who == 1:
            tk.store(a, tk.load(A, (0, 0), (64, 64), scope="warpgroup"))
            tk.arrive(ready)

    if READER_FIRST:
        reader()
        writer()
    else:
        writer()
        reader()


@pytest.mark.parametrize("uniform,reader_first,fenced", [
    (False, True, True),     # the writer's warpgroup runs past the reader's if at once
    (False, False, True),
    (True, True, False),     # one path for all threads: the write comes after the only read
    (True, False, True),
])
def test_two_ifs_on_the_thread_run_in_either_order(uniform, reader_first, fenced):
    ptx = two_ifs.compile(_spec(), _spec("f32"), UNIFORM=uniform,
                          READER_FIRST=reader_first).asm["ptx"]
    assert ptx.count(FENCE) == int(fenced)
    if fenced:           # after the stores, before the arrival that publishes them
        lines = _lines(ptx)
        fence = lines.index(FENCE)
        assert any(l.startswith("st.shared") for l in lines[:fence])
        assert any(l.startswith("mbarrier.arrive") for l in lines[fence:])


@tk.kernel(num_warps=8)
def read_then_one_warpgroup_writes(A: tk.gl[bf16], C: tk.gl[f32]):
    """Every thread's wgmma, then a write by one warpgroup: no read follows it."""
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    acc = tk.mma_ABt(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), a, a)
    tk.mma_wait(0)
    tk.store(C, acc, (0, 0))
    if tk.warpgroup_id() == 1:
        tk.store(a, tk.load(A, (0, 0), (64, 64), scope="warpgroup"))


def test_a_write_under_the_thread_id_after_the_only_read_is_not_fenced():
    ptx = read_then_one_warpgroup_writes.compile(_spec(), _spec("f32")).asm["ptx"]
    assert FENCE not in ptx


@tk.kernel(num_warps=4)
def tma_round_trip(A: tk.gl[bf16], C: tk.gl[bf16], THREADS: tk.constexpr):
    """A tile loaded by TMA (or by the threads) and stored by TMA."""
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    if THREADS:
        tk.copy(a, A, (0, 0))
    else:
        s = tk.semaphore()
        if tk.elect_leader("warpgroup"):
            tk.tma.expect(s, a)
            tk.tma.load_async(a, A, (0, 0), s)
        tk.wait(s, 0)
    if tk.elect_leader("warpgroup"):
        tk.tma.store_async(C, a, (0, 0))
        tk.tma.store_commit()
    tk.tma.store_wait(0)


@pytest.mark.parametrize("threads", [False, True])
def test_tma_store_source_is_fenced_only_when_threads_wrote_it(threads):
    """TMA -> TMA needs no proxy fence (both async proxy); threads -> TMA does."""
    ptx = tma_round_trip.compile(_spec(), _spec(), THREADS=threads).asm["ptx"]
    assert ptx.count(FENCE) == (1 if threads else 0)


@pytest.mark.gpu
def test_warp_specialized_store_then_mma_on_the_gpu():
    """One warpgroup stores A's tile, the other multiplies it by itself: C = A @ A.T."""
    torch = pytest.importorskip("torch")
    a = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    c = torch.full((64, 64), float("nan"), device="cuda")
    warp_specialized[(1,)](a, c, UNIFORM=False)
    torch.cuda.synchronize()
    ref = a.float() @ a.float().T
    assert torch.allclose(c, ref, rtol=1e-3, atol=1e-3), (c - ref).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("reader_first", [True, False])
def test_two_ifs_store_then_mma_on_the_gpu(reader_first):
    """`two_ifs` on the GPU: warpgroup 1 stores A's tile, warpgroup 0 waits and
    multiplies it by itself, C = A @ A.T, whichever if comes first."""
    torch = pytest.importorskip("torch")
    a = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    c = torch.full((64, 64), float("nan"), device="cuda")
    two_ifs[(1,)](a, c, UNIFORM=False, READER_FIRST=reader_first)
    torch.cuda.synchronize()
    ref = a.float() @ a.float().T
    assert torch.allclose(c, ref, rtol=1e-3, atol=1e-3), (c - ref).abs().max()
