"""HTML for Jupyter: a compiled kernel's numbers and IR stages, one folded
block per stage, highlighted by a small regex highlighter (no dependencies).

The page is plain HTML with inline CSS (no script, nothing fetched), so it
reads the same in JupyterLab, the classic Notebook, VS Code and a saved
.ipynb opened offline. A notebook stores every byte of it, so the page is
kept small: a pass's stage shows only what the pass changed, long listings
are cut with a count and the call that shows them whole (`Listing`,
`compiled.show(stage)`). A Python line leads to the code it became by CSS
alone (hover, or its anchor in the URL: `_LineTags`); a cut PTX or SASS
listing keeps some of each line's code (`_linked`).

Highlighting tokenizes the *raw* text and HTML-escapes every piece it emits,
matched or not, so the patterns can see a real ``<`` in ``!tk.rt<bf16, 16, 64>``
while nothing unescaped ever reaches the page.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass

from .source_map import instruction_name
from .stage_diff import stage_diff

# Every selector sits under this class so the styles stay inside our fragment.
_SCOPE = "tk-mlir-stages"


# --------------------------------------------------------------------------
# Highlighter
# --------------------------------------------------------------------------

def _nested(open_: str, close: str, depth: int, atom: str) -> str:
    """A regex for ``open_ ... close`` balanced up to ``depth`` levels
    (Python's re has no recursion; IR types rarely nest deeper than 3)."""
    inner = f"(?:{atom})*"
    for _ in range(depth):
        inner = f"(?:{atom}|{re.escape(open_)}{inner}{re.escape(close)})*"
    return f"{re.escape(open_)}{inner}{re.escape(close)}"


_STR = r'"(?:[^"\\\n]|\\.)*"'
_ANGLES = _nested("<", ">", 3, r"[^<>\n]")
_PARENS = _nested("(", ")", 3, rf'[^()"\n]|{_STR}')


@dataclass(frozen=True)
class _Lexer:
    # A statement head: ``lead`` is tokenized normally, ``op`` is the
    # instruction or op name. Anchoring at line start is what tells an op
    # (``scf.for``) from an attribute key (``nvvm.maxntid =``) or a PTX
    # instruction (``ld.global.f32``) from its operands.
    head: re.Pattern
    # Named groups; a group's name is its CSS class.
    tokens: re.Pattern


def _tokens(*rules: tuple[str, str]) -> re.Pattern:
    return re.compile("|".join(f"(?P<{cls}>{rx})" for cls, rx in rules))


_MLIR = _Lexer(
    head=re.compile(
        r"(?P<lead>\s*(?:%[\w.$-]+(?::\d+)?(?:\s*,\s*%[\w.$-]+(?::\d+)?)*\s*=\s*)?)"
        r'(?P<op>"[a-z_][\w$]*(?:\.[\w$]+)+"|[a-z_][\w$]*(?:\.[\w$]+)*)(?![\w.$])'
    ),
    tokens=_tokens(
        ("com", r"//.*"),
        ("loc", rf"\bloc{_PARENS}"),
        ("str", _STR),
        ("ty", rf"![\w.$]+(?:{_ANGLES})?"
               rf"|\b(?:vector|memref|tensor|complex|tuple){_ANGLES}"
               r"|\b(?:[isu]\d+|f\d+|bf16|tf32|f8E\w+|index)\b"),
        ("attr", rf"#[\w.$]+(?:{_ANGLES})?"),
        ("ssa", r"%[\w.$-]+(?:#\d+)?"),
        ("sym", rf"@[\w.$-]+|@{_STR}"),
        ("lbl", r"\^[\w.$-]+"),
        ("num", r"\b(?:0x[0-9a-fA-F]+|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\b"),
    ),
)

_PTX = _Lexer(
    head=re.compile(r"(?P<lead>\s*(?:@!?%[\w$]+\s+)?)(?P<op>[a-z]\w*(?:\.\w+(?:::\w+)*)*)(?=[\s;]|$)"),
    tokens=_tokens(
        ("com", r"//.*|/\*.*?\*/"),
        ("str", _STR),
        ("pred", r"@!?%[\w$]+"),
        ("reg", r"%[\w$]+(?:\.[xyzw]\b)?"),
        ("dir", r"\.[A-Za-z_][\w$]*"),
        ("lbl", r"\$[\w$]+"),
        ("num", r"\b(?:0[xX][0-9a-fA-F]+|0[fFdD][0-9a-fA-F]{8,16}|\d+(?:\.\d+)?)\b"),
    ),
)

_SASS = _Lexer(
    # nvdisasm/cuobjdump lines: an address comment, an optional dual-issue
    # brace, an optional predicate, then the opcode.
    head=re.compile(
        r"(?P<lead>\s*(?:/\*[0-9a-fA-F]+\*/\s*)?(?:\{\s*)?(?:@!?U?P(?:T|\d+)\s+)?)"
        r"(?P<op>[A-Z][A-Z0-9_]*(?:\.[\w]+)*)(?=[\s;]|$)"
    ),
    tokens=_tokens(
        ("com", r"/\*.*?\*/|//.*"),
        ("str", _STR),
        ("pred", r"@!?U?P(?:T|\d+)\b"),
        ("reg", r"\b(?:U?R(?:\d+|Z)|U?P(?:\d+|T)|SR_\w+(?:\.[XYZ])?)\b"),
        ("lbl", r"`?\(?\.L_\w+\)?"),
        ("dir", r"\.[A-Za-z_][\w.]*"),
        ("num", r"-?\b(?:0x[0-9a-fA-F]+|\d+(?:\.\d+)?(?:e[+-]?\d+)?)\b"),
    ),
)


def _lexer_for(stage: str) -> _Lexer | None:
    name = stage.lower()
    if "ptx" in name:
        return _PTX
    if "sass" in name:
        return _SASS
    if "python" in name:
        return None
    return _MLIR


def _span(cls: str, text: str) -> str:
    # Prefixed: the notebook's own stylesheets may already use short names.
    return f'<span class="t-{cls}">{html.escape(text, quote=False)}</span>'


def _highlight_tokens(text: str, tokens: re.Pattern) -> str:
    out, pos = [], 0
    for m in tokens.finditer(text):
        out.append(html.escape(text[pos:m.start()], quote=False))
        out.append(_span(m.lastgroup, m.group()))
        pos = m.end()
    out.append(html.escape(text[pos:], quote=False))
    return "".join(out)


def _highlight_line(line: str, lexer: _Lexer) -> str:
    m = lexer.head.match(line)
    if not m:
        return _highlight_tokens(line, lexer.tokens)
    return (_highlight_tokens(m["lead"], lexer.tokens) + _span("op", m["op"])
            + _highlight_tokens(line[m.end():], lexer.tokens))


def highlight(text: str, stage: str) -> str:
    """``text`` as escaped HTML with ``<span class=...>`` tokens, in the
    language the stage name suggests (ptx, sass, python, else MLIR)."""
    lexer = _lexer_for(stage)
    if lexer is None:
        return html.escape(text, quote=False)
    return "\n".join(_highlight_line(line, lexer) for line in text.split("\n"))


# --------------------------------------------------------------------------
# Page
# --------------------------------------------------------------------------

_CSS = f"""
.{_SCOPE} {{ font-family: var(--jp-ui-font-family, sans-serif); font-size: 13px; }}
.{_SCOPE} .t-head {{ margin: 4px 0; overflow-x: auto; }}
.{_SCOPE} .t-title {{ display: block; font-weight: 600; font-size: 14px; font-family: var(--jp-code-font-family, monospace); }}
.{_SCOPE} table.t-meta {{ border-collapse: collapse; font-size: 12px; margin: 0; }}
.{_SCOPE} table.t-meta th, .{_SCOPE} table.t-meta td {{ padding: 1px 8px; text-align: left; border: none; }}
.{_SCOPE} table.t-meta th {{ font-weight: normal; opacity: .7; }}
.{_SCOPE} table.t-meta td.t-bad {{ color: #c62828; font-weight: 600; }}
.{_SCOPE} details {{ margin: 2px 0; }}
.{_SCOPE} summary {{ cursor: pointer; font-family: var(--jp-code-font-family, monospace); }}
.{_SCOPE} summary .t-count {{ opacity: .6; margin-left: .6em; }}
.{_SCOPE} pre {{ margin: 2px 0 6px 0; padding: 6px 8px; max-height: 40em; overflow: auto;
  background: rgba(127, 127, 127, .08); font-size: 12px; line-height: 1.35; }}
.{_SCOPE} .t-note {{ font-style: italic; opacity: .7; }}
.{_SCOPE} .t-op {{ color: #7b1fa2; font-weight: 600; }}
.{_SCOPE} .t-ssa, .{_SCOPE} .t-reg {{ color: #1565c0; }}
.{_SCOPE} .t-ty {{ color: #00796b; }}
.{_SCOPE} .t-attr, .{_SCOPE} .t-dir {{ color: #b26a00; }}
.{_SCOPE} .t-sym, .{_SCOPE} .t-lbl {{ color: #ad1457; }}
.{_SCOPE} .t-pred {{ color: #c62828; font-weight: 600; }}
.{_SCOPE} .t-str {{ color: #2e7d32; }}
.{_SCOPE} .t-num {{ color: #e65100; }}
.{_SCOPE} .t-com {{ color: #757575; font-style: italic; }}
.{_SCOPE} .t-loc {{ opacity: .4; }}
.{_SCOPE} .t-add {{ background: rgba(46, 160, 67, .18); }}
.{_SCOPE} .t-del {{ background: rgba(248, 81, 73, .18); }}
.{_SCOPE} .t-hunk {{ color: #6f42c1; opacity: .8; }}
.{_SCOPE} .t-sub {{ font-size: 12px; opacity: .7; margin-top: 2px; }}
.{_SCOPE} pre > [class^="t-py"] {{ display: inline-block; min-width: 100%; }}
.{_SCOPE} .t-gut {{ opacity: .45; color: inherit; text-decoration: none; }}
.{_SCOPE} a.t-gut:hover {{ opacity: 1; text-decoration: underline; }}
.{_SCOPE} ul.t-warn {{ margin: 0; padding-left: 1.5em; font-size: 12px; color: #b26a00;
  font-family: var(--jp-code-font-family, monospace); }}
"""


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def _format_value(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "—" if value is None else str(value)


_BAD = ' class="t-bad"'


def _is_bad(key: str, value) -> bool:
    # Spills (and the local-memory loads and stores they become) are the
    # numbers a kernel author must never miss.
    bad_if_any = "spill" in key.lower() or key in ("LDL", "STL")
    return bad_if_any and isinstance(value, (int, float)) and value > 0


def _table(row: dict) -> str:
    heads = "".join(f"<th>{html.escape(str(k))}</th>" for k in row)
    cells = "".join(
        f"<td{_BAD if _is_bad(str(k), v) else ''}>{html.escape(_format_value(v))}</td>"
        for k, v in row.items()
    )
    return f'<table class="t-meta"><tr>{heads}</tr><tr>{cells}</tr></table>'


def _meta_html(meta: dict) -> str:
    """Numbers in one table; a dict value (the instruction mix) as a table
    of its own under its key; a list value (ptxas warnings) as lines."""
    scalars = {k: v for k, v in meta.items() if not isinstance(v, (dict, list))}
    out = _table(scalars) if scalars else ""
    for key, value in meta.items():
        if isinstance(value, dict) and value:
            out += f'<div class="t-sub">{html.escape(str(key))}</div>{_table(value)}'
        elif isinstance(value, list) and value:
            items = "".join(f"<li>{html.escape(str(v))}</li>" for v in value)
            out += f'<div class="t-sub">{html.escape(str(key))}</div><ul class="t-warn">{items}</ul>'
        elif isinstance(value, list):      # "no warnings" is a fact worth a line
            out += f'<div class="t-sub">{html.escape(str(key))}: none</div>'
    return out


def _open_stage(names: list[str]) -> str | None:
    """The first tk stage is what a kernel author reads first; later stages
    (PTX, SASS) are long and opened on demand."""
    for name in names:
        if name.lower().startswith("tk"):
            return name
    return names[0] if names else None


# How much of a stage the page holds (a notebook keeps every byte of it,
# and highlighting triples the text). The Python and the first tk stage are
# shown whole up to FULL_LINES. Every other listing and diff shares
# PAGE_CHARS characters of IR (stages that need less leave the rest to the
# others) and is cut at CUT_LINES lines, with a count and the call that
# shows it whole. A cut PTX or SASS listing gives up to LINKED_SHARE of its
# share to the first line of each kind of instruction each Python line
# became (_linked), so that the line links (_LineTags) find code past its
# first lines: softmax's `.exp()` is ex2.approx and MUFU.EX2 far down.
FULL_LINES = 2000
CUT_LINES = 150
PAGE_CHARS = 45_000
LINKED_SHARE = 0.5


@dataclass
class _Shown:
    """What the page shows of one stage: `lines` are (mark, text) pairs, the
    mark "" for a listing and stage_diff's marks for a diff."""
    lines: list[tuple[str, str]]
    tag: str                # after the stage's name: its size, or what changed
    whole: bool = False     # shown whole (up to FULL_LINES): not cut to a share
    more: str = ""          # the note under a cut listing or diff
    same_as: str = ""       # unchanged: the stage it equals
    is_diff: bool = False
    at: list[int | None] | None = None   # each line's index in the stage (None: a
                                         # gap's note); None: the stage's first lines

    def chars(self) -> int:
        return sum(len(text) + 1 for _, text in self.lines)


def _cut(lines: list, limit: int, chars: int | None) -> list:
    """The first lines of `lines`, at most `limit` and (when given) `chars`
    characters; always at least one."""
    kept, used = [], 0
    for item in lines[:limit]:
        used += len(item[1]) + 1
        if kept and chars is not None and used > chars:
            break
        kept.append(item)
    return kept


def _shares(needs: list[int], budget: int) -> list[int]:
    """`budget` split over stages needing `needs`: each gets what it needs,
    up to an equal share of what the smaller ones left."""
    shares, left = [0] * len(needs), budget
    for k, i in enumerate(sorted(range(len(needs)), key=needs.__getitem__)):
        shares[i] = min(needs[i], left // (len(needs) - k))
        left -= shares[i]
    return shares


def _calls(name: str, diff: bool = False) -> str:
    quoted = json.dumps(name)
    whole = f".show({quoted}) or .asm[{quoted}]"
    return f".show({quoted}, diff=True); the whole stage: {whole}" if diff else whole


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _shown(name: str, text: str, before: tuple[str, str] | None, whole: bool) -> _Shown:
    """A pass stage (MLIR after MLIR) as what changed, when that is at most
    half the stage; anything else as a listing. Not cut yet (`_cut_to`)."""
    lines = _lines(text)
    size = _plural(len(lines), "line")
    if before is not None:
        previous, previous_text = before
        if previous_text == text:
            return _Shown([], f"{size}, unchanged", same_as=previous)
        diff = stage_diff(previous_text, text)
        if len(diff.lines) <= len(lines) // 2:     # (else it rewrote the stage)
            return _Shown(diff.lines, f"{size}, +{diff.added:,} −{diff.removed:,}", is_diff=True)
    return _Shown([("", l) for l in lines], size, whole=whole)


def _cut_to(name: str, shown: _Shown, chars: int | None,
            owners: list[int | None] | None = None) -> None:
    """Cut `shown` to its share of the page, saying what was left out.
    `owners`: the Python line of each line of a PTX or SASS listing, whose
    linked lines a cut then keeps too (_cut_linked)."""
    total, limit = len(shown.lines), FULL_LINES if shown.whole else CUT_LINES
    head = _cut(shown.lines, limit, chars)
    more = total - len(head)
    if more and owners and chars is not None and not shown.is_diff:
        return _cut_linked(name, shown, _kept(shown.lines, limit, chars, owners))
    shown.lines = head
    if not more:
        return
    if shown.is_diff:
        shown.more = f"… {_plural(more, 'more diff line')}: {_calls(name, True)}"
    else:
        shown.tag += f", first {len(shown.lines):,} shown"
        shown.more = f"… {_plural(more, 'more line')}: {_calls(name)}"


def _linked(texts: list[str], owners: list[int | None]) -> list[int]:
    """The index of the first line of each kind of instruction (opcode) each
    Python line became, every Python line's first kind before any line's
    second, and so on: a tight share still gives every line some code."""
    first: dict[tuple[int, str], int] = {}
    for i, (text, line) in enumerate(zip(texts, owners)):
        if line:
            first.setdefault((line, instruction_name(text)), i)
    kinds, ranked = Counter(), []
    for (line, _), i in first.items():         # (in listing order)
        ranked.append((kinds[line], i))
        kinds[line] += 1
    return [i for _, i in sorted(ranked)]


def _kept(lines: list, limit: int, chars: int, owners: list[int | None]) -> list[int]:
    """The indices a cut listing keeps: linked lines (_linked) in up to
    LINKED_SHARE of `chars` and half of `limit`, then its first lines in
    what is left."""
    picked, used = [], 0
    for i in _linked([text for _, text in lines], owners):
        if len(picked) >= limit // 2 or used + len(lines[i][1]) + 1 > chars * LINKED_SHARE:
            break
        picked.append(i)
        used += len(lines[i][1]) + 1
    head = _cut(lines, max(limit - len(picked), 1), chars - used)
    kept = set(range(len(head))) | set(picked)
    return sorted(kept | {i + 1 for i in kept if i + 2 in kept})   # (a one-line gap's
                                                                    # note is no shorter)


def _cut_linked(name: str, shown: _Shown, kept: list[int]) -> None:
    """Keep the lines of `shown` at `kept`, with a note "… N lines not shown"
    in each gap between them (the last gap's is the note under the listing)."""
    lines, at, last = [], [], -1
    for i in kept:
        if i > last + 1:
            lines.append(("…", f"… {_plural(i - last - 1, 'line')} not shown"))
            at.append(None)
        lines.append(shown.lines[i])
        at.append(i)
        last = i
    more = len(shown.lines) - 1 - last
    shown.lines, shown.at = lines, at
    shown.tag += f", {len(kept):,} shown"
    shown.more = (f"… {_plural(more, 'more line')}: " if more else "the whole stage: ") + _calls(name)


_MARKS = {"+": "t-add", "-": "t-del"}


def _line_html(mark: str, text: str, lexer: _Lexer | None) -> str:
    if mark == "@":
        return _span("hunk", text)
    if mark == "…":                 # a cut listing's gap
        return _span("note", text)
    body = html.escape(text, quote=False) if lexer is None else _highlight_line(text, lexer)
    if not mark:
        return body
    if mark == " ":
        return " " + body
    return f'<span class="{_MARKS[mark]}">{mark}{body}</span>'


def _stage_html(name: str, shown: _Shown, is_open: bool, tags: "_LineTags") -> str:
    lexer = _lexer_for(name)
    if shown.same_as:
        body = f'<div class="t-note">the same text as {html.escape(shown.same_as)}</div>'
    else:
        rows = [_line_html(m, t, lexer) for m, t in shown.lines]
        if not shown.is_diff:       # (a diff's lines are not the stage's: untagged)
            rows = tags.rows(name, rows, shown.at)
        body = "<pre>" + "\n".join(rows) + "</pre>"
    if shown.more:
        body += f'<div class="t-note">{html.escape(shown.more, quote=False)}</div>'
    return (f'<details data-stage="{html.escape(name)}"{" open" if is_open else ""}>'
            f'<summary>{html.escape(name)}<span class="t-count">{html.escape(shown.tag)}</span>'
            f"</summary>{body}</details>")


class _LineTags:
    """Python line -> its code, with no script: every listing line a Python
    line produced is wrapped in `<span class="t-pyN">`, each Python line with
    code gets an anchor `ID-LN` in a gutter, and one CSS rule per such line
    highlights all of `t-pyN` while one of them is hovered or the anchor is
    the URL's target (or focused: a click where the URL cannot change).
    ID is this page's, so two kernels in one notebook keep their anchors
    apart; it is a hash of the page's text, so a re-run keeps the bytes."""

    def __init__(self, page_id: str, lines: dict[str, list[int | None]]):
        self.id, self.lines = page_id, lines
        self.coded = {n for name, tags in lines.items() if name != "python"
                      for n in tags if n}

    def rows(self, name: str, rows: list[str], at: list[int | None] | None) -> list[str]:
        """`rows`, the stage's lines at `at` (_Shown.at), tagged."""
        tags = self.lines.get(name)
        if not tags:
            return rows
        if at is not None:
            tags = [None if i is None else tags[i] for i in at]
        if name == "python":
            width = len(str(max(tags)))
            rows = [self._gutter(n, width) + row for n, row in zip(tags, rows)]
        return [f'<span class="t-py{n}">{row}</span>' if n in self.coded else row
                for n, row in zip(tags, rows)]

    def _gutter(self, line: int, width: int) -> str:
        number = f"{line:>{width}}"
        if line not in self.coded:
            return f'<span class="t-gut">{number}</span> '
        anchor = f"{self.id}-L{line}"
        return f'<a class="t-gut" id="{anchor}" href="#{anchor}">{number}</a> '

    def css(self) -> str:
        if not self.coded:
            return ""
        p = self.id
        return ",".join(f"#{p}:has(.t-py{n}:hover,#{p}-L{n}:target,#{p}-L{n}:focus) .t-py{n}"
                        for n in sorted(self.coded)) + \
            " { background: rgba(255, 193, 7, .4); }"


def _page_id(title: str, stages: dict[str, str]) -> str:
    digest = hashlib.sha1(title.encode())
    for text in stages.values():
        digest.update(text.encode())
    return "tk" + digest.hexdigest()[:10]


def _is_mlir(name: str) -> bool:
    return _lexer_for(name) is _MLIR


def _owners(name: str, lines: dict | None) -> list[int | None] | None:
    """The Python line of each line of a PTX or SASS stage, if known."""
    return (lines or {}).get(name) if _lexer_for(name) in (_PTX, _SASS) else None


def stages_html(title: str, stages: dict[str, str], meta: dict | None = None,
                lines: dict[str, list[int | None]] | None = None) -> str:
    """An HTML fragment showing ``title``, the kernel's numbers in ``meta``
    (registers, shared memory, spills, threads, ...; a dict value becomes a
    table of its own, a list value a list) and one folded ``<details>`` per
    stage, in the order given: a pass's stage as a diff against the stage
    before it (stage_diff.py), other stages as listings, cut where long.
    ``lines``: per stage, the Python line of each of its lines (None: no
    line), for the hover and anchor links of _LineTags."""
    names = list(stages)
    opened = _open_stage(names)
    head = f'<div class="t-head"><span class="t-title">{html.escape(title)}</span>'
    if meta:
        head += _meta_html(meta)
    head += "</div>"
    shown, before = {}, None
    for name in names:
        text = stages[name]
        mlir = _is_mlir(name)
        shown[name] = _shown(name, text, before if mlir else None, name in (opened, "python"))
        before = (name, text) if mlir else None
    shared = [name for name in names if not shown[name].whole]
    for name, chars in zip(shared, _shares([shown[n].chars() for n in shared], PAGE_CHARS)):
        _cut_to(name, shown[name], chars, _owners(name, lines))
    for name in names:
        if shown[name].whole:
            _cut_to(name, shown[name], None)
    tags = _LineTags(_page_id(title, stages), lines or {})
    body = "".join(_stage_html(name, shown[name], name == opened, tags) for name in names)
    return (f'<div class="{_SCOPE}" id="{tags.id}"><style>{_CSS}{tags.css()}</style>'
            f"{head}{body}</div>")


def _results_are_displayed() -> bool:
    """Whether something shows the value of a bare expression: IPython (a
    notebook, or its terminal) or Python's interactive prompt; not a script."""
    if hasattr(sys, "ps1"):
        return True
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return get_ipython is not None and get_ipython() is not None


class Listing:
    """One stage's whole text (or its whole diff), as `compiled.show(stage)`
    returns it: plain text as a string, highlighted in a notebook. In a
    script, where nothing displays a returned value, making one prints its
    text to stdout: `compiled.show("ptx")` shows the stage there too
    (`compiled.asm[stage]` is the text without printing it)."""

    def __init__(self, title: str, stage: str, text: str, diff: bool = False):
        self.title, self.stage, self.text, self.diff = title, stage, text, diff
        if not _results_are_displayed():
            print(text, end="" if text.endswith("\n") else "\n")

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        lexer = _lexer_for(self.stage)
        if self.diff:
            rows = [("@" if l.startswith("@@") else l[:1], l if l.startswith("@@") else l[1:])
                    for l in _lines(self.text)]
        else:
            rows = [("", l) for l in _lines(self.text)]
        body = "\n".join(_line_html(m, t, lexer) for m, t in rows)
        return (f'<div class="{_SCOPE}"><style>{_CSS}</style>'
                f'<div class="t-title">{html.escape(self.title)}</div><pre>{body}</pre></div>')
