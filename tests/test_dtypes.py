"""tk_mlir/dtypes.py, the one table of element types: each column names
what its layer expects (MLIR parses the spelling, torch and nvvm have the
names), names are unique per column, and the derived views agree."""
import pytest
import torch
from mlir import ir
from mlir.dialects import nvvm

import tk_mlir as tk
from tk_mlir import dtypes
from tk_mlir.dialects import types as T

ROWS = list(dtypes.DTYPES.values())


@pytest.mark.parametrize("column", ["name", "mlir", "torch"])
def test_a_column_names_each_dtype_once(column):
    names = [getattr(r, column) for r in ROWS if getattr(r, column) is not None]
    assert len(names) == len(set(names))
    typestrs = [s for r in ROWS for s in r.typestr]
    assert len(typestrs) == len(set(typestrs))


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_each_column_is_what_its_layer_knows(row):
    if row.mlir:
        with ir.Context():
            assert ir.Type.parse(row.mlir)
            assert T.scalar_dtype(row.name) in dtypes.TILE_DTYPES
    if row.torch:
        assert getattr(torch, row.torch).itemsize == row.itemsize
        assert getattr(torch, row.torch).is_floating_point == row.float
    if row.wgmma:
        assert getattr(nvvm.WGMMATypes, row.wgmma) is not None
    assert not row.memory or (row.mlir and row.argument and row.tensor_map)
    assert not row.tensor_map or row.memory


def test_derived_views():
    assert set(dtypes.MEMORY_DTYPES) == {"bf16", "f16", "f32", "f8e4m3", "f8e5m2"}
    assert set(dtypes.ARGUMENT_DTYPES) == {*dtypes.MEMORY_DTYPES, "i32"}
    assert set(dtypes.TILE_DTYPES) == {*dtypes.MEMORY_DTYPES, "i32", "bool"}
    assert all(dtypes.DTYPES[dtypes.BY_TORCH_NAME[r.torch]] is r for r in ROWS if r.torch)
    assert all(dtypes.BY_TYPESTR[s] == r.name for r in ROWS for s in r.typestr)


@pytest.mark.parametrize("row", [r for r in ROWS if r.tensor_map], ids=lambda r: r.name)
def test_tensor_map_types_exist_in_the_driver(row):
    driver = pytest.importorskip("cuda.bindings.driver")
    assert getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{row.tensor_map}", None) \
        is not None


@tk.kernel(num_warps=4)
def first_n(X: tk.gl[tk.f32], N: tk.gl[tk.i32], Y: tk.gl[tk.f32]):
    """Y = X where the index is below N[0], else 0."""
    idx = tk.zeros((64,), tk.i32).indices()
    tk.store(Y, tk.where(idx < tk.load(N, (0,)), tk.load(X, (0,), (64,)), 0.0), (0,))


def test_tk_i32_names_the_int32_tensors_and_index_tiles():
    """tk.i32 as an annotation, a spec's dtype and a tile's: an i32 tensor's
    scalar bounds an index tile's mask (in the interpreter and compiled)."""
    x, y = torch.randn(64), torch.full((64,), float("nan"))
    first_n.interpret[(1,)](x, torch.tensor([37, 0, 0, 0], dtype=torch.int32), y)
    assert torch.equal(y, torch.where(torch.arange(64) < 37, x, 0.0))
    assert repr(tk.i32) == "tk.i32" and tk.spec((4,), tk.i32).dtype == "i32"
    assert "setp" in first_n.compile(tk.spec((64,), tk.f32), tk.spec((4,), tk.i32),
                                     tk.spec((64,), tk.f32)).asm["ptx"]
