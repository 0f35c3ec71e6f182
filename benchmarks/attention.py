"""Attention forward: tk_mlir vs torch SDPA (cuDNN backend, FlashAttention-2 backend).

On the GPU machine, from the repository root:
    python3 benchmarks/attention.py --out-dir "$OUT"            # the full table
    python3 benchmarks/attention.py --quick                     # N=4096, D=128 only
    python3 benchmarks/attention.py --n 4096,16384 --d 128 --causal 0
    python3 benchmarks/attention.py --backward                  # dq, dk, dv (2.5x the FLOPs)

B·N = 16384 tokens, H·D = 2048 (H = 2048 / D), bf16, (B, H, N, D) inputs;
FLOPs per call = 4·B·H·N²·D, half of it for causal. Every implementation is
checked against a float32 reference (explicit softmax, on a slice of heads)
before it is timed, with its output poisoned first.
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
IMPLS = ["tk_mlir", "cudnn", "fa2"]
TOL = 1e-2               # rel. Frobenius error vs float32 above this marks a row WRONG
CHECK_HEADS = 2          # heads of batch 0 the reference covers


def tk_attention(q, k, v, causal):
    from tk_mlir.kernels.flash_attention import attention
    return attention(q, k, v, causal=causal)


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def make_impls(names):
    from torch.nn.attention import SDPBackend
    table = {"tk_mlir": tk_attention,
             "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
             "fa2": sdpa(SDPBackend.FLASH_ATTENTION)}
    return [(n, table[n]) for n in names]


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

    def prepare(fn):
        call = lambda g: fn(g[0], g[1], g[2], causal)  # noqa: E731
        call(groups[0]).fill_(float("nan"))
        return call, groups, lambda: sliced_err(call(groups[0]), ref), TOL
    return prepare


def backward_pass(groups, causal: bool):
    """The backward alone: each implementation's forward runs once per input
    group outside the timing; the timed call is autograd.grad of o
    (retain_graph) for dq, dk, dv."""
    refs = reference_grads(*groups[0], causal)

    def prepare(fn):
        prepared = []
        for q, k, v, do in groups:
            leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
            prepared.append((fn(*leaves, causal), leaves, do))
        call = lambda p: torch.autograd.grad(p[0], p[1], p[2], retain_graph=True)  # noqa: E731
        return call, prepared, \
            lambda: max(sliced_err(g, r) for g, r in zip(call(prepared[0]), refs)), 2 * TOL
    return prepare


# pass -> (op name, FLOPs per B·H·N²·D, input tensors per group, its (check, call) maker)
PASSES = {"forward": ("attention", 4, 3, forward_pass),
          "backward": ("attention backward", 10, 4, backward_pass)}


def bench(n: int, d: int, causal: bool, impls, timing, which: str = "forward") -> list[dict]:
    op, flops_per, tensors, make = PASSES[which]
    b, h = TOKENS // n, HIDDEN // d
    flops = flops_per * b * h * n * n * d // (2 if causal else 1)
    shape = f"N={n} D={d}{' causal' if causal else ''}"
    base = {"op": op, "shape": shape, "B": b, "H": h, "N": n, "D": d,
            "causal": causal, "flops": flops}
    rows = [{**base, "impl": name} for name, _ in impls]
    groups = P.make_input_groups(
        lambda g: tuple(P.uniform(g, b, h, n, d) for _ in range(tensors)),
        tensors * 2 * b * h * n * d)
    prepare = make(groups, causal)
    print(f"{op} {shape}: B={b} H={h}, {len(groups)} groups", flush=True)
    for row, (name, fn) in zip(rows, impls):
        try:
            call, inputs, check, tol = prepare(fn)
            row["rel_err"] = err = check()
            row["status"] = "ok" if err <= tol else "WRONG"      # NaN fails too
            t = P.time_kernel(call, inputs, **timing)
        except Exception as e:      # one broken implementation must not sink the run
            row["status"] = f"failed: {P.first_line(e)}"
            print(f"  {name:8} {row['status']}", flush=True)
            continue
        finally:
            call = inputs = None    # (the backward's graphs hold memory)
        P.record_tflops(row, t, flops)
    P.add_ratios(rows, "cudnn", "ratio_vs_cudnn")
    del groups, prepare
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N=4096, D=128, few launches")
    ap.add_argument("--n", help="comma list of sequence lengths")
    ap.add_argument("--d", help="comma list of head dims (64, 128)")
    ap.add_argument("--causal", choices=["0", "1", "both"], default="both")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--backward", action="store_true",
                    help="time the backward pass (dq, dk, dv) instead of the forward")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    P.require_cuda("benchmarks/attention.py")
    torch.backends.cuda.matmul.allow_tf32 = False
    ns = [int(x) for x in args.n.split(",")] if args.n else [4096] if args.quick else NS
    ds = [int(x) for x in args.d.split(",")] if args.d else [128] if args.quick else DS
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    names = [s.strip() for s in args.impls.split(",") if s.strip()]
    if set(names) - set(IMPLS):
        ap.error(f"--impls: choose from {IMPLS}")
    timing = (dict(warmup=20, iters=20, repeats=1, pause_s=0.05) if args.quick
              else dict(warmup=500, iters=100, repeats=3, pause_s=0.5))
    impls = make_impls(names)
    which = "backward" if args.backward else "forward"
    rows = [r for d in ds for causal in causals for n in ns
            for r in bench(n, d, causal, impls, timing, which)]
    cols = ["shape", "B", "H", "impl", "ms", ("tflops", "TFLOP/s"),
            ("ratio_vs_cudnn", "vs cuDNN"), ("rel_err", "rel err"), "status"]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    meta = {"metric": "tflops", "dtype": "bfloat16", "pass": "backward" if args.backward else
            "forward", "flops": ("10" if args.backward else "4") + "*B*H*N^2*D (half if causal)",
            "tokens": TOKENS, "hidden": HIDDEN, "tol": TOL, "timing": timing,
            "check": f"rel. Frobenius error vs float32 on heads 0..{CHECK_HEADS - 1} of batch 0; "
                     f"NaN anywhere fails", "quick": args.quick}
    P.write_results("attention" + ("-backward" if args.backward else "") +
                    ("-quick" if args.quick else ""), rows, meta, args.out_dir)
    bad = [f"{r['shape']} {r['impl']}" for r in rows if r["status"] != "ok"]
    if bad:
        print("NOT OK: " + "; ".join(bad))
    return 0


if __name__ == "__main__":
    sys.exit(main())
