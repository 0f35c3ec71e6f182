"""Part of tk-verify: a signal must not publish TMA writes before they are done.

A TMA store or reduce-add (the async proxy) is complete only after
`cp.async.bulk.wait_group 0` — the `.read` form only says its shared source
may be reused — and a release (tk.signal) orders the writes of the generic
proxy only. So between the last TMA write and a signal that tells another
block or GPU to read its result there must be, in this order:

    tk.tma.store_wait(0, read=False)     # the writes are done
    tk.fence(scope, async_proxy=True)    # fence.proxy.async.global, then
    tk.signal(...)                       # fence.acq_rel at the signal's scope or wider

The check walks the kernel's ops in program order, a loop's body twice (a
signal early in a body follows the writes late in its previous iteration),
and reports a signal that comes too soon at its line. Ops are known by their
traits (dialects/tk.py: bulk_write, completes_bulk_writes, fence_scope,
fences_proxies, signal_scope).

Flags other GPUs reach need scope "sys": a signal or wait on a peer's copy
(a tk.pgl argument's X[r]), and a wait on this rank's copy X when the kernel
signals the peers' copies of X (the peers, running it, signal this one): an
acquire at "gpu" does not synchronize with another GPU's release. The rule
is per tensor, not per element (indices are run-time values).
"""
from __future__ import annotations

from mlir import ir

from ..dialects import contracts, tk
from ..errors import _where, error_at


def check_signals(func: ir.Operation) -> None:
    # The last TMA write and its completion (locations), and since then the
    # widest fence's scope and whether a fence ordered the proxies.
    state = {"written": None, "complete": None, "fenced": None, "proxies": False}
    peers = set(contracts.PEER_COPIES.get(func, ()))
    signaled_by_peers = _signaled_by_peers(func, peers)

    def visit(op: ir.Operation) -> None:
        d = tk.op_def(op)
        if d is None:
            return
        if d.bulk_write:
            state.update(written=op.location, complete=None, fenced=None, proxies=False)
        elif _true(d.completes_bulk_writes, op) and state["written"] is not None:
            state.update(complete=op.location, written=None)
        elif d.fence_scope is not None and state["complete"] is not None:
            scope = d.fence_scope(op)
            if state["fenced"] is None or _wider(scope, state["fenced"]):
                state["fenced"] = scope
            state["proxies"] |= d.fences_proxies is not None and d.fences_proxies(op)
        elif d.signal_scope is not None:
            _check_signal(op, d.signal_scope(op), state)
        if d.flag is None or ir.StringAttr(op.attributes["scope"]).value == "sys":
            return
        flag, scope = op.operands[d.operands.index(d.flag)], \
            ir.StringAttr(op.attributes["scope"]).value
        if _on_a_peer(flag, peers):
            raise error_at(op.location, f"{op.name}: this flag is a peer's copy (a tk.pgl "
                           f"argument's X[r]), which other GPUs reach: its scope must be 'sys', "
                           f"got {scope!r}")
        if d.signal_scope is None and _argument(flag) in signaled_by_peers:
            raise error_at(op.location, f"{op.name}: the peers signal this flag tensor (this "
                           f"kernel signals their copies of it, "
                           f"{_line(signaled_by_peers[_argument(flag)])}, so on each of them "
                           f"it signals this one): a wait at scope {scope!r} does not "
                           f"synchronize with another GPU's release; its scope must be 'sys' "
                           f"(flags only this GPU signals belong in a tensor of their own)")

    _in_order(func, visit)


def _in_order(op: ir.Operation, visit) -> None:
    """visit(op) for every op nested in op, in program order; a loop's body
    twice (what its end leaves is what its next iteration starts with)."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                visit(inner.operation)
                for _ in range(2 if inner.operation.name == "scf.for" else 1):
                    _in_order(inner.operation, visit)


def _signaled_by_peers(func: ir.Operation, peers: set) -> dict[int, ir.Location]:
    """{argument number of a tk.pgl argument's local copy X: a signal this
    kernel sends to one of X's peer copies}. A tk.pgl argument arrives as X,
    then its ranks' copies X[r] (consecutive numbers), then X.rank."""
    local_of = {}
    for i in sorted(peers):
        local_of[i] = local_of.get(i - 1, i - 1)
    found: dict[int, ir.Location] = {}

    def visit(op: ir.Operation) -> None:
        d = tk.op_def(op)
        if d is None or d.flag is None or d.signal_scope is None:
            return
        flag = op.operands[d.operands.index(d.flag)]
        copies = [flag] if isinstance(flag, ir.BlockArgument) else \
            list(flag.owner.operands)[1:] if _on_a_peer(flag, peers) else []
        for c in copies:
            if _argument(c) in local_of:
                found.setdefault(local_of[_argument(c)], op.location)

    _in_order(func, visit)
    return found


def _argument(v: ir.Value) -> int | None:
    """v's number when it is a kernel argument."""
    if isinstance(v, ir.BlockArgument):
        parent = v.owner.owner
        if getattr(parent, "operation", parent).name == "func.func":
            return v.arg_number
    return None


def _on_a_peer(v: ir.Value, peers: set) -> bool:
    """v is a rank's copy of a tk.pgl argument: one of the kernel's copy
    arguments, or a pick among them (an op with the peer_copies trait)."""
    if isinstance(v, ir.BlockArgument):
        parent = v.owner.owner
        return v.arg_number in peers and getattr(parent, "operation", parent).name == "func.func"
    d = tk.op_def(v.owner)
    return d is not None and d.peer_copies is not None


def _check_signal(op, scope: str, state: dict) -> None:
    if state["written"] is not None:
        raise error_at(op.location, f"tk.signal after TMA writes ({_line(state['written'])}) "
                       f"that may still be in flight: put tk.tma.store_wait(0, read=False) (the "
                       f"writes done, not only read) and tk.fence({scope!r}, async_proxy=True) "
                       f"before it")
    if state["complete"] is None:
        return
    fenced = state["fenced"]
    if fenced is None:
        raise error_at(op.location, f"tk.signal after TMA writes ({_line(state['complete'])} "
                       f"waits for them) without a fence: put tk.fence({scope!r}, "
                       f"async_proxy=True) between the wait and the signal (it orders the "
                       f"completed TMA writes, made by the async proxy, before the release)")
    if _wider(scope, fenced):
        raise error_at(op.location, f"tk.signal at scope {scope!r} after TMA writes fenced "
                       f"only at scope {fenced!r}: use tk.fence({scope!r}, async_proxy=True)")
    if not state["proxies"]:
        raise error_at(op.location, f"tk.signal after TMA writes fenced without "
                       f"async_proxy=True: the writes went through the async proxy and the "
                       f"signal does not, so use tk.fence({scope!r}, async_proxy=True) "
                       f"(fence.proxy.async.global orders them)")


def _true(trait, op) -> bool:
    return trait(op) if callable(trait) else bool(trait)


def _wider(a: str, b: str) -> bool:
    return tk.SCOPES.index(a) > tk.SCOPES.index(b)


def _line(loc) -> str:
    where = _where(loc)
    return f"line {where[1]}" if where else "earlier"
