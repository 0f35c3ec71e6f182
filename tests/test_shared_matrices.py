"""16-bit register tiles in the MMA fragment layouts (`row`, and `col`, its
transpose) move to and from shared tiles as 8x8 matrices: stmatrix and
ldmatrix (.trans for `col`), four matrices an instruction where the layout
allows, one address per lane. Other tiles and dtypes keep plain ld/st.shared.
The PTX is checked here; each direction, through every swizzle, scope and
tile side of 16·k, runs on the GPU."""
import re

import pytest

import tk_mlir as tk
from tk_mlir import bf16, f32


@tk.kernel(num_warps=4)
def round_trip(X: tk.gl, Y: tk.gl, ROWS: tk.constexpr = 64, COLS: tk.constexpr = 64,
               SWIZZLE: tk.constexpr = 128, LAYOUT: tk.constexpr = "row",
               SCOPE: tk.constexpr = "warpgroup", STORE: tk.constexpr = True,
               TMA: tk.constexpr = False):
    """Y = X, each block its own ROWS x COLS tile of rows, through a shared
    tile: STORE, a register tile in LAYOUT stored to it (stmatrix) and copied
    out; else copied in and loaded in LAYOUT (ldmatrix). The copies move
    16-byte vectors by the tile's byte layout, so a wrong matrix address
    shows (a round trip through both matrix instructions could hide it);
    TMA: the copy is a TMA store or load, which lays the tile out as the
    hardware does (a byte layout wrong in both directions shows too)."""
    s = tk.shared_tile(X.dtype, (ROWS, COLS), swizzle=SWIZZLE)
    if STORE:
        tk.store(s, tk.load(X, (tk.block_id(0), 0), (ROWS, COLS), layout=LAYOUT, scope=SCOPE))
        if TMA:
            tk.barrier()
            if tk.elect_leader("warpgroup"):      # (the block: one warpgroup)
                tk.tma.store_async(Y, s, (tk.block_id(0), 0))
                tk.tma.store_commit()
                tk.tma.store_wait(0)
        else:
            tk.copy(Y, s, (tk.block_id(0), 0))
    else:
        if TMA:
            full = tk.semaphore()
            if tk.elect_leader("warpgroup"):      # (the block: one warpgroup)
                tk.tma.expect(full, s)
                tk.tma.load_async(s, X, (tk.block_id(0), 0), full)
            tk.wait(full, 0)
        else:
            tk.copy(s, X, (tk.block_id(0), 0))
        tk.store(Y, tk.load(s, layout=LAYOUT, scope=SCOPE), (tk.block_id(0), 0))


def _ptx(rows=64, cols=64, dtype="bf16", **kw):
    return round_trip.compile(tk.spec((2 * rows, cols), dtype), tk.spec((2 * rows, cols), dtype),
                              ROWS=rows, COLS=cols, **kw).asm["ptx"]


