"""Compile errors as the kernel author sees them, each checked at the line
of this file that its kernel marks `# E:<name>` (error_checks.check_error):
the message, the file, the line and column of the user's code, the rendered
text (file:line:col, the source line, a caret under the column), and a
traceback that shows no compiler internals, in a new process too.

- Python a kernel cannot run (while, break, lambda, try, ** on run-time
  values, a plain function called on run-time values, ...) and tile rules
  broken (shapes, layouts, dtypes, coordinates, shared memory), at their
  line; errors at decoration (a parameter without an annotation).
- The mistakes a new user makes, each a CompilationError at its line, never
  an internal error or a raw Python exception: wrong argument counts to
  builtins, tiles where numbers are expected, run-time values where a
  compile-time one is needed, tile sizes and compile-time limits (expression
  depth, unrolling); where there is one fix, the message names it.
- The user's errors and tk_mlir's own bugs told apart (errors.py): an
  exception from the user's Python run at compile time (a helper they
  wrote, an operator on their constexprs, a builtin called with the wrong
  arguments) is a CompilationError at their line; one raised inside tk_mlir
  (a builtin, a pass, the lowering, ptxas) is an InternalCompilerError
  naming the kernel and the stage, chained to the original; a failing pass
  saves the IR before it and says how to replay the pass. TK_MLIR_DEBUG=1
  keeps the user's original traceback too.
- Recursion is unrolled at compile time: it works when it ends on
  compile-time values and is refused at the recursive call's line, naming
  the function, when it cannot end (a run-time count) or nests too deep.

The kernels live at module level: only compiling them raises. Errors of a
launch's arguments: test_launch_errors.py.
"""
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import numpy as np
import pytest

import error_checks
import markers
import tk_mlir as tk
from error_checks import INTERNAL, FakeCudaArray, compile_error, tk_frames
from tk_mlir import bf16, compiler, f32
from tk_mlir.dialects import types as T
from tk_mlir.errors import InternalCompilerError, raised_in_tk_mlir
from tk_mlir.frontend import MAX_INLINE_DEPTH
from tk_mlir.lowering import pipeline

HERE = Path(__file__).resolve()
REPO = Path(tk.__file__).resolve().parent.parent
F32 = tk.spec((64, 64), "f32")
BF16 = tk.spec((64, 64), "bf16")


def marked(marker: str) -> tuple[int, str]:
    """(line number, text) of the line of this file ending in `# E:<marker>`."""
    return markers.marked(HERE, marker)


def check_error(e: tk.CompilationError, marker: str, at: str, message):
    """e points at `at` on the line of this file marked `marker` and says `message`."""
    error_checks.check_error(e, marker, at, message, HERE)


# ------------------------------------------- kernels: unsupported Python, tile rules

def helper(x):
    return x


@tk.kernel
def k_while(X: tk.gl[f32]):
    i = tk.block_id(0)
    while i < 4:  # E:while
        i = i + 1


@tk.kernel
def k_loop_name_reused(X: tk.gl[f32], n: int):
    t = tk.block_id(0)
    for _ in range(n):  # E:reused
        t = [tk.shared_tile(f32, (64, 64)), tk.shared_tile(f32, (64, 64))]
        tk.store(X, tk.load(t[0]), (0, 0))


@tk.kernel
def k_loop_helper_returns_nothing(X: tk.gl[f32], n: int):
    def step_without_return(acc, x):
        acc = acc + x            # (no return: the caller gets None)
    acc = tk.zeros((16, 16), f32)
    for _ in range(n):  # E:noreturn
        acc = step_without_return(acc, tk.load(X, (0, 0), (16, 16)))
    tk.store(X, acc, (0, 0))


@tk.func
def store_three_coordinates(X, t):
    tk.store(X, t, (0, 0, 0))  # E:in-func


@tk.kernel
def k_error_in_a_func(X: tk.gl[f32]):
    store_three_coordinates(X, tk.zeros((16, 16), f32))  # E:func-call


@tk.kernel(num_warps=12)
def k_block_tile_over_12_warps(X: tk.gl[f32]):
    acc = tk.zeros((64, 64), f32, layout="row")  # E:twelve
    tk.store(X, acc, (0, 0))


@tk.kernel
def k_break(X: tk.gl[f32], n: int):
    for i in range(n):
        break  # E:break


@tk.kernel
def k_continue(X: tk.gl[f32], n: int):
    for i in range(n):
        continue  # E:continue


@tk.kernel
def k_lambda(X: tk.gl[f32]):
    f = lambda v: v  # E:lambda


@tk.kernel
def k_listcomp(X: tk.gl[f32]):
    xs = [i for i in range(4) for j in range(2)]  # E:listcomp


@tk.kernel
def k_try(X: tk.gl[f32]):
    try:  # E:try
        pass
    except Exception:
        pass


@tk.kernel
def k_with(X: tk.gl[f32]):
    with open("x"):  # E:with
        pass


@tk.kernel
def k_pow(X: tk.gl[f32]):
    i = tk.block_id(0)
    j = i ** 2  # E:pow


@tk.kernel
def k_return_value(X: tk.gl[f32]):
    i = tk.block_id(0)
    return i  # E:return


@tk.kernel
def k_return_in_runtime_if(X: tk.gl[f32], n: int):
    if n > 3:
        return  # E:runtime-return
    tk.store(X, tk.zeros((16, 16), f32), (0, 0))


@tk.kernel(num_warps=4)
def k_return_under_constexpr_if(X: tk.gl[f32], Y: tk.gl[f32], SKIP: tk.constexpr):
    x = tk.load(X, (0, 0), (64, 64))
    if SKIP:
        tk.store(Y, x, (0, 0))
        return
    tk.store(Y, x * 2.0, (0, 0))


@tk.kernel
def k_loop_over_a_number(X: tk.gl[f32], n: int):
    for i in n:  # E:loop-over-number
        pass


@tk.kernel(num_warps=4)
def k_loops_over_sequences(X: tk.gl[f32], Y: tk.gl[f32]):
    tiles = [tk.load(X, (i, 0), (16, 64)) for i in range(4)]
    acc = tiles[0]
    for t in tiles[1:]:
        acc = acc + t
    for i, s in enumerate((1.0, 2.0)):
        acc = acc * (s + i)
    tk.store(Y, acc, (0, 0))


