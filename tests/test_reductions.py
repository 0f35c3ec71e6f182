"""Reductions into global memory: tk.atomic_add (a register tile added with
red.global.add.f32, vectorized where the layout gives 2 or 4 consecutive
f32 per thread) and tk.tma.reduce_add_async (a shared tile added by TMA,
cp.reduce.async.bulk.tensor .add). CPU: the PTX and SASS, the guards that
add a replicated element once, the proxy fence before a TMA reduce of a
tile the threads wrote, and errors at the user's line. GPU (`-m gpu`): many
blocks accumulate into one random-initialised target, against float64.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import error_checks
import tk_mlir as tk
from error_checks import compile_error
from tk_mlir import bf16, f32
from tk_mlir.toolchain import find_tool

HERE = Path(__file__).resolve()
needs_nvdisasm = pytest.mark.skipif(find_tool("nvdisasm") is None, reason="nvdisasm not found")

BLOCKS = 8           # blocks accumulating into the same place (GPU tests)
FENCE = "fence.proxy.async.shared::cta"
REDUCE = "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group"


# ------------------------------------------------------------------ kernels

@tk.kernel(num_warps=4)
def add_tiles(X: tk.gl[f32], Y: tk.gl[f32], R: tk.constexpr, C: tk.constexpr,
              LAYOUT: tk.constexpr, SCOPE: tk.constexpr, AT: tk.constexpr):
    """Block b adds X[b] (masked past X's edge) into Y's tile AT (masked past Y's)."""
    x = tk.load(X, (tk.block_id(0), 0, 0), (R, C), layout=LAYOUT, scope=SCOPE)
    if SCOPE != "warp":          # block, or the one warpgroup of 4 warps
        tk.atomic_add(Y, x, AT)
    elif tk.warp_id() == 0:      # each warp holds a copy: the first one's
        tk.atomic_add(Y, x, AT)


@tk.kernel(num_warps=4)
def add_vectors(X: tk.gl[f32], RS: tk.gl[f32], CS: tk.gl[f32], R: tk.constexpr,
                C: tk.constexpr, LAYOUT: tk.constexpr, AT: tk.constexpr):
    """Row and column sums of block b's tile: vectors whose elements several
    threads hold (lanes of a quad, or every warp), added once each."""
    x = tk.load(X, (tk.block_id(0), 0, 0), (R, C), layout=LAYOUT)
    tk.atomic_add(RS, x.row_sum(), (AT,))
    tk.atomic_add(CS, x.col_sum(), (AT,))


@tk.kernel(num_warps=4)
def tma_add(X: tk.gl, Y: tk.gl, R: tk.constexpr, C: tk.constexpr, THREADS: tk.constexpr,
            AT: tk.constexpr):
    """Block b adds X[b]'s tile into Y's tile AT with TMA; the shared tile is
    written by the threads (a proxy fence is due) or by a TMA load (none)."""
    a = tk.shared_tile(X.dtype, (R, C), swizzle=128)
    if THREADS:
        tk.store(a, tk.load(X, (tk.block_id(0), 0, 0), (R, C)))
    else:
        s = tk.semaphore()
        if tk.elect_leader("warpgroup"):
            tk.tma.expect(s, a)
            tk.tma.load_async(a, X, (tk.block_id(0), 0, 0), s)
        tk.wait(s, 0)
    if tk.elect_leader("warpgroup"):
        tk.tma.reduce_add_async(Y, a, AT)
        tk.tma.store_commit()
    tk.tma.store_wait(0, read=False)


def _spec(*shape, dtype=f32):
    return tk.spec(shape, dtype)


def _tiles(layout, scope="block", at=(0, 0)):
    return add_tiles.compile(_spec(BLOCKS, 64, 64), _spec(100, 68), R=64, C=64, LAYOUT=layout,
                             SCOPE=scope, AT=at)


# -------------------------------------------------------------- PTX, SASS

@pytest.mark.parametrize("layout,form,sass", [
    ("vec", "red.global.add.v4.f32", "REDG.E.ADD.F32x4"),   # 4 consecutive f32 per thread
    ("row", "red.global.add.v2.f32", "REDG.E.ADD.F32x2"),   # the mma fragment's pairs
    ("col", "red.global.add.f32", "REDG.E.ADD.F32."),       # consecutive rows: scalars
])
def test_atomic_add_is_red_vectorized_as_the_layout_allows(layout, form, sass):
    c = _tiles(layout)
    ptx = c.asm["ptx"]
    reds = re.findall(r"red\.global[.\w]*", ptx)
    assert reds and set(reds) == {form}, reds
    # one red per piece: 64x64 f32 over 128 threads is 32 registers a thread
    width = {"vec": 4, "row": 2, "col": 1}[layout]
    assert len(reds) == 32 // width
    assert "atom." not in ptx
    assert c.info["spill stores (bytes)"] == 0
    if find_tool("nvdisasm") is not None:
        assert sass in c.asm["sass"]


def _definitions(ir_text: str) -> dict[str, str]:
    """SSA name -> its defining op's text (without the location)."""
    return {m.group(1): m.group(2) for m in
            re.finditer(r"^\s*(%[\w]+) = (.*?)(?: loc\(.*\))?$", ir_text, re.MULTILINE)}


def _replica_masks(defs: dict[str, str], cond: str) -> set[tuple[str, int]]:
    """The (lane | warp, mask) of each `bits & mask == 0` the i1 `cond` is the
    conjunction of (the first-replica test; bounds tests are skipped)."""
    rhs = defs.get(cond, "")
    if rhs.startswith("arith.andi") and rhs.endswith(": i1"):
        a, b = re.findall(r"%\w+", rhs)[:2]
        return _replica_masks(defs, a) | _replica_masks(defs, b)
    m = re.match(r"arith\.cmpi eq, (%\w+), %c0_i32", rhs)
    bits = re.match(r"arith\.andi (%\w+), %c(\d+)_i32", defs.get(m.group(1), "")) if m else None
    if bits is None:
        return set()
    source = defs.get(bits.group(1), "")
    kind = "lane" if ", %c31_i32" in source else "warp" if ", %c5_i32" in source else "?"
    return {(kind, int(bits.group(2)))}


def _red_guards(ir_text: str) -> list[str]:
    """The condition of each scf.if whose body is a red."""
    return re.findall(r"scf\.if (%\w+) \{\n\s*llvm\.inline_asm has_side_effects \"red\.global",
                      ir_text)


def test_a_replicated_vector_is_added_once():
    """A row sum in the row layout (r[8]l[x,x,1,2,4]w[16,32]) is held by the 4
    lanes of a quad: each red is guarded by lane & 3 == 0 (and bounds). A
    column sum (r[1,8,16,32]l[2,4,x,x,x]w[x,x]) is held by lanes 4 apart and
    by every warp: lane & 28 == 0 and warp & 3 == 0."""
    c = add_vectors.compile(_spec(BLOCKS, 64, 64), _spec(100), _spec(68), R=64, C=64,
                            LAYOUT="row", AT=0)
    layouts = re.findall(r'"tk\.atomic_add".*!tk\.rv<f32, 64 : i64, "([^"]+)"', c.asm["tk-verify"])
    assert layouts == ["r[8]l[x,x,1,2,4]w[16,32]", "r[1,8,16,32]l[2,4,x,x,x]w[x,x]"]
    lowered = c.asm["tk-to-gpu"]
    guards = _red_guards(lowered)
    assert len(guards) == len(re.findall(r"red\.global", c.asm["ptx"]))
    defs = _definitions(lowered)
    rows, cols = guards[:2], guards[2:]    # 2 registers of the row sum, then the column sum's
    assert cols and all(_replica_masks(defs, g) == {("lane", 3)} for g in rows)
    assert all(_replica_masks(defs, g) == {("lane", 28), ("warp", 3)} for g in cols)


def test_a_tile_with_no_replica_has_only_bounds_guards():
    lowered = _tiles("vec").asm["tk-to-gpu"]
    defs = _definitions(lowered)
    guards = _red_guards(lowered)
    assert len(guards) == 8 and not any(_replica_masks(defs, g) for g in guards)


@pytest.mark.parametrize("threads", [True, False])
def test_tma_reduce_add_is_cp_reduce_async_bulk_and_fenced_after_thread_writes(threads):
    c = tma_add.compile(_spec(BLOCKS, 64, 32), _spec(100, 52), R=64, C=32, THREADS=threads,
                        AT=(1, 1))
    ptx = c.asm["ptx"]
    assert ptx.count(REDUCE) == 1
    assert "cp.async.bulk.commit_group" in ptx and re.search(r"cp.async.bulk.wait_group\s+0;", ptx)
    # The threads' st.shared, then the fence, then (after the barrier) the reduce.
    assert ptx.count(FENCE) == (1 if threads else 0)
    if threads:
        assert ptx.index(FENCE) < ptx.index(REDUCE)
    if find_tool("nvdisasm") is not None:
        assert "UTMAREDG.2D.ADD" in c.asm["sass"]


@pytest.mark.parametrize("dtype", [bf16, "f16"])
def test_tma_reduce_add_of_16_bit_tiles_assembles(dtype):
    c = tma_add.compile(_spec(BLOCKS, 64, 64, dtype=dtype), _spec(100, 72, dtype=dtype),
                        R=64, C=64, THREADS=True, AT=(0, 0))
    assert c.asm["ptx"].count(REDUCE) == 1


# ------------------------------------------------------------------- errors

@tk.kernel(num_warps=4)
def k_bf16_destination(X: tk.gl[bf16], Y: tk.gl[bf16]):
    x = tk.load(X, (0, 0), (64, 64))
    tk.atomic_add(Y, x, (0, 0))  # E:bf16-dst


@tk.kernel(num_warps=4)
def k_bf16_tile(X: tk.gl[bf16], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (64, 64))
    tk.atomic_add(Y, x, (0, 0))  # E:bf16-tile


@tk.kernel(num_warps=4)
def k_shared_destination(X: tk.gl[f32], Y: tk.gl[f32]):
    a = tk.shared_tile(f32, (64, 64))
    tk.atomic_add(a, tk.load(X, (0, 0), (64, 64)), (0, 0))  # E:shared-dst


@tk.kernel(num_warps=4)
def k_reduce_register_tile(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (64, 32))
    tk.tma.reduce_add_async(Y, x, (0, 0))  # E:reduce-register


@tk.kernel(num_warps=4)
def k_wrong_coordinates(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.atomic_add(Y, tk.load(X, (0, 0), (64, 64)), (0,))  # E:coords


@pytest.mark.parametrize("kernel,args,marker,message", [
    (k_bf16_destination, (_spec(64, 64, dtype=bf16),) * 2, "bf16-dst",
     "tk.atomic_add adds into an f32 tensor (red.global.add.f32), got bf16 global of rank 2"),
    (k_bf16_tile, (_spec(64, 64, dtype=bf16), _spec(64, 64)), "bf16-tile",
     "tk.atomic_add adds an f32 register tile or vector, got bf16 64x64 tile (vec, block); "
     "convert it with .to(tk.f32)"),
    (k_shared_destination, (_spec(64, 64),) * 2, "shared-dst",
     "tk.atomic_add adds into a tk.gl tensor argument (global memory)"),
    (k_reduce_register_tile, (_spec(64, 64),) * 2, "reduce-register",
     "tk.tma.reduce_add_async: TMA adds a shared tile, got"),
    (k_wrong_coordinates, (_spec(64, 64),) * 2, "coords",
     "tk.atomic_add needs 2 coordinates for a rank-2 tensor"),
])
def test_mistakes_are_errors_at_the_users_line(kernel, args, marker, message):
    at = "tk.tma" if marker == "reduce-register" else "tk.atomic_add"
    error_checks.check_error(compile_error(kernel, *args), marker, at, message, HERE)


@tk.kernel(num_warps=4)
def k_reduce_fp8(Y: tk.gl):
    a = tk.shared_tile(Y.dtype, (64, 128), swizzle=128)
    tk.tma.reduce_add_async(Y, a, (0, 0))  # E:reduce-fp8


def test_tma_reduce_add_refuses_types_ptx_cannot_add():
    e = compile_error(k_reduce_fp8, _spec(64, 128, dtype="f8e4m3"))
    error_checks.check_error(e, "reduce-fp8", "tk.tma", "TMA adds f32, f16 or bf16 tiles", HERE)


# ---------------------------------------------------------------------- GPU

def _torch():
    return pytest.importorskip("torch")


def _rel_err(got, ref) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def _expected(y0, x, at, r, c):
    """y0 with the sum of x's blocks added into the tile at tile coordinates `at`
    (x's blocks zero past their edge, the sum clipped at y0's)."""
    torch = _torch()
    ref = y0.double().clone()
    total = torch.zeros(r, c, dtype=torch.float64, device=x.device)
    total[:x.shape[1], :x.shape[2]] = x.double().sum(0)[:r, :c]
    r0, c0 = at[0] * r, at[1] * c
    nr, nc = max(0, min(r, ref.shape[0] - r0)), max(0, min(c, ref.shape[1] - c0))
    ref[r0:r0 + nr, c0:c0 + nc] += total[:nr, :nc]
    return ref


@pytest.mark.gpu
@pytest.mark.parametrize("layout,scope,r,c", [
    ("vec", "block", 64, 64), ("row", "warpgroup", 64, 64), ("row", "warp", 32, 64),
    ("col", "warp", 16, 32), ("vec", "block", 16, 128),
])
@pytest.mark.parametrize("at", [(0, 0), (1, 1)])
def test_atomic_add_accumulates_blocks_on_the_gpu(layout, scope, r, c, at):
    torch = _torch()
    # X's tiles run past X's edge (masked loads read 0); Y's tile AT past Y's
    # edge (masked adds): shapes that no tile divides.
    x = torch.randn(BLOCKS, r - 3, c - 4, device="cuda")
    y0 = torch.randn(r + r // 2 + 5, c + c // 2 + 4, device="cuda")
    y = y0.clone()
    add_tiles[(BLOCKS,)](x, y, R=r, C=c, LAYOUT=layout, SCOPE=scope, AT=at)
    torch.cuda.synchronize()
    ref = _expected(y0, x, at, r, c)
    assert _rel_err(y, ref) < 1e-6
    untouched = y0.double() == ref        # outside the tile: exactly as initialised
    assert torch.equal(y.double()[untouched], ref[untouched])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["vec", "row", "col"])
def test_atomic_add_of_replicated_vectors_adds_each_element_once_on_the_gpu(layout):
    torch = _torch()
    r, c = 64, 64
    x = torch.randn(BLOCKS, r - 5, c - 8, device="cuda")
    rs0, cs0 = torch.randn(r + 8, device="cuda"), torch.randn(c + 4, device="cuda")
    rs, cs = rs0.clone(), cs0.clone()
    add_vectors[(BLOCKS,)](x, rs, cs, R=r, C=c, LAYOUT=layout, AT=0)
    torch.cuda.synchronize()
    ref_rs, ref_cs = rs0.double(), cs0.double()
    ref_rs = ref_rs.clone()
    ref_rs[:r - 5] += x.double().sum((0, 2))
    ref_cs = ref_cs.clone()
    ref_cs[:c - 8] += x.double().sum((0, 1))
    assert _rel_err(rs, ref_rs) < 1e-6
    assert _rel_err(cs, ref_cs) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [True, False])
@pytest.mark.parametrize("at", [(0, 0), (1, 1)])
def test_tma_reduce_add_accumulates_blocks_on_the_gpu(threads, at):
    torch = _torch()
    r, c = 64, 32
    x = torch.randn(BLOCKS, r - 3, c - 4, device="cuda")
    y0 = torch.randn(r + 36, c + 20, device="cuda")
    y = y0.clone()
    tma_add[(BLOCKS,)](x, y, R=r, C=c, THREADS=threads, AT=at)
    torch.cuda.synchronize()
    ref = _expected(y0, x, at, r, c)
    assert _rel_err(y, ref) < 1e-6
    untouched = y0.double() == ref
    assert torch.equal(y.double()[untouched], ref[untouched])


@pytest.mark.gpu
def test_tma_reduce_add_of_bf16_on_the_gpu():
    torch = _torch()
    r, c = 64, 64
    x = torch.randn(BLOCKS, r, c - 8, device="cuda").to(torch.bfloat16)
    y0 = torch.randn(r + 8, c, device="cuda").to(torch.bfloat16)
    y = y0.clone()
    tma_add[(BLOCKS,)](x, y, R=r, C=c, THREADS=False, AT=(0, 0))
    torch.cuda.synchronize()
    ref = _expected(y0, x, (0, 0), r, c)
    assert _rel_err(y, ref) < 2e-2      # bf16: each of the 8 adds rounds to 8 bits


@tk.kernel(num_warps=4)
def store_between_grouped_reductions(X: tk.gl[f32], A: tk.gl[f32], M: tk.gl[f32],
                                     Y: tk.gl[f32], SCOPE: tk.constexpr):
    """Two reductions of one tile share one exchange (its barrier at the
    first): a shared store between them is not ordered by the second."""
    x = tk.load(X, (0, 0), (64, 64), layout="row", scope=SCOPE)
    t = tk.load(X, (0, 0), (64, 64), layout="row", scope="warpgroup")
    s = tk.shared_tile(bf16, (64, 64))
    a = x.col_sum()
    tk.store(s, t.to(bf16))
    m = x.col_max()
    y = tk.load(s, layout="col", scope="warpgroup")
    tk.store(A, a, (0,))
    tk.store(M, m, (0,))
    tk.store(Y, y.to(f32), (0, 0))


@pytest.mark.parametrize("scope", ["warpgroup", "block"])
def test_a_reduction_that_joins_an_earlier_exchange_orders_nothing(scope):
    """The interpreter places a group's barrier where the GPU does (at its
    first reduction), so the race the GPU has is reported."""
    torch = pytest.importorskip("torch")
    from tk_mlir.interpreter import InterpretError
    x = torch.randn(64, 64)
    outs = [torch.empty(64), torch.empty(64), torch.empty(64, 64)]
    with pytest.raises(InterpretError, match="data race"):
        store_between_grouped_reductions.interpret[(1,)](x, *outs, SCOPE=scope)
