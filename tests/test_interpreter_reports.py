"""What the CPU interpreter finds in warp-specialized kernels, each as the small
buggy kernel a user would write, reported at the user's line (a helper's
ops, e.g. a ring's wait, report at the user's call): deadlocks, semaphore
misuse, asynchronous results and copies used too early, races by
happens-before, out-of-range indices. Each bug is found whatever the
interleaving: the tests run several seeds."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import tk_mlir as tk
from tk_mlir import bf16, f32
from tk_mlir.interpreter import InterpretError

HERE = Path(__file__).resolve()
TILES = 4                      # 64-row tiles through a 2-slot ring: each slot used twice


def line_of(text: str) -> int:
    return next(i for i, l in enumerate(HERE.read_text().splitlines(), 1) if text in l)


def inputs(rows=64 * TILES):
    a = torch.randn(rows, 64).to(torch.bfloat16)
    return a, torch.full((rows, 64), float("nan"))


def interpret_at(seed, kernel, *args, grid=(1,), **kwargs) -> None:
    """kernel.interpret[grid](*args, **kwargs) under the interpreter's seed
    `seed` (its interleaving of warps)."""
    import tk_mlir.interpreter as interpreter
    interpreter.SEED = seed
    try:
        kernel.interpret[grid](*args, **kwargs)
    finally:
        interpreter.SEED = 0


def report(kernel, *args, seeds=range(3), same_line=True, **kwargs) -> InterpretError:
    """The InterpretError the kernel raises under every seed (at the same line
    under each, unless same_line=False: which of two racing sides is seen
    first depends on the interleaving)."""
    found = []
    for seed in seeds:
        with pytest.raises(InterpretError) as e, warnings.catch_warnings():
            warnings.simplefilter("ignore", tk.TkLintWarning)
            interpret_at(seed, kernel, *args, **kwargs)
        found.append(e.value)
    if same_line:
        assert len({(x.filename, x.line) for x in found}) == 1, [str(x) for x in found]
    return found[0]


@tk.kernel(num_warps=8)
def ring_by_hand(A: tk.gl, C: tk.gl, BUG: tk.constexpr = ""):
    """Warpgroup 1 loads A's 64-row tiles through two slots; warpgroup 0 copies
    each to C through registers. One BUG at a time."""
    tiles = tk.cdiv(A.shape[0], 64)
    st = tk.shared_tiles(A.dtype, (64, 64), 2, swizzle=128)
    full = tk.semaphores(2)                           # MARK: full
    empty = tk.semaphores(2, arrivals=4)              # MARK: empty
    if tk.warpgroup_id() == 1:
        if tk.elect_leader("warpgroup"):
            for i in range(tiles):
                s = i % 2
                if BUG == "producer phase":
                    tk.wait(empty[s], (i // 2) & 1)   # MARK: producer phase
                elif BUG != "no empty wait":
                    tk.wait(empty[s], ((i // 2) & 1) ^ 1)
                if BUG == "bytes":
                    tk.tma.expect_bytes(full[s], 4096)  # MARK: expect
                elif BUG == "more bytes":
                    tk.tma.expect_bytes(full[s], 16384)  # MARK: expect more
                else:
                    tk.tma.expect(full[s], st[s])
                tk.tma.load_async(st[s], A, (i, 0), full[s])  # MARK: load
    else:
        for i in range(tiles):
            s = i % 2
            if BUG == "consumer phase":
                tk.wait(full[s], ((i // 2) & 1) ^ 1)  # MARK: consumer phase
            else:
                tk.wait(full[s], (i // 2) & 1)        # MARK: consumer wait
            x = tk.load(st[s], layout="row", scope="warpgroup")  # MARK: consumer load
            if BUG == "every thread arrives":
                tk.arrive(empty[s])                   # MARK: arrive
            elif BUG != "never arrives":
                # Each warp read its rows: each arrives (one elected lane),
                # so the producer's next load is ordered after every read.
                if tk.elect_leader():
                    tk.arrive(empty[s])
            tk.store(C, x.to(f32), (i, 0))


def runs_under_seeds(kernel, a, c, seeds=range(3)) -> None:
    """kernel(a, c) interprets without a report under each seed, c = a."""
    for seed in seeds:
        interpret_at(seed, kernel, a, c)
        assert torch.equal(c, a.float())


def test_the_ring_by_hand_runs():
    runs_under_seeds(ring_by_hand, *inputs())


def test_producer_phase_off_by_one_deadlocks():
    """The producer waits for the empty slot's phase 0 on a fresh semaphore:
    nothing ever completes it, and the consumers wait for tiles never loaded."""
    e = report(ring_by_hand, *inputs(), BUG="producer phase")
    assert e.line == line_of("MARK: consumer wait")
    full, empty = line_of("MARK: full"), line_of("MARK: empty")
    assert "deadlock" in e.message
    assert re.search(rf"warp 4 waits at \S+:{line_of('MARK: producer phase')} for "
                     rf"semaphore\[0\] allocated at \S+:{empty} to complete a phase of parity "
                     rf"0 \(0 phase\(s\) completed, the current one \(parity 0\) waiting for 4 "
                     rf"of 4 arrival", e.message), e.message
    assert f"semaphore[0] allocated at {HERE}:{full}" in e.message


def test_consumer_that_never_arrives_deadlocks():
    e = report(ring_by_hand, *inputs(), BUG="never arrives")
    assert "deadlock" in e.message
    assert re.search(rf"warp 4 waits at \S+:{line_of('MARK: producer phase') + 2} for "
                     rf"semaphore\[0\] allocated at \S+:{line_of('MARK: empty')} to complete a "
                     rf"phase of parity 0", e.message), e.message


@tk.kernel(num_warps=12)
def register_split_by_hand(X: tk.gl[f32], INC: tk.constexpr = 232):
    """A producer and two consumers that meet at a named barrier after
    taking their registers: 2 x INC + 40 must fit the block's 3 x 168."""
    done = tk.semaphore(arrivals=256)
    if tk.warpgroup_id() == 2:
        tk.decrease_registers(40)
        tk.wait(done, 0)
    else:
        tk.increase_registers(INC)                    # MARK: increase
        tk.named_barrier(1, warps=8)
        wg = tk.warpgroup_id()
        tk.store(X, tk.load(X, (wg, 0), (64, 64), scope="warpgroup") + 1.0, (wg, 0))
        tk.arrive(done)


def test_a_register_split_the_block_cannot_make_deadlocks():
    """setmaxnreg.inc waits until other warpgroups free registers (a
    decrease or an exit): 2 x 240 + 40 > 504 hangs on the GPU, and is a
    deadlock here at the increase; 2 x 232 + 40 runs."""
    x = torch.rand(128, 64)
    want = x + 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tk.TkLintWarning)
        register_split_by_hand.interpret[(1,)](x, INC=232)
    assert torch.equal(x, want)
    e = report(register_split_by_hand, torch.rand(128, 64), INC=240, same_line=False)
    assert "deadlock" in e.message
    assert re.search(rf"warps 0-3 wait at \S+:{line_of('MARK: increase')}: "
                     rf"tk.increase_registers\(240\) "
                     rf"waits for registers: the other warpgroups hold 280 per thread of the 3 x "
                     rf"168 the block starts with", e.message), e.message


def test_consumer_phase_off_by_one_reads_before_the_load_landed():
    """Waiting for the other parity passes at once on a fresh semaphore: the
    consumer reads the slot the TMA load has not (or not knowably) written."""
    e = report(ring_by_hand, *inputs(), BUG="consumer phase")
    assert e.line == line_of("MARK: consumer load")
    assert re.search(rf"TMA load (issued )?at \S+:{line_of('MARK: load')}", e.message), e.message


@pytest.mark.parametrize("bug, marker, says", [
    ("bytes", "MARK: expect", "armed the phase with 4096 byte(s), but the 1 TMA load(s)"),
    ("more bytes", "MARK: expect more",                             # (found as a deadlock)
     "armed the phase with 16384 byte(s), but the 1 TMA load(s)"),
])
def test_wrong_expected_bytes(bug, marker, says):
    e = report(ring_by_hand, *inputs(), BUG=bug)
    assert "transaction-byte mismatch" in e.message
    assert f":{line_of(marker)}" in e.message and f":{line_of('MARK: load')}" in e.message
    assert says in e.message, e.message


@tk.kernel(num_warps=4)
def expect_one_of_two_tiles(A: tk.gl, B: tk.gl, C: tk.gl[f32]):
    a = tk.shared_tile(A.dtype, (64, 64), swizzle=128)
    b = tk.shared_tile(B.dtype, (128, 64), swizzle=128)
    sem = tk.semaphore()
    if tk.thread_id() == 0:
        tk.tma.expect(sem, a)                           # MARK: expect a only
        tk.tma.load_async(a, A, (0, 0), sem)
        tk.tma.load_async(b, B, (0, 0), sem)
    tk.wait(sem, 0)
    tk.store(C, tk.load(a, layout="row").to(f32), (0, 0))