@tk.func
def negated_if(x, NEG):
    """A helper returning early under a compile-time if."""
    if NEG:
        return -x
    return x


@tk.kernel(num_warps=4)
def k_helpers_return_under_constexpr_ifs(X: tk.gl[f32], Y: tk.gl[f32], NEG: tk.constexpr):
    def doubled_if(x, TWICE):
        if TWICE:
            return x * 2.0
        return x
    tk.store(Y, doubled_if(negated_if(tk.load(X, (0, 0), (64, 64)), NEG), not NEG), (0, 0))


@tk.kernel
def k_call(X: tk.gl[f32]):
    i = tk.block_id(0)
    j = helper(i)  # E:call


@tk.kernel
def k_shape(X: tk.gl[f32]):
    a = tk.zeros((16, 64))
    b = tk.zeros((16, 128))
    c = a + b  # E:shape


@tk.kernel
def k_store_dtype(Y: tk.gl[bf16]):
    a = tk.zeros((16, 64))
    tk.store(Y, a, (0, 0))  # E:store-dtype


@tk.kernel
def k_layout(X: tk.gl[f32]):
    a = tk.zeros((64, 64), layout="vec")
    b = tk.zeros((64, 64), layout="row")
    c = a + b  # E:layout


@tk.kernel
def k_sub_row(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    v = x.col_sum()
    y = x.sub_row(v)  # E:sub-row


@tk.kernel
def k_load_coords(X: tk.gl[f32]):
    x = tk.load(X, (0,), (16, 64))  # E:load-coords


@tk.kernel
def k_store_coords(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(X, x, (0, 0, 0))  # E:store-coords


@tk.kernel
def k_loop_type(X: tk.gl[f32], n: int):
    acc = 0
    for i in range(n):  # E:loop-type
        acc = acc + 1.5


@tk.kernel
def k_undefined(X: tk.gl[f32]):
    y = nope + 1  # E:undefined


@tk.kernel
def k_smem_total(X: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (256, 256))  # 128 KiB: fits
    b = tk.shared_tile(bf16, (256, 256))  # E:smem-total


@tk.kernel
def k_smem_one(X: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (512, 512))  # E:smem-one


@tk.kernel
def k_swizzle_too_wide(X: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (64, 32), swizzle=128)  # E:swizzle-wide


@tk.kernel
def k_swizzle_none_fits(X: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (64, 8), swizzle=32)  # E:swizzle-none


@tk.kernel(num_warps=4)
def k_fp8(X: tk.gl[tk.f8e4m3], Y: tk.gl[tk.f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 64)).to(tk.f32), (0, 0))  # E:fp8


# ------------------------------------------------------ unsupported syntax

@pytest.mark.parametrize("kernel,args,marker,at,message", [
    pytest.param(k_while, (F32,), "while", "while",
                 "while loops are not supported; use for ... in range(...)", id="while"),
    pytest.param(k_break, (F32, 1), "break", "break", "break (a loop runs all its iterations: guard the body with an "
                 "if) is not supported in a tk kernel",
                 id="break"),
    pytest.param(k_continue, (F32, 1), "continue", "continue",
                 "continue (guard the rest of the body with an if) is not supported", id="continue"),
    pytest.param(k_lambda, (F32,), "lambda", "lambda", "lambda (define a function with def) is not supported",
                 id="lambda"),
    pytest.param(k_listcomp, (F32,), "listcomp", "[i for",
                 "only single-`for` comprehensions are supported", id="listcomp"),
    pytest.param(k_try, (F32,), "try", "try", "try is not supported in a tk kernel", id="try"),
    pytest.param(k_with, (F32,), "with", "with", "with is not supported in a tk kernel",
                 id="with"),
    pytest.param(k_pow, (F32,), "pow", "i ** 2", "** on run-time values is not supported", id="pow"),
    pytest.param(k_return_value, (F32,), "return", "return",
                 "a kernel returns nothing; write results with tk.store", id="return-value"),
    pytest.param(k_return_in_runtime_if, (F32, 1), "runtime-return", "return",
                 "return inside a run-time if or loop of a kernel is not supported",
                 id="return-in-runtime-if"),
    pytest.param(k_loop_over_a_number, (F32, 3), "loop-over-number", "n:",
                 "or over a compile-time sequence", id="loop-over-a-number"),
    pytest.param(k_call, (F32,), "call", "helper(i)",
                 "calling helper() on run-time values is not supported in a kernel: only tk.* "
                 "functions, tile methods and @tk.func helpers take them", id="python-call"),
    pytest.param(k_undefined, (F32,), "undefined", "nope", "name 'nope' is not defined",
                 id="undefined-name"),
])
def test_unsupported_python(kernel, args, marker, at, message):
    check_error(compile_error(kernel, *args), marker, at, message)


def test_a_loop_carried_name_given_none_asks_for_the_missing_return():
    """A tile reassigned in a loop the result of a helper that forgot its
    `return`: the error says so, at the loop, and calls the tile a tile."""
    check_error(compile_error(k_loop_helper_returns_nothing, F32, 3), "noreturn", "for",
                "'acc' is <Tile: f32 16x16 tile (vec, block)> before the loop and None after "
                "one iteration: was it assigned the result of a function (a helper, or a "
                "tk.lcf callback) that ends without `return`?")


def test_an_error_in_a_tk_func_shows_the_call_that_led_there():
    e = compile_error(k_error_in_a_func, F32)
    check_error(e, "in-func", "tk.store", "tk.store needs 2 coordinates")
    line, text = markers.marked(HERE, "func-call")
    assert e.callers == [(str(HERE), line)]
    assert str(e).split("\n")[3] == f"  called from {HERE}:{line}: {text.strip()}"


def test_a_block_tile_in_a_kernel_of_twelve_warps_is_told_of_scopes():
    check_error(compile_error(k_block_tile_over_12_warps, F32), "twelve", "tk.zeros",
                'warps must be a power of two, got 12: a tile spreads over a power of two of '
                'warps; in a kernel of 12 warps give it scope="warpgroup" (4 warps) or '
                'scope="warp"')


def test_a_loop_carried_name_given_something_else_is_named():
    """A number reassigned in a loop to something that cannot be carried (a
    list of shared tiles): the name, both kinds and the fix, at the loop."""
    check_error(compile_error(k_loop_name_reused, F32, 3), "reused", "for",
                "'t' is a number (i32) before the loop and a list of 2 (Shared) after one "
                "iteration: a name the loop reassigns is carried from one iteration to the "
                "next and keeps its type; give the new value another name")


@tk.kernel
def k_one_branch(X: tk.gl[f32], n: int):
    if n > 1:
        t = tk.load(X, (0, 0), (16, 64))
    tk.store(X, t, (0, 0))  # E:one-branch


@tk.kernel
def k_only_in_loop(X: tk.gl[f32], n: int):
    for _ in range(n):
        last = tk.load(X, (0, 0), (16, 64))
    tk.store(X, last, (0, 0))  # E:only-in-loop


@tk.kernel
def k_shape_past_rank(X: tk.gl[f32]):
    tk.store(X, tk.load(X, (0, 0), (16, 64)) * X.shape[2], (0, 0))  # E:shape-rank


# ------------------------------------------------------------- tile rules

def test_a_name_a_run_time_if_or_loop_left_undefined_says_why():
    line = marked("one-branch")[0] - 2
    check_error(compile_error(k_one_branch, F32, 3), "one-branch", "t, (0",
                f"'t' is assigned in only one branch of the run-time `if` at line {line}, so it "
                f"has no value after it; give it a value before the `if` (or in both branches)")
    line = marked("only-in-loop")[0] - 2
    check_error(compile_error(k_only_in_loop, F32, 3), "only-in-loop", "last",
                f"'last' is first assigned inside the run-time loop at line {line}, so it has "
                f"no value after the loop (the loop may not run); give it a value before the "
                f"loop to carry it through")


def test_a_dim_past_the_tensors_rank_is_the_users_error():
    check_error(compile_error(k_shape_past_rank, F32), "shape-rank", "X.shape[2]",
                "a tensor of rank 2 has dims 0 .. 1 (or -1 .. -2): .shape[2] is none of them")


def test_shape_mismatch():
    check_error(compile_error(k_shape, F32), "shape", "a + b",
                "add: operands differ: f32 16x64 tile (vec, block) and f32 16x128 tile "
                "(vec, block)")


def test_store_dtype_mismatch():
    check_error(compile_error(k_store_dtype, BF16), "store-dtype", "tk.store",
                "tk.store: the tile is f32 but the tensor is bf16; convert with .to(tk.bf16)")


@tk.kernel
def k_dtypes(X: tk.gl[f32]):
    x = tk.zeros((16, 64))
    y = x + x.to(tk.bf16)  # E:dtypes


@tk.kernel
def k_mod(X: tk.gl[f32]):
    x = tk.zeros((16, 64))
    y = x % 2.0  # E:mod


def test_dtype_mismatch_and_an_operator_tiles_do_not_take_say_what_to_do():
    check_error(compile_error(k_dtypes, F32), "dtypes", "x + x",
                "add: operands differ in dtype: f32 16x64 tile (vec, block) and bf16 16x64 "
                "tile (vec, block); convert one first (x.to(tk.f32) or y.to(tk.bf16))")
    check_error(compile_error(k_mod, F32), "mod", "x % 2.0",
                "operator % is not defined on tiles (elementwise tiles take +, -, *, /, &, |, "
                "^); compute indices and offsets on scalars")


def test_layout_mismatch():
    check_error(compile_error(k_layout, F32), "layout", "a + b",
                "add: operands differ in layout or scope: f32 64x64 tile (vec, block) and "
                "f32 64x64 tile (row, block)")


def test_sub_row_vector_of_wrong_length():
    check_error(compile_error(k_sub_row, F32), "sub-row", "x.sub_row(v)",
                "sub_row: needs a vector of 16 (one per row), got f32 vector of 64")


def test_load_coordinates_count_differs_from_rank():
    check_error(compile_error(k_load_coords, F32), "load-coords", "tk.load",
                "tk.load needs 2 coordinates for a rank-2 tensor (one per dim), got 1")


def test_store_coordinates_count_differs_from_rank():
    check_error(compile_error(k_store_coords, F32), "store-coords", "tk.store",
                "tk.store needs 2 coordinates for a rank-2 tensor (one per dim), got 3")


def test_loop_variable_changes_type():
    # Reported at the loop (where the carried value's type must stay put), not
    # at the assignment inside it.
    check_error(compile_error(k_loop_type, F32, 4), "loop-type", "for",
                "'acc' starts as an int and becomes a float in the loop; initialise it with "
                "a float (e.g. 0.0)")


def test_shared_memory_exhausted_at_the_allocating_line():
    e = compile_error(k_smem_total, BF16)
    check_error(e, "smem-total", "tk.shared_tile",
                "shared memory exhausted: the tiles and semaphores allocated up to here need 262144 bytes, "
                f"a block has {227 * 1024}")


def test_one_shared_tile_over_the_limit():
    check_error(compile_error(k_smem_one, BF16), "smem-one", "tk.shared_tile",
                f"bf16 512x512 shared tile needs 524288 bytes; a block has {227 * 1024} bytes "
                f"of shared memory")


def test_a_row_narrower_than_its_swizzle_names_the_swizzle_that_fits():
    check_error(compile_error(k_swizzle_too_wide, BF16), "swizzle-wide", "tk.shared_tile",
                "with swizzle=128 a row is stored in blocks of 128 bytes, so it must be a "
                "multiple of 128 bytes (64 bf16), got 64; swizzle=64 fits rows of 64 bytes")
    check_error(compile_error(k_swizzle_none_fits, BF16), "swizzle-none", "tk.shared_tile",
                "got 16; swizzle=0 takes rows of any width")


def test_errors_are_not_cached():
    """A failed compile leaves nothing behind: the same call fails the same way."""
    first = compile_error(k_shape, F32)
    second = compile_error(k_shape, F32)
    assert str(first) == str(second)


def test_column_of_a_kernel_defined_in_a_function():
    @tk.kernel
    def nested(X: tk.gl[f32]):
        a = tk.zeros((16, 64))
        b = tk.zeros((16, 128))
        c = a + b  # E:nested

    check_error(compile_error(nested, F32), "nested", "a + b", "add: operands differ")


def test_fp8_tiles_are_refused_at_their_line():
    with pytest.raises(tk.CompilationError) as e:
        k_fp8.compile(tk.spec((16, 64), "f8e4m3"), tk.spec((16, 64), "f32"))
    assert "fp8" in e.value.message and "not lowered yet" in e.value.message
    assert e.value.line == marked("fp8")[0]


# ------------------------------------------------------ decoration errors

def test_missing_annotation_is_an_error_at_decoration():
    with pytest.raises(tk.CompilationError) as info:
        @tk.kernel  # E:annotation-decorator
        def unannotated(X, Y: tk.gl[f32]):  # E:annotation-def
            pass
    e = info.value
    assert e.message == ("kernel parameter 'X' needs an annotation: tk.gl[dtype] for a tensor, "
                         "int or float for a scalar, tk.constexpr for a compile-time constant")
    # At the user's kernel: the decorator or the def line (the parameter itself
    # would be best).
    assert e.filename is not None and Path(e.filename).resolve() == HERE
    lines = {marked("annotation-decorator")[0]: marked("annotation-decorator")[1],
             marked("annotation-def")[0]: marked("annotation-def")[1]}
    assert e.line in lines
    assert str(e).split("\n")[1] == "    " + lines[e.line].rstrip()
    assert e.__cause__ is None and e.__suppress_context__
    assert all(Path(f.filename).name == "kernel.py" for f in tk_frames(e.__traceback__))


def test_num_warps_not_a_power_of_two_at_decoration():
    with pytest.raises((tk.ArgumentError, tk.CompilationError, ValueError),
                       match="power of two"):
        @tk.kernel(num_warps=3)
        def three_warps(X: tk.gl[f32]):
            pass


# ------------------------------------------------------------- tracebacks

def test_traceback_in_a_new_process_shows_no_compiler_frames(tmp_path):
    """Uncaught, as a user running a script sees it."""
    (tmp_path / "user_kernel.py").write_text(textwrap.dedent("""\
        import tk_mlir as tk
        from tk_mlir import f32


        @tk.kernel
        def bad(X: tk.gl[f32]):
            a = tk.zeros((16, 64))
            b = tk.zeros((16, 128))
            c = a + b
    """))
    (tmp_path / "main.py").write_text(textwrap.dedent("""\
        import tk_mlir as tk
        from user_kernel import bad

        bad.compile(tk.spec((64, 64), "f32"))
    """))
    proc = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    err = proc.stderr
    assert err.startswith("Traceback (most recent call last):"), err
    assert "During handling of the above exception" not in err
    assert "The above exception was the direct cause" not in err
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', err)
    assert frames[0] == (str(tmp_path / "main.py"), "<module>"), frames
    internal = [f for f in frames if Path(f[0]).name in INTERNAL
                or "lowering" in Path(f[0]).parts or "passes" in Path(f[0]).parts]
    assert not internal, err
    assert f"{tmp_path / 'user_kernel.py'}:9:9: error: add: operands differ" in err
    assert err.rstrip().endswith("        c = a + b\n            ^"), err


@pytest.mark.parametrize("how", ["compile", "launch"])
def test_traceback_is_cut_at_the_public_entry(how):
    with pytest.raises(tk.CompilationError) as info:
        if how == "compile":
            k_shape.compile(F32)
        else:
            k_shape[(1,)](FakeCudaArray((64, 64), "<f4"))
    names = [f.name for f in tk_frames(info.value.__traceback__)]
    assert names == [how], names


# --------------------------------------------------- the mistakes of a new user

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
     "row_sum(): too many positional arguments"),
    (k_static_range_float, "static-range-float", "tk.static_range",
     "TypeError: 'float' object cannot be interpreted as an integer"),
    (k_tuple_index, "tuple-index", "a[5]", "IndexError: tuple index out of range"),
    (k_block_id_runtime, "block-id", "tk.block_id(tk", "dim must be 0, 1 or 2 (x, y, z)"),
    (k_subscript_tile, "subscript-tile", "t[0]", "TypeError: 'Tile' object is not subscriptable"),
])
def test_mistake_is_a_compile_error_at_its_line(kernel, marker, at, message):
    check_error(compile_error(kernel, F32), marker, at, message)


