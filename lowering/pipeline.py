"""From the tk kernel module to PTX, one named stage at a time.

Each stage runs on the module in place and its text is kept, so a user can
read (and re-parse and resume from) the IR between any two passes. Python
passes and upstream MLIR passes are both stages; upstream ones run through a
PassManager of their own.

A stage that fails with anything but a CompilationError (the user's error,
at their line) is a bug of ours: an InternalCompilerError naming the stage,
with the IR before it saved to a file and the command that replays the
stage on it (`python -m tk_mlir.lowering.pipeline STAGE FILE`).
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mlir import ir, passmanager

from ..errors import CompilationError, InternalCompilerError
from ..passes.fences import insert_proxy_fences
from ..passes.layouts import assign_layouts
from ..passes.lint import lint
from ..passes.smem import allocate_smem
from ..passes.verify import verify
from ..params import AbiParam
from ..stages import StageStore, stage_text
from .kernel import lower_to_gpu, set_kernel_attributes
from .tma import TensorMapSpec

# The tk-level passes, in order.
TK_PASSES = (("tk-assign-layouts", assign_layouts), ("tk-verify", verify),
             ("tk-allocate-smem", allocate_smem), ("tk-proxy-fences", insert_proxy_fences))
# Checks that warn and change nothing (no stage text of their own), after the
# tk passes: tk-lint (passes/lint.py) reads what tk-allocate-smem decided.
TK_CHECKS = (("tk-lint", lint),)
# Line info: a DISubprogram scope on each llvm.func makes the LLVM translation
# keep every op's file:line:col, so the PTX carries `.file`/`.loc` pointing at
# the kernel's Python source (ptxas -lineinfo carries them into the cubin,
# nvdisasm -g shows them in the SASS). DebugDirectivesOnly: only those
# directives, no DWARF sections, and no change to the generated code.
DEBUG_LINES = "ensure-debug-info-scope-on-llvm-func{emission-kind=DebugDirectivesOnly}"
# The stages after tk-to-gpu, in order: upstream passes by their pipeline
# text and our Python fix-ups by name (tk-kernel-attributes after
# convert-gpu-to-nvvm, which drops a gpu.func's argument attributes).
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
    DEBUG_LINES,
)
UPSTREAM = tuple(s for s in GPU_STAGES if isinstance(s, str))
GPU_STAGE_NAMES = tuple(s if isinstance(s, str) else s[0] for s in GPU_STAGES)
TO_BINARY = "gpu-module-to-binary{format=isa}"


@dataclass
class Lowered:
    stages: StageStore           # stage name -> IR after it, as snapshots (stages.py)
    ptx: str
    params: list[AbiParam]
    kernel_name: str
    tensor_maps: list[TensorMapSpec]
    widened_stores: int          # global stores that lane exchanges widened (lane_exchange.py)


def _python_stages() -> dict[str, Callable[[ir.Module], None]]:
    return {**dict(TK_PASSES), **dict(TK_CHECKS),
            **{s[0]: s[1] for s in GPU_STAGES if not isinstance(s, str)}}


def run_stage(name: str, module: ir.Module) -> ir.Module:
    """Run one stage on `module`; returns the module after it (tk-to-gpu makes a
    new one, every other stage changes `module` in place)."""
    if name == "tk-to-gpu":
        return lower_to_gpu(module)[0]
    python = _python_stages()
    if name in python:
        python[name](module)
    else:
        passmanager.PassManager.parse(f"builtin.module({name})").run(module.operation)
    return module


class _Stages:
    """Runs the stages, recording the text after each; a failing one becomes an
    InternalCompilerError (with how to reproduce it) unless it is the user's."""

    def __init__(self, on_stage: Callable[[str, str], None] | None, kernel: str | None):
        self.texts = StageStore()
        self.on_stage, self.kernel = on_stage, kernel

    def record(self, name: str, module: ir.Module) -> None:
        """Keep the IR after stage `name`: printed now when on_stage wants the
        text as it comes (TK_MLIR_DUMP_DIR), else a snapshot printed later."""
        if self.on_stage:
            self.texts[name] = stage_text(module)
            self.on_stage(name, self.texts[name])
        else:
            self.texts.snapshot(name, module)

    def same_as(self, name: str, earlier: str) -> None:
        self.texts.same_as(name, earlier)
        if self.on_stage:
            self.on_stage(name, self.texts[name])

    def record_text(self, name: str, text: str) -> None:
        self.texts[name] = text
        if self.on_stage:
            self.on_stage(name, text)

    def run(self, name: str, fn: Callable, module: ir.Module):
        try:
            return fn(module)
        except (CompilationError, Warning):     # (a tk-lint warning made an error)
            raise
        except Exception as e:
            raise self.internal(name, e) from e

    def internal(self, name: str, e: Exception) -> InternalCompilerError:
        message = f"{type(e).__name__}: {e}".rstrip()
        if self.texts:
            path = save_for_replay(name, self.texts[list(self.texts)[-1]])
            message += (f"\nthe IR before {name} is in {path}; reproduce with:\n"
                        f"    python -m tk_mlir.lowering.pipeline '{name}' {path}"
                        if path else f"\n(the IR before {name} could not be saved)")
        return InternalCompilerError(message, self.kernel, name)


