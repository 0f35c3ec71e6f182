"""Register tiles whose sides are multiples of 16 but not powers of two
(48, 80, 176, 192: a repeat in the layout's register index).

The layouts themselves are checked exhaustively (every element held, once
per replica; vectors, slices and their text form agree; power-of-two layouts
unchanged); user kernels with such tiles are compiled through ptxas and run
in the interpreter against float64, and on the GPU where there is one:
loads and stores past the edge, row and column reductions and broadcasts,
slices, TMA boxes, and wgmma with N and K of 16·k from shared memory and from
registers.
"""
from __future__ import annotations

import collections
import itertools
import re

import numpy as np
import pytest

import tk_mlir as tk
from dialects import layout as layouts
from tk_mlir import bf16, f32

torch = pytest.importorskip("torch")

SIDES = (16, 48, 64, 80, 112, 176, 192, 256)
# Each kernel runs in the interpreter (CPU tensors) and, where there is one, on the GPU.
WHERE = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)]


def _launcher(kernel, device):
    return kernel.interpret if device == "cpu" else kernel


def _elements(layout) -> collections.Counter:
    """How many threads hold each element (every register of every thread)."""
    held = collections.Counter()
    for w in range(1 << len(layout.warp)):
        for lane in range(32):
            base = [0] * len(layout.shape)
            for bits, bases in ((lane, layout.lane), (w, layout.warp)):
                for i, b in enumerate(bases):
                    if bits >> i & 1 and b is not None:
                        base[b[0]] += 1 << b[1]
            for r in range(layout.num_regs):
                held[tuple(x + p for x, p in zip(base, layout.reg_position(r)))] += 1
    return held


def _layouts():
    for name, rows, cols, warps in itertools.product(("vec", "row", "col"), SIDES, SIDES,
                                                     (1, 4)):
        try:
            yield layouts.tile_layout(name, rows, cols, warps)
        except layouts.LayoutError:
            pass


@pytest.mark.parametrize("layout", list(_layouts()), ids=lambda l: "x".join(map(str, l.shape)))
def test_every_element_is_held_equally_often(layout):
    held = _elements(layout)
    assert set(held) == set(itertools.product(*map(range, layout.shape)))
    assert len(set(held.values())) == 1
    for keep in (0, 1):
        vector = layout.slice(keep)
        assert set(_elements(vector)) == {(i,) for i in range(layout.shape[keep])}
        assert layouts.decode(vector.encode(), vector.shape[0]) == vector
        for r in range(layout.num_regs):
            v = layout.slice_register(keep, r)
            assert vector.reg_position(v)[0] == layout.reg_position(r)[keep]


def test_a_power_of_two_layout_has_no_repeat_and_a_16k_side_one():
    assert layouts.tile_layout("row", 64, 64, 4).reg == ((1, 0), (0, 3), (1, 3), (1, 4), (1, 5))
    row = layouts.tile_layout("row", 128, 176, 4)
    assert row.reg == ((1, 0), (0, 3), (1, 3), (1, 4, 11), (0, 6))
    assert row.num_regs == 128 * 176 // 128
    assert row.slice(1).encode() == "r[1,8,16*11]l[2,4,x,x,x]w[x,x]"


@pytest.mark.parametrize("rows,cols,warps,run,regs", [
    (48, 80, 4, 2, 30), (48, 80, 8, 2, 30), (176, 48, 4, 2, 66), (16, 80, 4, 2, 10),
    (16, 16, 4, 2, 2), (16, 64, 8, 4, 4), (4, 128, 8, 4, 4), (1, 80, 4, 8, 40),
    (64, 80, 4, 8, 40), (48, 80, 1, 8, 120), (2, 256, 4, 8, 8), (1, 256, 8, 8, 8)])
def test_a_vec_tile_too_small_for_its_threads_shortens_its_run(rows, cols, warps, run, regs):
    """Where a vec tile of several rows would have its lanes and warps hold
    copies, its run of 8 gives bits to the threads (down to 2), as long as the
    warps stay on rows; a tile that fills its threads, whose warps would have
    to step along columns (a row sum would cross warps), or of one row, keeps
    the run of 8."""
    layout = layouts.tile_layout("vec", rows, cols, warps)
    assert (layout.vector_run(1), layout.num_regs) == (run, regs)
    assert not layout.warp_bits_along(1)


