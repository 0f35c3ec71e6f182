"""Which values may differ between the threads of one block.

A value varies by thread when it depends on an op with the `thread_varying`
trait (thread, lane, warp, warpgroup id; elect) — through its operands, and
through control flow: a loop-carried value through its init, what the body
yields and the loop's bounds; the result of an if or a loop through what its
branches yield and the condition or bounds that pick the path.

tk-verify uses it to refuse a block barrier some threads would skip;
tk-proxy-fences to know that the two branches of an if may both run, in
different threads of the block, at the same time. With `trait="lane_varying"`
it finds the values that may differ between the lanes of one warp: tk-lint
uses that to tell an op every lane issues from one under tk.elect_leader().
"""
from __future__ import annotations

from mlir import ir

from ..dialects import tk


def _yielded(region_op, index: int) -> list[ir.Value]:
    """The values the regions of region_op yield at result position index."""
    out = []
    for region in region_op.regions:
        for block in region.blocks:
            ops = block.operations
            terminator = ops[len(ops) - 1]
            if terminator.name == "scf.yield" and index < len(terminator.operands):
                out.append(terminator.operands[index])
    return out


def _control(region_op) -> list[ir.Value]:
    """The operands that decide how region_op runs: an if's condition, a loop's bounds."""
    if region_op.name == "scf.if":
        return [region_op.operands[0]]
    if region_op.name == "scf.for":
        return list(region_op.operands)[:3]
    return list(region_op.operands)


class Uniformity:
    """The values of one function that may differ between a block's threads:
    propagated forward over its ops until nothing changes (a loop-carried
    value can become varying through what its loop yields)."""

    def __init__(self, func, trait: str = "thread_varying", cleared=None):
        """cleared(v): whether v is known uniform whatever it is made from
        (arithmetic the traits do not see through, e.g. an id divided down
        to whole groups); such a value never varies, nor what only it
        makes vary."""
        self.trait = trait
        self.varying: set = set()
        ops: list = []
        func.operation.walk(lambda op: ops.append(op.operation) or ir.WalkResult.ADVANCE)
        known: dict = {}
        changed = True
        while changed:
            changed = False
            for op in ops:
                for v, sources in self._edges(op):
                    if v not in self.varying and (sources is True or
                                                  any(s in self.varying for s in sources)):
                        if cleared is not None:
                            if v not in known:
                                known[v] = cleared(v)
                            if known[v]:
                                continue
                        self.varying.add(v)
                        changed = True

    def varies(self, v: ir.Value) -> bool:
        return v in self.varying

    def _edges(self, op):
        """(value, what it depends on, or True for a thread-varying origin)."""
        d = tk.op_def(op)
        if d is not None:
            for r in op.results:
                yield r, True if getattr(d, self.trait) else list(op.operands)
            return
        if op.name == "scf.for":
            loop = op.opview
            args = list(loop.body.arguments)
            yield args[0], _control(op)
            for i, (arg, res) in enumerate(zip(args[1:], op.results)):
                sources = _control(op) + [loop.initArgs[i]] + _yielded(op, i)
                yield arg, sources
                yield res, sources
            return
        if len(op.regions):
            for i, r in enumerate(op.results):
                yield r, _control(op) + _yielded(op, i)
            return
        for r in op.results:
            yield r, list(op.operands)
