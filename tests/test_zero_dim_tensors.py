"""0-d tensor arguments: one value a kernel reads with tk.load(X, ()) (a
per-tensor scale, a count), passed as it is: no 16-byte row rule, any
element-aligned pointer (a 0-d view into a vector). Checked in the
interpreter, in the PTX (one unguarded scalar load), in the launch's
argument rules, and on the GPU."""
import pytest

torch = pytest.importorskip("torch")

import tk_mlir as tk  # noqa: E402
from tk_mlir import f32  # noqa: E402
from tk_mlir.runtime.arguments import TensorInfo, check_tensor  # noqa: E402


@tk.kernel(num_warps=4)
def scale_rows(X: tk.gl[f32], S: tk.gl[f32], N: tk.gl["i32"], Y: tk.gl[f32]):
    """Y = X * S (S one value, or one per row), plus N's value (0-d i32)."""
    i = tk.block_id(0)
    x = tk.load(X, (i, 0), (16, 64))
    if len(S.shape) == 0:
        x = x * tk.load(S, ())
    else:
        x = x.mul_row(tk.load(S, (i,), (16,)))
    tk.store(Y, x + tk.load(N, ()), (i, 0))


def run(launch, device="cpu"):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 64, generator=gen).to(device)
    scales = torch.rand(7, generator=gen).to(device) + 0.5
    n = torch.tensor([3, -2], dtype=torch.int32, device=device)[1]       # a 0-d view, offset 4 bytes
    s = scales[5]                                                        # offset 20 bytes
    y = torch.full_like(x, float("nan"))
    launch[(3,)](x, s, n, y)
    assert torch.allclose(y, x * s - 2, atol=1e-6)
    return x, y


def test_interpreted_with_0d_views_at_element_offsets():
    run(scale_rows.interpret)


def test_a_vector_or_a_0d_tensor_compile_apart():
    one = scale_rows.compile(tk.spec((40, 64), f32), tk.spec((), f32), tk.spec((), "i32"),
                             tk.spec((40, 64), f32))
    rows = scale_rows.compile(tk.spec((40, 64), f32), tk.spec((48,), f32), tk.spec((), "i32"),
                              tk.spec((40, 64), f32))
    ptx = one.asm["ptx"]
    # Two scalar loads (S and N): one element each, no bounds test on them.
    assert ptx.count("ld.global.b32") == 2
    assert "tk.broadcast" in rows.asm["tk"] and one.asm["ptx"] != rows.asm["ptx"]


def test_the_launch_rule_takes_any_element_aligned_0d_tensor():
    info = TensorInfo(0x7F00_0000_0004, (), (), "f32", "cuda:0", 4)
    check_tensor(info, "s", dtype="f32", rank=0)
    odd = TensorInfo(0x7F00_0000_0006, (), (), "f32", "cuda:0", 4)   # (DLPack can say so)
    with pytest.raises(tk.ArgumentError, match="argument 's'.*0-d f32 tensor is not 4-byte"):
        check_tensor(odd, "s", dtype="f32", rank=0)


@pytest.mark.gpu
def test_gpu_reads_0d_views():
    run(scale_rows, "cuda")
