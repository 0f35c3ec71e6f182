"""Mamba-2's SSD layer: tk_mlir `ssd` against flash-linear-attention's
`chunk_simple_gla` (Triton), which computes the same recurrence with
q = C, k = dt·B, v = x, g = dt·A (issue 27), forward and forward+backward,
and both against a float64 recurrence.

On the GPU machine, from the repository root, with FLA on PYTHONPATH (a
pure-Python wheel, ../shared/gpu/README.md):
    python3 benchmarks/ssd.py --out-dir "$OUT"
    python3 benchmarks/ssd.py --l 2048 --g 1 --b 2 --h 64
    python3 benchmarks/ssd.py --l 2048 --g 1 --b 1 --h 16 --graph   # CUDA-graph replays

bf16 x, B, C; f32 dt (through softplus) and A < 0; no D. Both are timed
from the layer's inputs (x, dt, A, B, C) with gradients to all of them: for
FLA, k = dt·B (B expanded to the heads) and g = dt·A are made by torch ops
inside the timed call, as a Mamba-2 layer on FLA would ("fla"), and before
it ("fla kernels": FLA's kernels alone). µs per call: CUDA
events (50 warm-up, 2 x 30 timed calls), input groups cycled past the L2;
--graph replays the timed calls in one CUDA graph (GPU time, without the
host's launches between them: short sequences are host-bound eagerly).
Numerics: each implementation's relative error against the recurrence run
in float64, one token at a time, at b1 l1024 h4 (h = g for g > 4), output and gradients.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402

INPUTS = ("x", "dt", "A", "B", "C")


def impls():
    """name -> f(x, dt, A, B, C) -> y."""
    from tk_mlir.kernels import ssd
    out = {"tk_mlir": lambda x, dt, A, B, C: ssd(x, dt, A, B, C)}
    try:
        from fla.ops.simple_gla import chunk_simple_gla

        def fla(x, dt, A, B, C):
            h = x.shape[2]
            Bh, Ch = (t.repeat_interleave(h // t.shape[2], 2) for t in (B, C))
            k = (dt[..., None] * Bh).to(x.dtype)
            return chunk_simple_gla(Ch, k, x, g=dt * A, scale=1.0)[0]
        out["fla"] = fla
    except Exception as e:                                          # noqa: BLE001
        print(f"fla not importable ({P.first_line(e)}): its rows are left out", flush=True)
    return out


def inputs(b, l, h, p, g, n, gen, grad=True):
    x = (torch.randn(b, l, h, p, device="cuda", generator=gen) * 0.5).bfloat16()
    dt = torch.nn.functional.softplus(torch.randn(b, l, h, device="cuda", generator=gen) - 3)
    A = -0.5 - 3.5 * torch.rand(h, device="cuda", generator=gen)
    B, C = ((torch.randn(b, l, g, n, device="cuda", generator=gen) * 0.3).bfloat16()
            for _ in range(2))
    return tuple(t.requires_grad_(grad) for t in (x, dt, A, B, C))


def recurrence(x, dt, A, B, C):
    b, l, h, p = x.shape
    Bh, Ch = (t.repeat_interleave(h // t.shape[2], 2) for t in (B, C))
    H = x.new_zeros(b, h, p, B.shape[3])
    ys = []
    for t in range(l):
        H = (torch.exp(dt[:, t] * A)[..., None, None] * H
             + dt[:, t, :, None, None] * x[:, t, :, :, None] * Bh[:, t, :, None, :])
        ys.append((H * Ch[:, t, :, None, :]).sum(-1))
    return torch.stack(ys, 1)


def numerics(g: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    leaves = inputs(1, 1024, g * max(1, 4 // g), 64, g, 128, gen, grad=False)
    dy = torch.randn(leaves[0].shape, device="cuda", generator=gen)
    ref_in = [t.double().requires_grad_() for t in leaves]
    ref = recurrence(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, dy.double())
    out = {}
    for name, fn in impls().items():
        mine = [t.clone().requires_grad_() for t in leaves]
        y = fn(*mine)
        out[name] = {"y": P.rel_err(y, ref)}
        try:        # (FLA refuses its gated backward on some Triton versions)
            grads = torch.autograd.grad(y, mine, dy.to(y.dtype))
        except Exception as e:                                      # noqa: BLE001
            out[name]["status"] = f"backward failed: {P.first_line(e)}"
            continue
        out[name].update({f"d{k}": P.rel_err(a, r) for k, a, r in zip(INPUTS, grads, ref_grads)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--l", default="2048,8192,16384")
    ap.add_argument("--g", default="1,8")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--h", type=int, default=64)
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays (kernel time, not the host's)")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    P.require_cuda("benchmarks/ssd.py")
    rows = []
    groups = [int(x) for x in args.g.split(",")]
    for g in groups:
        for name, errs in numerics(g).items():
            row = {"case": f"numerics g{g}", "impl": name, **errs}
            rows.append(row)
            print(row, flush=True)
    for g in groups:
        for l in (int(x) for x in args.l.split(",")):
            rows += _time(args.b, l, args.h, args.p, g, args.n, args.graph)
    for r in rows:
        peer = next((x for x in rows if x["impl"] == "fla" and x["case"] == r["case"] and
                     x.get("pass") == r.get("pass") and "us" in x), None)
        if peer and "us" in r:
            r["vs_fla"] = peer["us"] / r["us"]
    cols = ["case", "impl", "pass", ("us", "µs"), ("vs_fla", "fla µs / this"), "y",
            *(f"d{k}" for k in INPUTS), "status"]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    P.write_results("ssd", rows, vars(args), args.out_dir)
    return 0


def _time(b, l, h, p, g, n, graph=False):
    case = f"b{b} l{l} h{h} p{p} g{g} n{n}"
    timing = dict(warmup=50, iters=30, repeats=2, graph=graph)
    rows = P.time_passes(case, impls(), lambda gen: inputs(b, l, h, p, g, n, gen), **timing)
    if any(r["impl"] == "fla" for r in rows):     # FLA's kernels alone, on q, k, g made before
        from fla.ops.simple_gla import chunk_simple_gla

        def made(gen):
            x, dt, A, B, C = (t.detach() for t in inputs(b, l, h, p, g, n, gen))
            q, k = (t.repeat_interleave(h // g, 2) for t in (C, B))
            return tuple(t.requires_grad_() for t in (q, (dt[..., None] * k).to(x.dtype), x,
                                                      dt * A))
        rows += P.time_passes(case, {"fla kernels": lambda q, k, v, gl: chunk_simple_gla(
            q, k, v, g=gl, scale=1.0)[0]}, made, **timing)
    return rows


if __name__ == "__main__":
    sys.exit(main())