# Its truth is refused by C code (no Python frame of the user's below ours).
AMBIGUOUS = np.array([1, 2])


@tk.kernel
def k_ambiguous_if(X: tk.gl[f32]):
    if AMBIGUOUS:  # E:ambiguous
        pass


def test_truth_of_a_compile_time_value_is_the_users():
    check_error(compile_error(k_ambiguous_if, F32), "ambiguous", "AMBIGUOUS",
                "ValueError: The truth value of an array with more than one element is "
                "ambiguous")


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
    check_error(compile_error(k_zeros_arguments_swapped, F32), "zeros-swapped", "tk.zeros",
                "tk.zeros: the first argument is the shape, (rows, cols) or (length,), got "
                "tk.f32")


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
    check_error(e, marker, at, "positive compile-time ints")
    assert message in e.message


@tk.kernel
def k_rows_from_int(X: tk.gl[f32], Y: tk.gl[f32], rows: int):
    x = tk.load(X, (0, 0), (rows, 64))  # E:rows-from-int
    tk.store(Y, x, (0, 0))


def test_a_tile_size_from_an_int_parameter_suggests_constexpr():
    check_error(compile_error(k_rows_from_int, F32, F32, 16), "rows-from-int", "tk.load",
                "rows is an int parameter, known only at run time: declare it "
                "`rows: tk.constexpr`")


