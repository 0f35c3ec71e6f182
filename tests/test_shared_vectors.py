"""Shared vectors (!tk.sv): tk.shared_vector(s), TMA loads of a vector box,
tk.load into a register vector whose layout follows its uses, tk.store of a
register vector (each element written once). The GPU tests compare with torch."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import error_checks
import tk_mlir as tk
from tk_mlir import bf16, f32
from tk_mlir.dialects import tk as tk_dialect
from error_checks import compile_error

HERE = Path(__file__).resolve()
FENCE = "fence.proxy.async.shared::cta;"


@tk.kernel(num_warps=4)
def sub_col_from_tma(X: tk.gl[f32], Z: tk.gl[f32], Y: tk.gl[f32], N: tk.constexpr):
    """Y[b, :, j-th N columns] = Z[...] - X[b, j-th N]: one vector per (b, j),
    brought in by TMA, read by the warpgroup as a column vector of a row tile."""
    b, j = tk.block_id(0), tk.block_id(1)
    sv = tk.shared_vector(f32, N)
    s = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(s, sv)
        tk.tma.load_async(sv, X, (b, j), s)
    tk.wait(s, 0)
    v = tk.load(sv, scope="warpgroup")
    t = tk.load(Z, (b, j), (64, N), layout="row", scope="warpgroup")
    tk.store(Y, t.sub_col(v), (b, j))


@tk.kernel(num_warps=4)
def row_sums_through_shared(Z: tk.gl[f32], Y: tk.gl[f32]):
    """Y[b] = Z[b].sum(-1): written from the row layout's slice (replicated
    lanes), read back in the default vector layout."""
    b = tk.block_id(0)
    sv = tk.shared_vector(f32, 64)
    t = tk.load(Z, (b, 0), (64, 64), layout="row", scope="warpgroup")
    tk.store(sv, t.row_sum())
    tk.barrier()
    tk.store(Y, tk.load(sv), (b, 0))


@tk.kernel(num_warps=4)
def ring_of_vectors(X: tk.gl[f32], Y: tk.gl[f32], STEPS: tk.constexpr):
    """An array of shared vectors indexed at run time, each a TMA destination."""
    svs = tk.shared_vectors(f32, 64, 2)
    sems = tk.semaphores(2)
    acc = tk.zeros((64,), f32)
    for i in range(STEPS):
        if tk.elect_leader("warpgroup"):
            tk.tma.expect(sems[i % 2], svs[i % 2])
            tk.tma.load_async(svs[i % 2], X, (0, i), sems[i % 2])
        tk.wait(sems[i % 2], (i // 2) % 2)
        acc = acc + tk.load(svs[i % 2])
        tk.barrier()
    tk.store(Y, acc, (0,))


def _sub_col(n=64):
    return sub_col_from_tma.compile(tk.spec((4, 2 * n), f32), tk.spec((256, 2 * n), f32),
                                    tk.spec((256, 2 * n), f32), N=n)


# ------------------------------------------------------------------ tk IR

def test_tk_ir_of_the_shared_vector_ops():
    text = _sub_col().asm["tk"]
    assert re.search(r'"tk\.alloc_sv"\(\) : \(\) -> !tk\.sv<f32, 64', text)
    assert re.search(r'"tk\.tma_load"\(%\w+, %arg0, %\w+, %\w+, %\w+\) : \(!tk\.sv<f32, 64', text)
    assert re.search(r'"tk\.load"\(%\w+\) .*: \(!tk\.sv<f32, 64 : i64>\) -> '
                     r'!tk\.rv<f32, 64 : i64, "auto", "warpgroup">', text)
    assert '"tk.expect_bytes"(%' in text and "bytes = 256" in text


def test_the_layout_pass_gives_the_vector_the_tiles_column_slice():
    """tk.load(sv) starts "auto"; t.sub_col(v) on a row-layout tile fixes it."""
    text = _sub_col().asm["tk-assign-layouts"]
    (layout,) = set(re.findall(r'-> !tk\.rv<f32, 64 : i64, "([^"]+)", "warpgroup">', text))
    assert layout != "auto"
    from tk_mlir.dialects import layout as layouts
    assert layout == layouts.tile_layout("row", 64, 64, 4).slice(1).encode()


def test_ptx_has_the_tma_vector_load_and_shared_loads():
    compiled = _sub_col()
    ptx = compiled.asm["ptx"]
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier", ptx)
    assert re.search(r"ld\.shared\.v2\.(b32|f32)", ptx)      # the column pairs of the row layout
    assert FENCE not in ptx                 # TMA -> mbarrier -> ld.shared needs no proxy fence
    # One tensor map: a box of 1 row of N elements, no swizzle.
    assert compiled.tensor_maps == [(0, 1, 64, 0, "f32")]


@tk.kernel(num_warps=4)
def k_vector_at(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 32)
    s = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(s, sv)
        tk.tma.load_async(sv, X, (1, 2, 3), s)    # X[1, 2, 96:128]
    tk.wait(s, 0)


def test_tma_vector_coordinates_count_vectors_in_the_last_dim():
    """Element coordinates innermost first: the last counts vectors (3 * 32),
    the outer ones elements."""
    text = k_vector_at.compile(tk.spec((2, 4, 256), f32)).asm["cse"]
    constants = dict(re.findall(r"(%\w+) = llvm\.mlir\.constant\((-?\d+) : i32\)", text))
    (box,) = re.findall(r"cp\.async\.bulk\.tensor\.shared\.cluster\.global .*box\[([^\]]*)\]",
                        text)
    assert [int(constants[v.strip()]) for v in box.split(",")] == [3 * 32, 2, 1]


def test_rank_one_tensor_and_an_array_of_vectors():
    compiled = ring_of_vectors.compile(tk.spec((1, 256), f32), tk.spec((64,), f32), STEPS=4)
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx
    assert compiled.tensor_maps == [(0, 1, 64, 0, "f32")]
    # Two 256-byte vectors, each 128-aligned, then the semaphores.
    assert compiled.smem_bytes >= 2 * 256 + 2 * 8


def test_store_to_a_shared_vector_writes_each_element_once():
    compiled = row_sums_through_shared.compile(tk.spec((256, 64), f32), tk.spec((4, 64), f32))
    ptx = compiled.asm["ptx"]
    assert re.search(r"st\.shared(\.v\d)?\.(b32|f32)", ptx)
    assert re.search(r"ld\.shared(\.v\d)?\.(b32|f32)", ptx)
    # The row layout's column-slice replicates over lane bits 0 and 1: the stores
    # are predicated on the first replica (lane & 3 == 0).
    tkgpu = compiled.asm["tk-to-gpu"]
    assert re.search(r"arith\.andi %\w+, %c3_i32", tkgpu)
    assert FENCE not in ptx                 # no async-proxy reader of the vector


def test_shared_vectors_are_shared_accesses_for_the_fence_pass():
    """passes/fences.py sees accesses to shared vectors through the ops' traits."""
    text = row_sums_through_shared.compile(tk.spec((256, 64), f32),
                                           tk.spec((4, 64), f32)).asm["tk"]
    from mlir import ir
    from tk_mlir.dialects import types as T
    with ir.Context() as ctx:
        tk_dialect.load(ctx)
        module = ir.Module.parse(text)
        kinds = []
        def visit(op):
            kinds.extend((k, p, type(T.parse(v.type)).__name__)
                         for k, p, v in tk_dialect.shared_accesses(op))
            return ir.WalkResult.ADVANCE
        module.operation.walk(visit)
    assert ("write", tk_dialect.GENERIC, "SV") in kinds
    assert ("read", tk_dialect.GENERIC, "SV") in kinds


