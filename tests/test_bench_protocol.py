"""CPU checks of benchmarks/protocol.py and plot.py. Timing needs CUDA and is
not tested here (and benchmarks make no timing assertions anywhere)."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


P = _load("protocol")
ROWS = [
    {"op": "rmsnorm", "shape": "1024x4096", "impl": "copy", "gbs": 4263.4, "ms": 0.00394},
    {"op": "rmsnorm", "shape": "1024x4096", "impl": "torch", "gbs": 3453.0, "ms": 0.00486},
    {"op": "rmsnorm", "shape": "1024x4096", "impl": "tk_mlir", "gbs": None,
     "status": "missing (a|b)"},
    {"op": "rmsnorm", "shape": "2048x8192", "impl": "torch", "gbs": 2664.2, "ms": 0.0252},
]


def test_markdown_table():
    got = P.markdown_table(ROWS[1:3], ["impl", ("gbs", "GB/s"), "ms", "status"])
    assert got == ("| impl | GB/s | ms | status |\n"
                   "|---|---|---|---|\n"
                   "| torch | 3453 | 0.00486 | — |\n"
                   "| tk_mlir | — | — | missing (a\\|b) |")


def test_bandwidth_and_flops_math():
    assert P.bandwidth_gbs(1e9, 1.0) == pytest.approx(1000.0)  # 1 GB in 1 ms
    assert P.bandwidth_gbs(2 * 2**29, 0.25) == pytest.approx(4294.967296)
    assert P.tflops(2 * 4096**3, 1.0) == pytest.approx(137.438953472)


def test_input_groups_cover_3x_l2_and_repeat_bit_for_bit():
    def one(g):
        return (P.uniform(g, 64, 64, dtype=torch.float32),)

    groups = P.make_input_groups(one, 64 * 64 * 4, l2_bytes=40000, device="cpu")
    assert len(groups) == math.ceil(3 * 40000 / (64 * 64 * 4))
    again = P.make_input_groups(one, 64 * 64 * 4, l2_bytes=40000, device="cpu")
    assert all(torch.equal(a[0], b[0]) for a, b in zip(groups, again))
    assert not torch.equal(groups[0][0], groups[1][0])
    assert (groups[0][0] != 0).float().mean() > 0.99
    assert len(P.make_input_groups(one, 10**12, l2_bytes=40000, device="cpu")) == 2


def test_write_results_is_atomic_and_records_meta(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on a machine without it
    path = P.write_results("demo", ROWS, {"metric": "gbs"}, tmp_path)
    data = json.loads(path.read_text())
    assert data["rows"] == ROWS
    assert {"device", "date", "torch", "triton", "command", "metric"} <= data["meta"].keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.json"]  # no tmp, no png
    assert "python benchmarks/plot.py" in capsys.readouterr().out


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.json"
    path.write_text(json.dumps({"meta": {"device": "H200", "date": "2026-11-30", "metric": "gbs"},
                                "rows": ROWS}))
    png = Path(_load("plot").plot(path))
    assert png == tmp_path / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.json", "demo.png"]


def test_norm_peers_match_f32_reference_on_cpu():
    norms = _load("norms")
    g = torch.Generator().manual_seed(0)
    x, w, b = P.uniform(g, 64, 512), P.uniform(g, 512), P.uniform(g, 512)
    for eager, ref in [(norms.rms_eager, norms.rms_ref), (norms.ln_eager, norms.ln_ref)]:
        assert norms.rel_err(eager(x, w, b), ref(x, w, b)) < norms.TOL


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("script, argv", [("norms", ["--quick"]),
                                          ("decode_attention", ["--quick"]),
                                          ("llama_generate", []),
                                          ("sliding_window", ["--n", "8192"]),
                                          ("varlen_attention", []),
                                          ("linear_attention", ["--kernel-time"])])
def test_scripts_without_cuda_say_so(script, argv):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        _load(script).main(argv)


def test_sliding_window_counts_the_pairs_the_window_lets_through():
    sw = _load("sliding_window")
    assert sw.pairs(5, 5) == 15 and sw.pairs(6, 2) == 1 + 2 + 3 + 3 + 3 + 3


def test_varlen_benchmark_counts_the_pairs_each_mask_lets_through():
    vl = _load("varlen_attention")
    assert vl.pairs(4, 6, False) == 24
    assert vl.pairs(4, 4, True) == 10 and vl.pairs(3, 5, True) == 3 + 4 + 5
    assert vl.pairs(5, 2, True) == 1 + 2       # queries before the diagonal see nothing


def test_gemm_benchmark_options():
    """--small picks the small and skinny shapes and graph timing; --batch
    names its results apart and refuses what it cannot run."""
    gemm = _load("gemm")
    small = gemm.parse_args(["--small"])
    assert small.graph and (16, 4096, 4096) in small.shapes and (1024, 1024, 1024) in small.shapes
    assert gemm.result_name("nk", False, True) == "gemm-small"
    assert gemm.result_name("nk", False, False, 8) == "gemm-batch8"
    assert gemm.parse_args(["--batch", "8"]).batch == 8
    for bad in (["--batch", "0"], ["--batch", "2", "--dtype", "fp8"]):
        with pytest.raises(SystemExit):
            gemm.parse_args(bad)


def test_gemm_benchmark_reference_and_check_for_batches():
    gemm = _load("gemm")
    a, b = torch.randn(3, 40, 16), torch.randn(3, 24, 16)
    rows = gemm.check_rows(40)
    ref = gemm.reference(a, b, "nk", rows)
    out = (a @ b.transpose(1, 2)).to(torch.bfloat16)
    assert ref.shape == (3, 40, 24) and gemm.rel_err(out, ref, rows, 40, 24) < 5e-3
    out[1, 3, 4] = float("nan")
    assert math.isnan(gemm.rel_err(out, ref, rows, 40, 24))


def test_gemm_benchmark_grouped_options():
    gemm = _load("gemm")
    args = gemm.parse_args(["--grouped", "--batch", "8", "--sizes", "2048x4096x1024"])
    assert args.grouped and args.batch == 8
    assert gemm.result_name("nk", False, False, 8, True) == "gemm-grouped8"
    for bad in (["--grouped"], ["--grouped", "--batch", "4", "--layout", "kn"]):
        with pytest.raises(SystemExit):
            gemm.parse_args(bad)


def test_gemm_benchmark_shape_whose_inputs_fail_marks_its_rows():
    gemm = _load("gemm")
    rows = [{"M": 8, "impl": "tk_mlir"}, {"M": 8, "impl": "cublas"}]

    def one(g):
        raise MemoryError("CUDA out of memory")
    assert gemm.prepare(rows, one, 1 << 20, None) is None
    assert [r["status"] for r in rows] == ["failed: inputs (MemoryError: CUDA out of memory)"] * 2
