"""Register-tile layouts and shared tiles on the GPU, against torch.

Each layout (vec, row, col) at each scope it supports loads a tile, reduces
it along rows and columns, broadcasts the results back and stores tile and
vectors; shared tiles make a global -> shared -> register -> shared ->
global round trip under every swizzle. Shapes leave part of each tile past
the tensor's edge, so masking is exercised too.
"""
import pytest

torch = pytest.importorskip("torch")

import tk_mlir as tk
from tk_mlir import bf16, f32

pytestmark = pytest.mark.gpu


@tk.kernel(num_warps=4)
def tile_ops(X: tk.gl[f32], RS: tk.gl[f32], CM: tk.gl[f32], Y: tk.gl[f32],
             R: tk.constexpr, C: tk.constexpr, LAYOUT: tk.constexpr, SCOPE: tk.constexpr,
             COLS: tk.constexpr):
    x = tk.load(X, (0, 0), (R, C), layout=LAYOUT, scope=SCOPE)
    rs = x.row_sum()
    tk.store(RS, rs, (0,))
    y = x.sub_row(rs)
    if COLS:
        cm = x.col_max()
        tk.store(CM, cm, (0,))
        y = y.mul_col(cm)
    tk.store(Y, y, (0, 0))


CASES = [  # layout, scope, R, C, column reductions (cross the warps of a warpgroup tile)
    ("vec", "block", 16, 64, True), ("vec", "block", 1, 1024, True),
    ("vec", "block", 64, 256, True), ("vec", "warp", 8, 64, True),
    ("row", "warp", 16, 16, True), ("row", "warp", 32, 64, True),
    ("col", "warp", 16, 32, True), ("row", "warpgroup", 64, 32, False),
    ("row", "block", 64, 16, False),
]


@pytest.mark.parametrize("layout,scope,R,C,cols", CASES)
def test_layout_reduce_broadcast(layout, scope, R, C, cols):
    m = max(1, R - 3)               # the last rows of the tile are past the edge
    x = torch.rand(m, C, device="cuda") - 0.5
    rs = torch.full((max(R, 4),), float("nan"), device="cuda")   # rows of whole 16-byte vectors
    cm = torch.full((C,), float("nan"), device="cuda")
    y = torch.full_like(x, float("nan"))
    tile_ops[(1,)](x, rs, cm, y, R=R, C=C, LAYOUT=layout, SCOPE=scope, COLS=cols)
    torch.cuda.synchronize()
    xd = x.double()
    ref_rs = xd.sum(1)
    assert torch.allclose(rs[:m].double(), ref_rs, rtol=1e-5, atol=1e-5)
    assert torch.all(rs[m:R] == 0)  # masked rows read 0: their sum is 0
    ref_y = xd - ref_rs[:, None]
    if cols:
        ref_cm = torch.cat([xd, torch.zeros(R - m, C, device="cuda", dtype=torch.float64)]).max(0).values
        assert torch.allclose(cm.double(), ref_cm, rtol=1e-6, atol=1e-6)
        ref_y = ref_y * ref_cm[None, :]
    assert torch.allclose(y.double(), ref_y, rtol=1e-5, atol=1e-5)


@tk.kernel(num_warps=4)
def shared_roundtrip(X: tk.gl[bf16], Y: tk.gl[bf16], R: tk.constexpr, C: tk.constexpr,
                     SWIZZLE: tk.constexpr, LAYOUT: tk.constexpr):
    i = tk.block_id(0)
    a = tk.shared_tile(bf16, (R, C), swizzle=SWIZZLE)
    b = tk.shared_tile(bf16, (R, C), swizzle=SWIZZLE)
    tk.copy(a, X, (i, 0))
    t = tk.load(a, layout=LAYOUT, scope="warp")
    tk.store(b, (t.to(f32) * 2.0 + 1.0).to(bf16))
    tk.copy(Y, b, (i, 0))


