"""A kernel's tk IR after the tk passes, compiled once into Python closures.

`build_module` runs the same frontend and tk passes as the GPU path
(compiler.py and lowering/pipeline.py's TK_PASSES: layouts assigned, tiles
verified, shared memory placed) and stops there. `Program` turns each op of
the kernel into a step: a per-warp closure (scalars, scf.for / scf.if), or a
tile op that the warps of its scope rendezvous on (machine.py). An op the
interpreter does not model is refused here, at its line.

A Program is plain data: its steps and closures hold what the rules read of
each op (`Op`: locations as machine.Loc, attribute values, type text), no
MLIR object, so the module and its context are freed once it is built
(a kernel keeps a Program per specialization).
"""
from __future__ import annotations

import numpy as np
from mlir import ir

from ..dialects import contracts, tk, types as T
from ..lowering.tma import tensor_arguments
from ..target import current as current_target
from . import blackwell, hopper, machine, rules, scalars  # noqa: F401  (they register ops)
from .machine import Arrival, Loc, error, uniform
from .races import BY_BARRIER
from .shared import Allocation, whole

PLAIN, TILE, REGION, SYNC = 0, 1, 2, 3


def build_module(spec, fn_node, globals_: dict):
    """(context, module): `spec`'s kernel after the tk passes and checks (the
    GPU path's frontend, its tk passes, and tk-lint's warnings, which point at
    what the interpreter cannot show, such as a TMA copy every lane issues;
    no lowering)."""
    from ..compiler import frontend_module
    from ..lowering.pipeline import TK_CHECKS, TK_PASSES
    context, module = frontend_module(spec, fn_node, globals_)
    with context:
        for _, run_pass in TK_PASSES + TK_CHECKS:
            run_pass(module)
    return context, module


# The most SMs a GPU of the target has (H100 SXM and H200: 132), for the
# most blocks of a launch that can run at once.
MOST_SMS = 132


