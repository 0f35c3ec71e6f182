"""tk_mlir: ThunderKittens-style tile kernels in Python, compiled through MLIR.

    import tk_mlir as tk
    from tk_mlir import bf16, f32

    @tk.kernel
    def double(X: tk.gl[bf16], Y: tk.gl[bf16], BM: tk.constexpr = 64):
        x = tk.load(X, (tk.block_id(0), 0), (BM, 64))
        tk.store(Y, x + x, (tk.block_id(0), 0))

The tk.* functions used inside kernels (load, store, zeros, block_id, ...)
are loaded on first use: importing tk_mlir and launching a kernel found in
the disk cache never loads MLIR.
"""
from __future__ import annotations

import importlib

from .errors import ArgumentError, CompilationError
from .kernel import Kernel, kernel
from .language import bf16, constexpr, f8e4m3, f8e5m2, f16, f32, gl
from .runtime.arguments import spec

__version__ = "0.1.0"

# Names resolved lazily from tk_mlir.ops (they import MLIR).
_OPS = {"block_id", "grid_dim", "thread_id", "lane_id", "warp_id", "warpgroup_id", "load",
        "store", "copy", "zeros", "full", "shared_tile", "barrier"}


def static_range(*args):
    """`for i in tk.static_range(n)`: a loop unrolled at compile time."""
    return range(*args)


def cdiv(a: int, b: int) -> int:
    """Ceiling division, for grids: `tk.cdiv(M, BM)`."""
    return -(-a // b)


def __getattr__(name: str):
    if name in _OPS:
        return getattr(importlib.import_module(".ops", __name__), name)
    raise AttributeError(f"module 'tk_mlir' has no attribute {name!r}")


__all__ = ["kernel", "Kernel", "gl", "constexpr", "spec", "bf16", "f16", "f32", "f8e4m3",
           "f8e5m2", "CompilationError", "ArgumentError", "static_range", "cdiv", *_OPS]
