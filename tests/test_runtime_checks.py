"""Runtime checks that need no GPU: the target device, grid limits, the
devices of the tensor arguments, tk.spec dtypes, TK_MLIR_DUMP_DIR, the
one-line repr of a compiled kernel, and what a launch that cannot run here
(CPU tensors, no GPU) says to do instead."""
import os
import re
import sys

import pytest

import tk_mlir as tk
from tk_mlir import f32, launcher
from tk_mlir.runtime import driver
from tk_mlir.runtime.arguments import TensorInfo
from tk_mlir.target import TARGET

X = tk.spec((64, 64), "f32")


@tk.kernel(num_warps=4)
def copy(X: tk.gl[f32], Y: tk.gl[f32]):
    i = tk.block_id(0)
    tk.store(Y, tk.load(X, (i, 0), (16, 64)), (i, 0))


# ------------------------------------------------------------------ target

def test_a_non_hopper_device_is_refused_by_name(monkeypatch):
    """Only the capability query is faked: the refusal comes before any load."""
    compiled = copy.compile(X, X)
    monkeypatch.setattr(driver, "has_gpu", lambda: True)
    monkeypatch.setattr(driver, "device_identity", lambda device: ("NVIDIA A100-SXM4-80GB", (8, 0)))
    with pytest.raises(driver.UnsupportedDevice) as info:
        compiled.function(0)
    message = str(info.value)
    assert "cuda:0 (NVIDIA A100-SXM4-80GB, compute capability 8.0)" in message
    assert TARGET.description in message and TARGET.arch in message
    assert not compiled._functions


def test_the_target_supports_hopper_only():
    assert TARGET.supports((9, 0)) and not TARGET.supports((8, 0)) and not TARGET.supports((10, 0))


# -------------------------------------------------------------------- grid

@pytest.mark.parametrize("grid, axis, limit", [((1, 65536), "y", 65535), ((1, 1, 70000), "z", 65535),
                                               (2**31, "x", 2**31 - 1)])
def test_grids_over_the_limits_name_the_dimension(grid, axis, limit):
    with pytest.raises(tk.ArgumentError) as info:
        launcher.normalize_grid(grid, {})
    assert f"{axis} = " in str(info.value) and f"limit of {limit} along {axis}" in str(info.value)


def test_grids_at_the_limits_pass():
    assert launcher.normalize_grid((2**31 - 1, 65535, 65535), {}) == (2**31 - 1, 65535, 65535)
    with pytest.raises(tk.ArgumentError, match="at least 1"):
        launcher.normalize_grid((0,), {})


# ----------------------------------------------------------------- devices

def _on(device):
    return TensorInfo(0x1000, (16, 16), (16, 1), "f32", device, 4)


def test_the_launch_device_is_the_tensors_device():
    assert launcher.launch_device({"X": _on("cuda:1"), "Y": _on("cuda:1")}) == 1
    with pytest.raises(tk.ArgumentError) as info:
        launcher.launch_device({"X": _on("cuda:0"), "Y": _on("cuda:1")})
    assert "'X' on cuda:0, 'Y' on cuda:1" in str(info.value)


# ------------------------------------------ where a launch cannot run here

@pytest.fixture
def not_interpreting(monkeypatch):
    """TK_MLIR_INTERPRET unset, as read at the process's first launch."""
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", False)


def test_a_launch_on_cpu_tensors_says_how_to_run_it_here(not_interpreting):
    torch = pytest.importorskip("torch")
    x = torch.randn(16, 64) + 2
    with pytest.raises(tk.ArgumentError) as info:
        copy[(1,)](x, torch.empty_like(x))
    message = str(info.value)
    assert message.startswith("argument 'X' is on cpu; tk_mlir kernels need CUDA tensors: ")
    assert "move it with .cuda()" in message
    assert "kernel.interpret[grid](...) for one launch" in message
    assert "TK_MLIR_INTERPRET=1 in the environment (read at the process's first launch)" \
        in message
    y = torch.full_like(x, float("nan"))
    copy.interpret[(1,)](x, y)                       # (the advice works)
    assert torch.equal(y, x)


def test_the_librarys_wrappers_on_cpu_tensors_say_how_to_run_them_here(not_interpreting):
    torch = pytest.importorskip("torch")
    from tk_mlir.kernels import matmul, rms_norm
    a = torch.randn(64, 64).to(torch.bfloat16)
    for call in (lambda: matmul(a, a), lambda: rms_norm(a, a[0])):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert re.search(r"^\w+: \w+ must be on a CUDA device, got cpu \(the kernel runs on "
                         r"the GPU\): move it with \.cuda\(\), or run the library on CPU "
                         r"tensors in the interpreter: TK_MLIR_INTERPRET=1", message), message


