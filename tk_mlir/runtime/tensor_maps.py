"""TMA tensor maps: encoded on the host with cuTensorMapEncodeTiled, cached.

A kernel whose TMA ops read or write tensor argument X with a tile box gets
one tensor map parameter per (X, box) (lowering/tma.py). At launch the map is
looked up by everything it encodes (pointer, shape, strides, dtype, box,
swizzle): encoding costs a driver call, and a training loop reuses the same
few tensors. Maps are passed by value as 128-byte __grid_constant__
parameters; the cache keeps each CUtensorMap alive while it may be in use.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from ..dtypes import DTYPES
from .arguments import check_tma_tensor  # noqa: F401  (the launch's callers find it here)
from .driver import check, cu, using_context  # (driver.py: what is missing without cuda-bindings)

_SWIZZLE_NAMES = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}
_MAX_CACHED = 4096


def encode(ptr: int, shape, strides, dtype: str, itemsize: int, box_rows: int,
           box_cols: int, swizzle: int) -> cu.CUtensorMap:
    """A tiled tensor map: dims innermost first, box = (box_cols, box_rows, 1, ...)."""
    rank = len(shape)
    dims = [cu.cuuint64_t(int(d)) for d in reversed(shape)]
    steps = [cu.cuuint64_t(s) for s in _byte_strides(shape, strides, itemsize)]
    # A rank-1 tensor has only the inner dim (a shared vector's box: rows is 1).
    box = ([cu.cuuint32_t(box_cols), cu.cuuint32_t(box_rows)] +
           [cu.cuuint32_t(1)] * (rank - 2))[:rank]
    ones = [cu.cuuint32_t(1)] * rank
    args = (_data_type(dtype), rank, ptr, dims, steps, box, ones,
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{_SWIZZLE_NAMES[swizzle]}"),
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    result = cu.cuTensorMapEncodeTiled(*args)
    if result[0] == cu.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        # A thread with no current context (autograd's device threads run a
        # backward's first kernel there): encode under the tensor's device's.
        device = check(cu.cuPointerGetAttribute(
            cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
            "cuPointerGetAttribute(DEVICE_ORDINAL)")
        with using_context(int(device)):
            result = cu.cuTensorMapEncodeTiled(*args)
    return check(result, f"cuTensorMapEncodeTiled(shape={tuple(shape)}, "
                         f"box={box_rows}x{box_cols}, swizzle={swizzle})")


def _data_type(dtype: str):
    """The tensor-map data type of a tk dtype (the dtype table's column; fp8
    is bytes: TMA only copies)."""
    name = DTYPES[dtype].tensor_map
    return getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{name}")


def _byte_strides(shape, strides, itemsize: int) -> list[int]:
    """globalStrides, innermost first. A dim of size 1 is never stepped over,
    so its stride may be anything (torch gives such dims odd strides); the
    driver still wants a multiple of 16 no smaller than what it spans."""
    out, span = [], shape[-1] * itemsize
    for n, step in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        b = step * itemsize if n != 1 else -(-span // 16) * 16
        out.append(int(b))
        span = n * b
    return out


class TensorMapCache:
    """Encoded maps by everything they encode, least recently used dropped."""

    def __init__(self, capacity: int = _MAX_CACHED):
        self._maps: OrderedDict = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, ptr: int, shape, strides, dtype: str, itemsize: int, box) -> cu.CUtensorMap:
        key = (ptr, tuple(shape), tuple(strides), dtype, box)
        m = self._maps.get(key)
        if m is None:
            m = encode(ptr, shape, strides, dtype, itemsize, *box)
            with self._lock:
                self._maps[key] = m
                if len(self._maps) > self._capacity:
                    self._maps.popitem(last=False)
        elif len(self._maps) > self._capacity // 2:   # near full: keep the hot ones
            with self._lock:
                if key in self._maps:
                    self._maps.move_to_end(key)
        return m

    def __len__(self) -> int:
        return len(self._maps)


CACHE = TensorMapCache()


def tensor_map(info, box) -> cu.CUtensorMap:
    """The map of a tensor argument (TensorInfo) for box (rows, cols, swizzle)."""
    return CACHE.get(info.ptr, info.shape, info.strides, info.dtype, info.itemsize, box)
