"""Sliding-window attention: does tk_mlir's forward take time in proportion to
the window, not to N? tk_mlir `attention(..., causal=True, window=(W, 0))`
against the same kernel without a window, and FlashAttention-4's
`window_size=(W, 0)` when its wheel imports (../shared/gpu/README.md).

On the GPU machine, from the repository root:
    python3 benchmarks/sliding_window.py --out-dir "$OUT"
    python3 benchmarks/sliding_window.py --window 4096 --n 8192,16384,32768 --b 1 --h 16

bf16 (B, H, N, D) inputs, D=128; µs per call (CUDA events, input groups
cycled past the L2, the protocol's warm-up); TFLOP/s counts the (query, key)
pairs the window lets through. Each output is checked first against float32
attention on the last 256 query rows of head 0 (the rows whose window is
whole).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
import protocol as P  # noqa: E402

from tk_mlir.benchmarking import bench  # noqa: E402

TOL = 1e-2


def pairs(n: int, window: int) -> int:
    """(query, key) pairs of causal attention with keys [i - window, i]."""
    return sum(min(i, window) + 1 for i in range(n))


def impls(window: int):
    from tk_mlir.kernels import attention
    out = {"tk_mlir window": lambda q, k, v: attention(q, k, v, causal=True,
                                                        window=(window, 0)),
           "tk_mlir full causal": lambda q, k, v: attention(q, k, v, causal=True)}
    try:
        from flash_attn.cute.interface import flash_attn_func
        out["fa4 window"] = lambda q, k, v: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
            window_size=(window, 0))[0].transpose(1, 2)
    except Exception as e:                                          # noqa: BLE001
        print(f"fa4 not importable ({P.first_line(e)}): its rows are left out", flush=True)
    return out


def check(fn, q, k, v, window: int, full: bool) -> float:
    """Rel. error of head 0's last 256 rows against float32."""
    n, d = q.shape[2], q.shape[3]
    rows = torch.arange(n - 256, n, device=q.device)
    s = q[0, 0, -256:].float() @ k[0, 0].float().T / math.sqrt(d)
    key = torch.arange(n, device=q.device)[None]
    hidden = key > rows[:, None]
    if not full:
        hidden |= key < rows[:, None] - window
    ref = torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ v[0, 0].float()
    got = fn(q, k, v)[0, 0, -256:].float()
    return ((got - ref).norm() / ref.norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--n", default="8192,16384,32768")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    P.require_cuda("benchmarks/sliding_window.py")
    rows = []
    for n in (int(x) for x in args.n.split(",")):
        b, h, d, w = args.b, args.h, 128, args.window
        def inputs(gen, b=b, h=h, n=n):
            return tuple((torch.rand(b, h, n, d, device="cuda", generator=gen) * 2 - 1)
                         .bfloat16() for _ in range(3))
        q, k, v = inputs(torch.Generator(device="cuda").manual_seed(0))
        for name, fn in impls(w).items():
            full = "full" in name
            row = {"N": n, "window": w, "impl": name}
            try:
                row["rel_err"] = check(fn, q, k, v, w, full)
                t = bench(fn, inputs=inputs, flops=4 * b * h * d * pairs(n, n if full else w))
                row.update(us=t.ms * 1e3, tflops=t.tflops,
                           status="ok" if row["rel_err"] < TOL else "WRONG")
            except Exception as e:                                  # noqa: BLE001
                row["status"] = f"failed: {P.first_line(e)}"
            rows.append(row)
            print(row, flush=True)
    cols = ["N", "window", "impl", ("us", "µs"), ("tflops", "TFLOP/s"), ("rel_err", "rel err"),
            "status"]
    print("\n" + P.markdown_table(rows, cols) + "\n")
    P.write_results("sliding-window", rows, vars(args), args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