def test_a_slice_along_a_repeat_keeps_the_threads_of_its_tile():
    """The run depends on the power-of-two part alone: (16, 16) of (16, 80)
    is held by the same lanes and warps, so slicing it out moves no data."""
    whole, part = (layouts.tile_layout("vec", 16, c, 4) for c in (80, 16))
    assert (whole.lane, whole.warp) == (part.lane, part.warp)


def test_a_tile_too_large_for_its_threads_says_what_would_help():
    """More warps help a tile whose warps hold no copies; where they do, they
    would only add copies, and the error says to take a smaller tile."""
    @tk.kernel(num_warps=1)
    def big(X: tk.gl[f32], R: tk.constexpr, C: tk.constexpr):
        tk.store(X, tk.load(X, (0, 0), (R, C)) + 1.0, (0, 0))

    spec = tk.spec((512, 4096), f32)
    with pytest.raises(tk.CompilationError, match="use a smaller tile or more warps"):
        big.compile(spec, R=176, C=48)
    big.compile(spec, R=176, C=48, num_warps=4)     # (66 registers a thread)
    with pytest.raises(tk.CompilationError) as e:
        big.compile(spec, R=1, C=4080, num_warps=4)    # (255 x 16 columns: copies)
    assert "use a smaller tile" in str(e.value) and "more warps" not in str(e.value)