def test_an_expect_short_of_two_loads_names_both_totals():
    """Whichever load lands first (b's 16384 bytes overshoot the 8192 armed
    while a's are in flight; or a's complete the phase under b), a byte
    mismatch gives the phase's totals, not the overshoot of the moment. (A
    schedule where a lands before b is issued reports b's load, left
    unwaited for in a phase no expect armed, and says why it may be.)"""
    a, b = torch.randn(64, 64).to(torch.bfloat16), torch.randn(128, 64).to(torch.bfloat16)
    mismatches = []
    for seed in range(8):
        with pytest.raises(InterpretError) as e:
            interpret_at(seed, expect_one_of_two_tiles, a, b, torch.zeros(64, 64))
        if "transaction-byte mismatch" in e.value.message:
            mismatches.append(e.value.message)
        else:
            assert "ends without waiting for the TMA load" in e.value.message and \
                "no tk.tma.expect armed that phase: if this load belongs with the ones " \
                "before it, their expect armed fewer bytes" in e.value.message, e.value.message
    assert 2 <= len(mismatches) < 8
    for message in mismatches:
        assert f":{line_of('MARK: expect a only')} armed" in message
        assert re.search(r"armed (the phase with )?8192 byte\(s\)", message) and \
            re.search(r"add up to \(?24576", message), message


@tk.kernel(num_warps=4)
def arrives_twice_on_block_0(Y: tk.gl[f32]):
    """Each block should arrive once on each block's semaphore (2 arrivals
    each); both arrive twice on block 0's instead."""
    tk.use_cluster(2)
    s = tk.semaphore(arrivals=2)
    if tk.thread_id() == 0:
        tk.arrive(s, cta=0)
        tk.arrive(s, cta=0)                                     # MARK: cta 0 again
    tk.wait(s, 0)
    tk.cluster_sync()
    tk.store(Y, tk.full((16, 16), 1.0, f32), (tk.block_id(0), 0))


def test_a_warp_arriving_twice_on_a_peers_semaphore_is_named():
    """tk.arrive(..., cta=r) is checked as tk.arrive is: a warp arriving
    again in one phase, its block named when the semaphore is another's."""
    e = report(arrives_twice_on_block_0, torch.zeros(32, 16), grid=(2,), same_line=False)
    assert e.line == line_of("MARK: cta 0 again")
    assert re.search(r"warp 0 (of block \(1, 0, 0\) )?arrives on semaphore\[0\] .* again in "
                     r"one phase", e.message), e.message


def test_every_thread_arriving_overflows_the_semaphore():
    e = report(ring_by_hand, *inputs(), BUG="every thread arrives")
    assert e.line == line_of("MARK: arrive")
    assert "arrival overflow: 32 thread(s) arrive" in e.message
    assert "waits for 4 more of its 4 arrival(s)" in e.message


@tk.kernel(num_warps=8)
def producer_elected_per_warp(X: tk.gl, Y: tk.gl):
    """A producer warpgroup that elects a thread per warp (tk.elect_leader()'s
    default) where one per warpgroup was meant: four expects, one arrival."""
    ring = tk.ring(X.dtype, (64, 64), 2)
    if tk.warpgroup_id() == 1:
        if tk.elect_leader():
            tile, sem = ring.fill(0)     # MARK: per-warp fill
            tk.tma.load_async(tile, X, (0, 0), sem)
    else:
        s = ring.wait(0)
        tk.store(Y, tk.load(s, layout="row", scope="warpgroup").to(Y.dtype), (0, 0))
        tk.named_barrier(1, warps=4)
        ring.release(0)


def test_a_producer_elected_per_warp_is_told_of_the_warpgroup_election():
    e = report(producer_elected_per_warp, *inputs(64), same_line=True)
    assert e.line == line_of("MARK: per-warp fill")
    assert "arrival overflow" in e.message
    assert re.search(r"warps [4-7](, [4-7])* and [4-7] each arrived from this line: "
                     r"tk.elect_leader\(\) elects one thread per warp, "
                     r'tk.elect_leader\("warpgroup"\) one per warpgroup', e.message), e.message


def test_producer_that_never_waits_for_the_empty_slot_races():
    """The third load overwrites slot 0 with nothing ordering it after the
    consumer's read of the first tile, nor after the first load's write (a
    race, whatever the interleaving), or the producer runs so far ahead that
    it arms a phase still waiting for its bytes (an arrival overflow)."""
    load, read = line_of("MARK: load"), line_of("MARK: consumer load")
    for seed in range(6):
        e = report(ring_by_hand, *inputs(), BUG="no empty wait", seeds=[seed])
        if "arrival overflow" in e.message:
            assert e.line == load - 1
        elif e.line == load:
            assert re.search(rf"data race: .*(also written|read) at \S+:({load}|{read})",
                             e.message), e.message
        else:
            assert e.line == read and f":{load}" in e.message, e.message


# ------------------------------------------------------------------ wgmma

@tk.kernel(num_warps=8)
def mma_ring(A: tk.gl, C: tk.gl, EARLY: tk.constexpr = False, SHORT: tk.constexpr = False):
    """tests/test_pipeline.py's ring_copy; EARLY releases the slot before the
    wgmma reading it is waited for; SHORT loads one tile too few."""
    tiles = tk.cdiv(A.shape[0], 64)
    ring = tk.ring(A.dtype, (64, 64), 2)
    if tk.warpgroup_id() == 1:
        if tk.elect_leader("warpgroup"):
            for i in range(tiles - 1 if SHORT else tiles):
                tile, full = ring.fill(i)
                tk.tma.load_async(tile, A, (i, 0), full)   # MARK: ring load
    else:
        for i in range(tiles):
            a = ring.wait(i)                      # MARK: ring wait
            zero = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
            acc = tk.mma_ABt(zero, a, a)          # MARK: ring mma
            if EARLY:
                ring.release(i)                   # MARK: early release
            tk.mma_wait(0)
            if not EARLY:
                ring.release(i)
            tk.store(C, acc, (i, 0))


def test_mma_ring_runs():
    a, c = inputs()
    mma_ring.interpret[(1,)](a, c)
    ref = torch.stack([t @ t.T for t in a.double().split(64)]).reshape(-1, 64)
    assert float((c.double() - ref).norm() / ref.norm()) < 1e-6


def test_deadlock_inside_a_ring_method_is_reported_at_the_users_call():
    e = report(mma_ring, *inputs(), SHORT=True)
    assert (e.filename, e.line) == (str(HERE), line_of("MARK: ring wait"))
    assert re.search(rf"warps 0-3 wait at \S+:{e.line} for semaphore\[1\] allocated at "
                     rf"\S+:{line_of('ring = tk.ring(A.dtype, (64, 64), 2)')} to complete a "
                     rf"phase of parity 1 \(1 phase\(s\) completed", e.message), e.message
    assert "phase k, counting from 0, completes with parity k & 1" in e.message


@tk.kernel(num_warps=8)
def ring_never_released(A: tk.gl, C: tk.gl[f32]):
    ring = tk.ring(A.dtype, (64, 64), 1)          # MARK: one-stage ring
    if tk.warpgroup_id() == 1:
        if tk.elect_leader("warpgroup"):
            for i in range(2):
                tile, full = ring.fill(i)         # MARK: fill waits
                tk.tma.load_async(tile, A, (i, 0), full)
    else:
        for i in range(2):
            tk.store(C, tk.load(ring.wait(i), layout="row", scope="warpgroup").to(f32), (i, 0))


def test_a_rings_full_and_empty_semaphores_are_told_apart():
    """Both arrays come from the tk.ring line: the empty ones (the producer's
    wait, never released here) are named as the second made there."""
    e = report(ring_never_released, *inputs())
    ring = line_of("MARK: one-stage ring")
    assert re.search(rf"waits at \S+:{line_of('MARK: fill waits')} for semaphore\[0\] "
                     rf"allocated at \S+:{ring} \(the second semaphores made there: a tk.ring "
                     rf"or tk.lcf makes its full ones, then its empty ones\)", e.message), e.message


def test_stage_released_before_its_mma_wait():
    e = report(mma_ring, *inputs(), EARLY=True, seeds=range(6))
    assert e.line == line_of("MARK: ring load")
    assert "wgmma" in e.message, e.message


def test_a_finished_wgmmas_read_is_placed_at_the_wgmma():
    """Where the wgmma had been waited for by the time the load overwrites
    its tile, the report places its read at the wgmma (it said the wait)."""
    mma = line_of("MARK: ring mma")
    reads = [e.message for e in (report(mma_ring, *inputs(), EARLY=True, seeds=[s])
                                 for s in range(8)) if "read at" in e.message]
    assert reads and all(f"wgmma of warpgroup 0 read at {HERE}:{mma}," in m for m in reads), \
        reads


