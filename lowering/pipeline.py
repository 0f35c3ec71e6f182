"""From the tk kernel module to PTX, one named stage at a time.

Each stage runs on the module in place and its text is kept, so a user can
read (and re-parse and resume from) the IR between any two passes. Python
passes and upstream MLIR passes are both stages; upstream ones run through a
PassManager of their own.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from mlir import ir, passmanager

from ..errors import CompilationError
from ..passes.layouts import assign_layouts
from ..passes.smem import allocate_smem
from ..passes.verify import verify
from .kernel import KernelParam, lower_to_gpu, set_kernel_attributes
from .tma import TensorMapSpec

# The stages after tk-to-gpu, in order: upstream passes by their pipeline
# text (see MLIR_NOTES for why this order) and our Python fix-ups by name.
GPU_STAGES = (
    "convert-scf-to-cf",
    "convert-nvvm-to-llvm",
    "convert-arith-to-llvm",
    "convert-index-to-llvm",
    "canonicalize",
    "cse",
    "gpu.module(convert-gpu-to-nvvm{use-bare-ptr-memref-call-conv=1})",
    ("tk-kernel-attributes", set_kernel_attributes),
    "reconcile-unrealized-casts",
)
UPSTREAM = tuple(s for s in GPU_STAGES if isinstance(s, str))
GPU_STAGE_NAMES = tuple(s if isinstance(s, str) else s[0] for s in GPU_STAGES)


@dataclass
class Lowered:
    stages: dict[str, str]       # stage name -> IR text after it
    ptx: str
    params: list[KernelParam]
    kernel_name: str
    tensor_maps: list[TensorMapSpec]


def _run_upstream(module: ir.Module, pipeline: str) -> None:
    pm = passmanager.PassManager.parse(f"builtin.module({pipeline})")
    try:
        pm.run(module.operation)
    except ir.MLIRError as e:
        raise CompilationError(f"internal compiler error in pass {pipeline}: {e}\n"
                               f"(re-run with TK_MLIR_DUMP_DIR=dir to get the IR before it)") \
            from None


def _stage_text(module: ir.Module) -> str:
    return module.operation.get_asm(enable_debug_info=True, large_elements_limit=64)


def lower(module: ir.Module, on_stage: Callable[[str, str], None] | None = None) -> Lowered:
    """Run every stage on `module` (the frontend's tk module, modified in place)."""
    stages: dict[str, str] = {}
    def record(name: str, m: ir.Module) -> None:
        stages[name] = _stage_text(m)
        if on_stage:
            on_stage(name, stages[name])

    record("tk", module)
    for name, fn in (("tk-assign-layouts", assign_layouts), ("tk-verify", verify),
                     ("tk-allocate-smem", allocate_smem)):
        fn(module)
        record(name, module)
    (func,) = module.body.operations
    kernel_name = ir.StringAttr(func.attributes["sym_name"]).value
    gpu_module, params, tensor_maps = lower_to_gpu(module)
    record("tk-to-gpu", gpu_module)
    for stage in GPU_STAGES:
        if isinstance(stage, str):
            _run_upstream(gpu_module, stage)
            record(stage, gpu_module)
        else:
            name, fn = stage
            fn(gpu_module)
            record(name, gpu_module)
    record("llvm", gpu_module)
    _run_upstream(gpu_module, "gpu-module-to-binary{format=isa}")
    ptx = _extract_ptx(str(gpu_module))
    stages["ptx"] = ptx
    if on_stage:
        on_stage("ptx", ptx)
    return Lowered(stages, ptx, params, kernel_name, tensor_maps)


def _extract_ptx(binary_module_text: str) -> str:
    m = re.search(r'assembly = "(.*?)(?<!\\)">', binary_module_text, re.S)
    if not m:
        raise CompilationError("internal compiler error: gpu-module-to-binary produced no PTX")
    text = m.group(1)
    # MLIR prints the string attribute with \XX escapes for special bytes.
    return re.sub(r"\\([0-9A-Fa-f]{2})", lambda h: chr(int(h.group(1), 16)), text) \
        .replace('\\"', '"').replace("\\\\", "\\")
