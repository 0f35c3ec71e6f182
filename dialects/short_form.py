"""The tk stages in a short form for reading, one line per op:

    // softmax.py
    20 │   %3 = tk.sub_row %1, %2 : rt<f32, 4x1024>

MLIR prints IRDL ops only in the generic form, with long types and `loc(...)`
tails. This view is for people: the op's name (with the attributes its
OpDef's `mnemonic` folds in, as the Python method reads), its operands in
OpDef order with the variadic group in brackets, every other attribute by
name, the result's type in short (types_short below), regions indented, and
the source line as a gutter. It is not parsed back: the generic text
(`compiled.asm[stage]`) stays the re-parsable one.

Everything here is read from the OpDef rows (dialects/tk.py); no op has
printing code of its own. Ops of other dialects (func, scf, arith) print as
MLIR prints them, with tk types shortened.
"""
from __future__ import annotations

import io
import math
import os
import re

from mlir import ir

from . import tk, types as T

GUTTER_BAR = "│"


# ----------------------------------------------------------------- types

def type_short(t: T.TkType) -> str:
    """rt<f32, 4x512>, rt<bf16, 64x64, row, warpgroup>, gl<bf16, ?x4096>,
    st<bf16, 64x64, swizzle 128>, rv<f32, 4, LAYOUT>, sv<f32, 64>, tt<f32, 128x256>, sem:
    dims as AxB, a layout or scope only when it is not the default."""
    if isinstance(t, T.Sem):
        return "sem"
    if isinstance(t, T.GL):
        return f"gl<{t.dtype}, {'x'.join('?' if d is None else str(d) for d in t.shape)}>"
    if isinstance(t, T.ST):
        swizzle = f", swizzle {t.swizzle}" if t.swizzle else ""
        return f"st<{t.dtype}, {t.rows}x{t.cols}{swizzle}>"
    if isinstance(t, T.SV):
        return f"sv<{t.dtype}, {t.length}>"
    if isinstance(t, T.TT):
        return f"tt<{t.dtype}, {t.rows}x{t.cols}>"
    default = T.RT if isinstance(t, T.RT) else T.RV
    dims = f"{t.rows}x{t.cols}" if isinstance(t, T.RT) else str(t.length)
    extra = [v for v, d in ((t.layout, default.layout), (t.scope, default.scope)) if v != d]
    return f"{type(t).__name__.lower()}<{', '.join([t.dtype, dims, *extra])}>"


def types_short(text: str) -> str:
    """`text` with every `!tk.<name><...>` type (brackets balanced) in short."""
    out, i = [], 0
    while (start := text.find("!tk.", i)) >= 0:
        end = start + 4
        while end < len(text) and (text[end].isalnum() or text[end] == "_"):
            end += 1
        if text.startswith("<", end):
            depth = 0
            for end in range(end, len(text)):
                depth += {"<": 1, ">": -1}.get(text[end], 0)
                if depth == 0:
                    break
            end += 1
        parsed = T.parse(text[start:end])
        out += [text[i:start], type_short(parsed) if parsed else text[start:end]]
        i = end
    return "".join(out) + text[i:]


# ------------------------------------------------------------ attributes

def attribute_short(attr: ir.Attribute) -> str:
    """An attribute's value as Python would write it: 0, 0.5, -inf, row, true."""
    value = tk.attribute_value(attr)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("-inf" if value < 0 else
                                                         "inf" if value > 0 else "nan")
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(attr, ir.DenseI32ArrayAttr):
        return "[" + ", ".join(map(str, attr)) + "]"
    return str(attr)


def _attribute_names(op: ir.Operation, d: tk.OpDef) -> list[str]:
    """The op's attributes to show: its own, in OpDef order, then what the
    passes added (contracts: offsets, hints), by name."""
    present = set(op.attributes)
    return [n for n in d.attributes if n in present] + \
        sorted(present - set(d.attributes))


def mnemonic_fields(d: tk.OpDef) -> tuple[str, ...]:
    """The attributes the op's mnemonic template names."""
    return tuple(re.findall(r"\{(\w+)\}", d.mnemonic or ""))


# ------------------------------------------------------------------ ops

class _Namer:
    """SSA names as the generic text has them (one AsmState for the module)."""

    def __init__(self, root: ir.Operation):
        self.state = ir.AsmState(root)

    def __call__(self, v: ir.Value) -> str:
        return v.get_name(self.state)

    def print(self, op: ir.Operation) -> str:
        f = io.StringIO()
        op.print(state=self.state, file=f)
        return f.getvalue()


