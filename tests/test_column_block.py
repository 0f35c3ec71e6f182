"""Shared tile column blocks (Shared.column_block): a swizzled tile is stored
as column blocks of `swizzle` bytes per row, each rows x block_cols and apart
from the others, so each block is a tile of its own (e.g. the B operand of a
wgmma over part of the columns)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import error_checks
import tk_mlir as tk
from error_checks import compile_error
from tk_mlir import f32

HERE = Path(__file__)
A = tk.spec((128, 128), tk.bf16)
C = tk.spec((64, 128), tk.f32)


@tk.func
def rows_and_all(A):
    """A[0:64] and all of A (128x128) in swizzled shared tiles, loaded by TMA."""
    a = tk.shared_tile(A.dtype, (64, 128), swizzle=128)
    b = tk.shared_tile(A.dtype, (128, 128), swizzle=128)
    sem = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(sem, a, b)
        tk.tma.load_async(a, A, (0, 0), sem)
        tk.tma.load_async(b, A, (0, 0), sem)
    tk.wait(sem, 0)
    return a, b


@tk.kernel(num_warps=4)
def halves(A: tk.gl, C: tk.gl):
    """C[:, 64j:64j+64] = A[0:64] · A[:, 64j:64j+64] for j = 0, 1: the B
    operand of each product is column block j of a 128x128 shared tile."""
    a, b = rows_and_all(A)
    for j in tk.static_range(2):
        acc = tk.mma_AB(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), a,
                        b.column_block(j))
        tk.mma_wait(0)
        tk.store(C, acc, (0, j))


def test_column_blocks_are_offsets_of_rows_x_swizzle_bytes():
    c = halves.compile(A, C)
    tk_ir = c.asm["tk"]
    assert tk_ir.count('"tk.column_block"') == 2
    assert re.search(r'"tk.column_block"\(%\S+, %\S+\) : \(!tk.st<bf16, 128 : i64, '
                     r'128 : i64, 128 : i64>, i32\) -> !tk.st<bf16, 128 : i64, 64 : i64', tk_ir), tk_ir
    # Block 1 of a 128-row tile with 128-byte rows per block: 16384 bytes on.
    assert "16384" in c.asm["ptx"]
    assert c.asm["sass"].count("HGMMA") == 16       # 2 products of K/16 = 8 steps


@tk.kernel(num_warps=4)
def unswizzled(A: tk.gl):
    a = tk.shared_tile(A.dtype, (64, 128))
    b = a.column_block(0)  # E:unswizzled


@tk.kernel(num_warps=4)
def past_the_end(A: tk.gl):
    a = tk.shared_tile(A.dtype, (64, 128), swizzle=128)
    b = a.column_block(2)  # E:past-end


@tk.kernel(num_warps=4)
def float_index(A: tk.gl):
    a = tk.shared_tile(A.dtype, (64, 128), swizzle=128)
    b = a.column_block(0.5 * tk.block_id(0))  # E:float-index


@pytest.mark.parametrize("kernel, marker, at, message", [
    (unswizzled, "unswizzled", "a.column_block", "is not swizzled: its rows are contiguous"),
    (past_the_end, "past-end", "a.column_block", "has 2 column block(s) of 64 columns, no block 2"),
    (float_index, "float-index", "a.column_block", "column_block index must be an int"),
])
def test_column_block_errors_point_at_their_line(kernel, marker, at, message):
    error_checks.check_error(compile_error(kernel, A), marker, at, message, HERE)


@tk.kernel(num_warps=4)
def one_half(A: tk.gl, C: tk.gl):
    """Block j of the grid computes C[:, 64j:64j+64] of `halves`, its column
    block chosen at run time (tk.block_id: no branch)."""
    j = tk.block_id(0)
    a, b = rows_and_all(A)
    acc = tk.mma_AB(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), a,
                    b.column_block(j))
    tk.mma_wait(0)
    tk.store(C, acc, (0, j))


@tk.kernel(num_warps=4)
def chained(A: tk.gl, C: tk.gl):
    """C[:, :64] = A[0:64] · (A[:, :64] + A[:, 64:]): two MMAs into one
    accumulator, the second issued while the first is in flight."""
    a, b = rows_and_all(A)
    acc = tk.mma_AB(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), a,
                    b.column_block(0))
    acc = tk.mma_AB(acc, a, b.column_block(1))
    tk.mma_wait(0)
    tk.store(C, acc, (0, 0))


def test_chained_mmas_are_not_serialized():
    # The first MMA's registers pass to the second: no copy of them mid-MMA,
    # which would make ptxas serialize every wgmma (C7514).
    c = chained.compile(A, C)
    assert "C7514" not in c.ptxas_log and "C7517" not in c.ptxas_log, c.ptxas_log


def test_a_run_time_column_block_is_an_address_offset():
    ptx = one_half.compile(A, C).asm["ptx"]
    assert re.search(r"shl\.b32\s+%r\d+, %r\d+, 14;", ptx), ptx     # j * 16384 bytes


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, grid", [(halves, 1), (one_half, 2), (chained, 1)])
def test_column_block_products_on_the_gpu(kernel, grid):
    torch = pytest.importorskip("torch")
    a = torch.randn(128, 128, device="cuda").bfloat16()
    c = torch.full((64, 128), float("nan"), device="cuda")
    kernel[(grid,)](a, c)
    ref = a[:64].double() @ a.double()
    if kernel is chained:
        c, ref = c[:, :64], ref[:, :64] + ref[:, 64:]
    assert ((c.double() - ref).norm() / ref.norm()).item() < 1e-5


@tk.kernel(num_warps=4)
def lane_varying_block(A: tk.gl, C: tk.gl):
    a = tk.shared_tile(A.dtype, (64, 128), swizzle=128)
    b = tk.shared_tile(A.dtype, (128, 128), swizzle=128)
    half = b.column_block(tk.lane_id() % 2)  # E:lane-varying
    acc = tk.mma_AB(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), a, half)
    tk.mma_wait(0)
    tk.store(C, acc, (0, 0))


def test_a_wgmma_operand_picked_per_thread_is_refused_at_its_line():
    error_checks.check_error(compile_error(lane_varying_block, A, C), "lane-varying",
                            "b.column_block", "differs between the threads of a warpgroup",
                            HERE)
