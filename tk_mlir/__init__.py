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
import importlib.abc
import importlib.util
import sys
from pathlib import Path


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """`tk_mlir.dialects`, `.passes`, `.lowering` from a source checkout.

    They sit beside `tk_mlir/` at the top of the repository (the design's
    layout) and are mapped under `tk_mlir` when installed. Run from the
    repository root, Python finds the source `tk_mlir/` before any installed
    copy; this finder then supplies its three siblings, so a plain checkout,
    an editable and a regular install all import the same way."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.partition(".")
        if prefix != __name__ or name not in _SIBLINGS:
            return None
        init = self.root / name / "__init__.py"
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[str(init.parent)])


_SIBLINGS = ("dialects", "passes", "lowering")
_HERE = Path(__file__).resolve().parent
if not (_HERE / "dialects").is_dir() and (_HERE.parent / "dialects" / "__init__.py").is_file():
    sys.meta_path.insert(0, _SourceTreeFinder(_HERE.parent))

from .autotune import Config, autotune
from .errors import ArgumentError, CompilationError, InternalCompilerError, TkLintWarning
from .kernel import Kernel, kernel
from .language import bf16, constexpr, f8e4m3, f8e5m2, f16, f32, func, gl, i32, pgl, static_range
from .runtime.arguments import spec

__version__ = "0.1.0"

# Names resolved lazily from the modules that define them (they import MLIR,
# or torch).
_LAZY = {
    **dict.fromkeys(("block_id", "grid_dim", "num_warps", "thread_id", "lane_id", "warp_id",
                     "warpgroup_id",
                     "load", "store", "copy", "zeros", "full", "shared_tile", "shared_tiles",
                     "barrier", "where", "shared_vector", "shared_vectors", "atomic_add",
                     "store_partial"), ".ops"),
    **dict.fromkeys(("semaphore", "semaphores", "arrive", "wait", "wait_phase", "ring_phase", "elect_leader",
                     "registers_per_thread", "increase_registers", "decrease_registers", "named_barrier", "use_cluster",
                     "cluster_rank", "cluster_sync", "named_barrier_arrive"), ".sync"),
    **dict.fromkeys(("mma_AB", "mma_ABt", "mma_AtB", "mma_AtBt", "mma_wait"), ".mma"),
    **dict.fromkeys(("tensor_tile", "free_tensor_tile", "mma_commit"), ".tensor_memory"),
    **dict.fromkeys(("lcf", "grouped_tile", "register_split", "store_in_pieces"), ".templates"),
    **dict.fromkeys(("ring", "Ring"), ".rings"),
    **dict.fromkeys(("bench", "sweep"), ".benchmarking"),
    **dict.fromkeys(("signal", "wait_signal", "fence"), ".signals"),
    **dict.fromkeys(("PeerTensor", "peer_tensor", "peer_spec"), ".runtime.peers"),
}
_SUBMODULES = {"tma"}   # tk.tma.load_async, ...


def cdiv(a, b):
    """Ceiling division: `tk.cdiv(M, BM)` on the host (grids; ints, numpy's
    too) or in a kernel, where run-time values give a run-time result."""
    if type(a) is int and type(b) is int:      # (the host's common case, without ABC checks)
        return -(-a // b)
    import numbers
    if isinstance(a, numbers.Integral) and isinstance(b, numbers.Integral):
        return -(-int(a) // int(b))
    values = sys.modules.get(__name__ + ".values")      # (loaded once a kernel compiles)
    if values is None or not any(isinstance(x, values.Value) for x in (a, b)):
        raise TypeError(f"tk.cdiv takes ints (in a kernel, run-time ints too), got {a!r} and "
                        f"{b!r}")
    return values.ceil_div(a, b)


cdiv.__tk_builtin__ = True     # the frontend may call it on run-time values


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tk_mlir' has no attribute {name!r}")


__all__ = ["kernel", "Kernel", "func", "autotune", "Config", "gl", "pgl", "constexpr", "spec", "bf16",
           "f16", "f32", "f8e4m3", "f8e5m2", "i32", "CompilationError", "ArgumentError",
           "InternalCompilerError", "TkLintWarning", "static_range", "cdiv", "tma", *_LAZY]
