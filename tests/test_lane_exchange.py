"""Lane exchanges (lowering/lane_exchange.py): register tiles traded between
lanes by shuffles so that global stores move 16 bytes a thread.

The exchanges' data movement is `exchange`, run here on per-lane lists with a
warp's semantics (the lowering runs the same function on MLIR values), and
checked against where the exchanged layout says each element lives."""
from __future__ import annotations

import itertools
import re

import pytest

import tk_mlir as tk
from tk_mlir.dialects import layout as layouts
from tk_mlir.lowering.lane_exchange import exchange, word_strides
from test_attention import compile_backward

torch = pytest.importorskip("torch")

SIDES = (16, 48, 64, 80, 128, 176, 256)


def _layouts_and_sizes():
    """Every layout of these sides and an element size whose runs fill 32-bit
    words (a shorter run is never exchanged)."""
    for name, rows, cols, warps in itertools.product(("row", "col", "vec"), SIDES, SIDES, (1, 4)):
        try:
            layout = layouts.tile_layout(name, rows, cols, warps)
        except layouts.LayoutError:
            continue
        for size in (2, 4):
            if layout.vector_run(1) * size >= 4:
                yield pytest.param(layout, size, id=f"{name}-{rows}x{cols}-w{warps}-{size}B")


def _exchanged_in_a_warp(layout, size: int):
    """Each lane's registers (element positions) after the exchanges
    `widening` chooses for elements of `size` bytes, made by `exchange` on
    per-lane lists; and the layout they should be in."""
    per_word = 4 // size
    held = [[layout.position(r, lane) for r in range(layout.num_regs)] for lane in range(32)]
    # A word is one list over the 32 lanes of per_word registers' elements.
    words = [[tuple(held[lane][r:r + per_word]) for lane in range(32)]
             for r in range(0, layout.num_regs, per_word)]
    steps, order = layout.widening(len(layout.shape) - 1, 16 // size)

    def select(bit, a, b):
        return [x if c else y for c, x, y in zip(bit, a, b)]

    def shuffle(v, mask):
        return [v[lane ^ mask] for lane in range(32)]

    bits = [[lane >> k & 1 for lane in range(32)] for _, k in steps]
    words = exchange(words, word_strides(layout, steps, per_word), [k for _, k in steps], bits,
                     select, shuffle)
    for step in steps:
        layout = layout.exchanged(*step)
    regs = [[e for w in words for e in w[lane]] for lane in range(32)]
    final, picked = layout.reordered(order)
    return [[regs[lane][p] for p in picked] for lane in range(32)], final, steps


@pytest.mark.parametrize("layout, size", list(_layouts_and_sizes()))
def test_exchanged_registers_hold_what_the_new_layout_says(layout, size):
    axis = len(layout.shape) - 1
    regs, final, steps = _exchanged_in_a_warp(layout, size)
    for lane in range(32):
        assert regs[lane] == [final.position(r, lane) for r in range(final.num_regs)]
    run = final.vector_run(axis)
    assert run >= layout.vector_run(axis) and (run * size <= 16 or not steps)
    # The lanes along the axis and the run still cover one contiguous span.
    along = sorted(b[1] for b in final.lane if b is not None and b[0] == axis)
    assert along == list(range(run.bit_length() - 1, run.bit_length() - 1 + len(along)))
    cols = layout.shape[axis]
    if layout.lane == ROW_LANES and (cols & -cols) * size >= 64:
        assert run * size == 16, steps      # row tiles with the column bits reach 16 bytes


ROW_LANES = layouts.tile_layout("row", 64, 64, 4).lane


def test_row_layout_widening_is_two_exchanges_for_bf16_and_one_for_f32():
    row = layouts.tile_layout("row", 64, 128, 4)
    assert len(row.widening(1, 8)[0]) == 2 and len(row.widening(1, 4)[0]) == 1
    vec = layouts.tile_layout("vec", 64, 128, 4)
    assert vec.widening(1, 8)[0] == []          # already 16 bytes a thread


@tk.kernel
def scale_store(A: tk.gl, C: tk.gl, LAYOUT: tk.constexpr = "row"):
    x = tk.load(A, (0, 0), shape=(64, 128), layout=LAYOUT, scope="warpgroup")
    tk.store(C, (x * 2.0).to(C.dtype), (0, 0))


def test_a_bf16_row_tile_leaves_in_16_byte_stores_after_shuffles():
    a = torch.randn(64, 128)
    c = torch.empty(64, 128, dtype=torch.bfloat16)
    ptx = scale_store.compile(a, c, num_warps=4).asm["ptx"]
    assert re.findall(r"st\.global[.\w]*", ptx) == ["st.global.v4.b32"] * 8
    assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == 32


def test_an_f32_row_tile_writing_whole_sectors_is_not_exchanged():
    a = torch.randn(64, 128)
    c = torch.empty(64, 128)
    ptx = scale_store.compile(a, c, num_warps=4).asm["ptx"]
    assert re.findall(r"st\.global[.\w]*", ptx) == ["st.global.v2.b32"] * 32
    assert "shfl" not in ptx


def test_a_vec_tile_store_moves_no_data_between_lanes():
    a = torch.randn(64, 128)
    c = torch.empty(64, 128, dtype=torch.bfloat16)
    ptx = scale_store.compile(a, c, LAYOUT="vec", num_warps=4).asm["ptx"]
    assert "shfl" not in ptx and len(re.findall(r"st\.global\.v4\.b32", ptx)) == 8


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, cols", [(64, 128), (61, 120), (64, 40)])
def test_row_tile_stores_on_the_gpu(dtype, rows, cols):
    """Exchanged stores land every element where it belongs, partial tiles
    (masked pieces) included; nothing past the tensor is written."""
    a = torch.randn(rows, cols, device="cuda")
    c = torch.full((rows, cols), float("nan"), device="cuda", dtype=dtype)
    scale_store[(1,)](a, c, num_warps=4)
    torch.cuda.synchronize()
    ref = (a.double() * 2).to(dtype).double()
    assert torch.equal(c.double(), ref)


def test_a_kernel_keeps_its_widened_stores_where_ptxas_spills_no_more(ptxas):
    """The attention backward's dK and dV (bf16, `row` layout) leave in 16-byte
    stores (+3-7% on the H100, BENCHMARKS.md); its few spills are the same
    either way."""
    c = compile_backward(128, True)
    assert "tk.narrow_stores" not in c.asm["tk"]
    assert len(re.findall(r"st\.global\.v4\.b32", c.asm["ptx"])) == 16


def test_a_kernel_whose_widened_stores_spill_more_is_compiled_without_them(ptxas):
    """Soft-capped, the same backward spilled 116 bytes with lane exchanges
    and 84 without: the compiler keeps the second, and says so in its IR."""
    c = compile_backward(128, True, 30.0)
    assert "tk.narrow_stores" in c.asm["tk"]
    assert not re.search(r"st\.global\.v4\.b32", c.asm["ptx"])
    assert c.info["spill stores (bytes)"] <= 96, c.ptxas_log
