"""Multi-GPU kernels (issue 13): tk_mlir's all_reduce and matmul_reduce_scatter
against NCCL and PyTorch's symmetric-memory kernels, on 2 GPUs over NVLink.

On the 2-GPU machine, from the repository root:
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py [--quick] [--out DIR]
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --sections all_reduce

Sections: peer_link (rank 0's dst.copy_(src), cuda:0 -> cuda:1: GB/s and the
small-copy latency, eager, so launch time included), all_reduce (bf16 (T, 8192),
µs per call from CUDA-graph replays of 20 back-to-back calls: eager launches of
µs-scale ops would time the host), gemm_rs (row-parallel layer: every rank holds
a K-slice, K_local = K / W; CUDA-event timing after warm-up; TFLOP/s counts
2*M*N*K_local per rank; "exposed" = t(tk fused) - t(tk GEMM alone), as a
fraction of t(NCCL reduce_scatter alone)), ag_gemm (all-gather + GEMM: rows of A
sharded, C = A_full @ B.T, vs all_gather_into_tensor + torch.mm and symm_mem's
fused_all_gather_matmul). Every method is checked once against
a float64 reference reduced by NCCL (rel. Frobenius error); one that raises is
recorded with its error. Times are rank 0's; every rank runs every op.
NVLink multicast is never used: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1
and NVSHMEM_DISABLE_NVLS=1 are set before torch loads (unless already set).
"""
from __future__ import annotations

import os

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in NO_MULTICAST.items():  # before torch loads
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._symmetric_memory as symm_mem  # noqa: E402  (registers symm_mem ops)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402

