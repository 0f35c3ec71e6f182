"""Lowering of register-to-register tk ops: fill, cvt, elementwise maps,
broadcasts, slices. Each rule says what to compute per register; the
Fragment (lowering/fragments.py) applies it along its layout.

Transcendentals use the PTX approximations (ex2/lg2/rsqrt.approx.ftz.f32,
relative error ~2^-22), computed in f32 whatever the tile's dtype, as
ThunderKittens and Triton do for exp-heavy kernels like softmax; rcp is
rcp.approx.ftz.f32.

Tile arithmetic may contract (as CUDA's and Triton's do by default): add, sub
and mul carry `#arith.fastmath<contract>`, so the NVPTX backend fuses
`x * s - m` into one fma.rn.f32 (one rounding instead of two);
`@tk.kernel(fp_contract=False)` turns it off. Tile division is div.full.f32
(Triton's `/`: full range, at most 2 ulp, much cheaper than IEEE div.rn),
computed in f32 for bf16/f16 tiles too.
"""
from __future__ import annotations

import functools
import math

from mlir import ir
from mlir.dialects import arith, llvm, nvvm, scf
from mlir.dialects import math as mmath

from ..dialects import contracts, types as T
from ..dialects.tk import LOGICAL
from .context import LoweringContext, constant, float_constant, lowers
from .fragments import F32, Fragment, layout_of


def _ptx_unary(instr: str):
    def emit(x: ir.Value) -> ir.Value:
        return llvm.inline_asm(ir.F32Type.get(), [x], f"{instr} $0, $1;", "=f,f")
    return emit


_ex2, _lg2 = _ptx_unary("ex2.approx.ftz.f32"), _ptx_unary("lg2.approx.ftz.f32")
_rsqrt, _sqrt = _ptx_unary("rsqrt.approx.ftz.f32"), _ptx_unary("sqrt.approx.ftz.f32")
_rcp = _ptx_unary("rcp.approx.ftz.f32")


def _div(x: ir.Value, y: ir.Value) -> ir.Value:
    """x / y by div.full.f32, through f32 for a narrower dtype (a scalar divisor
    of a bf16/f16 tile is already rounded to the tile's dtype, as in every
    tile-with-scalar op)."""
    f32 = ir.F32Type.get()
    if x.type == f32:
        return llvm.inline_asm(f32, [x, y], "div.full.f32 $0, $1, $2;", "=f,f,f")
    return arith.truncf(x.type, _div(arith.extf(f32, x), arith.extf(f32, y)))

# Unary maps in f32.
UNARY_F32 = {
    "exp": lambda x: _ex2(arith.mulf(x, float_constant(math.log2(math.e), F32))),
    "exp2": _ex2,
    "log": lambda x: arith.mulf(_lg2(x), float_constant(math.log(2.0), F32)),
    "sqrt": _sqrt,
    "rsqrt": _rsqrt,
    "rcp": _rcp,
    "abs": mmath.absf,
    "neg": arith.negf,
    "relu": lambda x: arith.maximumf(x, float_constant(0.0, F32)),
}
# Binary maps in the tile's own dtype (bf16/f16 arithmetic is native on sm_90).
BINARY = {"add": arith.addf, "sub": arith.subf, "mul": arith.mulf, "div": _div,
          "max": arith.maximumf, "min": arith.minimumf}
CONTRACTIBLE = ("add", "sub", "mul")    # may fuse into an fma with their neighbours


def _binary_fn(ctx: LoweringContext, name: str):
    """BINARY[name], with the contract flag when the kernel allows contraction."""
    fn = BINARY[name]
    if not (ctx.fp_contract and name in CONTRACTIBLE):
        return fn
    contract = ir.Attribute.parse("#arith.fastmath<contract>")
    return lambda x, y: fn(x, y, fastmath=contract)


# ... and on i32 tiles (signed, as Python's ints; div is refused by tk-verify),
# the logical ops on bool tiles (masks) too.
INT_BINARY = {"add": arith.addi, "sub": arith.subi, "mul": arith.muli, "max": arith.maxsi,
              "min": arith.minsi, "and": arith.andi, "or": arith.ori, "xor": arith.xori}


@lowers("tk.fill")
def lower_fill(ctx: LoweringContext, op) -> Fragment:
    t = T.parse(op.result.type)
    return Fragment.full(constant(op.value, t.dtype), t, ctx.num_warps)


@lowers("tk.cvt")
def lower_cvt(ctx: LoweringContext, op, src: Fragment) -> Fragment:
    return src.astype(T.parse(op.result.type).dtype)


def _unary(ctx: LoweringContext, op, src: Fragment) -> Fragment:
    return src.map(UNARY_F32[op.operation.name.removeprefix("tk.")], in_f32=True)


def _binary(ctx: LoweringContext, op, lhs: Fragment, rhs) -> Fragment:
    name = op.operation.name.removeprefix("tk.")
    fn = _binary_fn(ctx, name) if T.is_float(lhs.dtype) else INT_BINARY[name]
    return lhs.zip_with(rhs, fn)


for _name in UNARY_F32:
    lowers(f"tk.{_name}")(_unary)
for _name in BINARY:
    lowers(f"tk.{_name}")(_binary)
for _name in LOGICAL:
    lowers(f"tk.{_name}")(_binary)


@lowers("tk.broadcast")
def lower_broadcast(ctx: LoweringContext, op, src: Fragment, vec: Fragment) -> Fragment:
    fn = _binary_fn(ctx, op.kind) if T.is_float(src.dtype) else INT_BINARY[op.kind]
    axis = 0 if op.axis == "row" else 1
    if not contracts.SKIP_ONES.get(op, False):
        return src.broadcast(vec, axis, fn)
    # A warp-uniform branch (vote.any), so no lanes diverge: a warp whose
    # factors are all 1 keeps its registers; any other factor (NaN too) multiplies.
    one = float_constant(1.0, vec.dtype)
    used = sorted({src.layout.slice_register(axis, i) for i in range(len(src.regs))})
    thread_needs = functools.reduce(arith.ori, (
        arith.cmpf(arith.CmpFPredicate.UNE, vec.regs[r], one) for r in used))
    warp_needs = nvvm.vote_sync(ir.IntegerType.get_signless(1), constant(-1, "i32"),
                                thread_needs, nvvm.VoteSyncKind.any)
    branch = scf.IfOp(warp_needs, [r.type for r in src.regs], has_else=True)
    with ir.InsertionPoint(branch.then_block):
        scf.YieldOp(src.broadcast(vec, axis, fn).regs)
    with ir.InsertionPoint(branch.else_block):
        scf.YieldOp(src.regs)
    return src.like(list(branch.results))


@lowers("tk.slice")
def lower_slice(ctx: LoweringContext, op, src: Fragment) -> Fragment:
    from ..dialects.tile_rules import slice_registers
    sub = T.parse(op.result.type)
    picked = slice_registers(T.parse(op.src.type), sub, op.row, op.col, ctx.num_warps)
    return src.select(picked, layout_of(sub, ctx.num_warps))
