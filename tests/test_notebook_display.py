"""The notebook display of real kernels: small enough to keep in a .ipynb
(the GEMM's page at most 1 MB, a small kernel's at most 200 KB), every stage
reachable from it, pass stages shown as what they changed."""
import html
import re
import sys
from pathlib import Path

import pytest

import tk_mlir as tk
from tk_mlir.display import Listing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from quickstart import softmax  # noqa: E402

MB = 1_000_000


@pytest.fixture(scope="module")
def small():
    x = tk.spec((1000, 512), tk.f32)
    return softmax.compile(x, x, ROWS=4, N=512)


@pytest.fixture(scope="module")
def gemm():
    from tk_mlir.kernels.gemm import gemm_kernel
    a = tk.spec((4096, 4096), "bf16")
    return gemm_kernel.compile(a, a, a, config=0)


@pytest.fixture(scope="module")
def pages(small, gemm):
    return {"small": small._repr_html_(), "gemm": gemm._repr_html_()}


def _stages(page):
    return re.findall(r'<details data-stage="([^"]+)"', page)


@pytest.mark.parametrize("kernel, limit", [("small", 200_000), ("gemm", MB)])
def test_page_size(kernel, limit, request, pages):
    compiled = request.getfixturevalue(kernel)
    assert len(pages[kernel].encode()) <= limit
    assert sum(map(len, compiled.asm.values())) > limit      # (the stages themselves are not)


def test_page_needs_no_script_and_fetches_nothing(pages):
    page = pages["gemm"]
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org", "")
    assert "<link" not in page and "@import" not in page


def test_every_stage_is_reachable(small, gemm, pages):
    for compiled, page in ((small, pages["small"]), (gemm, pages["gemm"])):
        assert [html.unescape(s) for s in _stages(page)] == list(compiled.asm)
        for name in compiled.asm:
            assert str(compiled.show(name, generic=True)) == compiled.asm[name]
            block = re.search(rf'<details data-stage="{re.escape(html.escape(name))}".*?</details>',
                              page, re.S).group()
            if "shown</span>" in block or "more diff line" in block:    # cut: says how to see it
                assert f'.show("{name}")' in html.unescape(block)


def test_tk_stages_are_shown_in_their_short_form(small, pages):
    """The tk stages read as `%3 = tk.sub_row %1, %2 : rt<...>` with the source
    line as a gutter; MLIR's generic text stays one argument away."""
    tk_block = re.search(r'<details data-stage="tk".*?</details>', pages["small"], re.S).group()
    text = html.unescape(re.sub(r"<[^>]+>", "", tk_block))
    assert "tk.sub_row" in text and "│" in text and '"tk.broadcast"' not in text
    assert str(small.show("tk")) == small.asm.short("tk")
    assert str(small.show("tk", generic=True)).count('"tk.broadcast"') >= 1


def test_pass_stages_are_diffs(pages):
    page = pages["gemm"]
    for name in ("tk-allocate-smem", "tk-proxy-fences", "tk-kernel-attributes",
                 "reconcile-unrealized-casts"):
        block = re.search(rf'<details data-stage="{re.escape(html.escape(name))}".*?</details>',
                          page, re.S).group()
        assert re.search(r"lines, \+\d+ −\d+</span>", block), name
        assert '<pre><span class="t-hunk">@@ -' in block, name
    assert re.search(r'data-stage="llvm"><summary>llvm<span class="t-count">[\d,]+ lines, unchanged',
                     page)


def test_show_diff_and_errors(gemm):
    listing = gemm.show("tk-proxy-fences", diff=True)
    assert isinstance(listing, Listing) and str(listing).startswith("@@ -")
    assert "<pre>" in listing._repr_html_()
    with pytest.raises(KeyError, match=r"show\(stage='nope'\): stage must be one of python, tk"):
        gemm.show("nope")
    for not_a_pass in ("python", "tk", "ptx", "ptxas"):
        with pytest.raises(ValueError, match=rf"{not_a_pass!r} is not a pass's stage"):
            gemm.show(not_a_pass, diff=True)
    unchanged = [s for s in gemm.asm if s.startswith("tk-") and
                 gemm.asm[s] == gemm.asm[list(gemm.asm)[list(gemm.asm).index(s) - 1]]]
    assert unchanged                       # (tk-verify checks, it does not rewrite)
    assert str(gemm.show(unchanged[0], diff=True)) == f"({unchanged[0]} changed nothing)"
    with pytest.raises(TypeError, match=r"show\(diff='yes'\): diff must be True or False"):
        gemm.show("tk-proxy-fences", diff="yes")


