"""gemm.plan's measured table (issue 26): every candidate plan timed at the
shapes of the Llama sweep where the choice matters, the fastest kept.

On the GPU machine, from the repository root:
    python3 benchmarks/gemm_plan_table.py --out-dir "$OUT"              # the table into $OUT
    python3 benchmarks/gemm_plan_table.py --write                       # ... into the package
    python3 benchmarks/gemm_plan_table.py --m 64,256 --layouts nk       # a part of it

For each layout of B ("nk", "kn") and each (M, N, K) of `gemm.py --llama`'s
sweep with M <= --max-m (larger M keeps the autotuned kernel, whose tiles
fill the SMs by far), every plan of `gemm.candidate_plans` runs once against
cuBLAS's product (rel. error <= 1e-2, or it is dropped) and is then timed as
CUDA-graph replays (inputs rotating through groups that hold 3x the L2), as
is cuBLAS (torch.matmul) for the record. The fastest plan of each shape goes
to gemm_plans.json (`gemm.MEASURED_PLANS`), which `gemm.plan` reads: the
device, its SM count, the date and this command head the file, and each row
keeps its time, the rules' plan's time and cuBLAS's; every candidate's time
goes to gemm-plan-candidates.json in --out-dir. The run stops early after
--budget-s seconds and keeps the shapes done.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402
from gemm import LLAMA_M, LLAMA_PROJECTIONS  # noqa: E402

TOL = 1e-2


def shapes(ms: list[int]) -> list[tuple[int, int, int]]:
    return [(m, n, k) for _, n, k in LLAMA_PROJECTIONS for m in ms]


def time_plan(run, groups, flops: float) -> float:
    """µs per call of run(group) as CUDA-graph replays, few launches for
    long products."""
    iters = 20 if flops < 2e11 else 5
    return 1e3 * P.time_kernel(run, groups, warmup=3, iters=iters, repeats=1, pause_s=0.0,
                               graph=True)["ms"]


def measure_shape(M: int, N: int, K: int, layout: str, sms: int) -> dict | None:
    """The row of one shape: its fastest plan (None when none ran right)."""
    from tk_mlir.kernels import gemm
    kn = layout == "kn"

    def make(gen):
        a = P.uniform(gen, M, K)
        b = P.uniform(gen, *((K, N) if kn else (N, K)))
        return a, b, torch.empty(M, N, dtype=torch.bfloat16, device="cuda")

    groups = P.make_input_groups(make, 2 * (M * K + N * K + M * N))
    a, b, c = groups[0]
    ref = (a @ (b if kn else b.T)).float()
    flops = 2.0 * M * N * K
    cublas_us = time_plan(lambda g: torch.matmul(g[0], g[1] if kn else g[1].T, out=g[2]),
                          groups, flops)
    times = []
    for chosen in gemm.candidate_plans(M, N, K, sms):
        run = lambda g, p=chosen: gemm.run_plan(p, *g, layout, "mk", sms)   # noqa: E731
        try:
            c.fill_(float("nan"))
            run(groups[0])
            err = ((c.float() - ref).norm() / ref.norm()).item()
            if not err <= TOL:
                print(f"  {M}x{N}x{K} {layout} {chosen.why}: rel. error {err:.3g}, dropped",
                      flush=True)
                continue
            times.append((time_plan(run, groups, flops), chosen))
        except Exception as e:          # (one candidate's failure drops it, not the run)
            print(f"  {M}x{N}x{K} {layout} {chosen.why}: {P.first_line(e)}", flush=True)
    if not times:
        return None
    rules_us = next((t for t, p in times if p == gemm.rules_plan(M, N, K, sms)), float("nan"))
    us, best = min(times, key=lambda tp: tp[0])
    return {"layout": layout, "M": M, "N": N, "K": K, "kernel": best.kernel,
            "config": dict(best.config), "us": round(us, 2), "rules_us": round(rules_us, 2),
            "cublas_us": round(cublas_us, 2), "candidates": len(times), "plan": best.why,
            "times": [{"kernel": p.kernel, "config": dict(p.config), "us": round(t, 2)}
                      for t, p in times]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default=",".join(str(m) for m in LLAMA_M if m <= 2048),
                    help="the M values (default: the sweep's, up to 2048)")
    ap.add_argument("--layouts", default="nk,kn")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--write", action="store_true", help="write the table into the package "
                    "(tk_mlir/kernels/gemm_plans.json), which gemm.plan reads")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    P.require_cuda("benchmarks/gemm_plan_table.py")
    from tk_mlir.kernels import gemm
    from tk_mlir.kernels.device import num_sms
    sms = num_sms(torch.cuda.current_device())
    start, rows = time.monotonic(), []
    todo = [(layout, s) for layout in args.layouts.split(",")
            for s in shapes([int(m) for m in args.m.split(",")])]
    for i, (layout, (M, N, K)) in enumerate(todo):
        if time.monotonic() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: {len(todo) - i} shapes left out")
            break
        row = measure_shape(M, N, K, layout, sms)
        if row is not None:
            rows.append(row)
            print(f"[{i + 1}/{len(todo)} {time.monotonic() - start:.0f}s] {layout} "
                  f"{M}x{N}x{K}: {row['us']:.1f} us ({row['plan']}); rules {row['rules_us']:.1f}, "
                  f"cuBLAS {row['cublas_us']:.1f}", flush=True)
    table = {"about": "gemm.plan's measured choices: the fastest of gemm.candidate_plans per "
                      "shape and layout of B (benchmarks/gemm_plan_table.py)",
             "device": torch.cuda.get_device_name(), "sms": sms,
             "measured": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "command": "python3 benchmarks/gemm_plan_table.py " + shlex.join(argv or sys.argv[1:]),
             "plans": rows}
    # Every candidate's time goes to the results (to study how a choice
    # generalises); the package's table keeps the chosen plans.
    kept = {**table, "plans": [{k: v for k, v in r.items() if k != "times"} for r in rows]}
    files = [(Path(args.out_dir) / "gemm-plan-candidates.json", table),
             (Path(args.out_dir) / gemm.MEASURED_PLANS, kept)]
    if args.write:
        files.append((Path(gemm.__file__).with_name(gemm.MEASURED_PLANS), kept))
    for path, content in files:
        text = json.dumps(content, indent=1) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)                 # (never a half-written table)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
