"""Attention: tk_mlir vs cuDNN, FlashAttention-2 (torch SDPA) and FlashAttention-4.

On the GPU machine, from the repository root:
    python3 benchmarks/attention.py --out-dir "$OUT"            # the full table
    python3 benchmarks/attention.py --quick                     # N=4096, D=128 only
    python3 benchmarks/attention.py --n 4096,16384 --d 128 --causal 0
    python3 benchmarks/attention.py --backward                  # dq, dk, dv (2.5x the FLOPs)
    python3 benchmarks/attention.py --issue-table [--backward]  # the attention issue's shapes
    python3 benchmarks/attention.py --configs "4,16,4096,128,1;16,16,512,128"  # B,H,N,D[,causal]
    python3 benchmarks/attention.py --issue-table --graph       # each call a CUDA-graph replay

The sweep: B·N = 16384 tokens, H·D = 2048 (H = 2048 / D); --configs and
--issue-table give B, H, N, D instead. bf16, (B, H, N, D) inputs; FLOPs per
call = 4·B·H·N²·D, half of it for causal. Every implementation is checked
against a float32 reference (explicit softmax, on a slice of heads) before it
is timed, with its output poisoned first.

fa4 is flash_attn.cute.interface.flash_attn_func (the flash-attn-4 wheel; on
the H200 machine PYTHONPATH=/tmp/site:/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages,
../shared/gpu/README.md). It takes (B, N, H, D): it gets contiguous copies of
the same inputs in that layout, made once per input group outside the
timing. Without the wheel its rows say failed and the run goes on.

--graph times CUDA-graph replays (time_kernel(graph=True): the timed launches,
cycling the input groups, captured once after the warm-up): GPU time without
the host's launch time between calls, which short sequences need. An
implementation that does not capture gets a failed row.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
NS, DS = [1024, 2048, 4096, 8192, 16384], [64, 128]
IMPLS = ["tk_mlir", "cudnn", "fa2", "fa4"]
TOL = 1e-2               # rel. Frobenius error vs float32 above this marks a row WRONG
CHECK_HEADS = 2          # heads of batch 0 the reference covers
# The attention issue's shapes (B, H, N, D, causal). D=256 is forward only:
# tk_mlir's backward takes D <= 128.
ISSUE_TABLE = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (2, 16, 8192, 128, True),
               (8, 32, 1024, 128, True), (4, 32, 4096, 64, True), (1, 16, 8192, 256, False),
               (16, 16, 512, 128, True)]


def tk_attention(q, k, v, causal):
    from tk_mlir.kernels.flash_attention import attention
    return attention(q, k, v, causal=causal)


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def fa4():
    """FlashAttention-4 on (B, N, H, D) tensors (its call returns (out, lse));
    when the wheel does not import, a call that says so (the row fails)."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as e:      # not installed, or its CUDA libraries missing
        why = P.first_line(e)

        def missing(*_):
            raise RuntimeError(f"fa4 not importable ({why}); PYTHONPATH per "
                               f"../shared/gpu/README.md")
        return missing
    return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)[0]


def make_impls(names):
    """(name, fn, flip): flip marks an implementation taking (B, N, H, D)."""
    from torch.nn.attention import SDPBackend
    table = {"tk_mlir": (tk_attention, False),
             "cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION), False),
             "fa2": (sdpa(SDPBackend.FLASH_ATTENTION), False),
             "fa4": (fa4() if "fa4" in names else None, True)}
    return [(n, *table[n]) for n in names]


def laid_out(group, flip: bool) -> tuple:
    """A group's tensors in an implementation's layout: for (B, N, H, D),
    contiguous copies, made once, outside the timing."""
    return tuple(x.transpose(1, 2).contiguous() for x in group) if flip else group


def ours(t, flip: bool):
    """An implementation's output or gradient as (B, H, N, D) (a view)."""
    return t.transpose(1, 2) if flip else t


def reference(q, k, v, causal: bool) -> torch.Tensor:
    qf, kf, vf = (x[0, :CHECK_HEADS].float() for x in (q, k, v))
    s = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    return torch.softmax(s, -1) @ vf


def sliced_err(got, ref) -> float:
    """Rel. error of heads 0..CHECK_HEADS-1 of batch 0 against `ref`; NaN when
    anything in `got` is not finite (poison left, a NaN computed)."""
    if not bool(torch.isfinite(got).all()):
        return float("nan")
    return ((got[0, :CHECK_HEADS].float() - ref).norm() / ref.norm()).item()


