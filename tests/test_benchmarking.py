"""tk.bench and tk.sweep on CPU: the no-GPU error, argument rules, input
groups, and the plot drawn from given numbers. Timing itself needs a GPU
(the `gpu` test below; benchmarks make no timing assertions)."""
import math

import pytest

torch = pytest.importorskip("torch")

import tk_mlir as tk  # noqa: E402
from tk_mlir import benchmarking as B  # noqa: E402

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")


@NO_GPU
def test_bench_without_a_gpu_says_so():
    with pytest.raises(B.NoGpu, match=r"tk.bench needs a CUDA GPU.*nothing was measured"):
        tk.bench(lambda a: a * 2, torch.ones(8), flops=8)


@NO_GPU
def test_sweep_stops_at_no_gpu():
    def run(n, impl):
        return tk.bench(torch.mm, torch.ones(n, n), torch.ones(n, n))
    with pytest.raises(B.NoGpu):
        tk.sweep(run, [64, 128], ["torch"])


def test_bench_argument_rules():
    with pytest.raises(TypeError, match=r"either the arguments of one call .* got neither"):
        tk.bench(lambda: None)
    with pytest.raises(TypeError, match="got both"):
        tk.bench(lambda a: a, torch.ones(2), inputs=lambda g: (torch.ones(2),))
    with pytest.raises(ValueError, match=r"bench\(flops=0\): flops per call must be > 0"):
        tk.bench(lambda a: a, torch.ones(2), flops=0)
    with pytest.raises(ValueError, match=r"no tensor among args"):
        tk.bench(lambda n: n, 4096)


def test_cloned_groups_exceed_three_l2s():
    a, b = torch.ones(64, 64), torch.zeros(64, 64)
    groups = B._clone_groups((a, 3, b), l2_bytes=100_000)
    assert len(groups) == math.ceil(3 * 100_000 / (2 * 64 * 64 * 4))
    assert groups[0][0] is a and groups[1][0] is not a and torch.equal(groups[1][0], a)
    assert all(g[1] == 3 for g in groups)
    assert len({g[2].data_ptr() for g in groups}) == len(groups)
    assert B.group_count(10**12, l2_bytes=1) == 2


ROWS = [{"N": n, "impl": impl, "tflops": v, "ms": 1.0}
        for n, impl, v in [(1024, "tk_mlir", 300.0), (2048, "tk_mlir", 600.0),
                           (1024, "torch", 320.0), (2048, "torch", None)]]


def test_plot_sweep_from_given_numbers(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    fig = B.plot_sweep(ROWS, "N", "tflops", title="gemm")
    ax = fig.axes[0]
    lines = {l.get_label(): l for l in ax.get_lines()}
    assert set(lines) == {"tk_mlir", "torch"}
    assert list(lines["tk_mlir"].get_ydata()) == [300.0, 600.0]
    assert math.isnan(lines["torch"].get_ydata()[1])       # a failed point is a gap
    assert ax.get_ylabel() == "TFLOP/s" and ax.get_title() == "gemm"
    fig.savefig(tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_records_failures_and_prints_a_table():
    timing = B.Timing(0.5, 0.5, 0.5, [0.5], 4, 1, 1, tflops=100.0)

    def run(n, impl):
        if impl == "peer" and n > 1:
            raise RuntimeError("shape not supported\nmore")
        return timing

    result = tk.sweep(run, [1, 2], ["tk_mlir", "peer"], x_name="N")
    assert result.metric == "tflops"
    assert [r.get("status") for r in result.rows] == ["ok", "ok", "ok",
                                                       "RuntimeError: shape not supported"]
    assert str(result).splitlines() == ["TFLOP/s", "N | tk_mlir | peer", "1 | 100 | 100",
                                        "2 | 100 | RuntimeError: shape not supported"]
    with pytest.raises(ValueError, match=r"sweep\(impls=\[\]\)"):
        tk.sweep(run, [1], [])


def test_timing_prints_its_rates():
    t = B.Timing(0.25, 0.24, 0.25, [0.25, 0.24, 0.26], 12, 500, 100, tflops=550.0)
    assert str(t) == ("0.2500 ms, 550.0 TFLOP/s (median 0.2500, min 0.2400 over 3 runs of 100; "
                      "12 input groups)")


@pytest.mark.gpu
def test_bench_times_a_matmul_on_the_gpu():
    n = 2048
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = tk.bench(torch.mm, a, a, flops=2 * n**3, warmup=10, iters=10, pause_s=0)
    assert t.ms > 0 and t.tflops > 0 and t.gbs is None
    assert t.groups * 2 * a.numel() * a.element_size() >= 3 * B.l2_cache_bytes()
    r = tk.bench(torch.mm, inputs=lambda g: (B.uniform(g, n, n), B.uniform(g, n, n)),
                 flops=2 * n**3, warmup=10, iters=10, pause_s=0)
    assert r.tflops > 0


@pytest.mark.gpu
def test_bench_and_sweep_a_tk_kernel_on_the_gpu():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from quickstart import softmax

    def run(rows, impl):
        x = torch.randn(rows, 512, device="cuda")
        y = torch.empty_like(x)
        if impl == "tk_mlir":
            fn = lambda x, y: softmax[(tk.cdiv(rows, 4),)](x, y, ROWS=4, N=512)  # noqa: E731
        else:
            fn = lambda x, y: torch.softmax(x, -1)  # noqa: E731
        return tk.bench(fn, x, y, bytes=2 * x.numel() * 4, warmup=10, iters=10, pause_s=0)

    result = tk.sweep(run, [1024, 8192], ["tk_mlir", "torch"], x_name="rows")
    assert result.metric == "gbs"
    assert all(r["status"] == "ok" and r["gbs"] > 0 for r in result.rows), result.rows
    pytest.importorskip("matplotlib").use("Agg")
    assert len(result.plot().axes[0].get_lines()) == 2


def test_sweep_takes_plain_numbers_as_perf_report_functions_return():
    s = tk.sweep(lambda x, impl: 0.5 * x + (impl == "b"), [1, 2], ["a", "b"], x_name="N")
    assert s.metric == "value"
    assert [r["value"] for r in s.rows] == [0.5, 1.5, 1.0, 2.0]
    bad = tk.sweep(lambda x, impl: "fast", [1], ["a"])
    assert bad.rows[0]["status"] == ("TypeError: run returned str 'fast'; return a tk.bench(...) "
                                     "Timing or a number")