@pytest.mark.parametrize("rows,cols,fix", [
    (24, 64, "rows must be a power of two or a multiple of 16, got 24; use 32"),
    (16, 100, "cols must be a power of two or a multiple of 16, got 100; use 112"),
    (3, 64, "rows must be a power of two or a multiple of 16, got 3; use 4")])    # the nearest
def test_a_tile_of_another_size_says_which_size_to_use(rows, cols, fix):
    e = compile_error(k_tile_rows, F32, F32, R=rows, C=cols)
    check_error(e, "tile-rows", "tk.load", fix)
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
    check_error(e, marker, "tk.static_range", message)


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
def k_submodule_keyword(X: tk.gl[f32]):
    t = tk.shared_tile(f32, (16, 64))
    sem = tk.semaphore()
    tk.tma.load_async(t, X, (0, 0), sem, fill=0.0)  # E:submodule-keyword


@tk.kernel
def k_misspelled_method(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(X, x, (0, 0), cach="stream")  # E:misspelled-store


@tk.kernel
def k_misspelled_name(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(X, xx, (0, 0))  # E:misspelled-name


@tk.kernel
def k_numpy_method(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(X, x.sum(), (0, 0))  # E:numpy-method


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
    (k_submodule_keyword, "submodule-keyword", "tk.tma.load_async",
     "tk.tma.load_async() has no keyword argument 'fill'"),
    (k_misspelled_name, "misspelled-name", "xx",
     "name 'xx' is not defined; did you mean 'x'?"),
    (k_numpy_method, "numpy-method", "x.sum", "has no attribute 'sum'; did you mean 'col_sum' "
                                              "or 'row_sum'?"),
    (make_closure_kernel(), "closure", "scale", "'scale' is a variable of the function this "
                                                "one is defined in (a closure)"),
])
def test_a_mistake_names_its_fix(kernel, marker, at, message):
    check_error(compile_error(kernel, F32), marker, at, message)


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
        tk.kernel(k_misspelled_name)
    with pytest.raises(tk.CompilationError, match="applies to a function defined with"):
        tk.func(print)


# ------------------------------------------ the user's errors and tk_mlir's bugs

def rows_for(n):
    if n % 16:
        raise ValueError(f"n={n} is not a multiple of 16")
    return n


def outer_helper(n):
    return rows_for(n)


@tk.kernel
def k_helper_raises(X: tk.gl[f32], N: tk.constexpr):
    x = tk.load(X, (0, 0), (rows_for(N), 64))  # E:helper
    tk.store(X, x, (0, 0))


@tk.kernel
def k_nested_helper_raises(X: tk.gl[f32], N: tk.constexpr):
    r = outer_helper(N)  # E:nested-helper


@tk.kernel
def k_constexpr_type_error(X: tk.gl[f32], N: tk.constexpr):
    r = N + "rows"  # E:constexpr-op


@tk.kernel
def k_builtin_arity(X: tk.gl[f32]):
    x = tk.zeros()  # E:arity


@tk.kernel
def k_builtin_extra_arg(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64), 1, 2, 3)  # E:extra


