"""The CPU interpreter: run a tk kernel with numpy, no GPU, CUDA or ptxas.

    kernel.interpret[grid](x, y, ROWS=4)     # numpy arrays or CPU torch tensors
    TK_MLIR_INTERPRET=1 python script.py     # kernel[grid](...) interprets too (read at
                                             # the process's first launch)

It runs the kernel's tk IR after the tk passes (the GPU path's frontend,
inlining, unrolling, constant folding, layouts and verification), compiled
once per specialization into a closure per op (program.py), with one
coroutine per warp over 32-lane numpy scalars and tile ops at tile
granularity, rendezvous of their scope's warps (machine.py). Blocks run one
after another. Outputs are written in place.

What it models today: thread/warp/block ids, gl_dim, loads and stores
between global arrays and register tiles/vectors (edge masking, `fill`),
fill, cvt, the elementwise maps, reductions, broadcasts, slices, masks
(tile_index, cmp, where, logical ops), the block barrier, scf.for / scf.if
(lanes under an active mask when the condition differs between them) and
the arith ops the frontend emits. Shared tiles, TMA, semaphores, MMA, named
barriers, clusters, atomics and register reallocation are refused at their
line (issue 10 goes on with them: asynchronous agents, race detection).

Numerics contract:
- storage and conversions round exactly as the GPU does: every float tile
  holds values of its dtype, rounded to nearest even after each op (bf16 and
  fp8 through torch's CPU casts, f16 through numpy's);
- arithmetic is f32 (bf16/f16 tile arithmetic computes in f32 and rounds, one
  rounding like the GPU's native bf16/f16 ops except for rare double-rounding
  ties); reductions accumulate in f32 in numpy's (pairwise) order, not the
  GPU's shuffle order;
- transcendentals (exp, exp2, log, sqrt, rsqrt) and rcp / div are numpy's
  correctly rounded f32 functions where the GPU uses ex2/lg2/rsqrt/rcp.approx
  (relative error ~2^-22) and div.full (2 ulp), and no flush-to-zero, no fma
  contraction: results agree with the GPU's to about 1e-6 relative in f32
  (one bf16 ulp, 2^-8, where a value sits at a bf16 rounding boundary).
"""
from __future__ import annotations

from ..errors import ArgumentError
from .machine import InterpretError

__all__ = ["InterpretError", "launch", "SEED"]

# Picks the interleaving of warps, the TMA delays and the elected lanes (a
# run is reproducible); set it to try other schedules. Races are found by
# happens-before whatever the schedule; a deadlock or a wrong value may show
# under one schedule and not another.
SEED = 0


def launch(kernel, grid, args: tuple, kwargs: dict) -> None:
    """Interpret `kernel` on `grid` with these arguments (as kernel[grid](...))."""
    import numpy as np
    from ..launcher import normalize_grid
    from .arguments import check_arguments
    values, num_warps = kernel.params.bind(args, kwargs)
    arrays, sig = check_arguments(kernel.params, values, num_warps)
    program = kernel.interpreted(sig)
    g = normalize_grid(grid, dict(zip(kernel.params.names, values)))
    runtime = []
    for i in kernel.params.runtime:
        kind = kernel.params[i].kind
        runtime.append(arrays[i] if i in arrays else
                       (np.int32 if kind == "i32" else np.float32)(_scalar(values[i], kind,
                                                                           kernel.params[i])))
    program.run(g, runtime, SEED)


def _scalar(v, kind: str, param):
    if kind == "i32" and not -2**31 <= v < 2**31:
        raise ArgumentError(f"argument {param.name!r} = {v} does not fit in an i32")
    return v
