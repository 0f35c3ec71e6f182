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


# ------------------------------------------ sizes, limits and the fix in the message

@tk.kernel
def k_tile_rows(X: tk.gl[f32], Y: tk.gl[f32], R: tk.constexpr, C: tk.constexpr):
    x = tk.load(X, (0, 0), (R, C))  # E:tile-rows
    tk.store(Y, x, (0, 0))


@tk.kernel
def k_shared_rows(X: tk.gl[f32], R: tk.constexpr):
    s = tk.shared_tile(f32, (R, 64))  # E:shared-rows


@tk.kernel
def k_zeros_rows(X: tk.gl[f32], R: tk.constexpr):
    z = tk.zeros((R, 64))  # E:zeros-rows


@pytest.mark.parametrize("kernel,marker,at", [
    (k_tile_rows, "tile-rows", "tk.load"),
    (k_shared_rows, "shared-rows", "tk.shared_tile"),
    (k_zeros_rows, "zeros-rows", "tk.zeros"),
])
@pytest.mark.parametrize("rows,message", [
    (True, "(with a bool)"), (False, "(with a bool)"),
    (2**70, "up to 65536 (MAX_TILE_DIM)"), (-16, "up to 65536 (MAX_TILE_DIM)"),
    (0, "up to 65536 (MAX_TILE_DIM)"), (16.0, "(with float 16.0)"), ("16", "(with str '16')"),
])
def test_a_bad_constexpr_tile_size_is_an_error_at_its_line(kernel, marker, at, rows, message):
    kw = {"C": 64} if kernel is k_tile_rows else {}
    args = (F32, F32) if kernel is k_tile_rows else (F32,)
    e = compile_error(kernel, *args, R=rows, **kw)
    test_errors.check_error(e, marker, at, "positive compile-time ints", HERE)
    assert message in e.message


@tk.kernel
def k_rows_from_int(X: tk.gl[f32], Y: tk.gl[f32], rows: int):
    x = tk.load(X, (0, 0), (rows, 64))  # E:rows-from-int
    tk.store(Y, x, (0, 0))


def test_a_tile_size_from_an_int_parameter_suggests_constexpr():
    test_errors.check_error(compile_error(k_rows_from_int, F32, F32, 16), "rows-from-int",
                            "tk.load", "rows is an int parameter, known only at run time: "
                            "declare it `rows: tk.constexpr`", HERE)


@pytest.mark.parametrize("rows,cols,fix", [(24, 64, "rows must be a power of two, got 24; use 32"),
                                           (16, 100, "cols must be a power of two, got 100; "
                                                     "use 128")])
def test_a_tile_that_is_not_a_power_of_two_says_which_size_to_use(rows, cols, fix):
    e = compile_error(k_tile_rows, F32, F32, R=rows, C=cols)
    test_errors.check_error(e, "tile-rows", "tk.load", fix, HERE)
    assert "a tile is masked" in e.message


def _kernel_file(tmp_path, name: str, body: str):
    """A module in tmp_path holding `body` (kernel source), imported."""
    import importlib.util
    path = tmp_path / f"{name}.py"
    path.write_text("import tk_mlir as tk\nfrom tk_mlir import f32\n\n" + body)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


@pytest.mark.parametrize("op", ["+", "*", "-"])
def test_a_deep_expression_is_an_error_with_its_limit(tmp_path, op):
    terms = f" {op} x" * (300 + np.random.randint(100))
    module, path = _kernel_file(tmp_path, f"deep{ord(op)}", (
        "@tk.kernel\ndef deep(X: tk.gl[f32]):\n"
        "    x = tk.load(X, (0, 0), (16, 64))\n"
        f"    y = x{terms}\n"
        "    tk.store(X, y, (0, 0))\n"))
    e = compile_error(module.deep, F32)
    assert "nests more than 100 operations deep (MAX_EXPRESSION_DEPTH" in e.message
    assert (Path(e.filename), e.line) == (path, 7)