# ------------------------------------------------------------------ errors

@tk.kernel(num_warps=4)
def k_tma_short(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 2)
    s = tk.semaphore()
    tk.tma.load_async(sv, X, (0, 0), s)  # E:sv-short


@tk.kernel(num_warps=4)
def k_tma_long(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 512)
    s = tk.semaphore()
    tk.tma.load_async(sv, X, (0, 0), s)  # E:sv-long


@tk.kernel(num_warps=4)
def k_not_power_of_two(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 40)  # E:sv-pow2


@tk.kernel(num_warps=4)
def k_bad_length(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 0)  # E:sv-zero


@tk.kernel(num_warps=4)
def k_tma_dtype(X: tk.gl[f32]):
    sv = tk.shared_vector(bf16, 64)
    s = tk.semaphore()
    tk.tma.load_async(sv, X, (0, 0), s)  # E:sv-dtype


@tk.kernel(num_warps=4)
def k_tma_coords(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 64)
    s = tk.semaphore()
    tk.tma.load_async(sv, X, (0,), s)  # E:sv-coords


@tk.kernel(num_warps=4)
def k_sv_as_tile(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 64)
    tk.tma.store_async(X, sv, (0, 0))  # E:sv-as-tile


@tk.kernel(num_warps=4)
def k_sv_in_mma(X: tk.gl[f32]):
    sv = tk.shared_vector(bf16, 64)
    acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
    acc = tk.mma_ABt(acc, sv, sv)  # E:sv-mma


@tk.kernel(num_warps=4)
def k_store_tile_to_sv(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 64)
    tk.store(sv, tk.zeros((64, 64), f32))  # E:sv-store-tile


@tk.kernel(num_warps=4)
def k_store_wrong_length(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 64)
    tk.store(sv, tk.zeros((32,), f32))  # E:sv-store-len


@tk.kernel(num_warps=4)
def k_store_wrong_dtype(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 64)
    tk.store(sv, tk.zeros((64,), bf16))  # E:sv-store-dtype


@tk.kernel(num_warps=4)
def k_load_with_idx(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 64)
    v = tk.load(sv, (0,))  # E:sv-load-idx