def tk_op_short(op: ir.Operation, name: _Namer) -> str:
    """One tk op, read off its OpDef: `%r = tk.NAME a, b [i, j] {attr=v} : T`."""
    d = tk.op_def(op)
    attrs = {n: attribute_short(op.attributes[n]) for n in op.attributes}
    folded = mnemonic_fields(d)
    op_name = d.mnemonic.format(**attrs) if d.mnemonic and all(f in attrs for f in folded) \
        else d.name
    operands = list(op.operands)
    text = "tk." + op_name
    fixed = [name(v) for v in operands[:len(d.operands)]]
    if fixed:
        text += " " + ", ".join(fixed)
    if d.variadic and len(operands) > len(d.operands):
        text += " [" + ", ".join(name(v) for v in operands[len(d.operands):]) + "]"
    shown = [n for n in _attribute_names(op, d) if not (d.mnemonic and n in folded)]
    if shown:
        text += " {" + ", ".join(f"{n}={attrs[n]}" for n in shown) + "}"
    if len(op.results):
        text = ", ".join(name(r) for r in op.results) + " = " + text
        text += " : " + ", ".join(types_short(str(r.type)) for r in op.results)
    return text


def _other_op_short(op: ir.Operation, name: _Namer) -> tuple[str, list[str]]:
    """(first line, the lines closing each region) of an op MLIR prints."""
    lines = name.print(op).rstrip("\n").split("\n")
    closers = [types_short(l) for l in lines[1:] if l and not l[0].isspace()]
    return types_short(lines[0]), closers


# --------------------------------------------------------------- listing

def source_line(loc: ir.Location) -> tuple[str, int] | None:
    """(file, line) of an op's location: a file location, or the first one
    inside a fused / named / call-site location; None if it has none."""
    if loc.is_a_file():
        # ("-": made up by the parser of stage text, not the user's source.)
        return (loc.filename, loc.start_line) if loc.filename != "-" else None
    if loc.is_a_fused():
        inner = loc.locations
    elif loc.is_a_name():
        inner = [loc.child_loc]
    elif loc.is_a_callsite():
        inner = [loc.callee]
    else:
        inner = []
    for child in inner:
        found = source_line(child)
        if found:
            return found
    return None


def op_lines(root: ir.Operation) -> list[tuple[tuple[str, int] | None, int, str, ir.Operation]]:
    """(source (file, line), depth, text, op) for each op under `root`,
    in program order, region closers as lines of their own (op None)."""
    name = _Namer(root)
    out = []

    def visit(op: ir.Operation, depth: int) -> None:
        if _is_bare_terminator(op):
            return
        where = source_line(op.location)
        if tk.op_def(op) is not None:
            out.append((where, depth, tk_op_short(op, name), op))
            return
        first, closers = _other_op_short(op, name)
        out.append((where, depth, first, op))
        regions = [r for r in op.regions if len(r.blocks)]
        for i, (region, closer) in enumerate(zip(regions, closers)):
            before = len(out)
            for block in region.blocks:
                for inner in block.operations:
                    visit(inner.operation, depth + 1)
            if i and len(out) == before:   # an empty else: `}` closes the op, as MLIR prints it
                out.pop()
            out.append((None, depth, closer, None))

    for op in _top_ops(root):
        visit(op, 0)
    return out


def _is_bare_terminator(op: ir.Operation) -> bool:
    """An operand-less scf.yield ending a region: MLIR's own printer leaves it
    out (and its location is only where the parser made it up)."""
    return op.name == "scf.yield" and not len(op.operands)


def _top_ops(root: ir.Operation) -> list[ir.Operation]:
    """The kernel's ops: a module's, or the op itself."""
    if root.name == "builtin.module":
        return [op.operation for op in root.regions[0].blocks[0].operations]
    return [root]


def short_form(module: ir.Module | ir.Operation) -> str:
    """The whole listing of a tk-stage module, with its source gutter: the
    line number for the kernel's own file (named in the first line), the
    file's base name too for lines from another file."""
    root = module.operation
    rows = op_lines(root)
    main = next((w[0] for w, *_ in rows if w), None)
    gutters = [_gutter(w, main) for w, *_ in rows]
    width = max(map(len, gutters), default=0)
    header = [f"// {os.path.basename(main)}"] if main else []
    return "\n".join(header + [f"{g:>{width}} {GUTTER_BAR} {'  ' * depth}{text}"
                               for g, (_, depth, text, _) in zip(gutters, rows)]) + "\n"


def _gutter(where: tuple[str, int] | None, main: str | None) -> str:
    if where is None:
        return ""
    file, line = where
    return str(line) if file == main else f"{os.path.basename(file)}:{line}"


_GUTTER = re.compile(rf"^\s*(\d+) {GUTTER_BAR} ")


def gutter_line(listing_line: str) -> int | None:
    """The kernel-file line in a short-form line's gutter (short_form: a
    bare number); None for a line from another file or without one."""
    m = _GUTTER.match(listing_line)
    return int(m[1]) if m else None