def test_an_expression_within_the_limit_compiles(tmp_path):
    module, _ = _kernel_file(tmp_path, "shallow", (
        "@tk.kernel\ndef shallow(X: tk.gl[f32], Y: tk.gl[f32]):\n"
        "    x = tk.load(X, (0, 0), (16, 64))\n"
        f"    y = x{' + x' * 60}\n"
        "    tk.store(Y, y, (0, 0))\n"))
    import torch
    x, y = torch.randn(16, 64), torch.full((16, 64), float("nan"))
    module.shallow.interpret[(1,)](x, y)
    assert torch.allclose(y, x * 61, rtol=1e-5)


@tk.kernel
def k_unroll(X: tk.gl[f32], N: tk.constexpr, M: tk.constexpr):
    s = 0
    for i in tk.static_range(N):  # E:unroll-outer
        for j in tk.static_range(M):  # E:unroll-inner
            s = s + 1


@pytest.mark.parametrize("n,m,marker,message", [
    (200_000, 1, "unroll-outer", "tk.static_range unrolls at most 1024 iterations "
                                 "(MAX_STATIC_RANGE), got 200000"),
    (2**70, 1, "unroll-outer", "MAX_STATIC_RANGE"),
    (4, 1025, "unroll-inner", "got 1025"),
    (100, 100, "unroll-inner", "more than 4096 loop bodies in all (MAX_UNROLLED"),
])
def test_compile_time_unrolling_is_capped(n, m, marker, message):
    import time
    start = time.monotonic()
    e = compile_error(k_unroll, F32, N=n, M=m)
    assert time.monotonic() - start < 30
    test_errors.check_error(e, marker, "tk.static_range", message, HERE)


def plain_helper(x):
    return x * 2.0


@tk.kernel
def k_plain_helper(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(X, plain_helper(x), (0, 0))  # E:plain-helper


@tk.kernel
def k_if_on_tile(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    if x > 0:  # E:if-tile
        x = x * 2.0


@tk.kernel
def k_misspelled(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64), fil=0.0)  # E:misspelled


@tk.kernel
def k_misspelled_method(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(X, x, (0, 0), cach="stream")  # E:misspelled-store


@tk.kernel
def k_undefined(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(X, xx, (0, 0))  # E:undefined


def make_closure_kernel():
    scale = 2.0

    @tk.kernel
    def k_closure(X: tk.gl[f32]):
        x = tk.load(X, (0, 0), (16, 64))
        tk.store(X, x * scale, (0, 0))  # E:closure
    return k_closure


@pytest.mark.parametrize("kernel,marker,at,message", [
    (k_plain_helper, "plain-helper", "plain_helper(x)",
     "plain_helper is a plain Python function, run only on compile-time values: decorate "
     "it with @tk.func"),
    (k_if_on_tile, "if-tile", "x > 0", "to choose per element write tk.where(mask, a, b)"),
    (k_misspelled, "misspelled", "tk.load", "tk.load() has no keyword argument 'fil'; did you "
                                            "mean 'fill'?"),
    (k_misspelled_method, "misspelled-store", "tk.store", "did you mean 'cache'?"),
    (k_undefined, "undefined", "xx", "name 'xx' is not defined; did you mean 'x'?"),
    (make_closure_kernel(), "closure", "scale", "'scale' is a variable of the function this "
                                                "one is defined in (a closure)"),
])
def test_a_mistake_names_its_fix(kernel, marker, at, message):
    test_errors.check_error(compile_error(kernel, F32), marker, at, message, HERE)


class NotAFunction:
    pass


async def coroutine(X):
    pass


@pytest.mark.parametrize("obj,what", [
    (print, "the built-in 'print'"), (NotAFunction, "the class"), (len, "the built-in 'len'"),
    (lambda X: X, "a lambda"), (coroutine, "the async function"), (3, "3 (a int)"),
])
def test_tk_kernel_on_something_not_a_def_says_what_it_got(obj, what):
    with pytest.raises(tk.CompilationError) as info:
        tk.kernel(obj)
    assert "applies to a function defined with `def`" in info.value.message
    assert what in info.value.message
    assert "exec" not in info.value.message


def test_tk_kernel_twice_and_func_as_kernel_are_refused():
    with pytest.raises(tk.CompilationError, match="a kernel already"):
        tk.kernel(k_undefined)
    with pytest.raises(tk.CompilationError, match="applies to a function defined with"):
        tk.func(print)