@tk.kernel(num_warps=4)
def k_whole_array(X: tk.gl[f32]):
    svs = tk.shared_vectors(f32, 64, 2)
    v = tk.load(svs)  # E:sv-whole-array


@tk.kernel(num_warps=4)
def k_index_single(X: tk.gl[f32]):
    sv = tk.shared_vector(f32, 64)
    v = tk.load(sv[0])  # E:sv-not-array


@tk.kernel(num_warps=4)
def k_expect_not_shared(X: tk.gl[f32]):
    s = tk.semaphore()
    tk.tma.expect(s, tk.zeros((64,), f32))  # E:sv-expect


@pytest.mark.parametrize("kernel,marker,at,message", [
    (k_tma_short, "sv-short", "tk.tma.load_async", "a TMA box of a shared vector is a multiple "
                                                   "of 16 bytes and at most 256 elements"),
    (k_tma_long, "sv-long", "tk.tma.load_async", "f32 shared vector of 512 has 2048 bytes"),
    (k_not_power_of_two, "sv-pow2", "tk.shared_vector", "a shared vector's length (it is read "
                                                        "as a register vector) must be a power "
                                                        "of two or a multiple of 16, got 40"),
    (k_bad_length, "sv-zero", "tk.shared_vector", "a shared vector's length must be a positive "
                                                  "compile-time int, got 0"),
    (k_tma_dtype, "sv-dtype", "tk.tma.load_async", "bf16 shared vector of 64 and f32 global "
                                                   "of rank 2 differ in dtype"),
    (k_tma_coords, "sv-coords", "tk.tma.load_async", "one coordinate per dim of the tensor (2), got 1"),
    (k_sv_as_tile, "sv-as-tile", "tk.tma.store_async", "expected a shared tile, got "
                                                       "<SharedVector"),
    (k_sv_in_mma, "sv-mma", "tk.mma_ABt", "SharedVector"),
    (k_store_tile_to_sv, "sv-store-tile", "tk.store", "f32 64x64 tile (vec, block) does not "
                                                      "match f32 shared vector of 64"),
    (k_store_wrong_length, "sv-store-len", "tk.store", "f32 vector of 32 (block) does not match"),
    (k_store_wrong_dtype, "sv-store-dtype", "tk.store", "bf16 vector of 64 (block) does not "
                                                        "match f32 shared vector of 64"),
    (k_load_with_idx, "sv-load-idx", "tk.load", "tk.load of a shared vector reads the whole "
                                                "vector"),
    (k_whole_array, "sv-whole-array", "tk.load", "whole array of 2 shared vectors"),
    (k_index_single, "sv-not-array", "sv[0]", "this shared vector is not an array"),
    (k_expect_not_shared, "sv-expect", "tk.tma.expect", "takes the shared tiles and vectors"),
])
def test_mistakes_are_errors_at_the_users_line(kernel, marker, at, message):
    error_checks.check_error(compile_error(kernel, tk.spec((64, 64), f32)), marker, at, message,
                            HERE)


# ------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("n", [32, 64])
def test_tma_vector_broadcast_along_columns_on_the_gpu(n):
    torch = pytest.importorskip("torch")
    B, J = 3, 2
    x = torch.randn(B, J * n, device="cuda")
    z = torch.randn(B * 64, J * n, device="cuda")
    y = torch.full_like(z, float("nan"))
    sub_col_from_tma[(B, J)](x, z, y, N=n)
    torch.cuda.synchronize()
    ref = (z.view(B, 64, J * n) - x[:, None, :]).view(B * 64, J * n)
    assert torch.equal(y, ref), (y - ref).abs().max()


@pytest.mark.gpu
def test_store_then_load_round_trip_on_the_gpu():
    torch = pytest.importorskip("torch")
    B = 5
    z = torch.randn(B * 64, 64, device="cuda")
    y = torch.full((B, 64), float("nan"), device="cuda")
    row_sums_through_shared[(B,)](z, y)
    torch.cuda.synchronize()
    ref = z.view(B, 64, 64).sum(-1)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-4), (y - ref).abs().max()


@pytest.mark.gpu
def test_ring_of_tma_vectors_on_the_gpu():
    torch = pytest.importorskip("torch")
    steps = 4
    x = torch.randn(1, steps * 64, device="cuda")
    y = torch.full((64,), float("nan"), device="cuda")
    ring_of_vectors[(1,)](x, y, STEPS=steps)
    torch.cuda.synchronize()
    ref = x.view(steps, 64).sum(0)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5), (y - ref).abs().max()


def test_tma_of_a_rank_1_tensor_is_refused():
    """The driver refuses rank-1 tensor maps: view the tensor as (1, n)."""
    with pytest.raises(tk.CompilationError, match=r"needs a tensor of rank 2 to 5 \(view a 1-D "
                                                  r"tensor as \(1, n\)\)"):
        ring_of_vectors.compile(tk.spec((256,), f32), tk.spec((64,), f32), STEPS=4)
