"""bf16 GEMM, f32 accumulate, bf16 out: tk_mlir vs cuBLAS (torch.mm) vs Triton;
and (--dtype fp8) e4m3 GEMM with per-tensor scales: tk_mlir's scaled_matmul vs
cuBLASLt (torch._scaled_mm, with and without fast accumulation).

On the GPU machine, from the repository root:
    python3 benchmarks/gemm.py --out-dir "$OUT"                  # full run, B stored N x K
    python3 benchmarks/gemm.py --layout both --out-dir "$OUT"    # also B stored K x N
    python3 benchmarks/gemm.py --quick                           # smoke test: 1024, 4096
    python3 benchmarks/gemm.py --sizes 4096,8192x8192x2048 --impls tk_mlir,cublas
    python3 benchmarks/gemm.py --dtype fp8 --out-dir "$OUT"     # fp8 rows (B stored N x K)
    python3 benchmarks/gemm.py --small --out-dir "$OUT"          # small and skinny, CUDA graphs
    python3 benchmarks/gemm.py --llama --layout both --out-dir "$OUT"   # issue 26's sweep

--llama: Llama-3 8B's and 70B's projections (QKV and gate/up fused, O, down)
at M from 1 to 16384, tk_mlir vs cuBLAS as CUDA-graph replays with short
timing (20 warm-up and 20 timed launches); gemm-llama[-kn].json and a heat
map of the ratio, gemm-llama[-kn]-heat.png.

--small: 1024^3, 2048^3 and M in {16, 64, 128, 512} against N = K in {4096,
8192} (the shapes of issue 11), timed as CUDA-graph replays (--graph): these
kernels run for less time than a launch takes on the host, so eager
back-to-back launches would time the host (tk_mlir's and torch's alike).
Results go to gemm-small.json.

Layouts: "nk" computes C = A @ B.T with B stored N x K (the Linear-weight layout),
"kn" computes C = A @ B with B stored K x N. FLOPs per call = 2*M*N*K.
Every implementation is checked against a float32 reference before it is timed.
One result file per layout: gemm[-quick].json for nk, gemm-kn[-quick].json for kn
(benchmarks/plot.py groups bars by op and shape, so two layouts in one file
would land on the same bar); gemm-fp8[-quick].json for fp8.

fp8: A (M x K) and B (N x K, passed as its transpose: column-major K x N, the
layout torch._scaled_mm wants and the only one wgmma reads 8-bit operands in)
are uniform in [-1, 1] quantized to e4m3, the scales per-tensor f32, the
output bf16. The peer is torch._scaled_mm with use_fast_accum=True
("cublaslt": fp8 accumulation in the tensor cores, as tk_mlir's kernel does);
"cublaslt_exact" (use_fast_accum=False, its default) promotes partial sums to
f32 on the side, which costs time. Every call allocates its output (neither
API writes into a given tensor the same way), so no output is poisoned; the
GPU tests do that.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402

try:  # Triton is a peer, not a dependency: without it its rows say "missing"
    import triton
    import triton.language as tl
    TRITON_WHY = None
except Exception as e:  # not installed (CPU builds of torch) or broken
    triton = tl = None
    TRITON_WHY = f"{type(e).__name__}: {e}"

SQUARE = [1024, 2048, 4096, 8192, 16384]
LLM = [(8192, 8192, 2048), (16384, 4096, 14336), (8192, 28672, 4096)]
SHAPES = [(s, s, s) for s in SQUARE] + LLM
QUICK_SHAPES = [(1024, 1024, 1024), (4096, 4096, 4096)]
SMALL_SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048)] + [
    (m, nk, nk) for nk in (4096, 8192) for m in (16, 64, 128, 512)]
# Issue 26's sweep: (name, N, K) of Llama-3 8B's and 70B's projections (QKV
# fused, gate and up fused) against every M an LLM runs them at.
LLAMA_PROJECTIONS = (("8B qkv", 6144, 4096), ("8B o", 4096, 4096), ("8B gate_up", 28672, 4096),
                     ("8B down", 4096, 14336), ("70B qkv", 10240, 8192), ("70B o", 8192, 8192),
                     ("70B gate_up", 57344, 8192), ("70B down", 8192, 28672))
LLAMA_M = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LLAMA_SHAPES = [(m, n, k) for _, n, k in LLAMA_PROJECTIONS for m in LLAMA_M]
IMPLS = ["tk_mlir", "cublas", "triton"]
# Also on request (--impls): the GEMM's ping-pong and stream-K schedules outside gemm.plan,
# and the cooperative kernel on the ping-pong's 128 x 128 tiles (the schedules' baseline).
EXTRA_IMPLS = ["tk_pingpong", "tk_pingpong_64x256", "tk_stream_k", "tk_stream_k_64x128",
               "tk_tiles_128x128", "tk_cluster_split_2", "tk_cluster_split_4",
               "tk_cluster_split_8"]
FP8_IMPLS = ["tk_mlir", "cublaslt", "cublaslt_exact"]
LAYOUTS = ["nk", "kn"]
TOL = 1e-2  # rel. Frobenius error above this marks a row WRONG (bf16 output)
FULL_CHECK_ROWS = 4096  # up to this M the reference covers every row of C
CHECK_ROWS = 2048       # beyond it, about this many rows (see check_rows)


def fp8_tol(K: int) -> float:
    """fp8: bf16 rounding of C and the tensor cores' fp8 accumulation, which
    keeps ~14 bits and so grows with K (~1.2e-2 at K = 4096)."""
    return 2e-3 + 2.5e-6 * K


# ---------------------------------------------------------------- Triton peer
# The tutorial kernel: one output tile per program, grouped-M launch order so
# GROUP_M row-tiles share B tiles in L2. Both layouts are the same kernel
# with B's strides swapped; stride_bk is in the autotune key so each layout
# gets its own choice of config.
TRITON_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (128, 256, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (256, 128, 64, 8, 3),
]

if triton is not None:
    @triton.autotune(
        configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                               num_warps=w, num_stages=s)
                 for bm, bn, bk, w, s in TRITON_CONFIGS],
        key=["M", "N", "K", "stride_bk"])
    @triton.jit
    def _triton_mm(a_ptr, b_ptr, c_ptr, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_M * num_pid_n
        first_pid_m = (pid // num_pid_in_group) * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        # Wrap out-of-range rows/cols (their results are masked at the store).
        offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
            acc += tl.dot(a, b)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn
        mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def triton_matmul(a, b, c, b_layout: str):
    M, K = a.shape
    N = b.shape[0] if b_layout == "nk" else b.shape[1]
    # B[k, n]: for nk that is b[n, k], so k walks b's columns.
    sbk, sbn = (b.stride(1), b.stride(0)) if b_layout == "nk" else (b.stride(0), b.stride(1))

    def grid(meta):  # one program per output tile of the config autotune picked
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _triton_mm[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), sbk, sbn,
                     c.stride(0), c.stride(1))
    return c


# ---------------------------------------------------------------- peers
def cublas_matmul(a, b, c, b_layout: str):
    # b.t() is a view: cuBLAS reads a row-major N x K b as a transposed
    # operand, no copy. out= keeps allocation out of the timed loop. A batch
    # (3-D) goes through torch.matmul: cuBLAS's strided-batched GEMM.
    bt = b.transpose(-1, -2) if b_layout == "nk" else b
    return torch.mm(a, bt, out=c) if a.dim() == 2 else torch.matmul(a, bt, out=c)


def load_tk():
    """The library's matmul; returns (fn, None) or (None, why not)."""
    try:
        from tk_mlir.kernels import matmul
        return matmul, None
    except Exception as e:  # import error: report, go on
        return None, f"{type(e).__name__}: {e}"


