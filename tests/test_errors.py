"""The errors a kernel author meets, as the author sees them.

Compile errors: the message, the file, the line and column of the user's
code (found here by a marker comment at the end of the offending line), the
rendered text (file:line:col, the source line, a caret under the column),
and a traceback that shows no compiler internals. Launch-time argument
errors: the message naming the argument and the rule, raised before any
CUDA driver work, so they run on machines without a GPU.

The kernels live at module level: only compiling them raises.
"""
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest

import markers
import tk_mlir as tk
from tk_mlir import bf16, f16, f32

HERE = Path(__file__).resolve()

# Modules of the compiler proper: none of their frames may reach the user.
INTERNAL = ("frontend.py", "values.py", "ops.py", "language.py", "compiler.py", "cache.py",
            "verify.py", "smem.py", "layouts.py", "pipeline.py")


def helper(x):
    return x


# ----------------------------------------------------------------- kernels

@tk.kernel
def k_while(X: tk.gl[f32]):
    i = tk.block_id(0)
    while i < 4:  # E:while
        i = i + 1


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
def k_rank_by_code(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (tk.block_id(0), 0), (16, 64))  # E:rank-by-code
    tk.store(Y, x, (tk.block_id(0), 0))


# Kernels that are fine, for the launch-time argument rules.

@tk.kernel
def k_copy_bf16(X: tk.gl[bf16], Y: tk.gl[bf16]):
    x = tk.load(X, (tk.block_id(0), 0), (16, 64))
    tk.store(Y, x, (tk.block_id(0), 0))


@tk.kernel
def k_copy_f32(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (tk.block_id(0), 0), (16, 64))
    tk.store(Y, x, (tk.block_id(0), 0))


@tk.kernel
def k_static_bf16(X: tk.gl[bf16, (None, 4096)], Y: tk.gl[bf16, (None, 4096)]):
    x = tk.load(X, (tk.block_id(0), 0), (16, 64))
    tk.store(Y, x, (tk.block_id(0), 0))


@tk.kernel
def k_static_f16(X: tk.gl[f16, (None, 4096)], Y: tk.gl[f16, (None, 4096)]):
    x = tk.load(X, (tk.block_id(0), 0), (16, 64))
    tk.store(Y, x, (tk.block_id(0), 0))


@tk.kernel
def k_scaled(X: tk.gl[f32], Y: tk.gl[f32], s: int, scale: float):
    x = tk.load(X, (tk.block_id(0), 0), (16, 64))
    tk.store(Y, x * float(s) * scale, (tk.block_id(0), 0))


# ----------------------------------------------------------------- helpers

def marked(marker: str, path: Path = HERE) -> tuple[int, str]:
    """(line number, text) of the line of `path` (this file) ending in `# E:<marker>`."""
    return markers.marked(path, marker)


def tk_frames(tb) -> list[traceback.FrameSummary]:
    """The frames of tk_mlir's own files in a traceback (not the tests')."""
    pkg = Path(tk.__file__).resolve().parent.parent
    return [f for f in traceback.extract_tb(tb) if Path(f.filename).resolve().is_relative_to(pkg)
            and "tests" not in Path(f.filename).resolve().relative_to(pkg).parts]


def check_error(e: tk.CompilationError, marker: str, at: str, message: str | re.Pattern,
                path: Path = HERE):
    """e points at `at` on the line of `path` (this file) marked `marker`, says
    `message`, renders with a caret and carries no compiler internals."""
    line, text = marked(marker, path)
    col = text.index(at)
    if isinstance(message, re.Pattern):
        assert message.search(e.message), e.message
    else:
        assert message in e.message, e.message
    assert e.filename is not None and Path(e.filename).resolve() == path
    assert (e.line, e.col) == (line, col), (e.line, e.col, line, col)
    rendered = str(e).split("\n")
    assert rendered[0] == f"{e.filename}:{line}:{col + 1}: error: {e.message}"
    assert rendered[1] == "    " + text.rstrip()
    assert rendered[2] == "    " + " " * col + "^"
    assert len(rendered) == 3
    # What the user sees: raised `from None`, no chained compiler exception...
    assert e.__cause__ is None and e.__suppress_context__
    # ...and no frame of the frontend, the passes or the lowering.
    leaked = [f"{Path(f.filename).name}:{f.name}" for f in tk_frames(e.__traceback__)
              if Path(f.filename).name in INTERNAL or "lowering" in Path(f.filename).parts
              or "passes" in Path(f.filename).parts]
    assert not leaked, leaked


def compile_error(kernel, *args, **kwargs) -> tk.CompilationError:
    with pytest.raises(tk.CompilationError) as info:
        kernel.compile(*args, **kwargs)
    return info.value


F32 = tk.spec((64, 64), "f32")
BF16 = tk.spec((64, 64), "bf16")


# ------------------------------------------------------ unsupported syntax

