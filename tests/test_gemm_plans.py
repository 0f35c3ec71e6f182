"""gemm.plan's measured table (gemm_plans.json, benchmarks/gemm_plan_table.py):
its rows are plans the table script may choose, `plan` takes them only for
the shapes, layouts and SM count they were measured at (M within a factor of
two), and every candidate plan computes the product right — in the
interpreter here, on the GPU in the `gpu` test."""
from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

import tk_mlir as tk
from tk_mlir import interpreter
from tk_mlir.kernels import gemm

TABLE = Path(gemm.__file__).with_name(gemm.MEASURED_PLANS)


def key(p: gemm.Plan) -> tuple:
    return p.kernel, tuple(sorted(p.config.items()))


def test_the_table_holds_candidate_plans_of_its_shapes():
    table = json.loads(TABLE.read_text())
    assert {"device", "sms", "measured", "command", "plans"} <= set(table)
    assert table["plans"], "an empty table: regenerate it on the GPU"
    for row in table["plans"]:
        assert row["layout"] in ("nk", "kn")
        candidates = {key(p) for p in gemm.candidate_plans(row["M"], row["N"], row["K"],
                                                           table["sms"])}
        chosen = gemm.Plan(row["kernel"], MappingProxyType(row["config"]))
        assert key(chosen) in candidates, row
        assert row["us"] <= row["rules_us"] or row["rules_us"] != row["rules_us"], row


def test_plan_takes_the_table_only_where_it_was_measured():
    table = json.loads(TABLE.read_text())
    row = next(r for r in table["plans"] if r["us"] < (1 - gemm.MEASURED_MARGIN) * r["rules_us"]
               and r["M"] >= 16)
    M, N, K, sms, layout = row["M"], row["N"], row["K"], table["sms"], row["layout"]
    chosen = gemm.plan(M, N, K, sms, layout=layout)
    assert key(chosen) == (row["kernel"], tuple(sorted(row["config"].items())))
    assert chosen.why.startswith(f"measured on {table['device']}")
    assert f"{M} x {N} x {K}" in chosen.why
    rules = gemm.rules_plan
    assert gemm.plan(M, N, K, sms) == rules(M, N, K, sms)                  # no layout: rules
    assert gemm.plan(M, N + 8, K, sms, layout=layout) == rules(M, N + 8, K, sms)   # other N
    assert gemm.plan(M, N, K, sms + 1, layout=layout) == rules(M, N, K, sms + 1)   # other GPU
    assert gemm.plan(M, N, K, sms, batch=2, layout=layout) == rules(M, N, K, sms, 2)
    largest = max(r["M"] for r in table["plans"] if (r["N"], r["K"]) == (N, K))
    assert gemm.plan(largest + 1, N, K, sms, layout=layout) == rules(largest + 1, N, K, sms)
    close = next(r for r in table["plans"] if r["us"] >= (1 - gemm.MEASURED_MARGIN) *
                 r["rules_us"])                  # (a win within the noise: the rules' plan)
    assert gemm.plan(close["M"], close["N"], close["K"], sms, layout=close["layout"]) == \
        rules(close["M"], close["N"], close["K"], sms)


def test_cluster_split_plans_are_not_taken_with_b_as_k_by_n():
    """gemm.CLUSTER_SPLIT_KN off: the table's cluster_split_k rows with B as
    K x N (wrong sums on one H100) give the rules' plan; B as N x K keeps them."""
    table = json.loads(TABLE.read_text())
    rows = [r for r in table["plans"] if r["kernel"] == "cluster_split_k"
            and r["us"] < (1 - gemm.MEASURED_MARGIN) * r["rules_us"]]
    assert {r["layout"] for r in rows} == {"nk", "kn"}
    for r in rows:
        chosen = gemm.plan(r["M"], r["N"], r["K"], table["sms"], layout=r["layout"])
        assert (chosen.kernel == "cluster_split_k") == (r["layout"] == "nk"), r


def test_measured_plan_takes_the_nearest_m_within_a_factor_of_two(monkeypatch):
    at = {m: gemm.Plan("tiles", MappingProxyType(gemm.tile_config(64, 128)), f"at {m}")
          for m in (16, 64, 1024)}
    index = {("nk", 132, 512, 256): sorted(at.items())}
    monkeypatch.setattr(gemm, "measured_plans", lambda: index)
    def why(m):
        chosen = gemm.measured_plan(m, 512, 256, 132, "nk")
        return chosen and chosen.why
    assert [why(m) for m in (8, 16, 31, 33, 128, 129, 511, 512, 1024, 1025)] == [
        "at 16", "at 16", "at 16", "at 64", "at 64", None, None, "at 1024", "at 1024", None]
    assert gemm.measured_plan(64, 512, 256, 132, "kn") is None


