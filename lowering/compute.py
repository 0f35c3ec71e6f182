"""Lowering of register-to-register tk ops: fill, cvt, elementwise maps,
broadcasts. Each is a loop over the fragment's registers; a broadcast finds
the vector register for a tile register through the layout (slice_register).

Transcendentals use the PTX approximations (ex2/lg2/rsqrt.approx.ftz.f32,
relative error ~2^-22), computed in f32 whatever the tile's dtype, as
ThunderKittens and Triton do for exp-heavy kernels like softmax.
"""
from __future__ import annotations

import math

from mlir import ir
from mlir.dialects import arith, llvm
from mlir.dialects import math as mmath

from ..dialects import types as T
from .context import LoweringContext, float_constant, lowers
from .fragments import Fragment, layout_of

F32 = "f32"


def _f32() -> ir.Type:
    return ir.F32Type.get()


def convert(v: ir.Value, src: str, dst: str) -> ir.Value:
    if src == dst:
        return v
    if src != F32:
        v = arith.extf(_f32(), v)
    return v if dst == F32 else arith.truncf(T.element_type(dst), v)


def _ptx_unary(instr: str):
    def emit(x: ir.Value) -> ir.Value:
        return llvm.inline_asm(_f32(), [x], f"{instr} $0, $1;", "=f,f")
    return emit


_ex2, _lg2 = _ptx_unary("ex2.approx.ftz.f32"), _ptx_unary("lg2.approx.ftz.f32")
_rsqrt, _sqrt = _ptx_unary("rsqrt.approx.ftz.f32"), _ptx_unary("sqrt.approx.ftz.f32")

# Unary maps in f32.
UNARY_F32 = {
    "exp": lambda x: _ex2(arith.mulf(x, float_constant(math.log2(math.e), F32))),
    "exp2": _ex2,
    "log": lambda x: arith.mulf(_lg2(x), float_constant(math.log(2.0), F32)),
    "sqrt": _sqrt,
    "rsqrt": _rsqrt,
    "abs": mmath.absf,
    "neg": arith.negf,
    "relu": lambda x: arith.maximumf(x, float_constant(0.0, F32)),
}
# Binary maps in the tile's own dtype (bf16/f16 arithmetic is native on sm_90).
BINARY = {"add": arith.addf, "sub": arith.subf, "mul": arith.mulf, "div": arith.divf,
          "max": arith.maximumf, "min": arith.minimumf}


@lowers("tk.fill")
def lower_fill(ctx: LoweringContext, op) -> None:
    t = T.parse(op.result.type)
    layout = layout_of(t, ctx.num_warps)
    c = float_constant(op.value, t.dtype)
    ctx.bind(op.result, Fragment([c] * layout.num_regs, layout, t.dtype, t.scope))


@lowers("tk.cvt")
def lower_cvt(ctx: LoweringContext, op) -> None:
    frag = ctx.lookup(op.src)
    dst = T.parse(op.result.type).dtype
    ctx.bind(op.result, frag.like([convert(r, frag.dtype, dst) for r in frag.regs], dst))


def _unary(ctx: LoweringContext, op) -> None:
    frag = ctx.lookup(op.src)
    fn = UNARY_F32[op.operation.name.removeprefix("tk.")]
    regs = [convert(fn(convert(r, frag.dtype, F32)), F32, frag.dtype) for r in frag.regs]
    ctx.bind(op.result, frag.like(regs))


def _binary(ctx: LoweringContext, op) -> None:
    a, b = ctx.lookup(op.lhs), ctx.lookup(op.rhs)
    fn = BINARY[op.operation.name.removeprefix("tk.")]
    if isinstance(b, Fragment):
        regs = [fn(x, y) for x, y in zip(a.regs, b.regs)]
    else:   # a scalar, converted once
        s = convert(b, F32, a.dtype)
        regs = [fn(x, s) for x in a.regs]
    ctx.bind(op.result, a.like(regs))


for _name in UNARY_F32:
    lowers(f"tk.{_name}")(_unary)
for _name in BINARY:
    lowers(f"tk.{_name}")(_binary)


@lowers("tk.broadcast")
def lower_broadcast(ctx: LoweringContext, op) -> None:
    tile, vec = ctx.lookup(op.src), ctx.lookup(op.vec)
    keep = 0 if op.axis == "row" else 1
    fn = BINARY[op.kind]
    regs = [fn(x, vec.regs[tile.layout.slice_register(keep, i)])
            for i, x in enumerate(tile.regs)]
    ctx.bind(op.result, tile.like(regs))


@lowers("tk.slice")
def lower_slice(ctx: LoweringContext, op) -> None:
    from ..passes.verify import slice_registers
    src = ctx.lookup(op.src)
    picked = slice_registers(T.parse(op.src.type), T.parse(op.result.type), op.row, op.col,
                             ctx.num_warps)
    sub = layout_of(T.parse(op.result.type), ctx.num_warps)
    ctx.bind(op.result, Fragment([src.regs[r] for r in picked], sub, src.dtype, src.scope))
