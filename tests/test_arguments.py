"""Reading and checking kernel tensor arguments (no GPU needed).

check_tensor tests build TensorInfo by hand with device 'cuda:0' where a rule
other than the device rule is under test: the device rule comes first, and
this machine has no CUDA tensors.
"""
import dataclasses

import numpy as np
import pytest
import torch

from tk_mlir.dtypes import DTYPES
from tk_mlir.errors import ArgumentError
from tk_mlir.runtime.arguments import (
    TensorInfo, TensorSpec, canonical_dtype, check_tensor, describe, spec, tensor_info)

BASE = 0x7F00_0000_0000          # a 16-byte aligned fake device address


def cuda_info(shape, strides=None, dtype="bf16", itemsize=2, ptr=BASE):
    strides = strides or spec(shape, dtype).strides
    return TensorInfo(ptr, tuple(shape), tuple(strides), dtype, "cuda:0", itemsize)


def rejects(info, match, **annotation):
    annotation.setdefault("dtype", info.dtype)
    annotation.setdefault("rank", len(info.shape))
    with pytest.raises(ArgumentError, match=match) as caught:
        check_tensor(info, "x", **annotation)
    assert "argument 'x'" in str(caught.value)
    return str(caught.value)


# ------------------------------------------------------------- tensor_info

def test_torch_tensor_is_read_directly():
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    info = tensor_info(t, "x")
    assert info == TensorInfo(t.data_ptr(), (4, 8), (8, 1), "bf16", "cpu", 2)
    assert tensor_info(t.t(), "x").strides == (1, 8)


@pytest.mark.parametrize("row", [r for r in DTYPES.values() if r.torch], ids=lambda r: r.name)
def test_each_dtype_is_read_by_its_row(row):
    """A dtype torch or numpy names is read as its row in dtypes.py says, one
    kernels do not take too (the annotation then refuses it by name)."""
    info = tensor_info(torch.zeros(16, dtype=getattr(torch, row.torch)), "x")
    assert (info.dtype, info.itemsize) == (row.name, row.itemsize)
    assert canonical_dtype(row.torch) == canonical_dtype(row.name) == row.name
    if row.name not in ("bf16", "f8e4m3", "f8e5m2"):          # numpy has no such type
        assert describe(np.zeros(16, row.torch)).dtype == row.name


def test_a_dtype_kernels_do_not_take_is_refused_by_the_annotation_with_the_fix():
    info = tensor_info(torch.zeros(16, dtype=torch.bool), "x")
    rejects(dataclasses.replace(info, device="cuda:0"), r"has dtype bool, but the kernel's "
            r"annotation wants f32; convert it \(torch: x.to\(torch.float32\); numpy: "
            r"x.astype\('float32'\)\)", dtype="f32")


def test_refusals_list_the_dtypes_kernels_take():
    taken = "bf16, f16, f32, f8e4m3, f8e5m2, i32"
    with pytest.raises(ArgumentError) as caught:
        tensor_info(torch.zeros(4, dtype=torch.complex64), "z")
    assert str(caught.value).endswith(f"which tk_mlir kernels do not take (they take {taken})")
    with pytest.raises(ArgumentError, match=f"unknown dtype 'bf17'; the supported dtypes are "
                                            f"{taken} "):
        canonical_dtype("bf17")


def test_torch_subclass_and_meta_tensor():
    param = torch.nn.Parameter(torch.zeros(2, 8))
    assert tensor_info(param, "w").dtype == "f32"
    meta = tensor_info(torch.empty(2, 8, device="meta", dtype=torch.float16), "m")
    assert (meta.device, meta.dtype) == ("meta", "f16")


def test_unsupported_torch_dtype_names_argument():
    with pytest.raises(ArgumentError, match=r"argument 'z' has dtype torch.complex64"):
        tensor_info(torch.zeros(4, dtype=torch.complex64), "z")


@pytest.mark.parametrize("obj", [[1.0, 2.0], 3, None, "tensor"])
def test_non_tensor_is_refused_with_type_name(obj):
    with pytest.raises(ArgumentError) as caught:
        tensor_info(obj, "x")
    assert str(caught.value) == (
        "argument 'x': expected a CUDA tensor (torch.Tensor, __cuda_array_interface__ "
        f"or DLPack), got {type(obj).__name__}")
    assert isinstance(caught.value, TypeError)


