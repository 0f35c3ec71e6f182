"""tk_mlir/interpreter/numerics.py: each tile dtype of dtypes.py is held in
numpy (floats as float32) and rounded to its dtype, ties to even, as the
GPU's conversions do."""
import numpy as np
import pytest
import torch

import tk_mlir as tk
from tk_mlir.dtypes import TILE_DTYPES
from tk_mlir.interpreter.numerics import HOLDER, round_to

FLOATS = [r for r in TILE_DTYPES.values() if r.float]


def test_every_tile_dtype_has_a_holder():
    assert HOLDER == {**{r.name: np.float32 for r in FLOATS}, "i32": np.int32, "bool": np.bool_}


@pytest.mark.parametrize("row", FLOATS, ids=lambda r: r.name)
def test_floats_round_to_their_dtype_as_torch_does(row):
    x = np.random.default_rng(0).standard_normal(256).astype(np.float32) * 4
    want = torch.from_numpy(x).to(getattr(torch, row.torch)).float().numpy()
    got = round_to(row.name, x)
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_ints_and_bools_by_numpy_casts():
    assert round_to("i32", [1.7, -2.5]).tolist() == [1, -2]
    assert round_to("bool", [0, 3]).tolist() == [False, True]


def test_floats_to_i32_as_the_gpus_cvt_rzi():
    """Toward zero and saturating, NaN to 0 (cvt.rzi.s32.f32), not numpy's
    -2**31 for every value out of range."""
    x = np.array([np.nan, np.inf, -np.inf, 1e10, -1e10, 2.7, -2.7, 2**31, -2**31 - 1e3],
                 dtype=np.float32)
    assert round_to("i32", x).tolist() == [0, 2**31 - 1, -2**31, 2**31 - 1, -2**31, 2, -2,
                                           2**31 - 1, -2**31]


@tk.kernel(num_warps=1)
def to_i32(X: tk.gl[tk.f32], Y: tk.gl[tk.i32]):
    tk.store(Y, tk.load(X, (0,), (32,)).to(tk.i32), (0,))


def test_a_kernel_converts_f32_to_i32_as_the_gpu():
    x = np.full(32, 0.5, np.float32)
    x[:5] = [np.nan, np.inf, -np.inf, 3e9, -7.9]
    y = np.zeros(32, np.int32)
    to_i32.interpret[(1,)](x, y)
    assert y[:6].tolist() == [0, 2**31 - 1, -2**31, 2**31 - 1, -7, 0]
