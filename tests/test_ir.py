"""FileCheck tests of the tk IR of every op, and of what tk-to-gpu makes of it.

Each op family has a tiny kernel below; constexprs pick the op, so each op
sits on a source line of its own. For each op we check

  * the 'tk' stage: the op, its operand and result types, and that its
    location is the kernel line that wrote it (the line is looked up with
    inspect, so the tests survive edits to this file);
  * the 'tk-to-gpu' stage: what the op became. The lowered ops carry the tk
    op's location, so the checks pin them to it with `loc([[LOC]])`, LOC
    being the #loc alias of that source position in the stage's text.

Tests read `CompiledKernel.stages` rather than `.asm`: `.asm` runs nvdisasm
(about 0.4 s) on first access, and no test here needs SASS.
"""
from __future__ import annotations

import inspect
import re

import pytest
from mlir import ir

import tk_mlir as tk
from tk_mlir import bf16, f32
from tk_mlir.dialects import tk as tk_dialect

from filecheck_util import filecheck

# ---------------------------------------------------------------- kernels
# At module level: the frontend reads their source with inspect.


@tk.kernel(num_warps=8)
def index_kernel(Y: tk.gl[f32], WHICH: tk.constexpr, DIM: tk.constexpr = 0):
    if WHICH == "block_id":
        v = tk.block_id(DIM)
    elif WHICH == "grid_dim":
        v = tk.grid_dim(DIM)
    elif WHICH == "thread_id":
        v = tk.thread_id()
    elif WHICH == "lane_id":
        v = tk.lane_id()
    elif WHICH == "warp_id":
        v = tk.warp_id()
    else:
        v = tk.warpgroup_id()
    tk.store(Y, tk.zeros((16, 64)), (v, 0))


@tk.kernel(num_warps=4)
def gl_dim_kernel(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, x * float(X.shape[1]), (0, 0))


@tk.kernel(num_warps=4)
def static_dim_kernel(X: tk.gl[f32, (None, 64)], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, x * float(X.shape[1]), (0, 0))


@tk.kernel(num_warps=4)
def load_store_kernel(X: tk.gl[bf16], Y: tk.gl[bf16], FILL: tk.constexpr = 0.0,
                      LAYOUT: tk.constexpr = "vec", SCOPE: tk.constexpr = "block"):
    i = tk.block_id(0)
    x = tk.load(X, (i, 0), (16, 64), fill=FILL, layout=LAYOUT, scope=SCOPE)
    tk.store(Y, x, (i, 0))


@tk.kernel(num_warps=4)
def vector_kernel(W: tk.gl[bf16], V: tk.gl[bf16]):
    w = tk.load(W, (0,), (256,))
    tk.store(V, w * 2.0, (0,))


@tk.kernel(num_warps=4)
def vector_copy_kernel(W: tk.gl[bf16], V: tk.gl[bf16]):
    tk.store(V, tk.load(W, (0,), (256,)), (0,))


@tk.kernel(num_warps=4)
def vector_fill_kernel(V: tk.gl[f32]):
    tk.store(V, tk.zeros((64,)), (0,))


@tk.kernel(num_warps=4)
def alloc_kernel(X: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (1, 8))
    b = tk.shared_tile(bf16, (1, 8))
    c = tk.shared_tile(bf16, (8, 64), swizzle=128)
    tk.copy(c, X, (0, 0))


@tk.kernel(num_warps=4)
def shared_kernel(X: tk.gl[bf16], Y: tk.gl[bf16], SWIZZLE: tk.constexpr = 0):
    s = tk.shared_tile(bf16, (32, 64), swizzle=SWIZZLE)
    tk.copy(s, X, (tk.block_id(0), 0))
    x = tk.load(s)
    tk.store(s, x + x)
    tk.copy(Y, s, (tk.block_id(0), 0))


@tk.kernel(num_warps=4)
def fill_kernel(Y: tk.gl[bf16], Z: tk.gl[f32]):
    tk.store(Y, tk.full((16, 64), 2.5, bf16), (0, 0))
    tk.store(Z, tk.zeros((16, 64)), (0, 0))


