"""Chunked linear attention: tk_mlir `linear_attention` against
flash-linear-attention's `chunk_linear_attn` (Triton), forward and
forward+backward, and both against a float64 recurrence.

On the GPU machine, from the repository root, with FLA on PYTHONPATH (a
pure-Python wheel, ../shared/gpu/README.md):
    python3 benchmarks/linear_attention.py --out-dir "$OUT"
    python3 benchmarks/linear_attention.py --n 2048,8192 --d 64,128 --b 4 --h 16
    python3 benchmarks/linear_attention.py --d 64 --kernel-time   # + the kernels' GPU time

bf16 (B, N, H, D) inputs, D_k = D_v = D, causal, identity feature map (FLA
takes q and k already mapped), normalize off and on (FLA divides by q·scale·
cumsum(k) + 1e-10 with the cumsum in bf16; tk_mlir by φ(q)·z + 1e-6 in f32).
µs per call: CUDA events, input groups cycled past the L2. Numerics: each
implementation's relative error against the recurrence run in float64, one
token at a time, at B1 H2 N1024 on elu(x)+1-mapped inputs (positive
normalisers), output and gradients.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402


def impls(normalize: bool, taylor2: bool = False):
    """tk_mlir and FLA on (B, N, H, D): identity feature map, or (taylor2)
    Based's, against FLA's fused_chunk_based and parallel_based."""
    from tk_mlir.kernels import linear_attention
    feature_map = "taylor2" if taylor2 else None
    out = {"tk_mlir": lambda q, k, v: linear_attention(q, k, v, feature_map,
                                                       normalize=normalize)}
    try:
        if taylor2:
            from fla.ops.based import fused_chunk_based, parallel_based
            out["fla"] = lambda q, k, v: fused_chunk_based(q, k, v, use_norm=normalize)
            out["fla parallel"] = lambda q, k, v: parallel_based(q, k, v, use_norm=normalize)
        else:
            from fla.ops.linear_attn import chunk_linear_attn
            out["fla"] = lambda q, k, v: chunk_linear_attn(q, k, v, normalize=normalize)[0]
    except Exception as e:                                          # noqa: BLE001
        print(f"fla not importable ({P.first_line(e)}): its rows are left out", flush=True)
    return out


def taylor2(x):
    """Based's feature map: [1, x, vec(x ⊗ x) / √2]."""
    outer = (x[..., :, None] * x[..., None, :]).flatten(-2) / 2 ** 0.5
    return torch.cat((torch.ones_like(x[..., :1]), x, outer), -1)


def recurrence(q, k, v, normalize: bool, feature=None):
    """float64, token by token (q scaled by 1/sqrt(D), then the feature map)."""
    q = q * q.shape[-1] ** -0.5
    if feature is not None:
        q, k = feature(q), feature(k)
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    z = q.new_zeros(q.shape[0], q.shape[2], q.shape[3])
    outs = []
    for t in range(q.shape[1]):
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
        z = z + k[:, t]
        num = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        outs.append(num / ((q[:, t] * z).sum(-1, keepdim=True) + 1e-6) if normalize else num)
    return torch.stack(outs, 1)


def numerics(normalize: bool, d: int, dv: int, taylor: bool = False) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = ((torch.rand(1, 1024, 2, d, device="cuda", generator=g) - 0.5).bfloat16()
            for _ in range(2))
    v = (torch.rand(1, 1024, 2, dv, device="cuda", generator=g) - 0.5).bfloat16()
    if not taylor:       # (positive features: the normaliser stays away from 0)
        q, k = (torch.nn.functional.elu(t.float()).add(1).bfloat16() for t in (q, k))
    do = torch.rand(1, 1024, 2, dv, device="cuda", generator=g) - 0.5
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = recurrence(*ref_in, normalize, taylor2 if taylor else None)
    ref_grads = torch.autograd.grad(ref, ref_in, do.double())
    out = {}
    for name, fn in impls(normalize, taylor).items():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        grads = torch.autograd.grad(o, leaves, do.to(o.dtype))
        errs = [((a.double() - b).norm() / b.norm()).item()
                for a, b in zip((o, *grads), (ref, *ref_grads))]
        out[name] = dict(zip(("o", "dq", "dk", "dv"), errs))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="2048,8192,16384")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--kernel-time", action="store_true",
                    help="also each pass's GPU time per call as its kernels cost (torch."
                         "profiler's sum: no host time), the \"kernels\" passes")
    ap.add_argument("--taylor2", action="store_true",
                    help="Based's feature map instead: q/k head dim 16, v 64, against FLA's "
                         "fused_chunk_based and parallel_based")
    args = ap.parse_args(argv)
    P.require_cuda("benchmarks/linear_attention.py")
    rows = []
    dims = [(16, 64)] if args.taylor2 else [(int(x), int(x)) for x in args.d.split(",")]
    for normalize in (False, True):
        for d, dv in dims:
            for name, errs in numerics(normalize, d, dv, args.taylor2).items():
                row = {"case": f"numerics D{d} normalize={normalize}", "impl": name, **errs}
                rows.append(row)
                print(row, flush=True)
            for n in (int(x) for x in args.n.split(",")):
                rows += _time(args.b, n, args.h, d, dv, normalize, args.taylor2,
                              args.kernel_time)
    cols = ["case", "impl", "pass", ("us", "µs"), ("vs_fla", "fla µs / this"), "o", "dq",
            "dk", "dv", "status"]
    for r in rows:
        peer = next((x for x in rows if x["impl"] == "fla" and x["case"] == r["case"] and
                     x.get("pass") == r.get("pass") and "us" in x), None)
        if peer and "us" in r:
            r["vs_fla"] = peer["us"] / r["us"]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    P.write_results("linear-attention" + ("-taylor2" if args.taylor2 else ""), rows, vars(args),
                    args.out_dir)
    return 0


def _time(b, n, h, d, dv, normalize, taylor=False, kernel_time=False):
    def make(gen):
        return tuple((torch.rand(b, n, h, dim, device="cuda", generator=gen) - 0.5).bfloat16()
                     .requires_grad_() for dim in (d, d, dv))
    case = f"B{b} N{n} H{h} D{d}/{dv} normalize={normalize}" + (" taylor2" if taylor else "")
    rows = P.time_passes(case, impls(normalize, taylor), make)
    if kernel_time:
        rows += _kernel_times(case, impls(normalize, taylor),
                              make(torch.Generator(device="cuda").manual_seed(0)))
    return rows


def _kernel_times(case, fns, leaves):
    """Rows of each implementation's GPU time per call (P.kernel_us_per_call):
    the forward, and the forward + backward (every input's gradient, ones
    as the output's), on one input group."""
    rows = []
    for name, fn in fns.items():
        def fwd(fn=fn):
            return fn(*leaves)

        def fwd_bwd(fn=fn):
            out = fn(*leaves)
            return torch.autograd.grad(out, leaves, torch.ones_like(out))
        for pass_, f in (("fwd kernels", fwd), ("fwd+bwd kernels", fwd_bwd)):
            row = {"case": case, "impl": name, "pass": pass_}
            try:
                with torch.set_grad_enabled(f is fwd_bwd):
                    us, per = P.kernel_us_per_call(f)
                row.update(us=us, status="ok",
                           kernels={k[:60]: round(v, 1) for k, v in list(per.items())[:6]})
            except Exception as e:                                  # noqa: BLE001
                row["status"] = f"failed: {P.first_line(e)}"
            rows.append(row)
            print(row, flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