def test_candidate_plans_split_k_keeps_every_slice_busy():
    for M, N, K in [(1, 4096, 4096), (16, 6144, 4096), (256, 4096, 14336), (1, 8192, 28672),
                    (64, 128, 4000), (3000, 5000, 4000)]:
        plans = gemm.candidate_plans(M, N, K, 132)
        assert plans[0] == gemm.rules_plan(M, N, K, 132)
        assert len({key(p) for p in plans}) == len(plans)
        for p in plans:
            if p.kernel == "split_k":
                parts, steps = p.config["SPLIT_K"], tk.cdiv(K, 64)
                assert parts >= 2 and (parts - 1) * tk.cdiv(steps, parts) < steps
                assert tk.cdiv(steps, parts) >= gemm.MIN_CANDIDATE_SLICE_STEPS


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_every_candidate_plan_computes_the_product_in_the_interpreter(interpret, layout):
    M, N, K = 70, 200, 600              # (rows and columns that are not whole tiles)
    sms = interpreter.SMS
    a = torch.empty(M, K).uniform_(-1, 1).to(torch.bfloat16)
    b = torch.empty(*((K, N) if layout == "kn" else (N, K))).uniform_(-1, 1).to(torch.bfloat16)
    ref = a.double() @ (b.double() if layout == "kn" else b.double().T)
    plans = gemm.candidate_plans(M, N, K, sms)
    expected = {"autotuned", "tiles", "split_k", "stream_k"}
    assert {p.kernel for p in plans} == expected | (
        {"cluster_split_k"} if gemm.CLUSTER_SPLIT_CANDIDATES else set())
    for chosen in plans:
        if chosen.kernel == "autotuned":
            continue                    # (the autotuned kernel's configs: tests/test_gemm*.py)
        c = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
        gemm.run_plan(chosen, a, b, c, layout, "mk", sms)
        err = ((c.double() - ref).norm() / ref.norm()).item()
        assert err < 8e-3, (chosen.why, err)


def test_the_benchmarks_schedules_return_the_product(interpret):
    """benchmarks/gemm.py's impls outside gemm.plan (ping-pong, stream-K, the
    cooperative 128 x 128 tiles) return C as its other impls do."""
    import importlib.util
    import sys
    where = Path(__file__).parents[1] / "benchmarks"
    sys.path.insert(0, str(where))                  # (its own imports: protocol, plot)
    try:
        spec = importlib.util.spec_from_file_location("bench_gemm", where / "gemm.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(where))
    M, N, K = 70, 200, 312
    a = torch.empty(M, K).uniform_(-1, 1).to(torch.bfloat16)
    b = torch.empty(N, K).uniform_(-1, 1).to(torch.bfloat16)
    ref = a.double() @ b.double().T
    for name, fn, why in bench.make_impls(bench.EXTRA_IMPLS):
        assert fn is not None, (name, why)
        c = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
        got = fn(a, b, c, "nk")
        assert got is c, name
        assert ((c.double() - ref).norm() / ref.norm()).item() < 8e-3, name


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_every_candidate_plan_computes_the_product_on_the_gpu(layout):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from tk_mlir.kernels.device import num_sms
    sms = num_sms(torch.cuda.current_device())
    for M, N, K in [(37, 6144, 4096), (200, 1000, 3000)]:
        a = torch.empty(M, K, device="cuda").uniform_(-1, 1).bfloat16()
        b = torch.empty(*((K, N) if layout == "kn" else (N, K)),
                        device="cuda").uniform_(-1, 1).bfloat16()
        ref = a.double() @ (b.double() if layout == "kn" else b.double().T)
        for chosen in gemm.candidate_plans(M, N, K, sms):
            c = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            gemm.run_plan(chosen, a, b, c, layout, "mk", sms)
            err = ((c.double() - ref).norm() / ref.norm()).item()
            assert err < 8e-3, (M, N, K, chosen.why, err)


@pytest.mark.parametrize("args, error, match", [
    ((-1, 64, 64, 132), ValueError, "M must be at least 0"),
    ((64, 64, 64, 0), ValueError, "sms must be at least 1"),
    ((64.0, 64, 64, 132), TypeError, "M must be an int"),
    ((64, 64, 64, 132, -2), ValueError, "batch must be at least 0"),
    ((64, True, 64, 132), TypeError, "N must be an int"),
])
def test_plan_refuses_bad_sizes(args, error, match):
    with pytest.raises(error, match=match):
        gemm.plan(*args)


def test_plan_refuses_an_unknown_layout_and_run_plan_too():
    with pytest.raises(ValueError, match="layout must be None, 'nk' or 'kn'"):
        gemm.plan(64, 6144, 4096, 132, layout="NK")
    a = b = c = torch.zeros(8, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="b_layout must be 'nk' or 'kn'"):
        gemm.run_plan(gemm.rules_plan(8, 8, 8, 3), a, b, c, "KN", "mk", 3)


def test_empty_products_have_one_candidate_and_no_measured_plan():
    assert [p.kernel for p in gemm.candidate_plans(64, 64, 0, 132)] == ["none"]
    assert gemm.measured_plan(0, 6144, 4096, 132, "nk") is None


@pytest.mark.parametrize("kn", [False, True])
@pytest.mark.parametrize("split", [1, 4])
def test_the_64x64_candidates_assemble_without_spills(ptxas, split, kn):
    """The narrow tiles offered for few rows (a 12-stage ring, 206 KB of
    shared memory), plain and split: no spill, no C75xx advisory."""
    a, c = tk.spec((128, 4096), "bf16"), tk.spec((128, 4096), "bf16")
    b = tk.spec((4096, 4096), "bf16")
    if split == 1:
        compiled = gemm.gemm_kernel.kernel.compile(a, b, c, B_KN=kn, **gemm.tile_config(64, 64))
    else:
        compiled = gemm.gemm_split_k_kernel.compile(
            a, b, c, tk.spec((128, 4096), "f32"), tk.spec((8192,), "i32"), B_KN=kn,
            **gemm.split_tile_config(64, 64), SPLIT_K=split)
    assert compiled.info["spill stores (bytes)"] == compiled.info["spill loads (bytes)"] == 0
    assert "C75" not in compiled.ptxas_log, compiled.ptxas_log
    assert compiled.info["dynamic shared memory (bytes)"] <= 232448