@pytest.mark.parametrize("rows,cols", [(64, 48), (128, 176), (192, 80), (64, 96), (128, 112)])
def test_row_registers_are_in_wgmma_fragment_order(rows, cols):
    """lowering/mma.py hands the row layout's registers to wgmma as they are:
    per 64 rows, 4 per 8 columns (the accumulator), and 8 per 64x16 block
    along K, then M (the A fragment)."""
    layout = layouts.tile_layout("row", rows, cols, 4)
    lane0 = [layout.reg_position(r) for r in range(layout.num_regs)]
    for r, (row, col) in enumerate(lane0):
        block, i = divmod(r, cols // 2)            # the accumulator of 64 rows
        j, k = divmod(i, 4)                        # its 8-column block j
        assert (row, col) == (64 * block + 8 * (k >> 1), 8 * j + (k & 1))
        a_block, a = divmod(r, 8)                  # the A fragment's 64x16 blocks
        mb, ks = divmod(a_block, cols // 16)
        assert (row, col) == (64 * mb + 8 * (a >> 1 & 1), 16 * ks + (a & 1) + 8 * (a >> 2))


@pytest.mark.parametrize("name,rows,cols,warps,message", [
    ("row", 64, 40, 4, "cols must be a power of two or a multiple of 16, got 40; use 48"),
    ("row", 48, 64, 4, "needs a multiple of 64 rows and of 16 columns, got 48x64"),
    ("col", 64, 48, 4, "needs a multiple of 16 rows and of 64 columns, got 64x48"),
    ("vec", 24, 64, 4, "rows must be a power of two or a multiple of 16, got 24; use 32"),
])
def test_sizes_no_layout_holds_are_refused(name, rows, cols, warps, message):
    with pytest.raises(layouts.LayoutError, match=message):
        layouts.tile_layout(name, rows, cols, warps)


# ----------------------------------------------------------- user kernels

@tk.kernel(num_warps=4)
def tile_ops(X: tk.gl[f32], RS: tk.gl[f32], CM: tk.gl[f32], Y: tk.gl[f32], S: tk.gl[f32],
             R: tk.constexpr, C: tk.constexpr, LAYOUT: tk.constexpr, SCOPE: tk.constexpr,
             SW: tk.constexpr, ROWS: tk.constexpr, COLS: tk.constexpr):
    """Row sums (ROWS) and column maxima (COLS), broadcast back; the tile's
    last SW columns (a slice) stored apart."""
    x = tk.load(X, (0, 0), (R, C), layout=LAYOUT, scope=SCOPE)
    y = x
    if ROWS:
        rs = x.row_sum()
        tk.store(RS, rs, (0,))
        y = y.sub_row(rs)
    if COLS:
        cm = x.col_max()
        tk.store(CM, cm, (0,))
        y = y.mul_col(cm)
    tk.store(Y, y, (0, 0))
    tk.store(S, x.slice(cols=(C - SW, SW)), (0, 0))


TILE_CASES = [  # layout, scope, R, C
    ("vec", "block", 48, 80), ("vec", "warp", 16, 48), ("vec", "block", 192, 16),
    ("vec", "block", 16, 80), ("vec", "block", 32, 80),
    ("row", "warp", 48, 80), ("row", "warpgroup", 192, 48), ("row", "block", 64, 80),
    ("col", "warp", 80, 48), ("col", "warpgroup", 48, 192),
]


@pytest.mark.parametrize("device", WHERE)
@pytest.mark.parametrize("layout,scope,R,C", TILE_CASES)
def test_tile_ops(device, layout, scope, R, C):
    m, n = R - 3, C - 4               # the last rows and columns are past the edge
    rows = cols = True          # (a warpgroup tile of a 4-warp kernel is the block's)
    x = torch.rand(m, n, device=device) - 0.5
    rs = torch.full((R,), float("nan"), device=device)
    cm = torch.full((C,), float("nan"), device=device)
    y = torch.full_like(x, float("nan"))
    sw = 64 if (layout, scope) == ("col", "warpgroup") else 16   # a whole col tile
    s = torch.full((m, sw), float("nan"), device=device)
    _launcher(tile_ops, device)[(1,)](x, rs, cm, y, s, R=R, C=C, LAYOUT=layout, SCOPE=scope,
                                      SW=sw, ROWS=rows, COLS=cols)
    xd = torch.zeros(R, C, dtype=torch.float64, device=device)
    xd[:m, :n] = x.double()
    ref_rs, ref_cm = xd.sum(1), xd.max(0).values
    rel = lambda got, ref: ((got.double() - ref).norm() / ref.norm()).item()
    ref_y = xd
    if rows:
        assert rel(rs, ref_rs) < 1e-6
        ref_y = ref_y - ref_rs[:, None]
    if cols:
        assert rel(cm, ref_cm) < 1e-6
        ref_y = ref_y * ref_cm[None, :]
    assert rel(y, ref_y[:m, :n]) < 1e-6
    assert rel(s, xd[:m, C - sw:]) < 1e-6     # the columns past the edge read 0


def test_a_reduction_across_a_warpgroup_tiles_warps_is_refused_in_the_interpreter_too():
    """In a kernel of two warpgroups a warpgroup tile's warps cannot meet at
    the block's barrier: the GPU path and the interpreter refuse it alike
    (tk-verify), at the line."""
    x = torch.rand(189, 44)
    out = [torch.empty(n) for n in (192, 48)] + [torch.empty(189, 44), torch.empty(189, 16)]
    with pytest.raises(tk.CompilationError, match="a col reduction across the warps of a "
                       "warpgroup-scope tile .* in a kernel of 8 warps is not supported yet; "
                       "make the tile with layout=\"col\"") as e:
        tile_ops.interpret[(1,)](x, *out, R=192, C=48, LAYOUT="row", SCOPE="warpgroup", SW=16,
                                 ROWS=True, COLS=True, num_warps=8)
    assert "cm = x.col_max()" in str(e.value)


@tk.kernel(num_warps=4)
def mma_tile(A: tk.gl[bf16], B: tk.gl[bf16], C: tk.gl[f32], M: tk.constexpr, N: tk.constexpr,
             K: tk.constexpr, FORM: tk.constexpr):
    """C = op(A)·op(B) in one warpgroup: A, B in by TMA, one tk.mma_* (FORM
    ABt, AB, AtB, or RA: A from registers), out by threads."""
    a = tk.shared_tile(bf16, (K, M) if FORM == "AtB" else (M, K), swizzle=32)
    b = tk.shared_tile(bf16, (N, K) if FORM in ("ABt", "RA") else (K, N), swizzle=32)
    sem = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(sem, a, b)
        tk.tma.load_async(a, A, (0, 0), sem)
        tk.tma.load_async(b, B, (0, 0), sem)
    tk.wait(sem, 0)
    acc = tk.zeros((M, N), f32, layout="row", scope="warpgroup")
    if FORM == "ABt":
        acc = tk.mma_ABt(acc, a, b)
    elif FORM == "AB":
        acc = tk.mma_AB(acc, a, b)
    elif FORM == "AtB":
        acc = tk.mma_AtB(acc, a, b)
    else:
        acc = tk.mma_ABt(acc, tk.load(a, layout="row", scope="warpgroup"), b)
    tk.mma_wait(0)
    tk.store(C, acc, (0, 0))


MMA_CASES = [  # M, N, K, form
    (64, 48, 48, "ABt"), (64, 176, 64, "ABt"), (128, 80, 176, "AB"), (192, 112, 32, "AtB"),
    (64, 240, 80, "RA"), (128, 48, 96, "RA"),
]


@pytest.mark.parametrize("device", WHERE)
@pytest.mark.parametrize("M,N,K,form", MMA_CASES)
def test_mma(device, M, N, K, form):
    # Each tile reaches past the tensor's edge (TMA reads zeros there, the
    # store skips it) by 8: tensors' rows stay whole 16-byte units.
    m, n, k = M - 8, N - 8, K - 8
    a = (torch.rand(m, k, device=device) - 0.5).to(torch.bfloat16)
    b = (torch.rand(n, k, device=device) - 0.5).to(torch.bfloat16)
    c = torch.full((m, n), float("nan"), device=device)
    a_arg = a.T.contiguous() if form == "AtB" else a
    b_arg = b if form in ("ABt", "RA") else b.T.contiguous()
    _launcher(mma_tile, device)[(1,)](a_arg, b_arg, c, M=M, N=N, K=K, FORM=form)
    ref = a.double() @ b.double().T
    err = ((c.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err


@pytest.mark.parametrize("M,N,K,form", MMA_CASES)
def test_mma_assembles_with_one_wgmma_per_64_rows_and_k_step(M, N, K, form, ptxas):
    spec = lambda r, c: tk.spec((r, c), bf16)
    a = spec(K, M) if form == "AtB" else spec(M, K)
    b = spec(N, K) if form in ("ABt", "RA") else spec(K, N)
    compiled = mma_tile.compile(a, b, tk.spec((M, N), f32), M=M, N=N, K=K, FORM=form)
    ptx = compiled.asm["ptx"]
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{N}k16") == (M // 64) * (K // 16)
    # From tk.zeros: each 64-row block's first wgmma has scale-d 0 (D = A·B,
    # no zeroed registers), the others accumulate.
    assert ptx.count("setp.ne.b32 p, 0, 0;") == M // 64
    assert ptx.count("setp.ne.b32 p, 1, 0;") == (M // 64) * (K // 16 - 1)
    info = compiled.info
    assert info["spill stores (bytes)"] == 0, info


@tk.kernel(num_warps=4)
def shared_ops(X: tk.gl[bf16], Y: tk.gl[bf16], A: tk.gl[f32], R: tk.constexpr, C: tk.constexpr,
               SWIZZLE: tk.constexpr, LAYOUT: tk.constexpr):
    """Per block: an R x C tile global -> shared (threads), shared -> registers,
    2x + 1 back into a second shared tile, out by a TMA store; and the f32 tile
    added into A (atomic_add) at the same place."""
    i = tk.block_id(0)
    a = tk.shared_tile(bf16, (R, C), swizzle=SWIZZLE)
    b = tk.shared_tile(bf16, (R, C), swizzle=SWIZZLE)
    tk.copy(a, X, (i, 0))
    t = tk.load(a, layout=LAYOUT, scope="warpgroup" if LAYOUT == "row" else "block").to(f32)
    tk.store(b, (t * 2.0 + 1.0).to(bf16))
    tk.barrier()
    if tk.elect_leader("warpgroup"):
        tk.tma.store_async(Y, b, (i, 0))
        tk.tma.store_commit()
        tk.tma.store_wait(0)
    tk.atomic_add(A, t, (i, 0))


SHARED_CASES = [  # R, C, swizzle, layout: 16·k sides, several swizzles
    (48, 80, 32, "vec"), (192, 48, 32, "row"), (80, 64, 128, "vec"), (64, 112, 32, "row"),
    (112, 128, 64, "vec"),
]


@pytest.mark.parametrize("device", WHERE)
@pytest.mark.parametrize("R,C,swizzle,layout", SHARED_CASES)
def test_shared_tiles_tma_store_and_atomic_add(device, R, C, swizzle, layout):
    m, n = 2 * R + R // 2, C - 8             # 3 blocks, the last one half past the edge
    x = (torch.rand(m, n, device=device) - 0.5).to(torch.bfloat16)
    y = torch.full_like(x, float("nan"))
    acc = torch.rand(m, n, device=device)
    start = acc.clone()
    _launcher(shared_ops, device)[(3,)](x, y, acc, R=R, C=C, SWIZZLE=swizzle, LAYOUT=layout)
    assert torch.equal(y, (x.float() * 2 + 1).to(torch.bfloat16))
    assert torch.allclose(acc, start + x.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("R,C,swizzle,layout", SHARED_CASES)
def test_shared_ops_assemble_without_spills(R, C, swizzle, layout, ptxas):
    compiled = shared_ops.compile(tk.spec((1000, C), bf16), tk.spec((1000, C), bf16),
                                  tk.spec((1000, C), f32), R=R, C=C, SWIZZLE=swizzle,
                                  LAYOUT=layout)
    assert compiled.info["spill stores (bytes)"] == 0, compiled.info
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in compiled.asm["ptx"]


@tk.kernel(num_warps=4)
def column_vector(X: tk.gl[f32], Y: tk.gl[f32], C: tk.constexpr):
    """Y = -X broadcast down 64 rows: X's C values (a 1 x C tensor) through a
    shared vector picked at run time (as a ring's stage is), read in the row
    layout's column order (ten pieces at C=80)."""
    v = tk.shared_vectors(f32, C, 2)[tk.block_id(0) % 2]
    sem = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(sem, v)
        tk.tma.load_async(v, X, (0, 0), sem)
    tk.wait(sem, 0)
    t = tk.zeros((64, C), f32, layout="row", scope="warpgroup").sub_col(
        tk.load(v, scope="warpgroup"))
    tk.store(Y, t, (0, 0))


@pytest.mark.parametrize("C", [64, 80, 176])
def test_a_vector_read_takes_one_address_and_immediates(C, ptxas):
    """Each piece's offset is the thread's plus a constant with no bit in
    common, added with no-wrap flags so that LLVM may fold it into the
    ld.shared's immediate (unflagged, the i32 sum is sign-extended whole; in
    the attention backward's ring of 80-element vectors that took an address
    register per piece)."""
    c = column_vector.compile(tk.spec((1, C), f32), tk.spec((64, C), f32), C=C)
    offsets = re.findall(r"arith\.addi %\w+, %c(\d+)_i32 overflow<nsw, nuw>", c.asm["tk-to-gpu"])
    assert sorted(map(int, offsets)) == [32 * j for j in range(1, C // 8)], offsets
    loads = re.findall(r"ld\.shared\.v2\.(?:b32|f32)\s+\{[^}]*\},\s*\[(%r[d]?\d+)(?:\+\d+)?\]",
                       c.asm["ptx"])
    assert len(loads) == C // 8 and len(set(loads)) == 1, loads


@pytest.mark.parametrize("device", WHERE)
def test_column_vector_broadcast(device):
    x = torch.rand(1, 80, device=device)
    y = torch.full((64, 80), float("nan"), device=device)
    _launcher(column_vector, device)[(1,)](x, y, C=80)
    assert torch.equal(y, -x.expand(64, 80))


@tk.kernel(num_warps=4)
def transposed(X: tk.gl[f32], Y: tk.gl[f32], Z: tk.gl[f32], R: tk.constexpr, C: tk.constexpr,
               SWIZZLE: tk.constexpr):
    """Y = Xᵀ + 1 from registers (a row tile transposed to a col one), and Z
    = Xᵀ through a swizzled shared tile and a TMA store; X read back from
    the col tile transposed again (2·X - X: the round trip is exact)."""
    x = tk.load(X, (0, 0), (R, C), layout="row", scope="warpgroup")
    t = x.T
    tk.store(Y, t + 1.0, (0, 0))
    st = tk.shared_tile(f32, (C, R), swizzle=SWIZZLE)
    tk.store(st, t.T.T * 2.0 - x.transpose().T.T)
    tk.barrier()
    if tk.elect_leader("warpgroup"):
        tk.tma.store_async(Z, st, (0, 0))
        tk.tma.store_commit()
        tk.tma.store_wait(0)


@pytest.mark.parametrize("device", WHERE)
@pytest.mark.parametrize("R, C, swizzle", [(64, 80, 128), (64, 64, 64), (128, 48, 32)])
def test_transpose_in_registers(device, R, C, swizzle):
    x = torch.randn(R, C, device=device)
    y, z = (torch.full((C, R), float("nan"), device=device) for _ in range(2))
    _launcher(transposed, device)[(1,)](x, y, z, R=R, C=C, SWIZZLE=swizzle)
    assert torch.equal(y, x.T + 1) and torch.equal(z, x.T)


def test_transpose_moves_no_data_and_takes_row_or_col_tiles(ptxas):
    c = transposed.compile(tk.spec((64, 80), f32), tk.spec((80, 64), f32),
                           tk.spec((80, 64), f32), R=64, C=80, SWIZZLE=128)
    assert '"tk.transpose"' in c.asm["tk"] and "shfl" not in c.asm["ptx"]
    assert c.info["spill stores (bytes)"] == 0
    with pytest.raises(tk.CompilationError, match=r"transpose: expected a register tile in "
                                                  r"the row or col layout"):
        tile_ops_vec_transpose.compile(tk.spec((64, 64), f32))


@tk.kernel(num_warps=4)
def tile_ops_vec_transpose(X: tk.gl[f32]):
    tk.store(X, tk.load(X, (0, 0), (64, 64)).T, (0, 0))


@pytest.mark.parametrize("swizzle, registers", [(0, 1), (128, 4)])
def test_a_transposed_store_takes_one_offset_and_constants(swizzle, registers, ptxas):
    """The col tile's 40 pieces (80 x 64 f32) share the thread's offset: a
    sum of constants unswizzled, and swizzled a XOR within the pattern's
    1024 bytes (4 distinct) plus a sum above it (the second column block
    starts 80·128 bytes on: not a XOR), where each piece's offset was
    computed whole before."""
    c = transposed.compile(tk.spec((64, 80), f32), tk.spec((80, 64), f32),
                           tk.spec((80, 64), f32), R=64, C=80, SWIZZLE=swizzle)
    stores = re.findall(r"st\.shared\.\S+\s+\[(%r[d]?\d+)(?:\+\d+)?\]", c.asm["ptx"])
    assert len(stores) == 40 and len(set(stores)) == registers, stores


@tk.kernel(num_warps=4)
def col_store_then_row_load(X: tk.gl[f32], Y: tk.gl[f32], BARRIER: tk.constexpr):
    st = tk.shared_tile(f32, (64, 64), swizzle=128)
    tk.store(st, tk.load(X, (0, 0), (64, 64), layout="row", scope="warpgroup").T)
    if BARRIER:
        tk.barrier()
    tk.store(Y, tk.load(st, layout="row", scope="warpgroup"), (0, 0))


def test_the_interpreter_tells_col_tiles_warps_apart():
    """A col tile's warps hold columns, not rows: its store into shared memory
    is no race among them, but a row-layout read of it by other warps with
    no barrier between is."""
    from tk_mlir.interpreter import InterpretError
    x = torch.randn(64, 64)
    y = torch.full_like(x, float("nan"))
    col_store_then_row_load.interpret[(1,)](x, y, BARRIER=True)
    assert torch.equal(y, x.T)
    with pytest.raises(InterpretError, match="data race"):
        col_store_then_row_load.interpret[(1,)](x, y, BARRIER=False)


@tk.kernel(num_warps=8)
def transposed_block(X: tk.gl[bf16], Y: tk.gl[bf16], Z: tk.gl[bf16], R: tk.constexpr,
                     C: tk.constexpr):
    """Across 8 warps, in bf16: Y = Xᵀ from registers, Z = Xᵀ read back from a
    shared tile (unswizzled) as a col tile."""
    t = tk.load(X, (0, 0), (R, C), layout="row").T
    tk.store(Y, t, (0, 0))
    st = tk.shared_tile(bf16, (C, R))
    tk.store(st, t)
    tk.barrier()
    tk.store(Z, tk.load(st, layout="col"), (0, 0))


@pytest.mark.parametrize("device", WHERE)
def test_transpose_across_eight_warps_in_bf16(device):
    x = torch.randn(128, 48, device=device).bfloat16()
    y, z = (torch.full((48, 128), float("nan"), device=device).bfloat16() for _ in range(2))
    _launcher(transposed_block, device)[(1,)](x, y, z, R=128, C=48)
    assert torch.equal(y, x.T) and torch.equal(z, x.T)