@tk.kernel(num_warps=4)
def cvt_kernel(X: tk.gl[f32], Y: tk.gl[bf16], Z: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    y = x.to(bf16)
    tk.store(Y, y, (0, 0))
    tk.store(Z, y.to(f32), (0, 0))


@tk.kernel(num_warps=4)
def unary_kernel(X: tk.gl[f32], Y: tk.gl[f32], OP: tk.constexpr):
    x = tk.load(X, (0, 0), (16, 64))
    if OP == "exp":
        y = x.exp()
    elif OP == "exp2":
        y = x.exp2()
    elif OP == "log":
        y = x.log()
    elif OP == "abs":
        y = x.abs()
    elif OP == "neg":
        y = -x
    elif OP == "relu":
        y = x.relu()
    elif OP == "sqrt":
        y = x.sqrt()
    else:
        y = x.rsqrt()
    tk.store(Y, y, (0, 0))


@tk.kernel(num_warps=4)
def unary_bf16_kernel(X: tk.gl[bf16], Y: tk.gl[bf16]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, x.exp(), (0, 0))


@tk.kernel(num_warps=4)
def binary_kernel(A: tk.gl[f32], B: tk.gl[f32], Y: tk.gl[f32], OP: tk.constexpr):
    a = tk.load(A, (0, 0), (16, 64))
    b = tk.load(B, (0, 0), (16, 64))
    if OP == "add":
        y = a + b
    elif OP == "sub":
        y = a - b
    elif OP == "mul":
        y = a * b
    elif OP == "div":
        y = a / b
    elif OP == "max":
        y = max(a, b)
    else:
        y = min(a, b)
    tk.store(Y, y, (0, 0))


@tk.kernel(num_warps=4)
def scalar_kernel(A: tk.gl[bf16], Y: tk.gl[bf16], s: float, OP: tk.constexpr):
    a = tk.load(A, (0, 0), (16, 64))
    if OP == "add":
        y = a + 2.0
    elif OP == "sub":
        y = a - 2.0
    elif OP == "mul":
        y = a * s
    elif OP == "div":
        y = a / 2.0
    elif OP == "max":
        y = max(a, 0.5)
    elif OP == "min":
        y = min(a, 0.5)
    elif OP == "rsub":
        y = 2.0 - a
    else:
        y = 2.0 / a
    tk.store(Y, y, (0, 0))


@tk.kernel(num_warps=4)
def reduce_kernel(X: tk.gl[f32], V: tk.gl[f32], KIND: tk.constexpr, AXIS: tk.constexpr,
                  ROWS: tk.constexpr, COLS: tk.constexpr):
    x = tk.load(X, (0, 0), (ROWS, COLS))
    if AXIS == "row":
        if KIND == "sum":
            v = x.row_sum()
        elif KIND == "max":
            v = x.row_max()
        else:
            v = x.row_min()
    else:
        if KIND == "sum":
            v = x.col_sum()
        elif KIND == "max":
            v = x.col_max()
        else:
            v = x.col_min()
    tk.store(V, v, (0,))


@tk.kernel(num_warps=4)
def broadcast_kernel(X: tk.gl[f32], V: tk.gl[f32], Y: tk.gl[f32], KIND: tk.constexpr,
                     AXIS: tk.constexpr):
    x = tk.load(X, (0, 0), (16, 64))
    v = tk.load(V, (0,), (16 if AXIS == "row" else 64,))
    if AXIS == "row":
        if KIND == "add":
            y = x.add_row(v)
        elif KIND == "sub":
            y = x.sub_row(v)
        elif KIND == "mul":
            y = x.mul_row(v)
        else:
            y = x.div_row(v)
    else:
        if KIND == "add":
            y = x.add_col(v)
        elif KIND == "sub":
            y = x.sub_col(v)
        elif KIND == "mul":
            y = x.mul_col(v)
        else:
            y = x.div_col(v)
    tk.store(Y, y, (0, 0))


@tk.kernel(num_warps=4)
def barrier_kernel(X: tk.gl[f32]):
    tk.barrier()


@tk.kernel(num_warps=4)
def loop_kernel(X: tk.gl[f32], Y: tk.gl[f32]):
    acc = tk.load(X, (tk.block_id(0), 0), (16, 64))
    for k in range(1, X.shape[1] // 64):
        acc = acc + tk.load(X, (tk.block_id(0), k), (16, 64)).exp()
    tk.store(Y, acc.sub_row(acc.row_max()), (tk.block_id(0), 0))


@tk.kernel(num_warps=4)
def first_load_in_loop_kernel(X: tk.gl[f32], Y: tk.gl[f32]):
    acc = tk.zeros((16, 64))
    for k in range(4):
        acc = acc + tk.load(X, (0, k), (16, 64))
    tk.store(Y, acc, (0, 0))


@tk.kernel(num_warps=4)
def first_load_in_branch_kernel(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    acc = tk.zeros((16, 64))
    if n > 0:
        acc = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, acc, (0, 0))


# ---------------------------------------------------------------- helpers

F32_2D, BF16_2D = tk.spec((256, 256), f32), tk.spec((256, 256), bf16)
F32_1D, BF16_1D = tk.spec((256,), f32), tk.spec((256,), bf16)

GL_F32 = "!tk.gl<f32, array<i64: -1, -1>>"
GL_BF16 = "!tk.gl<bf16, array<i64: -1, -1>>"


def rt(dtype: str, rows: int, cols: int, layout: str = "vec", scope: str = "block") -> str:
    return f'!tk.rt<{dtype}, {rows} : i64, {cols} : i64, "{layout}", "{scope}">'


def rv(dtype: str, length: int, layout: str = "auto", scope: str = "block") -> str:
    return f'!tk.rv<{dtype}, {length} : i64, "{layout}", "{scope}">'


def st(dtype: str, rows: int, cols: int, swizzle: int = 0) -> str:
    return f"!tk.st<{dtype}, {rows} : i64, {cols} : i64, {swizzle} : i64>"


RT_F32, RT_BF16 = rt("f32", 16, 64), rt("bf16", 16, 64)


def stages(kernel, *args, **constexprs) -> dict[str, str]:
    return kernel.compile(*args, **constexprs).stages


def source_position(kernel, line_snippet: str, expr: str | None = None) -> tuple[int, int]:
    """(line, column) in this file of `expr` (default: the snippet itself) on
    the one line of `kernel` that contains `line_snippet`; columns count from 1
    as MLIR locations do."""
    lines, first = inspect.getsourcelines(kernel.fn)
    hits = [(first + i, text) for i, text in enumerate(lines) if line_snippet in text]
    assert len(hits) == 1, f"{line_snippet!r} is on {len(hits)} lines of {kernel}"
    line, text = hits[0]
    return line, text.index(expr or line_snippet) + 1


def check_tk_op(text: str, op: str, kernel, line_snippet: str, expr: str | None = None,
                **variables) -> None:
    """FileCheck `op` (a CHECK pattern for the whole op, up to its result
    type) in `text`, and that its location is the kernel's source line."""
    line, col = source_position(kernel, line_snippet, expr)
    filecheck(text, "CHECK: " + op + " loc([[LOC:#loc[0-9]*]])\n"
                    'CHECK: [[LOC]] = loc("{{.*}}test_ir.py":[[LINE]]:[[COL]])\n',
              LINE=str(line), COL=str(col), **variables)


def loc_alias(text: str, kernel, line_snippet: str, expr: str | None = None) -> str:
    """The #loc alias that `text` (a stage printed with debug info) uses for
    the source position of `expr`."""
    line, col = source_position(kernel, line_snippet, expr)
    m = re.search(rf'^(#loc\d*) = loc\("[^"]*test_ir\.py":{line}:{col}\)$', text, re.M)
    assert m, f"no location alias for test_ir.py:{line}:{col} in:\n{text}"
    return m.group(1)


def check_lowered(text: str, checks: str, kernel, line_snippet: str, expr: str | None = None,
                  **variables) -> None:
    """FileCheck `checks` against a lowered stage; [[LOC]] is the location
    alias of the tk op at `line_snippet`/`expr`."""
    if "[[LOC]]" in checks:
        variables["LOC"] = loc_alias(text, kernel, line_snippet, expr)
    filecheck(text, checks, **variables)


# ------------------------------------------------------ where this thread is

INDEX_CASES = {
    # name: (WHICH, DIM, the tk op, its line, checks that define [[V]]: the op's i32 value)
    "block_id_x": ("block_id", 0, '"tk.block_id"() {dim = 0 : i64} : () -> i32', "tk.block_id(DIM)",
                   """CHECK: [[ID:%[a-z_0-9]+]] = gpu.block_id x loc([[LOC]])
                      CHECK-NEXT: [[V:%[0-9]+]] = arith.index_cast [[ID]] : index to i32 loc([[LOC]])"""),
    "block_id_y": ("block_id", 1, '"tk.block_id"() {dim = 1 : i64} : () -> i32', "tk.block_id(DIM)",
                   """CHECK: [[ID:%[a-z_0-9]+]] = gpu.block_id y loc([[LOC]])
                      CHECK-NEXT: [[V:%[0-9]+]] = arith.index_cast [[ID]] : index to i32 loc([[LOC]])"""),
    "block_id_z": ("block_id", 2, '"tk.block_id"() {dim = 2 : i64} : () -> i32', "tk.block_id(DIM)",
                   """CHECK: [[ID:%[a-z_0-9]+]] = gpu.block_id z loc([[LOC]])
                      CHECK-NEXT: [[V:%[0-9]+]] = arith.index_cast [[ID]] : index to i32 loc([[LOC]])"""),
    "grid_dim_x": ("grid_dim", 0, '"tk.grid_dim"() {dim = 0 : i64} : () -> i32', "tk.grid_dim(DIM)",
                   """CHECK: [[ID:%[a-z_0-9]+]] = gpu.grid_dim x loc([[LOC]])
                      CHECK-NEXT: [[V:%[0-9]+]] = arith.index_cast [[ID]] : index to i32 loc([[LOC]])"""),
    "grid_dim_y": ("grid_dim", 1, '"tk.grid_dim"() {dim = 1 : i64} : () -> i32', "tk.grid_dim(DIM)",
                   """CHECK: [[ID:%[a-z_0-9]+]] = gpu.grid_dim y loc([[LOC]])
                      CHECK-NEXT: [[V:%[0-9]+]] = arith.index_cast [[ID]] : index to i32 loc([[LOC]])"""),
    # tid, lane = tid & 31 and warp = tid >> 5 are computed once per kernel (where
    # is the lowering's business, so no location), the warp index shuffled from
    # lane 0 for ptxas to see it warp-uniform; warpgroup = warp >> 2 here.
    "thread_id": ("thread_id", 0, '"tk.thread_id"() : () -> i32', "tk.thread_id()",
                  """CHECK: [[ID:%[a-z_0-9]+]] = gpu.thread_id x
                     CHECK-NEXT: [[V:%[0-9]+]] = arith.index_cast [[ID]] : index to i32"""),
    "lane_id": ("lane_id", 0, '"tk.lane_id"() : () -> i32', "tk.lane_id()",
                """CHECK: [[ID:%[a-z_0-9]+]] = gpu.thread_id x
                   CHECK-NEXT: [[TID:%[0-9]+]] = arith.index_cast [[ID]] : index to i32
                   CHECK: [[V:%[0-9]+]] = arith.andi [[TID]], %c31_i32{{[_0-9]*}} : i32"""),
    "warp_id": ("warp_id", 0, '"tk.warp_id"() : () -> i32', "tk.warp_id()",
                """CHECK: [[ID:%[a-z_0-9]+]] = gpu.thread_id x
                   CHECK-NEXT: [[TID:%[0-9]+]] = arith.index_cast [[ID]] : index to i32
                   CHECK: [[W:%[0-9]+]] = arith.shrui [[TID]], %c5_i32{{[_0-9]*}} : i32
                   CHECK: [[V:%[0-9]+]] = nvvm.shfl.sync idx %c-1_i32, [[W]], %c0_i32"""),
    "warpgroup_id": ("warpgroup_id", 0, '"tk.warpgroup_id"() : () -> i32', "tk.warpgroup_id()",
                     """CHECK: [[ID:%[a-z_0-9]+]] = gpu.thread_id x
                        CHECK-NEXT: [[TID:%[0-9]+]] = arith.index_cast [[ID]] : index to i32
                        CHECK: [[W:%[0-9]+]] = arith.shrui [[TID]], %c5_i32{{[_0-9]*}} : i32
                        CHECK: [[U:%[0-9]+]] = nvvm.shfl.sync idx %c-1_i32, [[W]], %c0_i32
                        CHECK: [[V:%[0-9]+]] = arith.shrui [[U]], %c2_i32{{[_0-9]*}} : i32 loc([[LOC]])"""),
}


def _index_stages(case):
    which, dim, *_ = INDEX_CASES[case]
    return stages(index_kernel, F32_2D, WHICH=which, DIM=dim)


@pytest.mark.parametrize("case", INDEX_CASES)
def test_index_op_in_tk_ir(case):
    _, _, op, line, _ = INDEX_CASES[case]
    check_tk_op(_index_stages(case)["tk"], "%{{[0-9]+}} = " + op, index_kernel, line)


@pytest.mark.parametrize("case", INDEX_CASES)
def test_index_op_lowering(case):
    _, _, _, line, checks = INDEX_CASES[case]
    # The value is the row coordinate of the store: row base = v * 16 rows.
    checks += "\nCHECK: arith.muli [[V]], %c16_i32{{[_0-9]*}} : i32"
    check_lowered(_index_stages(case)["tk-to-gpu"], checks, index_kernel, line)


# ------------------------------------------------------------------ gl_dim

def test_gl_dim_in_tk_ir():
    text = stages(gl_dim_kernel, F32_2D, F32_2D)["tk"]
    check_tk_op(text, '%{{[0-9]+}} = "tk.gl_dim"(%arg0) {dim = 1 : i64} : ([[GL]]) -> i32',
                gl_dim_kernel, "float(X.shape[1])", "X.shape", GL=GL_F32)


def test_gl_dim_lowers_to_the_kernel_parameter():
    # X becomes (ptr, dim 0, dim 1, stride 0): X.shape[1] is parameter %arg2, used as is.
    text = stages(gl_dim_kernel, F32_2D, F32_2D)["tk-to-gpu"]
    filecheck(text, """
        CHECK: gpu.func @gl_dim_kernel(%arg0: !llvm.ptr<1> {{.*}}, %arg1: i32 {{.*}}, %arg2: i32 {{.*}}, %arg3: i64 {{.*}}, %arg4: !llvm.ptr<1>
        CHECK: [[D:%[0-9]+]] = arith.sitofp %arg2 : i32 to f32
        CHECK-COUNT-8: arith.mulf %{{[0-9]+}}, [[D]] fastmath<contract> : f32
    """)


def test_static_dim_is_a_constant_not_gl_dim():
    text = stages(static_dim_kernel, tk.spec((256, 64), f32), F32_2D)["tk"]
    filecheck(text, """
        CHECK-NOT: "tk.gl_dim"(%arg0) {dim = 1 : i64}
        CHECK: [[C:%cst[_0-9]*]] = arith.constant 6.400000e+01 : f32
        CHECK: "tk.mul"(%{{[0-9]+}}, [[C]]) : ([[RT]], f32) -> [[RT]]
    """, RT=RT_F32)


# ---------------------------------------------------------- load / store gl

def test_load_gl_to_rt_in_tk_ir():
    text = stages(load_store_kernel, BF16_2D, BF16_2D)["tk"]
    check_tk_op(text, '%{{[0-9]+}} = "tk.load"(%arg0, %{{[0-9]+}}, %c0_i32) '
                      "{fill = 0.000000e+00 : f32} : ([[GL]], i32, i32) -> [[RT]]",
                load_store_kernel, "x = tk.load", "tk.load", GL=GL_BF16, RT=RT_BF16)


def test_load_gl_to_rt_lowers_to_guarded_16_byte_loads():
    # 16x64 bf16 over 4 warps: 8 contiguous elements per thread, one 16-byte load
    # under an in-bounds test, the fill value otherwise.
    text = stages(load_store_kernel, BF16_2D, BF16_2D)["tk-to-gpu"]
    check_lowered(text, """
        CHECK: [[FILL:%cst[_0-9]*]] = arith.constant 0.000000e+00 : bf16 loc([[LOC]])
        CHECK-COUNT-8: llvm.insertelement [[FILL]], %{{[0-9]+}}[%c{{[0-9]}}_i32{{[_0-9]*}} : i32] : vector<8xbf16> loc([[LOC]])
        CHECK: [[OK:%[0-9]+]] = arith.andi %{{[0-9]+}}, %{{[0-9]+}} : i1 loc([[LOC]])
        CHECK-NEXT: %{{[0-9]+}} = scf.if [[OK]] -> (vector<8xbf16>) {
        CHECK-NEXT: [[V:%[0-9]+]] = llvm.load %{{[0-9]+}} {alignment = 16 : i64} : !llvm.ptr<1> -> vector<8xbf16> loc([[LOC]])
        CHECK-NEXT: scf.yield [[V]] : vector<8xbf16>
        CHECK-NEXT: } else {
        CHECK-NEXT: scf.yield %{{[0-9]+}} : vector<8xbf16>
        CHECK-COUNT-8: llvm.extractelement
        CHECK-NOT: llvm.load
    """, load_store_kernel, "x = tk.load", "tk.load")


def test_load_fill_value_reaches_the_masked_lanes():
    s = stages(load_store_kernel, BF16_2D, BF16_2D, FILL=float("-inf"))
    filecheck(s["tk"], '''CHECK: "tk.load"({{.*}}) {fill = 0xFF800000 : f32}''')
    filecheck(s["tk-to-gpu"], """
        CHECK: [[NEG_INF:%cst[_0-9]*]] = arith.constant 0xFF80 : bf16
        CHECK-COUNT-8: llvm.insertelement [[NEG_INF]], %{{[0-9]+}}[%c{{[0-9]}}_i32{{[_0-9]*}} : i32] : vector<8xbf16>
        CHECK: } else {
    """)


def test_load_row_layout_warp_scope_tile():
    # The MMA fragment layout: pairs of columns per thread, 4-byte accesses.
    s = stages(load_store_kernel, BF16_2D, BF16_2D, LAYOUT="row", SCOPE="warp")
    check_tk_op(s["tk"], '%{{[0-9]+}} = "tk.load"(%arg0, %{{[0-9]+}}, %c0_i32) '
                         "{fill = 0.000000e+00 : f32} : ([[GL]], i32, i32) -> [[RT]]",
                load_store_kernel, "x = tk.load", "tk.load", GL=GL_BF16,
                RT=rt("bf16", 16, 64, "row", "warp"))
    check_lowered(s["tk-to-gpu"], """
        CHECK-COUNT-16: llvm.load %{{[0-9]+}} {alignment = 4 : i64} : !llvm.ptr<1> -> vector<2xbf16> loc([[LOC]])
        CHECK-NOT: llvm.load
    """, load_store_kernel, "x = tk.load", "tk.load")


def test_store_rt_to_gl_in_tk_ir():
    text = stages(load_store_kernel, BF16_2D, BF16_2D)["tk"]
    check_tk_op(text, '"tk.store"(%arg1, %{{[0-9]+}}, %{{[0-9]+}}, %c0_i32_0) : '
                      "([[GL]], [[RT]], i32, i32) -> ()",
                load_store_kernel, "tk.store", GL=GL_BF16, RT=RT_BF16)


def test_store_rt_to_gl_lowers_to_a_guarded_16_byte_store():
    text = stages(load_store_kernel, BF16_2D, BF16_2D)["tk-to-gpu"]
    check_lowered(text, """
        CHECK: [[OK:%[0-9]+]] = arith.andi %{{[0-9]+}}, %{{[0-9]+}} : i1 loc([[LOC]])
        CHECK: [[V:%[0-9]+]] = llvm.insertelement %{{[0-9]+}}, %{{[0-9]+}}[%c7_i32{{[_0-9]*}} : i32] : vector<8xbf16> loc([[LOC]])
        CHECK-NEXT: scf.if [[OK]] {
        CHECK-NEXT: llvm.store [[V]], %{{[0-9]+}} {alignment = 16 : i64} : vector<8xbf16>, !llvm.ptr<1> loc([[LOC]])
        CHECK-NEXT: } loc([[LOC]])
        CHECK-NOT: llvm.store
    """, load_store_kernel, "tk.store")


def test_load_and_store_of_a_vector_in_tk_ir():
    s = stages(vector_kernel, BF16_1D, BF16_1D)
    gl = "!tk.gl<bf16, array<i64: -1>>"
    check_tk_op(s["tk"], '%{{[0-9]+}} = "tk.load"(%arg0, %c0_i32) {fill = 0.000000e+00 : f32} '
                         ": ([[GL]], i32) -> [[RV]]",
                vector_kernel, "w = tk.load", "tk.load", GL=gl, RV=rv("bf16", 256))
    # Unconstrained by any tile: the default vector layout (warps replicate).
    default = rv("bf16", 256, "r[1,2,4]l[8,16,32,64,128]w[x,x]")
    filecheck(s["tk-assign-layouts"], """
        CHECK: "tk.load"(%arg0, %c0_i32) {{.*}} -> [[RV]]
        CHECK: "tk.store"(%arg1, %{{[0-9]+}}, %c0_i32_0) : ([[GL]], [[RV]], i32) -> ()
    """, GL=gl, RV=default)


def test_load_and_store_of_a_vector_lowering():
    text = stages(vector_kernel, BF16_1D, BF16_1D)["tk-to-gpu"]
    check_lowered(text, """
        CHECK: llvm.load %{{[0-9]+}} {alignment = 16 : i64} : !llvm.ptr<1> -> vector<8xbf16> loc([[LOC]])
    """, vector_kernel, "w = tk.load", "tk.load")
    # Every warp holds the whole vector: only warp 0 (warp & 3 == 0) writes it.
    check_lowered(text, """
        CHECK: [[TID:%[0-9]+]] = arith.index_cast %thread_id_x
        CHECK: [[W:%[0-9]+]] = arith.shrui [[TID]], %c5_i32{{[_0-9]*}} : i32
        CHECK: [[WBITS:%[0-9]+]] = arith.andi [[W]], %c3_i32{{[_0-9]*}} : i32 loc([[LOC]])
        CHECK: [[FIRST:%[0-9]+]] = arith.cmpi eq, [[WBITS]], %c0_i32{{[_0-9]*}} : i32 loc([[LOC]])
        CHECK: [[OK:%[0-9]+]] = arith.andi %{{[0-9]+}}, [[FIRST]] : i1 loc([[LOC]])
        CHECK-NEXT: scf.if [[OK]] {
        CHECK-NEXT: llvm.store %{{[0-9]+}}, %{{[0-9]+}} {alignment = 16 : i64} : vector<8xbf16>, !llvm.ptr<1> loc([[LOC]])
    """, vector_kernel, "tk.store")


@pytest.mark.parametrize("kernel,args,vector", [
    (vector_copy_kernel, (BF16_1D, BF16_1D), rv("bf16", 256, "r[1,2,4]l[8,16,32,64,128]w[x,x]")),
    (vector_fill_kernel, (F32_1D,), rv("f32", 64, "r[1,2,4]l[8,16,32,x,x]w[x,x]"))],
    ids=["load-store", "fill-store"])
def test_vector_used_only_by_memory_ops_gets_the_default_layout(kernel, args, vector):
    # Regression: tk-assign-layouts once skipped vectors no op constrains, left
    # them "auto", and the lowering failed in layout.decode.
    s = stages(kernel, *args)
    filecheck(s["tk-assign-layouts"], """
        CHECK-NOT: "auto"
        CHECK: "tk.store"(%arg{{[0-9]}}, %{{[0-9]+}}, %c0_i32{{[_0-9]*}}) : ({{.*}}, [[RV]], i32) -> ()
    """, RV=vector)
    filecheck(s["tk-to-gpu"], """
        CHECK: scf.if %{{[0-9]+}} {
        CHECK-NEXT: llvm.store %{{[0-9]+}}, %{{[0-9]+}} {alignment = 16 : i64} : vector<{{[48]}}x{{(bf16|f32)}}>, !llvm.ptr<1>
    """)


# ------------------------------------------------------------ shared tiles

def test_alloc_st_in_tk_ir():
    text = stages(alloc_kernel, BF16_2D)["tk"]
    check_tk_op(text, '%{{[0-9]+}} = "tk.alloc_st"() : () -> [[ST]]', alloc_kernel,
                "c = tk.shared_tile", "tk.shared_tile", ST=st("bf16", 8, 64, 128))
    check_tk_op(text, '%{{[0-9]+}} = "tk.alloc_st"() : () -> [[ST]]', alloc_kernel,
                "a = tk.shared_tile", "tk.shared_tile", ST=st("bf16", 1, 8))


def test_alloc_st_offsets_in_allocate_smem_stage():
    # The swizzled tile first, at 0 (1024-aligned), then the 16-byte tiles at
    # 128-byte alignment after it (created first, they would leave a gap
    # before it), and 1024 bytes more to round the base up to 1024 at run time.
    compiled = alloc_kernel.compile(BF16_2D)
    filecheck(compiled.stages["tk-allocate-smem"], """
        CHECK: func.func @alloc_kernel({{.*}}) attributes {tk.num_warps = 4 : i64, tk.smem_align = 1024 : i64, tk.smem_bytes = 2304 : i64}
        CHECK-NEXT: "tk.alloc_st"() {offset = 1024 : i64, stride = 128 : i64} : () -> [[ST_A]]
        CHECK-NEXT: "tk.alloc_st"() {offset = 1152 : i64, stride = 128 : i64} : () -> [[ST_A]]
        CHECK-NEXT: "tk.alloc_st"() {offset = 0 : i64, stride = 1024 : i64} : () -> [[ST_C]]
    """, ST_A=st("bf16", 1, 8), ST_C=st("bf16", 8, 64, 128))
    assert compiled.smem_bytes == 2304


def test_alloc_st_lowers_to_an_offset_into_dynamic_shared_memory():
    text = stages(alloc_kernel, BF16_2D)["tk-to-gpu"]
    filecheck(text, r"""
        CHECK: llvm.mlir.global external @__tk_smem() {addr_space = 3 : i32, alignment = 16 : i64} : !llvm.array<0 x i8>
        CHECK: [[RAW:%[0-9]+]] = llvm.mlir.addressof @__tk_smem : !llvm.ptr<3>
        CHECK: [[ADDR:%[0-9]+]] = llvm.ptrtoint [[RAW]] : !llvm.ptr<3> to i32
        CHECK: [[UP:%[0-9]+]] = arith.addi [[ADDR]], %c1023_i32
        CHECK: [[ALIGNED:%[0-9]+]] = arith.andi [[UP]], %c-1024_i32
        CHECK: [[PAD:%[0-9]+]] = arith.subi [[ALIGNED]], [[ADDR]]
        CHECK: [[SMEM:%[0-9]+]] = llvm.getelementptr {{.*}}[[RAW]]{{\[}}[[PAD]]{{\]}} : (!llvm.ptr<3>, i32) -> !llvm.ptr<3>, i8
        CHECK: llvm.getelementptr [[SMEM]][%c1024_i32{{[_0-9]*}}] : (!llvm.ptr<3>, i32) -> !llvm.ptr<3>, i8
        CHECK: llvm.getelementptr [[SMEM]][%c1152_i32{{[_0-9]*}}] : (!llvm.ptr<3>, i32) -> !llvm.ptr<3>, i8
        CHECK: llvm.getelementptr [[SMEM]][%c0_i32{{[_0-9]*}}] : (!llvm.ptr<3>, i32) -> !llvm.ptr<3>, i8
    """)


SHARED_TK_OPS = {
    # name: (the tk op, the line, the expression)
    "copy_gl_to_st": ('"tk.copy"(%0, %arg0, %{{[0-9]+}}, %c0_i32) : ([[ST]], [[GL]], i32, i32) -> ()',
                      "tk.copy(s, X", None),
    "load_st_to_rt": ('%{{[0-9]+}} = "tk.load"(%0) {fill = 0.000000e+00 : f32} : ([[ST]]) -> [[RT]]',
                      "x = tk.load(s)", "tk.load(s)"),
    "store_rt_to_st": ('"tk.store"(%0, %{{[0-9]+}}) : ([[ST]], [[RT]]) -> ()', "tk.store(s", None),
    "copy_st_to_gl": ('"tk.copy"(%arg1, %0, %{{[0-9]+}}, %c0_i32_0) : ([[GL]], [[ST]], i32, i32) -> ()',
                      "tk.copy(Y, s", None),
}


@pytest.mark.parametrize("swizzle", [0, 128])
@pytest.mark.parametrize("case", SHARED_TK_OPS)
def test_shared_memory_op_in_tk_ir(case, swizzle):
    op, line, expr = SHARED_TK_OPS[case]
    text = stages(shared_kernel, BF16_2D, BF16_2D, SWIZZLE=swizzle)["tk"]
    check_tk_op(text, op, shared_kernel, line, expr, GL=GL_BF16, ST=st("bf16", 32, 64, swizzle),
                RT=rt("bf16", 32, 64))


SHARED_LOWERINGS = {
    # 32x64 bf16 = 256 16-byte chunks, 2 per thread of 128.
    "copy_gl_to_st": ("tk.copy(s, X", None, """
        CHECK: nvvm.barrier0 loc([[LOC]])
        CHECK: scf.if %{{[0-9]+}} -> (vector<8xbf16>) {
        CHECK-NEXT: llvm.load %{{[0-9]+}} {alignment = 16 : i64} : !llvm.ptr<1> -> vector<8xbf16> loc([[LOC]])
        CHECK: llvm.store %{{[0-9]+}}, %{{[0-9]+}} {alignment = 16 : i64} : vector<8xbf16>, !llvm.ptr<3> loc([[LOC]])
        CHECK-NOT: nvvm.barrier0
        CHECK: scf.if %{{[0-9]+}} -> (vector<8xbf16>) {
        CHECK-NEXT: llvm.load %{{[0-9]+}} {alignment = 16 : i64} : !llvm.ptr<1> -> vector<8xbf16> loc([[LOC]])
        CHECK: llvm.store %{{[0-9]+}}, %{{[0-9]+}} {alignment = 16 : i64} : vector<8xbf16>, !llvm.ptr<3> loc([[LOC]])
        CHECK-NEXT: } loc([[LOC]])
        CHECK-NEXT: nvvm.barrier0 loc([[LOC]])
    """),
    "load_st_to_rt": ("x = tk.load(s)", "tk.load(s)", """
        CHECK-COUNT-2: llvm.load %{{[0-9]+}} {alignment = 16 : i64} : !llvm.ptr<3> -> vector<8xbf16> loc([[LOC]])
    """),
    "store_rt_to_st": ("tk.store(s", None, """
        CHECK: nvvm.barrier0 loc([[LOC]])
        CHECK-COUNT-2: llvm.store %{{[0-9]+}}, %{{[0-9]+}} {alignment = 16 : i64} : vector<8xbf16>, !llvm.ptr<3> loc([[LOC]])
        CHECK-NEXT: nvvm.barrier0 loc([[LOC]])
    """),
    "copy_st_to_gl": ("tk.copy(Y, s", None, """
        CHECK: nvvm.barrier0 loc([[LOC]])
        CHECK: scf.if %{{[0-9]+}} {
        CHECK-NEXT: [[V:%[0-9]+]] = llvm.load %{{[0-9]+}} {alignment = 16 : i64} : !llvm.ptr<3> -> vector<8xbf16> loc([[LOC]])
        CHECK-NEXT: llvm.store [[V]], %{{[0-9]+}} {alignment = 16 : i64} : vector<8xbf16>, !llvm.ptr<1> loc([[LOC]])
        CHECK: scf.if %{{[0-9]+}} {
        CHECK-NEXT: [[V:%[0-9]+]] = llvm.load %{{[0-9]+}} {alignment = 16 : i64} : !llvm.ptr<3> -> vector<8xbf16> loc([[LOC]])
        CHECK-NEXT: llvm.store [[V]], %{{[0-9]+}} {alignment = 16 : i64} : vector<8xbf16>, !llvm.ptr<1> loc([[LOC]])
        CHECK-NEXT: } loc([[LOC]])
        CHECK-NEXT: nvvm.barrier0 loc([[LOC]])
    """),
}


@pytest.mark.parametrize("case", SHARED_LOWERINGS)
def test_shared_memory_op_lowering(case):
    line, expr, checks = SHARED_LOWERINGS[case]
    text = stages(shared_kernel, BF16_2D, BF16_2D)["tk-to-gpu"]
    check_lowered(text, checks, shared_kernel, line, expr)


def test_shared_tile_swizzle_xors_the_address():
    plain = stages(shared_kernel, BF16_2D, BF16_2D, SWIZZLE=0)["tk-to-gpu"]
    swizzled = stages(shared_kernel, BF16_2D, BF16_2D, SWIZZLE=128)["tk-to-gpu"]
    filecheck(plain, "CHECK-NOT: arith.xori")
    # 128-byte swizzle: the 16-byte chunk index ^= (offset >> 7) & 7.
    check_lowered(swizzled, """
        CHECK: [[LINE:%[0-9]+]] = arith.shrui [[OFF:%[0-9]+]], %c7_i32{{[_0-9]*}} : i32 loc([[LOC]])
        CHECK: [[BITS:%[0-9]+]] = arith.andi [[LINE]], %c7_i32{{[_0-9]*}} : i32 loc([[LOC]])
        CHECK: [[SHIFT:%[0-9]+]] = arith.shli [[BITS]], %c4_i32{{[_0-9]*}} : i32 loc([[LOC]])
        CHECK: arith.xori [[OFF]], [[SHIFT]] : i32 loc([[LOC]])
    """, shared_kernel, "x = tk.load(s)", "tk.load(s)")


# -------------------------------------------------------------------- fill

FILL_CASES = {
    "full_bf16": ("tk.full((16, 64), 2.5, bf16)", "2.500000e+00", RT_BF16, "2.500000e+00 : bf16"),
    "zeros_f32": ("tk.zeros((16, 64))", "0.000000e+00", RT_F32, "0.000000e+00 : f32"),
}


@pytest.mark.parametrize("case", FILL_CASES)
def test_fill_in_tk_ir(case):
    expr, value, tile, _ = FILL_CASES[case]
    text = stages(fill_kernel, BF16_2D, F32_2D)["tk"]
    check_tk_op(text, '%{{[0-9]+}} = "tk.fill"() {value = [[VALUE]] : f32} : () -> [[RT]]',
                fill_kernel, expr, VALUE=value, RT=tile)


@pytest.mark.parametrize("case", FILL_CASES)
def test_fill_lowers_to_one_constant_in_every_register(case):
    expr, _, _, constant = FILL_CASES[case]
    text = stages(fill_kernel, BF16_2D, F32_2D)["tk-to-gpu"]
    check_lowered(text, """
        CHECK: [[C:%cst[_0-9]*]] = arith.constant [[CONSTANT]] loc([[LOC]])
        CHECK: llvm.insertelement [[C]], %{{[0-9]+}}[%c0_i32{{[_0-9]*}} : i32]
        CHECK: llvm.insertelement [[C]], %{{[0-9]+}}[%c1_i32{{[_0-9]*}} : i32]
    """, fill_kernel, expr, CONSTANT=constant)


# --------------------------------------------------------------------- cvt

CVT_CASES = {
    "f32_to_bf16": ("y = x.to(bf16)", "x.to(bf16)", RT_F32, RT_BF16, "arith.truncf", "f32 to bf16"),
    "bf16_to_f32": ("y.to(f32)", None, RT_BF16, RT_F32, "arith.extf", "bf16 to f32"),
}


@pytest.mark.parametrize("case", CVT_CASES)
def test_cvt_in_tk_ir(case):
    line, expr, src, dst, _, _ = CVT_CASES[case]
    text = stages(cvt_kernel, F32_2D, BF16_2D, F32_2D)["tk"]
    check_tk_op(text, '%{{[0-9]+}} = "tk.cvt"(%{{[0-9]+}}) : ([[SRC]]) -> [[DST]]', cvt_kernel,
                line, expr, SRC=src, DST=dst)


@pytest.mark.parametrize("case", CVT_CASES)
def test_cvt_lowering(case):
    line, expr, _, _, op, types = CVT_CASES[case]
    text = stages(cvt_kernel, F32_2D, BF16_2D, F32_2D)["tk-to-gpu"]
    check_lowered(text, """
        CHECK-COUNT-8: [[OP]] %{{[0-9]+}} : [[TYPES]] loc([[LOC]])
    """, cvt_kernel, line, expr, OP=op, TYPES=types)


# ------------------------------------------------------------------- unary

UNARY_CASES = {
    # op: (the expression, checks for one register of the 8 of a 16x64 f32 tile)
    "exp": ("x.exp()", """
        CHECK: [[LOG2E:%cst[_0-9]*]] = arith.constant 1.44269502 : f32 loc([[LOC]])
        CHECK-NEXT: [[X:%[0-9]+]] = arith.mulf %{{[0-9]+}}, [[LOG2E]] : f32 loc([[LOC]])
        CHECK-NEXT: llvm.inline_asm "ex2.approx.ftz.f32 $0, $1;", "=f,f" [[X]] : (f32) -> f32 loc([[LOC]])
    """),
    "exp2": ("x.exp2()", """
        CHECK-NOT: arith.mulf
        CHECK: llvm.inline_asm "ex2.approx.ftz.f32 $0, $1;", "=f,f" %{{[0-9]+}} : (f32) -> f32 loc([[LOC]])
    """),
    "log": ("x.log()", """
        CHECK: [[X:%[0-9]+]] = llvm.inline_asm "lg2.approx.ftz.f32 $0, $1;", "=f,f" %{{[0-9]+}} : (f32) -> f32 loc([[LOC]])
        CHECK-NEXT: [[LN2:%cst[_0-9]*]] = arith.constant 0.693147182 : f32 loc([[LOC]])
        CHECK-NEXT: arith.mulf [[X]], [[LN2]] : f32 loc([[LOC]])
    """),
    "abs": ("x.abs()", "CHECK: math.absf %{{[0-9]+}} : f32 loc([[LOC]])"),
    "neg": ("-x", "CHECK: arith.negf %{{[0-9]+}} : f32 loc([[LOC]])"),
    "relu": ("x.relu()", """
        CHECK: [[ZERO:%cst[_0-9]*]] = arith.constant 0.000000e+00 : f32 loc([[LOC]])
        CHECK-NEXT: arith.maximumf %{{[0-9]+}}, [[ZERO]] : f32 loc([[LOC]])
    """),
    "sqrt": ("x.sqrt()", """
        CHECK: llvm.inline_asm "sqrt.approx.ftz.f32 $0, $1;", "=f,f" %{{[0-9]+}} : (f32) -> f32 loc([[LOC]])
    """),
    "rsqrt": ("x.rsqrt()", """
        CHECK: llvm.inline_asm "rsqrt.approx.ftz.f32 $0, $1;", "=f,f" %{{[0-9]+}} : (f32) -> f32 loc([[LOC]])
    """),
}
UNARY_KEY = {"exp": "ex2.approx", "exp2": "ex2.approx", "log": "lg2.approx", "abs": "math.absf",
             "neg": "arith.negf", "relu": "arith.maximumf", "sqrt": "sqrt.approx",
             "rsqrt": "rsqrt.approx"}


@pytest.mark.parametrize("op", UNARY_CASES)
def test_unary_in_tk_ir(op):
    text = stages(unary_kernel, F32_2D, F32_2D, OP=op)["tk"]
    check_tk_op(text, '%{{[0-9]+}} = "tk.[[OP]]"(%{{[0-9]+}}) : ([[RT]]) -> [[RT]]', unary_kernel,
                "y = " + UNARY_CASES[op][0], UNARY_CASES[op][0], OP=op, RT=RT_F32)


@pytest.mark.parametrize("op", UNARY_CASES)
def test_unary_lowering(op):
    expr, checks = UNARY_CASES[op]
    text = stages(unary_kernel, F32_2D, F32_2D, OP=op)["tk-to-gpu"]
    check_lowered(text, checks, unary_kernel, "y = " + expr, expr)
    # ... once per register
    check_lowered(text, "CHECK-COUNT-8: [[KEY]]{{.*}} loc([[LOC]])\nCHECK-NOT: [[KEY]]",
                  unary_kernel, "y = " + expr, expr, KEY=UNARY_KEY[op])


def test_unary_on_bf16_computes_in_f32():
    text = stages(unary_bf16_kernel, BF16_2D, BF16_2D)["tk-to-gpu"]
    check_lowered(text, """
        CHECK: [[X:%[0-9]+]] = arith.extf %{{[0-9]+}} : bf16 to f32 loc([[LOC]])
        CHECK: [[Y:%[0-9]+]] = arith.mulf [[X]], %cst{{[_0-9]*}} : f32 loc([[LOC]])
        CHECK-NEXT: [[Z:%[0-9]+]] = llvm.inline_asm "ex2.approx.ftz.f32 $0, $1;", "=f,f" [[Y]] : (f32) -> f32 loc([[LOC]])
        CHECK-NEXT: arith.truncf [[Z]] : f32 to bf16 loc([[LOC]])
    """, unary_bf16_kernel, "x.exp()")


# ------------------------------------------------------------------ binary

BINARY_CASES = {"add": ("a + b", "arith.addf"), "sub": ("a - b", "arith.subf"),
                "mul": ("a * b", "arith.mulf"), "div": ("a / b", "arith.divf"),
                # no tile method: Python's max/min on a tile emit tk.max / tk.min
                "max": ("max(a, b)", "arith.maximumf"), "min": ("min(a, b)", "arith.minimumf")}
# How each binary op on f32 registers reads in tk-to-gpu: (before its two
# operands, after them). add/sub/mul may contract into fma; / is div.full.f32
# (lowering/compute.py).
LOWERED_F32 = {"add": ("arith.addf", "fastmath<contract> : f32"),
               "sub": ("arith.subf", "fastmath<contract> : f32"),
               "mul": ("arith.mulf", "fastmath<contract> : f32"),
               "div": ('llvm.inline_asm "div.full.f32 $0, $1, $2;", "=f,f,f"',
                       ": (f32, f32) -> f32"),
               "max": ("arith.maximumf", ": f32"), "min": ("arith.minimumf", ": f32")}


@pytest.mark.parametrize("op", BINARY_CASES)
def test_binary_in_tk_ir(op):
    expr, _ = BINARY_CASES[op]
    text = stages(binary_kernel, F32_2D, F32_2D, F32_2D, OP=op)["tk"]
    check_tk_op(text, '%{{[0-9]+}} = "tk.[[OP]]"(%0, %1) : ([[RT]], [[RT]]) -> [[RT]]',
                binary_kernel, "y = " + expr, expr, OP=op, RT=RT_F32)


@pytest.mark.parametrize("op", BINARY_CASES)
def test_binary_lowers_to_one_arith_op_per_register(op):
    expr, _ = BINARY_CASES[op]
    lowered, tail = LOWERED_F32[op]
    text = stages(binary_kernel, F32_2D, F32_2D, F32_2D, OP=op)["tk-to-gpu"]
    check_lowered(text, """
        CHECK-COUNT-8: [[OP]] %{{[0-9]+}}, %{{[0-9]+}} [[TAIL]] loc([[LOC]])
        CHECK-NOT: [[OP]]
    """, binary_kernel, "y = " + expr, expr, OP=lowered, TAIL=tail)


SCALAR_CASES = {
    # name: (the expression, the tk ops, the lowering)
    "add": ("a + 2.0", ['"tk.add"(%0, %cst) : ([[RT]], f32) -> [[RT]]'], "arith.addf"),
    "sub": ("a - 2.0", ['"tk.sub"(%0, %cst) : ([[RT]], f32) -> [[RT]]'], "arith.subf"),
    "mul": ("a * s", ['"tk.mul"(%0, %arg2) : ([[RT]], f32) -> [[RT]]'], "arith.mulf"),
    "div": ("a / 2.0", ['"tk.div"(%0, %cst) : ([[RT]], f32) -> [[RT]]'], None),  # in f32
    "max": ("max(a, 0.5)", ['"tk.max"(%0, %cst) : ([[RT]], f32) -> [[RT]]'], "arith.maximumf"),
    "min": ("min(a, 0.5)", ['"tk.min"(%0, %cst) : ([[RT]], f32) -> [[RT]]'], "arith.minimumf"),
    # scalar (op) tile: 2 - a = (-a) + 2, 2 / a = fill(2) / a
    "rsub": ("2.0 - a", ['%1 = "tk.neg"(%0) : ([[RT]]) -> [[RT]]',
                         '"tk.add"(%1, %cst) : ([[RT]], f32) -> [[RT]]'], None),
    "rdiv": ("2.0 / a", ['%1 = "tk.fill"() {value = 2.000000e+00 : f32} : () -> [[RT]]',
                         '"tk.div"(%1, %0) : ([[RT]], [[RT]]) -> [[RT]]'], None),
}


def _scalar_stages(op):
    return stages(scalar_kernel, BF16_2D, BF16_2D, 1.0, OP=op)


@pytest.mark.parametrize("op", SCALAR_CASES)
def test_tile_op_scalar_in_tk_ir(op):
    expr, tk_ops, _ = SCALAR_CASES[op]
    text = _scalar_stages(op)["tk"]
    for tk_op in tk_ops:
        check_tk_op(text, "%{{[0-9]+}} = " + tk_op if not tk_op.startswith("%") else tk_op,
                    scalar_kernel, "y = " + expr, expr, RT=RT_BF16)


@pytest.mark.parametrize("op", [op for op, case in SCALAR_CASES.items() if case[2]])
def test_tile_op_scalar_converts_the_scalar_once(op):
    # A bf16 tile: the f32 scalar is truncated once, then one bf16 op per register.
    expr, _, arith_op = SCALAR_CASES[op]
    scalar = "%arg8" if op == "mul" else "%cst{{[_0-9]*}}"    # s: after A's and Y's 4 params
    flags = "fastmath<contract> " if op in ("add", "sub", "mul") else ""
    check_lowered(_scalar_stages(op)["tk-to-gpu"], """
        CHECK: [[S:%[0-9]+]] = arith.truncf [[SCALAR]] : f32 to bf16 loc([[LOC]])
        CHECK-COUNT-8: [[OP]] %{{[0-9]+}}, [[S]] [[FLAGS]]: bf16 loc([[LOC]])
        CHECK-NOT: [[OP]]
    """.replace("[[SCALAR]]", scalar).replace("[[FLAGS]]", flags), scalar_kernel,
        "y = " + expr, expr, OP=arith_op)


def test_scalar_minus_tile_lowering():
    check_lowered(_scalar_stages("rsub")["tk-to-gpu"], """
        CHECK-COUNT-8: arith.negf %{{[0-9]+}} : f32 loc([[LOC]])
        CHECK: [[TWO:%[0-9]+]] = arith.truncf %cst{{[_0-9]*}} : f32 to bf16 loc([[LOC]])
        CHECK-COUNT-8: arith.addf %{{[0-9]+}}, [[TWO]] fastmath<contract> : bf16 loc([[LOC]])
    """, scalar_kernel, "y = 2.0 - a", "2.0 - a")


def test_scalar_over_tile_lowering():
    # bf16 division is div.full.f32 on the operands widened to f32, then rounded once.
    check_lowered(_scalar_stages("rdiv")["tk-to-gpu"], """
        CHECK: [[TWO:%cst[_0-9]*]] = arith.constant 2.000000e+00 : bf16 loc([[LOC]])
        CHECK-COUNT-8: arith.extf [[TWO]] : bf16 to f32 loc([[LOC]])
        CHECK-NOT: arith.divf
    """, scalar_kernel, "y = 2.0 / a", "2.0 / a")
    check_lowered(_scalar_stages("rdiv")["tk-to-gpu"], """
        CHECK: [[N:%[0-9]+]] = arith.extf [[TWO:%cst[_0-9]*]] : bf16 to f32 loc([[LOC]])
        CHECK-NEXT: [[D:%[0-9]+]] = arith.extf %{{[0-9]+}} : bf16 to f32 loc([[LOC]])
        CHECK-NEXT: [[Q:%[0-9]+]] = llvm.inline_asm "div.full.f32 $0, $1, $2;", "=f,f,f" [[N]], [[D]] : (f32, f32) -> f32 loc([[LOC]])
        CHECK-NEXT: arith.truncf [[Q]] : f32 to bf16 loc([[LOC]])
    """, scalar_kernel, "y = 2.0 / a", "2.0 / a")


# ------------------------------------------------------------------ reduce

COMBINE = {"sum": "arith.addf", "max": "arith.maximumf", "min": "arith.minimumf"}
# Row reductions of a 1x256 tile (8 registers, lanes along the row: shuffles
# 1..16, warps replicate: no exchange); column reductions of a 64x64 tile
# (4 row registers, lane bits 3-4 and both warp bits along the column).
REDUCE_SHAPES = {"row": (1, 256), "col": (64, 64)}
REDUCE_RESULTS = {"row": rv("f32", 1, "r[]l[x,x,x,x,x]w[x,x]"),
                  "col": rv("f32", 64, "r[1,2,4]l[8,16,32,x,x]w[x,x]")}
REDUCE_CASES = [(axis, kind) for axis in ("row", "col") for kind in ("sum", "max", "min")]


def _reduce_stages(axis, kind, shape=None):
    rows, cols = shape or REDUCE_SHAPES[axis]
    return stages(reduce_kernel, tk.spec((256, 1024), f32), tk.spec((1024,), f32), KIND=kind,
                  AXIS=axis, ROWS=rows, COLS=cols)


def _reduce_expr(axis, kind):
    return f"x.{axis}_{kind}()"


@pytest.mark.parametrize("axis,kind", REDUCE_CASES)
def test_reduce_in_tk_ir(axis, kind):
    text = _reduce_stages(axis, kind)["tk"]
    check_tk_op(text, '%{{[0-9]+}} = "tk.reduce"(%0) {axis = "[[AXIS]]", kind = "[[KIND]]"} : '
                      "([[RT]]) -> [[RV]]",
                reduce_kernel, "v = " + _reduce_expr(axis, kind), _reduce_expr(axis, kind),
                AXIS=axis, KIND=kind, RT=rt("f32", *REDUCE_SHAPES[axis]), RV=REDUCE_RESULTS[axis])


@pytest.mark.parametrize("kind", ["sum", "max", "min"])
def test_row_reduce_lowers_to_a_butterfly_over_the_lanes(kind):
    # 8 registers combined, then shfl.bfly with lane masks 1, 2, 4, 8, 16, each
    # result combined with the running value; no shared memory, no barrier.
    checks = ["CHECK-COUNT-6: [[OP]] %{{[0-9]+}}, %{{[0-9]+}} : f32 loc([[LOC]])",
              "CHECK: [[X0:%[0-9]+]] = [[OP]] %{{[0-9]+}}, %{{[0-9]+}} : f32 loc([[LOC]])"]
    for i, mask in enumerate((1, 2, 4, 8, 16)):
        checks += [f"CHECK: [[S{i}:%[0-9]+]] = nvvm.shfl.sync bfly %c-1_i32{{{{[_0-9]*}}}}, "
                   f"[[X{i}]], %c{mask}_i32{{{{[_0-9]*}}}}, %c31_i32{{{{[_0-9]*}}}} : f32 -> f32 "
                   "loc([[LOC]])",
                   f"CHECK-NEXT: [[X{i + 1}:%[0-9]+]] = [[OP]] [[X{i}]], [[S{i}]] : f32 "
                   "loc([[LOC]])"]
    checks += ["CHECK-NOT: nvvm.shfl.sync", "CHECK-NOT: !llvm.ptr<3>"]
    text = _reduce_stages("row", kind)["tk-to-gpu"]
    check_lowered(text, "\n".join(checks), reduce_kernel, "v = " + _reduce_expr("row", kind),
                  _reduce_expr("row", kind), OP=COMBINE[kind])
    filecheck(text, "CHECK-NOT: nvvm.barrier0")


@pytest.mark.parametrize("kind", ["sum", "max", "min"])
def test_col_reduce_shuffles_the_row_lanes_and_exchanges_across_warps(kind):
    # 64x64 over 4 warps: each thread holds 8 columns x 4 rows; rows combine in
    # registers, then lane masks 8 and 16 (the lane bits along rows), then the
    # 4 warps (all along rows) exchange 8 partials each through shared memory.
    expr = _reduce_expr("col", kind)
    s = _reduce_stages("col", kind)
    filecheck(s["tk-allocate-smem"], """
        CHECK: tk.smem_bytes = 8192 : i64
        CHECK: "tk.reduce"(%0) {axis = "col", exchange_group = 0 : i64, exchange_sync_after = false, kind = "[[KIND]]", scratch_offset = 0 : i64}
    """, KIND=kind)
    check_lowered(s["tk-to-gpu"], """
        CHECK-COUNT-24: [[OP]] %{{[0-9]+}}, %{{[0-9]+}} : f32 loc([[LOC]])
        CHECK-COUNT-8: nvvm.shfl.sync bfly %c-1_i32{{[_0-9]*}}, %{{[0-9]+}}, %c8_i32{{[_0-9]*}}, %c31_i32{{[_0-9]*}} : f32 -> f32 loc([[LOC]])
        CHECK-COUNT-8: nvvm.shfl.sync bfly %c-1_i32{{[_0-9]*}}, %{{[0-9]+}}, %c16_i32{{[_0-9]*}}, %c31_i32{{[_0-9]*}} : f32 -> f32 loc([[LOC]])
        CHECK-NOT: nvvm.shfl.sync
        CHECK-COUNT-8: llvm.store %{{[0-9]+}}, %{{[0-9]+}} {alignment = 4 : i64} : f32, !llvm.ptr<3> loc([[LOC]])
        CHECK-NEXT: nvvm.barrier0 loc([[LOC]])
        CHECK: [[A:%[0-9]+]] = llvm.load %{{[0-9]+}} {alignment = 4 : i64} : !llvm.ptr<3> -> f32 loc([[LOC]])
        CHECK: [[B:%[0-9]+]] = llvm.load %{{[0-9]+}} {alignment = 4 : i64} : !llvm.ptr<3> -> f32 loc([[LOC]])
        CHECK-NEXT: [[OP]] [[A]], [[B]] : f32 loc([[LOC]])
        CHECK-COUNT-30: llvm.load %{{[0-9]+}} {alignment = 4 : i64} : !llvm.ptr<3> -> f32 loc([[LOC]])
        CHECK-NOT: nvvm.barrier0
    """, reduce_kernel, "v = " + expr, expr, OP=COMBINE[kind])
    filecheck(s["tk-to-gpu"], "CHECK-NOT: nvvm.shfl.sync bfly {{.*}}, %c{{[124]}}_i32")


def test_row_reduce_across_warps_exchanges_through_shared_memory():
    # 1x1024 over 4 warps: the warps split the row, so after the shuffles each
    # thread writes its partial, one barrier, and reads the 4 warps' partials.
    s = _reduce_stages("row", "sum", (1, 1024))
    filecheck(s["tk-allocate-smem"], """
        CHECK: tk.smem_bytes = 1024 : i64
        CHECK: "tk.reduce"(%0) {axis = "row", exchange_group = 0 : i64, exchange_sync_after = false, kind = "sum", scratch_offset = 0 : i64}
    """)
    check_lowered(s["tk-to-gpu"], """
        CHECK: nvvm.shfl.sync bfly {{.*}}, %c16_i32{{[_0-9]*}}, {{.*}} loc([[LOC]])
        CHECK-NEXT: [[P:%[0-9]+]] = arith.addf
        CHECK: llvm.store [[P]], %{{[0-9]+}} {alignment = 4 : i64} : f32, !llvm.ptr<3> loc([[LOC]])
        CHECK-NEXT: nvvm.barrier0 loc([[LOC]])
        CHECK-COUNT-4: llvm.load %{{[0-9]+}} {alignment = 4 : i64} : !llvm.ptr<3> -> f32 loc([[LOC]])
        CHECK-NOT: nvvm.barrier0
    """, reduce_kernel, "v = x.row_sum()", "x.row_sum()")


# --------------------------------------------------------------- broadcast

BROADCAST_CASES = [(axis, kind) for axis in ("row", "col") for kind in ("add", "sub", "mul", "div")]
# The layouts of a 16x64 vec tile's rows and columns over 4 warps.
ROW_LAYOUT, COL_LAYOUT = "r[]l[x,x,x,1,2]w[4,8]", "r[1,2,4]l[8,16,32,x,x]w[x,x]"


def _broadcast_expr(axis, kind):
    return f"x.{kind}_{axis}(v)"


def _broadcast_stages(axis, kind):
    return stages(broadcast_kernel, F32_2D, F32_1D, F32_2D, KIND=kind, AXIS=axis)


@pytest.mark.parametrize("axis,kind", BROADCAST_CASES)
def test_broadcast_in_tk_ir(axis, kind):
    expr = _broadcast_expr(axis, kind)
    check_tk_op(_broadcast_stages(axis, kind)["tk"],
                '%{{[0-9]+}} = "tk.broadcast"(%0, %1) {axis = "[[AXIS]]", kind = "[[KIND]]"} : '
                "([[RT]], [[RV]]) -> [[RT]]",
                broadcast_kernel, "y = " + expr, expr, AXIS=axis, KIND=kind, RT=RT_F32,
                RV=rv("f32", 16 if axis == "row" else 64))


@pytest.mark.parametrize("axis,kind", BROADCAST_CASES)
def test_broadcast_lowers_to_one_arith_op_per_register(axis, kind):
    expr = _broadcast_expr(axis, kind)
    if axis == "row":   # each thread's 8 registers lie on one row: one vector register
        checks = """
            CHECK: [[OP]] %{{[0-9]+}}, [[V:%[0-9]+]] [[TAIL]] loc([[LOC]])
            CHECK-COUNT-7: [[OP]] %{{[0-9]+}}, [[V]] [[TAIL]] loc([[LOC]])
            CHECK-NOT: [[OP]]
        """
    else:               # ... on 8 columns: 8 vector registers
        checks = """
            CHECK-COUNT-8: [[OP]] %{{[0-9]+}}, %{{[0-9]+}} [[TAIL]] loc([[LOC]])
            CHECK-NOT: [[OP]]
        """
    text = _broadcast_stages(axis, kind)["tk-to-gpu"]
    lowered, tail = LOWERED_F32[kind]
    check_lowered(text, checks, broadcast_kernel, "y = " + expr, expr, OP=lowered, TAIL=tail)
    if axis == "col":
        operands = re.findall(r'(?:arith\.\w+f|"=f,f,f") %\d+, (%\d+) (?:fastmath<contract> )?'
                              r": (?:\(f32, f32\) -> )?f32 loc\(" + loc_alias(
            text, broadcast_kernel, "y = " + expr, expr) + r"\)", text)
        assert len(set(operands)) == 8, operands


@tk.kernel(num_warps=4)
def skip_ones_kernel(X: tk.gl[f32], V: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (64, 64), layout="row", scope="warpgroup")
    tk.store(Y, x.mul_row(tk.load(V, (0,), (64,), scope="warpgroup"), skip_ones=True), (0, 0))


def test_mul_skipping_ones_branches_over_a_warps_multiplies():
    """mul_row(skip_ones=True): the hint in tk IR; in PTX each thread asks
    whether any of its 2 row factors is not 1, the warp votes, and its 32
    multiplies sit behind the vote's branch."""
    c = skip_ones_kernel.compile(F32_2D, F32_1D, F32_2D)
    assert re.search(r'"tk.broadcast"\(%\d+, %\d+\) \{axis = "row", kind = "mul", skip_ones = '
                     r'true\}', c.asm["tk"])
    ptx = c.asm["ptx"]
    assert len(re.findall(r"setp\.neu\.f32", ptx)) == 2
    vote = re.search(r"vote\.sync\.any\.pred\s+(%p\d+), %p\d+, -1;", ptx)
    assert vote
    after = ptx[vote.end():]
    branch = re.search(r"@!?%p\d+ bra", after)
    assert branch and len(re.findall(r"mul\.(?:rn\.)?f32", after[branch.end():])) == 32
    assert not re.findall(r"mul\.(?:rn\.)?f32", ptx[:vote.start()])


def test_mul_skipping_ones_needs_a_float_tile_and_a_constant_flag():
    @tk.kernel(num_warps=4)
    def on_ints(X: tk.gl[f32], Y: tk.gl[f32]):
        i = tk.load(X, (0, 0), (16, 64)).col_indices()
        tk.store(Y, i.mul_row(i.row_max(), skip_ones=True).to(f32), (0, 0))

    @tk.kernel(num_warps=4)
    def runtime_flag(X: tk.gl[f32], Y: tk.gl[f32], n: int):
        x = tk.load(X, (0, 0), (16, 64))
        tk.store(Y, x.mul_row(x.row_max(), skip_ones=n > 0), (0, 0))

    with pytest.raises(tk.CompilationError, match=r"mul_row\(skip_ones=True\) takes a float "
                                                  r"tile, got .*i32"):
        on_ints.compile(F32_2D, F32_2D)
    with pytest.raises(tk.CompilationError, match="skip_ones must be a compile-time True or "
                                                  "False"):
        runtime_flag.compile(F32_2D, F32_2D, 3)


@pytest.mark.parametrize("axis,layout", [("row", ROW_LAYOUT), ("col", COL_LAYOUT)])
def test_assign_layouts_gives_an_auto_vector_the_layout_of_its_tile(axis, layout):
    s = _broadcast_stages(axis, "sub")
    n = 16 if axis == "row" else 64
    filecheck(s["tk"], 'CHECK: "tk.load"(%arg1, %c0_i32_1) {{.*}} -> [[RV]]', RV=rv("f32", n))
    filecheck(s["tk-assign-layouts"], """
        CHECK-NOT: "auto"
        CHECK: %1 = "tk.load"(%arg1, %c0_i32_1) {fill = 0.000000e+00 : f32} : (!tk.gl<f32, array<i64: -1>>, i32) -> [[RV]]
        CHECK: "tk.broadcast"(%0, %1) {axis = "[[AXIS]]", kind = "sub"} : ([[RT]], [[RV]]) -> [[RT]]
    """, RV=rv("f32", n, layout), RT=RT_F32, AXIS=axis)


def test_assign_layouts_matches_the_reduction_result_layout():
    # x.sub_row(x.row_max()): the vector a reduction makes is already laid out
    # like the tile's rows; the loop kernel also carries a tile through scf.for.
    s = stages(loop_kernel, F32_2D, F32_2D)
    filecheck(s["tk-assign-layouts"], """
        CHECK: scf.for
        CHECK: "tk.reduce"({{.*}}) -> [[RV]]
        CHECK: "tk.broadcast"({{.*}}) {axis = "row", kind = "sub"} : ([[RT]], [[RV]]) -> [[RT]]
    """, RV=rv("f32", 16, ROW_LAYOUT), RT=RT_F32)


# ----------------------------------------------------------------- barrier

def test_barrier_in_tk_ir():
    text = stages(barrier_kernel, F32_2D)["tk"]
    check_tk_op(text, '"tk.barrier"() : () -> ()', barrier_kernel, "tk.barrier()")


def test_barrier_lowers_to_bar_sync_0():
    text = stages(barrier_kernel, F32_2D)["tk-to-gpu"]
    check_lowered(text, """
        CHECK: gpu.func @barrier_kernel
        CHECK: nvvm.barrier0 loc([[LOC]])
        CHECK-NEXT: gpu.return
    """, barrier_kernel, "tk.barrier()")


# ------------------------------------------------------ loops and branches

@pytest.mark.parametrize("kernel,args", [(first_load_in_loop_kernel, (F32_2D, F32_2D)),
                                         (first_load_in_branch_kernel, (F32_2D, F32_2D, 1))],
                         ids=["loop", "branch"])
def test_thread_position_is_computed_before_any_loop_or_branch(kernel, args):
    # Regression: tid/lane/warp were computed at their first use and cached; a
    # first use inside scf.for/scf.if left them in that region, and the store
    # after it failed to verify (operand does not dominate its use).
    text = stages(kernel, *args)["tk-to-gpu"]
    filecheck(text, """
        CHECK: gpu.func
        CHECK: gpu.thread_id x
        CHECK: scf.{{for|if}}
    """)
    assert text.count("gpu.thread_id") == 1


# -------------------------------------------------------------- round trip

ROUND_TRIP = {
    "shared": lambda: stages(shared_kernel, BF16_2D, BF16_2D, SWIZZLE=128),
    "reduce": lambda: _reduce_stages("col", "max"),
    "broadcast": lambda: _broadcast_stages("row", "div"),
    "scalar": lambda: _scalar_stages("mul"),
    "index": lambda: _index_stages("warpgroup_id"),
    "loop": lambda: stages(loop_kernel, F32_2D, F32_2D),
}
TK_STAGES = ("tk", "tk-assign-layouts", "tk-verify", "tk-allocate-smem", "tk-proxy-fences")


def _asm(module: ir.Module) -> str:
    # As lowering/pipeline.py prints a stage.
    return module.operation.get_asm(enable_debug_info=True, large_elements_limit=64)


@pytest.mark.parametrize("stage", TK_STAGES)
@pytest.mark.parametrize("kernel", ROUND_TRIP)
def test_tk_ir_round_trips_through_the_parser(kernel, stage):
    text = ROUND_TRIP[kernel]()[stage]
    ctx = ir.Context()
    tk_dialect.load(ctx)
    with ctx:
        module = ir.Module.parse(text)
        assert module.operation.verify()
        assert _asm(module) == text


@pytest.mark.parametrize("kernel", ["loop", "reduce", "shared"])
def test_lowering_resumes_from_parsed_tk_ir(kernel):
    # The 'tk' text, parsed back, lowers to the same stages (PTX included).
    from tk_mlir.lowering.pipeline import lower
    original = ROUND_TRIP[kernel]()
    ctx = ir.Context()
    tk_dialect.load(ctx)
    with ctx:
        lowered = lower(ir.Module.parse(original["tk"]))
    for name, text in lowered.stages.items():
        assert text == original[name], f"stage {name} differs"


# ------------------------------------------- global addresses, run on the CPU

@pytest.mark.parametrize("name, dtype, scope, shape, strides, coords", [
    ("row", "bf16", "warpgroup", (100, 72), (80,), (1, 1)),         # a partial edge tile
    ("vec", "f32", "block", (3, 50, 40), (4000, 48), (2, 0, 0)),     # rows past 50, cols past 40
    ("col", "bf16", "warpgroup", (3, 64, 256), (16384, 256), (3, 0, 1)),   # batch 3 of 3: out
    ("row", "f16", "warp", (16, 64), (64,), (0, 0)),
])
def test_global_tile_pieces_address_their_elements(name, dtype, scope, shape, strides, coords):
    """memory.global_pieces' IR, JIT-compiled on the CPU for every (lane,
    warp): each piece addresses the element its first register holds (row
    strides from the tensor), and is in bounds exactly when that element is
    inside the tensor (outer coordinates included)."""
    from lowering_jit import global_pieces
    from tk_mlir.dialects import layout as layouts, types as T
    tile = (64, 64) if scope != "warp" else (16, 64)
    warps = T.scope_warps(scope, 4)
    layout = layouts.tile_layout(name, *tile, warps)
    gl = T.GL(dtype, shape)
    pieces, results = global_pieces(gl, layout, scope, coords, strides)
    outer, (ti, tj) = coords[:-2], coords[-2:]
    for (r0, _), got in zip(pieces, results):
        for (lane, warp), (offset, ok) in got.items():
            row, col = layout.position(r0, lane, warp)
            row, col = ti * tile[0] + row, tj * tile[1] + col
            at = (*outer, row, col)
            inside = all(0 <= c < d for c, d in zip(at, shape))
            assert ok == inside, (r0, lane, warp, at)
            if inside:
                elements = sum(c * s for c, s in zip(at[:-1], strides)) + col
                assert offset == elements * T.itemsize(dtype), (r0, lane, warp, at)
