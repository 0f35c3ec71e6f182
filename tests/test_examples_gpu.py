"""Every example and library kernel against torch on the GPU: fresh uniform random inputs each
run, outputs poisoned with NaN before the launch, relative-norm error
against a float32/float64 reference. Shapes include rows and widths that
are not multiples of the tile."""
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def uniform(*shape, dtype=torch.bfloat16, lo=-2.0, hi=2.0):
    return (torch.rand(*shape, device="cuda", dtype=torch.float32) * (hi - lo) + lo).to(dtype)


def poisoned_like(x):
    return torch.full_like(x, float("nan"))


@pytest.mark.parametrize("rows,d", [(1, 4096), (333, 4096), (1024, 8192), (77, 1000), (5, 256)])
def test_rmsnorm(rows, d):
    from tk_mlir.kernels import rms_norm
    x, w = uniform(rows, d), uniform(d)
    out = rms_norm(x, w, 1e-6, out=poisoned_like(x))
    xf = x.double()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("rows,d", [(1, 4096), (333, 4096), (1024, 8192), (77, 1000)])
def test_layernorm(rows, d):
    from tk_mlir.kernels import layer_norm
    x, w, b = uniform(rows, d), uniform(d), uniform(d)
    out = layer_norm(x, w, b, 1e-5, out=poisoned_like(x))
    ref = torch.nn.functional.layer_norm(x.double(), (d,), w.double(), b.double(), 1e-5)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("m,n", [(1, 32), (1000, 1000), (4096, 4096), (7, 5000), (123, 128)])
def test_softmax(m, n):
    from softmax import softmax
    x = uniform(m, n, dtype=torch.float32, lo=-8, hi=8)
    out = softmax(x, out=poisoned_like(x))
    assert rel_err(out, torch.softmax(x.double(), -1)) < 1e-5


@pytest.mark.parametrize("m,n", [(32, 256), (1000, 1000), (4096, 4096), (3, 24)])
def test_swiglu(m, n):
    from fused_elementwise import swiglu
    a, b = uniform(m, n), uniform(m, n)
    out = swiglu(a, b, out=poisoned_like(a))
    af = a.double()
    assert rel_err(out, af * torch.sigmoid(af) * b.double()) < 1e-2


@pytest.mark.parametrize("example", ["quickstart", "gemm", "rmsnorm", "layernorm", "attention",
                                     "paged_decode", "linear_attention"])
def test_example_runs(example, capsys):
    import runpy
    from pathlib import Path
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / f"{example}.py"),
                   run_name="__main__")
    assert "no GPU here" not in capsys.readouterr().out