SECTIONS = ["peer_link", "all_reduce", "gemm_rs", "ag_gemm"]
AR_N, AR_T = 8192, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
AR_T_QUICK = [1, 16, 128, 512]
LINK_SIZES = [4096 << (2 * i) for i in range(10)]       # 4 KB, 16 KB, ..., 1 GB
LINK_SIZES_QUICK = [4 << 10, 1 << 20, 256 << 20]
# (label, M, N, K): K is the full depth, each rank holds K / W of it.
# Llama-3-70B's MLP down-projection: hidden 8192, intermediate 28672.
GEMM_SHAPES = [(f"{n}", n, n, n // 2) for n in (4096, 8192, 16384)] + [
    ("llama70b-down", 8192, 8192, 28672)]
GEMM_SHAPES_QUICK = [("8192", 8192, 8192, 4096)]
RANK = 0


def log(*args) -> None:
    if RANK == 0:
        print(*args, flush=True)


def sync(collective: bool = True) -> None:
    """Every rank at the same point with an idle GPU: before each timed section."""
    torch.cuda.synchronize()
    if collective:
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()


def timed(fn, iters: int, warmup: int | None = None, collective: bool = True) -> float:
    """µs per call of fn: warm-up, barrier, then `iters` back-to-back calls
    between two CUDA events on the current stream."""
    for _ in range(max(2, iters // 5) if warmup is None else warmup):
        fn()
    sync(collective)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def graph_timed(fn, calls: int = 20, replays: int = 50) -> float:
    """µs per call of fn from replays of one CUDA graph holding `calls` calls.
    fn must have run once eagerly (symmetric memory, NCCL communicators)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch's docs do
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    sync()
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread may query events while we capture.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    us = timed(graph.replay, replays, warmup=3) / calls
    del graph
    return us


def rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def attempt(row: dict, fn) -> None:
    """Run fn(row); an exception marks the row failed instead of ending the run."""
    try:
        fn(row)
        row.setdefault("status", "ok")
    except Exception as e:
        row["status"] = P.first_line(e)
        print(f"[rank {RANK}] {row['impl']}: FAILED {row['status']}", flush=True)


# ------------------------------------------------------------------ sections
def peer_link(quick: bool) -> list[dict]:
    """dst.copy_(src), src on cuda:0, dst on cuda:1 (torch enables peer access),
    by rank 0 while the others wait at the barrier."""
    rows = []
    if RANK == 0 and torch.cuda.device_count() < 2:
        log("peer_link: skipped, rank 0 sees one GPU")
    elif RANK == 0:
        for n in LINK_SIZES_QUICK if quick else LINK_SIZES:
            row = {"impl": "copy_0to1", "bytes": n}

            def run(row, n=n):
                src = torch.empty(n, dtype=torch.uint8, device="cuda:0").random_(0, 256)
                dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
                iters = max(10, min(1000, (2 << 30) // n))
                row["us"] = timed(lambda: dst.copy_(src), iters, collective=False)
                row["gbs"] = n / row["us"] / 1e3
                if not torch.equal(dst.to("cuda:0"), src):
                    row["status"] = "WRONG: dst differs from src"
            attempt(row, run)
            rows.append(row)
        torch.cuda.empty_cache()
        log("\n## Peer link, cuda:0 -> cuda:1\n")
        log(P.markdown_table(rows, ["bytes", ("us", "µs per copy"), ("gbs", "GB/s"), "status"]))
        if rows and rows[0].get("us"):
            log(f"latency ({rows[0]['bytes']} B copy): {rows[0]['us']:.2f} µs "
                f"(eager copies: launch and cross-stream events included, an upper bound)")
    sync()
    return rows


def all_reduce_latency(quick: bool, gname: str) -> tuple[list[dict], list[dict]]:
    from tk_mlir.kernels import all_reduce

    def tk(alg):
        def make(x):
            buf = x.clone()
            return all_reduce(x.clone(), algorithm=alg), lambda: all_reduce(buf, algorithm=alg)
        return make

    def nccl(x):
        out, buf = x.clone(), x.clone()
        dist.all_reduce(out)
        return out, lambda: dist.all_reduce(buf)

    def symm(two_shot):
        def make(x):  # the input must live in symmetric memory: copied there once
            buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
            symm_mem.rendezvous(buf, gname)
            buf.copy_(x)
            if two_shot:
                def op():
                    return torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", gname)
                op()
                return buf.clone(), op

            def op():
                return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", gname)
            return op(), op
        return make

    methods = {"tk_one_shot": tk("one_shot"), "tk_two_shot": tk("two_shot"),
               "tk_auto": tk("auto"), "nccl": nccl, "symm_one_shot": symm(False),
               "symm_two_shot": symm(True)}
    gen = torch.Generator(device=f"cuda:{torch.cuda.current_device()}").manual_seed(1000 + RANK)
    rows, summary = [], []
    for T in AR_T_QUICK if quick else AR_T:
        # In place, the timed buffers double each call (to inf within a few
        # replays: the same speed); the checks run on fresh copies of x.
        x = P.uniform(gen, T, AR_N)
        ref = x.double()
        dist.all_reduce(ref)
        line = {"T": T, "KB": x.numel() * x.element_size() / 1024}
        for name, make in methods.items():
            row = {"impl": name, "T": T, "bytes": x.numel() * x.element_size()}

            def run(row, make=make):
                out, op = make(x)
                row["rel_err"] = rel_err(out, ref)
                row["us"] = graph_timed(op, 20, 10 if quick else 50)
            attempt(row, run)
            rows.append(row)
            line[name] = row.get("us")
            log(f"  T={T:4} {name:14} {row.get('us', float('nan')):8.2f} µs  "
                f"err {row.get('rel_err', float('nan')):.2e}  {row['status']}")
        auto = line.get("tk_auto")
        for peer in ("nccl", "symm_one_shot"):
            line[f"auto_vs_{peer}"] = line[peer] / auto if auto and line.get(peer) else None
        if line["auto_vs_nccl"] and line["KB"] <= 1024:
            line["goal_nccl"] = "met" if line["auto_vs_nccl"] >= 1.5 else "MISSED"
        if line["auto_vs_symm_one_shot"]:
            line["goal_symm"] = "met" if line["auto_vs_symm_one_shot"] >= 0.9 else "MISSED"
        summary.append(line)
    log("\n## All-reduce, bf16 (T, 8192), µs per call (CUDA graphs)\n")
    log(P.markdown_table(summary, ["T", "KB", *methods, ("auto_vs_nccl", "auto vs NCCL"),
                                   ("auto_vs_symm_one_shot", "auto vs symm 1-shot"),
                                   ("goal_nccl", ">=1.5x NCCL"), ("goal_symm", ">=0.9x symm")]))
    log("goals: auto vs NCCL >= 1.5 up to 1 MB (T <= 64); auto vs symm 1-shot >= 0.9")
    return rows, summary


def gemm_rs(quick: bool, world: int, gname: str) -> tuple[list[dict], list[dict]]:
    gen = torch.Generator(device=f"cuda:{torch.cuda.current_device()}").manual_seed(2000 + RANK)
    rows, summary = [], []
    for shape in GEMM_SHAPES_QUICK if quick else GEMM_SHAPES:
        shape_rows, line = gemm_rs_shape(*shape, world, gname, gen, quick)
        rows += shape_rows
        summary.append(line)
        torch.cuda.empty_cache()
    log("\n## GEMM + reduce-scatter, bf16, per rank\n")
    log(P.markdown_table(rows, ["shape", "impl", "ms", ("tflops", "TFLOP/s"),
                                ("rel_err", "rel err"), "status"]))
    log("\n" + P.markdown_table(summary, [
        "shape", "MxNxK_local", ("tk_vs_torch_mm+nccl_rs", "tk vs mm+RS"),
        ("tk_vs_symm_fused", "tk vs symm fused"), ("exposed_ms", "exposed ms"),
        ("exposed_frac_of_rs", "exposed / RS alone")]))
    log("goal: tk vs each peer >= 1.1 at 8192")
    return rows, summary


def ag_gemm(quick: bool, world: int, gname: str) -> list[dict]:
    """All-gather + GEMM (column-parallel layer on sequence-sharded input):
    every rank holds M / W rows of A and its own B (N x K); C = A_full @ B.T.
    tk all_gather_matmul vs all_gather_into_tensor + torch.mm and vs
    symm_mem's fused_all_gather_matmul, TFLOP/s per rank (2*M*N*K)."""
    from tk_mlir.kernels import all_gather_matmul
    gen = torch.Generator(device=f"cuda:{torch.cuda.current_device()}").manual_seed(3000 + RANK)
    iters, warmup = (10, 5) if quick else (50, 20)
    rows = []
    for label, M, N, K in GEMM_SHAPES_QUICK if quick else GEMM_SHAPES:
        K = min(K, 8192)          # (the layer's input width, not the RS shapes' depth)
        a, b = P.uniform(gen, M // world, K), P.uniform(gen, N, K)
        full = torch.empty(M, K, dtype=a.dtype, device=a.device)
        c = torch.empty(M, N, dtype=a.dtype, device=a.device)
        dist.all_gather_into_tensor(full, a)
        cols = slice(None, None, max(1, N // 1024))
        ref = full.double() @ b[cols].double().t()

        def nccl_mm():
            dist.all_gather_into_tensor(full, a)
            return torch.mm(full, b.t(), out=c)

        def symm():
            return torch.ops.symm_mem.fused_all_gather_matmul(a, [b.t()], 0, gname,
                                                               return_A=False)[1][0]
        methods = {"tk_fused": lambda: all_gather_matmul(a, b), "nccl_ag+torch_mm": nccl_mm,
                   "symm_fused": symm}
        for name, fn in methods.items():
            row = {"impl": name, "shape": label, "M": M, "N": N, "K": K}

            def run(row, fn=fn):
                row["rel_err"] = rel_err(fn()[:, cols], ref)
                row["ms"] = timed(fn, iters, warmup) / 1e3
                row["tflops"] = 2 * M * N * K / row["ms"] / 1e9
            attempt(row, run)
            rows.append(row)
        t = {r["impl"]: r.get("ms") for r in rows if r["shape"] == label}
        for peer in ("nccl_ag+torch_mm", "symm_fused"):
            if t.get("tk_fused") and t.get(peer):
                rows[-3][f"vs_{peer}"] = t[peer] / t["tk_fused"]
        torch.cuda.empty_cache()
    log("\n## All-gather + GEMM, bf16, per rank\n")
    log(P.markdown_table(rows, ["shape", "impl", "ms", ("tflops", "TFLOP/s"),
                                ("vs_nccl_ag+torch_mm", "tk vs AG+mm"),
                                ("vs_symm_fused", "tk vs symm fused"), ("rel_err", "rel err"),
                                "status"]))
    return rows


def gemm_rs_shape(label, M, N, K, world, gname, gen, quick) -> tuple[list[dict], dict]:
    """One shape's rows (every method, checked then timed) and its summary line."""
    from tk_mlir.kernels import matmul
    from tk_mlir.kernels.gemm_rs import matmul_reduce_scatter
    iters, warmup = (10, 5) if quick else (50, 20)
    Kl = K // world
    a, b = P.uniform(gen, M, Kl), P.uniform(gen, N, Kl)   # b: N x K_local (a Linear weight)
    c = torch.mm(a, b.t())
    out = torch.empty(M // world, N, dtype=a.dtype, device=a.device)
    cols = slice(None, None, max(1, N // 1024))   # ~1024 columns spread over every tile
    local = a.double() @ b[cols].double().t()
    ref = local.new_empty(M // world, local.shape[1])
    dist.reduce_scatter_tensor(ref, local)

    def torch_rs():
        torch.mm(a, b.t(), out=c)
        dist.reduce_scatter_tensor(out, c)
        return out

    methods = {
        "tk_fused": lambda: matmul_reduce_scatter(a, b),
        "torch_mm+nccl_rs": torch_rs,
        "symm_fused": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
            a, b.t(), "sum", 0, gname),
        "tk_gemm_alone": lambda: matmul(a, b, c),
        "nccl_rs_alone": lambda: dist.reduce_scatter_tensor(out, c) or out,
    }
    rows, t = [], {}
    for name, fn in methods.items():
        row = {"impl": name, "shape": label, "M": M, "N": N, "K": K, "K_local": Kl}

        def run(row, fn=fn, name=name):
            if name == "nccl_rs_alone":
                torch.mm(a, b.t(), out=c)   # tk_gemm_alone overwrote c
            res = fn()
            row["rel_err"] = rel_err(res[:, cols], local if res.shape[0] == M else ref)
            row["ms"] = t[name] = timed(fn, iters, warmup) / 1e3
            if name != "nccl_rs_alone":
                row["tflops"] = 2 * M * N * Kl / row["ms"] / 1e9
        attempt(row, run)
        rows.append(row)
        log(f"  {label} {name:17} {row.get('ms', float('nan')):8.3f} ms "
            f"{row.get('tflops', float('nan')):6.1f} TFLOP/s  "
            f"err {row.get('rel_err', float('nan')):.2e}  {row['status']}")
    line = {"shape": label, "MxNxK_local": f"{M}x{N}x{Kl}"}
    tk = t.get("tk_fused")
    for peer in ("torch_mm+nccl_rs", "symm_fused"):
        line[f"tk_vs_{peer}"] = t[peer] / tk if tk and t.get(peer) else None
    if tk and "tk_gemm_alone" in t and "nccl_rs_alone" in t:
        line["exposed_ms"] = tk - t["tk_gemm_alone"]
        line["exposed_frac_of_rs"] = line["exposed_ms"] / t["nccl_rs_alone"]
    return rows, line


# ------------------------------------------------------------------ output
def plot(data: dict, png: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        log(f"no plot ({e})")
        return
    s = data["sections"]
    panels = [k for k in ("all_reduce", "gemm_rs", "peer_link") if s.get(k)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = [r for r in s[key] if r.get("status") == "ok"]
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        if key == "gemm_rs":
            shapes = list(dict.fromkeys(r["shape"] for r in s[key]))
            impls = [i for i in impls if i != "nccl_rs_alone"]
            w = 0.8 / max(1, len(impls))
            for j, impl in enumerate(impls):
                by = {r["shape"]: r["tflops"] for r in rows if r["impl"] == impl}
                ax.bar([i - 0.4 + (j + 0.5) * w for i in range(len(shapes))],
                       [by.get(sh, 0) for sh in shapes], w, label=impl)
            ax.set_xticks(range(len(shapes)), shapes)
            ax.set_ylabel("TFLOP/s per rank")
            ax.set_title("GEMM + reduce-scatter")
        else:
            x, y = ("T", "us") if key == "all_reduce" else ("bytes", "gbs")
            for impl in impls:
                pts = [(r[x], r[y]) for r in rows if r["impl"] == impl]
                ax.plot(*zip(*pts), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("T (rows of 8192 bf16)" if key == "all_reduce" else "bytes")
            ax.set_ylabel("µs per call" if key == "all_reduce" else "GB/s")
            ax.set_yscale("log" if key == "all_reduce" else "linear")
            ax.set_title("all-reduce latency" if key == "all_reduce" else "peer copy cuda:0 -> 1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{data['meta']['device']} x{data['meta']['world_size']} — "
                 f"{data['meta']['date'][:10]}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    log(f"wrote {png}")


def write_output(args, world: int, sections: dict) -> None:
    """The JSON (every number and how it was measured), then the PNG."""
    nproc = os.environ.get("LOCAL_WORLD_SIZE", world)
    meta = {**P.run_meta(), "world_size": world, "quick": args.quick, "sections": args.sections,
            "command": f"torchrun --nproc-per-node {nproc} {shlex.join(sys.argv)}",
            "env": {k: os.environ.get(k) for k in NO_MULTICAST},
            "nccl": str(torch.cuda.nccl.version()),
            "timing": "all_reduce: CUDA-graph replays of 20 calls; gemm_rs, peer_link: "
                      "CUDA events after warm-up; rank 0's clock"}
    out = Path(args.out)
    if out.suffix != ".json":
        day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        out = out / (f"multi_gpu-{day}{'-quick' if args.quick else ''}"
                     f"{f'-world{world}' if world != 2 else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "sections": sections}
    out.write_text(json.dumps(data, indent=1, default=str) + "\n")
    log(f"wrote {out}")
    try:
        plot(data, out.with_suffix(".png"))
    except Exception as e:  # the JSON is what matters
        log(f"plot failed ({P.first_line(e)})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer sizes and iterations (smoke test)")
    ap.add_argument("--out", default=str(HERE / "results"),
                    help="directory for multi_gpu-<date>[-quick].json and .png, or a .json path")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma list from {','.join(SECTIONS)} (default: all)")
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not args.sections or set(args.sections) - set(SECTIONS):
        ap.error(f"--sections: choose from {SECTIONS}, got {args.sections}")
    return args


def main(argv=None) -> int:
    global RANK
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("run under torchrun (RANK/WORLD_SIZE unset): "
                         "torchrun --nproc-per-node 2 benchmarks/multi_gpu.py")
    P.require_cuda("benchmarks/multi_gpu.py")
    world, local_rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.device_count() <= local_rank:
        raise SystemExit(f"needs a GPU per rank: WORLD_SIZE={world}, this process "
                         f"(LOCAL_RANK={local_rank}) sees {torch.cuda.device_count()} GPU(s)")
    if world < 2:
        print("WORLD_SIZE=1: no traffic between GPUs; the numbers are the methods' fixed costs "
              "(launch, synchronisation, local copies), not the multi-GPU benchmark", flush=True)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    RANK, gname = dist.get_rank(), dist.group.WORLD.group_name
    sections = {}
    try:
        if "peer_link" in args.sections:
            sections["peer_link"] = peer_link(args.quick)
        if "all_reduce" in args.sections:
            sections["all_reduce"], sections["all_reduce_summary"] = \
                all_reduce_latency(args.quick, gname)
        if "gemm_rs" in args.sections:
            sections["gemm_rs"], sections["gemm_rs_summary"] = gemm_rs(args.quick, world, gname)
        if "ag_gemm" in args.sections:
            sections["ag_gemm"] = ag_gemm(args.quick, world, gname)
        if RANK == 0:
            write_output(args, world, sections)
        sync()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
