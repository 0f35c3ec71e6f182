r"""tk-lint: the ThunderKittens 2.0 pitfalls that show without running, as
warnings (tk.TkLintWarning) at the user's line.

A kernel that trips one still compiles: each rule is a fact about the code
that is almost always a bug (or idle hardware), not a proof. Each rule is
one function below, saying why; `lint` runs them all after tk-verify and
tk-allocate-smem (the cluster rule reads the kernel's shared memory). The
message starts with `file:line:col: warning: [rule]`; silence a rule with
`warnings.filterwarnings("ignore", r".*\[rule\]", tk.TkLintWarning)` (all of
them without the message pattern).

Not linted: redundant fences. The tk dialect has no fence a user writes —
tk-proxy-fences (passes/fences.py) inserts exactly those the memory model
asks for — so there is none a user could make redundant.
"""
from __future__ import annotations

from mlir import ir

from ..dialects import contracts, tk, types as T
from ..errors import warn_at
from .. import target
from .uniform import Uniformity

# Least registers per thread a warpgroup can keep after setmaxnreg.dec (PTX ISA).
MIN_SETMAXNREG = 24


def _tk_ops(func) -> list[ir.Operation]:
    ops: list = []
    func.operation.walk(lambda op: (ops.append(op.operation) if tk.op_def(op) else None)
                        or ir.WalkResult.ADVANCE)
    return ops


def _enclosing(op):
    """(if or loop, the values that decide whether and how often its body
    runs: the condition, the bounds) for each around `op`, innermost first."""
    parent = op.parent
    while parent is not None and parent.name != "func.func":
        if parent.name == "scf.if":
            yield parent, [parent.operands[0]]
        elif parent.name == "scf.for":
            yield parent, list(parent.operands)[:3]
        parent = parent.parent


def _conditions(op) -> list[ir.Value]:
    """The values that decide whether `op` runs: the conditions of the ifs and
    the bounds of the loops around it."""
    return [c for _, controls in _enclosing(op) for c in controls]


def _semaphore_arrivals(sem: ir.Value) -> int | None:
    root = tk.shared_root(sem)
    if isinstance(root, ir.OpResult) and tk.op_def(root.owner) and tk.op_def(root.owner).semaphore:
        return root.owner.opview.arrivals
    return None


def single_thread_ops(func, ops, num_warps: int) -> None:
    """A TMA copy, a tcgen05.mma or an mbarrier arrival (ops with the
    `one_thread` trait) that every lane of a warp runs: nothing around it
    depends on the lane (an elect_leader(), a lane or thread id). Each thread
    that runs it issues it, so a warp issues it 32 times: a TMA load moves
    its bytes 32 times over (and completes 32x the bytes expected on its
    semaphore), a TMA store writes the tile 32 times, an MMA adds its
    product 32 times, expect_bytes expects 32x the bytes (the phase never
    completes), and a warp's 32 arrivals overrun a semaphore that expects
    fewer per phase. (Arrivals on a semaphore that expects 32 or more per
    phase may be meant for every thread: not flagged.)"""
    lanes = Uniformity(func, trait="lane_varying")
    for op in ops:
        d = tk.op_def(op)
        if not d.one_thread or any(lanes.varies(c) for c in _conditions(op)):
            continue
        name = tk.spelled(d)
        if tk.tma_operands(op) is not None:
            why = "each of a warp's threads issues its own copy: 32 copies of the tile per warp"
        elif d.tensor_memory == "async":       # a tcgen05.mma
            why = ("each of a warp's threads issues its own MMA: the product is added 32 "
                   "times per warp")
        elif "bytes" in d.attributes:          # an arrival that also expects TMA bytes
            name += " (or tk.tma.expect, which issues it)"
            why = ("each of a warp's 32 threads arrives and expects the bytes: the semaphore "
                   "waits for 32x the bytes the TMA delivers (and 32 arrivals)")
        else:                                  # an arrival (here or in another block)
            arrivals = _semaphore_arrivals(op.operands[0])
            if arrivals is None or arrivals >= 32:
                continue
            why = (f"each of a warp's 32 threads arrives, but the semaphore expects "
                   f"{arrivals} arrival(s) per phase: its phases complete early")
        warn_at(op.location, "elect", f"{name} runs on every thread of the warp: {why}; "
                f"issue it from one thread: `if tk.elect_leader():` (or "
                f"tk.elect_leader(\"warpgroup\"))")