@tk.kernel(num_warps=4)
def short_expect(A: tk.gl, C: tk.gl[f32]):
    """Two tiles loaded on one semaphore whose expect counts only the first:
    the phase completes when either lands, before the other."""
    a = tk.shared_tile(A.dtype, (64, 64), swizzle=128)
    b = tk.shared_tile(A.dtype, (64, 64), swizzle=128)
    sem = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(sem, a)                                  # MARK: short expect
        tk.tma.load_async(a, A, (0, 0), sem)
        tk.tma.load_async(b, A, (1, 0), sem)
    tk.wait(sem, 0)
    x = tk.load(a, layout="row", scope="warpgroup").to(f32)
    y = tk.load(b, layout="row", scope="warpgroup").to(f32)
    tk.store(C, x + y, (0, 0))


def test_a_load_landing_after_its_phase_completed_is_reported():
    """An expect short of the loads' bytes lets the phase complete before the
    last load lands (a wait that does not wait for it): reported under every
    seed as a transaction-byte mismatch, when the phase completes with a load
    of it in flight (before a read of the tile can race with it), or when a
    load lands after its phase completed."""
    messages = [report(short_expect, *inputs(), seeds=[s], same_line=False).message
                for s in range(8)]
    assert all("transaction-byte mismatch" in m and (
        "still in flight" in m or "counts towards a phase that completed before its 8192 "
        "byte(s) landed" in m) and re.search(r"armed (fewer bytes than its loads add up to|"
                                             r"8192 byte\(s\), fewer than the loads add up "
                                             r"to \(16384\))", m)
        for m in messages), messages


MMA_RESULT_BEFORE_WAIT = """
module {
  func.func @k(%c: !tk.gl<f32, array<i64: 64, 64>>) attributes {tk.num_warps = 4 : i64} {
    %a = "tk.alloc_st"() {offset = 0 : i64} : () -> !tk.st<bf16, 64, 64, 128> loc("k.py":2:5)
    %z = "tk.fill"() {value = 0.0 : f32} : () -> !tk.rt<f32, 64, 64, "row", "warpgroup"> loc("k.py":3:5)
    %s = "tk.mma"(%z, %a, %a) {trans_a = 0 : i64, trans_b = 0 : i64} : (!tk.rt<f32, 64, 64, "row", "warpgroup">, !tk.st<bf16, 64, 64, 128>, !tk.st<bf16, 64, 64, 128>) -> !tk.rt<f32, 64, 64, "row", "warpgroup"> loc("k.py":4:5)
    "tk.store"(%c, %s) : (!tk.gl<f32, array<i64: 64, 64>>, !tk.rt<f32, 64, 64, "row", "warpgroup">) -> () loc("k.py":5:5)
    return loc("k.py":6:1)
  } loc("k.py":1:1)
}
"""


def test_mma_result_used_before_its_wait():
    """tk-verify refuses this statically (passes/async_results.py); the IR past
    it, as if the check had missed it: the interpreter's accumulator stays
    pending until each warp's tk.mma_wait."""
    from mlir import ir
    from tk_mlir.dialects import tk as tk_dialect
    from tk_mlir.interpreter.memory import GlobalArray
    from tk_mlir.interpreter.program import Program
    context = ir.Context()
    tk_dialect.load(context)
    with context:
        module = ir.Module.parse(MMA_RESULT_BEFORE_WAIT)
    c = GlobalArray(np.zeros((64, 64), np.float32), "C")
    with pytest.raises(InterpretError, match=r"tk.store uses the result of the wgmma issued "
                                             r"at k.py:4 before its tk.mma_wait") as e:
        Program(context, module).run((1, 1, 1), [c])
    assert (e.value.filename, e.value.line) == ("k.py", 5)


# ------------------------------------------------------------ TMA stores

@tk.kernel(num_warps=4)
def epilogue(A: tk.gl, C: tk.gl, BUG: tk.constexpr = ""):
    """Two 64-row tiles out through one staging tile and TMA stores."""
    stage = tk.shared_tile(A.dtype, (64, 64), swizzle=128)
    for i in range(2):
        if BUG != "no wait before reuse":
            tk.tma.store_wait(0)
        tk.named_barrier(1, warps=4)
        x = tk.load(A, (i, 0), (64, 64), layout="row", scope="warpgroup")
        tk.store(stage, x + x)                       # MARK: staging store
        tk.named_barrier(1, warps=4)
        if tk.elect_leader("warpgroup"):
            tk.tma.store_async(C, stage, (i, 0))     # MARK: tma store
            tk.tma.store_commit()
    if BUG != "exits with stores":
        tk.tma.store_wait(0)


def test_epilogue_runs():
    a = torch.randn(128, 64).to(torch.bfloat16)
    c = torch.full_like(a, float("nan"))
    epilogue.interpret[(1,)](a, c)
    assert torch.equal(c, a + a)


def test_staging_tile_rewritten_under_a_tma_store():
    a = torch.randn(128, 64).to(torch.bfloat16)
    e = report(epilogue, a, torch.empty_like(a), BUG="no wait before reuse")
    assert e.line == line_of("MARK: staging store")
    assert f"TMA store issued at {HERE}:{line_of('MARK: tma store')} still reads it" \
        in e.message, e.message


def test_block_exiting_with_tma_stores_outstanding():
    a = torch.randn(128, 64).to(torch.bfloat16)
    e = report(epilogue, a, torch.empty_like(a), BUG="exits with stores")
    assert e.line == line_of("MARK: tma store")
    assert "exits with the TMA store issued here outstanding" in e.message


def test_tma_store_of_a_thread_write_with_no_proxy_fence(monkeypatch):
    """tk-proxy-fences fences every thread write an async-proxy read may
    follow; without it (a compiler bug) the interpreter says so at the read."""
    from tk_mlir.lowering import pipeline

    @tk.kernel(num_warps=4)
    def epilogue_unfenced(A: tk.gl, C: tk.gl):
        stage = tk.shared_tile(A.dtype, (64, 64), swizzle=128)
        tk.store(stage, tk.load(A, (0, 0), (64, 64), layout="row", scope="warpgroup"))
        tk.named_barrier(1, warps=4)
        if tk.elect_leader("warpgroup"):
            tk.tma.store_async(C, stage, (0, 0))     # MARK: unfenced read
            tk.tma.store_commit()
        tk.tma.store_wait(0)

    monkeypatch.setattr(pipeline, "TK_PASSES", tuple(
        p for p in pipeline.TK_PASSES if p[0] != "tk-proxy-fences"))
    a = torch.randn(64, 64).to(torch.bfloat16)
    e = report(epilogue_unfenced, a, torch.empty_like(a), seeds=[0])
    assert e.line == line_of("MARK: unfenced read")
    assert "has no proxy fence (fence.proxy.async) after it" in e.message


# --------------------------------------------------------- named barriers

@tk.kernel(num_warps=8)
def ping_pong(A: tk.gl, C: tk.gl, BAR: tk.constexpr = 1,
              WARPS: tk.constexpr = 8):
    """Both warpgroups meet at named barrier BAR (WARPS: warpgroup 1's count)."""
    wg = tk.warpgroup_id()
    bar = BAR + tk.block_id(0)                # a run-time id
    if wg == 0:
        tk.named_barrier(bar, warps=8)        # MARK: bar 0
    else:
        tk.named_barrier(bar, warps=WARPS)    # MARK: bar 1
    x = tk.load(A, (wg, 0), (64, 64), layout="row", scope="warpgroup")
    tk.store(C, x.to(f32), (wg, 0))


def test_named_barrier_with_mismatched_warp_counts():
    a, c = inputs(128)
    e = report(ping_pong, a, c, WARPS=4, same_line=False)
    lines = {line_of("MARK: bar 0"), line_of("MARK: bar 1")}
    assert e.line in lines and "named barrier 1 reached at" in e.message
    assert "warps=4" in e.message and "warps=8" in e.message
    assert all(f":{l}" in e.message for l in lines), e.message


def test_named_barrier_id_out_of_range():
    a, c = inputs(128)
    e = report(ping_pong, a, c, BAR=16, same_line=False)
    assert e.line in {line_of("MARK: bar 0"), line_of("MARK: bar 1")}
    assert "named barrier id 16 is out of range: ids are 1 to 15" in e.message


def test_ping_pong_runs():
    a, c = inputs(128)
    ping_pong.interpret[(1,)](a, c)
    assert torch.equal(c, a.float())


