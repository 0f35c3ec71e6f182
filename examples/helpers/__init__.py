"""What the examples share, kept out of examples/*.py, where every file is
an example (the tests run each and read the kernels it compiles).

check_on: where a library example checks its kernel against torch: on the
GPU when there is one; in the CPU interpreter under TK_MLIR_INTERPRET=1,
which makes every launch interpret, so the library takes CPU tensors; else
nowhere: the example compiled only, and says how to check it on this machine.

    device = check_on(__file__)     # 'cuda', 'cpu' (the interpreter) or None
"""
from pathlib import Path

from tk_mlir.errors import CudaUnavailable
from tk_mlir.knobs import interpret


def check_on(example: str) -> str | None:
    """The torch device to check `example` (its __file__) on: 'cpu' under
    TK_MLIR_INTERPRET=1 (the interpreter is slow: use small shapes), 'cuda'
    where a GPU can be used; else None, having said how to check it."""
    if interpret():        # read as kernel.py reads it: "true" counts, "0" does not
        return "cpu"
    if gpu_here():
        return "cuda"
    print(f"no GPU here: compiled only; run on a Hopper GPU to check it against torch, "
          f"or check it in the CPU interpreter:\n"
          f"  TK_MLIR_INTERPRET=1 python examples/{Path(example).name}")
    return None


def gpu_here() -> bool:
    """Whether kernels can launch here; never raises."""
    try:
        from tk_mlir.runtime.driver import has_gpu
    except CudaUnavailable:        # no cuda-bindings (macOS): compiling still works
        return False
    return has_gpu()