def register_split(func, ops, num_warps: int) -> None:
    """setmaxnreg (tk.increase_registers / decrease_registers) acts on a whole
    warpgroup, and only moves registers between the block's warpgroups:
    - in a kernel whose warps do not make whole warpgroups, a warpgroup is
      missing warps that never run it: undefined (the warpgroup hangs);
    - an increase to more than the block can ever free for it — the registers
      it starts with (tk.registers_per_thread()) times its warpgroups, less
      what the others keep (at least the smallest decrease in the kernel, or
      all they start with if none decreases) — waits forever."""
    regs = [op for op in ops if tk.op_def(op).setmaxnreg]
    if not regs:
        return
    if num_warps % 4:
        warn_at(regs[0].location, "setmaxnreg", f"setmaxnreg acts on whole warpgroups (4 warps), "
                f"but the kernel has num_warps={num_warps}: its last warpgroup lacks warps, "
                f"and setmaxnreg needs every warp of the warpgroup to run it (the warpgroup "
                f"hangs); use a multiple of 4 warps")
        return
    groups, start = num_warps // 4, target.current().launch_registers(32 * num_warps)
    decreases = [op.opview.count for op in regs if op.opview.action == "dec"]
    others_keep = min(decreases, default=start)
    most = groups * start - (groups - 1) * others_keep
    for op in regs:
        count = op.opview.count
        if op.opview.action == "inc" and count > most:
            kept = (f"the other {groups - 1} keep at least {others_keep} (the smallest "
                    f"decrease)" if decreases else
                    f"the other {groups - 1} never decrease from {start}")
            warn_at(op.location, "setmaxnreg", f"tk.increase_registers({count}) can never be "
                    f"met: the block starts with {start} registers per thread in each of its "
                    f"{groups} warpgroups and {kept}, so one warpgroup gets at most {most}; "
                    f"setmaxnreg.inc waits until registers are free, here forever")
        elif op.opview.action == "inc" and groups > 1:
            dec = _decrease_beside(op)
            if dec is not None and (groups - 1) * count + dec > groups * start:
                warn_at(op.location, "setmaxnreg", f"tk.increase_registers({count}) in the "
                        f"branch beside tk.decrease_registers({dec}): with one warpgroup "
                        f"decreasing and the other {groups - 1} increasing, "
                        f"{groups - 1} x {count} + {dec} registers per thread exceed the "
                        f"block's {groups} x {start} = {groups * start}; setmaxnreg.inc "
                        f"waits until registers are free, here forever (tk.register_split "
                        f"checks a split before it is made)")


def _decrease_beside(op) -> int | None:
    """The count of a tk.decrease_registers in the then-branch of an
    `if tk.warpgroup_id() == c` whose else-branch holds `op` (an increase):
    the producer/consumer split, one warpgroup decreasing and every other
    increasing; None for any other shape."""
    child, parent = op, op.parent
    while parent is not None and parent.name != "scf.if":
        child, parent = parent, parent.parent
    if parent is None or not _one_warpgroup(parent.operands[0]):
        return None
    then, orelse = parent.regions
    if not _holds(orelse, child):
        return None
    found = []

    def decrease(x):
        d = tk.op_def(x)
        if d is not None and d.setmaxnreg and x.opview.action == "dec":
            found.append(x.opview.count)
        return ir.WalkResult.ADVANCE
    for block in then.blocks:
        for o in block.operations:
            o.operation.walk(decrease)
    return min(found) if found else None


def _one_warpgroup(condition) -> bool:
    """Whether `condition` compares a warpgroup's index for equality (true in
    one warpgroup): an op whose result differs between a block's threads but
    not within a warpgroup (tk.warpgroup_id), == a value."""
    owner = condition.owner
    if not hasattr(owner, "name") or owner.name != "arith.cmpi" or \
            str(owner.attributes["predicate"]) != "0 : i64":
        return False
    defs = [tk.op_def(v.owner) if hasattr(v.owner, "name") else None for v in owner.operands]
    return any(d is not None and d.thread_varying and not d.warpgroup_varying for d in defs)


def _holds(region, op) -> bool:
    return any(o.operation == op for block in region.blocks for o in block.operations)


