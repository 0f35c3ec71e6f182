"""What one pass changed: a unified diff of a stage against the stage before.

MLIR prints SSA values, blocks and location aliases with sequential numbers,
so a pass that inserts one op early renumbers every later line: a plain diff
of `reconcile-unrealized-casts` on the GEMM is 3,400 lines for 6 real
changes. Lines are therefore *matched* with those numbers blanked out
(`%12` and `%13` match, `^bb3` and `^bb4`, `#loc7` and `#loc9`), and *shown*
as printed: removed lines as they were, added and context lines as they are
now. A change that is only a renumbering is not a change here; an operand
rewired to another value is not either, unless the line changes otherwise —
`.asm[stage]` has both texts for a plain diff.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from difflib import SequenceMatcher

# What is blanked before matching: SSA values (%12, %c0_i32, %arg3), block
# labels (^bb3) and location aliases (#loc7).
_NUMBERED = re.compile(r"%[\w.$-]+|\^bb\d+|#loc\d*")

CONTEXT = 2   # unchanged lines shown around each change


@dataclass(frozen=True)
class StageDiff:
    """`lines`: (mark, text) pairs; mark is "@" (a hunk header), "-", "+" or " "."""
    lines: list[tuple[str, str]]
    added: int
    removed: int

    @property
    def unchanged(self) -> bool:
        return not self.lines

    def text(self) -> str:
        """The diff as unified-diff text."""
        return "\n".join(text if mark == "@" else mark + text for mark, text in self.lines)


def _shape(line: str) -> str:
    # Indentation too: scf-to-cf flattens regions, moving every line left.
    return _NUMBERED.sub(lambda m: m.group()[0], line).strip()


def _common_ends(old: list[str], new: list[str]) -> tuple[int, int]:
    """How many lines the two share at the start, and then at the end: most
    passes change a little in the middle, and the matcher is quadratic."""
    start, most = 0, min(len(old), len(new))
    while start < most and old[start] == new[start]:
        start += 1
    end = 0
    while end < most - start and old[-1 - end] == new[-1 - end]:
        end += 1
    return start, end


def stage_diff(before: str, after: str, context: int = CONTEXT) -> StageDiff:
    """The unified diff from `before` to `after`, lines matched with SSA,
    block and location numbers ignored (the module's docstring)."""
    old, new = before.splitlines(), after.splitlines()
    old_shapes, new_shapes = [_shape(l) for l in old], [_shape(l) for l in new]
    start, end = _common_ends(old_shapes, new_shapes)
    # autojunk off: in IR, frequent lines (`}`, constants) are real lines.
    matcher = SequenceMatcher(None, old_shapes[start:len(old) - end],
                              new_shapes[start:len(new) - end], autojunk=False)
    opcodes = [("equal", 0, start, 0, start)] if start else []
    opcodes += [(tag, a1 + start, a2 + start, b1 + start, b2 + start)
                for tag, a1, a2, b1, b2 in matcher.get_opcodes() if a1 != a2 or b1 != b2]
    if end:
        opcodes.append(("equal", len(old) - end, len(old), len(new) - end, len(new)))
    matcher.get_opcodes = lambda: opcodes     # (grouped below as difflib groups its own)
    lines, added, removed = [], 0, 0
    for group in matcher.get_grouped_opcodes(context):
        i1, j1, i2, j2 = group[0][1], group[0][3], group[-1][2], group[-1][4]
        lines.append(("@", f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@"))
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                lines += [(" ", l) for l in new[b1:b2]]
                continue
            lines += [("-", l) for l in old[a1:a2]]
            lines += [("+", l) for l in new[b1:b2]]
            removed += a2 - a1
            added += b2 - b1
    return StageDiff(lines, added, removed)
