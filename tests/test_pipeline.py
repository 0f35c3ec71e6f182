"""tk.ring, the pipeline-state helper (tk_mlir/rings.py): slots, phases and
semaphores of a producer/consumer ring, its tk.func methods bound to the
ring, its errors at the user's line; and tk.registers_per_thread."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import markers
import tk_mlir as tk
from error_checks import compile_error
from tk_mlir import f32

HERE = Path(__file__)
A = tk.spec((256, 64), tk.bf16)
C = tk.spec((256, 64), tk.f32)


@tk.kernel(num_warps=8)
def ring_copy(A: tk.gl, C: tk.gl, STAGES: tk.constexpr = 2):
    """Warpgroup 1 loads A's 64-row tiles through a ring; warpgroup 0 computes
    A·Aᵀ's diagonal block from each and stores it: every use count's slot
    and phase comes from the ring."""
    tiles = tk.cdiv(A.shape[0], 64)
    ring = tk.ring(A.dtype, (64, 64), STAGES)
    if tk.warpgroup_id() == 1:
        if tk.elect_leader("warpgroup"):
            for i in range(tiles):
                tile, full = ring.fill(i)
                tk.tma.load_async(tile, A, (i, 0), full)
    else:
        for i in range(tiles):
            a = ring.wait(i)
            acc = tk.mma_ABt(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), a, a)
            tk.mma_wait(0)
            ring.release(i)
            tk.store(C, acc, (i, 0))


def test_ring_compiles_to_slots_and_parities():
    c = ring_copy.compile(A, C)
    ptx = c.asm["ptx"]
    assert "mbarrier.try_wait.parity" in ptx and "cp.async.bulk.tensor" in ptx
    tk_ir = c.asm["tk"]
    # The slot is the use count mod STAGES; the parity (count // STAGES) & 1,
    # and the producer waits on the empty semaphore for the other parity (a
    # fresh one passes it: the first STAGES fills find their slot free). Two
    # stages: a mask and a shift; three: Python's modulo and floor division.
    assert tk_ir.count("tk.wait") == 2 and "arith.remsi" not in tk_ir
    assert "arith.shrsi" in tk_ir and "arith.floordivsi" not in tk_ir
    producer = tk_ir[:tk_ir.index("} else {")]
    assert re.search(r"arith\.xori %\S+, %c1_i32", producer), producer
    three = ring_copy.compile(A, C, STAGES=3).asm["tk"]
    assert "arith.remsi" in three and "arith.floordivsi" in three


def test_ring_methods_are_inlined_as_tk_funcs():
    from tk_mlir.language import BoundFunc, Func
    from tk_mlir.rings import Ring
    assert isinstance(Ring.wait, Func)
    bound = Ring(None, None, None, 2, 1).wait
    assert isinstance(bound, BoundFunc)
    with pytest.raises(RuntimeError, match="can only be called inside a @tk.kernel"):
        bound(0)


@tk.kernel(num_warps=8)
def bad_stages(A: tk.gl):
    ring = tk.ring(A.dtype, (64, 64), 0)  # E:stages


@tk.kernel(num_warps=8)
def bad_count(A: tk.gl):
    ring = tk.ring(A.dtype, (64, 64), 2, count=9)  # E:count


@tk.kernel(num_warps=8)
def bad_part(A: tk.gl):
    ring = tk.ring(A.dtype, (64, 64), 2, count=2)
    tile = ring.wait(0, part=2)  # E:part


@tk.kernel(num_warps=8)
def bad_swizzle(A: tk.gl):
    ring = tk.ring(A.dtype, (64, 64), 2, swizzle=48)  # E:swizzle


@pytest.mark.parametrize("kernel, marker, message", [
    (bad_stages, "stages", "stages must be a compile-time int from 1 to 16, got 0"),
    (bad_count, "count", "count must be a compile-time int from 1 to 8, got 9"),
    (bad_swizzle, "swizzle", "swizzle must be 0, 32, 64 or 128 (bytes), got 48"),
    (bad_part, "part", "ring.wait: part=2 is not one of the slot's 2 tiles (0 to 1)"),
])
def test_ring_errors_point_at_their_line(kernel, marker, message):
    e = compile_error(kernel, A)
    line, _ = markers.marked(HERE, marker)
    assert f"{HERE}:{line}:" in str(e) and message in str(e)


@tk.kernel(num_warps=12)
def split(A: tk.gl, CONSUMER: tk.constexpr = 240, PRODUCER: tk.constexpr = 24):
    tk.register_split(2, CONSUMER, PRODUCER)  # E:split
    if tk.warpgroup_id() == 2:
        tk.decrease_registers(PRODUCER)
    else:
        tk.increase_registers(CONSUMER)


def test_registers_per_thread_is_what_ptxas_gives_the_block():
    c = split.compile(A)
    assert c.info["registers"] == 168          # 65536 / 384 threads, in multiples of 8
    e = compile_error(split, A, PRODUCER=32)   # 2 x 240 + 32 > 3 x 168: setmaxnreg would hang
    line, _ = markers.marked(HERE, "split")
    assert f"{HERE}:{line}:" in str(e) and \
        "2 x 240 + 32 registers per thread exceed the block's 504" in str(e)


@tk.kernel(num_warps=4)
def none_test(X: tk.gl, Y: tk.gl):
    x = tk.load(X, (0, 0), (16, 64))
    if x is not None:                   # decided at compile time: a tile is never None
        tk.store(Y, x, (0, 0))


def test_is_none_on_a_run_time_value_is_decided_at_compile_time():
    tk_ir = none_test.compile(C, C).asm["tk"]
    assert "scf.if" not in tk_ir and "tk.store" in tk_ir
