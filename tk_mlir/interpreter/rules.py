"""What each tk op does in the interpreter, keyed by op name as the lowering's
`@lowers` is: `@interprets("tk.load")` registers a factory that, given the op
(a program.Op: its attributes, types and location as plain data), returns
its closure (built once per specialization). A closure keeps plain data
only, never an MLIR object: a Program outlives its module.

A tile op's closure (an op with a register tile or vector, or a block
barrier: program.py decides from the types and traits) runs once per scope
instance as `fn(scope, *operands)` (program.Scope: the block, the warps,
the op's line): tiles are numpy arrays, global arrays `memory.GlobalArray`s,
shared tiles and semaphores `shared.SharedRef`/`SemRef`s, scalars Python
numbers (the same in every thread of the scope). Any other op's closure
runs per warp as `fn(warp, *operands)` on 32-lane values (machine.py).

Float tiles compute in f32 and round to their dtype after each op
(numerics.py); the scalar operand of a bf16/f16 tile op is rounded to the
tile's dtype first, as the GPU converts it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from ..dialects import tk, types as T
from . import numerics, ordering, shared
from .machine import LANES, Blocked, error, warp_scalar

INTERPRETERS: dict[str, Callable] = {}
SYNC: set[str] = set()      # ops whose per-warp closure is a generator (it may wait)


def interprets(*names: str, sync: bool = False):
    """Register a closure factory `factory(op, num_warps)` (op: a program.Op)
    for ops `names`; sync=True: the closure is a generator `fn(warp,
    *operands)` that may yield machine.Blocked / machine.YIELD and returns the
    op's result."""
    def register(factory):
        for n in names:
            INTERPRETERS[n] = factory
            if sync:
                SYNC.add(n)
        return factory
    return register


def _order(scope) -> ordering.OrderView:
    """The global-memory order of a tile op's access: its warps' together."""
    return scope.block.global_order([w.index for w in scope.warps])


def _result(op) -> T.TkType:
    return T.parse(op.result_type)


# ------------------------------------------------------ where this thread is

@interprets("tk.block_id", "tk.grid_dim")
def _block_index(op, num_warps):
    dim, grid = op.dim, op.name == "tk.grid_dim"
    return lambda w: np.int32(w.block.grid[dim] if grid else w.block.id[dim])


@interprets("tk.lane_id")
def _lane_id(op, num_warps):
    return lambda w: w.lane_ids()


@interprets("tk.thread_id")
def _thread_id(op, num_warps):
    return lambda w: w.lane_ids() + np.int32(LANES * w.index)


@interprets("tk.warp_id")
def _warp_id(op, num_warps):
    return lambda w: np.int32(w.index)


