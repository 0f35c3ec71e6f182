"""Masks: i32 and bool register tiles, row/column indices, comparisons,
logical operators and tk.where, as an attention kernel uses them (a causal
mask, a ragged sequence tail).

Without a GPU: FileCheck of the tk IR (the ops and their types) and of the
lowering (an index is the thread's position plus a register constant, a
comparison a setp, a select a selp, and no shared memory), and every misuse
a CompilationError at the user's line. With a GPU (`-m gpu`): the masks
against torch on every layout, fresh random inputs, poisoned outputs.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import error_checks
import tk_mlir as tk
from tk_mlir import bf16, f32
from error_checks import compile_error


def filecheck(text: str, checks: str, **variables) -> None:
    """filecheck_util.filecheck, imported on use: the GPU machine may lack the
    filecheck package, and this module's GPU tests must still run there."""
    from filecheck_util import filecheck as check
    check(text, checks, **variables)

HERE = Path(__file__).resolve()
F32 = tk.spec((64, 64), "f32")
BF16 = tk.spec((64, 64), "bf16")


def rt(dtype: str, rows: int, cols: int, layout: str, scope: str) -> str:
    return f'!tk.rt<{dtype}, {rows} : i64, {cols} : i64, "{layout}", "{scope}">'


# ---------------------------------------------------------------- kernels

@tk.kernel(num_warps=4)
def causal(X: tk.gl[f32], Y: tk.gl[f32], kv_start: int):
    x = tk.load(X, (0, 0), (64, 64), layout="row", scope="warpgroup")
    keep = x.col_indices() + kv_start <= x.row_indices()
    tk.store(Y, tk.where(keep, x, float("-inf")), (0, 0))