@pytest.mark.parametrize("kernel,args,marker,at,message", [
    pytest.param(k_while, (F32,), "while", "while",
                 "while loops are not supported; use for ... in range(...)", id="while"),
    pytest.param(k_break, (F32, 1), "break", "break", "Break is not supported in a tk kernel",
                 id="break"),
    pytest.param(k_continue, (F32, 1), "continue", "continue",
                 "Continue is not supported in a tk kernel", id="continue"),
    pytest.param(k_lambda, (F32,), "lambda", "lambda", "Lambda is not supported in a tk kernel",
                 id="lambda"),
    pytest.param(k_listcomp, (F32,), "listcomp", "[i for",
                 "only single-`for` comprehensions are supported", id="listcomp"),
    pytest.param(k_try, (F32,), "try", "try", "Try is not supported in a tk kernel", id="try"),
    pytest.param(k_with, (F32,), "with", "with", "With is not supported in a tk kernel",
                 id="with"),
    pytest.param(k_pow, (F32,), "pow", "i ** 2", "** on run-time values is not supported", id="pow"),
    pytest.param(k_return_value, (F32,), "return", "return",
                 "a kernel returns nothing; write results with tk.store", id="return-value"),
    pytest.param(k_call, (F32,), "call", "helper(i)",
                 "calling helper() on run-time values is not supported in a kernel (only tk.* "
                 "functions and tile methods are)", id="python-call"),
    pytest.param(k_undefined, (F32,), "undefined", "nope", "name 'nope' is not defined",
                 id="undefined-name"),
])
def test_unsupported_python(kernel, args, marker, at, message):
    check_error(compile_error(kernel, *args), marker, at, message)


# ------------------------------------------------------------- tile rules

def test_shape_mismatch():
    check_error(compile_error(k_shape, F32), "shape", "a + b",
                "add: operands differ: f32 16x64 tile (vec, block) and f32 16x128 tile "
                "(vec, block)")


def test_store_dtype_mismatch():
    check_error(compile_error(k_store_dtype, BF16), "store-dtype", "tk.store",
                "tk.store: the tile is f32 but the tensor is bf16; convert with .to(tk.bf16)")


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


def test_num_warps_not_a_power_of_two_at_launch():
    with pytest.raises(tk.ArgumentError, match=r"num_warps must be from 1 to 32 and a power of two "
                       r"or a multiple of 4, got 3"):
        k_copy_f32.compile(F32, F32, num_warps=3)
    with pytest.raises(tk.ArgumentError, match="got 64"):
        k_copy_f32[(1,)](F32, F32, num_warps=64)


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


# ----------------------------------------------- launch-time argument errors

class FakeCudaArray:
    """An object exposing __cuda_array_interface__ and no memory at all."""

    def __init__(self, shape, typestr, ptr=0x10000, strides=None):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (ptr, False), "version": 3,
                                         "strides": strides}


class _RecordingDriver:
    """Stands in for cuda.bindings.driver: records every attribute read."""

    def __init__(self, real):
        self.real, self.used = real, []

    def __getattr__(self, name):
        self.used.append(name)
        return getattr(self.real, name)


@pytest.fixture
def driver_watch(monkeypatch):
    """Fail if argument checking loads a module or builds a launcher; record any
    other driver entry point used. A GPU-less machine only probes for a device
    (cached since collection) and, on a machine with one, asks which device owns
    a pointer (tensor_info of a __cuda_array_interface__ object)."""
    from tk_mlir import compiler
    from tk_mlir.runtime import driver

    def refuse(*args, **kwargs):
        raise AssertionError("driver work before the arguments were checked")
    monkeypatch.setattr(driver, "Module", refuse)
    monkeypatch.setattr(driver, "PackedLauncher", refuse)
    monkeypatch.setattr(compiler.CompiledKernel, "function", refuse)
    watch = _RecordingDriver(driver.cu)
    monkeypatch.setattr(driver, "cu", watch)
    yield watch
    allowed = {"CUpointer_attribute", "cuPointerGetAttribute",      # pointer_device
               "cuInit", "cuDeviceGetCount"}                          # has_gpu's probe
    assert set(watch.used) <= allowed, watch.used


def launch_error(kernel, *args, **kwargs) -> tk.ArgumentError:
    with pytest.raises(tk.ArgumentError) as info:
        kernel[(1,)](*args, **kwargs)
    return info.value


def test_cpu_torch_tensor(driver_watch):
    torch = pytest.importorskip("torch")
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    e = launch_error(k_copy_bf16, x, x.clone())
    assert str(e) == ("argument 'X' is on cpu; tk_mlir kernels need CUDA tensors (move it "
                      "with .cuda())")


def test_cpu_torch_tensor_of_the_wrong_dtype_reports_the_device_first(driver_watch):
    torch = pytest.importorskip("torch")
    x = torch.zeros(64, 64, dtype=torch.float32)
    e = launch_error(k_copy_bf16, x, x.clone())
    assert "argument 'X' is on cpu" in str(e)


