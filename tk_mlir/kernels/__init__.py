"""The kernel library: ready kernels on torch tensors, each the readable
tk_mlir source of its kernel beside a checked, torch-facing wrapper.

    from tk_mlir.kernels import attention, matmul, rms_norm, layer_norm

    c = matmul(a, b)                       # A @ B.T, B given as N x K
    y = rms_norm(x, weight)                # x / rms(x) * weight, per row
    y = layer_norm(x, weight, bias)        # (x - mean) / std * weight + bias
    o = attention(q, k, v, causal=True)    # softmax(q kᵀ / sqrt(D)) v, (B, H, N, D)

Importing the library is cheap: neither torch nor MLIR loads until a name
is used, and then only its own module (torch for the wrapper's checks, MLIR
at the kernel's first compile, not at all when the disk cache has it).
"""
from __future__ import annotations

import importlib
import sys
import types

# Each public name and the module that defines it (a new kernel is one entry).
_LAZY = {
    "matmul": ".matmul",
    "rms_norm": ".norms",
    "layer_norm": ".norms",
    "attention": ".attention",
}


class _Library(types.ModuleType):
    """The package object, which keeps each public name bound to its kernel.

    Importing a submodule binds it to the package attribute of its name, so
    `import tk_mlir.kernels.matmul` would replace the `matmul` function with
    the module `tk_mlir.kernels.matmul` for every later
    `from tk_mlir.kernels import matmul`. Exported names are never rebound to
    a module; the modules stay reachable through sys.modules, importlib and
    `from tk_mlir.kernels.matmul import gemm_kernel`."""

    def __setattr__(self, name, value):
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Library


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value         # resolved once: later lookups skip this hook
    return value


def __dir__():
    return sorted({*globals(), *_LAZY})


__all__ = list(_LAZY)