@tk.kernel(num_warps=4)
def logic(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    rows, cols = x.row_indices(), x.col_indices()
    m = (0.0 < x) & ~(cols == 3) | (rows != cols) ^ (x >= 1.0)
    tk.store(Y, tk.where(m, 1.0, 0.0), (0, 0))


@tk.kernel(num_warps=4)
def int_math(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    x = tk.load(X, (0, 0), (16, 64), layout="col", scope="warp")
    d = max(x.col_indices() - x.row_indices(), 0) * 2 + n
    e = min(n - d, 7)
    tk.store(Y, x * 2 + e.to(f32), (0, 0))


@tk.kernel(num_warps=4)
def vector_tail(X: tk.gl[f32], V: tk.gl[f32], n: int):
    x = tk.load(X, (0, 0), (64, 64), layout="row", scope="warpgroup")
    m = x.row_max()
    m = tk.where(m.indices() < n, m, 0.0)
    tk.store(V, m, (0,))


@tk.kernel(num_warps=4)
def bf16_compare(X: tk.gl[bf16], Y: tk.gl[bf16]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, tk.where(x > 0.1, x, tk.zeros((16, 64), bf16)), (0, 0))


@tk.kernel(num_warps=4)
def int_fill(X: tk.gl[f32], Y: tk.gl[f32], s: float):
    x = tk.load(X, (0, 0), (16, 64))
    k = tk.full((16, 64), 7, "i32")
    tk.store(Y, tk.where(x.col_indices() < k, s, 2), (0, 0))


def stages(kernel, *args, **kwargs) -> dict[str, str]:
    return kernel.compile(*args, **kwargs).stages


# ------------------------------------------------------------- the tk IR

def test_causal_mask_in_tk_ir():
    row_f32, row_i32 = rt("f32", 64, 64, "row", "warpgroup"), rt("i32", 64, 64, "row", "warpgroup")
    filecheck(stages(causal, F32, F32, 0)["tk"], """
        CHECK: [[X:%[0-9]+]] = "tk.load"
        CHECK: [[C:%[0-9]+]] = "tk.tile_index"([[X]]) {axis = 1 : i64} : ([[F]]) -> [[I]]
        CHECK: [[C2:%[0-9]+]] = "tk.add"([[C]], %arg2) : ([[I]], i32) -> [[I]]
        CHECK: [[R:%[0-9]+]] = "tk.tile_index"([[X]]) {axis = 0 : i64} : ([[F]]) -> [[I]]
        CHECK: [[M:%[0-9]+]] = "tk.cmp"([[C2]], [[R]]) {predicate = "le"} : ([[I]], [[I]]) -> [[B]]
        CHECK: [[INF:%.+]] = arith.constant 0xFF800000 : f32
        CHECK: "tk.select"([[M]], [[X]], [[INF]]) : ([[B]], [[F]], f32) -> [[F]]
    """, F=row_f32, I=row_i32, B=rt("i1", 64, 64, "row", "warpgroup"))


def test_logical_operators_and_scalar_comparisons_in_tk_ir():
    vec = lambda dtype: rt(dtype, 16, 64, "vec", "block")   # noqa: E731
    filecheck(stages(logic, F32, F32)["tk"], """
        CHECK: "tk.cmp"(%0, %{{.*}}) {predicate = "gt"} : ([[F]], f32) -> [[B]]
        CHECK: "tk.cmp"(%{{.*}}, %{{.*}}) {predicate = "eq"} : ([[I]], i32) -> [[B]]
        CHECK: %true = arith.constant true
        CHECK: "tk.xor"(%{{.*}}, %true) : ([[B]], i1) -> [[B]]
        CHECK: "tk.and"
        CHECK: "tk.cmp"(%{{.*}}, %{{.*}}) {predicate = "ne"} : ([[I]], [[I]]) -> [[B]]
        CHECK: "tk.cmp"(%0, %{{.*}}) {predicate = "ge"} : ([[F]], f32) -> [[B]]
        CHECK: "tk.xor"(%{{.*}}, %{{.*}}) : ([[B]], [[B]]) -> [[B]]
        CHECK: "tk.or"
        CHECK: "tk.select"(%{{.*}}, %{{.*}}, %{{.*}}) : ([[B]], f32, f32) -> [[F]]
    """, F=vec("f32"), I=vec("i32"), B=vec("i1"))


def test_i32_tiles_stay_integer():
    col = lambda dtype: rt(dtype, 16, 64, "col", "warp")   # noqa: E731
    text = stages(int_math, F32, F32, 3)
    filecheck(text["tk"], """
        CHECK: "tk.sub"(%{{.*}}, %{{.*}}) : ([[I]], [[I]]) -> [[I]]
        CHECK: %c0_i32{{.*}} = arith.constant 0 : i32
        CHECK: "tk.max"(%{{.*}}, %c0_i32{{.*}}) : ([[I]], i32) -> [[I]]
        CHECK: "tk.mul"(%{{.*}}, %c2_i32) : ([[I]], i32) -> [[I]]
        CHECK: "tk.add"(%{{.*}}, %arg2) : ([[I]], i32) -> [[I]]
        COM: n - d is d * -1 + n (a run-time n cannot be filled into a tile)
        CHECK: "tk.mul"(%{{.*}}, %c-1_i32) : ([[I]], i32) -> [[I]]
        CHECK: "tk.add"(%{{.*}}, %arg2) : ([[I]], i32) -> [[I]]
        CHECK: "tk.min"(%{{.*}}, %c7_i32) : ([[I]], i32) -> [[I]]
        COM: a float tile with an int scalar stays float
        CHECK: "tk.mul"(%0, %{{.*}}) : ([[F]], f32) -> [[F]]
        CHECK: "tk.cvt"(%{{.*}}) : ([[I]]) -> [[F]]
    """, I=col("i32"), F=col("f32"))
    lowered = text["tk-to-gpu"]
    for op in ("arith.subi", "arith.maxsi", "arith.muli", "arith.addi", "arith.minsi",
               "arith.sitofp"):
        assert op in lowered, op
    assert not re.search(r"arith\.(addf|maximumf|minimumf).*: i32", lowered)


@tk.kernel(num_warps=4)
def int_reductions(X: tk.gl[f32], FIRST: tk.gl[tk.i32], LAST: tk.gl[f32], COUNT: tk.gl[f32],
                   WRAP: tk.gl[f32]):
    x = tk.load(X, (0, 0), (64, 64))
    cols = x.col_indices()
    first = tk.where(x.sub_row(x.row_max()) == 0.0, cols, 1 << 20).row_min()     # argmax
    tk.store(FIRST, first, (0,))
    tk.store(LAST, tk.where(x > 0.0, cols, -1).row_max().to(f32), (0,))
    tk.store(COUNT, (x > 0.0).to(tk.i32).col_sum().to(f32), (0,))      # across the warps
    big = cols * 0 + (1 << 26) + x.row_indices()           # 64 rows: past 2**31, wrapping
    tk.store(WRAP, big.col_sum().to(f32), (0,))


def _check_int_reductions(launch, device):
    import torch
    x = torch.randn(64, 64, device=device)
    last, count, wrap = (torch.full((64,), float("nan"), device=device) for _ in range(3))
    first = torch.full((64,), -7, dtype=torch.int32, device=device)
    launch(x, first, last, count, wrap)
    x, first, last, count, wrap = (t.cpu() for t in (x, first, last, count, wrap))
    assert torch.equal(first.long(), x.argmax(1))
    positive = torch.where(x > 0, torch.arange(64), -1)
    assert torch.equal(last.long(), positive.max(1).values)
    assert torch.equal(count, (x > 0).sum(0).float())
    total = 64 * (1 << 26) + sum(range(64))                # 2**32 + 2016: wraps to 2016
    assert total > 2**31 and torch.equal(wrap, torch.full((64,), float(total - 2**32)))


def test_i32_reductions_stay_integer_and_wrap_as_their_adds(interpret):
    _check_int_reductions(int_reductions.interpret[(1,)], "cpu")
    specs = (F32, tk.spec((64,), "i32"), *(tk.spec((64,), "f32"),) * 3)
    lowered = stages(int_reductions, *specs)["tk-to-gpu"]
    for op in ("arith.minsi", "arith.maxsi", "arith.addi"):
        assert op in lowered, op
    assert "shfl.sync" in int_reductions.compile(*specs).asm["ptx"]


def test_int_fill_and_where_between_run_time_and_compile_time_numbers():
    vec = lambda dtype: rt(dtype, 16, 64, "vec", "block")   # noqa: E731
    text = stages(int_fill, F32, F32, 1.5)
    filecheck(text["tk"], """
        CHECK: "tk.fill"() {value = 7 : i64} : () -> [[I]]
        CHECK: "tk.cmp"(%{{.*}}, %{{.*}}) {predicate = "lt"} : ([[I]], [[I]]) -> [[B]]
        CHECK: [[TWO:%.+]] = arith.constant 2.000000e+00 : f32
        CHECK: "tk.select"(%{{.*}}, %arg2, [[TWO]]) : ([[B]], f32, f32) -> [[F]]
    """, I=vec("i32"), B=vec("i1"), F=vec("f32"))
    filecheck(text["tk-to-gpu"], "CHECK: arith.constant 7 : i32")


def test_vector_indices_take_the_vectors_layout():
    text = stages(vector_tail, F32, tk.spec((64,), "f32"), 64)["tk-assign-layouts"]
    m = re.search(r'"tk.reduce".*-> (!tk.rv<f32, 64 : i64, "([^"]+)", "warpgroup">)', text)
    assert m, text
    layout = m.group(2)
    filecheck(text, """
        CHECK: "tk.tile_index"(%{{.*}}) {axis = 0 : i64} : ([[V]]) -> !tk.rv<i32, 64 : i64, "[[L]]", "warpgroup">
        CHECK: "tk.cmp"{{.*}} -> !tk.rv<i1, 64 : i64, "[[L]]", "warpgroup">
        CHECK: "tk.select"{{.*}} -> [[V]]
    """, V=m.group(1), L=layout)


# ------------------------------------------------------------ lowering

def test_indices_are_the_thread_position_plus_a_register_constant():
    text = stages(causal, F32, F32, 0)["tk-to-gpu"]
    # 64x64 over a warpgroup: 32 registers per thread, one compare and one select each.
    filecheck(text, "CHECK-COUNT-32: arith.cmpi sle, %{{.*}}, %{{.*}} : i32\n"
                    "CHECK-NOT: arith.cmpi sle")
    filecheck(text, "CHECK-COUNT-32: arith.select %{{.*}}, %{{.*}}, %{{.*}} : f32\n"
                    "CHECK-NOT: arith.select")
    # The row layout's register bits: rows +8 (bit 1) and columns +8 (bit 2).
    filecheck(text, """
        CHECK: gpu.thread_id x
        CHECK: arith.constant 8 : i32
        CHECK: arith.addi
    """)


def test_masks_become_setp_and_selp_without_shared_memory():
    ptx = causal.compile(F32, F32, 0).stages["ptx"]
    assert re.search(r"\bsetp\.\w+\.s32\b", ptx), ptx
    assert re.search(r"\bselp\.(f32|b32)\b", ptx), ptx
    assert ".shared" not in ptx and "bar.sync" not in ptx


def test_float_comparisons_are_made_in_f32():
    text = stages(bf16_compare, BF16, BF16)["tk-to-gpu"]
    filecheck(text, """
        CHECK: [[X:%[0-9]+]] = arith.extf %{{.*}} : bf16 to f32
        CHECK: arith.cmpf ogt, [[X]], %{{.*}} : f32
    """)
    assert "arith.select" in text and ": bf16" in text
    assert re.search(r"\bsetp\.gt\.f32\b", stages(bf16_compare, BF16, BF16)["ptx"])


@tk.kernel(num_warps=4)
def float_ne(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, tk.where(x != 0.5, x, 0.0), (0, 0))


def test_not_equal_is_unordered_like_python():
    """NaN != 0.5 is True in Python: float != is the unordered une; the other
    float compares are ordered."""
    assert "arith.cmpf une" in stages(float_ne, F32, F32)["tk-to-gpu"]
    text = stages(logic, F32, F32)["tk-to-gpu"]
    assert "arith.cmpf ogt" in text and "arith.cmpf oge" in text
    assert "arith.cmpi ne" in text and "arith.cmpi eq" in text


@tk.kernel(num_warps=4)
def bool_fill(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, tk.where(tk.full((16, 64), 2, "bool"), x, 1.0), (0, 0))


@tk.kernel(num_warps=4)
def fractional_i32_fill(X: tk.gl[f32]):
    i = tk.full((16, 64), 1.5, "i32")  # E:i32-fill


def test_fills_of_masks_and_indices_keep_python_values():
    assert "arith.constant true" in stages(bool_fill, F32, F32)["tk-to-gpu"]   # 2 is True
    error_checks.check_error(compile_error(fractional_i32_fill, F32), "i32-fill", "tk.full",
                            "an i32 tile's fill value must be an integer that fits in i32, "
                            "got 1.5", HERE)


# --------------------------------------------------------------- errors

@tk.kernel(num_warps=4)
def k_bool_arith(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    m = x > 0.0
    y = m + 1  # E:bool-arith


@tk.kernel(num_warps=4)
def k_float_and(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = x & x  # E:float-and


@tk.kernel(num_warps=4)
def k_float_invert(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = ~x  # E:float-invert


@tk.kernel(num_warps=4)
def k_float_mask(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = tk.where(x, x, 0.0)  # E:float-mask


@tk.kernel(num_warps=4)
def k_scalar_mask(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = tk.where(tk.block_id(0) > 0, x, 0.0)  # E:scalar-mask


@tk.kernel(num_warps=4)
def k_where_shape(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    z = tk.load(X, (0, 0), (32, 64))
    y = tk.where(x > 0.0, z, 0.0)  # E:where-shape


@tk.kernel(num_warps=4)
def k_where_layout(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    z = tk.load(X, (0, 0), (16, 64), layout="row", scope="warp")
    y = tk.where(x > 0.0, z, 0.0)  # E:where-layout


@tk.kernel(num_warps=4)
def k_where_dtypes(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = tk.where(x > 0.0, x, x.to(bf16))  # E:where-dtypes


@tk.kernel(num_warps=4)
def k_compare_shapes(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    z = tk.load(X, (0, 0), (32, 64))
    y = x < z  # E:compare-shapes


@tk.kernel(num_warps=4)
def k_order_masks(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = (x > 0.0) < (x < 1.0)  # E:order-masks


@tk.kernel(num_warps=4)
def k_int_float_scalar(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = x.col_indices() + 0.5  # E:int-float-scalar


@tk.kernel(num_warps=4)
def k_int_div(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = x.col_indices() / x.row_indices()  # E:int-div


@tk.kernel(num_warps=4)
def k_exp_int(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = x.row_indices().exp()  # E:exp-int


@tk.kernel(num_warps=4)
def k_reduce_mask(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = (x > 0.0).row_sum()  # E:reduce-mask


@tk.kernel(num_warps=4)
def k_store_indices(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(X, x.row_indices(), (0, 0))  # E:store-indices


@tk.kernel(num_warps=4)
def k_load_bool(X: tk.gl[f32]):
    m = tk.load(X, (0, 0), (16, 64), dtype="bool")  # E:load-bool


@tk.kernel(num_warps=4)
def k_shared_i32(X: tk.gl[f32]):
    s = tk.shared_tile("i32", (16, 64))  # E:shared-i32


@tk.kernel(num_warps=4)
def k_store_mask_to_shared(X: tk.gl[f32]):
    s = tk.shared_tile(f32, (16, 64))
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(s, x > 0.0)  # E:mask-to-shared


@tk.kernel(num_warps=4)
def k_and_masks(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = x > 0.0 and x < 1.0  # E:and-masks


@tk.kernel(num_warps=4)
def k_not_mask(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = not (x > 0.0)  # E:not-mask


REGISTERS_ONLY = "tiles live in registers only (indices and masks)"


@pytest.mark.parametrize("kernel,marker,at,message", [
    (k_bool_arith, "bool-arith", "m + 1", "add is not defined on bool 16x64 tile (vec, block) "
                                          "(a mask); combine masks with & | ^ ~"),
    (k_float_and, "float-and", "x & x", "and (the operator &) is defined on bool tiles (masks) "
                                        "and i32 tiles, not on f32 16x64 tile"),
    (k_float_invert, "float-invert", "~x", "~ is defined on bool tiles (masks) and i32 tiles, "
                                           "not on f32 tiles"),
    (k_float_mask, "float-mask", "tk.where", "tk.where: the mask must be a bool tile or vector "
                                             "(e.g. from a comparison), got f32 16x64 tile"),
    (k_scalar_mask, "scalar-mask", "tk.where", "tk.where: the mask must be a bool tile or "
                                               "vector"),
    (k_where_shape, "where-shape", "tk.where", "tk.where: a (f32 32x64 tile (vec, block)) does "
                                               "not match the mask (bool 16x64 tile (vec, block))"),
    (k_where_layout, "where-layout", "tk.where", "tk.where: a (f32 16x64 tile (row, warp)) "
                                                 "does not match the mask"),
    (k_where_dtypes, "where-dtypes", "tk.where", "tk.where: b is bf16, the result f32"),
    (k_compare_shapes, "compare-shapes", "x < z", "comparison: operands differ: f32 16x64 tile "
                                                  "(vec, block) and f32 32x64 tile (vec, block)"),
    (k_order_masks, "order-masks", "(x > 0.0) <", "(a mask) compares with == and != only"),
    (k_int_float_scalar, "int-float-scalar", "x.col_indices() +",
     "add: i32 16x64 tile (vec, block) cannot be combined with a scalar of type f32 (it takes "
     "i32 scalars); convert the tile with .to(tk.f32)"),
    (k_int_div, "int-div", "x.col_indices() /", "div is not defined on i32 16x64 tile"),
    (k_exp_int, "exp-int", "x.row_indices().exp", "exp is defined on float tiles, not on i32 "
                                                  "16x64 tile (vec, block); convert with .to"),
    (k_reduce_mask, "reduce-mask", "(x > 0.0).row_sum", "sum reduction is defined on float "
                                                        "and i32 tiles, not on bool 16x64 tile"),
    (k_store_indices, "store-indices", "tk.store", "tk.store: i32 " + REGISTERS_ONLY),
    (k_load_bool, "load-bool", "tk.load", "tk.load: bool " + REGISTERS_ONLY),
    (k_shared_i32, "shared-i32", "tk.shared_tile", "i32 16x64 shared tile: i32 " + REGISTERS_ONLY),
    (k_store_mask_to_shared, "mask-to-shared", "tk.store", "tk.store: bool " + REGISTERS_ONLY),
    (k_and_masks, "and-masks", "x > 0.0 and", "combine masks elementwise with & and |"),
    (k_not_mask, "not-mask", "not", "the elementwise not of a mask is ~mask"),
])
def test_mask_mistake_is_a_compile_error_at_its_line(kernel, marker, at, message):
    error_checks.check_error(compile_error(kernel, F32), marker, at, message, HERE)


def test_int_tensors_are_arguments_for_counters_and_scalars_only():
    """An i32 tensor argument holds counters (tk.store_partial), scalars
    (tk.load(X, idx)) or vectors, never tiles: loading a tile is refused at its line;
    bool tensors stay refused."""
    assert tk.spec((4, 8), "i32").dtype == "i32"
    with pytest.raises(tk.ArgumentError, match="the supported dtypes are"):
        tk.spec((4, 8), "bool")

    @tk.kernel(num_warps=4)
    def load_counters(F: tk.gl["i32"]):
        x = tk.load(F, (0, 0), (16, 64))
    with pytest.raises(tk.CompilationError, match=re.escape(
            "i32 global of rank 2: an i32 tensor holds counters (tk.store_partial's counters=), "
            "scalars (tk.load(X, idx) reads one) or vectors (tk.load(X, idx, (n,)) and "
            "tk.store), not tiles")) as info:
        load_counters.compile(tk.spec((16, 64), "i32"))
    assert "x = tk.load(F, (0, 0), (16, 64))" in str(info.value)


# ------------------------------------------------------------------ GPU

@tk.kernel(num_warps=4)
def gpu_causal(X: tk.gl[f32], Y: tk.gl[f32], ROWS: tk.gl[f32], COLS: tk.gl[f32], kv_start: int,
               R: tk.constexpr, C: tk.constexpr, LAYOUT: tk.constexpr, SCOPE: tk.constexpr):
    x = tk.load(X, (0, 0), (R, C), layout=LAYOUT, scope=SCOPE)
    rows, cols = x.row_indices(), x.col_indices()
    tk.store(ROWS, rows.to(f32), (0, 0))
    tk.store(COLS, cols.to(f32), (0, 0))
    tk.store(Y, tk.where(cols + kv_start <= rows, x, float("-inf")), (0, 0))


GPU_CASES = [  # layout, scope, R, C (what tests/test_tiles_gpu.py runs at 4 warps)
    ("row", "warpgroup", 64, 64), ("row", "warpgroup", 64, 32), ("row", "warp", 16, 16),
    ("row", "warp", 32, 64), ("col", "warp", 16, 32), ("vec", "block", 16, 64),
    ("vec", "warp", 8, 64), ("row", "block", 64, 16),
]


@pytest.mark.gpu
def test_i32_reductions_on_the_gpu():
    _check_int_reductions(int_reductions[(1,)], "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("layout,scope,R,C", GPU_CASES)
@pytest.mark.parametrize("kv_start", [0, -5])
def test_causal_mask_on_the_gpu(layout, scope, R, C, kv_start):
    torch = pytest.importorskip("torch")
    x = torch.randn(R, C, device="cuda")
    y, rows, cols = (torch.full_like(x, float("nan")) for _ in range(3))
    gpu_causal[(1,)](x, y, rows, cols, kv_start, R=R, C=C, LAYOUT=layout, SCOPE=scope)
    torch.cuda.synchronize()
    r = torch.arange(R, device="cuda")[:, None].expand(R, C)
    c = torch.arange(C, device="cuda")[None, :].expand(R, C)
    assert torch.equal(rows, r.float()) and torch.equal(cols, c.float())
    ref = torch.where(c + kv_start <= r, x, torch.full_like(x, float("-inf")))
    assert torch.equal(y, ref)


@tk.kernel(num_warps=4)
def gpu_tail(X: tk.gl[f32], Y: tk.gl[f32], M: tk.gl[f32], n_rows: int, n_cols: int,
             R: tk.constexpr, C: tk.constexpr):
    """A ragged tail: rows and columns past (n_rows, n_cols) of the sequence are
    masked, and the row maxima past n_rows read 0."""
    i = tk.block_id(0)
    x = tk.load(X, (i, 0), (R, C), layout="row", scope="warpgroup")
    inside = (x.row_indices() + i * R < n_rows) & (x.col_indices() < n_cols)
    x = tk.where(inside, x, float("-inf"))
    m = x.row_max()
    m = tk.where(m.indices() + i * R < n_rows, m, 0.0)
    tk.store(M, m, (i,))
    tk.store(Y, tk.where(~inside, 0.0, x.sub_row(m)), (i, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows,n_cols", [(128, 64), (100, 50), (70, 1)])
def test_ragged_tail_on_the_gpu(n_rows, n_cols):
    torch = pytest.importorskip("torch")
    R, C = 64, 64
    x = torch.randn(2 * R, C, device="cuda")
    y = torch.full_like(x, float("nan"))
    m = torch.full((2 * R,), float("nan"), device="cuda")
    gpu_tail[(2,)](x, y, m, n_rows, n_cols, R=R, C=C)
    torch.cuda.synchronize()
    r = torch.arange(2 * R, device="cuda")[:, None]
    c = torch.arange(C, device="cuda")[None, :]
    inside = (r < n_rows) & (c < n_cols)
    xm = torch.where(inside, x, torch.full_like(x, float("-inf")))
    ref_m = torch.where(r[:, 0] < n_rows, xm.max(1).values, torch.zeros_like(m))
    assert torch.equal(m, ref_m)
    ref_y = torch.where(inside, xm - ref_m[:, None], torch.zeros_like(x))
    assert torch.equal(y, ref_y)


@pytest.mark.parametrize("layout,scope,R,C", GPU_CASES)
def test_the_gpu_kernels_compile(layout, scope, R, C):
    """Without a GPU, at least the kernels the GPU tests run compile to PTX."""
    x = tk.spec((R, C), "f32")
    ptx = gpu_causal.compile(x, x, x, x, 0, R=R, C=C, LAYOUT=layout, SCOPE=scope).stages["ptx"]
    assert "selp" in ptx and ".shared" not in ptx
    if (layout, scope) == ("row", "warpgroup") and (R, C) == (64, 64):
        x2 = tk.spec((128, 64), "f32")
        assert gpu_tail.compile(x2, x2, tk.spec((128,), "f32"), 1, 1, R=64, C=64).stages["ptx"]
        b = tk.spec((16, 64), "bf16")
        assert gpu_bf16_threshold.compile(b, b, 0.5).stages["ptx"]


@tk.kernel(num_warps=4)
def gpu_bf16_threshold(X: tk.gl[bf16], Y: tk.gl[bf16], t: float):
    x = tk.load(X, (0, 0), (16, 64))
    keep = ((x > t) | (x == 0.25) | (x != x)) & (x != 0.5)   # NaN != NaN: kept
    tk.store(Y, tk.where(keep, x, 1.0), (0, 0))


@pytest.mark.gpu
def test_bf16_comparisons_with_a_scalar_on_the_gpu():
    torch = pytest.importorskip("torch")
    x = (torch.rand(16, 64, device="cuda") - 0.5).to(torch.bfloat16)
    x[0, :4] = torch.tensor([0.25, 0.5, 0.1, float("nan")])
    y = torch.full_like(x, float("nan"))
    gpu_bf16_threshold[(1,)](x, y, 0.1)
    torch.cuda.synchronize()
    xf = x.float()              # compared in f32, as Python compares the numbers
    keep = ((xf > 0.1) | (xf == 0.25) | (xf != xf)) & (xf != 0.5)
    ref = torch.where(keep, x, torch.ones_like(x))
    assert torch.equal(y.isnan(), ref.isnan())
    assert torch.equal(y.nan_to_num(7.0), ref.nan_to_num(7.0))
