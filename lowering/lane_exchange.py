"""Lane exchanges: a register tile's elements traded between the lanes of a
warp by shuffles, so that each thread holds longer runs along a row.

A tile in wgmma's `row` layout gives each thread 2 consecutive columns (lane
% 4 picks the pair), so a bf16 tile leaves for global memory in 4-byte
stores, a quad writing 16 bytes of a row: half of each 32-byte sector, and
four times the store instructions a 16-byte run needs. Exchanging
register digit j with lane bit k (`Layout.exchanged`) fixes that without
shared memory: each thread keeps the register whose digit j equals its lane
bit k, and trades the other with the lane across bit k, one shuffle per pair
of 32-bit words. `Layout.widening` chooses the exchanges; `widened` makes
them, through `exchange`.
"""
from __future__ import annotations

from typing import Callable

from mlir import ir
from mlir.dialects import arith, llvm, nvvm

from ..dialects import layout as layouts, types as T
from .context import LoweringContext, build_vector, c32, i32, split_vector, vector_type
from .fragments import Fragment


# Bytes of one memory transaction: a warp's store that writes whole sectors
# of each row is left as it is (the exchanges' shuffles and registers would
# buy fewer instructions only: a `row` f32 tile's 8-byte pieces).
SECTOR = 32


def exchange(words: list, strides: list[int], lane_bits: list[int], bits: list, select: Callable,
             shuffle: Callable) -> list:
    """`words` after exchanging, in turn, the word digit of each stride in
    `strides` (words between two words that differ in that digit) with lane
    bit lane_bits[i], whose value in this thread is bits[i]. select(c, a, b)
    is `a if c else b` and shuffle(v, mask) is v of lane ^ mask: the same
    steps for any values with a warp's semantics (MLIR values in `widened`,
    per-lane lists in the tests). The words that trade with one another go
    a group at a time."""
    out = list(words)
    for group in _groups(len(words), strides):
        traded = [words[w] for w in group]
        for i, (lane_bit, bit) in enumerate(zip(lane_bits, bits)):
            traded = _trade(traded, 1 << i, lane_bit, bit, select, shuffle)
        for w, v in zip(group, traded):
            out[w] = v
    return out


def _trade(words: list, stride: int, lane_bit: int, bit, select: Callable,
           shuffle: Callable) -> list:
    """One exchange: a thread keeps the word whose digit (of `stride`)
    equals its lane bit and trades the other with the lane across the bit,
    which sends the word it does not keep."""
    out = list(words)
    for a in range(len(words)):
        if a // stride % 2:
            continue
        b = a + stride
        theirs = shuffle(select(bit, words[a], words[b]), 1 << lane_bit)
        out[a] = select(bit, theirs, words[a])
        out[b] = select(bit, words[b], theirs)
    return out


def widened(ctx: LoweringContext, frag: Fragment) -> Fragment:
    """frag with each thread's runs along the last axis lengthened toward 16
    bytes by lane exchanges (Layout.widening), where a warp's access would
    write part of a sector of a row; frag itself where none applies (whole
    sectors already, or runs shorter than a 32-bit word, which a shuffle
    cannot split) or the kernel is compiled without them (ctx.widen_stores:
    tk_mlir/compiler.py turns them off where they made ptxas spill more)."""
    axis = len(frag.layout.shape) - 1
    size = T.itemsize(frag.dtype)
    if not ctx.widen_stores or size > 4 or frag.layout.vector_run(axis) * size < 4 or \
            frag.layout.warp_span(axis) * size >= SECTOR:
        return frag
    steps, order = frag.layout.widening(axis, 16 // size)
    if not steps:
        return frag
    ctx.widened_stores += 1
    per_word = 4 // size
    words = [_word(frag.regs[r:r + per_word], frag.dtype)
             for r in range(0, len(frag.regs), per_word)]
    lane_bits = [k for _, k in steps]
    bits = [arith.cmpi(arith.CmpIPredicate.ne, arith.andi(ctx.lane(), c32(1 << k)), c32(0))
            for k in lane_bits]
    words = exchange(words, word_strides(frag.layout, steps, per_word), lane_bits, bits,
                     arith.select, _shuffle_xor)
    regs = [r for w in words for r in _unword(w, per_word, frag.dtype)]
    layout = frag.layout
    for step in steps:
        layout = layout.exchanged(*step)
    layout, picked = layout.reordered(order)
    return Fragment([regs[r] for r in picked], layout, frag.dtype, frag.scope)


def word_strides(layout: layouts.Layout, steps, per_word: int) -> list[int]:
    """For each exchange's register digit, how many words apart two words
    differing in it are (registers come `per_word` to a word: the run's
    lowest digits, which no exchange takes)."""
    strides = layout.digit_strides()
    return [strides[digit] // per_word for digit, _ in steps]


def _groups(n: int, strides: list[int]) -> list[list[int]]:
    """The indices 0..n-1 in groups that differ only in the binary digits
    of `strides`, each group ordered so that its digit i steps by 1 << i."""
    out = []
    for base in range(n):
        if not any(base // s % 2 for s in strides):
            out.append([base + sum(s for i, s in enumerate(strides) if j >> i & 1)
                        for j in range(1 << len(strides))])
    return out


def _word(regs: list[ir.Value], dtype: str) -> ir.Value:
    v = build_vector(regs, dtype)
    return v if v.type == i32() else llvm.bitcast(i32(), v)


def _unword(word: ir.Value, n: int, dtype: str) -> list[ir.Value]:
    vtype = vector_type(n, dtype) if n > 1 else T.element_type(dtype)
    return split_vector(llvm.bitcast(vtype, word) if vtype != i32() else word, n)


def _shuffle_xor(x: ir.Value, lane_mask: int) -> ir.Value:
    return nvvm.shfl_sync(i32(), c32(-1), x, c32(lane_mask), c32(31), nvvm.ShflKind.bfly)
