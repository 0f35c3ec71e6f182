"""The descriptors the tensor cores read, as Python ints.

Hopper's wgmma and Blackwell's tcgen05.mma read a shared operand through a
64-bit matrix descriptor, and tcgen05.mma takes its shape and types from a
32-bit instruction descriptor. Both hold compile-time facts only (the
run-time start address is added by the lowering), so they are built here in
plain Python, where tests/test_descriptors.py holds every field to the PTX
ISA's tables bit by bit.

Shared-memory descriptor fields (both families):
  start address >> 4 (bits 0-13), leading byte offset >> 4 (16-29), stride
  byte offset >> 4 (32-45), then
  wgmma:   swizzle mode in bits 62-63 (1 = 128B, 2 = 64B, 3 = 32B);
  tcgen05: a fixed 0b001 in bits 46-48, base offset 0 (49-51: our swizzled
           tiles start on a 1024-byte boundary), LBO mode 0 (52: relative)
           and the swizzle mode in bits 61-63 (2 = 128B, 4 = 64B, 6 = 32B).
The byte offsets are the same for both (the canonical layouts agree): see
operand_offsets.

Instruction descriptor (tcgen05.mma, dense; PTX ISA "Instruction
descriptor"): D format in bits 4-5 (f16 0, f32 1), A and B formats in 7-9
and 10-12 (kind::f16: f16 0, bf16 1; kind::f8f6f4: e4m3 0, e5m2 1), A and B
transposed (MN-major) in bits 15 and 16 (0: K-major), N >> 3 in 17-22,
M >> 4 in 24-28; sparsity, saturation, negation and shift fields are 0.
"""
from __future__ import annotations

from ..dialects import types as T

WGMMA_SWIZZLE = {128: 1, 64: 2, 32: 3}
TCGEN05_SWIZZLE = {0: 0, 128: 2, 64: 4, 32: 6}

# tcgen05.mma's operand kinds: dtype -> (kind, the format code in the descriptor).
TCGEN05_FORMATS = {"f16": ("f16", 0), "bf16": ("f16", 1),
                   "f8e4m3": ("f8f6f4", 0), "f8e5m2": ("f8f6f4", 1)}
TCGEN05_D_FORMATS = {"f16": 0, "f32": 1}


def _field(value: int, lo: int, width: int, what: str) -> int:
    if not 0 <= value < 1 << width:
        raise ValueError(f"{what} = {value} does not fit bits {lo}-{lo + width - 1}")
    return value << lo


def operand_offsets(st: T.ST, k_major: bool) -> tuple[int, int]:
    """(leading, stride) byte offsets of a swizzled shared operand, as both
    MMA families read our tiles (column blocks of S = swizzle bytes per row,
    8-row swizzle atoms of 8*S bytes):
      K-major (rows = M or N, columns = K): SBO = 8*S between 8-row groups;
          LBO unused (16, "assumed 1");
      MN-major (rows = K, columns = M or N): LBO = rows*S between column
          blocks, SBO = 8*S between 8-row groups of K."""
    s = st.swizzle
    return (16 if k_major else st.rows * s), 8 * s


def wgmma_smem(lbo: int, sbo: int, swizzle: int) -> int:
    """wgmma's shared-memory descriptor, start address 0."""
    return (_field(lbo >> 4, 16, 14, "LBO >> 4") | _field(sbo >> 4, 32, 14, "SBO >> 4") |
            (WGMMA_SWIZZLE[swizzle] << 62))


def tcgen05_smem(lbo: int, sbo: int, swizzle: int) -> int:
    """tcgen05's shared-memory descriptor, start address 0."""
    return (_field(lbo >> 4, 16, 14, "LBO >> 4") | _field(sbo >> 4, 32, 14, "SBO >> 4") |
            (1 << 46) | (TCGEN05_SWIZZLE[swizzle] << 61))


def tcgen05_kind(dtype: str) -> str:
    """The tcgen05.mma kind (f16, f8f6f4) that multiplies `dtype` operands."""
    return TCGEN05_FORMATS[dtype][0]


def tcgen05_instruction(a: str, b: str, m: int, n: int, *, d: str = "f32",
                        a_mn_major: bool = False, b_mn_major: bool = False) -> int:
    """tcgen05.mma's instruction descriptor for an M x N x (kind's K) product
    of `a` and `b` operands into a `d` accumulator."""
    (kind_a, fa), (kind_b, fb) = TCGEN05_FORMATS[a], TCGEN05_FORMATS[b]
    if kind_a != kind_b:
        raise ValueError(f"tcgen05.mma multiplies operands of one kind: {a} is kind::{kind_a}, "
                         f"{b} kind::{kind_b}")
    return (_field(TCGEN05_D_FORMATS[d], 4, 2, "D format") | _field(fa, 7, 3, "A format") |
            _field(fb, 10, 3, "B format") | (int(a_mn_major) << 15) | (int(b_mn_major) << 16) |
            _field(n >> 3, 17, 6, "N >> 3") | _field(m >> 4, 24, 5, "M >> 4"))
