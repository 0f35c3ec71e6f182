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

from ..dtypes import DTYPES, TILE_DTYPES

# The numpy dtype that holds each tile dtype's values: float32 for every
# float (rounded to the dtype by round_to), numpy's own type for the rest
# (its name is the dtype's torch column: int32, bool).
HOLDER = {name: np.dtype(np.float32 if d.float else d.torch).type
          for name, d in TILE_DTYPES.items()}


def round_to(dtype: str, x) -> np.ndarray:
    """x (any numbers) as the values of a `dtype` tile: f32, then rounded to
    the nearest `dtype` value, ties to even; i32 and bool by numpy's casts,
    but a float to i32 as the GPU's cvt.rzi.s32.f32 converts it: toward
    zero, saturating (±inf and values past the range to its ends), NaN to 0
    (numpy's cast gives -2**31 for all of those)."""
    if not DTYPES[dtype].float:
        x = np.asarray(x)
        if dtype == "i32" and x.dtype.kind == "f":
            x = np.clip(np.nan_to_num(np.trunc(x.astype(np.float64)), nan=0.0), -2**31, 2**31 - 1)
        return x.astype(HOLDER[dtype])
    x = np.asarray(x, dtype=np.float32)
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float32)
    import torch          # bf16 and fp8: numpy has no such type, torch rounds exactly
    t = torch.from_numpy(np.ascontiguousarray(x))
    rounded = t.to(getattr(torch, DTYPES[dtype].torch)).to(torch.float32)
    return rounded.numpy().reshape(x.shape)


def scalar_for(dtype: str, value) -> np.ndarray:
    """A scalar operand of an op on `dtype` tiles, as the GPU converts it once
    to the tile's dtype (lowering/fragments.py zip_with)."""
    return round_to(dtype, np.asarray(value))
