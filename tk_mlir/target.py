"""The one description of the GPU tk_mlir compiles for.

Every layer that needs a fact about the target reads it here: the compiler
(arch in the cache key, ptxas), the lowering (the NVVM target attribute),
the passes (shared-memory and register limits, alignments), the runtime
(the device check before a module is loaded, the grid limits) and the
summary (occupancy from the per-SM limits when no GPU is here).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    arch: str                      # ptxas / NVVM chip, e.g. "sm_90a"
    ptx_features: str              # NVVM target features, e.g. "+ptx81" (8.1: vector red)
    compute_capability: tuple[int, int]
    description: str               # what a device must be, in words
    max_shared_bytes: int          # dynamic shared memory per block (opt-in)
    max_registers_per_thread: int
    registers_per_sm: int          # the register file setmaxnreg moves registers within
    register_alloc_unit: int       # registers are given to a warp in units of this many
    max_threads_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    shared_bytes_per_sm: int       # what the blocks resident on one SM share
    shared_alloc_unit: int         # shared memory is given to a block in units of this many
    shared_reserved_bytes: int     # per block, for the system (sm_80 and later)
    max_grid: tuple[int, int, int]  # blocks along x, y, z
    swizzle_align: int             # swizzled shared tiles (TMA/wgmma) sit at this alignment
    smem_align: int                # every other shared allocation
    global_align: int              # tensor base / row alignment for 16-byte vectors and TMA

    def launch_registers(self, threads: int) -> int:
        """Registers per thread of a block of `threads` that asks for as many
        as fit one block per SM (.maxntid + .minnctapersm 1, as ptxas does for
        a kernel using setmaxnreg): the register file split evenly, in
        multiples of 8, at most max_registers_per_thread (rounded down to 8)."""
        return min(self.registers_per_sm // threads, self.max_registers_per_thread) // 8 * 8

    def supports(self, capability: tuple[int, int]) -> bool:
        """Can a device of this compute capability run code built for this
        target? sm_90a code runs on exactly 9.0 ("a": arch-specific features,
        no forward compatibility)."""
        return tuple(capability) == self.compute_capability


HOPPER = Target(
    arch="sm_90a", ptx_features="+ptx81", compute_capability=(9, 0),
    description="an NVIDIA Hopper GPU (compute capability 9.0: H100, H200, H800, GH200)",
    max_shared_bytes=227 * 1024, max_registers_per_thread=255, registers_per_sm=65536,
    register_alloc_unit=256, max_threads_per_block=1024, max_threads_per_sm=2048,
    max_blocks_per_sm=32, shared_bytes_per_sm=228 * 1024, shared_alloc_unit=128,
    shared_reserved_bytes=1024,
    max_grid=(2**31 - 1, 65535, 65535), swizzle_align=1024, smem_align=128, global_align=16)

TARGET = HOPPER    # the one target today
