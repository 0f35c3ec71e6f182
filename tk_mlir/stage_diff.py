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
from bisect import bisect_left
from collections import Counter
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


def _increasing(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest run of `pairs` (sorted by their first index) whose second
    indices increase too (patience sorting)."""
    tops, top_js, links = [], [], {}
    for pair in pairs:
        k = bisect_left(top_js, pair[1])
        links[pair] = tops[k - 1] if k else None
        tops[k:k + 1], top_js[k:k + 1] = [pair], [pair[1]]
    run, pair = [], tops[-1] if tops else None
    while pair is not None:
        run.append(pair)
        pair = links[pair]
    return run[::-1]


def _matches(old: list[str], new: list[str], a1: int, a2: int, b1: int, b2: int,
             out: list[tuple[int, int]]) -> None:
    """Append to `out` the matched (old, new) line pairs of old[a1:a2] and
    new[b1:b2], in order: the shared start and end, then lines that occur
    once on both sides as anchors (patience diff), recursing between them;
    difflib's matcher only for a stretch with no such line. (difflib alone
    is quadratic in IR's many repeated lines: seconds for the GEMM.)"""
    while a1 < a2 and b1 < b2 and old[a1] == new[b1]:
        out.append((a1, b1))
        a1, b1 = a1 + 1, b1 + 1
    tail = []
    while a1 < a2 and b1 < b2 and old[a2 - 1] == new[b2 - 1]:
        a2, b2 = a2 - 1, b2 - 1
        tail.append((a2, b2))
    if a1 < a2 and b1 < b2:
        once_old = Counter(old[a1:a2])
        once_new = Counter(new[b1:b2])
        at_new = {line: j for j, line in enumerate(new[b1:b2], b1) if once_new[line] == 1}
        anchors = _increasing([(i, at_new[line]) for i, line in enumerate(old[a1:a2], a1)
                               if once_old[line] == 1 and line in at_new])
        if anchors:
            for i, j in anchors:
                _matches(old, new, a1, i, b1, j, out)
                out.append((i, j))
                a1, b1 = i + 1, j + 1
            _matches(old, new, a1, a2, b1, b2, out)
        else:
            # autojunk off: in IR, frequent lines (`}`, constants) are real lines.
            blocks = SequenceMatcher(None, old[a1:a2], new[b1:b2], autojunk=False)
            for i, j, n in blocks.get_matching_blocks():
                out += [(a1 + i + k, b1 + j + k) for k in range(n)]
    out += tail[::-1]


def _hunks(matched: list[tuple[int, int]], n_old: int, n_new: int, context: int):
    """Unified-diff hunks from the matched pairs: each a list of (mark, old
    index or new index) rows, changes with `context` unchanged lines around."""
    changes, i, j = [], 0, 0         # (old from, old to, new from, new to) per change
    for mi, mj in [*matched, (n_old, n_new)]:
        if i < mi or j < mj:
            changes.append((i, mi, j, mj))
        i, j = mi + 1, mj + 1
    groups = []
    for change in changes:
        if groups and change[0] - groups[-1][-1][1] <= 2 * context:
            groups[-1].append(change)
        else:
            groups.append([change])
    for group in groups:
        first, last = group[0], group[-1]
        lead = min(context, first[0], first[2])
        trail = min(context, n_old - last[1], n_new - last[3])
        yield (first[0] - lead, last[1] + trail, first[2] - lead, last[3] + trail, group)


def stage_diff(before: str, after: str, context: int = CONTEXT) -> StageDiff:
    """The unified diff from `before` to `after`, lines matched with SSA,
    block and location numbers ignored (the module's docstring)."""
    old, new = before.splitlines(), after.splitlines()
    matched = []
    _matches([_shape(l) for l in old], [_shape(l) for l in new], 0, len(old), 0, len(new),
             matched)
    lines, added, removed = [], 0, 0
    for a1, a2, b1, b2, group in _hunks(matched, len(old), len(new), context):
        lines.append(("@", f"@@ -{a1 + 1},{a2 - a1} +{b1 + 1},{b2 - b1} @@"))
        j = b1
        for c1, c2, d1, d2 in group:
            lines += [(" ", l) for l in new[j:d1]]          # unchanged, as printed now
            lines += [("-", l) for l in old[c1:c2]]
            lines += [("+", l) for l in new[d1:d2]]
            removed, added, j = removed + c2 - c1, added + d2 - d1, d2
        lines += [(" ", l) for l in new[j:b2]]
    return StageDiff(lines, added, removed)