def cluster_occupancy(func, ops, num_warps: int) -> None:
    """A cluster's blocks run at once on SMs of one GPC. When a block needs a
    whole SM (more than half its shared memory, or setmaxnreg, which makes
    ptxas size it for one block per SM), a GPC holds only as many clusters as
    whole groups of its SMs, and GPCs have SM counts that are not a multiple
    of 4 or 8: those SMs stay idle in a persistent grid (ThunderKittens 2.0's
    figures for B200 are in BENCHMARKS.md). Cluster size 2 loses none of them."""
    cluster = next((op for op in ops if tk.op_def(op).cluster), None)
    if cluster is None or cluster.opview.size <= 2:
        return
    smem = contracts.SMEM_BYTES.get(func, 0)
    reallocates = any(tk.op_def(op).setmaxnreg for op in ops)
    if smem <= target.current().max_shared_bytes // 2 and not reallocates:
        return
    size = cluster.opview.size
    why = (f"{smem} bytes of shared memory" if smem > target.current().max_shared_bytes // 2
           else "setmaxnreg (one block per SM)")
    warn_at(cluster.location, "cluster", f"clusters of {size} blocks that each need a whole SM "
            f"({why}) must fit whole in one GPC, whose SM count is in general not a multiple "
            f"of {size}: some SMs can take no cluster and stay idle (a persistent grid of "
            f"compiled.persistent_grid() blocks is smaller than the SM count); cluster size "
            f"2 keeps every SM busy")


def named_barrier_counts(func, ops, num_warps: int) -> None:
    """bar.sync / bar.arrive on one barrier id with two thread counts cannot
    both be right: a phase of the barrier completes after one count of
    threads, so the warps that counted on the other are released early (a
    race) or never (a hang). (Ids computed at
    run time are not checked. The templates, tk.lcf and tk.ring, use no
    named barrier, so every id 1-15 is the kernel's own.)"""
    first: dict[int, ir.Operation] = {}
    for op in ops:
        d = tk.op_def(op)
        if d.named_barrier is None:
            continue
        bar_id = tk.constant_int(getattr(op.opview, d.named_barrier))
        if bar_id is None:
            continue
        seen = first.setdefault(bar_id, op)
        if seen.opview.warps != op.opview.warps:
            warn_at(op.location, "named-barrier", f"named barrier {bar_id} is used here with "
                    f"warps={op.opview.warps} but with warps={seen.opview.warps} at "
                    f"{_short(str(seen.location))}: a phase of the barrier completes after one "
                    f"count of threads, so the warps that counted on the other are released "
                    f"early (a race) or wait forever (a hang); use another id")


_PREDICATES = ("eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule", "ugt", "uge")  # arith.cmpi's
_BELOW = {"slt": 0, "ult": 0, "sge": 0, "uge": 0, "sle": 1, "ule": 1, "sgt": 1, "ugt": 1}
_FLIPPED = {"slt": "sgt", "sgt": "slt", "sle": "sge", "sge": "sle", "ult": "ugt",
            "ugt": "ult", "ule": "uge", "uge": "ule", "eq": "eq", "ne": "ne"}


def _id_run(v) -> int | None:
    """For v a thread index (an op with the `thread_run` trait: the thread,
    warp or warpgroup id; a lane id restarts every warp and has none) or one
    divided by positive constants: how many consecutive threads share each of
    its values (each run starting at a multiple of it); else None."""
    if not isinstance(v, ir.OpResult):
        return None
    op = v.owner
    d = tk.op_def(op)
    if d is not None and d.thread_run:
        return d.thread_run
    if op.name in ("arith.floordivsi", "arith.divsi", "arith.divui", "arith.shrui",
                   "arith.shrsi"):
        c = tk.constant_int(op.operands[1])
        run = _id_run(op.operands[0])
        if run is not None and c is not None and c > 0:
            return run * (2 ** c if op.name.startswith("arith.sh") else c)
    return None


def _uniform_over(v, threads: int) -> bool:
    """Whether v is shown the same in each aligned group of `threads`
    consecutive threads, by arithmetic the traits do not see: an id divided
    down (its runs whole groups), or an id compared with a constant whose
    boundary falls between groups (`tk.thread_id() // 32 == 1` over a warp,
    `tk.warp_id() >= 4` over a warpgroup, `tk.thread_id() < 128` over a
    4-warp block)."""
    run = _id_run(v)
    if run is not None:
        return run % threads == 0
    if not isinstance(v, ir.OpResult) or v.owner.name != "arith.cmpi":
        return False
    op = v.owner
    pred = _PREDICATES[ir.IntegerAttr(op.attributes["predicate"]).value]
    x, k = op.operands
    if _id_run(x) is None:
        x, k, pred = k, x, _FLIPPED.get(pred, "")
    run, c = _id_run(x), tk.constant_int(k)
    if run is None or c is None or pred not in _FLIPPED:
        return False
    if pred in ("eq", "ne"):                    # true on one run
        return run % threads == 0
    return run * (c + _BELOW[pred]) % threads == 0      # the one boundary between runs


def _varying_region(op, uniform: Uniformity, threads: int):
    """The innermost if or for around op whose condition or bounds `uniform`
    finds varying and _uniform_over does not clear for groups of `threads`,
    or None."""
    return next((region for region, controls in _enclosing(op)
                 if any(uniform.varies(c) and not _uniform_over(c, threads) for c in controls)),
                None)


