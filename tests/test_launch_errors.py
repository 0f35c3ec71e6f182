"""Launch-time argument errors (the launcher's checks, by the rules of
runtime/arguments.py): a kernel launched with a bad argument raises an
ArgumentError naming the argument and the rule (device, dtype, rank and
static shape against the annotation, 16-byte alignment, whole 16-byte rows,
32-bit scalars, num_warps), before any CUDA driver work, so these run on
machines without a GPU. A rank that an annotation without a shape accepts
specializes the kernel, and is a compile error at the line it breaks.

The kernels live at module level; they are correct, their arguments are not.
"""
from pathlib import Path

import pytest

import error_checks
import tk_mlir as tk
from error_checks import FakeCudaArray
from tk_mlir import bf16, f16, f32
from tk_mlir.runtime.arguments import check_tensor, spec

HERE = Path(__file__).resolve()
F32 = tk.spec((64, 64), "f32")


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


@tk.kernel
def k_rank_by_code(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (tk.block_id(0), 0), (16, 64))  # E:rank-by-code
    tk.store(Y, x, (tk.block_id(0), 0))


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
    from tk_mlir import compiled
    from tk_mlir.runtime import driver

    def refuse(*args, **kwargs):
        raise AssertionError("driver work before the arguments were checked")
    monkeypatch.setattr(driver, "Module", refuse)
    monkeypatch.setattr(driver, "PackedLauncher", refuse)
    monkeypatch.setattr(compiled.CompiledKernel, "function", refuse)
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
    assert str(e) == ("argument 'X' is on cpu; tk_mlir kernels need CUDA tensors: move it "
                      "with .cuda(), or run the kernel on the CPU in the interpreter: "
                      "kernel.interpret[grid](...) for one launch, or TK_MLIR_INTERPRET=1 in "
                      "the environment (read at the process's first launch) for every launch")


def test_cpu_torch_tensor_of_the_wrong_dtype_reports_the_device_first(driver_watch):
    torch = pytest.importorskip("torch")
    x = torch.zeros(64, 64, dtype=torch.float32)
    e = launch_error(k_copy_bf16, x, x.clone())
    assert "argument 'X' is on cpu" in str(e)


def test_wrong_dtype(driver_watch):
    e = launch_error(k_copy_bf16, FakeCudaArray((64, 64), "<f4"),
                     FakeCudaArray((64, 64), "<f4"))
    assert str(e) == ("argument 'X' has dtype f32, but the kernel's annotation wants bf16; "
                      "convert it (torch: x.to(torch.bfloat16))")   # (numpy has no bfloat16)


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
    error_checks.check_error(e, "rank-by-code", "tk.load", "tk.load needs 1 coordinates for a "
                             "rank-1 tensor (one per dim), got 2", HERE)


def test_static_shape_mismatch(driver_watch):
    # bf16 has no __cuda_array_interface__ typestr and a CPU torch tensor stops
    # at the device rule, so without a GPU the dim rule is reached with f16.
    e = launch_error(k_static_f16, FakeCudaArray((64, 2048), "<f2"),
                     FakeCudaArray((64, 4096), "<f2"))
    assert str(e) == ("argument 'X' has shape (64, 2048): dim 1 must be 4096 (the kernel's "
                      "annotation fixes it)")


def test_dims_beyond_i32_are_refused():
    with pytest.raises(tk.ArgumentError, match="below 2\\*\\*31"):
        check_tensor(spec((2**31, 8), "f32"), "X", dtype="f32", rank=2)


@pytest.mark.parametrize("value", [2**31, -2**31 - 1])
def test_i32_scalar_out_of_range(driver_watch, value):
    x = FakeCudaArray((64, 64), "<f4")
    e = launch_error(k_scaled, x, x, value, 1.0)
    assert str(e) == f"argument 's' = {value} is outside the 32-bit range " \
        f"[-2147483648, 2147483647] of a run-time int (split it, or pass it as a tk.constexpr)"


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


def test_num_warps_not_a_power_of_two_at_launch():
    with pytest.raises(tk.ArgumentError, match=r"num_warps must be from 1 to 32 and a power of two "
                       r"or a multiple of 4, got 3"):
        k_copy_f32.compile(F32, F32, num_warps=3)
    with pytest.raises(tk.ArgumentError, match="got 64"):
        k_copy_f32[(1,)](F32, F32, num_warps=64)


def test_argument_errors_are_type_errors():
    assert issubclass(tk.ArgumentError, TypeError)