@tk.kernel
def k_zeros(X: tk.gl[tk.bf16]):
    x = tk.zeros((16, 64))  # E:zeros
    tk.store(X, x.to(tk.bf16), (0, 0))


@pytest.fixture
def raised(monkeypatch):
    """What compile_specialization raised, before kernel.py's public entry
    shapes it for the user (its traceback policy is kernel.py's)."""
    seen = []
    real = compiler.compile_specialization

    def spy(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except Exception as e:
            seen.append(e)
            raise
    monkeypatch.setattr(compiler, "compile_specialization", spy)
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    monkeypatch.delenv("TK_MLIR_DEBUG", raising=False)
    return seen


# ------------------------------------------------------------ the user's

def test_user_helper_raising_is_a_compile_error_at_the_call(raised):
    check_error(compile_error(k_helper_raises, F32, N=24), "helper", "rows_for(N)",
                "ValueError: n=24 is not a multiple of 16")
    (inner,) = raised
    assert isinstance(inner, tk.CompilationError) and inner.__cause__ is None


def test_user_helper_raising_deeper_is_at_the_kernel_line():
    check_error(compile_error(k_nested_helper_raises, F32, N=8), "nested-helper",
                "outer_helper(N)", "ValueError: n=8 is not a multiple of 16")


def test_constexpr_arithmetic_error_is_the_users():
    check_error(compile_error(k_constexpr_type_error, F32, N=8), "constexpr-op", 'N + "rows"',
                "TypeError: unsupported operand type(s) for +: 'int' and 'str'")


def test_builtin_called_with_missing_arguments():
    check_error(compile_error(k_builtin_arity, F32), "arity", "tk.zeros()",
                "TypeError: zeros() missing 1 required positional argument: 'shape'")


def test_builtin_called_with_too_many_arguments():
    e = compile_error(k_builtin_extra_arg, F32)
    check_error(e, "extra", "tk.load", "TypeError: load() takes")


def test_debug_keeps_the_users_traceback(raised, monkeypatch):
    monkeypatch.setenv("TK_MLIR_DEBUG", "1")
    with pytest.raises(tk.CompilationError):
        k_helper_raises.compile(F32, N=24)
    (inner,) = raised
    assert isinstance(inner.__cause__, ValueError)
    frames = [f.name for f in traceback.extract_tb(inner.__cause__.__traceback__)]
    assert frames[-1] == "rows_for", frames


# ------------------------------------------------------------ tk_mlir's

def test_bug_in_a_builtin_is_an_internal_error(raised, monkeypatch):
    # Simulated: the dtype table loses an entry, so tk.zeros' own code raises
    # KeyError inside dialects/types.py (as `tk.spec(..., "f64")` once did).
    # (A copy without it: deleting and restoring the entry would reorder the table.)
    monkeypatch.setattr(T, "TILE_DTYPES", {k: v for k, v in T.TILE_DTYPES.items() if k != "f32"})
    with pytest.raises(InternalCompilerError) as info:
        k_zeros.compile(tk.spec((64, 64), "bf16"))
    e = info.value
    assert not isinstance(e, tk.CompilationError)
    assert (e.kernel, e.stage) == ("k_zeros", "frontend")
    line, text = marked("zeros")
    assert f"KeyError: 'f32' (compiling {HERE}:{line}:{text.index('tk.zeros') + 1})" in str(e)
    assert str(e).startswith("internal compiler error in kernel k_zeros during frontend")
    assert isinstance(e.__cause__, KeyError)
    innermost = traceback.extract_tb(e.__cause__.__traceback__)[-1]
    assert Path(innermost.filename).name == "types.py"


def test_bug_in_a_pass_is_an_internal_error_that_says_how_to_replay(raised, monkeypatch,
                                                                    tmp_path):
    def broken(module):
        raise KeyError("scratch_offset")
    passes = tuple((n, broken if n == "tk-allocate-smem" else f) for n, f in pipeline.TK_PASSES)
    monkeypatch.setattr(pipeline, "TK_PASSES", passes)
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(tmp_path))
    with pytest.raises(InternalCompilerError) as info:
        k_zeros.compile(tk.spec((64, 64), "bf16"))
    e = info.value
    assert (e.kernel, e.stage) == ("k_zeros", "tk-allocate-smem")
    assert isinstance(e.__cause__, KeyError)
    saved = tmp_path / "before-tk-allocate-smem.mlir"
    assert f"the IR before tk-allocate-smem is in {saved}" in str(e)
    command = f"python -m tk_mlir.lowering.pipeline 'tk-allocate-smem' {saved}"
    assert command in str(e)
    # The saved IR is the stage before, and the command replays the (real) pass on it.
    proc = subprocess.run([sys.executable, "-m", "tk_mlir.lowering.pipeline",
                           "tk-allocate-smem", str(saved)], capture_output=True, text=True,
                          cwd=REPO, env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tk.smem_bytes" in proc.stdout and "tk.smem_bytes" not in saved.read_text()


def test_bug_in_an_upstream_pass_is_an_internal_error(raised, monkeypatch):
    monkeypatch.setattr(pipeline, "GPU_STAGE_NAMES",
                        pipeline.GPU_STAGE_NAMES[:2] + ("no-such-pass",))
    with pytest.raises(InternalCompilerError) as info:
        k_zeros.compile(tk.spec((64, 64), "bf16"))
    assert info.value.stage == "no-such-pass"
    assert "reproduce with" in str(info.value)


def test_ptxas_rejecting_our_ptx_is_an_internal_error(raised, monkeypatch):
    real = pipeline._extract_ptx
    monkeypatch.setattr(pipeline, "_extract_ptx", lambda text: real(text) + "\nnot ptx;\n")
    with pytest.raises(InternalCompilerError) as info:
        k_zeros.compile(tk.spec((64, 64), "bf16"))
    assert info.value.stage == "ptxas"
    assert "reproduce with: ptxas -arch=sm_90a" in str(info.value)


def test_who_raised():
    """The rule itself: the innermost frame that is tk_mlir's or the user's
    decides, looking through the standard library and MLIR."""
    def user():
        import json
        json.loads("{")                 # raises inside the standard library
    with pytest.raises(ValueError) as info:
        user()
    assert not raised_in_tk_mlir(info.value.__traceback__)
    with pytest.raises(KeyError) as info:
        T.itemsize("f64")               # raises in tk_mlir's own code
    assert raised_in_tk_mlir(info.value.__traceback__)


# ---------------------------------------------------------------- recursion

@tk.kernel
def k_runtime_count(X: tk.gl[f32]):
    def f(t, n):
        return t if n == 0 else f(t * 2.0, n - 1)  # E:rt-rec
    n = tk.block_id(0)
    tk.store(X, f(tk.load(X, (0, 0), (16, 64)), n), (0, 0))


@tk.kernel
def k_compile_time_count(X: tk.gl[f32], D: tk.constexpr):
    def f(t, n):
        return t if n == 0 else f(t * 2.0, n - 1)  # E:ct-rec
    tk.store(X, f(tk.load(X, (0, 0), (16, 64)), D), (0, 0))


@tk.func
def doubled(t, n):
    return t if n == 0 else doubled(t * 2.0, n - 1)  # E:func-rec


@tk.kernel
def k_func_runtime_count(X: tk.gl[f32], n: int):
    tk.store(X, doubled(tk.load(X, (0, 0), (16, 64)), n), (0, 0))


@tk.kernel
def k_func_compile_time_count(X: tk.gl[f32], D: tk.constexpr):
    tk.store(X, doubled(tk.load(X, (0, 0), (16, 64)), D), (0, 0))


@tk.kernel
def k_no_progress(X: tk.gl[f32], D: tk.constexpr):
    def g(n):
        return g(n)  # E:same-args
    g(D)


@tk.kernel
def k_mutual(X: tk.gl[f32]):
    def even(n):
        return True if n == 0 else odd(n - 1)
    def odd(n):
        return False if n == 0 else even(n - 1)  # E:mutual
    b = even(tk.block_id(0))


def test_runtime_recursion_is_refused_at_the_call():
    check_error(compile_error(k_runtime_count, F32), "rt-rec", "f(t * 2.0",
                "f calls itself with a run-time argument (n) and otherwise the same "
                "arguments; recursion is unrolled at compile time only when it ends on "
                "compile-time values")


def test_runtime_recursion_in_a_tk_func():
    # A run-time conditional builds both sides, so the recursive call is reached.
    check_error(compile_error(k_func_runtime_count, F32, 3), "func-rec", "doubled(t",
                "doubled calls itself with a run-time argument (n)")


def test_mutual_runtime_recursion():
    check_error(compile_error(k_mutual, F32), "mutual", "even(n - 1)",
                "even calls itself with a run-time argument (n)")


def test_recursion_without_progress():
    check_error(compile_error(k_no_progress, F32, D=2), "same-args", "g(n)",
                "g calls itself with the same arguments, so the recursion never ends")


def _multiplies(compiled) -> int:
    return compiled.asm["tk"].count('"tk.mul"(')


@pytest.mark.parametrize("kernel", [k_compile_time_count, k_func_compile_time_count])
def test_compile_time_recursion_is_unrolled(kernel):
    muls = [_multiplies(kernel.compile(F32, D=d)) for d in (0, 3, 7)]
    assert muls == [0, 3, 7], muls


def test_recursion_nesting_too_deep():
    kernel_ok = k_compile_time_count.compile(F32, D=MAX_INLINE_DEPTH - 1)
    assert kernel_ok.asm["ptx"]
    e = compile_error(k_compile_time_count, F32, D=MAX_INLINE_DEPTH)
    check_error(e, "ct-rec", "f(t * 2.0", f"calling f here nests inlined calls more than "
                                          f"{MAX_INLINE_DEPTH} deep (... -> f -> f -> f -> f "
                                          f"-> f); recursion is unrolled at compile time")


def test_python_stack_running_out_is_a_compile_error(monkeypatch):
    """Below MAX_INLINE_DEPTH calls, Python's own stack can still run out (here
    made small): a CompilationError at a recursive call, not a RecursionError."""
    import inspect
    import sys
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")      # compile, not a cache hit
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 200)
    try:
        e = compile_error(k_compile_time_count, F32, D=MAX_INLINE_DEPTH - 1)
    finally:
        sys.setrecursionlimit(limit)
    check_error(e, "ct-rec", "f(t * 2.0", "calling f here nests inlined calls deeper than "
                                          "Python's recursion limit")


