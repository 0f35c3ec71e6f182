"""Host time of a GEMM called from Python: tk_mlir.kernels' `matmul(a, b, c)`
against `torch.mm(a, b.T, out=c)` (cuBLAS), in one process.

Calls are timed in rounds of 200 between device syncs (protocol.host_us_per_call),
so the launch queue never fills and the time per call is the host's even
where a GEMM's GPU time is longer (tk_mlir's persistent GEMM takes ~15 µs of
GPU time at 256^3): what the Python entry point costs. Also measured: the tuned
kernel launched directly with its chosen config (`gemm_kernel.kernel[grid]`,
no autotune dispatch) to show what the dispatch adds, and a bare cuda-python
cuLaunchKernel of the same cubin as the floor.

    python benchmarks/host_time.py [--size 256] [--calls 20000] [--out-dir benchmarks/results]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from protocol import (host_us_per_call, markdown_table, require_cuda, run_meta,  # noqa: E402
                      write_results)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    require_cuda()
    from tk_mlir.kernels import matmul
    from tk_mlir.kernels.device import num_sms
    from tk_mlir.kernels.gemm import gemm_kernel
    n = args.size
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.empty(n, n, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1, generator=g)
    b = torch.empty(n, n, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1, generator=g)
    c = torch.full((n, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    matmul(a, b, c)
    ref = a.float() @ b.float().T
    err = ((c.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"matmul is wrong: relative error {err}"

    config = gemm_kernel.best_config(a, b, c)
    grid = (num_sms(a.get_device()),)
    direct = gemm_kernel.kernel[grid]
    kw = config.all_kwargs()
    compiled = gemm_kernel.kernel.compile(a, b, c, **kw)
    rows = [
        {"impl": "tk_mlir matmul(a, b, c)", "us": host_us_per_call(lambda: matmul(a, b, c), args.calls)},
        {"impl": "torch.mm(a, b.T, out=c)", "us": host_us_per_call(
            lambda: torch.mm(a, b.T, out=c), args.calls)},
        {"impl": "tk_mlir gemm_kernel[grid](a, b, c) (autotuned dispatch)", "us": host_us_per_call(
            lambda: gemm_kernel[grid](a, b, c), args.calls)},
        {"impl": f"tk_mlir gemm_kernel.kernel[grid](a, b, c, **{kw}) (no dispatch)",
         "us": host_us_per_call(lambda: direct(a, b, c, **kw), args.calls)},
    ]
    print(f"{n}^3 bf16, {compiled.name}, relative error {err:.1e}")
    print(markdown_table(rows, [("impl", "call"), ("us", "host µs / call")]))
    write_results("host_time", rows, run_meta() | {"size": n, "calls": args.calls,
                                                   "config": repr(config)},
                  out_dir=args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
