"""Element values of the interpreter: how each tk dtype is held and rounded.

Every float tile is a float32 numpy array whose values are exactly
representable in the tile's dtype: after each op the f32 result is rounded
to the dtype (round-to-nearest-even), which is what storage and conversions
on the GPU do. bf16 and fp8 have no numpy dtype, so they are rounded through
torch's CPU conversions (exact RNE, as cvt.rn); f16 through numpy's float16
(also RNE). i32 tiles are int32 arrays (wrapping, as the GPU's), bool tiles
bool arrays.
"""
from __future__ import annotations

import numpy as np

# The numpy dtype that holds each tk dtype's values.
HOLDER = {"bf16": np.float32, "f16": np.float32, "f32": np.float32,
          "f8e4m3": np.float32, "f8e5m2": np.float32, "i32": np.int32, "bool": np.bool_}
_TORCH_ROUNDED = {"bf16": "bfloat16", "f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}


def round_to(dtype: str, x) -> np.ndarray:
    """x (any numbers) as the values of a `dtype` tile: f32, then rounded to
    the nearest `dtype` value, ties to even; i32 and bool by numpy's casts."""
    if dtype in ("i32", "bool"):
        return np.asarray(x).astype(HOLDER[dtype])
    x = np.asarray(x, dtype=np.float32)
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float32)
    import torch
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(getattr(torch, _TORCH_ROUNDED[dtype])).to(torch.float32).numpy().reshape(x.shape)


def scalar_for(dtype: str, value) -> np.ndarray:
    """A scalar operand of an op on `dtype` tiles, as the GPU converts it once
    to the tile's dtype (lowering/fragments.py zip_with)."""
    return round_to(dtype, np.asarray(value))