def reference_grads(q, k, v, do, causal: bool):
    """float32 (dq, dk, dv) on heads 0..CHECK_HEADS-1 of batch 0 (heads are
    independent: the slice's gradients are the full gradients' slice)."""
    qf, kf, vf = (x[0, :CHECK_HEADS].float().requires_grad_() for x in (q, k, v))
    o = reference(qf[None], kf[None], vf[None], causal)
    o.backward(do[0, :CHECK_HEADS].float())
    return qf.grad, kf.grad, vf.grad


def forward_pass(groups, causal: bool):
    """(check, timed call) of the forward: each call returns a fresh output;
    the checked one follows a call whose output was poisoned."""
    ref = reference(*groups[0][:3], causal)

    def prepare(fn, flip):
        mine = [laid_out(g, flip) for g in groups]
        call = lambda g: fn(g[0], g[1], g[2], causal)  # noqa: E731
        call(mine[0]).fill_(float("nan"))
        return call, mine, lambda: sliced_err(ours(call(mine[0]), flip), ref), TOL
    return prepare


def run_forward(fn, group, causal: bool):
    """(o, (q, k, v) leaves, do) of one forward, ready for autograd.grad."""
    if group[0].is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a forward would be captured in the backward's graph "
                           "(fewer warm-up calls than input groups)")
    q, k, v, do = group
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    return fn(*leaves, causal), leaves, do


def backward_pass(groups, causal: bool):
    """The backward alone: the timed call is autograd.grad of o (retain_graph)
    for dq, dk, dv. Each implementation's forward runs once per input group,
    at the group's first call (in the warm-up, outside the timing), so on the
    stream that times the calls: autograd runs a backward on its forward's
    stream, and with --graph that is the stream being captured."""
    refs = reference_grads(*groups[0], causal)

    def prepare(fn, flip):
        mine, forwards = [laid_out(g, flip) for g in groups], {}

        def call(i):
            if i not in forwards:
                forwards[i] = run_forward(fn, mine[i], causal)
            o, leaves, do = forwards[i]
            return torch.autograd.grad(o, leaves, do, retain_graph=True)

        def check():
            o, leaves, do = run_forward(fn, mine[0], causal)
            for g in torch.autograd.grad(o, leaves, do, retain_graph=True):
                g.fill_(float("nan"))       # the checked gradients may land here
            got = torch.autograd.grad(o, leaves, do)
            return max(sliced_err(ours(g, flip), r) for g, r in zip(got, refs))
        return call, list(range(len(groups))), check, 2 * TOL
    return prepare


# pass -> (op name, FLOPs per B·H·N²·D, input tensors per group, its (check, call) maker)
PASSES = {"forward": ("attention", 4, 3, forward_pass),
          "backward": ("attention backward", 10, 4, backward_pass)}


def shape_name(b: int, h: int, n: int, d: int, causal: bool, sweep: bool = False) -> str:
    """The sweep's shapes by N and D (B and H follow from them), others by all four."""
    return (f"N={n} D={d}" if sweep else f"B{b} H{h} N{n} D{d}") + (" causal" if causal else "")


def bench(config, impls, timing, which: str = "forward", sweep: bool = True) -> list[dict]:
    b, h, n, d, causal = config
    op, flops_per, tensors, make = PASSES[which]
    flops = flops_per * b * h * n * n * d // (2 if causal else 1)
    shape = shape_name(b, h, n, d, causal, sweep)
    base = {"op": op, "shape": shape, "B": b, "H": h, "N": n, "D": d,
            "causal": causal, "flops": flops}
    rows = [{**base, "impl": name} for name, *_ in impls]
    groups = P.make_input_groups(
        lambda g: tuple(P.uniform(g, b, h, n, d) for _ in range(tensors)),
        tensors * 2 * b * h * n * d)
    prepare = make(groups, causal)
    print(f"{op} {shape}: B={b} H={h}, {len(groups)} groups"
          f"{', CUDA graphs' if timing.get('graph') else ''}", flush=True)
    for row, (name, fn, flip) in zip(rows, impls):
        try:
            call, inputs, check, tol = prepare(fn, flip)
            row["rel_err"] = err = check()
            row["status"] = "ok" if err <= tol else "WRONG"      # NaN fails too
            t = P.time_kernel(call, inputs, **timing)
        except Exception as e:      # one broken implementation must not sink the run
            row["status"] = f"failed: {P.first_line(e)}"
            print(f"  {name:8} {row['status']}", flush=True)
            continue
        finally:
            call = inputs = check = None    # (the backward's graphs and fa4's copies hold memory)
        P.record_tflops(row, t, flops)
    P.add_ratios(rows, "cudnn", "ratio_vs_cudnn")
    P.add_ratios(rows, "fa4", "ratio_vs_fa4")
    del groups, prepare
    torch.cuda.empty_cache()
    return rows


