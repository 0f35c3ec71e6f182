"""Import MLIR's Python bindings without numpy.

`mlir.ir` imports numpy (0.1-0.15 s, a third of a small kernel's first
compile on the CPU machine) only to register four attribute builders
(F64/I32/I64/IndexElementsAttr), which no dialect tk_mlir builds uses. The
first compile imports the bindings through here: with numpy hidden while
`mlir.ir` loads, and those builders registered again to import numpy when
first called, so nothing is lost. Where numpy is already imported (torch
imports it) there is nothing to save and this does nothing special.
"""
from __future__ import annotations

import sys


def _register_lazy_numpy_builders(ir) -> None:
    def builder(np_dtype: str, element_type):
        def build(x, context):
            import numpy as np
            return ir.DenseElementsAttr.get(np.array(x, dtype=np_dtype),
                                            type=element_type(context), context=context)
        return build
    kinds = {"F64ElementsAttr": ("float64", lambda c: ir.F64Type.get(context=c)),
             "I32ElementsAttr": ("int32", lambda c: ir.IntegerType.get_signless(32, context=c)),
             "I64ElementsAttr": ("int64", lambda c: ir.IntegerType.get_signless(64, context=c)),
             "IndexElementsAttr": ("int64", lambda c: ir.IndexType.get(context=c))}
    for name, (np_dtype, element_type) in kinds.items():
        ir.register_attribute_builder(name)(builder(np_dtype, element_type))


def import_mlir():
    """mlir.ir, imported without numpy unless numpy is loaded already."""
    if "mlir.ir" in sys.modules or "numpy" in sys.modules:
        import mlir.ir
        return mlir.ir
    import _imp
    # Hold the import lock while numpy is hidden, so that no other thread's
    # `import numpy` can see the placeholder.
    _imp.acquire_lock()
    try:
        sys.modules["numpy"] = None          # `import numpy` raises ImportError
        try:
            import mlir.ir
        finally:
            del sys.modules["numpy"]
    finally:
        _imp.release_lock()
    _register_lazy_numpy_builders(mlir.ir)
    return mlir.ir


import_mlir()
