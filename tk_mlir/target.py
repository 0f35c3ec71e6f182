"""The descriptions of the GPUs tk_mlir compiles for (Hopper, by default; Blackwell).

Every layer that needs a fact about the target reads it here: the compiler
(arch in the cache key, ptxas), the lowering (the NVVM target attribute),
the passes (shared-memory and register limits, alignments), the runtime
(the device check before a module is loaded, the grid limits) and the
summary (occupancy from the per-SM limits when no GPU is here).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace


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
    tmem_lanes: int = 0            # tensor memory per block (Blackwell): lanes (rows) ...
    tmem_columns: int = 0          # ... and 32-bit columns; none on Hopper

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

# Blackwell (datacenter): Hopper's limits for what tk_mlir uses (228 KB of
# shared memory per SM, 227 KB per block, 64K registers, the grid) and 128
# lanes x 512 columns of tensor memory per block; PTX 8.8 is the first with
# sm_100a. Its MMA is tcgen05 into tensor memory, not wgmma (tile_rules
# refuses tk.mma_* into registers there). tk_mlir has never run on it.
BLACKWELL = replace(
    HOPPER, arch="sm_100a", ptx_features="+ptx88", compute_capability=(10, 0),
    tmem_lanes=128, tmem_columns=512,
    description="an NVIDIA Blackwell datacenter GPU (compute capability 10.0: B200, GB200)")

# The targets a kernel may name, each with the one NVVM (chip, features) pair
# known to work with the MLIR bindings: LLVM aborts the process on a pair it
# does not support, so nothing else reaches it.
TARGETS = {t.arch: t for t in (HOPPER, BLACKWELL)}
TARGET = HOPPER    # the default: what a kernel compiles for unless it names another

_CURRENT: ContextVar[Target] = ContextVar("tk_mlir_target", default=TARGET)


def named(arch) -> Target:
    """The target called `arch` ("sm_90a", "sm_100a"; None: the default), or
    a ValueError listing the ones there are."""
    if arch is None:
        return TARGET
    t = TARGETS.get(arch) if isinstance(arch, str) else None
    if t is None:
        raise ValueError(f"target must be one of {', '.join(map(repr, TARGETS))}, got "
                         f"{arch!r}")
    return t


def current() -> Target:
    """The target of the kernel being compiled (the default outside a compile)."""
    return _CURRENT.get()


@contextmanager
def compiling_for(target: Target):
    """Every layer's current() is `target` inside: one kernel's compile."""
    token = _CURRENT.set(target)
    try:
        yield target
    finally:
        _CURRENT.reset(token)
