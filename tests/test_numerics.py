"""tk_mlir/interpreter/numerics.py: each tile dtype of dtypes.py is held in
numpy (floats as float32) and rounded to its dtype, ties to even, as the
GPU's conversions do."""
import numpy as np
import pytest
import torch

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
