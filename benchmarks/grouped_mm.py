"""Ragged grouped GEMM for MoE: tk_mlir `grouped_mm(a, b, offs)` against
`torch._grouped_mm(a, b, offs)` (cuBLAS / CUTLASS grouped kernels in torch)
at the expert shapes of Mixtral 8x7B, DeepSeek-V3 and Qwen3-30B-A3B.

On the GPU machine, from the repository root:
    python3 benchmarks/grouped_mm.py --out-dir "$OUT"
    python3 benchmarks/grouped_mm.py --backward      # da and db given dc (2x the FLOPs)

a (T, K) bf16: T routed token rows sorted by expert; b (G, K, N) given as the
transpose of contiguous (G, N, K) expert weights (as a Linear keeps them);
offs the cumulative row counts of a router's choice (tokens draw experts
uniformly at random, so groups differ in size). Timed in CUDA graphs (GPU time,
the protocol's input groups and warm-up); TFLOP/s counts 2·T·K·N. Each output
is checked first against float32 torch (a per-expert loop). --backward
times the gradients (da, db) of the same products given a random dc:
tk_mlir's ragged_grads against autograd through torch._grouped_mm (its
forward run once outside the timing), eagerly (torch's backward fails under
CUDA-graph capture); TFLOP/s counts 4·T·K·N.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402

from tk_mlir.benchmarking import bench  # noqa: E402

TOL = 1e-2

# (name, G experts, T rows, K, N): up (gate and up fused) and down projections.
SHAPES = [
    ("mixtral-8x7b up", 8, 8192, 4096, 28672),
    ("mixtral-8x7b down", 8, 8192, 14336, 4096),
    ("deepseek-v3 up", 256, 32768, 7168, 4096),
    ("deepseek-v3 down", 256, 32768, 2048, 7168),
    ("qwen3-30b-a3b up", 128, 32768, 2048, 1536),
    ("qwen3-30b-a3b down", 128, 32768, 768, 2048),
    ("deepseek-v3 up, 8-way EP", 32, 4096, 7168, 4096),
    ("deepseek-v3 decode up", 256, 64, 7168, 4096),     # 8 tokens x top-8
    ("mixtral-8x7b decode up", 8, 16, 4096, 28672),      # 8 tokens x top-2
]


def offs_of(G: int, T: int, gen) -> torch.Tensor:
    """Cumulative row counts (int32, on the GPU) of T rows each routed to an
    expert drawn uniformly."""
    experts = torch.randint(0, G, (T,), device="cuda", generator=gen)
    return torch.bincount(experts, minlength=G).cumsum(0).to(torch.int32)


def impls():
    from tk_mlir.kernels import grouped_mm
    out = {"tk_mlir": grouped_mm}
    if hasattr(torch, "_grouped_mm"):
        out["torch._grouped_mm"] = torch._grouped_mm
    else:
        print("torch._grouped_mm is not in this torch: its rows are left out", flush=True)
    return out


def check(fn, a, b, offs) -> float:
    """Rel. error against float32, over the rows of every group."""
    got = fn(a, b, offs).float()
    ends = offs.tolist()
    ref = torch.zeros_like(got)
    start = 0
    for g, end in enumerate(ends):
        ref[start:end] = a[start:end].float() @ b[g].float()
        start = end
    return ((got[:ends[-1]] - ref[:ends[-1]]).norm() / ref[:ends[-1]].norm()).item()


def grad_impls():
    """(da, db) given (a, b, offs, dc, out), out = torch._grouped_mm(a, b, offs)
    recorded by autograd (torch's backward reads its graph)."""
    from tk_mlir.kernels import grouped_gemm
    out = {"tk_mlir": lambda a, b, offs, dc, out: grouped_gemm.ragged_grads(dc, a, b, offs)}
    if hasattr(torch, "_grouped_mm"):
        out["torch._grouped_mm"] = lambda a, b, offs, dc, out: torch.autograd.grad(
            out, (a, b), dc, retain_graph=True)
    return out


def check_grads(fn, a, b, offs, dc, out) -> float:
    """The larger rel. error of da and db against float32 (a per-expert loop)."""
    da, db = fn(a, b, offs, dc, out)
    ref_a = torch.zeros_like(a, dtype=torch.float32)
    ref_b = torch.zeros_like(b, dtype=torch.float32)
    start = 0
    for g, end in enumerate(offs.tolist()):
        ref_a[start:end] = dc[start:end].float() @ b[g].float().T
        ref_b[g] = a[start:end].float().T @ dc[start:end].float()
        start = end
    return max(((got.float() - ref).norm() / ref.norm()).item()
               for got, ref in ((da, ref_a), (db, ref_b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--only", default="", help="comma-separated substrings of shape names")
    ap.add_argument("--backward", action="store_true", help="time da and db given dc")
    args = ap.parse_args(argv)
    P.require_cuda("benchmarks/grouped_mm.py")
    rows = []
    wanted = [s for s in args.only.split(",") if s]
    for name, G, T, K, N in SHAPES:
        if wanted and not any(w in name for w in wanted):
            continue

        def inputs(gen, G=G, T=T, K=K, N=N):
            a = (torch.rand(T, K, device="cuda", generator=gen) * 2 - 1).bfloat16()
            w = (torch.rand(G, N, K, device="cuda", generator=gen) * 2 - 1).bfloat16()
            if not args.backward:
                return a, w.transpose(1, 2), offs_of(G, T, gen)
            a, b, offs = a.requires_grad_(), w.transpose(1, 2).requires_grad_(), offs_of(G, T, gen)
            dc = (torch.rand(T, N, device="cuda", generator=gen) * 2 - 1).bfloat16()
            return a, b, offs, dc, torch._grouped_mm(a, b, offs)
        args_ = inputs(torch.Generator(device="cuda").manual_seed(0))
        for impl, fn in (grad_impls() if args.backward else impls()).items():
            row = {"shape": name, "G": G, "T": T, "K": K, "N": N, "impl": impl}
            try:
                row["rel_err"] = (check_grads if args.backward else check)(fn, *args_)
                # (torch's backward of _grouped_mm fails under CUDA-graph capture:
                # the gradients are timed eagerly, milliseconds against microseconds
                # of launches at these shapes)
                t = bench(fn, inputs=inputs, flops=(4 if args.backward else 2) * T * K * N,
                          graph=not args.backward)
                row.update(us=t.ms * 1e3, tflops=t.tflops,
                           status="ok" if row["rel_err"] < TOL else "WRONG")
            except Exception as e:                                  # noqa: BLE001
                row["status"] = f"failed: {P.first_line(e)}"
            rows.append(row)
            print(row, flush=True)
    for r in rows:                      # > 1: faster than torch._grouped_mm
        peer = next((p.get("us") for p in rows
                     if p["shape"] == r["shape"] and p["impl"] == "torch._grouped_mm"), None)
        if peer and r.get("us"):
            r["vs_torch"] = peer / r["us"]
    cols = ["shape", "G", "T", "K", "N", "impl", ("us", "µs"), ("tflops", "TFLOP/s"),
            ("vs_torch", "speed vs torch"), ("rel_err", "rel err"), "status"]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    P.write_results("grouped-mm-backward" if args.backward else "grouped-mm", rows, vars(args),
                    args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
