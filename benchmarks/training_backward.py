"""The training kernels' backward (issue 25) against torch, the runs behind
BENCHMARKS.md's "Training kernels' backward" section.

On the GPU machine, from the repository root:
    python3 benchmarks/training_backward.py                      # every section
    python3 benchmarks/training_backward.py --only norms,cross_entropy

Sections (names for --only):
- norms: rms_norm / layer_norm backward (dx, dweight[, dbias]) vs torch
  eager and torch.compile (their autograd fwd+bwd minus their forward);
- matmul: gemm.grad_a / grad_b vs cuBLAS on the same products;
- cross_entropy: fwd and fwd+bwd vs F.cross_entropy eager and compiled,
  with the peak memory allocated beyond the inputs;
- linear_cross_entropy: fwd+bwd time and peak memory vs
  F.cross_entropy(h @ w.T) at Llama-3's vocabulary.
Every output is checked against float64 first (its rel. error printed);
times are CUDA events around back-to-back calls after a warm-up.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
import protocol as P  # noqa: E402


def _uniform(*shape):
    return (torch.rand(*shape, device="cuda") * 2 - 1).bfloat16()




def norms() -> None:
    from tk_mlir.kernels import norms as tk_norms
    for rows, d in ((32768, 4096), (16384, 8192), (4096, 4096)):
        x, w, b, dy = _uniform(rows, d), _uniform(d), _uniform(d), _uniform(rows, d)
        gb = 3 * rows * d * 2 / 1e9                       # x, dy read; dx written
        compiled = torch.compile(lambda xx, ww: F.rms_norm(xx, (d,), ww, 1e-6))

        def grads(fn, *inputs):
            inputs = [t.detach().requires_grad_() for t in inputs]
            torch.autograd.grad(fn(*inputs), inputs, dy)

        times = {
            "tk rms": P.events_ms(lambda: tk_norms.rms_norm_backward(dy, x, w, 1e-6), 30),
            "torch rms": P.events_ms(lambda: grads(lambda a, c: F.rms_norm(a, (d,), c, 1e-6),
                                                   x, w), 30) -
            P.events_ms(lambda: F.rms_norm(x, (d,), w, 1e-6), 30),
            "compile rms": P.events_ms(lambda: grads(compiled, x, w), 30) -
            P.events_ms(lambda: compiled(x, w), 30),
            "tk ln": P.events_ms(lambda: tk_norms.layer_norm_backward(dy, x, w, 1e-5), 30),
            "torch ln": P.events_ms(lambda: grads(lambda a, c, e: F.layer_norm(a, (d,), c, e, 1e-5),
                                          x, w, b), 30) -
            P.events_ms(lambda: F.layer_norm(x, (d,), w, b, 1e-5), 30),
        }
        dx, dw = tk_norms.rms_norm_backward(dy, x, w, 1e-6)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        ref = torch.autograd.grad(x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) *
                                  w64, (x64, w64), dy.double())
        err = max(P.rel_err(dx, ref[0]), P.rel_err(dw, ref[1]))
        print(f"{rows}x{d} err {err:.1e} | " + " | ".join(
            f"{k} {t * 1e3:.0f} us ({gb / t * 1e3:.0f} GB/s)" for k, t in times.items()),
            flush=True)


def matmul() -> None:
    from tk_mlir.kernels import gemm
    for M, N, K in ((4096, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336),
                    (2048, 1024, 4096)):
        for layout in ("nk", "kn"):
            a, dc = _uniform(M, K), _uniform(M, N)
            b = _uniform(N, K) if layout == "nk" else _uniform(K, N)
            flop = 2 * M * N * K
            ours = (P.events_ms(lambda: gemm.grad_a(dc, b, layout)),
                    P.events_ms(lambda: gemm.grad_b(dc, a, layout)))
            if layout == "nk":
                cublas = (P.events_ms(lambda: dc @ b), P.events_ms(lambda: dc.T @ a))
                refs = (dc.double() @ b.double(), dc.double().T @ a.double())
            else:
                cublas = (P.events_ms(lambda: dc @ b.T), P.events_ms(lambda: a.T @ dc))
                refs = (dc.double() @ b.double().T, a.double().T @ dc.double())
            err = max(P.rel_err(gemm.grad_a(dc, b, layout), refs[0]),
                      P.rel_err(gemm.grad_b(dc, a, layout), refs[1]))
            print(f"{M}x{N}x{K} {layout} err {err:.1e} | dA tk {flop / ours[0] / 1e9:.0f} "
                  f"cuBLAS {flop / cublas[0] / 1e9:.0f} | dB tk {flop / ours[1] / 1e9:.0f} "
                  f"cuBLAS {flop / cublas[1] / 1e9:.0f} TFLOP/s", flush=True)


def _peak_gib(f) -> float:
    f()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    f()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def cross_entropy() -> None:
    from tk_mlir.kernels import cross_entropy as tk_ce
    compiled = torch.compile(lambda x, t: F.cross_entropy(x, t))
    for n, v in ((8192, 128256), (4096, 32000)):
        x = torch.randn(n, v, device="cuda").bfloat16().requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda")
        gb = n * v * 2 / 1e9
        rows = []
        for name, fn in (("tk", tk_ce), ("torch", F.cross_entropy), ("compile", compiled)):
            def step(fn=fn):
                torch.autograd.grad(fn(x, t), (x,))
            fwd = P.events_ms(lambda fn=fn: fn(x.detach(), t), 10)
            rows.append(f"{name}: fwd {fwd * 1e3:.0f} us ({gb / fwd * 1e3:.0f} GB/s) fwd+bwd "
                        f"{P.events_ms(step, 10) * 1e3:.0f} us peak +{_peak_gib(step):.2f} GiB")
        err = P.rel_err(tk_ce(x.detach(), t), F.cross_entropy(x.detach().double(), t))
        print(f"{n}x{v} loss rel err {err:.1e} | " + " | ".join(rows), flush=True)


def linear_cross_entropy() -> None:
    from tk_mlir.kernels import linear_cross_entropy as tk_lce
    n, d, v = 8192, 4096, 128256
    h = (torch.randn(n, d, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device="cuda") * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    err = P.rel_err(tk_lce(h.detach(), w.detach(), t),
               F.cross_entropy((h @ w.T).detach().double(), t))
    for name, loss in (("tk", lambda: tk_lce(h, w, t)),
                       ("tk low_memory", lambda: tk_lce(h, w, t, low_memory=True)),
                       ("torch", lambda: F.cross_entropy(h @ w.T, t))):
        def step(loss=loss):
            torch.autograd.grad(loss(), (h, w))
        print(f"{name}: fwd+bwd {P.events_ms(step, 3):.1f} ms, peak +{_peak_gib(step):.2f} GiB "
              f"(loss rel err {err:.1e})", flush=True)


SECTIONS = {"norms": norms, "matmul": matmul, "cross_entropy": cross_entropy,
            "linear_cross_entropy": linear_cross_entropy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma list of sections: {', '.join(SECTIONS)}")
    for name in ap.parse_args().only.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r}; they are {', '.join(SECTIONS)}")
        SECTIONS[name]()


if __name__ == "__main__":
    main()