def parse_configs(text: str, causals: list[bool]) -> list[tuple]:
    """'B,H,N,D[,causal];...' -> [(B, H, N, D, causal)]; an entry without
    causal (0 or 1) comes once per --causal choice."""
    configs = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        fields = [int(x) for x in entry.split(",") if x.strip().isdigit()]
        if len(fields) != len(entry.split(",")) or len(fields) not in (4, 5) \
                or min(fields[:4]) < 1 or fields[4:] not in ([], [0], [1]):
            raise ValueError(f"{entry!r}: want B,H,N,D or B,H,N,D,causal (causal 0 or 1)")
        configs += [(*fields[:4], c) for c in ([bool(fields[4])] if fields[4:] else causals)]
    if not configs:
        raise ValueError("no config given")
    return configs


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N=4096, D=128, few launches")
    ap.add_argument("--n", help="comma list of sequence lengths")
    ap.add_argument("--d", help="comma list of head dims (64, 128)")
    ap.add_argument("--causal", choices=["0", "1", "both"], default="both",
                    help="for the sweep and for --configs entries without causal")
    ap.add_argument("--configs", help="exact shapes instead of the sweep: 'B,H,N,D[,causal];...' "
                                      "(causal 0 or 1), e.g. '4,16,4096,128,1;16,16,512,128'")
    ap.add_argument("--issue-table", action="store_true",
                    help="the attention issue's shapes: " + "; ".join(
                        shape_name(*c) for c in ISSUE_TABLE) + " (D=256 forward only)")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--backward", action="store_true",
                    help="time the backward pass (dq, dk, dv) instead of the forward")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays of the calls (GPU time without host time "
                         "between them)")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    if (args.configs or args.issue_table) and (args.n or args.d):
        ap.error("--configs and --issue-table give whole shapes: drop --n and --d")
    if args.configs and args.issue_table:
        ap.error("give --configs or --issue-table, not both")
    if args.issue_table:
        args.config_list = [c for c in ISSUE_TABLE if not (args.backward and c[3] == 256)]
    elif args.configs:
        try:
            args.config_list = parse_configs(args.configs, causals)
        except ValueError as e:
            ap.error(f"--configs: {e}")
    else:
        ns = [int(x) for x in args.n.split(",")] if args.n else [4096] if args.quick else NS
        ds = [int(x) for x in args.d.split(",")] if args.d else [128] if args.quick else DS
        args.config_list = [(TOKENS // n, HIDDEN // d, n, d, causal)
                            for d in ds for causal in causals for n in ns]
    args.names = [s.strip() for s in args.impls.split(",") if s.strip()]
    if not args.names or set(args.names) - set(IMPLS):
        ap.error(f"--impls: choose from {IMPLS}")
    return args


def result_name(args) -> str:
    return ("attention" + ("-backward" if args.backward else "")
            + ("-issue" if args.issue_table else "-configs" if args.configs else "")
            + ("-graph" if args.graph else "") + ("-quick" if args.quick else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    P.require_cuda("benchmarks/attention.py")
    torch.backends.cuda.matmul.allow_tf32 = False
    timing = (dict(warmup=20, iters=20, repeats=1, pause_s=0.05) if args.quick
              else dict(warmup=500, iters=100, repeats=3, pause_s=0.5))
    timing["graph"] = args.graph
    impls = make_impls(args.names)
    which = "backward" if args.backward else "forward"
    sweep = not (args.configs or args.issue_table)
    rows = [r for c in args.config_list for r in bench(c, impls, timing, which, sweep)]
    cols = ["shape", "B", "H", "impl", "ms", ("tflops", "TFLOP/s"),
            ("ratio_vs_cudnn", "vs cuDNN"), ("ratio_vs_fa4", "vs FA4"),
            ("rel_err", "rel err"), "status"]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    meta = {"metric": "tflops", "dtype": "bfloat16", "pass": which,
            "flops": ("10" if args.backward else "4") + "*B*H*N^2*D (half if causal)",
            **({"tokens": TOKENS, "hidden": HIDDEN} if sweep else
               {"configs": "the attention issue's table" if args.issue_table else args.configs}),
            "tol": TOL, "timing": timing, "graph": args.graph,
            "layouts": "(B, H, N, D) contiguous; fa4: (B, N, H, D) contiguous copies of "
                       "the same inputs",
            "check": f"rel. Frobenius error vs float32 on heads 0..{CHECK_HEADS - 1} of batch 0; "
                     f"NaN anywhere fails", "quick": args.quick}
    P.write_results(result_name(args), rows, meta, args.out_dir)
    bad = [f"{r['shape']} {r['impl']}" for r in rows if r["status"] != "ok"]
    if bad:
        print("NOT OK: " + "; ".join(bad))
    return 0


if __name__ == "__main__":
    sys.exit(main())
