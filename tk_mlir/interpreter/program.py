"""A kernel's tk IR after the tk passes, compiled once into Python closures.

`build_module` runs the same frontend and tk passes as the GPU path
(compiler.py and lowering/pipeline.py's TK_PASSES: layouts assigned, tiles
verified, shared memory placed) and stops there. `Program` turns each op of
the kernel into a step: a per-warp closure (scalars, scf.for / scf.if), or a
tile op that the warps of its scope rendezvous on (machine.py). An op the
interpreter does not model is refused here, at its line.
"""
from __future__ import annotations

import numpy as np

from ..dialects import tk, types as T
from . import machine, ops, scalars  # noqa: F401  (scalars registers the arith ops)
from .machine import Arrival, error, uniform

PLAIN, TILE, REGION = 0, 1, 2


def build_module(spec, fn_node, globals_: dict):
    """(context, module): `spec`'s kernel after the tk passes (the GPU path's
    frontend, then its tk passes; no lowering)."""
    from ..compiler import frontend_module
    from ..lowering.pipeline import TK_PASSES
    context, module = frontend_module(spec, fn_node, globals_)
    with context:
        for _, run_pass in TK_PASSES:
            run_pass(module)
    return context, module


def _scope(op, num_warps: int) -> str | None:
    """The scope whose warps run `op` together: its tiles' scope, the block's
    for a block barrier; None for an op each warp runs alone."""
    for v in (*op.results, *op.operands):
        t = T.parse(v.type)
        if isinstance(t, (T.RT, T.RV)):
            return t.scope
    d = tk.op_def(op)
    return "block" if d is not None and d.has_barrier(op, num_warps) else None


def _line(op) -> str:
    e = machine.error(op.location, "")
    return f"line {e.line}" if e.line else "an unknown line"


class TileStep:
    """A tile op: run once per scope instance, when all its warps are here."""
    kind = TILE

    def __init__(self, op, scope: str, ins, outs, fn):
        self.name, self.loc, self.scope = op.name, op.location, scope
        self.ins, self.outs, self.fn = ins, outs, fn
        self.where = _line(op)
        self.kinds = ["tile" if isinstance(T.parse(v.type), (T.RT, T.RV, T.GL)) else "scalar"
                      for v in op.operands]

    def describe(self) -> str:
        return f"{self.name} ({self.where})"

    def execute(self, block, arrivals: list[Arrival]):
        values = []
        for k, kind in enumerate(self.kinds):
            got = [a.operands[k] for a in arrivals]
            if kind == "scalar":
                got = [uniform(g, self.loc, f"{self.name}: operand {k}") for g in got]
            if any(g is not got[0] and not (kind == "scalar" and g == got[0]) for g in got):
                raise error(self.loc, f"{self.name}: operand {k} differs between the warps of "
                                      f"its {self.scope}; the interpreter does not model "
                                      f"warp-varying operands of tile ops yet")
            values.append(got[0])
        return self.fn(block, *values)


class PlainStep:
    kind = PLAIN

    def __init__(self, ins, outs, fn):
        ins, out = tuple(ins), (outs[0] if outs else None)
        def run(w):
            v = fn(w, *(w.values[i] for i in ins))
            if out is not None:
                w.values[out] = v
        self.run = run


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
        else:
            yield from s.run(w)


class Program:
    """One specialization, ready to run blocks."""

    def __init__(self, context, module):
        self.context, self.module = context, module     # (the closures refer to its ops)
        func = module.body.operations[0]
        from ..dialects import contracts
        self.num_warps = contracts.NUM_WARPS.get(func)
        self.name = func.attributes["sym_name"].value
        self.slots: dict = {}
        with context:
            entry = func.regions[0].blocks[0]
            self.arg_slots = [self.slot(a) for a in entry.arguments]
            self.body, _ = self.compile_block(entry)

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
        factory = ops.INTERPRETERS.get(op.name)
        fn = factory(op.opview, self.num_warps) if factory is not None else None
        if fn is None:
            raise error(op.location, f"the interpreter does not model {op.name} (with these "
                                     f"operand types) yet: it runs register tiles and vectors "
                                     f"with global loads and stores; shared tiles, TMA, "
                                     f"semaphores, MMA, named barriers and clusters are not "
                                     f"modeled yet (issue 10); run this kernel on a GPU")
        ins = [self.slot(v) for v in op.operands]
        outs = [self.slot(v) for v in op.results]
        scope = _scope(op, self.num_warps)
        if scope is None:
            return PlainStep(ins, outs, fn)
        return TileStep(op, scope, ins, outs, fn)

    def compile_for(self, op):
        lb, ub, step, *inits = [self.slot(v) for v in op.operands]
        body = op.regions[0].blocks[0]
        iv, *carried = [self.slot(a) for a in body.arguments]
        iv_type = scalars.holder(body.arguments[0].type)
        steps, yielded = self.compile_block(body)
        results, loc = [self.slot(r) for r in op.results], op.location

        def run(w):
            bounds = [uniform(_active(w, w.values[s]), loc, "a bound of this loop")
                      for s in (lb, ub, step)]
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
        loc = op.location

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

    def run(self, grid: tuple[int, int, int], args: list) -> None:
        """Run every block of `grid`, one after another; `args`: per kernel
        argument a memory.GlobalArray or a numpy scalar."""
        def init(w):
            for s, a in zip(self.arg_slots, args):
                w.values[s] = a
        body = lambda w: run_steps(self.body, w)   # noqa: E731
        with np.errstate(all="ignore"):   # i32 wraps; inf and NaN are values, as on the GPU
            for z in range(grid[2]):
                for y in range(grid[1]):
                    for x in range(grid[0]):
                        block = machine.Block((x, y, z), grid, self.num_warps)
                        machine.run_block(body, block, len(self.slots), init)


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
