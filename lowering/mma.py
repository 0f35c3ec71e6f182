"""Lowering of tk.mma / tk.mma_wait to wgmma.

A shared operand is described to wgmma by a 64-bit matrix descriptor:
start address >> 4 (bits 0-13), leading byte offset >> 4 (16-29), stride byte
offset >> 4 (32-45), swizzle mode (62-63: 1 = 128B, 2 = 64B, 3 = 32B). Our
swizzled tiles are column blocks of S = swizzle bytes per row, 8-row swizzle
atoms of 8*S bytes, bases aligned to the atom (passes/smem.py):

  K-major (rows = M or N, columns = K):   SBO = 8*S between 8-row groups; LBO
      unused. One instruction's K (k16 of 16-bit types, k32 of fp8) is 32
      bytes of a row: a K step moves 32 bytes along it, a 64-row step 64*S.
  MN-major (rows = K, columns = M or N):  LBO = rows*S between column blocks
      (block_cols M/N elements each), SBO = 8*S between 8-row groups of K.
      A k16 step moves 16 rows (16*S bytes), a 64-column step 64/block_cols
      column blocks. (16-bit types only: wgmma reads 8-bit types K-major.)

The accumulator is the `row` layout fragment; its registers for 64 rows are,
in order, the wgmma accumulator registers (lowering/../dialects/layout.py,
mma_row), so the fragment is passed to wgmma as is, 64 rows at a time.
"""
from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, llvm, nvvm

from ..dialects import tk, types as T
from ..dtypes import TILE_DTYPES
from . import descriptors
from .context import LoweringContext, build_vector, c32, c64, i32, i64, in_place, lowers
from .fragments import Fragment, SharedRef

def _wgmma_type(dtype: str):
    """The wgmma operand type of a tile dtype (the table's `wgmma` column)."""
    return getattr(nvvm.WGMMATypes, TILE_DTYPES[dtype].wgmma)