@pytest.mark.parametrize("skip", [True, False])
def test_a_return_under_a_constexpr_if_ends_the_kernel(skip):
    """`if SKIP: return`: the if is decided at compile time, and a taken
    return leaves out everything after it (one store, not two)."""
    torch = pytest.importorskip("torch")
    x, y = torch.randn(64, 64), torch.full((64, 64), float("nan"))
    k_return_under_constexpr_if.interpret[(1,)](x, y, SKIP=skip)
    assert torch.equal(y, x if skip else x * 2)
    ir_text = str(k_return_under_constexpr_if.compile(tk.spec((64, 64), "f32"),
                                                      tk.spec((64, 64), "f32"),
                                                      SKIP=skip).stages["tk"])
    assert ir_text.count("tk.store") == 1, ir_text


def test_a_for_loop_over_a_compile_time_sequence_is_unrolled():
    """`for t in tiles[1:]` and `for i, s in enumerate(...)`: unrolled, as
    comprehensions over compile-time sequences are."""
    torch = pytest.importorskip("torch")
    x, y = torch.randn(64, 64), torch.full((16, 64), float("nan"))
    k_loops_over_sequences.interpret[(1,)](x, y)
    assert torch.allclose(y, x.view(4, 16, 64).sum(0) * 1.0 * 3.0, atol=1e-5)
    k_loops_over_sequences.compile(tk.spec((64, 64), "f32"), tk.spec((16, 64), "f32"))