def test_tensor_info_is_frozen():
    info = cuda_info((4, 8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.ptr = 0
    assert dataclasses.replace(info, ptr=16).ptr == 16
    assert hash(info) == hash(cuda_info((4, 8)))


# ------------------------------------------------ __cuda_array_interface__

class FakeCudaArray:
    """Carries only the interface dict: this tests parsing, not the GPU."""

    def __init__(self, **interface):
        self.__cuda_array_interface__ = {"version": 3, "strides": None, "data": (BASE, False),
                                         **interface}


def test_cuda_array_interface_contiguous():
    info = tensor_info(FakeCudaArray(shape=(4, 8), typestr="<f2"), "x")
    assert (info.ptr, info.shape, info.strides, info.dtype, info.itemsize) == (
        BASE, (4, 8), (8, 1), "f16", 2)
    assert info.device.startswith("cuda")


def test_cuda_array_interface_byte_strides_become_elements():
    info = tensor_info(FakeCudaArray(shape=(4, 8), typestr="<f4", strides=(64, 4)), "x")
    assert info.strides == (16, 1) and info.dtype == "f32"


def test_cuda_array_interface_v2_without_strides_key():
    interface = {"version": 2, "shape": (3, 16), "typestr": "<i4", "data": (BASE, False)}
    obj = type("V2", (), {"__cuda_array_interface__": interface})()
    assert tensor_info(obj, "x").strides == (16, 1)


def test_cuda_array_interface_refuses_raw_bytes_typestr():
    with pytest.raises(ArgumentError, match=r"argument 'x'.*'<V2'.*bf16.*torch tensor or a DLPack"):
        tensor_info(FakeCudaArray(shape=(4, 8), typestr="<V2"), "x")


def test_cuda_array_interface_refuses_unknown_typestr_mask_and_odd_strides():
    with pytest.raises(ArgumentError, match=r"typestr '<c8'.*\(they take <f2, <f4, <i4\)$"):
        tensor_info(FakeCudaArray(shape=(4,), typestr="<c8"), "x")
    with pytest.raises(ArgumentError, match="masked"):
        tensor_info(FakeCudaArray(shape=(4,), typestr="<f4", mask=object()), "x")
    with pytest.raises(ArgumentError, match="not whole elements"):
        tensor_info(FakeCudaArray(shape=(4, 4), typestr="<f4", strides=(18, 4)), "x")
    with pytest.raises(ArgumentError, match="malformed"):
        tensor_info(FakeCudaArray(typestr="<f4"), "x")


# ------------------------------------------------------------------ DLPack

class FakeDlpack:
    """A DLPack producer that is neither torch nor numpy."""

    def __init__(self, tensor, device=None):
        self.tensor, self.device = tensor, device

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.device or self.tensor.__dlpack_device__()


def test_dlpack_object_is_read_through_torch():
    t = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    info = tensor_info(FakeDlpack(t), "x")
    assert (info.ptr, info.shape, info.strides, info.dtype, info.device) == (
        t.data_ptr(), (4, 8), (8, 1), "f32", "cpu")


def test_dlpack_device_that_cuda_cannot_read():
    with pytest.raises(ArgumentError, match=r"argument 'x' lives on DLPack device type 8"):
        tensor_info(FakeDlpack(torch.zeros(4), device=(8, 0)), "x")


def test_numpy_array_reads_as_cpu_and_fails_the_device_rule():
    info = tensor_info(np.zeros((4, 8), np.float32), "x")
    assert (info.device, info.dtype, info.strides) == ("cpu", "f32", (8, 1))
    rejects(info, r"argument 'x' is on cpu; tk_mlir kernels need CUDA tensors")


# ---------------------------------------------------------- check_tensor

def test_good_tensor_passes():
    check_tensor(cuda_info((64, 128)), "x", dtype="bf16", rank=2, static_shape=(None, 128))
    check_tensor(cuda_info((2, 3, 8), dtype="f32", itemsize=4), "y", dtype="f32", rank=3)


def test_cpu_tensor():
    """The error says how to run the kernel here: on the GPU (.cuda()) or in
    the CPU interpreter, for one launch or for every launch."""
    message = rejects(tensor_info(torch.randn(4, 8).to(torch.bfloat16), "x"),
                      r"is on cpu; tk_mlir kernels need CUDA tensors")
    assert "move it with .cuda()" in message
    assert "kernel.interpret[grid](...)" in message and "TK_MLIR_INTERPRET=1" in message


def test_device_rule_comes_first():
    # A misaligned CPU view with the wrong dtype and rank: the device is reported.
    t = torch.zeros(65, dtype=torch.float32)[1:]
    rejects(tensor_info(t, "x"), "is on cpu", dtype="bf16", rank=2)


def test_wrong_dtype():
    message = rejects(cuda_info((4, 8), dtype="f32", itemsize=4),
                      r"has dtype f32, but the kernel's annotation wants bf16", dtype="bf16")
    assert "torch.bfloat16" in message


def test_dtype_annotation_may_be_a_dtype_object():
    tk_bf16 = type("DType", (), {"name": "bf16"})()
    check_tensor(cuda_info((4, 8)), "x", dtype=tk_bf16, rank=2)
    rejects(cuda_info((4, 8)), "wants f16", dtype=type("DType", (), {"name": "f16"})())


def test_wrong_rank():
    rejects(cuda_info((4, 8, 8)), r"has rank 3 \(shape \(4, 8, 8\)\), but the kernel's "
                                  r"annotation wants rank 2", rank=2)


def test_static_dim():
    rejects(cuda_info((64, 64)), r"has shape \(64, 64\): dim 1 must be 128",
            static_shape=(None, 128))


def test_innermost_stride_must_be_one():
    message = rejects(cuda_info((8, 16), strides=(1, 8)), r"innermost dim must have stride 1")
    assert "contiguous()" in message


def test_misaligned_pointer():
    # A CPU view offset by one element, described as if it were on the GPU.
    view = torch.zeros(65, 8, dtype=torch.bfloat16).view(-1)[1:]
    info = cuda_info((8 * 64,), ptr=view.data_ptr())
    message = rejects(info, r"data pointer 0x[0-9a-f]+ is not 16-byte aligned")
    assert "clone()" in message


def test_rows_must_be_whole_16_byte_vectors():
    message = rejects(cuda_info((4, 100)), r"rows \(innermost dim\) are 100 x 2 = 200 bytes")
    assert "multiple of 8 elements" in message
    rejects(cuda_info((3,), dtype="f32", itemsize=4), r"12 bytes.*multiple of 4 elements")


def test_row_starts_must_be_16_byte_aligned():
    # Rows of 64 bf16 elements, but a row pitch of 100 elements (200 bytes).
    message = rejects(cuda_info((4, 64), strides=(100, 1)), r"dim 0 steps 200 bytes")
    assert "16-byte aligned" in message
    rejects(cuda_info((4, 64), strides=(-64, 1)), r"dim 0 steps -128 bytes")


def test_size_one_dims_may_have_any_stride():
    check_tensor(cuda_info((1, 4, 64), strides=(3, 64, 1)), "x", dtype="bf16", rank=3)


def test_spec_skips_device_and_pointer_rules_only():
    check_tensor(spec((64, 128), "bf16"), "x", dtype="bf16", rank=2, static_shape=(64, 128))
    rejects(spec((64, 100), "bf16"), "200 bytes")
    rejects(spec((64, 128), "f16"), "wants bf16", dtype="bf16")


# ------------------------------------------------------- spec / describe

def test_spec_is_contiguous_and_memoryless():
    s = spec((128, 64), "bf16")
    assert s == TensorSpec((128, 64), (64, 1), "bf16", 2, "meta")
    assert s.ptr is None and s.device == "meta"
    assert spec((4, 8), torch.float16).dtype == "f16"
    assert spec([2, 8], np.float32).strides == (8, 1)


def test_spec_refuses_bad_shapes_and_dtypes():
    with pytest.raises(ArgumentError, match="non-negative ints"):
        spec((4, -1), "bf16")
    with pytest.raises(ArgumentError, match="is not a dtype tk_mlir knows"):
        spec((4,), "bf17")


def test_describe_numpy():
    assert describe(np.zeros((4, 8), np.float16)) == spec((4, 8), "f16")
    strided = describe(np.zeros((4, 8), np.float32)[:, ::2])
    assert (strided.shape, strided.strides, strided.dtype) == ((4, 4), (8, 2), "f32")


def test_describe_torch_meta_and_cpu():
    meta = torch.empty(32, 64, device="meta", dtype=torch.bfloat16)
    assert describe(meta) == spec((32, 64), "bf16")
    transposed = describe(torch.zeros(8, 16, dtype=torch.float8_e4m3fn).t())
    assert (transposed.shape, transposed.strides, transposed.dtype) == ((16, 8), (1, 16), "f8e4m3")


def test_describe_spec_and_info():
    s = spec((16, 16), "f32")
    assert describe(s) is s
    assert describe(cuda_info((16, 16))) == spec((16, 16), "bf16")
    fake = FakeCudaArray(shape=(4, 8), typestr="<f2")
    assert describe(fake) == spec((4, 8), "f16")