def _offset(st: T.ST, k_major: bool, k_step: int, mn_step: int) -> int:
    """Byte offset of the (mn_step-th 64-wide, k_step-th instruction-K-deep) operand block."""
    if k_major:
        k_bytes = tk.wgmma_k(st.dtype) * T.itemsize(st.dtype) * k_step
        block, inner = divmod(k_bytes, st.block_bytes)
        return block * st.rows * st.block_bytes + inner + 64 * mn_step * st.block_bytes
    return 16 * k_step * st.block_bytes + (64 * mn_step // st.block_cols) * st.rows * st.block_bytes


class Descriptors:
    """Descriptors of one shared operand: the run-time base once, offsets as
    constants; `encode` (lowering/descriptors.py) makes the constant fields of
    wgmma's (the default) or tcgen05's form."""

    def __init__(self, ref: SharedRef, k_major: bool, encode=descriptors.wgmma_smem):
        self.st, self.k_major = ref.type, k_major
        addr = llvm.ptrtoint(i32(), ref.ptr)
        start = arith.shrui(arith.andi(addr, arith.constant(i32(), 0x3FFFF)),
                            arith.constant(i32(), 4))
        bits = encode(*descriptors.operand_offsets(ref.type, k_major), ref.type.swizzle)
        # Only the low word varies (start address, bits 0-13; offsets stay inside
        # shared memory, so adding one never carries out of them), but the
        # descriptor is made once as an i64 and each k-step's is a 64-bit add to
        # it: in uniform registers ptxas makes that one UIADD3.64, where a low
        # word added and paired with the high one again costs a UIADD3 and a
        # UMOV per k-step (the attention backward's step: 579 -> 556).
        high = bits >> 32
        high -= (high >> 31) << 32       # as a signed i32 (64B swizzle sets bit 63)
        low = arith.ori(start, c32(bits & 0xFFFF_FFFF))
        # In place: LLVM would hoist a loop-invariant operand's (k-step) descriptors
        # out of the loop, a register each for the whole loop (spilled in the
        # attention backward); recomputed here they are an add per k-step.
        self.base = in_place(arith.ori(arith.extui(i64(), in_place(low)), c64(high << 32)))

    def at(self, k_step: int, mn_step: int = 0) -> ir.Value:
        off = _offset(self.st, self.k_major, k_step, mn_step)
        no_wrap = arith.IntegerOverflowFlags.nsw | arith.IntegerOverflowFlags.nuw
        return arith.addi(self.base, c64(off >> 4), overflow_flags=no_wrap) if off else self.base


def _struct(n: int) -> ir.Type:
    return ir.Type.parse(f"!llvm.struct<({', '.join(['f32'] * n)})>")


def _pack(regs: list[ir.Value]) -> ir.Value:
    s = llvm.mlir_undef(_struct(len(regs)))
    for i, r in enumerate(regs):
        s = llvm.insertvalue(s, r, [i])
    return s


def _unpack(s: ir.Value, n: int) -> list[ir.Value]:
    return [llvm.extractvalue(ir.F32Type.get(), s, [i]) for i in range(n)]


def fence_registers(regs: list[ir.Value], kind: str = "f") -> list[ir.Value]:
    """Each register through an empty volatile asm that "rewrites" it. LLVM
    sees the accumulators as ready when the wgmma asm returns, and would move
    their uses (a bf16 conversion, a loop's phi copies) above the wgmma wait;
    ptxas then serializes every wgmma (C7514). Uses of the fenced values stay
    after the fence, and the fence stays after the wait (both volatile)."""
    return [llvm.inline_asm(r.type, [r], "", f"={kind},0", has_side_effects=True) for r in regs]


def _fence_where_computed(regs: list[ir.Value]) -> list[ir.Value]:
    """fence_registers(regs) placed where the last of them is computed in this
    block, not just above the MMA reading them: the fences' copies (a value in
    two accumulator registers, as a column broadcast is) then come before any
    MMA group issued in between. Registers written for an MMA after another
    group was issued make ptxas wait for that group first (C7517), so the
    two no longer overlap."""
    block = ir.InsertionPoint.current.block
    last = None
    for r in regs:
        if isinstance(r.owner, ir.Block):
            continue                                    # a block argument
        op = r.owner.operation
        if op.block == block and (last is None or last.is_before_in_block(op)):
            last = op
    if last is None:                # all computed outside this block
        return fence_registers(regs)
    with ir.InsertionPoint.after(last):
        return fence_registers(regs)


def _wgmma_register_a(acc: list[ir.Value], a: list[ir.Value], desc_b: ir.Value, n: int,
                      dtype: str, trans_b: bool, accumulate: bool = True) -> list[ir.Value]:
    """wgmma with A from registers (inline PTX: the NVVM op takes A as a
    descriptor only). `a` are the 4 packed 16-bit pairs of the A fragment;
    accumulate=False: D = A·B (scale-d 0), acc's registers are not read."""
    m = len(acc)
    outs = ", ".join(f"${i}" for i in range(m))
    ins = ", ".join(f"${m + i}" for i in range(4))
    text = (f"{{ .reg .pred p; setp.ne.b32 p, {int(accumulate)}, 0; "      # scale-d
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dtype}.{dtype} "
            f"{{{outs}}}, {{{ins}}}, ${m + 4}, p, 1, 1, {int(trans_b)}; }}")
    constraints = ",".join(["=f"] * m + ["r"] * 4 + ["l"] + [str(i) for i in range(m)])
    res = llvm.inline_asm(_struct(m), [*a, desc_b, *acc], text, constraints,
                          has_side_effects=True)
    return _unpack(res, m)