def test_the_multi_gpu_wrappers_on_cpu_tensors_point_to_interpret_ranks(not_interpreting):
    """Their memory is shared between GPUs: TK_MLIR_INTERPRET=1 would not run
    them, kernel.interpret_ranks runs their kernels."""
    torch = pytest.importorskip("torch")
    from tk_mlir.kernels import symmetric
    with pytest.raises(ValueError) as info:
        symmetric.check_distributed("all_reduce", "t", torch.randn(64).to(torch.bfloat16))
    message = str(info.value)
    assert message.startswith("all_reduce: t must be on a CUDA device, got cpu")
    assert "move it with .cuda()" in message and "kernel.interpret_ranks[grid]" in message
    assert "TK_MLIR_INTERPRET=1" not in message


class _Driver:
    """cuda.bindings.driver with some functions replaced."""

    def __init__(self, real, **replaced):
        self.real, self.replaced = real, replaced

    def __getattr__(self, name):
        return self.replaced.get(name) or getattr(self.real, name)


@pytest.fixture
def fresh_driver(monkeypatch):
    """The driver as before its first call: not initialised, its probes not
    cached (and not cached after the test either)."""
    monkeypatch.setattr(driver, "_initialized", False)
    driver.has_gpu.cache_clear()
    driver.gpu_problem.cache_clear()
    yield
    driver.has_gpu.cache_clear()
    driver.gpu_problem.cache_clear()


def _no_library(flags):
    raise OSError("libcuda.so.1: cannot open shared object file")


@pytest.mark.parametrize("cu_init, reason", [
    (_no_library, "the CUDA driver library does not load: libcuda.so.1: cannot open"),
    (lambda flags: (driver.cu.CUresult.CUDA_ERROR_NO_DEVICE,), "the CUDA driver sees no device"),
])
def test_no_gpu_says_how_to_run_the_kernel_here(monkeypatch, fresh_driver, cu_init, reason):
    monkeypatch.setattr(driver, "cu", _Driver(driver.cu, cuInit=cu_init))
    with pytest.raises(driver.NoGpu) as info:
        driver.device_count()
    message = str(info.value)
    assert isinstance(info.value, driver.CudaError)          # (callers catch those)
    assert message.startswith(f"no NVIDIA GPU can be used here ({reason}")
    assert "kernel.interpret[grid](...)" in message and "TK_MLIR_INTERPRET=1" in message
    assert not driver.has_gpu()
    with pytest.raises(driver.NoGpu) as info:
        driver.require_gpu("copy")
    assert str(info.value).startswith(f"cannot launch copy: no NVIDIA GPU can be used here "
                                      f"({reason}")
    assert "kernel.interpret[grid](...)" in str(info.value)


# -------------------------------------------------------------------- spec

@pytest.mark.parametrize("dtype", ["f64", "bool", int, "float64"])
def test_spec_refuses_dtypes_kernels_do_not_take(dtype):
    with pytest.raises(tk.ArgumentError) as info:
        tk.spec((4, 8), dtype)
    message = str(info.value)
    assert "tk.spec dtype" in message and "the supported dtypes are" in message
    assert all(name in message for name in ("bf16", "f16", "f32", "f8e4m3", "f8e5m2"))


def test_spec_refuses_torch_float64():
    torch = pytest.importorskip("torch")
    with pytest.raises(tk.ArgumentError, match=r"torch\.float64 \(f64\) is not an element type"):
        tk.spec((4, 8), torch.float64)


# --------------------------------------------------------- TK_MLIR_DUMP_DIR

def _compile_fresh(monkeypatch, dump_dir):
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(dump_dir))
    with pytest.raises(tk.CompilationError) as info:
        copy.compile(X, X)
    return str(info.value)


def test_a_dump_dir_that_is_a_file_is_a_clear_error(monkeypatch, tmp_path):
    file = tmp_path / "dump"
    file.write_text("not a folder")
    message = _compile_fresh(monkeypatch, file)
    assert message.startswith(f"TK_MLIR_DUMP_DIR: cannot write to '{file}/copy-")
    assert "is a file, not a folder" in message
    assert file.read_text() == "not a folder"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into read-only folders")
def test_a_read_only_dump_dir_is_a_clear_error(monkeypatch, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert "is not writable" in _compile_fresh(monkeypatch, folder / "sub")
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)


# -------------------------------------------------------------------- repr

def test_a_compiled_kernel_repr_is_one_line():
    compiled = copy.compile(X, X)
    text = repr(compiled)
    assert "\n" not in text and len(text) < 200, text
    assert text.startswith("<CompiledKernel copy: 4 warps (128 threads), ")
    assert "registers" in text and "no spills" in text
    assert f"{len(compiled.asm)} IR stages (.asm)" in text