def load_tk_fp8():
    """The library's scaled_matmul; returns (fn, None) or (None, why not)."""
    try:
        from tk_mlir.kernels import scaled_matmul
        return scaled_matmul, None
    except Exception as e:  # import error: report, go on
        return None, f"{type(e).__name__}: {e}"


def make_fp8_impls(names: list[str]) -> list[tuple]:
    """[(impl name, fn(a, b, scale_a, scale_b) | None, why missing)], b column-major K x N."""
    tk_mm, tk_why = load_tk_fp8()
    bf16 = torch.bfloat16

    def cublaslt(fast):
        return lambda a, b, sa, sb: torch._scaled_mm(a, b, sa, sb, out_dtype=bf16,
                                                     use_fast_accum=fast)
    table = {
        "tk_mlir": (tk_mm and (lambda a, b, sa, sb: tk_mm(a, b, sa, sb, out_dtype=bf16)), tk_why),
        "cublaslt": (cublaslt(True), None),
        "cublaslt_exact": (cublaslt(False), None),
    }
    return [(n, *table[n]) for n in names]


def tk_schedule(schedule: str, bm: int, bn: int, split: int = 0):
    """One of the GEMM's schedules outside gemm.plan, on bm x bn tiles:
    "pingpong" (gemm.pingpong_config), "tiles" (the cooperative kernel,
    gemm.tile_config), "stream_k" (gemm_split_k_kernel with STREAM_K) or
    "cluster_split_k" (K in the `split` blocks of a cluster,
    gemm.cluster_split_config); fn(a, b, c, b_layout), through gemm.run_plan
    as the measured table's script runs its candidates."""
    from types import MappingProxyType
    from tk_mlir.kernels import gemm as tk_gemm
    from tk_mlir.kernels.device import num_sms
    kernel, config = {"pingpong": ("tiles", tk_gemm.pingpong_config),
                      "tiles": ("tiles", tk_gemm.tile_config),
                      "stream_k": ("stream_k", tk_gemm.stream_k_config),
                      "cluster_split_k": ("cluster_split_k", lambda bm, bn: (
                          tk_gemm.cluster_split_config(bm, bn, split)))}[schedule]
    chosen = tk_gemm.Plan(kernel, MappingProxyType(config(bm, bn)))
    def run(a, b, c, lay):
        tk_gemm.run_plan(chosen, a, b, c, lay, "mk", num_sms(a.get_device()))
        return c                                  # run_plan writes c, returns nothing
    return run


