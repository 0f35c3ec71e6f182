"""Walking a function's ops from a Python pass.

An exception raised inside an MLIR walk callback comes out wrapped in a
RuntimeError with the whole Python traceback in its text; a pass's user
error must reach the user as itself. `walk_ops` stops at the first
CompilationError and raises it after the walk.
"""
from __future__ import annotations

from typing import Callable

from mlir import ir

from ..errors import CompilationError


def walk_ops(root: ir.Operation, fn: Callable[[ir.Operation], None]) -> None:
    failures: list[CompilationError] = []

    def visit(op):
        try:
            fn(op.operation)
        except CompilationError as e:
            failures.append(e)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE
    root.walk(visit)
    if failures:
        raise failures[0]