@interprets("tk.warpgroup_id")
def _warpgroup_id(op, num_warps):
    return lambda w: np.int32(w.index // T.SCOPES["warpgroup"])


@interprets("tk.gl_dim")
def _gl_dim(op, num_warps):
    dim = op.dim
    return lambda w, src: np.int32(src.shape[dim])


# ------------------------------------------------------------------ memory

@interprets("tk.load")
def _load(op, num_warps):
    t = _result(op)
    if not isinstance(T.parse(op.type("src")), T.GL):
        return _load_shared(t, num_warps)
    fill = op.fill
    return lambda scope, src, *coords: src.load(coords, t.shape, t.dtype, fill,
                                                by=(_order(scope), scope.where, scope.loc))


def _load_shared(t, num_warps):
    """st -> rt, sv -> rv: each warp reads the rows its part of the tile holds."""
    owners, columns = shared.rows_by_warp(t, num_warps), shared.cols_by_warp(t, num_warps)
    def load(scope, src, *coords):
        owner, src = _owner(scope, src, writes=False)
        if owner is not scope.block:
            return numerics.round_to(t.dtype, owner.smem.read(src))
        for k, w in enumerate(scope.warps):
            _check(scope, scope.block.shadow.read(src, w.index, w.clock, scope.where,
                                            "this load", rows=owners[k], cols=columns[k]))
        return numerics.round_to(t.dtype, scope.block.smem.read(src))
    return load


def _owner(scope, ref, writes: bool):
    """(the block whose shared memory a thread load or store of ref reaches,
    the tile): another block of the cluster for tile.in_block's ref (checked
    by _reach_remote), else this block; in a cluster, the access checked
    against the other blocks' (_across_cluster)."""
    owner = scope.block
    if isinstance(ref, shared.RemoteRef):
        owner, ref = scope.block.cluster.blocks[ref.rank], ref.ref
        if owner is not scope.block:
            _reach_remote(scope, owner, ref, writes)
    if scope.block.cluster is not None and isinstance(ref.alloc.type, T.ST):
        _across_cluster(scope, owner, ref, writes)
    return owner, ref


def _reach_remote(scope, peer, ref, writes: bool) -> None:
    """Check a thread load (writes=False) or store of block `peer`'s copy of
    tile ref from another block of its cluster: ordering across blocks is not
    tracked (machine.Cluster), what is in flight there is (a TMA copy
    writing it; for a store, reading it too), and the block must still be
    running."""
    what = "store into" if writes else "load of"
    scope.block.reach(peer, scope.loc, f"this {what} another block's tile (tile.in_block)")
    f = peer.shadow.in_flight_on(ref) if writes else peer.shadow.writing(ref)
    if f is not None:
        raise error(scope.loc, f"this {what} {ref.describe()} in block {peer.name} of the "
                               f"cluster runs while the {f.kind} issued at {f.where} is still "
                               f"{'writing' if f.writes else 'reading'} it there: that block "
                               f"must wait for it, then tk.cluster_sync() on both sides, before "
                               f"this access")


def _across_cluster(scope, owner, ref, writes: bool) -> None:
    """A thread access of `owner`'s tile ref, checked against the other
    blocks' since the last tk.cluster_sync (cluster_access.py)."""
    epoch = max(scope.block.cluster_epoch[w.index] for w in scope.warps)
    _check(scope, scope.block.cluster.accesses.check(owner, ref, scope.block, epoch, writes,
                                                      scope.where))


@interprets("tk.in_block")
def _in_block(op, num_warps):
    loc = op.loc
    def in_block(w, src, rank):
        r = warp_scalar(w, rank, loc, "tile.in_block: the rank")
        blocks = w.block.cluster.blocks
        if not 0 <= r < len(blocks):
            raise error(loc, f"tile.in_block({r}): the cluster has blocks 0..{len(blocks) - 1}")
        return shared.RemoteRef(src, int(r))
    return in_block


@interprets("tk.store")
def _store(op, num_warps):
    if not isinstance(T.parse(op.type("dst")), T.GL):
        return _store_shared(T.parse(op.type("value")), num_warps, _fenced(op))
    def store(scope, dst, value, *coords):
        _check(scope, dst.store(coords, value, by=(_order(scope), scope.where)))
    return store


def _fenced(op) -> bool:
    """Whether tk-proxy-fences put a proxy fence after this thread write."""
    from ..dialects import contracts
    return op.hint(contracts.PROXY_FENCE, False)


def _store_shared(t, num_warps, fenced: bool):
    owners = shared.rows_by_warp(t, num_warps, store=True)
    columns = shared.cols_by_warp(t, num_warps)
    def store(scope, dst, value, *coords):
        owner, dst = _owner(scope, dst, writes=True)
        if owner is not scope.block:
            owner.smem.write(dst, numerics.round_to(dst.alloc.type.dtype, value))
            return
        value = numerics.round_to(dst.alloc.type.dtype, value)
        # (the values already there, as every warp storing one warp-scope tile
        # leaves them: no race with an unordered earlier store of them)
        same = functools.cache(lambda: bool(np.array_equal(scope.block.smem.read(dst), value)))
        for k, w in enumerate(scope.warps):
            _check(scope, scope.block.shadow.write(dst, w.index, w.clock, scope.where,
                                             "this store", rows=owners[k], cols=columns[k],
                                             unfenced=not fenced, same_values=same))
        scope.block.smem.write(dst, value)
    return store


def _check(scope, problem: str | None) -> None:
    """Raise what races.py found, at the op's line."""
    if problem is not None:
        raise error(scope.loc, problem)


@interprets("tk.load_scalar")
def _load_scalar(op, num_warps):
    # Per warp: each lane reads the element at its own coordinates.
    loc, at = op.loc, op.at
    def load(w, src, *idx):
        lanes = np.broadcast_arrays(*(np.asarray(i, np.int64) for i in idx),
                                    np.zeros(LANES, np.int64))[:-1]
        return src.elements(tuple(lanes), by=(w.block.global_order([w.index]), at, loc))
    return load


def _lane(value, lane: int):
    """One lane's value of a per-thread operand (a scalar is every lane's)."""
    return np.asarray(value)[lane] if np.ndim(value) else value


def _flag_at(flags, lane: int, idx) -> tuple:
    """(the lane's array, its element coordinates) of a flag operand: an
    array, or a tk.pgl copy picked per lane (PeerChoice)."""
    array = flags.lanes[lane] if isinstance(flags, PeerChoice) else flags
    return array, tuple(int(_lane(i, lane)) for i in idx)


@interprets("tk.signal")
def _signal(op, num_warps):
    loc, add = op.loc, op.mode == "add"
    def signal(w, flags, value, *idx):
        for lane in w.active_lanes():
            array, at = _flag_at(flags, lane, idx)
            try:
                before, after = array.update_element(at, int(_lane(value, lane)), add)
            except IndexError as e:
                raise error(loc, f"tk.signal: {e} (on the GPU this traps)") from None
            ordering.publish(array.flag_clocks, at, before, after,
                             w.block.release_global(w.index), add)
    return signal


@interprets("tk.wait_signal", sync=True)
def _wait_signal(op, num_warps):
    # A flag not up yet steps this block aside (machine.run_blocks): others,
    # of this launch or of other ranks', may raise it.
    loc = op.loc
    def behind(w, flags, expected, idx) -> list[str]:
        late = []
        for lane in w.active_lanes():
            array, at = _flag_at(flags, lane, idx)
            seen, want = int(array.elements(tuple(np.asarray(a) for a in at))), \
                int(_lane(expected, lane))
            if ((seen - want) & 0xFFFFFFFF) >= 1 << 31:
                late.append(f"flag {at} of {array.name!r} holds {seen}, waiting for {want}")
        return late
    def wait(w, flags, expected, *idx):
        for lane in w.active_lanes():        # (a flag outside its tensor traps on the GPU)
            array, at = _flag_at(flags, lane, idx)
            if not all(0 <= i < d for i, d in zip(at, array.shape)):
                raise error(loc, f"tk.wait_signal: element {at} is outside {array.name!r} of "
                                 f"shape {array.shape} (on the GPU this traps)")
        while behind(w, flags, expected, idx):
            # (the block sleeps until a write to one of its flags: memory.py wakes it)
            watch = tuple((array.waiters, at) for array, at in
                          (_flag_at(flags, lane, idx) for lane in w.active_lanes()))
            yield Blocked(lambda: not behind(w, flags, expected, idx),
                          lambda: f"at {op.at} (tk.wait_signal): " + "; ".join(
                              behind(w, flags, expected, idx)[:2]),
                          loc, external=True, flag=True, watch=watch)
        for lane in w.active_lanes():        # ordered after what the signals published
            array, at = _flag_at(flags, lane, idx)
            w.block.acquire_global(w.index, ordering.acquire(array.flag_clocks, at,
                                                             int(_lane(expected, lane))))
    return wait


@dataclasses.dataclass
class PeerChoice:
    """A tk.pgl copy picked by a rank that differs between lanes: each lane's
    array (signals and waits take it lane by lane)."""
    lanes: list

    def __getattr__(self, name):
        from .machine import InterpretError
        if name.startswith("__"):
            raise AttributeError(name)
        raise InterpretError("a tk.pgl copy picked by a rank that differs between the threads "
                             "of a warp reaches an op other than tk.signal / tk.wait_signal; "
                             "the interpreter models per-thread ranks for flags only (pick the "
                             "copy by a rank every thread of the warp shares)")


@interprets("tk.peer_select")
def _peer_select(op, num_warps):
    loc = op.loc
    def select(w, rank, *copies):
        ranks = np.broadcast_to(np.asarray(rank), (LANES,))
        active = ranks[w.active_lanes()]
        if ((active < 0) | (active >= len(copies))).any():
            raise error(loc, f"peer rank {int(active[(active < 0) | (active >= len(copies))][0])}"
                             f" is not a rank of this {len(copies)}-rank peer tensor (on the "
                             f"GPU this traps)")
        if (active == active[0]).all():
            return copies[int(active[0])]
        return PeerChoice([copies[int(r)] if 0 <= r < len(copies) else None for r in ranks])
    return select


@interprets("tk.fence")
def _fence(op, num_warps):
    return lambda w: None      # (the interpreter's memory is sequentially consistent)


@interprets("tk.atomic_add")
def _atomic_add(op, num_warps):
    def add(scope, dst, value, *coords):
        _check(scope, dst.store(coords, value, add=True, by=(_order(scope), scope.where)))
    return add


@interprets("tk.store_partial")
def _store_partial(op, num_warps):
    # As on the GPU, where each thread counts its own elements' parts: the
    # scope adds its part, counts it on its tile's counters, and the last part
    # stores the total and zeroes workspace and counters.
    loc = op.loc
    def store(scope, dst, value, workspace, counters, parts, *coords):
        if parts < 1:
            raise error(loc, f"tk.store_partial: parts is {parts}; a tile has at least one part")
        if workspace.shape != dst.shape:
            raise error(loc, f"tk.store_partial: the workspace {workspace.name!r} has shape "
                             f"{workspace.shape}, dst {dst.name!r} {dst.shape}: it must have "
                             f"dst's shape")
        if not dst.overlaps(coords, value.shape):
            return                  # a tile wholly past dst's end: skipped, as on the GPU
        threads = 32 * len(scope.warps)
        slot = _tile_number(dst.shape, value.shape, coords)
        if (slot + 1) * threads > counters.shape[0]:
            raise error(loc, f"tk.store_partial: counters {counters.name!r} has "
                             f"{counters.shape[0]} elements; the tile at {tuple(coords)} counts "
                             f"on elements {slot * threads} to {(slot + 1) * threads - 1} "
                             f"({threads} threads per tile)")
        if getattr(counters, "counted_by", None) is None:      # the launch's first part
            _starts_at_zero(loc, counters, "i32", "the counters", "a count below parts= would "
                            "read as a tile short of parts")
            _starts_at_zero(loc, workspace, "f32", "the workspace", "every part adds into "
                            "it, so its sums would be off")
        workspace.store(coords, value, add=True)
        counters.counted_by = (loc, parts)      # checked at the launch's end (leftover_parts)
        count = counters.load((slot,), (threads,), "i32", 0)
        if not (count == count[0]).all() or not 0 <= count[0] < parts:
            raise error(loc, f"tk.store_partial: the counters of tile {tuple(coords)} hold "
                             f"{sorted(set(count.tolist()))}, not one count below parts={parts}: "
                             f"counters must start as zeros, and each tile get exactly "
                             f"{parts} parts")
        count = count + 1
        if count[0] == parts:
            total = workspace.load(coords, value.shape, "f32", 0.0)
            _check(scope, dst.store(coords, total, by=(_order(scope), scope.where)))
            workspace.store(coords, np.zeros_like(total))
            count[:] = 0
        counters.store((slot,), count)
    return store


def _starts_at_zero(loc, array, dtype: str, role: str, why: str) -> None:
    """tk.store_partial's rule for its workspace and counters at a launch's
    first part: all zeros (every launch leaves them so)."""
    values = array.load((0,) * len(array.shape), array.shape, dtype, 0)
    if values.any():
        flat = np.flatnonzero(values)
        at = tuple(int(i) for i in np.unravel_index(flat[0], values.shape))
        raise error(loc, f"tk.store_partial: {role} {array.name!r} must start as zeros "
                         f"({len(flat)} element(s) are not, the first at "
                         f"{at[0] if len(at) == 1 else at}, holding "
                         f"{sorted(set(values.ravel()[flat].tolist()))[:4]}): {why}; pass "
                         f"zeros (torch.zeros), which every launch leaves behind")


def leftover_parts(args) -> None:
    """After a launch: every tile's counters are back to zero, or a tile got
    fewer parts than `parts` (more parts leave a count behind as well: the
    extra ones start a new sum). Either way its sum was lost or mixed into the
    next launch's, so it is an error at the tk.store_partial line."""
    for a in args:
        counted = getattr(a, "counted_by", None)
        if counted is None:
            continue
        a.counted_by = None
        counts = a.load((0,), a.shape, "i32", 0)
        if counts.any():
            loc, parts = counted
            slots = np.flatnonzero(counts)
            raise error(loc, f"tk.store_partial: after the launch, counters {a.name!r} hold "
                             f"{sorted(set(counts[slots].tolist()))} at {len(slots)} element(s) "
                             f"(the first at {slots[0]}): a tile got a number of parts that is "
                             f"not parts={parts}: its sum was not stored, and its parts stay "
                             f"in the workspace")


def _tile_number(shape, tile_shape, coords) -> int:
    """The row-major number of the tile at coords among shape's tiles (outer
    dims count elements), as lowering/atomic.py numbers counters."""
    outer = len(shape) - len(tile_shape)
    number = 0
    for d, (c, extent) in enumerate(zip(coords, shape)):
        n = extent if d < outer else -(-extent // tile_shape[d - outer])
        number = number * n + int(c)
    return number


@interprets("tk.copy")
def _copy(op, num_warps):
    # gl <-> st by the whole block (then a block barrier: the step joins the
    # warps' clocks around it). Recorded as warp 0's access.
    fenced = _fenced(op)
    def copy(scope, dst, src, *coords):
        w = scope.warps[0]
        if isinstance(dst, shared.SharedRef):
            _check(scope, scope.block.shadow.write(dst, w.index, w.clock, scope.where, "this copy",
                                             unfenced=not fenced))
            scope.block.smem.write(dst, src.load(coords, dst.shape, dst.alloc.type.dtype, 0.0,
                                                 by=(_order(scope), scope.where, scope.loc)))
        else:
            _check(scope, scope.block.shadow.read(src, w.index, w.clock, scope.where, "this copy"))
            _check(scope, dst.store(coords, scope.block.smem.read(src),
                                    by=(_order(scope), scope.where)))
    return copy


# ------------------------------------------------------- shared tile views

@interprets("tk.index")
def _index(op, num_warps):
    loc = op.loc
    def index(w, base, i):
        i = warp_scalar(w, i, loc, "tk.index: the index")
        if base.index is not None:
            raise error(loc, f"tk.index: {base.describe()} is one element, not an array")
        if not 0 <= i < base.alloc.count:
            raise error(loc, f"index {i} out of range: the array allocated at "
                             f"{base.alloc.where} has {base.alloc.count} element(s) "
                             f"(0 to {base.alloc.count - 1})")
        return dataclasses.replace(base, index=i)
    return index


@interprets("tk.subtile")
def _subtile(op, num_warps):
    rows, loc = _result(op).rows, op.loc
    def subtile(w, src, row):
        row = warp_scalar(w, row, loc, "tk.subtile: the row")
        if row < 0 or row + rows > src.rows:
            raise error(loc, f"subtile rows {row} to {row + rows - 1} are out of range: "
                             f"{src.describe()} has {src.rows} row(s)")
        return dataclasses.replace(src, row=src.row + row, rows=rows)
    return subtile


@interprets("tk.column_block")
def _column_block(op, num_warps):
    cols, loc = _result(op).cols, op.loc
    def column_block(w, src, index):
        k = warp_scalar(w, index, loc, "tk.column_block: the index")
        if not 0 <= k < src.cols // cols:
            raise error(loc, f"column block {k} is out of range: {src.describe()} has "
                             f"{src.cols // cols} column block(s) of {cols} columns")
        return dataclasses.replace(src, col=src.col + k * cols, cols=cols)
    return column_block


@interprets("tk.barrier")
def _barrier(op, num_warps):
    # The rendezvous of the block's warps is the whole of its meaning here.
    return lambda block: None


# ------------------------------------------------------------------ values

@interprets("tk.fill")
def _fill(op, num_warps):
    t = _result(op)
    value = numerics.scalar_for(t.dtype, op.value)
    return lambda block: np.full(t.shape, value, numerics.HOLDER[t.dtype])


@interprets("tk.cvt")
def _cvt(op, num_warps):
    dtype = _result(op).dtype
    return lambda block, src: numerics.round_to(dtype, src)


# Unary maps, computed in f32 (exact functions; the GPU's are approximations
# within ~2 ulp f32: the numerics contract in __init__.py).
UNARY = {"exp": np.exp, "exp2": np.exp2, "log": np.log, "abs": np.abs, "neg": np.negative,
         "relu": lambda x: np.maximum(x, np.float32(0)), "sqrt": np.sqrt,
         "rsqrt": lambda x: np.float32(1) / np.sqrt(x), "rcp": lambda x: np.float32(1) / x}
BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
          "max": np.maximum, "min": np.minimum,     # (both propagate NaN, as maximumf does)
          "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}


@interprets(*(f"tk.{n}" for n in UNARY))
def _unary(op, num_warps):
    fn, dtype = UNARY[op.name[3:]], _result(op).dtype
    return lambda block, src: numerics.round_to(dtype, fn(src))


def _operand(dtype: str, x):
    """A tile as it is, a scalar converted once to the tile's dtype."""
    return x if isinstance(x, np.ndarray) and x.ndim else numerics.scalar_for(dtype, x)


@interprets(*(f"tk.{n}" for n in (*tk.BINARY, *tk.LOGICAL)))
def _binary(op, num_warps):
    fn, dtype = BINARY[op.name[3:]], _result(op).dtype
    return lambda block, lhs, rhs: numerics.round_to(dtype, fn(lhs, _operand(dtype, rhs)))


@interprets("tk.reduce")
def _reduce(op, num_warps):
    # Partials combine in f32, as the lowering does (in another order); an i32
    # tile's in i32, its sums wrapping past 32 bits as the GPU's adds do.
    fn = {"sum": np.sum, "max": np.max, "min": np.min}[op.kind]
    axis, dtype = 1 if op.axis == "row" else 0, _result(op).dtype
    if dtype == "i32":
        return lambda block, src: fn(src.astype(np.int64), axis=axis).astype(np.uint32) \
            .astype(np.int32)
    return lambda block, src: numerics.round_to(
        dtype, fn(src.astype(np.float32), axis=axis))


@interprets("tk.broadcast")
def _broadcast(op, num_warps):
    fn, dtype = BINARY[op.kind], _result(op).dtype
    row = op.axis == "row"      # one vector element per row: it repeats along the columns
    return lambda block, src, vec: numerics.round_to(
        dtype, fn(src, vec[:, None] if row else vec[None, :]))


@interprets("tk.slice")
def _slice(op, num_warps):
    t, r, c = _result(op), op.row, op.col
    return lambda block, src: src[r:r + t.rows, c:c + t.cols].copy()


@interprets("tk.transpose")
def _transpose(op, num_warps):
    return lambda block, src: src.T.copy()


@interprets("tk.swap_pairs")
def _swap_pairs(op, num_warps):
    def swap(block, src):
        rows, cols = src.shape
        return src.reshape(rows, cols // 2, 2)[:, :, ::-1].reshape(rows, cols).copy()
    return swap


@interprets("tk.tile_index")
def _tile_index(op, num_warps):
    t, axis = _result(op), op.axis
    return lambda block, src: np.indices(t.shape, dtype=np.int32)[axis]


# tk.cmp: floats compare in f32 (a bf16/f16 value is an f32 value; a scalar
# is not rounded to the tile's dtype: as Python compares the numbers).
COMPARE = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
           "eq": np.equal, "ne": np.not_equal}


@interprets("tk.cmp")
def _cmp(op, num_warps):
    fn = COMPARE[op.predicate]
    dtype = T.parse(op.type("lhs")).dtype
    scalar = np.float32 if T.is_float(dtype) else numerics.HOLDER[dtype]
    def compare(block, lhs, rhs):
        rhs = rhs if isinstance(rhs, np.ndarray) and rhs.ndim else scalar(rhs)
        return fn(lhs, rhs)
    return compare


@interprets("tk.select")
def _select(op, num_warps):
    dtype = _result(op).dtype
    return lambda block, mask, a, b: np.where(mask, _operand(dtype, a), _operand(dtype, b)) \
        .astype(numerics.HOLDER[dtype])
