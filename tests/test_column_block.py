"""Shared tile column blocks (Shared.column_block): a swizzled tile is stored
as column blocks of `swizzle` bytes per row, each rows x block_cols and apart
from the others, so each block is a tile of its own (e.g. the B operand of a
wgmma over part of the columns)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import test_errors
import tk_mlir as tk
from test_errors import compile_error
from tk_mlir import f32

HERE = Path(__file__)
A = tk.spec((128, 128), tk.bf16)
C = tk.spec((64, 128), tk.f32)


@tk.kernel(num_warps=4)
def halves(A: tk.gl, C: tk.gl):
    """C[:, 64j:64j+64] = A[0:64] · A[:, 64j:64j+64] for j = 0, 1: the B
    operand of each product is column block j of a 128x128 shared tile."""
    a = tk.shared_tile(A.dtype, (64, 128), swizzle=128)
    b = tk.shared_tile(A.dtype, (128, 128), swizzle=128)
    sem = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(sem, a, b)
        tk.tma.load_async(a, A, (0, 0), sem)
        tk.tma.load_async(b, A, (0, 0), sem)
    tk.wait(sem, 0)
    for j in tk.static_range(2):
        acc = tk.mma_AB(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), a,
                        b.column_block(j))
        tk.mma_wait(0)
        tk.store(C, acc, (0, j))


def test_column_blocks_are_offsets_of_rows_x_swizzle_bytes():
    c = halves.compile(A, C)
    tk_ir = c.asm["tk"]
    assert tk_ir.count('"tk.column_block"') == 2
    assert re.search(r'"tk.column_block"\(%\S+\) \{index = 1 : i64\} : \(!tk.st<bf16, 128 : i64, '
                     r'128 : i64, 128 : i64>\) -> !tk.st<bf16, 128 : i64, 64 : i64', tk_ir), tk_ir
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
def runtime_index(A: tk.gl):
    a = tk.shared_tile(A.dtype, (64, 128), swizzle=128)
    b = a.column_block(tk.block_id(0))  # E:runtime-index


@pytest.mark.parametrize("kernel, marker, at, message", [
    (unswizzled, "unswizzled", "a.column_block", "is not swizzled: its rows are contiguous"),
    (past_the_end, "past-end", "a.column_block", "has 2 column block(s) of 64 columns, no block 2"),
    (runtime_index, "runtime-index", "a.column_block",
     "column_block index must be a compile-time int"),
])
def test_column_block_errors_point_at_their_line(kernel, marker, at, message):
    test_errors.check_error(compile_error(kernel, A), marker, at, message, HERE)


@pytest.mark.gpu
def test_column_block_products_on_the_gpu():
    torch = pytest.importorskip("torch")
    a = torch.randn(128, 128, device="cuda").bfloat16()
    c = torch.full((64, 128), float("nan"), device="cuda")
    halves[(1,)](a, c)
    ref = a[:64].double() @ a.double()
    assert ((c.double() - ref).norm() / ref.norm()).item() < 1e-5
