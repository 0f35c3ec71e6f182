"""The training library's kernels against Liger Kernel's (Triton), quack's
(CuTe DSL, where it imports) and torch.compile of the plain torch code,
forward and forward+backward, same inputs, same run (issue 25).

On the GPU machine, from the repository root, with Liger Kernel importable
(a pure-Python wheel: bring it as ../shared/gpu/README.md says for peers;
quack and its nvidia-cutlass-dsl travel in the same bundles as FlashAttention-4,
and its rows are left out where it does not import):
    python3 benchmarks/liger_kernels.py --out-dir "$OUT"

Cases (Llama-3 8B sizes, bf16, 8192 tokens): rms_norm and
fused_add_rms_norm (D 4096), swiglu (14336 wide), rotary on q and k (B4
N2048 H32/8 D128), cross_entropy (vocab 128256) and linear_cross_entropy
(4096 -> 128256, ours by default and with low_memory=True, with the peak
memory each allocates beyond its inputs).
Each output is first checked against float64 (rel. error printed for all);
every implementation starts from the same input values (Liger's swiglu,
rotary and cross-entropy write over their inputs, so the inputs are restored
before each); times are CUDA events around back-to-back calls after a
warm-up, the median of ROUNDS rounds; fwd+bwd includes the forward (the
output gradients are made once, outside the timing). The peak memory is that of a second fwd+bwd call beyond what was
allocated before it (the first compiles, tunes and makes the gradients).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402

T = 8192          # tokens
D, F, V = 4096, 14336, 128256
ROUNDS = 5        # the median of 5 rounds of 10 calls (host-bound rows swing between rounds)


def _uniform(*shape, grad=False):
    x = (torch.rand(*shape, device="cuda") * 2 - 1).bfloat16()
    return x.requires_grad_() if grad else x


def _rel(x, ref) -> float:
    return P.rel_err(x[0] if isinstance(x, tuple) else x, ref)


def _fwd_bwd(fn, inputs):
    """fn's forward and its backward to `inputs` from every output (a loss:
    from 1; else from one fixed random gradient per output shape)."""
    grads = {}

    def gradient(o):          # (made once: the timed calls make no random tensors)
        if o.shape not in grads:
            grads[o.shape] = torch.ones_like(o) if o.dim() == 0 else torch.rand_like(o)
        return grads[o.shape]

    def run():
        out = fn()
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(outs, inputs, [gradient(o) for o in outs])
    return run


def plain_torch():
    """Each kernel's plain torch code under torch.compile (the issue's third
    peer): norms and rotary in f32 as the kernels compute, the losses on
    f32 logits."""
    fn = torch.nn.functional

    def rms_norm(x, w, eps=1e-6):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)

    def fused_add_rms_norm(x, r, w):
        h = x + r
        return rms_norm(h, w), h

    def rotary_qk(q, k, cos, sin):
        c, s = cos[:, None], sin[:, None]                      # (N, 1, D/2)

        def rotate(t):
            t1, t2 = t[..., :t.shape[-1] // 2].float(), t[..., t.shape[-1] // 2:].float()
            return torch.cat((t1 * c - t2 * s, t2 * c + t1 * s), -1).to(t.dtype)
        return rotate(q), rotate(k)

    plain = {"rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm,
             "swiglu": lambda g, u: fn.silu(g) * u, "rotary_qk": rotary_qk,
             "cross_entropy": lambda x, t: fn.cross_entropy(x.float(), t),
             "linear_cross_entropy": lambda h, w, t: fn.cross_entropy((h @ w.T).float(), t)}
    return {name: torch.compile(f) for name, f in plain.items()}


def _quack():
    """quack's (rmsnorm, apply_rotary_emb, cross_entropy,
    chunked_linear_cross_entropy), or None where it does not import."""
    try:
        from quack.cross_entropy import cross_entropy
        from quack.linear_cross_entropy import chunked_linear_cross_entropy
        from quack.rmsnorm import rmsnorm
        from quack.rotary import apply_rotary_emb
    except Exception as e:       # (not installed, or its CuTe DSL libraries are missing)
        print(f"quack not measured: {P.first_line(e)}", flush=True)
        return None
    return rmsnorm, apply_rotary_emb, cross_entropy, chunked_linear_cross_entropy


def cases():
    """(name, inputs needing grad, {impl: fn}, float64 reference of the output, extra)."""
    import liger_kernel.transformers as lt
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from tk_mlir import kernels as K
    C = plain_torch()
    Q = _quack()

    def with_quack(impls: dict, fn) -> dict:
        return impls if Q is None else {**impls, "quack": fn}

    x, w = _uniform(T, D, grad=True), (torch.rand(D, device="cuda") + 0.5).bfloat16()
    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)) * w.double()
    liger_norm = lt.LigerRMSNorm(D, eps=1e-6, in_place=False).cuda().bfloat16()
    liger_norm.weight.data.copy_(w)
    yield ("rms_norm T x 4096", [x], with_quack(
        {"tk_mlir": lambda: K.rms_norm(x, w, eps=1e-6), "liger": lambda: liger_norm(x),
         "torch.compile": lambda: C["rms_norm"](x, w)},
        lambda: Q[0](x, w, eps=1e-6)), ref)

    r = _uniform(T, D, grad=True)
    h = x.double() + r.double()
    ref = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)) * w.double()
    liger_add = lt.LigerFusedAddRMSNorm(D, eps=1e-6).cuda().bfloat16()
    liger_add.weight.data.copy_(w)
    yield ("fused_add_rms_norm T x 4096", [x, r],
           with_quack({"tk_mlir": lambda: K.fused_add_rms_norm(x, r, w, eps=1e-6),
                       "liger": lambda: liger_add(x, r),
                       "torch.compile": lambda: C["fused_add_rms_norm"](x, r, w)},
                      lambda: Q[0](x, w, residual=r, eps=1e-6, prenorm=True)), ref)

    g, u = _uniform(T, F, grad=True), _uniform(T, F, grad=True)
    ref = torch.nn.functional.silu(g.double()) * u.double()
    yield ("swiglu T x 14336", [g, u], {"tk_mlir": lambda: K.swiglu(g, u),
                                        "liger": lambda: LigerSiLUMulFunction.apply(g, u),
                                        "torch.compile": lambda: C["swiglu"](g, u)}, ref)

    B, N, H, Hk, Dh = 4, 2048, 32, 8, 128
    q, k = _uniform(B, N, H, Dh, grad=True), _uniform(B, N, Hk, Dh, grad=True)
    angle = torch.arange(N, device="cuda")[:, None] * 10000 ** (
        -torch.arange(Dh // 2, device="cuda") / (Dh // 2))
    cos, sin = angle.cos(), angle.sin()
    half = q.double()[..., :Dh // 2], q.double()[..., Dh // 2:]
    c, s = cos.double()[:, None], sin.double()[:, None]
    ref = torch.cat((half[0] * c - half[1] * s, half[1] * c + half[0] * s), -1)
    cos2 = torch.cat((cos, cos), -1)[None].bfloat16()
    sin2 = torch.cat((sin, sin), -1)[None].bfloat16()
    yield ("rotary q, k B4 N2048 H32/8 D128", [q, k],
           {"tk_mlir": lambda: K.rotary_embedding_qk(q, k, cos, sin),
            "liger": lambda: tuple(t.transpose(1, 2) for t in lt.liger_rotary_pos_emb(
                q.transpose(1, 2), k.transpose(1, 2), cos2, sin2)),
            "torch.compile": lambda: C["rotary_qk"](q, k, cos, sin),
            **({} if Q is None else
               {"quack": lambda: (Q[1](q, cos, sin), Q[1](k, cos, sin))})}, ref)

    logits = _uniform(T // 2, V, grad=True)
    target = torch.randint(0, V, (T // 2,), device="cuda")
    ref = torch.nn.functional.cross_entropy(logits.double(), target)
    liger_ce = lt.LigerCrossEntropyLoss()
    yield ("cross_entropy 4096 x 128256", [logits],
           with_quack({"tk_mlir": lambda: K.cross_entropy(logits, target),
                       "liger": lambda: liger_ce(logits, target),
                       "torch.compile": lambda: C["cross_entropy"](logits, target)},
                      lambda: Q[2](logits, target)), ref)

    hid, weight = _uniform(T, D, grad=True), (_uniform(V, D) * 0.05).requires_grad_()
    target = torch.randint(0, V, (T,), device="cuda")
    ref = None      # (the float64 logits would take 8 GB: checked against fp32 torch below)
    liger_lce = lt.LigerFusedLinearCrossEntropyLoss()
    yield ("linear_cross_entropy 8192 x 4096 -> 128256", [hid, weight],
           {"tk_mlir": lambda: K.linear_cross_entropy(hid, weight, target),
            "tk_mlir low_memory": lambda: K.linear_cross_entropy(hid, weight, target,
                                                                 low_memory=True),
            "liger": lambda: liger_lce(weight, hid, target),
            "torch.compile": lambda: C["linear_cross_entropy"](hid, weight, target),
            **({} if Q is None else {"quack": lambda: Q[3](hid, weight, target)}),
            "torch": lambda: torch.nn.functional.cross_entropy((hid @ weight.T).float(),
                                                               target)}, ref)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    P.require_cuda("benchmarks/liger_kernels.py")
    rows = []
    for name, inputs, impls, ref in cases():
        outs = {}
        pristine = [t.detach().clone() for t in inputs]
        for impl, fn in impls.items():
            row = {"case": name, "impl": impl}
            with torch.no_grad():      # (Liger writes gradients and rotations over its inputs)
                for t, saved in zip(inputs, pristine):
                    t.copy_(saved)
            try:
                with torch.no_grad():
                    outs[impl] = fn()
                if ref is not None:
                    row["rel_err"] = _rel(outs[impl], ref)
                row["fwd_us"] = 1e3 * P.events_ms(fn, 10, rounds=ROUNDS)
                run = _fwd_bwd(fn, inputs)
                run()      # (first: compiles and tunes, and makes the output gradients)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                run()
                row["fwd_bwd_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
                row["fwd_bwd_us"] = 1e3 * P.events_ms(run, 10, rounds=ROUNDS)
                row["status"] = "ok"
            except Exception as e:     # (one implementation's failure does not stop the run)
                row["status"] = f"failed: {P.first_line(e)}"
            rows.append(row)
            print(row, flush=True)
        if ref is None and "torch" in outs:     # linear_cross_entropy: against fp32 torch
            for r in rows[-len(impls):]:
                if r["impl"] in outs:
                    r["rel_err"] = abs(outs[r["impl"]].double().item() -
                                       outs["torch"].double().item()) / outs["torch"].item()
    for name in dict.fromkeys(r["case"] for r in rows):
        for impl, tag in (("liger", "liger"), ("torch.compile", "compile"), ("quack", "quack")):
            peer = next((r for r in rows if r["case"] == name and r["impl"] == impl
                         and r["status"] == "ok"), None)
            for r in rows:
                if r["case"] == name and peer is not None and r["status"] == "ok":
                    r[f"fwd_vs_{tag}"] = peer["fwd_us"] / r["fwd_us"]
                    r[f"fwd_bwd_vs_{tag}"] = peer["fwd_bwd_us"] / r["fwd_bwd_us"]
    cols = ["case", "impl", ("fwd_us", "fwd µs"), ("fwd_bwd_us", "fwd+bwd µs"),
            ("fwd_vs_liger", "fwd speedup vs Liger"),
            ("fwd_bwd_vs_liger", "fwd+bwd speedup vs Liger"),
            ("fwd_bwd_vs_compile", "fwd+bwd speedup vs torch.compile"),
            ("fwd_bwd_vs_quack", "fwd+bwd speedup vs quack"),
            ("fwd_bwd_peak_extra_gib", "peak extra GiB"), ("rel_err", "rel err"), "status"]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    P.write_results("liger-kernels", rows, vars(args), args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
