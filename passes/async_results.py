"""Part of tk-verify: an asynchronous result is read only once it exists.

An op with the `async_result` trait (tk.mma: wgmma) returns a value that
its hardware unit is still writing; it becomes readable once an op with the
`async_wait` trait (tk.mma_wait(pending)) has waited for its group:
wait(p) lets the newest p groups run on, so it completes a group when at
least p groups were issued after it. Before that the value may only be
chained into another async op as its accumulator (wgmma accumulates in
place, in order), carried through a loop or an if (scf.yield) — any other
use reads garbage, and is refused at its line.

A forward analysis over the structured IR: the state maps each value not
yet known to be complete to the fewest groups issued after it on any path
(fewer is the pessimistic side: a later wait(p) must find at least p).
Paths join by keeping a value pending if it is on either side; a loop is
iterated until the state at its head stops changing (the counts only go
down, so it ends), and what holds after the loop is that head state (the
loop may run zero times).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from mlir import ir

from ..dialects import tk
from ..errors import error_at

_MAX = 8          # groups in flight past which every wait(p <= 7) completes a group


@dataclass(frozen=True)
class _Pending:
    op: ir.Operation     # the async op whose result this is (for the message)
    newer: int           # groups issued after it, on the path with fewest


State = dict  # ir.Value -> _Pending


def _join(a: State, b: State) -> State:
    out = dict(a)
    for v, p in b.items():
        out[v] = p if v not in out or p.newer < out[v].newer else out[v]
    return out


def _mma_name(op: ir.Operation) -> str:
    """How the user wrote the op (tk.mma_ABt, ...): tk.mma's trans attributes."""
    if "trans_a" not in op.attributes:
        return op.name
    ta, tb = (bool(ir.IntegerAttr(op.attributes[k]).value) for k in ("trans_a", "trans_b"))
    return "tk.mma_" + ("At" if ta else "A") + ("B" if tb else "Bt")


def _line(op: ir.Operation) -> str:
    m = re.search(r":(\d+):\d+", str(op.location))
    return f" at line {m.group(1)}" if m else ""


def _refuse(use: ir.Operation, pending: _Pending) -> None:
    name = _mma_name(pending.op)
    raise error_at(use.location, f"the result of {name}{_line(pending.op)} is read before "
                   f"tk.mma_wait has completed it on every path here: an MMA runs "
                   f"asynchronously, and until tk.mma_wait(0) (or tk.mma_wait(p) after p newer "
                   f"MMAs) its result may only be another MMA's accumulator")


class _Analysis:
    def block(self, block, state: State) -> tuple[State, list]:
        """The state at the end of block and the states of the values it yields."""
        yielded: list = []
        for op in block.operations:
            op = op.operation
            if op.name == "scf.yield":
                yielded = [state.get(v) for v in op.operands]
            elif op.name == "scf.for":
                state = self.loop(op, state)
            elif op.name == "scf.if":
                state = self.branch(op, state)
            else:
                state = self.op(op, state)
        return state, yielded

    def op(self, op: ir.Operation, state: State) -> State:
        d = tk.op_def(op)
        chained = d.operands.index("acc") if d is not None and d.async_result else None
        for i, v in enumerate(op.operands):
            if v in state and i != chained:
                _refuse(op, state[v])
        for region in op.regions:            # any other region op: check inside it too
            for block in region.blocks:
                self.block(block, dict(state))
        if d is not None and d.async_result:
            state = {v: _Pending(p.op, min(p.newer + 1, _MAX)) for v, p in state.items()}
            state[op.results[0]] = _Pending(op, 0)
        elif d is not None and d.async_wait:
            pending = ir.IntegerAttr(op.attributes["pending"]).value
            state = {v: p for v, p in state.items() if p.newer < pending}
        return state

    def branch(self, op: ir.Operation, state: State) -> State:
        if op.operands[0] in state:
            _refuse(op, state[op.operands[0]])
        ends = []
        for region in op.regions:
            if len(region.blocks):
                ends.append(self.block(region.blocks[0], dict(state)))
            else:
                ends.append((dict(state), [None] * len(op.results)))
        out = ends[0][0]
        for end, _ in ends[1:]:
            out = _join(out, end)
        for i, r in enumerate(op.results):
            for _, yielded in ends:
                if yielded[i] is not None:
                    out = _join(out, {r: yielded[i]})
        return out

    def loop(self, op: ir.Operation, state: State) -> State:
        loop = op.opview
        for v in (loop.lowerBound, loop.upperBound, loop.step):
            if v in state:
                _refuse(op, state[v])
        body = loop.body
        carried = list(body.arguments)[1:]
        head = dict(state)
        for arg, init in zip(carried, loop.initArgs):
            if init in state:
                head[arg] = state[init]
        while True:
            end, yielded = self.block(body, dict(head))
            # Around the back edge: what was pending before the loop, and the
            # carried values as yielded (body-local values are redefined).
            back = {v: p for v, p in end.items() if v in state}
            for arg, y in zip(carried, yielded):
                if y is not None:
                    back[arg] = y
            new = _join(head, back)
            if new == head:
                break
            head = new
        out = {v: p for v, p in head.items() if v not in carried}
        for res, arg in zip(op.results, carried):
            if arg in head:
                out[res] = head[arg]
        return out


def check_async_results(func) -> None:
    """Refuse, at its line, the first read of an async result before its wait."""
    _Analysis().block(func.regions[0].blocks[0], {})