@tk.kernel(num_warps=8)
def arrives_twice(A: tk.gl, C: tk.gl):
    """Warpgroup 0 hands two turns to warpgroup 1 on one barrier before it
    takes the first (warpgroup 1 gets there after both, through a
    semaphore): the GPU would count warpgroup 0's threads twice."""
    wg = tk.warpgroup_id()
    sem = tk.semaphore()
    if wg == 0:
        tk.named_barrier_arrive(1, warps=8)
        tk.named_barrier_arrive(1, warps=8)   # MARK: arrive again
        if tk.elect_leader("warpgroup"):
            tk.arrive(sem)
    else:
        tk.wait(sem, 0)
        tk.named_barrier(1, warps=8)
        tk.named_barrier(1, warps=8)
    x = tk.load(A, (wg, 0), (64, 64), layout="row", scope="warpgroup")
    tk.store(C, x.to(f32), (wg, 0))


def test_a_warp_reaching_a_named_barrier_twice_in_one_use():
    a, c = inputs(128)
    e = report(arrives_twice, a, c, seeds=range(4))
    assert e.line == line_of("MARK: arrive again")
    assert re.search(r"warp \d reaches named barrier 1 at .* a second time in one use of it",
                     e.message), e.message


@tk.kernel(num_warps=8)
def skips_its_arrival(A: tk.gl, C: tk.gl):
    """Warpgroup 0 waits at a named barrier warpgroup 1 never reaches, and
    warpgroup 1 waits for a semaphore warpgroup 0 arrives on after it."""
    wg = tk.warpgroup_id()
    sem = tk.semaphore()
    if wg == 0:
        tk.named_barrier(1, warps=8)          # MARK: never met
        if tk.elect_leader("warpgroup"):
            tk.arrive(sem)
    else:
        tk.wait(sem, 0)
    x = tk.load(A, (wg, 0), (64, 64), layout="row", scope="warpgroup")
    tk.store(C, x.to(f32), (wg, 0))


def test_a_deadlock_at_a_named_barrier_says_how_barriers_count():
    """The hint is about the barrier (the semaphore waits only follow from
    it), not semaphore parities."""
    e = report(skips_its_arrival, *inputs(128), same_line=False)
    assert re.search(rf"warps 0-3 wait at \S+:{line_of('MARK: never met')} on named barrier 1 "
                     rf"\(4 of 8", e.message), e.message
    assert "a named barrier lets its warps go once every warp it counts" in e.message
    assert "parity k & 1" not in e.message


# ------------------------------------------------------- indices, races

@tk.kernel(num_warps=4)
def picks(A: tk.gl, C: tk.gl, k: int, WHAT: tk.constexpr = "tile"):
    tiles = tk.shared_tiles(A.dtype, (128, 64), 2)
    sems = tk.semaphores(2)
    if WHAT == "tile":
        t = tiles[k].subtile(0, 64)                    # MARK: tile index
    elif WHAT == "subtile":
        t = tiles[0].subtile(k, 64)                    # MARK: subtile
    else:
        tk.wait(sems[k], 1)                            # MARK: sem index
        t = tiles[0].subtile(0, 64)
    tk.store(t, tk.load(A, (0, 0), (64, 64), layout="row", scope="warpgroup"))


@pytest.mark.parametrize("what, k, message", [
    ("tile", 2, "index 2 out of range: the array allocated at .* has 2 element"),
    ("subtile", 2, "subtile rows 128 to 191 are out of range: the shared tile\\[0\\] .* has "
                   "128 row"),
    ("sem", -1, "index -1 out of range: the array allocated at .* has 2 element"),
])
def test_out_of_range_indices(what, k, message):
    a, c = inputs(64)
    marker = {"tile": "MARK: tile index", "subtile": "MARK: subtile", "sem": "MARK: sem index"}
    e = report(picks, a, c, k, WHAT=what)
    assert e.line == line_of(marker[what])
    assert re.search(message, e.message), e.message


@tk.kernel(num_warps=8)
def unsynchronised(A: tk.gl, C: tk.gl, SYNC: tk.constexpr = False):
    """Warpgroup 0 writes a shared tile that warpgroup 1 reads; SYNC puts a
    named barrier between them."""
    st = tk.shared_tile(A.dtype, (64, 64))
    wg = tk.warpgroup_id()
    if wg == 0:
        tk.store(st, tk.load(A, (0, 0), (64, 64), layout="row", scope="warpgroup"))  # MARK: race write
        if SYNC:
            tk.named_barrier_arrive(1, warps=8)
    else:
        if SYNC:
            tk.named_barrier(1, warps=8)
        tk.store(C, tk.load(st, layout="row", scope="warpgroup").to(f32), (0, 0))  # MARK: race read


def test_unsynchronised_shared_tile_is_a_race_whatever_the_order():
    a, c = inputs(64)
    e = report(unsynchronised, a, c, seeds=range(8), same_line=False)
    w, r = line_of("MARK: race write"), line_of("MARK: race read")
    assert "data race" in e.message
    assert e.line in (w, r) and f":{w if e.line == r else r}" in e.message, e.message
    unsynchronised.interpret[(1,)](a, c, SYNC=True)
    assert torch.equal(c, a.float())


# What a race report says to do depends on what orders the two accesses so
# far: nothing (a barrier between them), or a semaphore that orders an earlier
# access of the other warp but not this one (arrive after the access).

@tk.kernel(num_warps=8)
def reread(A: tk.gl, C: tk.gl, SYNC: tk.constexpr = False):
    """The block fills a shared tile; warpgroup 0 reads it while warpgroup 1
    overwrites it, with no semaphore anywhere (SYNC: a barrier between)."""
    st = tk.shared_tile(A.dtype, (64, 64))
    tk.store(st, tk.load(A, (0, 0), (64, 64)))        # (block scope: barriers around it)
    wg = tk.warpgroup_id()
    if wg == 0:
        x = tk.load(st, layout="row", scope="warpgroup")                       # MARK: reread
        tk.store(C, x.to(f32), (0, 0))
    if SYNC:
        tk.barrier()
    if wg == 1:
        tk.store(st, tk.load(A, (1, 0), (64, 64), layout="row", scope="warpgroup"))  # MARK: refill


def test_a_race_with_no_semaphore_involved_asks_for_a_barrier():
    a = torch.randn(128, 64).to(torch.bfloat16)
    for seed in range(4):
        e = report(reread, a, torch.empty(64, 64), seeds=[seed])
        assert "data race" in e.message and e.line in (line_of("MARK: reread"),
                                                       line_of("MARK: refill")), e.message
        assert "put a barrier between the two: tk.barrier()" in e.message, e.message
        assert "tk.named_barrier(id, warps=n)" in e.message
        assert "arrive" not in e.message.replace("named_barrier_arrive", ""), e.message
    c = torch.full((64, 64), float("nan"))
    reread.interpret[(1,)](a, c, SYNC=True)
    assert torch.equal(c, a[:64].float())


@tk.kernel(num_warps=8)
def handoff(A: tk.gl, C: tk.gl, EARLY: tk.constexpr = True):
    """Warpgroup 1 writes a shared tile and arrives on `full`; warpgroup 0
    waits for it, reads the tile and releases it on `empty` (EARLY: before its
    read); warpgroup 1 waits for `empty` and overwrites the tile."""
    st = tk.shared_tile(A.dtype, (64, 64))
    full, empty = tk.semaphore(arrivals=4), tk.semaphore(arrivals=4)
    if tk.warpgroup_id() == 1:
        tk.store(st, tk.load(A, (0, 0), (64, 64), layout="row", scope="warpgroup"))
        if tk.elect_leader():
            tk.arrive(full)
        tk.wait(empty, 0)
        tk.store(st, tk.load(A, (1, 0), (64, 64), layout="row", scope="warpgroup"))  # MARK: reuse
    else:
        tk.wait(full, 0)
        if EARLY:
            if tk.elect_leader():
                tk.arrive(empty)                                   # MARK: early release
        x = tk.load(st, layout="row", scope="warpgroup")           # MARK: late read
        if not EARLY:
            if tk.elect_leader():
                tk.arrive(empty)
        tk.store(C, x.to(f32), (0, 0))


def test_a_race_a_semaphore_orders_wrongly_asks_to_arrive_after_the_access():
    a = torch.randn(128, 64).to(torch.bfloat16)
    for seed in range(4):
        e = report(handoff, a, torch.empty(64, 64), seeds=[seed])
        assert "data race" in e.message and e.line in (line_of("MARK: reuse"),
                                                       line_of("MARK: late read")), e.message
        assert "through a semaphore" in e.message and "arrive only after" in e.message, \
            e.message
        assert "tk.barrier()" not in e.message, e.message
    c = torch.full((64, 64), float("nan"))
    handoff.interpret[(1,)](a, c, EARLY=False)
    assert torch.equal(c, a[:64].float())


