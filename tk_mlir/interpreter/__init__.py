"""The CPU interpreter: run a tk kernel with numpy, no GPU, CUDA or ptxas.

    kernel.interpret[grid](x, y, ROWS=4)          # numpy arrays or CPU tensors
    kernel.interpret_ranks[grid]([args0, args1])  # a tk.pgl kernel's ranks at once
    TK_MLIR_INTERPRET=1 python script.py          # kernel[grid](...) interprets too
                                                  # (read at the first launch)

It runs the kernel's tk IR after the GPU path's tk passes, one closure per op
(program.py; each op's rule in rules.py, hopper.py, blackwell.py, scalars.py), one
coroutine per warp over 32-lane numpy values (machine.py); tile ops work on
whole tiles and rendezvous their scope's warps. The warps of a block
interleave in a random order seeded by SEED (also the TMA delays and elected
lanes); blocks run one after another, a block waiting for another's flag
stepping aside (machine.run_blocks). Outputs are written in place.
Every op is modelled: shared memory (NaN until written), TMA, semaphores
(phase, arrivals, transaction bytes, exactly), wgmma (pending until
tk.mma_wait), named barriers, elect, atomics, tk.store_partial, signals and
peer tensors, clusters (a cluster's blocks are made together and act on
each other's semaphores and shared memory; each keeps its own clocks, so
across blocks only what is still in flight is checked, and a block waiting
for another may step aside before its own copies land), Blackwell's tensor
memory and tcgen05
(blackwell.py). An op that every active lane issues is issued once per
lane, as on the GPU.

Invariants:
- what runs here launches on a GPU: arguments are checked by the GPU
  launch's rules, device aside, with the GPU's messages (arguments.py);
- every finding is an InterpretError at the user's line (a tk_mlir helper's
  ops at the user's call);
- memory is sequentially consistent (tk.fence is a no-op), but blocks'
  global writes and reads are ordered only by tk.signal / tk.wait_signal
  (adds accumulate in any order);
- races are found by happens-before (races.py, ordering.py) whatever the
  schedule; a deadlock or a wrong value may show under one SEED only.

What it reports: a tile op under lane divergence or reached by part of its
scope; a deadlock (every warp blocked, nothing in flight: each waiter with
its line and the semaphore's or barrier's state); a transaction-byte
mismatch (or a load no expect armed), an arrival overflow, a warp arriving
twice in one phase of a semaphore that waits for several (a stage released
twice), a phase wrap-around; named barriers reached
with different warp counts or an id outside 1-15; a wgmma result used before
its mma_wait; a tile read while a TMA load writes it, or written while a
wgmma or TMA store reads it; a thread write read by the async proxy with no
proxy fence (a compiler bug); a warp or block ending with TMA stores, MMAs
or a TMA load's phase not waited for; global memory one block writes and
another block (or rank) reads or writes with no tk.signal / tk.wait_signal
ordering the two; out-of-range indices; data races in shared memory.

Numerics contract:
- storage rounds as the GPU does: every float tile holds values of its
  dtype, rounded to nearest even after each op (bf16 and fp8 through
  torch's CPU casts, f16 through numpy's);
- arithmetic is f32 (16-bit tile arithmetic computes in f32 and rounds);
  reductions and wgmma accumulate in f32 in numpy's order, not the GPU's;
- exp, exp2, log, sqrt, rsqrt, rcp and div are numpy's correctly rounded
  f32 functions where the GPU approximates (~2^-22 relative, div 2 ulp), with
  no flush-to-zero or fma contraction: results agree with the GPU's to about
  1e-6 relative in f32 (one bf16 ulp where a value sits on a bf16 rounding
  boundary);
- 16-bit tiles: where the GPU contracts a multiply and an add into one fma
  (fp_contract, the default: `x * s + b` is one fma.rn.bf16), the
  interpreter rounds the product to the tile's dtype first, so such results
  differ by one ulp of that dtype (bf16: 2^-8 relative) on many elements
  (fp_contract=False agrees); a Python float scalar on a 16-bit tile is
  rounded to the tile's dtype first, on the GPU as here (1.01 is 1.0078125 in
  bf16).
"""
from __future__ import annotations

from ..errors import ArgumentError
from .machine import InterpretError

__all__ = ["InterpretError", "launch", "launch_ranks", "SEED", "SMS"]

