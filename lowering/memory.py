"""Lowering of tk.load / tk.store / tk.copy / tk.alloc_st / tk.alloc_sv / tk.gl_dim.

Register tiles move in pieces of consecutive registers that the layout puts
on consecutive columns (at most 16 bytes: one ld/st.v4.b32). The launch
checks guarantee 16-byte aligned rows whose length is a whole number of
16-byte vectors, so a piece is either entirely inside the tensor or entirely
outside: one predicate per piece masks partial tiles. A register tile stored
to global memory first trades registers between lanes where that makes its
pieces longer (lane_exchange.py: wgmma's `row` layout holds 2 columns a
thread). To and from shared tiles, 16-bit tiles in the MMA fragment layouts
move as 8x8 matrices (ldmatrix/stmatrix), and a thread's accesses share one
address register where the tile's byte layout lets them (`_offset_constants`).
"""
from __future__ import annotations

import functools

from mlir import ir
from mlir.dialects import arith, llvm, nvvm, scf

from ..dialects import contracts, layout as layouts, types as T
from . import lane_exchange
from .context import (LoweringContext, build_vector, c32, c64, constant, float_constant, i32, i64,
                      in_place, lowers, ptr, split_vector, vector_type)
from .fragments import Fragment, GlobalRef, SharedRef, layout_of


def _and(conds: list[ir.Value]) -> ir.Value | None:
    return functools.reduce(arith.andi, conds) if conds else None


def _lt(a: ir.Value, b: ir.Value) -> ir.Value:
    """0 <= a < b for i32 a, b (b >= 0): unsigned, so negative coordinates
    are out of bounds too."""
    return arith.cmpi(arith.CmpIPredicate.ult, a, b)