def save_for_replay(stage: str, text: str, suffix: str = ".mlir") -> Path | None:
    """Write what a failing stage started from where the user can find it:
    TK_MLIR_DUMP_DIR when set (and writable), else a new temporary folder;
    None if neither can be written (the error is reported all the same)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", stage).strip("_")
    from ..knobs import dump_dir
    for folder in (dump_dir(), None):
        try:
            directory = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="tk_mlir-ice-"))
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"before-{safe}{suffix}"
            path.write_text(text)
            return path
        except OSError:
            continue
    return None


def lower(module: ir.Module, on_stage: Callable[[str, str], None] | None = None,
          kernel: str | None = None) -> Lowered:
    """Run every stage on `module` (the frontend's tk module, modified in place)."""
    stages = _Stages(on_stage, kernel)
    stages.record("tk", module)
    for name, fn in TK_PASSES:
        stages.run(name, fn, module)
        stages.record(name, module)
    for name, fn in TK_CHECKS:
        stages.run(name, fn, module)
    (func,) = module.body.operations
    kernel_name = ir.StringAttr(func.attributes["sym_name"]).value
    gpu_module, params, tensor_maps, widened = stages.run("tk-to-gpu", lower_to_gpu, module)
    stages.record("tk-to-gpu", gpu_module)
    for name in GPU_STAGE_NAMES:
        stages.run(name, lambda m: run_stage(name, m), gpu_module)
        stages.record(name, gpu_module)
    stages.same_as("llvm", GPU_STAGE_NAMES[-1])     # the LLVM-dialect module: no pass between
    ptx = stages.run(TO_BINARY, lambda m: _extract_ptx(str(run_stage(TO_BINARY, m))), gpu_module)
    stages.record_text("ptx", ptx)
    return Lowered(stages.texts, ptx, params, kernel_name, tensor_maps, widened)


def _extract_ptx(binary_module_text: str) -> str:
    m = re.search(r'assembly = "(.*?)(?<!\\)">', binary_module_text, re.S)
    if not m:
        raise ValueError("gpu-module-to-binary produced no PTX")
    text = m.group(1)
    # MLIR prints the string attribute with \XX escapes for special bytes.
    return re.sub(r"\\([0-9A-Fa-f]{2})", lambda h: chr(int(h.group(1), 16)), text) \
        .replace('\\"', '"').replace("\\\\", "\\")


def replay(stage: str, path: str | os.PathLike) -> str:
    """The text after running `stage` on the IR in `path` (a stage's text, as
    an InternalCompilerError saves it): a failing stage fails here the same way."""
    from ..dialects import tk as tk_dialect
    context = ir.Context()
    tk_dialect.load(context)
    with context:
        module = ir.Module.parse(Path(path).read_text())
        if stage == TO_BINARY:
            return _extract_ptx(str(run_stage(stage, module)))
        return stage_text(run_stage(stage, module))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tk_mlir.lowering.pipeline STAGE FILE.mlir")
    sys.stdout.write(replay(sys.argv[1], sys.argv[2]))