# ------------------------------------------------------------ launch plans

@tk.kernel(num_warps=1)
def any_rank(X: tk.gl[f32], s: float):
    tk.store(X, tk.load(X, (0, 0), (1, 32)) * s, (0, 0))


def test_a_plan_leaves_another_rank_to_another_plan():
    """The plan's guard has no rank test: a tensor of another rank fails its
    checked-key lookup, and full_check hands it back to the kernel (which
    compiles that rank's specialization) instead of reporting a rank error."""
    torch = pytest.importorskip("torch")
    x = torch.rand(4, 32)
    values, warps = any_rank.params.bind((x, 2.0), {})
    sig = any_rank.params.key(values, warps, lambda v, n: tk.spec(tuple(v.shape), "f32"))
    reads, compiled = any_rank._entry(sig)
    rules = {0: dict(dtype="f32", rank=2, static_shape=(None, None))}
    plan = launcher.torch_plan(any_rank.params, values, 2, {}, rules, compiled,
                               lambda *a: None, lambda: 0, 0, reads)
    assert "ndim" not in plan.source
    assert plan((1,), (torch.rand(2, 4, 32), 2.0), {}) is False
    with pytest.raises(tk.ArgumentError, match="is on cpu"):   # the same rank: checked
        plan((1,), (x, 2.0), {})


# ------------------------------------ grids, specs and constexprs at the edges

@pytest.mark.parametrize("grid", [None, 4.0, "4", (), (1, 2, 3, 4), (0,), (True,), lambda m: None])
def test_bad_grids_are_argument_errors(grid):
    with pytest.raises(tk.ArgumentError, match="grid must be an int or a tuple of 1 to 3 ints"):
        launcher.normalize_grid(grid, {})


def test_integer_like_grids_pass():
    import numpy as np
    assert launcher.normalize_grid((np.int64(4), 2), {}) == (4, 2, 1)
    assert launcher.normalize_grid(lambda meta: meta["n"], {"n": 3}) == (3, 1, 1)


@tk.kernel
def bare(X: tk.gl, Y: tk.gl):
    tk.store(Y, tk.load(X, (0, 0), (16, 64)), (0, 0))


@pytest.mark.parametrize("shape, dtype, rule", [
    ((64, 64), "float64", "is not an element type tk_mlir kernels take"),
    ((64, 64), "int64", "is not an element type tk_mlir kernels take"),
])
def test_a_bare_gl_refuses_what_kernels_do_not_take(shape, dtype, rule):
    torch = pytest.importorskip("torch")
    t = torch.rand(shape).to(getattr(torch, dtype))
    with pytest.raises(tk.ArgumentError, match=rule) as info:
        bare.compile(t, t)
    assert "argument 'X'" in str(info.value)


def test_a_0d_tensor_read_as_a_tile_is_a_compilation_error_at_its_line():
    torch = pytest.importorskip("torch")
    with pytest.raises(tk.CompilationError, match="needs 0 coordinates for a rank-0 tensor") \
            as info:
        bare.compile(torch.tensor(1.0), torch.rand(64, 64))
    assert "tk.load(X, (0, 0), (16, 64))" in str(info.value)


@pytest.mark.parametrize("shape", [None, (4.0, 8), (True, 8), 7])
def test_spec_refuses_shapes_that_are_not_ints(shape):
    with pytest.raises(tk.ArgumentError, match="tk.spec shape must be a tuple of non-negative ints"):
        tk.spec(shape, "f32")


@tk.kernel
def scaled(X: tk.gl[f32], Y: tk.gl[f32], C: tk.constexpr):
    s = 2.5 if C[0] is True else 3.5
    tk.store(Y, tk.load(X, (0, 0), (16, 64)) * s * C[1], (0, 0))


def test_constexprs_equal_in_python_but_not_in_code_compile_apart():
    a = scaled.compile(X, X, C=(1, 1.0))
    b = scaled.compile(X, X, C=(True, 1.0))          # (1, 1.0) == (True, 1.0)
    c = scaled.compile(X, X, C=(True, -1.0))
    d = scaled.compile(X, X, C=(True, 1.0))
    assert b is d and len({id(a), id(b), id(c)}) == 3
    assert "0f40600000" in a.asm["ptx"] and "0f40200000" in b.asm["ptx"]   # 3.5 and 2.5
    zero, negative_zero = scaled.compile(X, X, C=(1, 0.0)), scaled.compile(X, X, C=(1, -0.0))
    assert zero is not negative_zero
