"""Moved to tk_mlir/toolchain.py (the tools are the compile's, not the
runtime's). Only cli.py still imports ToolchainError from here; delete this
module once it imports tk_mlir.toolchain."""
from ..toolchain import ToolchainError  # noqa: F401
