"""HTML for Jupyter: a compiled kernel's IR stages, one collapsible block per
stage, highlighted by a small regex highlighter (no dependencies).

Highlighting tokenizes the *raw* text and HTML-escapes every piece it emits,
matched or not, so the patterns can see a real ``<`` in ``!tk.rt<bf16, 16, 64>``
while nothing unescaped ever reaches the page.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

MAX_LINES = 3000

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
.{_SCOPE} .t-head {{ display: flex; align-items: baseline; gap: 1.5em; flex-wrap: wrap; margin: 4px 0; }}
.{_SCOPE} .t-title {{ font-weight: 600; font-size: 14px; font-family: var(--jp-code-font-family, monospace); }}
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
    # Spills are the one number a kernel author must never miss.
    return "spill" in key.lower() and isinstance(value, (int, float)) and value > 0


def _meta_html(meta: dict) -> str:
    heads = "".join(f"<th>{html.escape(str(k))}</th>" for k in meta)
    cells = "".join(
        f"<td{_BAD if _is_bad(str(k), v) else ''}>{html.escape(_format_value(v))}</td>"
        for k, v in meta.items()
    )
    return f'<table class="t-meta"><tr>{heads}</tr><tr>{cells}</tr></table>'


def _open_stage(names: list[str]) -> str | None:
    """The first tk stage is what a kernel author reads first; later stages
    (PTX, SASS) are long and opened on demand."""
    for name in names:
        if name.lower().startswith("tk"):
            return name
    return names[0] if names else None


def _stage_html(name: str, text: str, is_open: bool) -> str:
    lines = _lines(text)
    shown = lines[:MAX_LINES]
    body = highlight("\n".join(shown), name)
    note = ""
    if len(lines) > MAX_LINES:
        cut = len(lines) - MAX_LINES
        note = (f'<div class="t-note">… {cut:,} more lines cut here '
                f"(showing {MAX_LINES:,} of {len(lines):,}).</div>")
    count = f"{len(lines):,} line{'' if len(lines) == 1 else 's'}"
    return (f'<details data-stage="{html.escape(name)}"{" open" if is_open else ""}>'
            f'<summary>{html.escape(name)}<span class="t-count">{count}</span></summary>'
            f"<pre>{body}</pre>{note}</details>")


def stages_html(title: str, stages: dict[str, str], meta: dict | None = None) -> str:
    """An HTML fragment showing ``title``, a small table of ``meta``
    (registers, shared memory, spills, threads, ...) and one collapsible
    ``<details>`` per stage, in the order given."""
    opened = _open_stage(list(stages))
    head = f'<div class="t-head"><span class="t-title">{html.escape(title)}</span>'
    if meta:
        head += _meta_html(meta)
    head += "</div>"
    body = "".join(_stage_html(name, text, name == opened) for name, text in stages.items())
    return f'<div class="{_SCOPE}"><style>{_CSS}</style>{head}{body}</div>'