def make_impls(names: list[str]) -> list[tuple]:
    """[(impl name, fn(a, b, c, b_layout) | None, why missing)] in `names` order."""
    tk_mm, tk_why = load_tk()
    tk_fn = tk_mm and (lambda a, b, c, lay: tk_mm(a, b, c, b_layout=lay))
    table = {
        "tk_mlir": (tk_fn, tk_why),
        "tk_pingpong": (tk_mm and tk_schedule("pingpong", 128, 128), tk_why),
        "tk_pingpong_64x256": (tk_mm and tk_schedule("pingpong", 64, 256), tk_why),
        "tk_stream_k": (tk_mm and tk_schedule("stream_k", 128, 128), tk_why),
        "tk_stream_k_64x128": (tk_mm and tk_schedule("stream_k", 64, 128), tk_why),
        "tk_tiles_128x128": (tk_mm and tk_schedule("tiles", 128, 128), tk_why),
        **{f"tk_cluster_split_{s}": (tk_mm and tk_schedule("cluster_split_k", 64, 128, s),
                                     tk_why) for s in (2, 4, 8)},
        "cublas": (cublas_matmul, None),
        "triton": (triton_matmul if triton is not None else None, TRITON_WHY),
    }
    return [(n, *table[n]) for n in names]


# ---------------------------------------------------------------- checking
def check_rows(M: int) -> slice:
    """Rows of C compared with the float32 reference.

    All of them up to FULL_CHECK_ROWS; beyond, ~CHECK_ROWS rows at an odd
    stride, which saves the f32 reference of a 16384^3 product yet puts the
    checked rows in every row-tile of the grid and at every row position
    within a tile (an even stride would only ever see even fragment rows).
    """
    if M <= FULL_CHECK_ROWS:
        return slice(None)
    return slice(None, None, (M // CHECK_ROWS) | 1)


def reference(a, b, b_layout: str, rows: slice) -> torch.Tensor:
    bf = b.float()
    return a[..., rows, :].float() @ (bf.transpose(-1, -2) if b_layout == "nk" else bf)


def rel_err(out: torch.Tensor, ref: torch.Tensor, rows: slice, M: int, N: int) -> float:
    if tuple(out.shape[-2:]) != (M, N):
        raise ValueError(f"output shape {tuple(out.shape)}, expected (..., {M}, {N})")
    # The whole output, not just the checked rows: NaN left from the poison
    # means a tile was never written.
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return ((out[..., rows, :].float() - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------- one shape
def prepare(rows: list[dict], make_one, bytes_per_group: int, reference_of):
    """(input groups, checked rows of C, reference) of one shape, or None with
    every row marked failed when they cannot be made (e.g. out of memory:
    this shape fails, the run goes on). reference_of(first group, rows)."""
    try:
        groups = P.make_input_groups(make_one, bytes_per_group)
        crow = check_rows(rows[0]["M"])
        return groups, crow, reference_of(groups[0], crow)
    except Exception as e:
        for r in rows:
            r["status"] = f"failed: inputs ({P.first_line(e)})"
        torch.cuda.empty_cache()
        return None


def bench_shape(M: int, N: int, K: int, layout: str, impls: list[tuple],
                timing: dict, batch: int = 1) -> list[dict]:
    lead = () if batch == 1 else (batch,)
    shape, flops = "x".join(map(str, (*lead, M, N, K))), 2 * batch * M * N * K
    base = {"op": "gemm", "layout": layout, "shape": shape, "M": M, "N": N, "K": K,
            "batch": batch, "flops": flops}
    rows = [{**base, "impl": name} for name, _, _ in impls]
    if lead:   # the Triton peer is a 2-D kernel
        impls = [(n, None if n == "triton" else fn, "a 2-D kernel" if n == "triton" else why)
                 for n, fn, why in impls]

    def one(g):  # A, B in this layout, and C for out=
        a = P.uniform(g, *lead, M, K)
        b = P.uniform(g, *lead, N, K) if layout == "nk" else P.uniform(g, *lead, K, N)
        return a, b, torch.empty(*lead, M, N, dtype=torch.bfloat16, device=a.device)

    prepared = prepare(rows, one, batch * (2 * (M * K + N * K) + 2 * M * N),
                       lambda g, crow: reference(g[0], g[1], layout, crow))
    if prepared is None:
        return rows
    groups, crow, ref = prepared
    print(f"{layout} {shape}: {len(groups)} groups, reference on {len(range(M)[crow])}/{M} "
          f"rows", flush=True)
    measure(rows, impls, groups, lambda fn, g: fn(g[0], g[1], g[2], layout),
            lambda g: g[2].fill_(float("nan")), ref, crow, TOL, timing)
    P.add_ratios(rows, "cublas", "ratio_vs_cublas")
    del groups, ref
    torch.cuda.empty_cache()  # the next shape's groups need the room
    return rows


def measure(rows: list[dict], impls: list[tuple], groups: list[tuple], call_with,
            poison, ref, crow: slice, tol: float, timing: dict, checked=None) -> None:
    """Check and time each implementation on the groups: call_with(fn, group)
    runs one call and returns its output; poison(group) (or None) fills the
    group's output with NaN before the checked call; checked(output, group)
    (or None) is the part of the output the check compares."""
    M, N, flops = rows[0]["M"], rows[0]["N"], rows[0]["flops"]
    for row, (name, fn, why) in zip(rows, impls):
        if fn is None:
            row["status"] = f"missing: {why}"
            print(f"  {name:8} missing: {why}", flush=True)
            continue
        call = lambda g, fn=fn: call_with(fn, g)  # noqa: E731
        try:
            # One call first: compiling / autotuning launches into C, which
            # would overwrite the poison and hide a kernel that skips tiles.
            call(groups[0])
            if poison is not None:
                poison(groups[0])
            out = call(groups[0])
            out = out if checked is None else checked(out, groups[0])
            row["rel_err"] = err = rel_err(out, ref, crow, M, N)
            row["status"] = "ok" if err <= tol else "WRONG"  # NaN fails too
            t = P.time_kernel(call, groups, **timing)  # WRONG rows are timed too
        except Exception as e:  # one broken implementation must not sink the run
            row["status"] = f"failed: {P.first_line(e)}"
            print(f"  {name:8} {row['status']}", flush=True)
            continue
        P.record_tflops(row, t, flops)


def bench_grouped_shape(M: int, N: int, K: int, G: int, impls: list[tuple],
                        timing: dict) -> list[dict]:
    """G products of up to M rows (an MoE layer's experts at capacity M),
    their sizes drawn (seeded) from [M/2, M]: tk_mlir's grouped_matmul
    computes the tiles that hold rows; the peer, cuBLAS's batched GEMM,
    computes all G x M rows (what a capacity layout falls back to). FLOPs
    count the rows below the sizes only; rows past them are zeroed (NaN
    included) before the check."""
    sizes = torch.randint(M // 2, M + 1, (G,), generator=torch.Generator().manual_seed(0))
    useful = int(sizes.sum())
    shape, flops = f"{G}x{M}x{N}x{K}", 2 * useful * N * K
    base = {"op": "grouped_gemm", "layout": "nk", "shape": shape, "M": M, "N": N, "K": K,
            "batch": G, "rows": useful, "flops": flops}
    rows = [{**base, "impl": name} for name, _, _ in impls]
    sizes = sizes.cuda()
    keep = (torch.arange(M, device="cuda")[None, :] < sizes[:, None])[..., None]

    def one(g):
        return (P.uniform(g, G, M, K), P.uniform(g, G, N, K),
                torch.empty(G, M, N, dtype=torch.bfloat16, device="cuda"))

    prepared = prepare(rows, one, G * (2 * (M * K + N * K) + 2 * M * N),
                       lambda g, crow: reference(g[0], g[1], "nk", crow) * keep[:, crow])
    if prepared is None:
        return rows
    groups, crow, ref = prepared
    fns = {"tk_mlir": lambda g: grouped(g[0], g[1], sizes, g[2]),
           "cublas": lambda g: cublas_matmul(g[0], g[1], g[2], "nk")}
    impls = [(n, fns[n] if fn is not None and n in fns else None,
              why if n in fns else "not a grouped GEMM") for n, fn, why in impls]
    print(f"grouped {shape}: {useful} of {G * M} rows, {len(groups)} groups", flush=True)
    measure(rows, impls, groups, lambda fn, g: fn(g), lambda g: g[2].fill_(float("nan")),
            ref, crow, TOL, timing, checked=lambda out, g: torch.where(keep, out, 0))
    P.add_ratios(rows, "cublas", "ratio_vs_cublas")
    del groups, ref
    torch.cuda.empty_cache()
    return rows


def grouped(a, b, sizes, c):
    from tk_mlir.kernels import grouped_matmul
    return grouped_matmul(a, b, sizes, c)


def bench_fp8_shape(M: int, N: int, K: int, impls: list[tuple], timing: dict) -> list[dict]:
    """The fp8 rows of one shape: e4m3 A (M x K) and B (N x K, passed as its
    column-major transpose), per-tensor scales, bf16 out."""
    shape, flops = f"{M}x{N}x{K}", 2 * M * N * K
    base = {"op": "gemm_fp8", "layout": "nk", "shape": shape, "M": M, "N": N, "K": K,
            "flops": flops}
    rows = [{**base, "impl": name} for name, _, _ in impls]
    e4m3 = torch.float8_e4m3fn

    def one(g):  # A, B as K x N column-major, the two scales
        a, bt = P.uniform(g, M, K).to(e4m3), P.uniform(g, N, K).to(e4m3)
        sa, sb = (P.uniform(g, 1, dtype=torch.float32, low=0.5, high=2.0).reshape(())
                  for _ in range(2))
        return a, bt.t(), sa, sb

    prepared = prepare(rows, one, M * K + N * K + 2 * M * N,
                       lambda g, crow: (g[0][crow].float() @ g[1].float()) * (g[2] * g[3]))
    if prepared is None:
        return rows
    groups, crow, ref = prepared
    print(f"fp8 {shape}: {len(groups)} groups, reference on {len(range(M)[crow])}/{M} rows",
          flush=True)
    measure(rows, impls, groups, lambda fn, g: fn(*g), None, ref, crow, fp8_tol(K), timing)
    P.add_ratios(rows, "cublaslt", "ratio_vs_cublaslt")
    del groups, ref
    torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- driver
def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    """'4096,8192x8192x2048' -> [(4096,)*3, (8192, 8192, 2048)]."""
    out = []
    for item in text.split(","):
        dims = [int(d) for d in item.strip().lower().split("x")]
        if len(dims) == 1:
            dims *= 3
        if len(dims) != 3 or min(dims) <= 0:
            raise ValueError(f"size {item!r}: give N (square) or MxNxK")
        out.append(tuple(dims))
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="1024^3 and 4096^3 only, few launches (smoke test)")
    ap.add_argument("--small", action="store_true",
                    help="issue 11's small and skinny shapes, timed with CUDA graphs")
    ap.add_argument("--llama", action="store_true",
                    help="issue 26's sweep: Llama-3 8B/70B projections x M from 1 to 16384, "
                         "tk_mlir vs cuBLAS in CUDA graphs, short timing; a heat map of the "
                         "ratio beside the results")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays of the launches (GPU time without host "
                         "launch time between them); on with --small")
    ap.add_argument("--grouped", action="store_true",
                    help="with --batch G: G products of up to M rows each (sizes drawn from "
                         "[M/2, M]), tk_mlir's grouped_matmul vs cuBLAS's batched GEMM of all "
                         "rows")
    ap.add_argument("--batch", type=int, default=1,
                    help="G > 1: each shape as G products in one call (3-D tensors; cuBLAS's "
                         "strided-batched GEMM as the peer)")
    ap.add_argument("--sizes", help="comma list of N (square) or MxNxK, e.g. 4096,8192x8192x2048")
    ap.add_argument("--layout", choices=["nk", "kn", "both"], default="nk",
                    help="nk: C = A @ B.T, B is N x K (default); kn: C = A @ B, B is K x N")
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16",
                    help="bf16 (default) or fp8: e4m3 with per-tensor scales vs "
                         "torch._scaled_mm (B stored N x K)")
    ap.add_argument("--impls", help=f"comma list from {','.join(IMPLS + EXTRA_IMPLS)} (bf16) "
                                    f"or {','.join(FP8_IMPLS)} (fp8); default: "
                                    f"{','.join(IMPLS)} or all fp8 ones")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    try:
        args.shapes = (parse_sizes(args.sizes) if args.sizes else SMALL_SHAPES if args.small
                       else LLAMA_SHAPES if args.llama else QUICK_SHAPES if args.quick
                       else SHAPES)
    except ValueError as e:
        ap.error(f"--sizes: {e}")
    known = FP8_IMPLS if args.dtype == "fp8" else IMPLS + EXTRA_IMPLS
    args.impl_names = ([s.strip() for s in args.impls.split(",") if s.strip()]
                       if args.impls else FP8_IMPLS if args.dtype == "fp8" else IMPLS)
    unknown = sorted(set(args.impl_names) - set(known))
    if unknown or not args.impl_names:
        ap.error(f"--impls: unknown {unknown}; for --dtype {args.dtype} choose from {known}")
    if args.dtype == "fp8" and args.layout != "nk":
        ap.error("--dtype fp8 takes B stored N x K only (--layout nk): wgmma reads 8-bit "
                 "operands K-major, and torch._scaled_mm wants B column-major")
    args.layouts = LAYOUTS if args.layout == "both" else [args.layout]
    args.graph = args.graph or args.small or args.llama
    if args.llama and not args.impls:
        args.impl_names = ["tk_mlir", "cublas"]
    if args.batch < 1 or (args.batch > 1 and args.dtype == "fp8"):
        ap.error(f"--batch {args.batch}: a batch is G >= 1 products, of bf16 only")
    if args.grouped and (args.batch < 2 or args.layouts != ["nk"] or args.dtype != "bf16"):
        ap.error("--grouped takes --batch G >= 2, bf16 and B stored N x K")
    return args


def result_name(layout: str, quick: bool, small: bool = False, batch: int = 1,
                grouped: bool = False, llama: bool = False) -> str:
    return ("gemm" + ("-small" if small else "") + ("-llama" if llama else "")
            + (f"-{'grouped' if grouped else 'batch'}{batch}" if batch > 1 else "")
            + ("" if layout == "nk" else f"-{layout}") + ("-quick" if quick else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    P.require_cuda("benchmarks/gemm.py")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference must be true f32
    timing = (dict(warmup=20, iters=10, repeats=1, pause_s=0.05) if args.quick
              else dict(warmup=20, iters=20, repeats=1, pause_s=0.05) if args.llama
              else dict(warmup=500, iters=100, repeats=3, pause_s=0.5))
    timing["graph"] = args.graph
    if args.dtype == "fp8":
        return main_fp8(args, timing)

    impls = make_impls(args.impl_names)
    for name, fn, why in impls:
        if fn is None:
            print(f"{name}: missing ({why})")
    rows = []
    for layout in args.layouts:
        for M, N, K in args.shapes:
            rows += (bench_grouped_shape(M, N, K, args.batch, impls, timing) if args.grouped
                     else bench_shape(M, N, K, layout, impls, timing, args.batch))

    if args.llama:
        names = {(n, k): name for name, n, k in LLAMA_PROJECTIONS}
        for r in rows:
            r["projection"] = names[r["N"], r["K"]]
    print_summary(rows, ["layout"], "cublas", "cuBLAS", lambda r: r["layout"])
    for layout in args.layouts:
        meta = {"metric": "tflops", "dtype": "bfloat16", "out_dtype": "bfloat16",
                "accumulate": "float32", "flops": "2*M*N*K", "layouts": [layout],
                "layout_meaning": {"nk": "C = A @ B.T, B is N x K",
                                   "kn": "C = A @ B, B is K x N"}[layout],
                "tol": TOL, "check": f"rel. Frobenius error vs float32 on all rows up to "
                                     f"M={FULL_CHECK_ROWS}, else ~{CHECK_ROWS} rows at an odd "
                                     f"stride; NaN anywhere in C fails",
                "triton_configs": TRITON_CONFIGS, "timing": timing, "quick": args.quick}
        path = P.write_results(result_name(layout, args.quick, args.small, args.batch,
                                           args.grouped, args.llama),
                               [r for r in rows if r["layout"] == layout], meta, args.out_dir)
        if args.llama:
            from plot import heat_map
            print(f"wrote {heat_map(path)}")
    report_not_ok(rows)
    return 0


def main_fp8(args, timing: dict) -> int:
    """The fp8 rows: every shape, tk_mlir vs torch._scaled_mm."""
    impls = make_fp8_impls(args.impl_names)
    for name, fn, why in impls:
        if fn is None:
            print(f"{name}: missing ({why})")
    rows = []
    for M, N, K in args.shapes:
        rows += bench_fp8_shape(M, N, K, impls, timing)
    print_summary(rows, [], "cublaslt", "cuBLASLt", lambda r: "fp8")
    meta = {"metric": "tflops", "dtype": "float8_e4m3fn", "out_dtype": "bfloat16",
            "scales": "per tensor (f32)", "accumulate": "float32 (fp8 tensor-core accumulation)",
            "flops": "2*M*N*K", "layouts": ["nk"],
            "layout_meaning": "C = (A @ B.T) * scale_a * scale_b, B is N x K",
            "peer": "torch._scaled_mm(use_fast_accum=True); cublaslt_exact: =False",
            "tol": "2e-3 + 2.5e-6 * K", "check": f"rel. Frobenius error vs float32 of the dequantized "
                                     f"inputs on all rows up to M={FULL_CHECK_ROWS}, else "
                                     f"~{CHECK_ROWS} rows at an odd stride; NaN anywhere fails",
            "timing": timing, "quick": args.quick}
    P.write_results("gemm-fp8" + ("-quick" if args.quick else ""), rows, meta, args.out_dir)
    report_not_ok(rows)
    return 0


def print_summary(rows: list[dict], first_cols: list[str], peer: str, peer_title: str,
                  label) -> None:
    """The table of rows, then tk_mlir's ratio to the peer per shape (label(row) first)."""
    key = f"ratio_vs_{peer}"
    cols = [*first_cols, "shape", "impl", "ms", ("tflops", "TFLOP/s"),
            (key, f"vs {peer_title}"), ("rel_err", "rel err"), "status"]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    for r in rows:
        if r["impl"] == "tk_mlir":
            ratio = r.get(key)
            print(f"{label(r)} {r['shape']}: tk/{peer} = "
                  + (f"{ratio:.2f}" if ratio else f"— ({r['status']})"))
    print()


def report_not_ok(rows: list[dict]) -> None:
    bad = [f"{r['layout']} {r['shape']} {r['impl']}" for r in rows if r["status"] != "ok"]
    if bad:  # said last so it is not lost in the log; exit 0 so chained runs go on
        print("NOT OK: " + "; ".join(bad))


if __name__ == "__main__":
    sys.exit(main())
