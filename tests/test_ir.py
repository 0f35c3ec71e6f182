"""FileCheck tests of the tk IR of every op and of what tk-to-gpu makes of it."""
from __future__ import annotations

import inspect

import pytest

import tk_mlir as tk
from tk_mlir import bf16, f32

from filecheck_util import filecheck

# ---------------------------------------------------------------- kernels
# Module-level (the frontend reads their source with inspect). Each is tiny;
# constexprs pick the op, so one kernel covers a family and each op sits on
# a line of its own (the location tests look for that line).


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
    tk.store(V, w, (0,))


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
def fill_kernel(Y: tk.gl[bf16], V: tk.gl[f32]):
    tk.store(Y, tk.full((16, 64), 2.5, bf16), (0, 0))
    tk.store(V, tk.zeros((64,)), (0,))


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
    tk.store(Y, tk.load(X, (0, 0), (16, 64)).exp(), (0, 0))


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
