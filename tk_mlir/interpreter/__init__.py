"""The CPU interpreter: run a tk kernel with numpy, no GPU, CUDA or ptxas.

    kernel.interpret[grid](x, y, ROWS=4)     # numpy arrays or CPU torch tensors
    TK_MLIR_INTERPRET=1 python script.py     # kernel[grid](...) interprets too (read at
                                             # the process's first launch)

It runs the kernel's tk IR after the tk passes (the GPU path's frontend,
inlining, unrolling, constant folding, layouts, verification and shared
memory placement), compiled once per specialization into a closure per op
(program.py; one interpret rule per op name: rules.py, hopper.py, scalars.py),
with one coroutine per warp over 32-lane numpy scalars (machine.py). Tile
ops work on whole tiles (numpy arrays) and rendezvous their scope's warps.
Blocks run one after another (one waiting for another's flag steps aside:
machine.run_blocks); the warps of a block interleave in a seeded
random order (interpreter.SEED) at every tile op, semaphore or barrier wait
and asynchronous issue, so producer/consumer kernels make progress.
Outputs are written in place. Arguments are checked by the GPU launch's
rules, device aside (arguments.py: what runs here launches on a GPU, and
what the GPU refuses is refused here with its message). Persistent kernels'
wrappers size their grid by interpreter.SMS simulated SMs on CPU tensors.

What it models: ids, gl_dim, global loads/stores/atomic adds of register
tiles and vectors (edge masking, `fill`), one-element loads (0 outside),
tk.store_partial (a tile's parts counted as on the GPU; its counters'
size, zero start and part count checked), the value ops (maps, reductions,
broadcasts, slices, masks, cvt), the block barrier, scf.for / scf.if (lanes
under an active mask when the condition differs between them), the arith
ops the frontend emits; and the Hopper machinery (hopper.py, semaphores.py,
shared.py):
- shared tiles and vectors (one array per allocation, NaN until written),
  tk.index / subtile / column_block views, loads and stores between shared
  memory and registers, tk.copy;
- semaphores exactly: phase count, pending arrivals, transaction bytes
  (expect / arrive / wait, a load's bytes may land before the expect);
- TMA loads land after a seeded random delay and complete their bytes on
  their semaphore; TMA stores and reduce-adds read their source until the
  issuing thread's store_wait covers their commit group;
- wgmma (AB, ABt, AtB, AtBt; shared or register A; f32 accumulation): the
  result is pending, and its shared operands are read, until tk.mma_wait;
- named barriers (bar.sync / bar.arrive counted in warps), elect_leader (a
  random active lane; a warpgroup's: of its first warp), setmaxnreg (no-op).
Ops issued by every active lane are issued once per lane, as on the GPU.
Flags: tk.signal adds or stores (u32, wrapping), tk.fence is a no-op (the
interpreter's memory is sequentially consistent), and a block at a
tk.wait_signal whose flag is not up steps aside for the next block
(machine.run_blocks) until it is; every block waiting is a deadlock at the
first one's wait. Peer tensors (tk.pgl): `kernel.interpret_ranks[grid]([
rank0_args, ...])` runs one launch per rank at once, their blocks paired in
order (block b of each rank, then b + 1), each rank's copies arrays that all
ranks' PeerTensor.from_tensors share. Clusters (use_cluster, cluster_rank/sync,
remote arrivals, multicast) are refused at their line.

What it reports, each an InterpretError at the user's line (a tk_mlir
helper's ops carry the user's call, frontend.py): a tile op reached under
lane divergence or by part of its scope; a deadlock (every warp blocked,
nothing in flight: each waiter with its line, the semaphore by allocation
line and index, the parity and the phase/arrival/byte state, or the named
barrier's arrivals); a transaction-byte mismatch (the expect and load
lines); an arrival overflow; a phase wrap-around (a wait that takes a phase
two or more past the last one this warp waited for there); a named barrier
reached with different warp counts, or an id outside 1-15; a wgmma result
used before each warp's mma_wait; a read of a tile a TMA load is writing or
whose load was not waited for; a write to a tile an in-flight wgmma or TMA
store reads; a thread write read by the async proxy with no proxy fence (a
compiler bug); a warp exiting with TMA stores outstanding or its
warpgroup's MMAs not waited for; a block ending with a TMA load whose
semaphore phase no warp waited for; a read of global memory that another
block wrote, a second block's write over it, or a write over what another
block read, with nothing ordering the two (ordering.py: per-block clocks
through tk.signal / tk.wait_signal, so across ranks too, and a wait for a
count the flag held before the launch orders nothing; an output element has
one writer unless a signal orders the next); out-of-range
array and subtile indices; data races by happens-before (races.py: vector clocks
through semaphores, barriers and mma/store waits; shadow state per shared
tile row and column block), found whatever the schedule.

Numerics contract:
- storage and conversions round exactly as the GPU does: every float tile
  holds values of its dtype, rounded to nearest even after each op (bf16 and
  fp8 through torch's CPU casts, f16 through numpy's);
- arithmetic is f32 (bf16/f16 tile arithmetic computes in f32 and rounds, one
  rounding like the GPU's native bf16/f16 ops except for rare double-rounding
  ties); reductions accumulate in f32 in numpy's (pairwise) order, not the
  GPU's shuffle order;
- wgmma multiplies the operands' exact (bf16/f16) values and accumulates
  in f32 (numpy's matmul order, not the tensor core's);
- transcendentals (exp, exp2, log, sqrt, rsqrt) and rcp / div are numpy's
  correctly rounded f32 functions where the GPU uses ex2/lg2/rsqrt/rcp.approx
  (relative error ~2^-22) and div.full (2 ulp), and no flush-to-zero, no fma
  contraction: results agree with the GPU's to about 1e-6 relative in f32
  (one bf16 ulp, 2^-8, where a value sits at a bf16 rounding boundary).
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
