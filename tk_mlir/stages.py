"""A compiled kernel's stages: stage name -> the IR text after it, in pipeline
order.

Printing every stage costs more than the rest of a compile (the GEMM's 14
MLIR stages are ~6 MB of text, ~0.5 s of printing) and most compiles are
never read. So an MLIR stage is kept as MLIR bytecode (the binary form:
~0.05 s for all of them, a twentieth of the bytes) and printed, with its
source locations, the first time it is read — in this process or, from the
disk cache, in another one (which then imports MLIR; launching a cached
kernel still does not). Stages that are text to begin with (python, ptx,
the ptxas log, sass) stay text. A bytecode stage prints exactly as the
module it was written from would have.
"""
from __future__ import annotations

import base64
import threading
from collections.abc import MutableMapping


class StageStore(MutableMapping):
    """name -> text; a value may be stored as MLIR bytecode (`put_bytecode`)."""

    def __init__(self, items: dict[str, str | bytes] | None = None):
        self._items: dict[str, str | bytes] = dict(items or {})

    def put_bytecode(self, name: str, blob: bytes) -> None:
        self._items[name] = blob

    def __getitem__(self, name: str) -> str:
        item = self._items[name]
        if isinstance(item, bytes):
            item = self._items[name] = print_bytecode(item)
        return item

    def stored(self, name: str) -> str | bytes:
        """Stage `name` as kept: text, or bytecode not printed yet (read_stage
        parses either, so a view of the IR need not print it first)."""
        return self._items[name]

    def __setitem__(self, name: str, text: str) -> None:
        self._items[name] = text

    def __delitem__(self, name: str) -> None:
        del self._items[name]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"<StageStore: {', '.join(self._items)}>"

    # ---- the disk cache's form: JSON, bytecode as base64

    def to_json(self) -> dict:
        return {name: {"mlirbc": base64.b64encode(v).decode()} if isinstance(v, bytes) else v
                for name, v in self._items.items()}

    @classmethod
    def from_json(cls, data: dict) -> StageStore:
        return cls({name: base64.b64decode(v["mlirbc"]) if isinstance(v, dict) else v
                    for name, v in data.items()})


_printing = threading.Lock()     # one MLIR context for printing, used by one thread at a time
_context = None


def print_bytecode(blob: bytes) -> str:
    """The text of a module written as bytecode, printed as the compiler
    prints its stages (lowering.pipeline.stage_text)."""
    from .lowering.pipeline import stage_text
    return read_stage(blob, stage_text)


def read_stage(stage: str | bytes, read):
    """`read(module)` on a stage's module, parsed from its text or bytecode in
    the one printing context (the tk dialect loaded)."""
    global _context
    from mlir import ir
    from .dialects import tk as tk_dialect
    with _printing:
        if _context is None:
            _context = ir.Context()
            tk_dialect.load(_context)
        with _context:
            return read(ir.Module.parse(stage))