@pytest.mark.parametrize("swizzle", [0, 32, 64, 128])
@pytest.mark.parametrize("layout,C", [("vec", 64), ("row", 64), ("vec", 128)])
def test_shared_tile_roundtrip(swizzle, layout, C):
    R, m = 32, 100                     # 4 tiles of rows, the last one partly past the edge
    x = (torch.rand(m, C, device="cuda") - 0.5).to(torch.bfloat16)
    y = torch.full_like(x, float("nan"))
    shared_roundtrip[(tk.cdiv(m, R),)](x, y, R=R, C=C, SWIZZLE=swizzle, LAYOUT=layout)
    torch.cuda.synchronize()
    ref = (x.float() * 2 + 1).to(torch.bfloat16)
    assert torch.equal(y, ref)


@tk.kernel(num_warps=4)
def convert_map(X: tk.gl[f32], Y16: tk.gl[tk.f16], YB: tk.gl[bf16], Z: tk.gl[f32],
                BM: tk.constexpr):
    i = tk.block_id(0)
    x = tk.load(X, (i, 0), (BM, 64))
    h = x.exp().to(tk.f16)                  # f32 -> f16
    b = (h.to(bf16) * 2.0).relu()           # f16 -> bf16 (through f32), bf16 arithmetic
    tk.store(Y16, h, (i, 0))
    tk.store(YB, b, (i, 0))
    tk.store(Z, max(b.to(f32), x) - min(x.abs().sqrt(), 1.0), (i, 0))


def test_dtype_conversions_and_maps():
    m = 77
    x = torch.rand(m, 64, device="cuda") * 4 - 2
    y16 = torch.full((m, 64), float("nan"), device="cuda", dtype=torch.float16)
    yb = torch.full((m, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    z = torch.full_like(x, float("nan"))
    convert_map[(tk.cdiv(m, 16),)](x, y16, yb, z, BM=16)
    torch.cuda.synchronize()
    h = torch.exp(x.double()).half()
    b = torch.relu(h.bfloat16() * 2)
    assert torch.allclose(y16.double(), h.double(), rtol=2e-3)
    assert torch.allclose(yb.double(), b.double(), rtol=1e-2)
    ref = torch.maximum(b.double(), x.double()) - torch.minimum(x.abs().sqrt().double(),
                                                               torch.ones_like(x.double()))
    assert torch.allclose(z.double(), ref, rtol=1e-2, atol=1e-2)


@tk.kernel(num_warps=4)
def skip_ones_scale(X: tk.gl[f32], V: tk.gl[f32], Y: tk.gl[f32], LAYOUT: tk.constexpr,
                    AXIS: tk.constexpr):
    x = tk.load(X, (0, 0), (64, 64), layout=LAYOUT, scope="warpgroup")
    v = tk.load(V, (0,), (64,), scope="warpgroup")
    tk.store(Y, x.mul_row(v, skip_ones=True) if AXIS == "row" else
             x.mul_col(v, skip_ones=True), (0, 0))


@pytest.mark.parametrize("layout", ["row", "vec"])
@pytest.mark.parametrize("axis", ["row", "col"])
def test_mul_skipping_ones_multiplies_wherever_a_factor_is_not_one(layout, axis):
    """mul_row / mul_col(skip_ones=True): warps whose factors are all 1 branch
    over their multiplies; every other warp multiplies (a NaN factor too),
    so the result is x times v everywhere."""
    x = torch.randn(64, 64, device="cuda")
    for v in (torch.ones(64, device="cuda"),
              torch.where(torch.arange(64, device="cuda") == 37, 0.5, 1.0),
              torch.where(torch.arange(64, device="cuda") == 5, float("nan"), 1.0),
              torch.rand(64, device="cuda") + 0.5):
        y = torch.full_like(x, float("nan"))
        skip_ones_scale[(1,)](x, v, y, LAYOUT=layout, AXIS=axis)
        torch.cuda.synchronize()
        ref = x * (v[:, None] if axis == "row" else v[None, :])
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.nan_to_num(), ref.nan_to_num())
