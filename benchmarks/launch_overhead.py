"""Host time per launch of a tiny kernel, over >= 10,000 launches in rounds of 200.

Measures, in one process: a cached tk_mlir kernel called as `kernel[grid](...)`
(argument checks included) and through `kernel.launcher(grid)` (bound once), a
bare cuda-python cuLaunchKernel of the same cubin, a torch eager op, and a tiny
Triton kernel when Triton is importable.
The GPU work is negligible (one block), so the wall time per launch is host
time: what a small kernel costs to call from Python.

    python benchmarks/launch_overhead.py [--launches 20000] [--out-dir benchmarks/results]
    python benchmarks/launch_overhead.py --plan-only     # no GPU: the plan's own host time

`--plan-only` profiles the generated launch plan on the CPU with the driver
call stubbed (a launch function that does nothing) and CPU tensors (their
checks, which a CPU tensor would fail, are taken as passed): what the plan
costs before it reaches cuLaunchKernel.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protocol import (host_us_per_call, markdown_table, require_cuda, run_meta,  # noqa: E402
                      write_results)

import tk_mlir as tk  # noqa: E402
from tk_mlir import f32  # noqa: E402


@tk.kernel(num_warps=1)
def tiny(X: tk.gl[f32], Y: tk.gl[f32], s: float):
    tk.store(Y, tk.load(X, (0, 0), (1, 32)) * s, (0, 0))


def plan_only(launches: int) -> list[dict]:
    """Host µs of tiny's launch plan and of `tiny[grid](...)` with the driver stubbed."""
    from tk_mlir import launcher
    x, y = torch.rand(4, 32), torch.rand(4, 32)
    values, warps = tiny.params.bind((x, y, 2.0), {})
    sig = tiny.params.key(values, warps, lambda v, name: tk.spec(tuple(v.shape), "f32"))
    reads, compiled = tiny._entry(sig)
    rules = tiny.params.tensor_rules(sig)
    plan = launcher.torch_plan(tiny.params, values, 3, {}, rules, compiled,
                               lambda *a: None, lambda: 0, 0, reads)
    plan.__globals__["full_check"] = lambda all_values: True    # CPU tensors: taken as checked
    tiny._plans.insert(0, plan)
    timed = lambda fn: min(_host_us(fn, launches) for _ in range(3))   # noqa: E731
    bound = tiny.launcher((1,))
    return [{"impl": "launch plan (driver stubbed)", "us": timed(lambda: plan((1,), (x, y, 2.0), {}))},
            {"impl": "tiny[(1,)](x, y, 2.0) (driver stubbed)",
             "us": timed(lambda: tiny[(1,)](x, y, 2.0))},
            {"impl": "tiny.launcher((1,))(x, y, 2.0) (driver stubbed)",
             "us": timed(lambda: bound(x, y, 2.0))},
            {"impl": "an empty Python call", "us": timed(lambda: None)}]


def _host_us(fn, n: int) -> float:
    for _ in range(1000):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=20000)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--plan-only", action="store_true",
                    help="no GPU: time the launch plan with the driver call stubbed")
    args = ap.parse_args(argv)
    if args.plan_only:
        print(markdown_table(plan_only(args.launches), [("impl", "call"), ("us", "host µs")]))
        return 0
    require_cuda()
    x = torch.rand(4, 32, device="cuda") + 0.5
    y = torch.full_like(x, float("nan"))
    tiny[(1,)](x, y, 2.0)
    torch.cuda.synchronize()
    assert torch.allclose(y[0], x[0] * 2.0), "tiny kernel is wrong"

    from cuda.bindings import driver as cu
    from tk_mlir.runtime import driver
    compiled = tiny.compile(x, y, 2.0)
    fn = compiled.function()
    params = [(x.data_ptr(), ctypes.c_void_p), (4, ctypes.c_int32), (32, ctypes.c_int32),
              (32, ctypes.c_int64), (y.data_ptr(), ctypes.c_void_p), (4, ctypes.c_int32),
              (32, ctypes.c_int32), (32, ctypes.c_int64), (2.0, ctypes.c_float)]
    kinds = [p.kind for p in compiled.params]
    assert len(kinds) == len(params), (kinds, "update the raw launch's parameter list")
    vals, types = tuple(v for v, _ in params), tuple(t for _, t in params)
    stream = driver.current_stream()

    def raw():
        cu.cuLaunchKernel(fn.handle, 1, 1, 1, 32, 1, 1, 0, stream, (vals, types), 0)

    bound = tiny.launcher((1,))
    rows = [
        {"impl": "tk_mlir kernel[grid](x, y, 2.0)", "us": host_us_per_call(
            lambda: tiny[(1,)](x, y, 2.0), args.launches)},
        {"impl": "tk_mlir kernel.launcher(grid)(x, y, 2.0)", "us": host_us_per_call(
            lambda: bound(x, y, 2.0), args.launches)},
        {"impl": "cuda-python cuLaunchKernel (bare)", "us": host_us_per_call(raw, args.launches)},
        {"impl": "torch eager y.copy_(x)", "us": host_us_per_call(lambda: y.copy_(x), args.launches)},
    ]
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def triton_tiny(X, Y, s, BLOCK: tl.constexpr):
            o = tl.arange(0, BLOCK)
            tl.store(Y + o, tl.load(X + o) * s)
        rows.append({"impl": "triton kernel[grid](x, y, 2.0)", "us": host_us_per_call(
            lambda: triton_tiny[(1,)](x, y, 2.0, BLOCK=32), args.launches)})
    except ImportError:
        pass
    table = markdown_table(rows, [("impl", "launch"), ("us", "host µs / launch")])
    print(table)
    write_results("launch_overhead", rows, run_meta() | {"launches": args.launches},
                  out_dir=args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