@pytest.mark.parametrize("neg", [True, False])
def test_a_helper_returns_under_a_constexpr_if(neg):
    """A tk.func and a function defined in the kernel may return under an if
    on a compile-time value: the branch taken is the function's result."""
    torch = pytest.importorskip("torch")
    x, y = torch.randn(64, 64), torch.full((64, 64), float("nan"))
    k_helpers_return_under_constexpr_ifs.interpret[(1,)](x, y, NEG=neg)
    assert torch.equal(y, -x if neg else x * 2)


@tk.kernel(num_warps=4)
def k_column_vector_along_rows(X: tk.gl[f32], Y: tk.gl[f32]):
    a = tk.load(X, (0, 0), (64, 64))
    tk.store(Y, a.sub_row(a.col_sum()), (0, 0))


def test_a_column_vector_broadcast_along_rows_says_which_vector_it_needs():
    e = compile_error(k_column_vector_along_rows, tk.spec((64, 64), f32), tk.spec((64, 64), f32))
    assert re.search(r"x\.sub_row\(v\) needs v laid out as one value per row of x, as "
                     r"x\.row_sum\(\) or x\.row_max\(\) makes it; this v was made for another "
                     r"tile or as a column vector", str(e)), str(e)
    assert "a.sub_row(a.col_sum())" in str(e)


# ------------------------------------------- what a README reader runs into

@tk.kernel(num_warps=4)
def k_sum_of_tiles(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, sum([tk.load(X, (k, 0), (16, 32)) for k in range(3)]), (0, 0))


def test_sum_over_a_list_of_tiles_adds_them_in_order():
    import torch
    x, y = torch.randn(48, 32), torch.full((16, 32), float("nan"))
    k_sum_of_tiles.interpret[(1,)](x, y)
    assert torch.allclose(y, x[:16] + x[16:32] + x[32:], atol=1e-6)


@tk.kernel(num_warps=4)
def k_loop_index_after_the_loop(X: tk.gl[f32], Y: tk.gl[f32], n: int, BEFORE: tk.constexpr):
    if BEFORE:
        k = 0
    for k in range(n):                                          # E:loop-index
        pass
    tk.store(Y, tk.load(X, (k, 0), (16, 32)), (0, 0))           # E:loop-after


@pytest.mark.parametrize("before", [False, True])
def test_a_run_time_loops_index_has_no_value_after_the_loop(before):
    """Python leaves the last index in it; a kernel's scf.for cannot, and must
    not leave the value from before the loop either (a silent difference)."""
    e = compile_error(k_loop_index_after_the_loop, tk.spec((64, 32), f32),
                      tk.spec((16, 32), f32), 3, BEFORE=before)
    assert e.line == marked("loop-after")[0]
    assert f"'k' is the loop variable of the run-time loop at line " \
           f"{marked('loop-index')[0]}, which has no value after the loop" in str(e)


@tk.kernel(num_warps=4)
def k_nested_loop_reuses_a_name(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    _, acc = 0, tk.zeros((16, 32), f32)
    for i in range(n):
        for _ in range(2):
            acc = acc + tk.load(X, (i, 0), (16, 32))
    tk.store(Y, acc, (0, 0))


def test_a_nested_loop_may_reuse_a_name_the_outer_scope_holds():
    import torch
    x, y = torch.randn(48, 32), torch.full((16, 32), float("nan"))
    k_nested_loop_reuses_a_name.interpret[(1,)](x, y, 3)
    assert torch.allclose(y, 2 * (x[:16] + x[16:32] + x[32:]), atol=1e-5)


@tk.kernel(num_warps=4)
def k_slice_past_the_tile(X: tk.gl[f32], Y: tk.gl[f32]):
    acc = tk.load(X, (0, 0), (64, 64), layout="row", scope="warpgroup")
    tk.store(Y, acc.slice(rows=(64, 64), cols=(0, 32)), (0, 0))  # E:slice-past


def test_a_slice_past_the_tile_says_it_is_outside():
    e = compile_error(k_slice_past_the_tile, tk.spec((64, 64), f32), tk.spec((64, 32), f32))
    assert e.line == marked("slice-past")[0]
    assert "slice rows=(64, 64) is outside the tile's 64 rows" in str(e), str(e)


@tk.kernel(num_warps=4)
def k_column_vector_of_another_layout(X: tk.gl[f32], Y: tk.gl[f32]):
    a = tk.load(X, (0, 0), (64, 64), layout="row")
    b = tk.load(X, (0, 0), (64, 64))
    tk.store(Y, b.add_col(a.col_sum()), (0, 0))


def test_a_column_vector_of_another_layout_names_the_methods_that_exist():
    e = compile_error(k_column_vector_of_another_layout, tk.spec((64, 64), f32),
                      tk.spec((64, 64), f32))
    assert "as x.col_sum() or x.col_max() makes it" in str(e), str(e)
    assert "Vectors are not converted between layouts" in str(e)


@tk.kernel(num_warps=4)
def k_if_on_a_mask(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 32))
    if x > 0.0:
        x = -x
    tk.store(Y, x, (0, 0))