def _a_fragment(frag: Fragment, mb: int, ks: int, k: int) -> list[ir.Value]:
    """The A registers of rows 64*mb.. and columns 16*ks.. as 4 packed pairs.
    In the row layout of an M x K tile the registers of one 64x16 block are 8
    consecutive ones (bit 0: column + 1, bit 1: row + 8, bit 2: column + 8),
    the blocks ordered along K, then M; pair i is wgmma's a_i."""
    base = (mb * (k // 16) + ks) * 8
    pairs = []
    for i in range(4):
        lo, hi = frag.regs[base + 2 * i], frag.regs[base + 2 * i + 1]
        vec = build_vector([lo, hi], frag.dtype)
        pairs.append(llvm.bitcast(i32(), vec))
    return pairs


@lowers("tk.mma")
def lower_mma(ctx: LoweringContext, op, acc: Fragment, a_ref, b_ref: SharedRef) -> Fragment:
    """The wgmma group of acc + op(a) op(b); a is a SharedRef or (register A)
    a Fragment. The result stays in flight until tk.mma_wait fences it."""
    from_zero = _is_zeros(op.acc)
    if from_zero:
        # D = A·B: the first k-step's scale-d is 0, so no register is zeroed or
        # read (zeros would be live registers held across the wgmmas' issue).
        acc = acc.like([llvm.mlir_undef(ir.F32Type.get())] * len(acc.regs))
    elif op.acc not in ctx.in_flight:
        # Computed by threads: fenced, so that LLVM keeps its computation above
        # the wgmma.fence.
        acc = acc.like(_fence_where_computed(acc.regs))
    elif len(list(op.acc.uses)) == 1:
        # A chain of MMAs into one result: the registers pass to this MMA, and
        # a later wait must not fence (keep alive) the old value: LLVM would
        # copy its registers mid-MMA, and ptxas serialize every wgmma (C7514).
        del ctx.in_flight[op.acc]
    trans_a, trans_b = bool(op.trans_a), bool(op.trans_b)
    t = T.parse(op.acc.type)
    a_t = T.parse(op.a.type)
    k = a_t.rows if trans_a else a_t.cols
    n = t.cols
    b_t = T.parse(op.b.type)
    ctx.in_flight[op.result] = ctx.depth
    if isinstance(a_ref, Fragment):
        return _lower_register_a(acc, a_ref, b_ref, t, k, trans_b, from_zero)
    da, db = Descriptors(a_ref, not trans_a), Descriptors(b_ref, not trans_b)
    k_step = tk.wgmma_k(a_t.dtype)
    shape = ir.Attribute.parse(f"#nvvm.shape<m = 64, n = {n}, k = {k_step}>")
    layout_a = nvvm.MMALayout.col if trans_a else nvvm.MMALayout.row
    layout_b = nvvm.MMALayout.row if trans_b else nvvm.MMALayout.col
    type_a, type_b = _wgmma_type(a_t.dtype), _wgmma_type(b_t.dtype)
    per_block = n // 2                       # accumulator registers per 64 rows
    nvvm.wgmma_fence_aligned()
    regs = list(acc.regs)
    for mb in range(t.rows // 64):
        d = _pack(regs[mb * per_block:(mb + 1) * per_block])
        for ks in range(k // k_step):
            d = nvvm.wgmma_mma_async(
                _struct(per_block), d, da.at(ks, mb), db.at(ks), shape, type_a, type_b,
                nvvm.WGMMATypes.f32,
                nvvm.WGMMAScaleOut.zero if from_zero and ks == 0 else nvvm.WGMMAScaleOut.one,
                nvvm.WGMMAScaleIn.one,
                nvvm.WGMMAScaleIn.one, layout_a, layout_b)
        regs[mb * per_block:(mb + 1) * per_block] = _unpack(d, per_block)
    nvvm.wgmma_commit_group_sync_aligned()
    return acc.like(regs)


def _lower_register_a(acc: Fragment, a: Fragment, b_ref: SharedRef, t: T.RT, k: int,
                      trans_b: bool, from_zero: bool) -> Fragment:
    db = Descriptors(b_ref, not trans_b)
    per_block = t.cols // 2
    regs = list(acc.regs)
    for mb in range(t.rows // 64):
        d = regs[mb * per_block:(mb + 1) * per_block]
        for ks in range(k // 16):
            # A wgmma.fence between every write of an A register and the wgmma
            # reading it: the k-step's packed pairs go through a volatile asm
            # first, or LLVM would sink their conversions (cvt.rn.bf16x2.f32)
            # below the fence. One fence per k-step (as CUTLASS's mainloop
            # arrives per k-block) keeps the conversions interleaved with the
            # wgmmas: fencing all A first made ptxas spill in the attention
            # backward.
            pairs = fence_registers(_a_fragment(a, mb, ks, k), "r")
            nvvm.wgmma_fence_aligned()
            d = _wgmma_register_a(d, pairs, db.at(ks), t.cols, a.dtype, trans_b,
                                  accumulate=not (from_zero and ks == 0))
        regs[mb * per_block:(mb + 1) * per_block] = d
    nvvm.wgmma_commit_group_sync_aligned()
    return acc.like(regs)


def _is_zeros(acc: ir.Value) -> bool:
    """Is acc a tile of zeros (tk.zeros: a tk.fill of 0)?"""
    owner = acc.owner
    if isinstance(owner, ir.Block):
        return False
    op = owner.operation
    return op.name == "tk.fill" and float(op.opview.value) == 0.0


@lowers("tk.mma_wait")
def lower_mma_wait(ctx: LoweringContext, op) -> None:
    nvvm.wgmma_wait_group_sync_aligned(op.pending)
    # Fence every accumulator still in flight (the wait completes it, or it is
    # the newest `pending` groups', which stay in flight). A wait has no result:
    # it rebinds the values it completes, the one rule that binds beside its own.
    # One bound in this block is rebound for good; one bound outside it, for the
    # rest of this block only (it stays in flight for the code after the block:
    # another path may not have waited), so its uses below the wait here read
    # the fenced registers and LLVM cannot move them above the wait.
    for value, depth in list(ctx.in_flight.items()):
        frag = ctx.lookup(value)
        fenced = frag.like(fence_registers(frag.regs))
        if depth == ctx.depth:
            ctx.bind(value, fenced)
            if op.pending == 0:
                del ctx.in_flight[value]
        else:
            _bind_in_block(ctx, value, fenced)
    # A loop's carried accumulator (the block argument of a loop around the
    # wait) is not among them: it is in flight when what enters the loop is, or
    # what the body yields for it may be (an mma, or an if/loop result that may
    # be one; a value not in flight is fenced for nothing, at no cost).
    for value, levels in _carried_in_flight(ctx, op.operation):
        frag = ctx.lookup(value)
        fenced = frag.like(fence_registers(frag.regs))
        if levels == 0:                      # the wait is in the loop's own body
            ctx.bind(value, fenced)
        else:
            _bind_in_block(ctx, value, fenced)


def _bind_in_block(ctx: LoweringContext, value, fenced: Fragment) -> None:
    ctx.bind_in_block(value, fenced, fenced.regs[0].owner.operation)


def _carried_in_flight(ctx: LoweringContext, op: ir.Operation):
    """(carried value, how many ifs/loops lie between the wait and its loop's
    body) for the register tiles carried by the loops around op that may be in
    flight there."""
    levels = 0
    parent = op.parent
    while parent is not None and parent.name in ("scf.for", "scf.if"):
        if parent.name == "scf.for":
            loop = parent.opview
            yields = list(loop.body.operations)[-1].operands
            for arg, init, y in zip(loop.inner_iter_args, loop.initArgs, yields):
                if isinstance(ctx.values.get(arg), Fragment) and \
                        (init in ctx.in_flight or _maybe_async(y, set())):
                    yield arg, levels
        levels += 1
        parent = parent.parent


def _maybe_async(v: ir.Value, seen: set) -> bool:
    """May v be the result of an async op (tk.mma) still in flight: its own
    result, or what an if or loop passes on from one?"""
    if v in seen:
        return False
    seen.add(v)
    owner = v.owner
    if isinstance(owner, ir.Block):          # a loop's carried value
        loop = owner.owner
        if loop is None or loop.operation.name != "scf.for" or ir.BlockArgument(v).arg_number == 0:
            return False
        i = ir.BlockArgument(v).arg_number - 1
        yields = list(loop.opview.body.operations)[-1].operands
        return _maybe_async(loop.opview.initArgs[i], seen) or _maybe_async(yields[i], seen)
    op = owner.operation
    d = tk.op_def(op)
    if d is not None:
        return d.async_result
    index = list(op.results).index(v)
    if op.name == "scf.if":
        return any(_maybe_async(y, seen) for y in _yielded(op, index))
    if op.name == "scf.for":
        return _maybe_async(op.opview.initArgs[index], seen) or \
            any(_maybe_async(y, seen) for y in _yielded(op, index))
    return False


def _yielded(region_op: ir.Operation, index: int) -> list[ir.Value]:
    out = []
    for region in region_op.regions:
        for block in region.blocks:
            ops = block.operations
            if len(ops) and ops[len(ops) - 1].name == "scf.yield":
                out.append(ops[len(ops) - 1].operands[index])
    return out
