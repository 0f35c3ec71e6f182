"""The interpreter runs what the GPU launch runs and refuses what it refuses,
with the same message: one check of the tensor rules (runtime/arguments.py
check_tensor_rules: rows of whole 16-byte vectors, unit inner stride,
16-byte aligned data and row starts), the tensor map rules of the tensors
TMA ops reach (check_tma_tensor) and the scalar rules (launcher.check_scalar).
The device is the one difference: numpy arrays and CPU torch tensors.

Each refusal is compared with the GPU launch's own check on the same tensor
described as a CUDA one; each accepted layout runs against a float64
reference (fresh random inputs, outputs poisoned with NaN)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.runtime.arguments import check_tensor, check_tma_tensor, tensor_info

RNG = np.random.default_rng()
BF16_TOLERANCE = 8e-3          # one bf16 rounding of the output, ~2^-9 per element


@tk.kernel(num_warps=4)
def scale(X: tk.gl, Y: tk.gl, s: float, COLS: tk.constexpr = 64):
    """Y = s * X, a 16 x COLS tile per block (bare tk.gl: any dtype, X's for Y)."""
    i = tk.block_id(0)
    tk.store(Y, tk.load(X, (i, 0), (16, COLS)) * s, (i, 0))


@tk.kernel(num_warps=4)
def tma_double(A: tk.gl, C: tk.gl[f32], B: tk.gl[f32]):
    """C = 2 A + B, A's 64 x 64 tiles in by TMA (a tensor map), B by threads."""
    a = tk.shared_tile(A.dtype, (64, 64), swizzle=128)
    sem = tk.semaphore()
    i = tk.block_id(0)
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(sem, a)
        tk.tma.load_async(a, A, (i, 0), sem)
    tk.wait(sem, 0)
    x = tk.load(a, layout="row", scope="warpgroup").to(f32)
    b = tk.load(B, (i, 0), (64, 64), layout="row", scope="warpgroup")
    tk.store(C, x + x + b, (i, 0))


# ------------------------------------------------------------- the arrays

def numpy_array(shape, dtype=np.float32) -> np.ndarray:
    return (RNG.standard_normal(shape) + 3).astype(dtype)     # never zeros


def torch_tensor(shape, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(shape) + 3).to(dtype)


def misaligned(dtype, elements: int, offset: int, shape) -> np.ndarray | torch.Tensor:
    """A view of a flat buffer starting `offset` elements in (x[1:] of a 1-D
    buffer, viewed as 2-D)."""
    if isinstance(dtype, torch.dtype):
        return torch_tensor(elements + offset, dtype)[offset:].view(shape)
    return numpy_array(elements + offset, dtype)[offset:].reshape(shape)


# (what, array): layouts the GPU launch refuses, in several dtypes and views.
REFUSED = [
    ("rows of 250 f32", lambda: numpy_array((16, 250))),
    ("rows of 100 bf16", lambda: torch_tensor((16, 100))),
    ("rows of 36 f16 (numpy)", lambda: numpy_array((16, 36), np.float16)),
    ("a transposed f16 view", lambda: torch_tensor((64, 16), torch.float16).t()),
    ("a transposed f32 array", lambda: numpy_array((64, 16)).T),
    ("[:, :250] of 256 f32 columns", lambda: numpy_array((16, 256))[:, :250]),
    ("[:, :64] of 100 bf16 columns (200-byte rows)", lambda: torch_tensor((16, 100))[:, :64]),
    ("x[1:] of a flat f32 buffer as 16 x 64", lambda: misaligned(np.float32, 1024, 1, (16, 64))),
    ("x[3:] of a flat bf16 buffer as 16 x 64",
     lambda: misaligned(torch.bfloat16, 1024, 3, (16, 64))),
    ("reversed rows", lambda: numpy_array((16, 64))[::-1]),
    ("every other column", lambda: torch_tensor((16, 128), torch.float32)[:, ::2]),
]

# Layouts the GPU launch takes: strided rows and offsets of whole 16-byte vectors.
ACCEPTED = [
    ("[:, :64] of 128 f32 columns", lambda: numpy_array((16, 128))[:, :64]),
    ("[:, :64] of 72 bf16 columns (144-byte rows)", lambda: torch_tensor((16, 72))[:, :64]),
    ("x[4:] of a flat f32 buffer", lambda: misaligned(np.float32, 1024, 4, (16, 64))),
    ("x[8:] of a flat f16 buffer", lambda: misaligned(torch.float16, 1024, 8, (16, 64))),
    ("a contiguous f32 tensor", lambda: torch_tensor((16, 64), torch.float32)),
]


def gpu_refusal(array, name: str) -> str:
    """What the GPU launch says of `array` as argument `name` of `scale`,
    were it a CUDA tensor with the same layout and address."""
    info = dataclasses.replace(tensor_info(array, name), device="cuda:0")
    with pytest.raises(tk.ArgumentError) as e:
        check_tensor(info, name, dtype=info.dtype, rank=2)
    return str(e.value)


def like(array, shape=(16, 64)):
    """A fresh contiguous array of `array`'s kind and dtype, NaN."""
    if isinstance(array, torch.Tensor):
        return torch.full(shape, float("nan"), dtype=array.dtype)
    return np.full(shape, np.nan, array.dtype)


def as_float64(array) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        return array.to(torch.float64).numpy()
    return np.asarray(array, np.float64)


def rel_err(got, ref) -> float:
    got, ref = as_float64(got), as_float64(ref)
    assert not np.isnan(got).any(), "an output element was not written"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


# --------------------------------------------------------- tensor layouts

@pytest.mark.parametrize("what, make", REFUSED, ids=[w for w, _ in REFUSED])
def test_an_input_the_gpu_refuses_is_refused_with_its_message(what, make):
    x = make()
    y = like(x)
    expected = gpu_refusal(x, "X")
    with pytest.raises(tk.ArgumentError) as e:
        scale.interpret[(1,)](x, y, 2.5)
    assert str(e.value) == expected
    assert np.isnan(as_float64(y)).all()          # refused before anything ran


@pytest.mark.parametrize("what, make", REFUSED, ids=[w for w, _ in REFUSED])
def test_an_output_the_gpu_refuses_is_refused_with_its_message(what, make):
    y = make()
    x = like(y)
    x[...] = 1.5
    expected = gpu_refusal(y, "Y")
    with pytest.raises(tk.ArgumentError) as e:
        scale.interpret[(1,)](x, y, 2.5)
    assert str(e.value) == expected


def test_the_refusals_name_their_rules():
    """The cases above are the rules meant (not one rule every time)."""
    says = {what: gpu_refusal(make(), "X") for what, make in REFUSED}
    assert "rows must be whole 16-byte vectors" in says["rows of 250 f32"]
    assert "innermost dim must have stride 1" in says["a transposed f16 view"]
    assert "1000 bytes" in says["[:, :250] of 256 f32 columns"]
    assert "dim 0 steps 200 bytes" in says["[:, :64] of 100 bf16 columns (200-byte rows)"]
    assert "not 16-byte aligned" in says["x[1:] of a flat f32 buffer as 16 x 64"]
    assert "not 16-byte aligned" in says["x[3:] of a flat bf16 buffer as 16 x 64"]
    assert "steps -256 bytes" in says["reversed rows"]


@pytest.mark.parametrize("what, make", ACCEPTED, ids=[w for w, _ in ACCEPTED])
def test_layouts_the_gpu_takes_run(what, make):
    x = make()
    y = make()                                   # the output in the same layout
    y[...] = float("nan")
    check_tensor(dataclasses.replace(tensor_info(x, "X"), device="cuda:0"), "X",
                 dtype=tensor_info(x, "X").dtype, rank=2)       # (the GPU takes it)
    scale.interpret[(1,)](x, y, 2.5)
    tol = 1e-6 if tensor_info(x, "X").dtype == "f32" else BF16_TOLERANCE
    assert rel_err(y, 2.5 * as_float64(x)) < tol


def test_under_tk_mlir_interpret_a_launch_refuses_them_too(monkeypatch):
    """kernel[grid](...) under TK_MLIR_INTERPRET=1 takes the same path."""
    import sys
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", True)
    x = numpy_array((16, 256))[:, :250]
    with pytest.raises(tk.ArgumentError) as e:
        scale[(1,)](x, like(x), 2.5)
    assert str(e.value) == gpu_refusal(x, "X")


# ----------------------------------------------------------- tensor maps

def test_the_tensor_map_rules_apply_to_what_tma_reaches():
    """A tensor a TMA op reads obeys the tensor map's rules (as on the GPU,
    where the map is encoded): a stride of 2**40 bytes or more, even over a
    dim of one row, is refused for A, and is no matter for B (threads)."""
    a = torch_tensor((64, 64))
    b = numpy_array((64, 64))
    far = np.lib.stride_tricks.as_strided(b, shape=(1, 64), strides=(2**41, 4))
    c = np.full((64, 64), np.nan, np.float32)
    far_a = torch.as_strided(a, (1, 64), (2**40, 1))
    with pytest.raises(tk.ArgumentError) as e:
        tma_double.interpret[(1,)](far_a, c, b)
    with pytest.raises(tk.ArgumentError) as gpu:
        check_tma_tensor("A", tensor_info(far_a, "A"))
    assert str(e.value) == str(gpu.value) and "below 2**40 bytes" in str(e.value)

    tma_double.interpret[(1,)](a[:1], c, far)              # B: read by threads, one row
    ref = 2 * as_float64(a[:1]) + as_float64(far)
    assert rel_err(c[:1], ref) < 1e-6


def test_an_empty_tma_tensor_is_refused():
    a = torch_tensor((0, 64))
    with pytest.raises(tk.ArgumentError, match=r"argument 'A' has shape \(0, 64\): TMA tensor "
                                               r"maps need every dim non-empty"):
        tma_double.interpret[(1,)](a, numpy_array((64, 64)), numpy_array((64, 64)))


def test_a_tma_kernel_runs_on_a_strided_view():
    a = torch_tensor((128, 96))[:, :64]          # 192-byte rows: whole 16-byte vectors
    b, c = numpy_array((128, 64)), np.full((128, 64), np.nan, np.float32)
    tma_double.interpret[(2,)](a, c, b)
    assert rel_err(c, 2 * as_float64(a) + as_float64(b)) < 1e-6


# ----------------------------------------------------------------- scalars

@pytest.mark.parametrize("value, message", [
    (np.float64(2.5), r"argument 's' must be a float, got a numpy.float64 .*float\(x\)"),
    (np.float32(2.5), r"argument 's' must be a float, got .*float\(x\)"),
    ("2.5", r"argument 's' must be a float, got '2.5'"),
])
def test_scalars_the_gpu_refuses(value, message):
    x = numpy_array((16, 64))
    with pytest.raises(tk.ArgumentError, match=message):
        scale.interpret[(1,)](x, like(x), value)


@tk.kernel(num_warps=4)
def add_n(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    i = tk.block_id(0)
    tk.store(Y, tk.load(X, (i, 0), (16, 64)) + float(n), (i, 0))


def test_an_int_past_32_bits_is_the_gpus_error():
    x = numpy_array((16, 64))
    with pytest.raises(tk.ArgumentError) as e:
        add_n.interpret[(1,)](x, like(x), 2**31)
    assert str(e.value).startswith("argument 'n' = 2147483648 is outside the 32-bit range "
                                   "[-2147483648, 2147483647] of a run-time int")


# ------------------------------------------- read-only and autograd arrays

def test_a_read_only_numpy_input_is_read():
    x = numpy_array((16, 64))
    x.flags.writeable = False
    y = like(x)
    scale.interpret[(1,)](x, y, 2.5)
    assert rel_err(y, 2.5 * as_float64(x)) < 1e-6


@pytest.mark.parametrize("make", [
    lambda: np.frombuffer(numpy_array((16, 64)).tobytes(), np.float32).reshape(16, 64),
    lambda: np.broadcast_to(numpy_array((1, 64)), (16, 64)),
])
def test_a_read_only_numpy_output_is_an_error_naming_it(make):
    y = make()
    x = numpy_array((16, 64))
    with pytest.raises(tk.ArgumentError) as e:
        scale.interpret[(1,)](x, y, 2.5)
    assert str(e.value).startswith("argument 'Y' is a read-only numpy array"), str(e.value)
    assert "writable array" in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_requires_grad_tensors_are_read_and_written_as_on_the_gpu(dtype):
    """The GPU reads and writes a tensor's memory whatever autograd records of
    it: a requires_grad input, and a requires_grad leaf as the output."""
    x = torch_tensor((32, 64), dtype).requires_grad_()
    y = torch.full((32, 64), float("nan"), dtype=dtype).requires_grad_()
    scale.interpret[(2,)](x, y, 2.5)
    assert x.requires_grad and y.requires_grad and y.grad_fn is None
    tol = 1e-6 if dtype == torch.float32 else BF16_TOLERANCE
    assert rel_err(y.detach(), 2.5 * as_float64(x.detach())) < tol
    # A view that autograd records (not a leaf) as input: read as it is.
    z = torch.full((32, 64), float("nan"), dtype=dtype)
    scale.interpret[(2,)](x * 2, z, 0.5)
    assert rel_err(z, as_float64(x.detach())) < tol


def test_a_call_without_a_grid_says_how_to_give_one():
    """`kernel(x, y)` and `kernel.interpret(x, y)` forget the grid: a TypeError
    that shows the indexing, not Python's "object is not callable"."""
    x = torch.rand(16, 64)
    y = torch.full_like(x, float("nan"))
    with pytest.raises(TypeError, match=r"scale\[grid\]\(\.\.\.\)"):
        scale(x, y, 2.0)
    with pytest.raises(TypeError, match=r"scale\.interpret\[grid\]\(\.\.\.\)"):
        scale.interpret(x, y, 2.0)
    assert torch.isnan(y).all()               # (nothing ran)
