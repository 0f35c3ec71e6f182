"""A kernel's stages: stage name -> the IR text after it, in pipeline order
(python, tk, each tk pass, tk-to-gpu, each upstream pass, llvm, ptx, ptxas).

Printing every stage costs more than the rest of a compile (the GEMM's 14
MLIR stages are ~6 MB of text, ~0.5 s of printing) and most compiles are
never read. So a `StageStore` keeps an MLIR stage in the cheapest form that
can still print it, and prints it the first time it is read:

- during the compile, as a snapshot: a clone of the module (~1 ms), alive in
  the compile's MLIR context;
- once the compile hands the kernel over, as MLIR bytecode (the binary form:
  ~0.05 s for all of them, a twentieth of the bytes), which outlives that
  context, goes into the disk cache and prints, with its source locations,
  in this process or in another one (which then imports MLIR; launching a
  cached kernel still does not).

Stages that are text to begin with (python, ptx, the ptxas log, sass) stay
text. A stage prints exactly as the module it was kept from would have
(`stage_text`), whichever form it was kept in.

Here too, what reads a kept stage without printing it: `read_stage` (parse
it in the one printing context) and `short_text` (a tk stage in short).
"""
from __future__ import annotations

import base64
import io
import threading
from collections.abc import MutableMapping

# (MLIR is imported only where a stage is printed or parsed: a kernel read
# from the disk cache launches without it.)


def stage_text(module) -> str:
    """The text of `module` (an ir.Module or ir.Operation) as every stage is
    printed: generic, re-parsable, with its source locations."""
    op = getattr(module, "operation", module)
    return op.get_asm(enable_debug_info=True, large_elements_limit=64)


class StageStore(MutableMapping):
    """Stage name -> text, in the order stages were added; a stage may be kept
    as a snapshot or as bytecode (the module's docstring), printed when read.

    Invariant: what a compiled kernel holds has no snapshot left (the
    compiler keeps its stages with `extend`, which writes snapshots as
    bytecode), so a kernel's store never refers to a compile's MLIR context
    and is all plain data (`to_json`)."""

    def __init__(self, items: dict[str, str | bytes] | None = None):
        self._items: dict[str, str | bytes | _Snapshot] = dict(items or {})

    def snapshot(self, name: str, module) -> None:
        """Keep stage `name` as a clone of `module`, as it is now."""
        self._items[name] = _Snapshot(module.operation.clone())

    def same_as(self, name: str, earlier: str) -> None:
        """Stage `name` left the IR as stage `earlier` did: kept once, printed once."""
        self._items[name] = self._items[earlier]

    def extend(self, other: StageStore) -> None:
        """Add `other`'s stages after these, in their stored form (`stored`):
        a snapshot is written as bytecode here, nothing is printed."""
        for name in other:
            self._items[name] = other.stored(name)

    def stored(self, name: str) -> str | bytes:
        """Stage `name` as text if it is printed (or was text), else as
        bytecode (read_stage parses either, so a view of the IR need not
        print it first)."""
        item = self._items[name]
        return item.stored() if isinstance(item, _Snapshot) else item

    def __getitem__(self, name: str) -> str:
        item = self._items[name]
        if isinstance(item, _Snapshot):
            return item.text()
        if isinstance(item, bytes):
            item = self._items[name] = print_bytecode(item)
        return item

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
        out = {}
        for name in self._items:
            v = self.stored(name)
            out[name] = {"mlirbc": base64.b64encode(v).decode()} if isinstance(v, bytes) else v
        return out

    @classmethod
    def from_json(cls, data: dict) -> StageStore:
        return cls({name: base64.b64decode(v["mlirbc"]) if isinstance(v, dict) else v
                    for name, v in data.items()})


class _Snapshot:
    """A clone of a stage's module, printed once when read (then only its
    text is kept) or written as bytecode for keeping."""

    def __init__(self, op):
        self._op, self._text = op, None

    def text(self) -> str:
        if self._text is None:
            self._text, self._op = stage_text(self._op), None
        return self._text

    def stored(self) -> str | bytes:
        if self._text is not None:
            return self._text
        out = io.BytesIO()
        self._op.write_bytecode(out)
        return out.getvalue()


def tk_stage_names() -> tuple[str, ...]:
    """The stages whose IR is tk ops: the frontend's, then each tk pass's."""
    from .lowering.pipeline import TK_PASSES
    return ("tk", *(name for name, _ in TK_PASSES))


# ------------------------------------------------- reading a kept stage

_printing = threading.Lock()     # one MLIR context for printing, used by one thread at a time
_context = None


def print_bytecode(blob: bytes) -> str:
    """The text of a module written as bytecode, printed as every stage is
    (stage_text)."""
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


def short_text(stage: str | bytes) -> str:
    """The short form of a tk stage (dialects/short_form.py: one line per op,
    short types, the source line as a gutter) from its text or its bytecode."""
    from .dialects.short_form import short_form
    return read_stage(stage, short_form)