@tk.kernel(num_warps=4)
def same_rows(X: tk.gl[f32], Y: tk.gl[f32]):
    """Each block doubles its 16 rows, but stores them at the block's row
    tile rounded down to even: blocks 0 and 1 both write rows 0-15."""
    i = tk.block_id(0)
    x = tk.load(X, (i, 0), (16, 64))
    tk.store(Y, x + x, (i // 2 * 2, 0))              # MARK: same rows


def test_overlapping_global_writes_from_two_blocks():
    x = np.random.default_rng().standard_normal((64, 64)).astype(np.float32)
    with pytest.raises(InterpretError) as e:
        same_rows.interpret[(4,)](x, np.zeros_like(x))
    line = line_of("MARK: same rows")
    assert e.value.line == line
    assert f"blocks (0, 0, 0) and (1, 0, 0) both write element (0, 0) of argument 'Y' (at " \
           f"{HERE}:{line} and {HERE}:{line})" in e.value.message, e.value.message


@tk.kernel(num_warps=8)
def global_handoff(A: tk.gl, B: tk.gl, C: tk.gl, F: tk.gl["i32"], ORDER: tk.constexpr = ""):
    """Warpgroup 0 writes B's tile, warpgroup 1 reads it back into C: ordered
    by a barrier (ORDER="barrier"), a flag in global memory the block gives
    itself ("flag": F[0], signalled after the write), or nothing."""
    wg = tk.warpgroup_id()
    if wg == 0:
        tk.store(B, tk.load(A, (0, 0), (64, 64), scope="warpgroup"), (0, 0))   # MARK: g write
        if ORDER == "flag":
            tk.named_barrier(1, warps=4)          # (the signal covers the warpgroup's writes)
            if tk.elect_leader("warpgroup"):
                tk.signal(F, (0,), scope="gpu")
    if ORDER == "barrier":
        tk.barrier()
    if wg == 1:
        if ORDER == "flag":
            tk.wait_signal(F, (0,), 1, scope="gpu")
        tk.store(C, tk.load(B, (0, 0), (64, 64), scope="warpgroup"), (0, 0))  # MARK: g read


def test_a_global_race_within_one_block_is_reported():
    """Two warpgroups of one block, one writing global memory and the other
    reading it, race unless a barrier or a flag orders them — as the
    interpreter reports races between blocks."""
    a = torch.randint(-8, 8, (64, 64)).float()
    flag = torch.zeros(4, dtype=torch.int32)
    e = report(global_handoff, a, torch.zeros(64, 64), torch.zeros(64, 64), flag,
               seeds=range(6), same_line=False)
    w, r = line_of("MARK: g write"), line_of("MARK: g read")
    assert "data race in global memory" in e.message and e.line in (w, r), e.message
    assert f":{w if e.line == r else r}" in e.message and "same block" in e.message, e.message
    assert "tk.named_barrier" in e.message
    for order in ("barrier", "flag"):
        for seed in range(4):
            c = torch.zeros(64, 64)
            interpret_at(seed, global_handoff, a, torch.zeros(64, 64), c,
                         torch.zeros(4, dtype=torch.int32), ORDER=order)
            assert torch.equal(c, a), order


@tk.kernel(num_warps=4)
def warps_store_one_tile(X: tk.gl, Y: tk.gl, OWN_ROWS: tk.constexpr = False):
    """Each warp stores its own 16 rows of X: into its own rows of Y
    (OWN_ROWS), or all into Y's first 16 rows (a wrong index); and every warp
    stores the block's whole tile (the same values) into rows 64-79 of Y."""
    w = tk.warp_id()
    x = tk.load(X, (w, 0), (16, 64), scope="warp")
    tk.store(Y, x, (w if OWN_ROWS else 0, 0))         # MARK: warp rows
    tk.store(Y, tk.load(X, (0, 0), (16, 64), scope="warp"), (4, 0))  # (every warp: the same)


def test_warps_of_one_block_storing_different_values_into_one_element_race():
    """Plain stores of one block's warps into one element are a race when
    they store different values (the element ends as whichever warp came
    last); the same values (a tile every warp holds) are not reported."""
    x = torch.randn(64, 64)
    e = report(warps_store_one_tile, x, torch.full((80, 64), float("nan")), seeds=range(4))
    assert e.line == line_of("MARK: warp rows"), e.message
    assert "data race in global memory" in e.message and "another value" in e.message
    for seed in range(3):
        y = torch.full((80, 64), float("nan"))
        interpret_at(seed, warps_store_one_tile, x, y, OWN_ROWS=True)
        assert torch.equal(y[:64], x) and torch.equal(y[64:], x[:16])


@tk.func
def signal_after_block_1(F, i):
    """Block i (0 or 1, one warpgroup) signals F[0] once its accesses are done,
    block 0 only after block 1's signal on F[1]: a wait for one count on
    F[0] is ordered after block 1 alone, though block 0 may have come first."""
    tk.barrier()
    if tk.elect_leader("warpgroup"):
        if i == 0:
            tk.wait_signal(F, (1,), 1, scope="gpu")
        tk.signal(F, (0,), scope="gpu")
        if i == 1:
            tk.signal(F, (1,), scope="gpu")


@tk.kernel(num_warps=4)
def read_then_overwrite(X: tk.gl, Y: tk.gl, F: tk.gl["i32"], WAIT_ALL: tk.constexpr = False):
    """Blocks 0 and 1 read X's tile (copying it to their row of Y) and
    signal F[0], block 0 only after block 1's signal on F[1]; block 2
    overwrites X once F[0] counts one read (two with WAIT_ALL). The count of
    one is block 1's signal: block 0's read, which may have come first, is
    not ordered before the write."""
    i = tk.block_id(0)
    if i < 2:
        tk.store(Y, tk.load(X, (0, 0), (16, 64)), (i, 0))
        signal_after_block_1(F, i)
    else:
        tk.wait_signal(F, (0,), 2 if WAIT_ALL else 1, scope="gpu")
        tk.store(X, tk.zeros((16, 64), X.dtype), (0, 0))           # MARK: after two reads


def test_a_write_after_two_reads_must_be_ordered_after_both():
    """Reads of an element by two blocks that nothing orders: a write must
    wait for both (the checks keep each element's unordered readers, not
    only its last), whichever read the interpreter ran last."""
    x = torch.randint(-8, 8, (16, 64)).float()
    for seed in range(4):
        with pytest.raises(InterpretError) as e, warnings.catch_warnings():
            warnings.simplefilter("ignore", tk.TkLintWarning)
            interpret_at(seed, read_then_overwrite, x.clone(), torch.zeros(32, 64),
                         torch.zeros(4, dtype=torch.int32), grid=(3,))
        assert e.value.line == line_of("MARK: after two reads"), e.value.message
        assert "which block (" in e.value.message and "read (at" in e.value.message
    for seed in range(4):
        y = torch.zeros(32, 64)
        interpret_at(seed, read_then_overwrite, x.clone(), y, torch.zeros(4, dtype=torch.int32),
                     grid=(3,), WAIT_ALL=True)
        assert torch.equal(y, torch.cat((x, x)))


@tk.kernel(num_warps=4)
def add_then_read(X: tk.gl, Y: tk.gl, F: tk.gl["i32"], WAIT_ALL: tk.constexpr = False):
    """read_then_overwrite's order with adds: blocks 0 and 1 add into X's
    tile and signal F[0] (block 0 after block 1's F[1]); block 2 reads X
    once F[0] counts one add (two with WAIT_ALL)."""
    i = tk.block_id(0)
    if i < 2:
        tk.atomic_add(X, tk.full((16, 64), 1.0, f32), (0, 0))
        signal_after_block_1(F, i)
    else:
        tk.wait_signal(F, (0,), 2 if WAIT_ALL else 1, scope="gpu")
        tk.store(Y, tk.load(X, (0, 0), (16, 64)), (0, 0))          # MARK: read after two adds


def test_a_read_after_two_adds_must_be_ordered_after_both():
    """As for reads: an element's adders that nothing orders are each kept,
    and a read must be ordered after all of them."""
    for seed in range(4):
        with pytest.raises(InterpretError) as e, warnings.catch_warnings():
            warnings.simplefilter("ignore", tk.TkLintWarning)
            interpret_at(seed, add_then_read, torch.zeros(16, 64), torch.zeros(16, 64),
                         torch.zeros(4, dtype=torch.int32), grid=(3,))
        assert e.value.line == line_of("MARK: read after two adds"), e.value.message
        assert "adds into" in e.value.message, e.value.message
    y = torch.zeros(16, 64)
    interpret_at(0, add_then_read, torch.zeros(16, 64), y, torch.zeros(4, dtype=torch.int32),
                 grid=(3,), WAIT_ALL=True)
    assert torch.equal(y, torch.full((16, 64), 2.0))


@tk.kernel(num_warps=4)
def tma_publish(A: tk.gl, B: tk.gl, C: tk.gl, F: tk.gl["i32"], FULL: tk.constexpr = False):
    """Block 0 writes A's tile into B by a TMA store and signals F; block 1
    waits for F and copies B into C. The store is waited for with read=True
    (its shared source free, its write maybe not done) unless FULL."""
    s = tk.shared_tile(A.dtype, (64, 64))
    if tk.block_id(0) == 0:
        tk.store(s, tk.load(A, (0, 0), (64, 64)))
        if tk.elect_leader("warpgroup"):
            tk.tma.store_async(B, s, (0, 0))                       # MARK: tma write
            tk.tma.store_commit()
            tk.tma.store_wait(0, read=not FULL)
            tk.fence("gpu", async_proxy=True)
            tk.signal(F, (0,), scope="gpu")
    else:
        tk.wait_signal(F, (0,), 1, scope="gpu")
        tk.store(C, tk.load(B, (0, 0), (64, 64)), (0, 0))          # MARK: tma read


def test_a_signal_before_a_tma_store_is_complete_publishes_nothing(monkeypatch):
    """A TMA store's write counts as done at a store_wait with read=False
    only: a signal after a read=True wait does not order it before the
    reader's read. (tk-verify refuses this kernel at compile time when it can
    see it, passes/signal_order.py; without that check — as for orders the
    check cannot follow — the interpreter reports it at the read.)"""
    from tk_mlir.passes import verify
    a = torch.randint(-8, 8, (64, 64)).float()
    args = (a, torch.zeros(64, 64), torch.zeros(64, 64), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(tk.CompilationError, match="tk.signal after TMA writes"):
        tma_publish.interpret[(2,)](*args)
    monkeypatch.setattr(verify, "check_signals", lambda func: None)
    with pytest.raises(InterpretError) as e:
        tma_publish.interpret[(2,)](*args)
    assert e.value.line == line_of("MARK: tma read"), e.value.message
    assert f":{line_of('MARK: tma write')}" in e.value.message
    assert "tk.tma.store_wait(0, read=False)" in e.value.message, e.value.message
    for seed in range(3):
        c = torch.zeros(64, 64)
        interpret_at(seed, tma_publish, a, torch.zeros(64, 64), c,
                     torch.zeros(4, dtype=torch.int32), grid=(2,), FULL=True)
        assert torch.equal(c, a)


@tk.kernel(num_warps=4)
def tma_read_then_reuse(X: tk.gl, C: tk.gl, F: tk.gl["i32"], EARLY: tk.constexpr = True):
    """Block 0 TMA-loads X's tile into shared memory and copies it to C, and
    signals F; block 1 waits for F and overwrites X. EARLY: the signal comes
    between the load's issue and the wait for its phase (the load may still
    be reading X when block 1 writes it)."""
    s = tk.shared_tile(X.dtype, (64, 64), swizzle=128)
    full = tk.semaphore()
    if tk.block_id(0) == 0:
        if tk.elect_leader("warpgroup"):
            tk.tma.expect(full, s)
            tk.tma.load_async(s, X, (0, 0), full)                  # MARK: tma load
            if EARLY:
                tk.signal(F, (0,), scope="gpu")
        tk.wait(full, 0)
        if not EARLY:
            if tk.elect_leader("warpgroup"):
                tk.signal(F, (0,), scope="gpu")
        tk.store(C, tk.load(s, layout="row", scope="warpgroup").to(f32), (0, 0))
    else:
        tk.wait_signal(F, (0,), 1, scope="gpu")
        tk.store(X, tk.zeros((64, 64), X.dtype), (0, 0))          # MARK: overwrite


def test_a_tma_loads_read_is_done_when_its_phase_is():
    """A TMA load reads global memory until its semaphore phase completes: a
    signal before the wait does not order the read before another block's
    write; after the wait it does."""
    x = torch.randn(64, 64).to(torch.bfloat16)

    def run(early, seed=0):
        c = torch.zeros(64, 64)
        interpret_at(seed, tma_read_then_reuse, x.clone(), c, torch.zeros(4, dtype=torch.int32),
                     grid=(2,), EARLY=early)
        return c
    with pytest.raises(InterpretError) as e:
        run(True)
    assert e.value.line == line_of("MARK: overwrite"), e.value.message
    assert f":{line_of('MARK: tma load')}" in e.value.message, e.value.message
    for seed in range(3):
        assert torch.equal(run(False, seed), x.float())


@tk.kernel(num_warps=4)
def signals(A: tk.gl, C: tk.gl):
    """Warp 0 signals sem three times, then done; warp 1 waits for done and
    then for sem's first phase — by then two more phases went by."""
    sem = tk.semaphore()
    done = tk.semaphore()
    w = tk.warp_id()
    if w == 0:
        if tk.elect_leader():
            for i in range(3):
                tk.arrive(sem)
            tk.arrive(done)
    elif w == 1:
        tk.wait(done, 0)
        tk.wait(sem, 0)                              # MARK: stale wait


def test_phase_wrap_around():
    a, c = inputs(64)
    e = report(signals, a, c)
    assert e.line == line_of("MARK: stale wait")
    assert "phase wrap-around" in e.message and "takes phase 2 as done" in e.message


@tk.kernel(num_warps=4)
def leaves_early(A: tk.gl, C: tk.gl, BUG: tk.constexpr = ""):
    """One warpgroup: A's first 64x64 tile in by TMA, C = A·Aᵀ by wgmma. One
    BUG at a time: the kernel ends before waiting for the load, or for the MMA."""
    a = tk.shared_tile(A.dtype, (64, 64), swizzle=128)
    sem = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(sem, a)
        tk.tma.load_async(a, A, (0, 0), sem)               # MARK: early load
    if BUG != "load not waited":
        tk.wait(sem, 0)
        zero = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
        acc = tk.mma_ABt(zero, a, a)                        # MARK: early mma
        if BUG != "mma not waited":
            tk.mma_wait(0)
            tk.store(C, acc, (0, 0))


def test_leaves_early_runs():
    a = torch.randn(64, 64).to(torch.bfloat16)
    c = torch.full((64, 64), float("nan"))
    leaves_early.interpret[(1,)](a, c)
    ref = a.float() @ a.float().T
    assert ((c - ref).norm() / ref.norm()).item() < 1e-5


def test_block_ending_before_its_tma_load_was_waited_for():
    """Found whatever the load's random delay: no warp waited for the phase."""
    a = torch.randn(64, 64).to(torch.bfloat16)
    e = report(leaves_early, a, torch.empty(64, 64), BUG="load not waited", seeds=range(6))
    assert e.line == line_of("MARK: early load")
    assert "ends without waiting for the TMA load issued here" in e.message, e.message
    assert "no tk.tma.expect armed" not in e.message       # (its phase was armed)


def test_warp_exiting_with_its_mma_in_flight():
    a = torch.randn(64, 64).to(torch.bfloat16)
    e = report(leaves_early, a, torch.empty(64, 64), BUG="mma not waited")
    assert e.line == line_of("MARK: early mma")
    assert "exits with the MMA issued here not waited for" in e.message, e.message


@tk.kernel(num_warps=8)
def column_halves(A: tk.gl, C: tk.gl, BUG: tk.constexpr = ""):
    """Warpgroup w writes column block w of one swizzled 64x128 tile, syncs
    itself only, reads its block back and stores it to C's columns 64w..:
    the two warpgroups never touch one place (unless BUG: both use block 0)."""
    st = tk.shared_tile(A.dtype, (64, 128), swizzle=128)
    wg = tk.warpgroup_id()
    block = st.column_block(0 if BUG == "same block" else wg)
    tk.store(block, tk.load(A, (0, wg), (64, 64), layout="row", scope="warpgroup"))  # MARK: half
    tk.named_barrier(1 + wg, warps=4)
    tk.store(C, tk.load(block, layout="row", scope="warpgroup").to(f32), (0, wg))


def test_column_blocks_of_one_row_are_different_places():
    a = torch.randn(64, 128).to(torch.bfloat16)
    runs_under_seeds(column_halves, a, torch.full((64, 128), float("nan")))


def test_one_column_block_written_by_two_warpgroups_races():
    a = torch.randn(64, 128).to(torch.bfloat16)
    e = report(column_halves, a, torch.empty(64, 128), BUG="same block", same_line=False)
    assert "data race" in e.message, e.message
    assert e.line in (line_of("MARK: half"), line_of("MARK: half") + 2), e.message


@tk.kernel(num_warps=4)
def offset_product(X: tk.gl[f32], Y: tk.gl[f32], n: int, OP: tk.constexpr = "mul"):
    """(n·n, n + n or -n - n) // 2**20 added to a tile of X: an int that may leave 32 bits."""
    if OP == "mul":
        big = n * n                                   # MARK: int mul
    elif OP == "add":
        big = n + n                                   # MARK: int add
    elif OP == "sub":
        big = -n - n                                  # MARK: int sub
    else:                       # both arms evaluated (a select): the wrapped one not taken
        big = (n * n) // 1048576 * 1048576 if n < 46341 else -1048576
    tk.store(Y, tk.load(X, (0, 0), (16, 32)) + (big // 1048576), (0, 0))


@pytest.mark.parametrize("op, n, says", [
    ("mul", 100000, "100000 * 100000 = 10000000000"),
    ("add", 2**30 + 5, "1073741829 + 1073741829 = 2147483658"),
    ("sub", 2**30 + 5, "-1073741829 - 1073741829 = -2147483658")])
def test_an_int_leaving_32_bits_is_warned_of_where_the_gpu_wraps_it(op, n, says):
    """The interpreter computes as the GPU (wrapping) and warns once, at the
    op's line: an error would refuse kernels whose wrapped value is never
    taken (the arm of a select)."""
    x, y = torch.randn(16, 32), torch.full((16, 32), float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offset_product.interpret[(1,)](x, y, n, OP=op)
    found = [w for w in caught if "[overflow]" in str(w.message)]
    assert len(found) == 1 and found[0].lineno == line_of(f"# MARK: int {op}"), \
        [str(w.message) for w in caught]
    assert f"int overflow: {says} does not fit in 32 bits" in str(found[0].message)
    wrapped = {"mul": 1410065408, "add": -2147483638, "sub": 2147483638}[op]
    assert torch.equal(y, x + (wrapped // 2**20))                  # (the GPU's wrapped value)


def test_ints_within_32_bits_compute_as_python_ints_and_warn_of_nothing():
    x, y = torch.randn(16, 32), torch.full((16, 32), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tk.TkLintWarning)
        offset_product.interpret[(1,)](x, y, 46340, OP="mul")         # 46340² < 2**31
        assert torch.equal(y, x + (46340 * 46340 // 2**20))
        offset_product.interpret[(1,)](x, y, -2**30, OP="add")        # exactly -2**31
        assert torch.equal(y, x + (-2**31 // 2**20))
        offset_product.interpret[(1,)](x, y, 7, OP="select")
        assert torch.equal(y, x)                                       # (7² // 2**20 = 0)
    with warnings.catch_warnings():         # the arm not taken wraps: a warning, not an error
        warnings.simplefilter("ignore", tk.TkLintWarning)
        offset_product.interpret[(1,)](x, y, 100000, OP="select")
    assert torch.equal(y, x - 1)


@tk.kernel(num_warps=4)
def large_mod(X: tk.gl[f32], Y: tk.gl[f32], a: int, b: int):
    tk.store(Y, tk.load(X, (0, 0), (16, 32)) + (a % b), (0, 0))            # MARK: int mod


@tk.kernel(num_warps=1)
def lane_quotient(F: tk.gl["i32"], b: int):
    tk.signal(F, (tk.lane_id() // b,), scope="gpu")                   # MARK: lane quotient


def test_a_division_of_each_lanes_value_by_one_zero_is_warned_of():
    flags = torch.zeros(32, dtype=torch.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lane_quotient.interpret[(1,)](flags, 0)
    found = [w for w in caught if "[zero-division]" in str(w.message)]
    assert len(found) == 1 and found[0].lineno == line_of("# MARK: lane quotient") and \
        "0 // 0" in str(found[0].message), [str(w.message) for w in caught]


@pytest.mark.parametrize("a, b, warned", [(7, 0, True), (7, 3, False)])
def test_an_int_division_by_zero_is_warned_of(a, b, warned):
    """The GPU's quotient of a division by zero is undefined (the
    interpreter's is 0): a warning at the op, as for overflow."""
    x, y = torch.randn(16, 32), torch.full((16, 32), float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        large_mod.interpret[(1,)](x, y, a, b)
    found = [w for w in caught if "[zero-division]" in str(w.message)]
    assert len(found) == warned, [str(w.message) for w in caught]
    if warned:
        assert found[0].lineno == line_of("# MARK: int mod") and \
            "int division by zero: 7 % 0; the GPU's result is undefined" in str(found[0].message)


def test_python_mod_of_large_ints_computes_no_sum_it_does_not_take():
    """a % b adds b only where Python's sign rule needs it: a large b makes
    no wrapped sum (and no [overflow] warning)."""
    x, y = torch.randn(16, 32), torch.full((16, 32), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tk.TkLintWarning)
        for a, b in ((1_500_000_000, 2_000_000_000), (-7, 3), (7, -3)):
            large_mod.interpret[(1,)](x, y, a, b)
            assert torch.equal(y, x + float(a % b)), (a, b)


@tk.kernel(num_warps=1)
def ceilings(Y: tk.gl[f32], a: int, b: int):
    """Y's rows 0-15 = cdiv(a, b) (run-time b), rows 16-31 = cdiv(a, 64) (a
    constant power of two); exact in f32 for the cases below."""
    tk.store(Y, tk.zeros((16, 8), f32) + tk.cdiv(a, b), (0, 0))
    tk.store(Y, tk.zeros((16, 8), f32) + tk.cdiv(a, 64), (1, 0))


@pytest.mark.parametrize("a, b", [(7, 2), (-7, 2), (7, -2), (-7, -2), (0, -3),
                                  (2**31 - 128, 64), (2**31 - 128, 2**30 + 1)])
def test_cdiv_in_a_kernel_is_the_hosts_ceiling(a, b):
    """Every sign of a and of a run-time b (-(-a // b): no a + b - 1 to wrap
    near 2**31), and a positive constant b: the host's tk.cdiv, with no
    [overflow] warning."""
    y = torch.full((32, 8), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tk.TkLintWarning)
        ceilings.interpret[(1,)](y, a, b)
    assert y[::16, 0].tolist() == [tk.cdiv(a, b), tk.cdiv(a, 64)], (a, b)


@tk.kernel(num_warps=4)
def wait_for_the_next_block(X: tk.gl, Y: tk.gl, F: tk.gl["i32"]):
    """Block i copies its rows once block i + 1 has (the last block starts):
    every block must be running at once. 64 KB of shared memory: three
    blocks per SM."""
    pad = tk.shared_tile(f32, (64, 256))
    i, n = tk.block_id(0), tk.grid_dim(0)
    if i < n - 1:
        if tk.elect_leader():
            tk.wait_signal(F, (i + 1,), 1, scope="gpu")      # MARK: next block
    tk.barrier()
    tk.store(pad, tk.load(X, (i, 0), (64, 256)))
    tk.barrier()
    tk.store(Y, tk.load(pad), (i, 0))
    tk.barrier()
    if tk.elect_leader():
        tk.signal(F, (i,), scope="gpu")


def test_blocks_that_wait_for_blocks_the_gpu_cannot_start_yet_deadlock(monkeypatch):
    """The interpreter starts another block while every running one waits,
    but no more than a GPU runs at once (its per-SM limits times its SMs,
    program.MOST_SMS: two here): past that the chain deadlocks, as on a GPU;
    within it, it runs."""
    from tk_mlir.interpreter import program
    monkeypatch.setattr(program, "MOST_SMS", 2)
    for grid, fits in ((6, True), (7, False)):
        x = torch.randn(64 * grid, 256)
        y, flags = torch.full_like(x, float("nan")), torch.zeros(8, dtype=torch.int32)
        if fits:
            wait_for_the_next_block.interpret[(grid,)](x, y, flags)
            assert torch.equal(y, x)
            continue
        with pytest.raises(InterpretError, match="deadlock") as e:
            wait_for_the_next_block.interpret[(grid,)](x, y, flags)
        assert e.value.line == line_of("MARK: next block")
        assert "as many as a GPU runs at once (3 block(s) with 65536 bytes of shared memory " \
               "per SM, 2 SMs)" in e.value.message, e.value.message


@tk.kernel(num_warps=8)
def fresh_parity(A: tk.gl, C: tk.gl, PARITY: tk.constexpr = 1):
    """Warpgroup 1 fills a shared tile and arrives on `full`; warpgroup 0
    waits for `full`'s parity PARITY, then reads the tile: the first phase
    has parity 0, and a wait for parity 1 passes at once on a fresh
    semaphore (which counts as having completed a phase of parity 1)."""
    st = tk.shared_tile(A.dtype, (64, 64))
    full = tk.semaphore(arrivals=4)
    if tk.warpgroup_id() == 1:
        tk.store(st, tk.load(A, (0, 0), (64, 64), layout="row", scope="warpgroup"))
        if tk.elect_leader():
            tk.arrive(full)
    else:
        tk.wait(full, PARITY)                                          # MARK: fresh wait
        tk.store(C, tk.load(st, layout="row", scope="warpgroup").to(f32), (0, 0))


def test_a_race_after_a_wait_that_passed_on_a_fresh_semaphore_says_so():
    """tk.wait(s, 1) before any phase of s completed passes at once (a
    ring's first empty-slot waits mean it; here it is the wrong parity): not
    an error at the wait, but the race it lets through names it."""
    a = torch.randn(128, 64).to(torch.bfloat16)
    e = report(fresh_parity, a, torch.zeros(64, 64), seeds=range(3), same_line=False)
    assert "data race" in e.message, e.message
    assert f"(note: the tk.wait(s, 1) at {HERE}:{line_of('MARK: fresh wait')} on semaphore" \
           in e.message and "passed at once" in e.message and "tk.wait_phase" in e.message, \
        e.message
    c = torch.zeros(64, 64)
    fresh_parity.interpret[(1,)](a, c, PARITY=0)
    assert torch.equal(c, a[:64].float())


def test_a_ring_whose_first_waits_pass_at_once_gets_no_such_note():
    """The ring's producer waits for its empty slots' parity 1 first (passing
    at once, as meant); a race after its later waits does not name them."""
    e = report(mma_ring, *inputs(), EARLY=True, same_line=False)
    assert "data race" in e.message and "passed at once" not in e.message, e.message


@tk.kernel(num_warps=8)
def passed_then_waited(A: tk.gl, C: tk.gl):
    """Warpgroup 0's tk.wait(empty, 1) passes at once (as a ring's first
    wait means it to); its last wait, tk.wait_phase(full, 0), is right; the
    race is warpgroup 1 storing the tile again after its arrival."""
    st = tk.shared_tile(A.dtype, (64, 64))
    empty, full = tk.semaphore(arrivals=4), tk.semaphore(arrivals=4)
    if tk.warpgroup_id() == 0:
        tk.wait(empty, 1)
        tk.wait_phase(full, 0)
        tk.store(C, tk.load(st, layout="row", scope="warpgroup").to(f32), (0, 0))
    else:
        tk.store(st, tk.load(A, (0, 0), (64, 64), layout="row", scope="warpgroup"))
        if tk.elect_leader():
            tk.arrive(full)
        tk.store(st, tk.load(A, (1, 0), (64, 64), layout="row", scope="warpgroup"))


def test_the_note_names_only_a_warps_last_semaphore_wait():
    """A wait that passed at once is not named once a later wait of the warp
    (here a tk.wait_phase) took a completed phase."""
    a = torch.randn(128, 64).to(torch.bfloat16)
    e = report(passed_then_waited, a, torch.full((64, 64), float("nan")), same_line=False)
    assert "data race" in e.message and "passed at once" not in e.message, e.message


@tk.kernel(num_warps=4)
def unflipped_parity(A: tk.gl, C: tk.gl):
    """Each round loads a tile by TMA and waits for the semaphore's parity 0:
    the second round's wait passes at once on the first round's phase."""
    s = tk.shared_tile(A.dtype, (64, 64))
    full = tk.semaphore()
    acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
    for i in range(2):
        if tk.elect_leader("warpgroup"):
            tk.tma.expect(full, s)
            tk.tma.load_async(s, A, (i, 0), full)
        tk.wait(full, 0)                                               # MARK: unflipped
        acc = acc + tk.load(s, layout="row", scope="warpgroup").to(f32)
        tk.barrier()
    tk.store(C, acc, (0, 0))


def test_a_race_after_a_wait_whose_parity_did_not_flip_says_so():
    """Where the second round's load is still in flight at its wait (seeds
    2 on), the wait passes on the first round's phase and the read races: the
    report names the wait; where it landed first, the wait is a deadlock."""
    a = torch.randn(128, 64).to(torch.bfloat16)
    for seed in range(2, 5):
        e = report(unflipped_parity, a, torch.full((64, 64), float("nan")), seeds=[seed])
        assert f"the tk.wait(s, 0) at {HERE}:{line_of('MARK: unflipped')} on semaphore" in \
            e.message and "taking phase 0 as done, which this warp had waited for already" \
            in e.message, e.message


@tk.kernel(num_warps=4)
def every_warp_stores(X: tk.gl[f32], Y: tk.gl[f32], SAME: tk.constexpr = True):
    """Every warp stores a warp-scope tile into one shared tile: the same
    rows of X (SAME), or each its own."""
    st = tk.shared_tile(f32, (16, 16))
    t = tk.load(X, (0 if SAME else tk.warp_id(), 0), (16, 16), layout="row", scope="warp")
    tk.store(st, t)                                                    # MARK: every warp
    tk.barrier()
    tk.store(Y, tk.load(st, layout="col", scope="warp"), (tk.warp_id(), 0))


def test_warps_storing_the_same_values_into_a_shared_tile_do_not_race():
    """As into global memory: unordered stores of the values already there
    are no race; different values are."""
    x, y = torch.randn(64, 16), torch.full((64, 16), float("nan"))
    every_warp_stores.interpret[(1,)](x, y)
    assert torch.equal(y, x[:16].repeat(4, 1))
    e = report(every_warp_stores, x, y, SAME=False)
    assert "data race: this store writes" in e.message and e.line == line_of("MARK: every warp")


@tk.kernel(num_warps=4)
def same_then_other(X: tk.gl[f32], Y: tk.gl[f32]):
    """Warps 0 and 1 store one warp-scope tile (the same values); warp 2,
    ordered after warp 1 only, stores others: warp 0's store may land last."""
    st = tk.shared_tile(f32, (16, 16))
    if tk.warp_id() < 2:
        t = tk.load(X, (0, 0), (16, 16), layout="row", scope="warp")
        tk.store(st, t)
    if tk.warp_id() == 1:
        tk.named_barrier_arrive(1, warps=2)
    if tk.warp_id() == 2:
        tk.named_barrier(1, warps=2)
        u = tk.load(X, (1, 0), (16, 16), layout="row", scope="warp")
        tk.store(st, u)                                                # MARK: other values
    tk.barrier()
    tk.store(Y, tk.load(st, layout="col", scope="warp"), (tk.warp_id(), 0))


def test_a_store_of_the_same_values_leaves_the_earlier_writer_to_be_ordered_after():
    """The same-valued store is no race, but the first warp stays a writer: a
    later store ordered after the second warp only races with it, under
    every interleaving."""
    x = torch.randn(64, 16)
    for seed in range(12):      # (at warp 2's store, or at warp 0's where it comes later)
        e = report(same_then_other, x, torch.full((64, 16), float("nan")), seeds=[seed])
        assert "data race: this store writes" in e.message, e.message


@tk.kernel(num_warps=8)
def two_writers(A: tk.gl, C: tk.gl):
    """Both warpgroups store into one shared tile with nothing between them."""
    st = tk.shared_tile(A.dtype, (64, 64))
    if tk.warpgroup_id() == 0:
        tk.store(st, tk.load(A, (0, 0), (64, 64), layout="row", scope="warpgroup"))  # MARK: ww0
    else:
        tk.store(st, tk.load(A, (1, 0), (64, 64), layout="row", scope="warpgroup"))  # MARK: ww1
    tk.barrier()
    if tk.warpgroup_id() == 0:
        tk.store(C, tk.load(st, layout="row", scope="warpgroup").to(f32), (0, 0))


def test_a_write_write_race_names_the_other_warp_and_its_line():
    """As a read-write race names the reader ("which warp 4 read at ..."), a
    write-write race names the other writer: "also written at ... by warp n"."""
    a = torch.randn(128, 64).to(torch.bfloat16)
    lines = line_of("MARK: ww0"), line_of("MARK: ww1")
    for seed in range(4):
        e = report(two_writers, a, torch.zeros(64, 64), seeds=[seed])
        assert e.line in lines, e.message
        other = 1 - lines.index(e.line)              # the other warpgroup wrote first
        m = re.search(rf"also written at {re.escape(str(HERE))}:{lines[other]} by warp (\d+),",
                      e.message)
        assert m and int(m.group(1)) // 4 == other, e.message


@tk.kernel(num_warps=4)
def vector_through_shared(X: tk.gl[f32], Y: tk.gl[f32], BUG: tk.constexpr = False):
    """Y = X minus its row maxima, the maxima through a shared vector: each
    warp of the block tile's row_max holds (and stores) its own rows' elements,
    no race. BUG: each warp stores the column sums of its own 16 rows of X
    (a warp-scope vector) into the whole shared vector, one write over
    another's."""
    mx = tk.shared_vector(f32, 64)
    x = tk.load(X, (0, 0), (64, 128))
    if BUG:
        tk.store(mx, tk.load(X, (tk.warp_id(), 0), (16, 64), scope="warp").col_sum())  # MARK: vs
    else:
        tk.store(mx, x.row_max())
    tk.barrier()
    tk.store(Y, x.sub_row(tk.load(mx)), (0, 0))


def test_a_row_reduction_stored_to_a_shared_vector_is_no_race():
    """The block tile's row maxima live in different warps (the vector's warp
    bits step along it): their stores touch different elements, whatever the
    interleaving; different values stored over the same elements still race."""
    x = torch.randn(64, 128)
    for seed in range(3):
        y = torch.full_like(x, float("nan"))
        interpret_at(seed, vector_through_shared, x, y)
        want = x.double() - x.double().amax(1, keepdim=True)
        assert ((y.double() - want).norm() / want.norm()).item() < 1e-6
    e = report(vector_through_shared, x, torch.empty_like(x), BUG=True, same_line=False)
    assert "data race" in str(e) and e.line == line_of("MARK: vs")
