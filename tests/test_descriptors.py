"""The tensor cores' descriptors (lowering/descriptors.py) against the PTX
ISA's tables, bit by bit: the tcgen05 instruction descriptor ("Instruction
descriptor" table of the tcgen05.mma section), the tcgen05 and wgmma
shared-memory descriptors ("Shared memory descriptor" / "Matrix
descriptor")."""
from __future__ import annotations

import pytest

from tk_mlir.dialects import types as T
from tk_mlir.lowering import descriptors as D


def bits(value: int, lo: int, hi: int) -> int:
    """Bits lo..hi (inclusive) of value."""
    return value >> lo & ((1 << (hi - lo + 1)) - 1)


@pytest.mark.parametrize("a, b, fa, fb", [("bf16", "bf16", 1, 1), ("f16", "f16", 0, 0),
                                          ("f8e4m3", "f8e5m2", 0, 1), ("f8e5m2", "f8e4m3", 1, 0)])
@pytest.mark.parametrize("m, n", [(128, 256), (128, 16), (64, 8), (128, 200)])
def test_the_instruction_descriptor_fields(a, b, fa, fb, m, n):
    d = D.tcgen05_instruction(a, b, m, n)
    assert bits(d, 0, 3) == 0                   # dense, no saturation
    assert bits(d, 4, 5) == 1                   # D is f32
    assert bits(d, 6, 6) == 0
    assert (bits(d, 7, 9), bits(d, 10, 12)) == (fa, fb)
    assert bits(d, 13, 16) == 0                 # no negation, both K-major
    assert bits(d, 17, 22) == n >> 3 and bits(d, 23, 23) == 0
    assert bits(d, 24, 28) == m >> 4 and bits(d, 29, 31) == 0


def test_instruction_descriptor_golden_words():
    # Computed by hand from the ISA's table: bf16 x bf16 -> f32, M=128, N=256:
    # D f32 (1 << 4), A bf16 (1 << 7), B bf16 (1 << 10), N>>3 = 32 (<< 17), M>>4 = 8 (<< 24).
    assert D.tcgen05_instruction("bf16", "bf16", 128, 256) == 0x0840_0490
    assert D.tcgen05_instruction("f16", "f16", 128, 64, d="f16") == 0x0810_0000
    assert D.tcgen05_instruction("bf16", "bf16", 128, 64, a_mn_major=True) == 0x0810_8490
    assert D.tcgen05_instruction("bf16", "bf16", 128, 64, b_mn_major=True) == 0x0811_0490
    assert D.tcgen05_kind("bf16") == "f16" and D.tcgen05_kind("f8e4m3") == "f8f6f4"


def test_the_instruction_descriptor_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="one kind: bf16 is kind::f16, f8e4m3 kind::f8f6f4"):
        D.tcgen05_instruction("bf16", "f8e4m3", 128, 128)
    with pytest.raises(ValueError, match=r"M >> 4 = 32 does not fit bits 24-28"):
        D.tcgen05_instruction("bf16", "bf16", 512, 128)
    with pytest.raises(ValueError, match=r"N >> 3 = 64 does not fit bits 17-22"):
        D.tcgen05_instruction("bf16", "bf16", 128, 512)


@pytest.mark.parametrize("swizzle, mode", [(128, 2), (64, 4), (32, 6)])
def test_the_tcgen05_shared_memory_descriptor(swizzle, mode):
    st = T.ST("bf16", 128, 64, swizzle)
    lbo, sbo = D.operand_offsets(st, k_major=True)
    d = D.tcgen05_smem(lbo, sbo, swizzle)
    assert bits(d, 0, 13) == 0                     # start address: added at run time
    assert bits(d, 16, 29) == 1 and bits(d, 32, 45) == 8 * swizzle >> 4
    assert bits(d, 46, 48) == 0b001                # the fixed "version" field
    assert bits(d, 49, 51) == 0 and bits(d, 52, 52) == 0   # base offset, relative LBO
    assert bits(d, 53, 60) == 0 and bits(d, 61, 63) == mode


def test_shared_memory_descriptor_golden_words():
    # K-major, 128-byte swizzle, 8-row atoms of 1024 bytes: LBO 16 (field 1),
    # SBO 1024 (field 64); tcgen05 adds bit 46 and mode 2 in bits 61-63, wgmma
    # mode 1 in bits 62-63.
    st = T.ST("bf16", 128, 64, 128)
    assert D.tcgen05_smem(*D.operand_offsets(st, True), 128) == 0x4000_4040_0001_0000
    assert D.wgmma_smem(*D.operand_offsets(st, True), 128) == 0x4000_0040_0001_0000
    # MN-major (rows = K = 64): LBO = rows * 128 between column blocks.
    kn = T.ST("bf16", 64, 128, 128)
    assert D.operand_offsets(kn, False) == (64 * 128, 1024)
    assert D.wgmma_smem(*D.operand_offsets(kn, False), 128) == 0x4000_0040_0200_0000


def test_an_offset_too_large_for_its_field_is_refused():
    with pytest.raises(ValueError, match=r"SBO >> 4 = 16384 does not fit bits 32-45"):
        D.tcgen05_smem(16, 1 << 18, 128)