def _pieces(frag_layout, dtype: str):
    """(first register, registers per piece) for every memory access of a fragment."""
    axis = len(frag_layout.shape) - 1
    run = min(frag_layout.vector_run(axis), max(1, 16 // T.itemsize(dtype)))
    return [(r0, run) for r0 in range(0, frag_layout.num_regs, run)], run


def element_offset(g: GlobalRef, coords) -> ir.Value:
    """i64 element offset of the leading element coordinates `coords` (one per
    dim from the first, at most all but the contiguous last)."""
    offset = c64(0)
    for c, stride in zip(coords, g.strides):
        offset = arith.addi(offset, arith.muli(arith.extsi(i64(), c), stride))
    return offset


class _GlobalTileAccess:
    """Addresses and bounds of a tile (or vector) at tile coordinates in a tensor."""

    def __init__(self, ctx: LoweringContext, g: GlobalRef, layout, scope: str, coords):
        self.g, self.layout = g, layout
        rank, tile_rank = g.type.rank, len(layout.shape)
        outer, inner = coords[:rank - tile_rank], coords[rank - tile_rank:]
        thread = ctx.thread_position(layout, scope)
        # Element coordinates of this thread's first element along the tile axes.
        self.base = [arith.addi(arith.muli(c, c32(n)), t)
                     for c, n, t in zip(inner, layout.shape, thread)]
        # In place too: LLVM rewrites a piece's bounds test base + p < extent
        # as base < extent - p, and would hoist each extent - p into a register.
        self.extent = [in_place(e) for e in g.dims[rank - tile_rank:]]
        offset = element_offset(g, outer)
        self.outer_ok = _and([_lt(c, d) for c, d in zip(outer, g.dims)])
        if tile_rank == 2:
            row = arith.extsi(i64(), self.base[0])
            offset = arith.addi(offset, arith.muli(row, g.strides[rank - 2]))
            # The pieces' row offsets (row x stride) are computed here, not
            # hoisted into a register each for a whole enclosing loop.
            self.row_stride = in_place(g.strides[rank - 2])
        self.offset = arith.addi(offset, arith.extsi(i64(), self.base[-1]))

    def piece(self, r0: int, dtype: str) -> tuple[ir.Value, ir.Value]:
        """(address, in-bounds i1) of the piece starting at register r0."""
        pos = self.layout.reg_position(r0)
        rank = self.g.type.rank
        off = c64(pos[-1])
        if len(pos) == 2 and pos[0]:
            off = arith.addi(off, arith.muli(c64(pos[0]), self.row_stride))
        off = arith.addi(self.offset, off)
        addr = llvm.getelementptr(ptr(1), self.g.ptr, [off], [-2**31], T.element_type(dtype),
                                  llvm.GEPNoWrapFlags.inbounds)
        conds = [_lt(arith.addi(b, c32(p)), e) for b, p, e in zip(self.base, pos, self.extent)]
        if self.outer_ok is not None:
            conds.append(self.outer_ok)
        return addr, _and(conds)


# The PTX of the cache hints a global access may carry (tk.load/tk.store
# `cache=`; dialects/tk.py CACHE_HINTS): (load, store) instruction prefixes.
# "stream": data read or written once, evicted first so that it does not push
# reused data (weights) out of L1 and L2.
_PTX_CACHE = {"stream": ("ld.global.cs", "st.global.cs")}   # .cs: evict-first in L1 and L2
# Loads of what other blocks wrote in this launch (after an acquire): from L2,
# past this SM's L1 (tk.store_partial's last part).
FROM_L2 = ("ld.global.cg", "st.global.cg")


def _asm_words(nbytes: int) -> str | None:
    return {4: "b32", 8: "v2.b32", 16: "v4.b32"}.get(nbytes)


def _load_with_policy(vtype: ir.Type, addr: ir.Value, nbytes: int, policy):
    """A global vector load, through inline PTX when a cache hint is set."""
    words = _asm_words(nbytes)
    if policy is None or words is None:
        return llvm.load(vtype, addr, alignment=nbytes)
    n = nbytes // 4
    i32 = ir.IntegerType.get_signless(32)
    outs = "{" + ", ".join(f"${i}" for i in range(n)) + "}" if n > 1 else "$0"
    rtype = ir.Type.parse(f"!llvm.struct<({', '.join(['i32'] * n)})>") if n > 1 else i32
    res = llvm.inline_asm(rtype, [addr], f"{policy[0]}.{words} {outs}, [${n}];",
                          ",".join(["=r"] * n + ["l"]), has_side_effects=False)
    parts = [llvm.extractvalue(i32, res, [i]) for i in range(n)] if n > 1 else [res]
    return llvm.bitcast(vtype, build_vector(parts, "i32") if n > 1 else parts[0])


def _store_with_policy(value: ir.Value, addr: ir.Value, nbytes: int, policy):
    words = _asm_words(nbytes)
    if policy is None or words is None:
        llvm.store(value, addr, alignment=nbytes)
        return
    n = nbytes // 4
    i32 = ir.IntegerType.get_signless(32)
    as_words = llvm.bitcast(ir.VectorType.get([n], i32) if n > 1 else i32, value)
    parts = [llvm.extractelement(as_words, c32(i)) for i in range(n)] if n > 1 else [as_words]
    ins = "{" + ", ".join(f"${i + 1}" for i in range(n)) + "}" if n > 1 else "$1"
    llvm.inline_asm(None, [addr, *parts], f"{policy[1]}.{words} [$0], {ins};",
                    ",".join(["l"] + ["r"] * n), has_side_effects=True)


def _policy(op) -> tuple[str, str] | None:
    return _PTX_CACHE.get(contracts.CACHE.get(op, "normal"))


def _guarded_load(addr: ir.Value, ok: ir.Value | None, vtype: ir.Type, fill: ir.Value,
                  align: int, policy=None) -> ir.Value:
    """A load where ok holds (always, when ok is None), else `fill`."""
    if ok is None:
        return _load_with_policy(vtype, addr, align, policy)
    op = scf.IfOp(ok, [vtype], has_else=True)
    with ir.InsertionPoint(op.then_block):
        scf.YieldOp([_load_with_policy(vtype, addr, align, policy)])
    with ir.InsertionPoint(op.else_block):
        scf.YieldOp([fill])
    return op.results[0]


def _guarded(cond: ir.Value | None, body) -> None:
    if cond is None:
        body()
        return
    op = scf.IfOp(cond)
    with ir.InsertionPoint(op.then_block):
        body()
        scf.YieldOp([])


@lowers("tk.load")
def lower_load(ctx: LoweringContext, op, src, *indices: ir.Value) -> Fragment:
    t = T.parse(op.result.type)
    layout = layout_of(t, ctx.num_warps)
    if isinstance(src, SharedRef):
        return _load_shared(ctx, src, layout, t)
    access = _GlobalTileAccess(ctx, src, layout, t.scope, list(indices))
    pieces, run = _pieces(layout, t.dtype)
    vtype = vector_type(run, t.dtype) if run > 1 else T.element_type(t.dtype)
    fill_scalar = constant(op.fill, t.dtype)
    fill = build_vector([fill_scalar] * run, t.dtype) if run > 1 else fill_scalar
    regs = []
    for r0, n in pieces:
        addr, ok = access.piece(r0, t.dtype)
        v = _guarded_load(addr, ok, vtype, fill, n * T.itemsize(t.dtype), _policy(op))
        regs += split_vector(v, n)
    return Fragment(regs, layout, t.dtype, t.scope)


def element_address(g: GlobalRef, indices) -> tuple[ir.Value, ir.Value | None]:
    """The address of one element at element coordinates, and whether it is
    inside g (unsigned compares: negative coordinates are outside); the last
    dim is contiguous, as every tensor argument's is (a 0-d tensor: its one
    element, always inside)."""
    offset = arith.addi(element_offset(g, indices[:-1]), arith.extsi(i64(), indices[-1])) \
        if indices else c64(0)
    addr = llvm.getelementptr(ptr(1), g.ptr, [offset], [-2**31],
                              T.element_type(g.type.dtype), llvm.GEPNoWrapFlags.inbounds)
    return addr, _and([_lt(i, d) for i, d in zip(indices, g.dims)])


@lowers("tk.load_scalar")
def lower_load_scalar(ctx: LoweringContext, op, src: GlobalRef, *indices: ir.Value) -> ir.Value:
    """One element at element coordinates, 0 past the end."""
    addr, ok = element_address(src, indices)
    return _guarded_load(addr, ok, T.element_type(src.type.dtype), constant(0, src.type.dtype), 4)


@lowers("tk.store")
def lower_store(ctx: LoweringContext, op, dst, frag: Fragment, *indices: ir.Value) -> None:
    if isinstance(dst, SharedRef):
        _store_shared(ctx, dst, frag, op)
        return
    frag = lane_exchange.widened(ctx, frag)     # 16-byte pieces where shuffles make them
    for r0, n, addr, conds in global_pieces(ctx, dst, frag, indices):
        value = build_vector(frag.regs[r0:r0 + n], frag.dtype)
        _guarded(_and(conds), lambda: _store_with_policy(value, addr, n * T.itemsize(frag.dtype),
                                                  _policy(op)))


def global_pieces(ctx: LoweringContext, dst: GlobalRef, frag: Fragment, indices):
    """(first register, registers, address, conditions) of each piece of frag
    written to dst at tile coordinates: the piece is written when all conditions
    hold (in bounds and, where several threads hold the same elements, first
    replica, so that each element is written once: tk.store, tk.atomic_add).
    Pieces are cut for frag's dtype, addresses are dst's elements (a part
    stored converted: tk.store_partial)."""
    access = _GlobalTileAccess(ctx, dst, frag.layout, frag.scope, list(indices))
    first = ctx.is_first_replica(frag.layout, frag.scope)
    pieces, _ = _pieces(frag.layout, frag.dtype)
    for r0, n in pieces:
        addr, ok = access.piece(r0, dst.type.dtype)
        yield r0, n, addr, [c for c in (ok, first) if c is not None]


@lowers("tk.gl_dim")
def lower_gl_dim(ctx: LoweringContext, op, src: GlobalRef) -> ir.Value:
    return src.dims[op.dim]


# ------------------------------------------------------------------ shared

def swizzled_offset(st: T.ST, row: ir.Value, col: ir.Value) -> ir.Value:
    """Byte offset of element (row, col) in a shared tile: column blocks of
    `swizzle` bytes per row (T.ST.byte_offset), 16-byte chunks XOR-swizzled
    within each 128-byte line, the pattern TMA's SWIZZLE_32B/64B/128B modes
    write and wgmma reads."""
    isz = T.itemsize(st.dtype)
    if st.block_cols >= st.cols:    # one column block, the whole row: any width (unswizzled)
        off = arith.addi(arith.muli(row, c32(st.block_bytes)), arith.muli(col, c32(isz)))
    else:                           # swizzled: blocks of a power of two columns
        shift = st.block_cols.bit_length() - 1
        block = arith.shrui(col, c32(shift))
        inner = arith.andi(col, c32(st.block_cols - 1))
        off = arith.addi(arith.muli(block, c32(st.rows * st.block_bytes)),
                         arith.addi(arith.muli(row, c32(st.block_bytes)),
                                    arith.muli(inner, c32(isz))))
    if st.swizzle:
        mask = st.swizzle // 16 - 1
        line = arith.andi(arith.shrui(off, c32(7)), c32(mask))
        off = arith.xori(off, arith.shli(line, c32(4)))
    return off


def _matrix_shape():
    return ir.Attribute.parse("#nvvm.ld_st_matrix_shape<m = 8, n = 8>")


def smem_addr(base: ir.Value, byte_offset: ir.Value) -> ir.Value:
    """base + byte_offset, in base's address space (shared, or shared::cluster
    for another block's tile: tk.in_block)."""
    return llvm.getelementptr(base.type, base, [byte_offset], [-2**31],
                              ir.IntegerType.get_signless(8), llvm.GEPNoWrapFlags.inbounds)


def _shared_offset(t, pos: list[ir.Value]) -> ir.Value:
    """Byte offset of the element at pos: (row, col) of a shared tile, or
    (index,) of a shared vector (its elements in order, unswizzled)."""
    if isinstance(t, T.SV):
        return arith.muli(pos[0], c32(T.itemsize(t.dtype)))
    return swizzled_offset(t, *pos)


def _shared_pieces(ctx, ref: SharedRef, layout, scope, dtype):
    """(first register, registers, address) of each access of a fragment to a
    shared tile or vector: a piece starts at a multiple of its length (the
    layout's low register bits), so the address is aligned for one ld/st."""
    pieces, run = _pieces(layout, dtype)
    starts = [r0 for r0, _ in pieces]
    for (r0, n), addr in zip(pieces, _addresses(ctx, ref, layout, scope, starts)):
        yield r0, n, addr


def _addresses(ctx, ref: SharedRef, layout, scope, starts: list[int]) -> list[ir.Value]:
    """The address of the element register r0 holds, for each r0 in starts,
    in this thread (its lane and warp bits placed by `layout`'s bases). Where
    the tile's byte layout allows (`_offset_constants`), one offset per thread
    and a constant XOR and sum per access; else each access's offset computed
    whole."""
    # In place: each access's offset is loop-invariant, and hoisted it would
    # hold a register per access for the whole loop (16 for a 64x64 bf16 tile
    # written per iteration: spilled in the attention backward).
    found = _offset_constants(ref.type, layout, tuple(starts))
    position = ctx.thread_position(layout, scope)
    if found is not None:
        consts, disjoint = found
        base = in_place(_shared_offset(ref.type, position))
        # The sums cannot wrap: flagged so, LLVM folds them into the address as
        # the ld/st's immediate (unflagged, the i32 sum is sign-extended whole:
        # a register per access). A XOR into bits the base never has is a sum.
        no_wrap = arith.IntegerOverflowFlags.nsw | arith.IntegerOverflowFlags.nuw

        def offset(x: int, a: int) -> ir.Value:
            if disjoint:
                x, a = 0, x + a
            v = arith.xori(base, c32(x)) if x else base
            return arith.addi(v, c32(a), overflow_flags=no_wrap) if a else v
        return [smem_addr(ref.ptr, offset(x, a)) for x, a in consts]
    thread = [in_place(t) for t in position]
    return [smem_addr(ref.ptr, _shared_offset(
        ref.type, [arith.addi(t, c32(p)) for t, p in zip(thread, layout.reg_position(r0))]))
        for r0 in starts]


def _byte_offset(t, pos: tuple[int, ...]) -> int:
    """_shared_offset in Python: where the element at pos lives."""
    return pos[0] * T.itemsize(t.dtype) if isinstance(t, T.SV) else t.byte_offset(*pos)


@functools.lru_cache(maxsize=512)
def _offset_constants(t, layout, starts: tuple[int, ...]):
    """Constants (x_r, a_r) with offset(p + reg_position(r)) == (offset(p) ^
    x_r) + a_r for the position p of every thread `layout` places (its lanes
    and warps), and whether no offset(p) shares a bit with any x_r (the XOR
    is then a sum); or None. Then a store or load of a tile needs one address
    register, not one per access. Tried first as a XOR alone (a_r = 0: the
    byte layout linear over the bits of the coordinates, as power-of-two sides
    and the XOR swizzle are, and a thread's bits and a register's apart), then
    as the XOR within a swizzle pattern's span (1024 bytes at 128-byte
    swizzle) and a sum above it (a column block of 80 rows starts 80·128
    bytes on: a sum, not a XOR). Checked thread by thread."""
    const = {q: _byte_offset(t, q) for q in map(layout.reg_position, starts)}
    span = t.swizzle * 8 if isinstance(t, T.ST) and t.swizzle else 1
    positions = [layout.position(0, lane, warp)     # (register 0 sits at the origin)
                 for lane in range(32) for warp in range(1 << len(layout.warp))]
    for split in ({q: (c, 0) for q, c in const.items()},
                  {q: (c % span, c - c % span) for q, c in const.items()}):
        if all(_byte_offset(t, tuple(a + b for a, b in zip(p, q))) ==
               (_byte_offset(t, p) ^ x) + a for p in positions for q, (x, a) in split.items()):
            used = functools.reduce(lambda u, xa: u | xa[0], split.values(), 0)
            disjoint = not any(_byte_offset(t, p) & used for p in positions)
            return tuple(split[layout.reg_position(r)] for r in starts), disjoint
    return None


# ldmatrix/stmatrix move 8x8 matrices of 16-bit elements, a matrix per pair
# of registers: lane l holds row l/4, columns 2(l%4) and 2(l%4)+1 (.trans: the
# transpose). Lane bases (and register bit 0) of a layout whose pairs are
# such matrices: `row`'s, and `col`'s for the .trans forms.
_MATRIX_CORE = {((1, 0),): (((1, 1), (1, 2), (0, 0), (0, 1), (0, 2)), False),
                ((0, 0),): (((0, 1), (0, 2), (1, 0), (1, 1), (1, 2)), True)}


def _matrix_pieces(ctx, ref: SharedRef, layout, scope: str, dtype: str):
    """(first register, registers, address, trans) of each ldmatrix/stmatrix
    that moves a 16-bit fragment to or from a shared tile, or None when the
    layout is not made of 8x8 matrices (then _shared_pieces moves it). An
    instruction moves up to four matrices, registers r0.. of every lane: lane
    l gives the address of row l%8 of matrix l/8, a 16-byte run of the tile's
    row (8 columns from a multiple of 8: inside one swizzle chunk)."""
    core = _MATRIX_CORE.get(layout.reg[:1])
    if (T.itemsize(dtype) != 2 or not isinstance(ref.type, T.ST) or len(layout.shape) != 2
            or core is None or layout.lane != core[0] or ref.type.block_cols % 8):
        return None
    trans = core[1]
    # Matrices per instruction: 4 when register bits 1 and 2 are bits (not a
    # repeat), so that matrix m of an instruction sits at a fixed offset from
    # its first whatever the instruction; lanes 8-15 and 16-23 then address
    # matrices 1 and 2 along those bits' steps.
    bits = 1
    while bits < 3 and bits < len(layout.reg) and len(layout.reg[bits] or ()) == 2 \
            and layout.num_regs % (2 << bits) == 0:
        bits += 1
    matrices = 1 << (bits - 1)
    row_lanes = ((0, 0), (0, 1), (0, 2))
    addressing = layouts.Layout(layout.shape, layout.reg,
                                row_lanes + tuple(layout.reg[1:bits]) + (None,) * (3 - bits),
                                layout.warp)
    step = 2 * matrices
    starts = list(range(0, layout.num_regs, step))
    return [(r0, step, addr, trans)
            for r0, addr in zip(starts, _addresses(ctx, ref, addressing, scope, starts))]


def _matrix_words(regs: list[ir.Value], dtype: str) -> list[ir.Value]:
    """Pairs of 16-bit registers as the b32 words ldmatrix/stmatrix move."""
    return [llvm.bitcast(i32(), build_vector(regs[i:i + 2], dtype))
            for i in range(0, len(regs), 2)]


def _matrix_halves(word: ir.Value, dtype: str) -> list[ir.Value]:
    """The two 16-bit registers of a b32 word ldmatrix gives."""
    return split_vector(llvm.bitcast(vector_type(2, dtype), word), 2)


def _matrix_layout(trans: bool):
    return nvvm.MMALayout.col if trans else nvvm.MMALayout.row


def _load_shared(ctx, ref: SharedRef, layout, t: T.RT) -> Fragment:
    # (ldmatrix reads this block's shared memory only: another block's tile
    # is read in plain pieces, ld.shared::cluster)
    matrices = None if ref.remote else _matrix_pieces(ctx, ref, layout, t.scope, t.dtype)
    if matrices is not None:
        regs = []
        for _, n, addr, trans in matrices:
            words = n // 2
            res = i32() if words == 1 else llvm.StructType.get_literal([i32()] * words)
            got = nvvm.ldmatrix(res, addr, words, _matrix_layout(trans), _matrix_shape(),
                                nvvm.LdStMatrixEltType.B16)
            for w in range(words):
                word = got if words == 1 else llvm.extractvalue(i32(), got, [w])
                regs += _matrix_halves(word, t.dtype)
        return Fragment(regs, layout, t.dtype, t.scope)
    regs = []
    for r0, n, addr in _shared_pieces(ctx, ref, layout, t.scope, t.dtype):
        vtype = vector_type(n, t.dtype) if n > 1 else T.element_type(t.dtype)
        regs += split_vector(llvm.load(vtype, addr, alignment=n * T.itemsize(t.dtype)), n)
    return Fragment(regs, layout, t.dtype, t.scope)


def fence_for_async_readers(op, remote: bool = False) -> None:
    """fence.proxy.async after this thread's generic writes of op, when
    tk-proxy-fences found an async-proxy read (wgmma, TMA store) that may
    follow them (passes/fences.py: why here, before any barrier); remote:
    the writes went to another block's tile (shared::cluster)."""
    if contracts.PROXY_FENCE.get(op, False):
        space = nvvm.SharedSpace.shared_cluster if remote else nvvm.SharedSpace.shared_cta
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=space)


def _store_shared(ctx, ref: SharedRef, frag: Fragment, op) -> None:
    # A block-scope tile: other threads may still read the tile's old contents,
    # and will read the new ones: a barrier on each side. (Conservative: a pass
    # that drops the barriers the memory model does not need is future work.)
    # A warpgroup-scope tile is written by part of the block, which
    # synchronises itself (tk.named_barrier), as in ThunderKittens: a block
    # barrier here would hang a warp-specialized kernel. A warp-scope tile's
    # lanes read each other's elements too, and nothing a kernel writes
    # orders them (the interpreter runs a warp as one): bar.warp.sync on each
    # side, which orders the lanes' shared-memory accesses and keeps ptxas
    # from moving a lane's loads of other lanes' elements across the store;
    # over the lanes that reach it (activemask), so a store some lanes skip
    # (a [partial-tile] lint warning) does not hang.
    block, warp = frag.scope == "block", frag.scope == "warp"
    _order_before_and_after(block, warp)
    first = ctx.is_first_replica(frag.layout, frag.scope)
    # (stmatrix writes this block's shared memory only: st.shared::cluster pieces)
    matrices = None if ref.remote else _matrix_pieces(ctx, ref, frag.layout, frag.scope,
                                                      frag.dtype)
    if matrices is not None:
        for r0, n, addr, trans in matrices:
            words = _matrix_words(frag.regs[r0:r0 + n], frag.dtype)
            _guarded(first, lambda: nvvm.stmatrix(addr, words, _matrix_layout(trans),
                                                  _matrix_shape(), nvvm.LdStMatrixEltType.B16))
    else:
        for r0, n, addr in _shared_pieces(ctx, ref, frag.layout, frag.scope, frag.dtype):
            value = build_vector(frag.regs[r0:r0 + n], frag.dtype)
            _guarded(first, lambda: llvm.store(value, addr,
                                               alignment=n * T.itemsize(frag.dtype)))
    fence_for_async_readers(op, ref.remote)
    _order_before_and_after(block, warp)


def _order_before_and_after(block: bool, warp: bool) -> None:
    """The barrier on each side of a shared store of a block- or warp-scope
    tile (_store_shared: why)."""
    if block:
        nvvm.barrier0()
    elif warp:
        llvm.inline_asm(None, [], "{ .reg .b32 m; activemask.b32 m; bar.warp.sync m; }",
                        "~{memory}", has_side_effects=True)


@lowers("tk.alloc_st", "tk.alloc_sv", "tk.alloc_sem")
def lower_alloc(ctx: LoweringContext, op) -> SharedRef:
    offset, stride = contracts.OFFSET.get(op), contracts.STRIDE.get(op)
    return SharedRef(smem_addr(ctx.smem_base, c32(offset)), T.parse(op.result.type), stride)


@lowers("tk.index")
def lower_index(ctx: LoweringContext, op, base: SharedRef, index: ir.Value) -> SharedRef:
    offset = arith.muli(index, c32(base.stride))
    return SharedRef(smem_addr(base.ptr, offset), base.type)


@lowers("tk.subtile")
def lower_subtile(ctx: LoweringContext, op, src: SharedRef, row: ir.Value) -> SharedRef:
    sub = T.parse(op.result.type)
    # One column block (tk-verify): the rows are consecutive lines of block_bytes.
    offset = arith.muli(row, c32(src.type.block_bytes))
    return SharedRef(smem_addr(src.ptr, offset), sub)


@lowers("tk.in_block")
def lower_in_block(ctx: LoweringContext, op, src: SharedRef, rank: ir.Value) -> SharedRef:
    # mapa: the same offset in block `rank`'s shared memory, as a shared::cluster
    # address; the pieces' offsets add to it as to a tile of this block.
    return SharedRef(nvvm.mapa(ptr(7), src.ptr, rank), src.type, src.stride)


@lowers("tk.column_block")
def lower_column_block(ctx: LoweringContext, op, src: SharedRef, index: ir.Value) -> SharedRef:
    # Block j is stored after the j before it, each rows x block_bytes (ST.byte_offset).
    offset = arith.muli(index, c32(src.type.rows * src.type.block_bytes))
    return SharedRef(smem_addr(src.ptr, offset), T.parse(op.result.type))


@lowers("tk.copy")
def lower_copy(ctx: LoweringContext, op, dst, src, *indices: ir.Value) -> None:
    """gl <-> st in 16-byte chunks, chunk k by thread k mod (threads in block)."""
    to_shared = isinstance(dst, SharedRef)
    sref, g = (dst, src) if to_shared else (src, dst)
    st, rank = sref.type, g.type.rank
    coords = list(indices)
    isz = T.itemsize(st.dtype)
    per_chunk = 16 // isz
    chunks_per_row = st.cols // per_chunk
    threads = 32 * ctx.num_warps
    # LLVM has no fp8 vectors (nor GEPs over fp8): their chunks move as four i32 words
    raw = st.dtype.startswith("f8")
    vtype = ir.VectorType.get([4], i32()) if raw else vector_type(per_chunk, st.dtype)
    element = ir.IntegerType.get_signless(8) if raw else T.element_type(st.dtype)
    nvvm.barrier0()
    for first_chunk in range(0, st.rows * chunks_per_row, threads):
        k = arith.addi(ctx.tid(), c32(first_chunk))
        row, col = arith.divui(k, c32(chunks_per_row)), \
            arith.muli(arith.remui(k, c32(chunks_per_row)), c32(per_chunk))
        grow = arith.addi(arith.muli(coords[rank - 2], c32(st.rows)), row)
        gcol = arith.addi(arith.muli(coords[rank - 1], c32(st.cols)), col)
        offset = arith.extsi(i64(), gcol)
        for c, stride in zip(coords[:rank - 2] + [grow], g.strides):
            offset = arith.addi(offset, arith.muli(arith.extsi(i64(), c), stride))
        gaddr = llvm.getelementptr(ptr(1), g.ptr, [offset], [-2**31], element,
                                   llvm.GEPNoWrapFlags.inbounds)
        saddr = smem_addr(sref.ptr, swizzled_offset(st, row, col))
        in_tile = _lt(k, c32(st.rows * chunks_per_row))
        in_bounds = _and([in_tile, _lt(grow, g.dims[rank - 2]), _lt(gcol, g.dims[rank - 1])]
                         + [_lt(c, d) for c, d in zip(coords[:rank - 2], g.dims)])
        if to_shared:
            zero = build_vector([c32(0)] * 4, "i32") if raw else \
                build_vector([float_constant(0.0, st.dtype)] * per_chunk, st.dtype)
            v = _guarded_load(gaddr, in_bounds, vtype, zero, 16)
            _guarded(in_tile, lambda: llvm.store(v, saddr, alignment=16))
        else:
            _guarded(in_bounds, lambda: llvm.store(llvm.load(vtype, saddr, alignment=16),
                                                   gaddr, alignment=16))
    if to_shared:
        fence_for_async_readers(op)
    nvvm.barrier0()