# Picks the interleaving of warps, the TMA delays and the elected lanes (a
# run is reproducible); set it to try other schedules. Races are found by
# happens-before whatever the schedule; a deadlock or a wrong value may show
# under one schedule and not another.
SEED = 0
# The SMs a persistent kernel's wrapper sizes its grid by on CPU tensors
# (tk_mlir/kernels/device.py): few, so that blocks loop over several tasks.
SMS = 3


def launch(kernel, grid, args: tuple, kwargs: dict) -> None:
    """Interpret `kernel` on `grid` with these arguments (as kernel[grid](...))."""
    program, g, runtime = _prepare(kernel, grid, args, kwargs)
    program.run(g, runtime, SEED)


def launch_ranks(kernel, grid, ranks: list, kwargs: dict) -> None:
    """Interpret one launch of `kernel` per rank, all at once (their blocks
    step aside for each other at tk.wait_signal, machine.run_blocks):
    `ranks` holds each rank's positional arguments, its tk.pgl ones
    tk.PeerTensor.from_tensors of arrays every rank shares; `kwargs` are
    every rank's."""
    import itertools

    import numpy as np
    from . import machine, rules
    if not isinstance(ranks, (list, tuple)) or not ranks or \
            not all(isinstance(r, (list, tuple)) for r in ranks):
        raise ArgumentError("interpret_ranks takes a list of each rank's positional "
                            "arguments (tuples), one per rank")
    _check_group(kernel, [kernel.params.bind(tuple(args), kwargs)[0] for args in ranks])
    wrappers: dict = {}          # one GlobalArray per array, whichever rank reaches it
    launches = [_prepare(kernel, grid, tuple(args), kwargs, wrappers) for args in ranks]
    runners = [program.block_runners(g, runtime, SEED, rank)
               for rank, (program, g, runtime) in enumerate(launches)]
    with np.errstate(all="ignore"):
        # block b of every rank, then block b + 1: ranks' blocks pair up in order
        machine.run_blocks(r for group in itertools.zip_longest(*runners) for r in group
                           if r is not None)
    for _, _, runtime in launches:
        rules.leftover_parts(runtime)


def _check_group(kernel, values: list) -> None:
    """Each rank's arguments (bound `values`, in rank order) hold, for each
    tk.pgl parameter, a PeerTensor of as many ranks as there are launches,
    of its own rank, over the copies every rank's shares: else the launches
    would not be one group's (a rank run twice, or copies no other rank
    writes) and the run would mean nothing."""
    from ..runtime.peers import PeerTensor
    from .arguments import memory_key
    for i, p in enumerate(kernel.params):
        if p.kind != "pgl":
            continue
        group = [v[i] for v in values]
        if not all(isinstance(t, PeerTensor) for t in group):
            continue                 # (the argument checks say what is wrong)
        for r, t in enumerate(group):
            if t.world_size != len(group) or t.rank != r:
                raise ArgumentError(
                    f"interpret_ranks: argument {p.name!r} of launch {r} is rank {t.rank} of "
                    f"a {t.world_size}-rank PeerTensor; launch r takes rank r's, one launch "
                    f"per rank ({len(group)} launches given)")
            if any(memory_key(a) != memory_key(b) for a, b in zip(t.peers, group[0].peers)):
                raise ArgumentError(
                    f"interpret_ranks: argument {p.name!r} of rank {r} holds other copies than "
                    f"rank 0's: every rank's PeerTensor groups the same arrays "
                    f"(tk.PeerTensor.from_tensors(copies, r) of one list)")


def _prepare(kernel, grid, args: tuple, kwargs: dict, wrappers: dict | None = None):
    """(the Program, the grid, the runtime arguments as the kernel takes
    them), the arguments checked as the GPU launch checks them (arguments.py)."""
    from ..launcher import normalize_grid
    from .arguments import check_arguments, launch_arguments
    values, num_warps = kernel.params.bind(args, kwargs)
    arrays, sig, infos = check_arguments(kernel.params, values, num_warps, wrappers)
    program = kernel.interpreted(sig)
    runtime = launch_arguments(kernel.params, values, arrays, infos, program.tma_args)
    g = normalize_grid(grid, dict(zip(kernel.params.names, values)))
    return program, g, runtime