def partial_tiles(func, ops, num_warps: int) -> None:
    """A tile op under an if or for whose condition may differ between the
    threads of the op's scope (a block-scope tile under `if
    tk.warpgroup_id() == 0`, a warp's under `if tk.lane_id() < 16`): each
    thread holds a part of the tile, so the threads that skip the op leave
    their part undone — a partial load, store or result on the GPU, which
    the interpreter reports at run time. The analysis goes by the traits of
    the ids a condition depends on, cleared by _uniform_over where an id is
    divided down or compared across whole groups (`tk.thread_id() // 32 == 1`
    around a warp's tile); other arithmetic that makes a condition uniform
    still warns: a warning, not an error. A warpgroup's tiles in a kernel of
    several warpgroups are checked against lane-dependent conditions only
    (in `if warp == 0: ... elif warp >= 4: <warpgroup tiles>` the else of the
    first if splits warpgroup 0, though the second selects warpgroup 1: path
    conditions, not modelled)."""
    uniformity: dict = {}
    warned: set = set()               # the ifs and loops warned of (once each: its first op)
    for op in ops:
        scope = tk.tile_scope(op)
        if scope is None:
            continue
        warps = T.scope_warps(scope, num_warps)
        trait = "lane_varying" if warps == 1 or (scope == "warpgroup" and num_warps > 4) else \
            "warpgroup_varying" if warps <= 4 else "thread_varying"
        if trait not in uniformity:
            uniformity[trait] = Uniformity(func, trait=trait)
        region = _varying_region(op, uniformity[trait], 32 * warps)
        if region is not None and region not in warned:
            warned.add(region)
            warn_at(op.location, "partial-tile", f"this {scope}-scope tile op sits under an if "
                    f"or for whose condition may differ between the threads of its {scope} "
                    f"(it depends on the lane, warp or thread id): each thread holds a part of "
                    f"the tile, and those that skip it leave their part undone; move it out of "
                    f"that if/for, or give its tiles a scope the condition is uniform over "
                    f"(scope=\"warp\" or \"warpgroup\")")


def varying_operands(func, ops, num_warps: int) -> None:
    """A tile op whose scalar operand (a coordinate of tk.load or tk.store, a
    scalar it applies) may differ between the threads of the op's scope (it
    depends on the lane, warp or thread id): each thread uses its own value
    for its part of the tile, so a tile load takes each thread's part from
    its own row, not one tile (the interpreter stops there). A value made
    uniform over the scope by arithmetic the traits do not see through
    (_uniform_over: an id divided down, compared across whole groups) is
    cleared, and so is what is made only of cleared or uniform values (a
    loop's counter, a carried value, an if's result); other arithmetic that
    makes a value uniform still warns."""
    uniformity: dict = {}
    for op in ops:
        scope = tk.tile_scope(op)
        if scope is None:
            continue
        warps = T.scope_warps(scope, num_warps)
        trait = "lane_varying" if warps == 1 else \
            "warpgroup_varying" if warps <= 4 else "thread_varying"
        if (trait, warps) not in uniformity:
            uniformity[trait, warps] = Uniformity(
                func, trait=trait, cleared=lambda v, threads=32 * warps: _uniform_over(v, threads))
        for i, v in enumerate(op.operands):
            if T.parse(v.type) is not None:       # a tile, tensor or semaphore: no scalar
                continue
            if uniformity[trait, warps].varies(v):
                warn_at(op.location, "varying-operand", f"operand {i} of this {scope}-scope "
                        f"tile op may differ between the threads of its {scope} (it depends "
                        f"on the lane, warp or thread id): each thread would use its own "
                        f"value for its part of the tile (a load would take each part from "
                        f"its own row); a tile's coordinates and scalars must be one value "
                        f"over its scope (compute them from tk.block_id, loop counters or "
                        f"loaded scalars, or give the tile a scope they are uniform over)")
                break


def _short(loc: str) -> str:
    import re
    m = re.search(r'loc\("([^"]+)":(\d+):(\d+)', loc)
    return f"{m.group(1)}:{m.group(2)}:{m.group(3)}" if m else "another op"


RULES = (single_thread_ops, register_split, cluster_occupancy, named_barrier_counts,
         partial_tiles, varying_operands)


def lint(module: ir.Module) -> None:
    """The tk-lint pass: warnings only, the module unchanged."""
    for func in module.body.operations:
        num_warps = contracts.NUM_WARPS.get(func)
        ops = _tk_ops(func)
        for rule in RULES:
            rule(func, ops, num_warps)