def test_an_if_on_a_mask_names_its_type_in_words():
    e = compile_error(k_if_on_a_mask, tk.spec((16, 32), f32), tk.spec((16, 32), f32))
    assert "`x > 0.0` is a bool 16x32 tile (vec, block), a value per element" in str(e), str(e)
    assert "!tk.rt" not in str(e)


@tk.kernel(num_warps=4)
def k_scaled_copy(X: tk.gl[f32], Y: tk.gl[f32], s: float, n: int):
    tk.store(Y, tk.load(X, (0, 0), (16, 32)) * s, (0, 0))


def test_an_argument_left_out_says_where_the_others_shifted():
    with pytest.raises(tk.ArgumentError) as e:
        k_scaled_copy.compile(tk.spec((16, 32), f32), 1.0, 2)
    assert str(e.value) == "k_scaled_copy() missing argument 'n' ('Y', a tensor, got 1.0: is " \
                           "an argument before it left out?)"


@tk.kernel(num_warps=4)
def k_branches_of_two_types(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    r = tk.load(X, (0, 0), (64, 64))
    if n > 0:
        r = r.to(bf16)
    tk.store(Y, r.to(f32), (0, 0))


def test_a_name_of_two_types_under_a_run_time_if_names_them_in_words():
    e = compile_error(k_branches_of_two_types, tk.spec((64, 64), f32), tk.spec((64, 64), f32), 1)
    assert "'r' is a bf16 64x64 tile (vec, block) in one branch and a f32 64x64 tile (vec, " \
           "block) in the other" in str(e), str(e)


@tk.kernel(num_warps=4)
def k_comprehension_over_a_run_time_range(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    tiles = [tk.load(X, (j, 0), (16, 64)) for j in range(n)]
    tk.store(Y, tiles[0], (0, 0))


def test_a_comprehension_over_a_run_time_range_says_to_loop():
    e = compile_error(k_comprehension_over_a_run_time_range, tk.spec((64, 64), f32),
                      tk.spec((16, 64), f32), 2)
    assert "range() with a run-time bound makes no list" in str(e), str(e)
    assert "write `for i in range(n):`" in str(e)


@tk.kernel(num_warps=4)
def k_loop_in_one_branch(X: tk.gl[f32], Y: tk.gl[f32], n: int, c: int):
    j = 0
    if c > 0:
        for j in range(n):                                       # E:branch-loop
            pass
    else:
        j = 2
    tk.store(Y, tk.load(X, (j, 0), (16, 32)), (0, 0))           # E:branch-after


def test_a_loop_variable_from_one_branch_has_no_value_after_the_if():
    """Not the value from before the if (the other branch's is lost too)."""
    e = compile_error(k_loop_in_one_branch, tk.spec((64, 32), f32), tk.spec((16, 32), f32), 3, 0)
    assert e.line == marked("branch-after")[0]
    assert f"'j' is the loop variable of the run-time loop at line " \
           f"{marked('branch-loop')[0]}" in str(e), str(e)


SHADOWED = 2


@tk.kernel(num_warps=4)
def k_loop_variable_shadows_a_global(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    for SHADOWED in range(n):
        pass
    tk.store(Y, tk.load(X, (SHADOWED, 0), (16, 32)), (0, 0))    # E:shadowed


def test_a_finished_loop_variable_never_reads_the_global_of_its_name():
    e = compile_error(k_loop_variable_shadows_a_global, tk.spec((64, 32), f32),
                      tk.spec((16, 32), f32), 3)
    assert e.line == marked("shadowed")[0]
    assert "'SHADOWED' is the loop variable of the run-time loop" in str(e), str(e)


@tk.kernel(num_warps=4)
def k_carried_name_reused_by_an_inner_loop(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    j = 1
    acc = tk.zeros((16, 32), f32)
    for i in range(n):                                          # E:outer-loop
        acc = acc + tk.load(X, (j, 0), (16, 32))                # E:stale-read
        for j in range(2):                                      # E:inner-loop
            acc = acc + tk.load(X, (j, 0), (16, 32))
    tk.store(Y, acc, (0, 0))


@tk.kernel(num_warps=4)
def k_inner_loop_variable_not_read_outside(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    j = 1
    acc = tk.zeros((16, 32), f32)
    for i in range(n):
        for j in range(2):
            acc = acc + tk.load(X, (j + i, 0), (16, 32))
    tk.store(Y, acc, (0, 0))


def test_a_carried_name_an_inner_loop_takes_is_refused_where_read_outside_it():
    """From the second iteration Python reads the inner loop's last index: a
    kernel loop would silently read the value from before the loops."""
    import torch
    e = compile_error(k_carried_name_reused_by_an_inner_loop, tk.spec((64, 32), f32),
                      tk.spec((16, 32), f32), 3)
    assert e.line == marked("stale-read")[0]
    assert f"'j' is read in the run-time loop at line {marked('outer-loop')[0]} and is the " \
           f"variable of the run-time loop inside it at line {marked('inner-loop')[0]}" \
           in str(e), str(e)
    x, y = torch.randn(64, 32), torch.full((16, 32), float("nan"))
    k_inner_loop_variable_not_read_outside.interpret[(1,)](x, y, 2)   # (read inside only: fine)
    want = sum(x[16 * (j + i):16 * (j + i + 1)] for i in range(2) for j in range(2))
    assert torch.allclose(y, want, atol=1e-5)