def test_wrong_dtype(driver_watch):
    e = launch_error(k_copy_bf16, FakeCudaArray((64, 64), "<f4"),
                     FakeCudaArray((64, 64), "<f4"))
    assert str(e) == ("argument 'X' has dtype f32, but the kernel's annotation wants bf16; "
                      "convert it (e.g. x.to(torch.bfloat16))")


def test_misaligned_pointer(driver_watch):
    e = launch_error(k_copy_f32, FakeCudaArray((64, 64), "<f4", ptr=0x10004),
                     FakeCudaArray((64, 64), "<f4"))
    assert "argument 'X': data pointer 0x10004 is not 16-byte aligned" in str(e)


def test_second_argument_is_named(driver_watch):
    e = launch_error(k_copy_f32, FakeCudaArray((64, 64), "<f4"),
                     FakeCudaArray((64, 64), "<f4", ptr=0x20008))
    assert str(e).startswith("argument 'Y': data pointer 0x20008 is not 16-byte aligned")


def test_rows_not_whole_16_byte_vectors(driver_watch):
    e = launch_error(k_copy_f32, FakeCudaArray((64, 3), "<f4"), FakeCudaArray((64, 4), "<f4"))
    assert "argument 'X' has shape (64, 3): its rows (innermost dim) are 3 x 4 = 12 bytes" \
        in str(e)


def test_rank_mismatch_against_a_shaped_annotation(driver_watch):
    torch = pytest.importorskip("torch")
    # The rank is part of the specialization, so this rule fires even before
    # the device rule.
    x = torch.zeros(4096, dtype=torch.bfloat16)
    e = launch_error(k_static_bf16, x, torch.zeros(64, 4096, dtype=torch.bfloat16))
    assert str(e) == "argument 'X' has rank 1, the annotation wants rank 2"
    e = launch_error(k_static_f16, FakeCudaArray((64, 64, 4096), "<f2"),
                     FakeCudaArray((64, 4096), "<f2"))
    assert str(e) == "argument 'X' has rank 3, the annotation wants rank 2"


def test_rank_mismatch_without_a_shaped_annotation_is_a_compile_error():
    """tk.gl[f32] takes any rank: a rank-1 tensor specializes the kernel for
    rank 1, whose 2-D load is then wrong, at the load's line."""
    with pytest.raises(tk.CompilationError) as info:
        k_rank_by_code[(1,)](FakeCudaArray((4096,), "<f4"), FakeCudaArray((64, 64), "<f4"))
    e = info.value
    check_error(e, "rank-by-code", "tk.load",
                "tk.load needs 1 coordinates for a rank-1 tensor (one per dim), got 2")


def test_static_shape_mismatch(driver_watch):
    # bf16 has no __cuda_array_interface__ typestr and a CPU torch tensor stops
    # at the device rule, so without a GPU the dim rule is reached with f16.
    e = launch_error(k_static_f16, FakeCudaArray((64, 2048), "<f2"),
                     FakeCudaArray((64, 4096), "<f2"))
    assert str(e) == ("argument 'X' has shape (64, 2048): dim 1 must be 4096 (the kernel's "
                      "annotation fixes it)")


@pytest.mark.parametrize("value", [2**31, -2**31 - 1])
def test_i32_scalar_out_of_range(driver_watch, value):
    x = FakeCudaArray((64, 64), "<f4")
    e = launch_error(k_scaled, x, x, value, 1.0)
    assert str(e) == f"argument 's' = {value} must be an int that fits in 32 bits"


def test_scalar_of_the_wrong_kind(driver_watch):
    x = FakeCudaArray((64, 64), "<f4")
    assert str(launch_error(k_scaled, x, x, 1.5, 1.0)) == \
        "argument 's' must be an int, got 1.5"
    assert str(launch_error(k_scaled, x, x, 1, "2")) == \
        "argument 'scale' must be a float, got '2'"


def test_not_a_tensor(driver_watch):
    e = launch_error(k_copy_f32, [[1.0]], FakeCudaArray((64, 64), "<f4"))
    assert str(e) == ("argument 'X': expected a CUDA tensor (torch.Tensor, "
                      "__cuda_array_interface__ or DLPack), got list")


def test_argument_errors_are_type_errors():
    assert issubclass(tk.ArgumentError, TypeError)


@tk.kernel(num_warps=4)
def k_fp8(X: tk.gl[tk.f8e4m3], Y: tk.gl[tk.f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 64)).to(tk.f32), (0, 0))  # E:fp8


def test_fp8_tiles_are_refused_at_their_line():
    with pytest.raises(tk.CompilationError) as e:
        k_fp8.compile(tk.spec((16, 64), "f8e4m3"), tk.spec((16, 64), "f32"))
    assert "fp8" in e.value.message and "not lowered yet" in e.value.message
    assert e.value.line == marked("fp8")[0]
