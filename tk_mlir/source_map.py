"""What each Python line of a kernel became: its tk ops, PTX and SASS.

Every tk op carries its Python file:line:col; the lowering builds each op's
code under that location, the LLVM translation turns it into PTX `.loc`
directives (lowering/pipeline.py: DEBUG_LINES), ptxas -lineinfo keeps them
in the cubin and nvdisasm -g prints them over the SASS. This module reads
them back from the three texts, so no stage needs more than it already has:

    compiled.lines(42)          # LineCode: the ops, PTX lines, SASS instructions
    compiled.source_map.lines() # every line that produced code, in order
"""
from __future__ import annotations

import linecache
import re
from collections import defaultdict
from dataclasses import dataclass

Where = tuple[str, int]          # (file, line)

_PTX_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]*)"', re.M)
_PTX_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+\d+")
_SASS_FILE = re.compile(r'^\s*//## File "([^"]*)", line (\d+)')
_SASS_INSTRUCTION = re.compile(r"^\s*(/\*[0-9a-f]+\*/)\s+(.*?)\s*(?:/\*.*)?$")


def ptx_line_owners(ptx: str) -> list[Where | None]:
    """The (file, line) of each line of `ptx` (split at "\\n"): an
    instruction's is the `.loc` above it; every other line's, and an
    instruction under line 0 (LLVM's "no single line": code merged from
    several), is None."""
    files = {int(n): path for n, path in _PTX_FILE.findall(ptx)}
    owners, where = [], None
    for raw in ptx.split("\n"):
        m = _PTX_LOC.match(raw)
        if m:
            line = int(m[2])
            where = (files.get(int(m[1]), m[1]), line) if line else None
        owners.append(where if where and _is_ptx_instruction(raw.strip()) else None)
    return owners


def ptx_by_line(ptx: str) -> dict[Where, list[str]]:
    """The PTX instructions under each `.loc` (file, line)."""
    return _by_line(ptx, ptx_line_owners(ptx), str.strip)


def _is_ptx_instruction(text: str) -> bool:
    return bool(text) and not text.startswith(("//", ".", "{", "}", ")")) and \
        not text.endswith((":", ","))


def sass_line_owners(sass: str) -> list[Where | None]:
    """The (file, line) of each instruction line of `sass` (split at "\\n"):
    the `//## File "...", line N` of `nvdisasm -g` above it; None for every
    other line."""
    owners, where = [], None
    for raw in sass.split("\n"):
        m = _SASS_FILE.match(raw)
        if m:
            where = (m[1], int(m[2]))
        owners.append(where if not m and _SASS_INSTRUCTION.match(raw) else None)
    return owners


def sass_by_line(sass: str) -> dict[Where, list[str]]:
    """The SASS instructions under each `//## File "...", line N`, as
    `/*addr*/ INSTRUCTION ;`."""
    def short(raw: str) -> str:
        m = _SASS_INSTRUCTION.match(raw)
        return f"{m[1]} {' '.join(m[2].split())}"
    return _by_line(sass, sass_line_owners(sass), short)


def instruction_name(line: str) -> str:
    """The opcode of a PTX or SASS instruction line (`ex2.approx.ftz.f32`,
    `MUFU.EX2`): its first word after SASS's `/*addr*/` and any predicate."""
    m = _SASS_INSTRUCTION.match(line)
    words = (m[2] if m else line).split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].rstrip(";") if words else ""


def _by_line(text: str, owners: list[Where | None], form) -> dict[Where, list[str]]:
    out: dict[Where, list[str]] = defaultdict(list)
    for raw, where in zip(text.split("\n"), owners):
        if where:
            out[where].append(form(raw))
    return dict(out)