def test_row_layout_moves_four_matrices_per_instruction():
    # 64x64 over a warpgroup: 16 matrices per warp, 4 instructions each way.
    ptx = _ptx()
    assert len(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16", ptx)) == 4
    assert not re.search(r"st\.shared\.(b32|u32|b16)", ptx)
    ptx = _ptx(STORE=False)
    assert len(re.findall(r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16", ptx)) == 4


def test_col_layout_moves_transposed_matrices():
    assert re.search(r"stmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16",
                     _ptx(LAYOUT="col"))
    assert re.search(r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16",
                     _ptx(LAYOUT="col", STORE=False))


def test_a_repeat_in_the_columns_still_moves_four_matrices():
    # 80 = 5 x 16 columns: the repeat digit sits above register bits 0-2.
    ptx = _ptx(cols=80, SWIZZLE=32)
    assert len(re.findall(r"stmatrix\.sync\.aligned\.m8n8\.x4", ptx)) == 5


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("kw", [dict(LAYOUT="vec", SCOPE="block"), dict(dtype="f32")])
def test_other_layouts_and_dtypes_keep_plain_shared_accesses(kw, store):
    ptx = _ptx(STORE=store, **kw)
    assert "stmatrix" not in ptx and "ldmatrix" not in ptx


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_a_warp_scope_store_is_ordered_among_the_warps_lanes(dtype):
    """A warp-scope tile's store has a bar.warp.sync on each side (its lanes
    read each other's elements, and nothing a kernel writes orders them);
    a warpgroup's orders itself (tk.named_barrier), a block's takes a block
    barrier on each side."""
    def around_store(ptx):      # (among the shared accesses and barriers, in order)
        lines = [l.strip() for l in ptx.splitlines()
                 if re.match(r"\s*(\{.*bar\.warp|bar\.|barrier|st\.shared|ld\.shared|stmatrix|"
                             r"ldmatrix)", l)]
        stores = [i for i, l in enumerate(lines) if re.match(r"(stmatrix|st\.shared)", l)]
        return lines[stores[0] - 1], lines[stores[-1] + 1]
    warp = _ptx(rows=48, cols=64, dtype=dtype, SWIZZLE=32, SCOPE="warp")
    # (over the lanes that reach it: a store some lanes skip does not hang)
    assert around_store(warp) == ("{ .reg .b32 m; activemask.b32 m; bar.warp.sync m; }",) * 2
    assert "bar.warp.sync" not in _ptx(dtype=dtype) and "bar.warp.sync" not in _ptx(
        rows=128, dtype=dtype, SCOPE="block")


@pytest.mark.parametrize("name, rows, cols, swizzle, scope",
                         [("row", 64, 64, 128, "warpgroup"), ("col", 64, 64, 64, "warpgroup"),
                          ("row", 64, 80, 32, "warpgroup"), ("row", 64, 48, 0, "warpgroup"),
                          ("row", 128, 64, 128, "block"), ("col", 48, 64, 32, "warp")])
def test_every_lane_addresses_its_rows(name, rows, cols, swizzle, scope):
    """The lowered addresses, JIT-compiled on the CPU for every (lane, warp):
    lane l of an x4 stmatrix/ldmatrix gives row l % 8 of matrix l // 8 (the
    register pair r0 + 2(l // 8)), and each plain access the element its first
    register holds; both by the tile's byte layout (T.ST.byte_offset)."""
    from tk_mlir.dialects import layout as layouts, types as T
    from lowering_jit import access_offsets
    st = T.ST("bf16", rows, cols, swizzle)
    layout = layouts.tile_layout(name, rows, cols, T.scope_warps(scope, 4))
    pieces, offsets = access_offsets(st, layout, scope, matrices=True)
    assert pieces and all(n == 8 for _, n, _ in pieces) and \
        {trans for _, _, trans in pieces} == {name == "col"}
    for (r0, n, _), got in zip(pieces, offsets):
        for (lane, warp), offset in got.items():
            row, col = layout.position(r0 + 2 * (lane // 8), 0, warp)
            assert offset == st.byte_offset(row + lane % 8, col), (r0, lane, warp)
    pieces, offsets = access_offsets(st, layout, scope, matrices=False)
    for (r0, _, _), got in zip(pieces, offsets):
        for (lane, warp), offset in got.items():
            assert offset == st.byte_offset(*layout.position(r0, lane, warp)), (r0, lane, warp)


CASES = [dict(), dict(SWIZZLE=0), dict(SWIZZLE=32), dict(SWIZZLE=64),
         dict(LAYOUT="col"), dict(LAYOUT="col", SWIZZLE=64),
         dict(SCOPE="warp", ROWS=16, COLS=128), dict(SCOPE="block", ROWS=128, COLS=64),
         dict(COLS=80, SWIZZLE=32), dict(ROWS=64, COLS=48, SWIZZLE=32, LAYOUT="row"),
         dict(ROWS=48, COLS=64, LAYOUT="col", SCOPE="warp"), dict(ROWS=64, COLS=16, SWIZZLE=32),
         dict(ROWS=64, COLS=48, SWIZZLE=0), dict(ROWS=64, COLS=80, SWIZZLE=0),
         dict(dtype="f16", COLS=128, SWIZZLE=128)]


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["copy", "tma"])
@pytest.mark.parametrize("store", [True, False], ids=["stmatrix", "ldmatrix"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items())
                         or "default")
def test_through_shared_memory_on_the_gpu(case, store, tma):
    torch = pytest.importorskip("torch")
    case = dict(case)
    dtype = getattr(torch, {"bf16": "bfloat16", "f16": "float16"}[case.pop("dtype", "bf16")])
    rows, cols = case.get("ROWS", 64), case.get("COLS", 64)
    x = torch.randn(3 * rows, cols, device="cuda").to(dtype)
    y = torch.full_like(x, float("nan"))
    round_trip[(3,)](x, y, STORE=store, TMA=tma, **case)
    assert torch.equal(x, y)
