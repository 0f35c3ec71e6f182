"""Mistakes a new user makes, each a CompilationError at its line (never an
internal error or a raw Python exception): wrong argument counts to
builtins, tiles where numbers are expected, run-time values where a
compile-time one is needed. Found by compiling wrong kernels on purpose."""
from pathlib import Path

import numpy as np
import pytest

import test_errors
import tk_mlir as tk
from tk_mlir import f32
from test_errors import compile_error

HERE = Path(__file__).resolve()
F32 = tk.spec((64, 64), "f32")


@tk.kernel
def k_select_tiles(X: tk.gl[f32]):
    t = tk.zeros((16, 64))
    u = t if tk.block_id(0) > 0 else t * 2.0  # E:select-tiles


@tk.kernel
def k_select_on_tile(X: tk.gl[f32]):
    t = tk.zeros((16, 64))
    u = 1.0 if t else 2.0  # E:select-on-tile


@tk.kernel
def k_select_on_int(X: tk.gl[f32]):
    u = 1.0 if tk.block_id(0) else 2.0  # E:select-on-int


@tk.kernel
def k_range_over_tile(X: tk.gl[f32]):
    t = tk.zeros((16, 64))
    for i in range(t):  # E:range-tile
        pass


@tk.kernel
def k_method_arity(X: tk.gl[f32]):
    t = tk.zeros((16, 64))
    u = t.row_sum(1, 2, 3)  # E:method-arity


@tk.kernel
def k_static_range_float(X: tk.gl[f32]):
    for i in tk.static_range(2.5):  # E:static-range-float
        pass


@tk.kernel
def k_tuple_index(X: tk.gl[f32]):
    a = (1, 2)
    b = a[5]  # E:tuple-index


@tk.kernel
def k_block_id_runtime(X: tk.gl[f32]):
    i = tk.block_id(tk.block_id(0))  # E:block-id


@tk.kernel
def k_subscript_tile(X: tk.gl[f32]):
    t = tk.zeros((16, 64))
    u = t[0]  # E:subscript-tile


@tk.kernel
def k_tile_chosen_by_if(X: tk.gl[f32]):
    a = tk.shared_tile(f32, (16, 64))
    b = tk.shared_tile(f32, (16, 64))
    if tk.block_id(0) > 0:  # E:tile-by-if
        a, b = b, a
    tk.copy(a, X, (0, 0))


@tk.kernel
def k_tile_swapped_in_loop(X: tk.gl[f32]):
    a = tk.shared_tile(f32, (16, 64))
    b = tk.shared_tile(f32, (16, 64))
    for i in range(tk.block_id(0)):  # E:tile-in-loop
        a, b = b, a
    tk.copy(a, X, (0, 0))


@tk.kernel
def k_zeros_runtime_shape(X: tk.gl[f32]):
    t = tk.zeros((tk.block_id(0), 64))  # E:zeros-runtime


@tk.kernel
def k_spread_number(X: tk.gl[f32]):
    t = tk.load(X, (*tk.block_id(0), 0), (16, 64))  # E:spread-number


@tk.kernel
def k_spread_in_call(X: tk.gl[f32]):
    t = tk.zeros(*16)  # E:spread-call


@pytest.mark.parametrize("kernel,marker,at,message", [
    (k_spread_number, "spread-number", "*tk.block_id(0)",
     "*tk.block_id(0) spreads a compile-time tuple or list (or a tensor's shape), not Scalar"),
    (k_spread_in_call, "spread-call", "*16",
     "*16 spreads a compile-time tuple or list (or a tensor's shape), not int"),
    (k_zeros_runtime_shape, "zeros-runtime", "tk.zeros", "a tile's shape is (rows, cols) or "
                                                        "(length,) of positive compile-time ints"),
    (k_tile_chosen_by_if, "tile-by-if", "if", "a shared tile cannot be chosen by a run-time if"),
    (k_tile_swapped_in_loop, "tile-in-loop", "for", "a shared tile cannot be changed from one "
                                                    "loop iteration to the next"),
    (k_select_tiles, "select-tiles", "t if", "x if c else y with a run-time condition chooses "
                                            "between numbers, not <Tile"),
    (k_select_on_tile, "select-on-tile", "t else", "a condition must be a comparison or a bool"),
    (k_select_on_int, "select-on-int", "tk.block_id(0) else",
     "a condition must be a comparison or a bool"),
    (k_range_over_tile, "range-tile", "range(t)", "range bounds must be integers, got 0, <Tile"),
    (k_method_arity, "method-arity", "t.row_sum",
     "TypeError: Tile.row_sum() takes 1 positional argument but 4 were given"),
    (k_static_range_float, "static-range-float", "tk.static_range",
     "TypeError: 'float' object cannot be interpreted as an integer"),
    (k_tuple_index, "tuple-index", "a[5]", "IndexError: tuple index out of range"),
    (k_block_id_runtime, "block-id", "tk.block_id(tk", "dim must be 0, 1 or 2 (x, y, z)"),
    (k_subscript_tile, "subscript-tile", "t[0]", "TypeError: 'Tile' object is not subscriptable"),
])
def test_mistake_is_a_compile_error_at_its_line(kernel, marker, at, message):
    test_errors.check_error(compile_error(kernel, F32), marker, at, message, HERE)


# Its truth is refused by C code (no Python frame of the user's below ours).
AMBIGUOUS = np.array([1, 2])


@tk.kernel
def k_ambiguous_if(X: tk.gl[f32]):
    if AMBIGUOUS:  # E:ambiguous
        pass


def test_truth_of_a_compile_time_value_is_the_users():
    test_errors.check_error(compile_error(k_ambiguous_if, F32), "ambiguous", "AMBIGUOUS",
                            "ValueError: The truth value of an array with more than one "
                            "element is ambiguous", HERE)


def takes_node_and_fn(node, fn):
    return node + fn


@tk.kernel
def k_keywords_like_ours(X: tk.gl[f32], N: tk.constexpr):
    # The frontend's own parameter names, passed as keywords to a user helper.
    assert takes_node_and_fn(node=N, fn=1) == N + 1, "wrong sum"


def test_helper_keywords_do_not_clash_with_the_frontends():
    x = tk.spec((64, 64), "f32")
    assert k_keywords_like_ours.compile(x, N=2).asm["ptx"]


@tk.kernel(num_warps=4)
def k_zeros_arguments_swapped(X: tk.gl[tk.f32]):
    z = tk.zeros(tk.f32, (16, 64))  # E:zeros-swapped


def test_zeros_with_its_arguments_swapped_is_a_user_error():
    test_errors.check_error(compile_error(k_zeros_arguments_swapped, F32), "zeros-swapped",
                            "tk.zeros", "tk.zeros: the first argument is the shape, (rows, "
                            "cols) or (length,), got tk.f32", HERE)


@tk.kernel
def spreads(X: tk.gl[f32], Y: tk.gl[f32]):
    shape = (*X.shape,)                          # a tensor's dims, static or not
    outer = ()
    tile = tk.load(X, (*outer, *[0], 0), (16, 64))
    tk.store(Y, tile * (shape[1] * 1.0), (*(0, 0),))


def test_spreads_in_displays_and_calls():
    import torch
    x, y = torch.randn(16, 64), torch.full((16, 64), float("nan"))
    spreads.interpret[(1,)](x, y)
    assert torch.equal(y, x * 64.0)
