"""`filecheck(text, checks)`: run LLVM-style FileCheck CHECK lines against text.

Uses the PyPI `filecheck` package (a Python port of LLVM FileCheck) in
process: its command line only reads the checks from a file and the input
from stdin, so the parser and the input are built here from strings. On a
mismatch the test fails with FileCheck's own message, plus the checked text
(truncated) so the failure can be read without re-running anything.

One difference from LLVM FileCheck to keep in mind (filecheck 1.0.6): the
range a CHECK-NOT searches runs to the *end* of the next positive match, not
its start, so `CHECK-NOT: X` followed by a check that matches X always fails.
Check such absences in a separate call.
"""
from __future__ import annotations

import io
import textwrap

import pytest

pytest.importorskip("filecheck")   # the [test] extra; the GPU machine may lack it
from filecheck.finput import FInput  # noqa: E402
from filecheck.matcher import Matcher  # noqa: E402
from filecheck.options import DumpInputKind, Options
from filecheck.parser import Parser, pattern_for_opts  # noqa: E402

_SHOWN_LINES = 400


def filecheck(text: str, checks: str, *, prefix: str = "CHECK", **variables) -> None:
    """Fail the calling test unless `checks` (lines with CHECK:, CHECK-NEXT:,
    CHECK-NOT:, ... directives; anything before the directive is ignored)
    match `text`. Keyword arguments become FileCheck -D variables ([[NAME]])."""
    checks = textwrap.dedent(checks)
    opts = Options(match_filename="<checks>", input_file="<input>", check_prefixes=prefix,
                   dump_input=DumpInputKind.FAIL,
                   variables={k: v for k, v in variables.items()})
    parser = Parser(opts, io.StringIO(checks), *pattern_for_opts(opts))
    matcher = Matcher(opts, FInput("<input>", FInput.canonicalize_line_ends(text)), parser)
    matcher.stderr = io.StringIO()
    if matcher.run() != 0:
        lines = text.splitlines()
        shown = "\n".join(lines[:_SHOWN_LINES])
        if len(lines) > _SHOWN_LINES:
            shown += f"\n... ({len(lines) - _SHOWN_LINES} more lines)"
        pytest.fail(f"FileCheck failed:\n{matcher.stderr.getvalue()}\n"
                    f"--- checks ---\n{checks}\n--- input ---\n{shown}", pytrace=False)
