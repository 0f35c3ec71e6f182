"""tk-assign-layouts: give every register vector a concrete layout.

A vector loaded from memory or filled with a constant starts as "auto"; its
uses decide: `x.mul_col(w)` needs w laid out like x's columns, elementwise ops
and loop-carried values need equal layouts on both sides. Values that must
agree are grouped (union-find); a group takes the one concrete layout among
its members, or the default vector layout when nothing constrains it. Two
different layouts in one group is the user's error, reported at the op that
joined them.
"""
from __future__ import annotations

from mlir import ir

from ..dialects import contracts, layout as layouts, tk, types as T
from ..errors import error_at, line_of
from .walk import walk_ops


class _Groups:
    def __init__(self):
        self.parent: dict = {}
        self.values: dict = {}
        self.fixed: dict = {}     # root -> (layout text, op that fixed it)

    def find(self, v):
        key = v
        self.parent.setdefault(key, key)
        self.values.setdefault(key, v)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def fix(self, v, layout: str, op) -> None:
        root = self.find(v)
        if root in self.fixed and self.fixed[root][0] != layout:
            raise error_at(op.location, "this vector is used with two different layouts: "
                           f"{self.fixed[root][0]} and {layout} (a vector made for one tile "
                           "cannot be used with a tile of another shape or layout)")
        self.fixed[root] = (layout, op)

    def join(self, a, b, op) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        sa, sb = T.parse(a.type).scope, T.parse(b.type).scope
        if sa != sb:
            raise error_at(op.location, f"a {sa}-scope vector and a {sb}-scope vector meet "
                           f"here; they must have the same scope")
        self.parent[rb] = ra
        if rb in self.fixed:
            self.fix(ra, *self.fixed.pop(rb)[:1], op)


def _is_vector(v: ir.Value) -> bool:
    return isinstance(T.parse(v.type), T.RV)


def _constrain(op, groups: _Groups, num_warps: int) -> None:
    name = op.operation.name
    d = tk.op_def(op)
    vecs = [v for v in list(op.operation.operands) + list(op.operation.results) if _is_vector(v)]
    for v in vecs:
        t = T.parse(v.type)
        groups.find(v)   # every vector gets a layout, even one only loaded and stored
        if t.layout != "auto":
            groups.fix(v, t.layout, op)
    if d is not None and d.layout == "broadcast":
        tile: T.RT = T.parse(op.operation.operands[0].type)
        lay = layouts.layout_of(tile, num_warps)
        keep = 0 if op.axis == "row" else 1
        vec, want = op.operation.operands[1], lay.slice(keep).encode()
        have = groups.fixed.get(groups.find(vec))
        if have is not None and have[0] != want:
            along, other = ("row", "column") if op.axis == "row" else ("column", "row")
            raise error_at(op.location, f"x.{op.kind}_{op.axis}(v) needs v laid out as one value "
                           f"per {along} of x, as x.{op.axis}_sum() or x.{op.axis}_max() makes "
                           f"it; this v was made for another tile or as a {other} vector "
                           f"({have[0]}, not {want}; its layout was set at "
                           f"{line_of(have[1].location)}). Vectors are not converted between "
                           f"layouts: a vector loaded or made by tk.full/tk.zeros takes the "
                           f"layout of its first use, so load (or make) it again for this one; "
                           f"or reduce a tile of x's layout and scope (layout= on its "
                           f"tk.load), or load x in the layout v came from")
        groups.fix(vec, want, op)
        return
    if d is not None and d.layout == "same":
        for v in vecs[1:]:
            groups.join(vecs[0], v, op)
    elif name == "scf.for":
        loop = op
        yields = loop.body.operations[len(loop.body.operations) - 1].operands
        for init, arg, y, res in zip(loop.initArgs, loop.inner_iter_args, yields, loop.results):
            if _is_vector(init):
                for v in (arg, y, res):
                    groups.join(init, v, op)
    elif name == "scf.if":
        for block in (op.then_block, op.else_block):
            yields = block.operations[len(block.operations) - 1].operands
            for y, res in zip(yields, op.results):
                if _is_vector(res):
                    groups.join(res, y, op)


def assign_layouts(module: ir.Module) -> None:
    for func in module.body.operations:
        num_warps = contracts.NUM_WARPS.get(func)
        groups = _Groups()
        walk_ops(func.operation, lambda op: _constrain(op.opview, groups, num_warps))
        for key, v in list(groups.values.items()):
            t = T.parse(v.type)
            if t.layout != "auto":
                continue
            root = groups.find(v)
            if root not in groups.fixed:   # nothing constrains the group: one default for all
                if t.length < layouts.VEC_RUN:
                    raise error_at(_defining_location(v), f"a vector of {t.length} elements "
                                   f"used on its own needs at least {layouts.VEC_RUN} (its "
                                   f"layout holds {layouts.VEC_RUN} per thread); pad it")
                groups.fixed[root] = (layouts.default_vector_layout(
                    t.length, T.scope_warps(t.scope, num_warps)).encode(), None)
            v.set_type(t.with_layout(groups.fixed[root][0]).to_mlir())


def _defining_location(v: ir.Value):
    owner = v.owner
    return owner.location if isinstance(owner, (ir.Operation, ir.OpView)) else \
        owner.owner.location