def ops_by_line(tk_stage: str | bytes) -> tuple[str, dict[Where, list[str]]]:
    """(the kernel's file, the ops of a tk stage at each source line in the
    short form of dialects/short_form.py), from the stage's generic text or
    bytecode."""
    from .dialects.short_form import op_lines
    from .stages import read_stage

    def read(module):
        rows = op_lines(module.operation)
        out: dict[Where, list[str]] = defaultdict(list)
        for where, _, text, _ in rows:
            if where:
                out[where].append(text)
        return next((w[0] for w, *_ in rows if w), ""), dict(out)
    return read_stage(tk_stage, read)


@dataclass(frozen=True)
class LineCode:
    """One Python line and the code it became."""
    file: str
    line: int
    source: str                # the line's text ("" if the file cannot be read)
    ops: tuple[str, ...]       # tk-stage ops, short form
    ptx: tuple[str, ...]
    sass: tuple[str, ...]      # () when there is no SASS (no ptxas or nvdisasm)

    def __str__(self) -> str:
        parts = [f"{self.file}:{self.line}: {self.source.strip()}"]
        for title, items in (("tk", self.ops), ("ptx", self.ptx), ("sass", self.sass)):
            parts.append(f"  {title} ({len(items)}):")
            parts += [f"    {item}" for item in items]
        return "\n".join(parts)


class SourceMap:
    """Python line -> LineCode for one compiled kernel."""

    def __init__(self, file: str, ops: dict[Where, list[str]], ptx: dict[Where, list[str]],
                 sass: dict[Where, list[str]] | None):
        self.file = file                 # the kernel's own source file
        self._ops, self._ptx, self._sass = ops, ptx, sass or {}

    def line(self, line: int, file: str | None = None) -> LineCode:
        """What `line` of `file` (default: the kernel's file) became."""
        where = (file or self.file, line)
        return LineCode(where[0], line, linecache.getline(where[0], line),
                        tuple(self._ops.get(where, ())), tuple(self._ptx.get(where, ())),
                        tuple(self._sass.get(where, ())))

    def files(self) -> list[str]:
        """The source files with code, the kernel's first (helpers, templates)."""
        wheres = set(self._ops) | set(self._ptx) | set(self._sass)
        return sorted({f for f, _ in wheres}, key=lambda f: (f != self.file, f))

    def find_file(self, name: str) -> str | None:
        """The file with code whose path (as given, or relative to the working
        folder) or base name is `name`."""
        import os
        here = os.path.abspath(name)
        found = [f for f in self.files() if f in (name, here) or f.rsplit("/", 1)[-1] == name]
        return found[0] if len(found) == 1 else None

    def lines(self) -> list[LineCode]:
        """Every line that became code, by file (the kernel's first), then line."""
        wheres = set(self._ops) | set(self._ptx) | set(self._sass)
        return [self.line(line, file) for file, line in
                sorted(wheres, key=lambda w: (w[0] != self.file, w))]


    def listing_lines(self, stages: dict[str, str], tk_stages) -> dict[str, list[int | None]]:
        """For the notebook display: the kernel-file line of each line of the
        python stage, of the tk stages named in `tk_stages` (in their short
        form), and of the PTX and SASS (None: no line, or another file's)."""
        from .dialects.short_form import gutter_line
        out: dict[str, list[int | None]] = {}
        for name, text in stages.items():
            if name == "python":
                first = self.first_line(text)
                if first is not None:
                    out[name] = list(range(first, first + text.count("\n") + 1))
            elif name in tk_stages:
                out[name] = [gutter_line(l) for l in text.split("\n")]
            elif name in ("ptx", "sass"):
                owners = (ptx_line_owners if name == "ptx" else sass_line_owners)(text)
                out[name] = [w[1] if w and w[0] == self.file else None for w in owners]
        return out

    def first_line(self, source: str) -> int | None:
        """Where the kernel's `source` (the python stage: dedented) starts in
        its file; None if the file no longer holds it."""
        want = [l.strip() for l in source.strip("\n").split("\n")]
        have = [l.strip() for l in linecache.getlines(self.file)]
        for i, line in enumerate(have):
            if line == want[0] and have[i:i + len(want)] == want:
                return i + 1
        return None