def _block(page, name):
    return re.search(rf'<details data-stage="{re.escape(html.escape(name))}".*?</details>',
                     page, re.S).group()


def _tagged(block, line):
    """The text of the listing lines of `block` tagged with Python `line`."""
    rows = re.findall(rf'^<span class="t-py{line}">(.*?)</span>(?:</pre>.*)?$', block, re.M)
    return [html.unescape(re.sub(r"<[^>]+>", "", row)).strip() for row in rows]


def test_python_lines_link_to_their_code(small, gemm, pages):
    """With no script, each Python line with code has an anchor, the
    tk, PTX and SASS lines it became carry its class, and a CSS rule per line
    highlights them all while one is hovered or the anchor is the URL's target
    (tests/test_display_browser.py checks this in Chromium)."""
    page = pages["small"]
    page_id = re.search(r'class="tk-mlir-stages" id="(tk\w+)"', page)[1]
    assert page_id != re.search(r'class="tk-mlir-stages" id="(tk\w+)"', pages["gemm"])[1]
    source_map = small.source_map
    coded = [c.line for c in source_map.lines() if c.file == source_map.file]
    assert len(coded) >= 4
    for n in coded:
        anchor = f"{page_id}-L{n}"
        assert f'<a class="t-gut" id="{anchor}" href="#{anchor}">{n}</a>' in page
        assert f"#{page_id}:has(.t-py{n}:hover,#{anchor}:target,#{anchor}:focus) .t-py{n}" in page
        code = small.lines(n)
        assert [" ".join(t.split()) for t in _tagged(_block(page, "python"), n)] == \
            [" ".join(f"{n} {code.source}".split())]
        assert len(_tagged(_block(page, "tk"), n)) == len(code.ops)
        assert set(_tagged(_block(page, "ptx"), n)) <= set(code.ptx)
        assert {" ".join(s.split()) for s in _tagged(_block(page, "sass"), n)} <= set(code.sass)
    assert "t-py" not in _block(pages["gemm"], "tk-proxy-fences")    # a diff: untagged


def _linked_stages(compiled):
    from tk_mlir.toolchain import find_tool
    return ("ptx", "sass") if "sass" in compiled.asm and find_tool("nvdisasm") else ("ptx",)


def test_cut_listings_keep_each_python_lines_code(small, gemm, pages):
    """A cut PTX or SASS listing keeps, past its first lines, the first line
    of each kind of instruction each Python line became: hovering any line
    with code finds some on the page, and softmax's `.exp()` finds its
    ex2.approx and MUFU.EX2, which lie far past the first lines."""
    for compiled, page in ((small, pages["small"]), (gemm, pages["gemm"])):
        source_map = compiled.source_map
        for stage in _linked_stages(compiled):
            block = _block(page, stage)
            assert re.search(r"lines, [\d,]+ shown</span>", block), stage       # it was cut
            assert re.search(r"^<span class=\"t-note\">… [\d,]+ lines? not shown</span>$", block, re.M)
            for code in source_map.lines():
                items = code.ptx if stage == "ptx" else code.sass
                if code.file == source_map.file and items:
                    assert _tagged(block, code.line), (stage, code.line)
    exp = next(c.line for c in small.source_map.lines() if ".exp()" in c.source)
    assert any(t.startswith("ex2.approx") for t in _tagged(_block(pages["small"], "ptx"), exp))
    if "sass" in _linked_stages(small):
        assert any("MUFU.EX2" in t for t in _tagged(_block(pages["small"], "sass"), exp))


def test_asm_names_its_stages_and_repr_counts_them_alike(gemm):
    with pytest.raises(KeyError, match=r"asm\['nope'\]: no such stage; the stages are python, tk"):
        gemm.asm["nope"]
    assert f"{len(gemm.asm)} IR stages (.asm)" in repr(gemm)