def _resident_blocks(num_warps: int, smem_bytes: int) -> tuple[int, str]:
    """(n, why): at most n blocks of a kernel of `num_warps` warps and
    `smem_bytes` of shared memory run at once on any GPU of the target, by
    its per-SM limits on blocks, threads and shared memory (registers, which
    only ptxas knows, can only make it fewer)."""
    t = current_target()
    per_sm = min(t.max_blocks_per_sm, t.max_threads_per_sm // (32 * num_warps))
    why = f"{per_sm} block(s) of {32 * num_warps} threads per SM"
    if smem_bytes:
        by_smem = t.shared_bytes_per_sm // (smem_bytes + t.shared_reserved_bytes)
        if by_smem < per_sm:
            per_sm, why = by_smem, f"{by_smem} block(s) with {smem_bytes} bytes of shared " \
                                   f"memory per SM"
    return per_sm * MOST_SMS, f"{why}, {MOST_SMS} SMs"


def _scope(op, num_warps: int) -> str | None:
    """The scope whose warps run `op` together: its tiles' scope, the block's
    for a block barrier; None for an op each warp runs alone."""
    scope = tk.tile_scope(op)
    if scope is not None:
        return scope
    d = tk.op_def(op)
    return "block" if d is not None and d.has_barrier(op, num_warps) else None


class Op:
    """An op as an interpret rule reads it while building its closure: plain
    data copied from the MLIR op, so that no closure keeps the module alive.

    `name` ("tk.load"), `loc` (a machine.Loc), `at` ("file:line"),
    `attributes` (each attribute's Python value: a number, string or bool, a
    dense array as a tuple, anything else as its text), `operand_types` and
    `result_types` (MLIR type text, which types.parse and scalars.holder
    read). An attribute also reads as a field (`op.dim`), and a tk op's
    operand or result type by its name (`op.type("src")`).
    """
    __slots__ = ("name", "loc", "at", "attributes", "operand_types", "result_types", "_names")

    def __init__(self, op):
        self.name = op.name
        self.loc = Loc.of(op.location)
        self.at = self.loc.where
        self.attributes = {name: _plain(a) for name, a in op.attributes.items()}
        self.operand_types = tuple(str(v.type) for v in op.operands)
        self.result_types = tuple(str(v.type) for v in op.results)
        d = tk.op_def(op)
        self._names = {} if d is None else {
            **{n: ("operand", i) for i, n in enumerate(d.operands)},
            **{n: ("result", i) for i, n in enumerate(d.results)}}

    def __getattr__(self, name: str):
        if name in Op.__slots__ or name.startswith("__"):
            raise AttributeError(name)          # (not set yet, or a protocol probe)
        try:
            return self.attributes[name]
        except KeyError:
            raise AttributeError(f"{self.name} has no attribute {name!r}") from None

    @property
    def result_type(self) -> str:
        return self.result_types[0]

    def type(self, name: str) -> str:
        """The type of the tk op's operand or result `name` (its OpDef's)."""
        kind, i = self._names[name]
        return (self.operand_types if kind == "operand" else self.result_types)[i]

    def hint(self, contract: contracts.Contract, default):
        """A contract attribute (dialects/contracts.py) of the op, or `default`."""
        return self.attributes.get(contract.name, default)


def _plain(attr: ir.Attribute):
    """An attribute's value as plain Python data (Op.attributes)."""
    value = tk.attribute_value(attr)
    if not isinstance(value, ir.Attribute):
        return value
    if isinstance(attr, ir.DenseI32ArrayAttr):
        return tuple(attr)
    return str(attr)


class Scope:
    """What a tile op's closure sees of the scope instance running it: the
    block, its warps (machine.Warp), the op's location and "file:line"."""

    def __init__(self, block, warps, loc, where_):
        self.block, self.warps, self.loc, self.where = block, warps, loc, where_


class TileStep:
    """A tile op: run once per scope instance, when all its warps are here."""
    kind = TILE

    def __init__(self, op: Op, scope: str, ins, outs, fn, barrier: bool = False):
        self.name, self.loc, self.scope = op.name, op.loc, scope
        self.ins, self.outs, self.fn = ins, outs, fn
        self.where = f"line {op.loc.line}" if op.loc.line else "an unknown line"
        self.at = op.at
        self.kinds = [_kind(t) for t in op.operand_types]
        self.barrier = barrier
        self.chains = op.name == "tk.mma"       # its accumulator may still be in flight

    def describe(self) -> str:
        return f"{self.name} ({self.where})"

    def execute(self, block, arrivals: list[Arrival]):
        values = []
        warps = [a.warp for a in arrivals]
        for k, kind in enumerate(self.kinds):
            got = [a.operands[k] for a in arrivals]
            if kind == "scalar":
                got = [uniform(g, self.loc, f"{self.name}: operand {k}",
                               f"a tile op's coordinates and scalars are one value over its "
                               f"{self.scope} (each thread holds a part of the tile; tk-lint's "
                               f"[varying-operand])") for g in got]
            if any(g is not got[0] and not (kind != "tile" and _same_number(g, got[0]))
                   for g in got):
                raise error(self.loc, f"{self.name}: operand {k} differs between the warps of "
                                      f"its {self.scope}; the interpreter does not model "
                                      f"warp-varying operands of tile ops yet")
            v = got[0]
            if isinstance(v, Pending) and not (self.chains and k == 0):
                v = v.result(warps, self)
            values.append(v)
        if not self.barrier:
            return self.fn(Scope(block, warps, self.loc, self.at), *values)
        # Its lowering syncs the block (before and after what it does to shared
        # memory, or after a copy): a join of the warps' clocks on both sides.
        _join(block, warps)
        out = self.fn(Scope(block, warps, self.loc, self.at), *values)
        _join(block, warps)
        return out


def _join(block, warps) -> None:
    """A barrier among warps: each ends up after what all of them did."""
    index = [w.index for w in warps]
    joined = block.clocks[index].max(0)
    for i in index:
        block.acquire(i, joined, BY_BARRIER)
    block.clocks[index, index] += 1


def _kind(t) -> str:
    """How a tile op's operand is compared between its warps: tiles and
    global arrays by identity, shared refs by value, scalars as numbers."""
    t = T.parse(t)
    if isinstance(t, (T.RT, T.RV, T.GL)):
        return "tile"
    return "ref" if isinstance(t, (T.ST, T.SV, T.Sem)) else "scalar"


class Pending:
    """A wgmma result still being written by its warpgroup's group `group`:
    usable as the accumulator of the next wgmma (chained in order), readable
    once each warp holding it has waited for the group (tk.mma_wait)."""

    def __init__(self, value, group: int, where_: str):
        self.value, self.group, self.where = value, group, where_

    def result(self, warps, step):
        late = [w.index for w in warps if w.mma_done < self.group]
        if late:
            raise error(step.loc, f"{step.name} uses the result of the wgmma issued at "
                                  f"{self.where} before its tk.mma_wait: warp(s) {late} have "
                                  f"not waited for it (its accumulator is still being "
                                  f"written; call tk.mma_wait(n) with at most n groups "
                                  f"issued after it first)")
        return self.value


class PlainStep:
    kind = PLAIN

    def __init__(self, ins, outs, fn):
        ins, out = tuple(ins), (outs[0] if outs else None)
        def run(w):
            v = fn(w, *(w.values[i] for i in ins))
            if out is not None:
                w.values[out] = v
        self.run = run


class SyncStep:
    """A per-warp op that may wait or let other warps run first (semaphores,
    TMA, named barriers): its closure is a generator over the warp."""
    kind = SYNC

    def __init__(self, ins, outs, fn):
        self.ins, self.out, self.fn = tuple(ins), (outs[0] if outs else None), fn


class RegionStep:
    """scf.for / scf.if: runs its regions in the warp (`run` is a generator)."""
    kind = REGION

    def __init__(self, run):
        self.run = run


def run_steps(steps, w):
    """Run a block's steps in warp w; yields an Arrival at each tile op."""
    for s in steps:
        if s.kind == PLAIN:
            s.run(w)
        elif s.kind == TILE:
            if w.mask is not None:
                lanes = np.flatnonzero(w.mask).tolist()
                raise error(s.loc, f"{s.name} is a {s.scope}-scope tile op, reached by warp "
                                   f"{w.index} with only lanes {lanes} active (under an if "
                                   f"whose condition differs between its lanes): every thread "
                                   f"of its {s.scope} must run it")
            out = yield Arrival(s, [w.values[i] for i in s.ins])
            if s.outs:
                w.values[s.outs[0]] = out
        elif s.kind == SYNC:
            out = yield from s.fn(w, *(w.values[i] for i in s.ins))
            if s.out is not None:
                w.values[s.out] = out
        else:
            yield from s.run(w)


class Program:
    """One specialization, ready to run blocks: plain data (module docstring).

    `Program(context, module)` compiles the kernel of `module` (after the tk
    passes) and keeps nothing of either."""

    def __init__(self, context, module):
        func = module.body.operations[0]
        self.num_warps = contracts.NUM_WARPS.get(func)
        self.name = func.attributes["sym_name"].value
        with context:
            c = _Compiler(self.num_warps)
            entry = func.regions[0].blocks[0]
            self.arg_slots = [c.slot(a) for a in entry.arguments]
            self.body, _ = c.compile_block(entry)
        self.num_slots = len(c.slots)      # SSA values: each warp's registers
        self.num_sems = c.num_sems         # semaphore elements: each a TMA agent clock slot
        self.tma_args = frozenset(c.tma_args)   # arguments TMA ops reach (tensor maps')
        self.cluster = c.cluster           # blocks per cluster (tk.use_cluster), 1 without
        self.resident = _resident_blocks(self.num_warps, contracts.SMEM_BYTES.get(func, 0))

    def run(self, grid: tuple[int, int, int], args: list, seed: int = 0) -> None:
        """Run every block of `grid` (one after another, unless one waits for
        another: machine.run_blocks); `args`: per kernel argument a
        memory.GlobalArray or a numpy scalar; `seed` picks the interleaving
        of warps, TMA delays and elected lanes."""
        with np.errstate(all="ignore"):   # i32 wraps; inf and NaN are values, as on the GPU
            machine.run_blocks(self.block_runners(grid, args, seed), self.resident)
        rules.leftover_parts(args)

    def block_runners(self, grid: tuple[int, int, int], args: list, seed: int = 0,
                      rank: int | None = None):
        """A runner (machine.block_runner) per block of `grid`, made as needed
        (`rank`: the launch's, when several ranks' run at once)."""
        def init(w):
            for s, a in zip(self.arg_slots, args):
                w.values[s] = a
        body = lambda w: run_steps(self.body, w)   # noqa: E731
        size = self.cluster
        if grid[0] % size:
            raise machine.InterpretError(f"{self.name} runs in clusters of {size} blocks along x "
                                 f"(tk.use_cluster), but the grid is {grid}: its x must be a "
                                 f"multiple of {size}")
        for z in range(grid[2]):
            for y in range(grid[1]):
                for x in range(0, grid[0], size):
                    # A cluster's blocks are made together: one may arrive on (or
                    # write into) another's shared memory before that one starts.
                    blocks = [machine.Block((x + r, y, z), grid, self.num_warps, self.num_sems,
                                            seed, rank) for r in range(size)]
                    if size > 1:
                        machine.Cluster(blocks)
                    for block in blocks:
                        yield machine.block_runner(body, block, self.num_slots, init)


class _Compiler:
    """The MLIR side of building a Program: a value's slot by the MLIR value
    (`slots`), each op's closure from its rule given the op's `Op`. Dropped
    once the Program is built, with every MLIR object it read."""

    def __init__(self, num_warps: int):
        self.num_warps = num_warps
        self.slots: dict = {}
        self.num_sems = 0
        self.sem_allocs_at: dict[str, int] = {}     # "file:line" -> semaphore allocations there
        self.tma_args: set[int] = set()
        self.cluster = 1
        self.exchanges_seen: set[int] = set()     # exchange groups whose barrier is placed

    def slot(self, value) -> int:
        return self.slots.setdefault(value, len(self.slots))

    def compile_block(self, block):
        """(steps, slots of the values its terminator yields)."""
        steps, yielded = [], []
        for op in block.operations:
            name = op.name
            if name in ("scf.yield", "func.return"):
                yielded = [self.slot(v) for v in op.operands]
            elif name == "scf.for":
                steps.append(self.compile_for(op))
            elif name == "scf.if":
                steps.append(self.compile_if(op))
            else:
                steps.append(self.compile_op(op))
        return steps, yielded

    def compile_op(self, op):
        d = tk.op_def(op)
        if d is not None and d.allocates:
            return self.compile_alloc(op, d)
        if d is not None and d.cluster:
            self.cluster = op.opview.size
        if d is not None and d.tma is not None:
            tensor, _ = tk.tma_operands(op)
            self.tma_args.update(a.arg_number for a in tensor_arguments(tensor))
        info = Op(op)
        factory = rules.INTERPRETERS.get(op.name)
        fn = factory(info, self.num_warps) if factory is not None else None
        if fn is None:
            raise error(info.loc, f"the interpreter does not model {op.name} (with these "
                                  f"operand types) yet; run this kernel on a GPU")
        ins = [self.slot(v) for v in op.operands]
        outs = [self.slot(v) for v in op.results]
        scope = _scope(op, self.num_warps)
        if op.name in rules.SYNC:
            return SyncStep(ins, outs, fn)
        if scope is None:
            return PlainStep(ins, outs, fn)
        return TileStep(info, scope, ins, outs, fn,
                        barrier=d is not None and d.has_barrier(op, self.num_warps)
                        and self._first_of_exchange(op))

    def _first_of_exchange(self, op) -> bool:
        """False for a reduction that joins an earlier one's exchange group
        (tk-allocate-smem): on the GPU the group's one barrier is at its first
        reduction, so a later member orders nothing at its own line."""
        if not contracts.EXCHANGE_GROUP.has(op):
            return True
        group = contracts.EXCHANGE_GROUP.get(op)
        first = group not in self.exchanges_seen
        self.exchanges_seen.add(group)
        return first

    def compile_alloc(self, op, d):
        """tk.alloc_st / alloc_sv / alloc_sem: an Allocation (its block's memory
        and semaphores are made at first use); alloc_sem's block barrier (the
        semaphores are initialised, then published) is a block-scope step."""
        info = Op(op)
        t = T.parse(info.result_type)
        count = tk.array_count(op)
        nth = self.sem_allocs_at.get(info.at, 0) if d.semaphore else 0
        alloc = Allocation(len(self.slots), t, count or 1, count is not None, info.at,
                           agent=self.num_warps + self.num_sems,
                           arrivals=info.arrivals if d.semaphore else 0, nth=nth)
        if d.semaphore:
            self.num_sems += count or 1
            self.sem_allocs_at[info.at] = nth + 1
        contracts.OFFSET.get(op)            # placed by tk-allocate-smem (checked)
        value = whole(alloc)
        out = [self.slot(op.results[0])]
        if d.tensor_memory == "alloc":      # allocated when run (blackwell.py)
            allocate = rules.INTERPRETERS[op.name](info, self.num_warps)
            return TileStep(info, "block", [], out, lambda scope: allocate(scope, alloc),
                            barrier=True)
        if d.has_barrier(op, self.num_warps):
            return TileStep(info, "block", [], out, lambda scope: value, barrier=True)
        return PlainStep([], out, lambda w: value)

    def compile_for(self, op):
        lb, ub, step, *inits = [self.slot(v) for v in op.operands]
        body = op.regions[0].blocks[0]
        iv, *carried = [self.slot(a) for a in body.arguments]
        iv_type = scalars.holder(str(body.arguments[0].type))
        steps, yielded = self.compile_block(body)
        results, loc = [self.slot(r) for r in op.results], Loc.of(op.location)

        def run(w):
            bounds = [uniform(_active(w, w.values[s]), loc, "a bound of this loop")
                      for s in (lb, ub, step)]
            # (a compile-time step <= 0 never reaches scf.for) Refused where the GPU's
            # loop and Python's range differ: a zero step, or a negative one that
            # Python runs (start above stop) or the GPU's would (start below it).
            if bounds[2] == 0 or bounds[2] < 0 and bounds[0] != bounds[1]:
                endless = bounds[0] < bounds[1]
                raise error(loc, f"the range's step is {bounds[2]} at run time: a step known "
                                 f"only at run time must be positive (on the GPU this loop "
                                 f"would {'never end' if endless else 'run no iterations'}); "
                                 f"for a loop that counts down, make the step a compile-time "
                                 f"constant (tk.constexpr), or loop over range(n) and compute "
                                 f"the index")
            values = [w.values[s] for s in inits]
            for i in range(*bounds):
                w.values[iv] = iv_type(i)
                for s, v in zip(carried, values):
                    w.values[s] = v
                yield from run_steps(steps, w)
                values = [w.values[s] for s in yielded]
            for s, v in zip(results, values):
                w.values[s] = v
        return RegionStep(run)

    def compile_if(self, op):
        cond = self.slot(op.operands[0])
        then = self.compile_block(op.regions[0].blocks[0])
        other = self.compile_block(op.regions[1].blocks[0]) if len(op.regions[1].blocks) \
            else ([], [])
        results = [self.slot(r) for r in op.results]
        tiles = [isinstance(T.parse(r.type), (T.RT, T.RV)) for r in op.results]
        loc = Loc.of(op.location)

        def branch(w, steps_yielded):
            steps, yielded = steps_yielded
            yield from run_steps(steps, w)
            return [w.values[s] for s in yielded]

        def run(w):
            c = np.asarray(w.values[cond])
            active = np.ones(machine.LANES, bool) if w.mask is None else w.mask
            taken, skipped = (active & c, active & ~c) if c.ndim else (None, None)
            if c.ndim == 0 or not skipped.any() or not taken.any():
                go = bool(c) if c.ndim == 0 else bool(taken.any())
                values = yield from branch(w, then if go else other)
            else:       # lanes disagree: both branches, each under its lanes
                saved = w.mask
                w.mask = taken
                a = yield from branch(w, then)
                w.mask = skipped
                b = yield from branch(w, other)
                w.mask = saved
                values = [_merge(x, y, c, tile, loc) for x, y, tile in zip(a, b, tiles)]
            for s, v in zip(results, values):
                w.values[s] = v
        return RegionStep(run)


def _active(w, value):
    """A per-thread value's lanes that are active in warp w."""
    return value if w.mask is None or not np.ndim(value) else np.asarray(value)[w.mask]


def _merge(a, b, cond, tile: bool, loc):
    """The value of an if's result in a warp whose lanes took both branches."""
    if tile:
        if a is not b:
            raise error(loc, "this if picks a register tile by a condition that differs "
                             "between the lanes of a warp; the interpreter does not model "
                             "per-lane tiles (make the condition warp-uniform)")
        return a
    return np.where(cond, a, b)


def _same_number(a, b) -> bool:
    """Whether two warps' scalar operands are one value: NaN is NaN (a NaN
    every warp holds is uniform, though NaN != NaN)."""
    return a == b or (a != a and b != b)
