import html
import re
import sys
from html.parser import HTMLParser

from hypothesis import given, strategies as st

from tk_mlir.display import CUT_LINES, FULL_LINES, PAGE_CHARS, Listing, highlight, stages_html
from tk_mlir.source_map import instruction_name
from tk_mlir.stage_diff import stage_diff

TK = """\
#loc1 = loc("gemm.py":12:8)
module {
  func.func @gemm(%arg0: !tk.gl<bf16, ?, ?>) {
    %0 = "tk.load"(%arg0) : (!tk.gl<bf16, ?, ?>) -> !tk.rt<bf16, 16, 64> loc(#loc1)
    %1 = arith.addf %a, %b : vector<4xf32> // a < b && c > d
    return
  }
}
"""

PTX = """\
.visible .entry gemm(
	.param .u64 gemm_param_0
)
{
	.reg .b32 	%r<12>;
	@%p1 bra 	$L__BB0_2;
	ld.global.v4.f32 	{%f1, %f2, %f3, %f4}, [%rd4]; // 16 bytes
}
"""

SASS = """\
        /*0010*/              @!P0 BRA `(.L_x_1) ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
"""

LLVM = "llvm.func @k() {\n  llvm.return\n}\n"   # (not a small change of TK: a listing)
STAGES = {"python": "def k(a): return a < 1 & 2\n", "tk": TK, "llvm": LLVM, "ptx": PTX, "sass": SASS}


class _Checker(HTMLParser):
    """Collects details elements and checks that every tag is closed in order."""

    VOID = {"br", "hr", "img", "meta", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.details, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)
        if tag == "details":
            self.details.append(dict(attrs))

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (self.stack, tag)
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def parse(fragment):
    checker = _Checker()
    checker.feed(fragment)
    checker.close()
    assert checker.stack == []
    return checker


def pre_text(fragment):
    """The decoded text of every <pre>: what a reader of the page sees."""
    return [html.unescape(re.sub(r"<[^>]+>", "", m)) for m in re.findall(r"<pre>(.*?)</pre>", fragment, re.S)]


def test_every_stage_is_a_details_element_in_order():
    checker = parse(stages_html("gemm", STAGES))
    assert [d["data-stage"] for d in checker.details] == list(STAGES)


def test_first_tk_stage_open_rest_collapsed():
    checker = parse(stages_html("gemm", STAGES))
    opened = [d["data-stage"] for d in checker.details if "open" in d]
    assert opened == ["tk"]
    checker = parse(stages_html("k", {"ptx": PTX, "sass": SASS}))
    assert [d["data-stage"] for d in checker.details if "open" in d] == ["ptx"]


def test_summary_counts_lines():
    out = stages_html("gemm", {"tk": TK, "one": "x"})
    assert re.search(r"<summary>tk<span[^>]*>8 lines</span></summary>", out)
    assert re.search(r"<summary>one<span[^>]*>1 line</span></summary>", out)


def test_ir_is_escaped():
    out = stages_html("gemm <BM=128> & co", STAGES, {"threads": "<384>"})
    parse(out)
    assert "!tk.rt&lt;bf16, 16, 64&gt;" in out
    assert "!tk.rt<bf16" not in out
    assert "a &lt; b &amp;&amp; c &gt; d" in out
    assert "gemm &lt;BM=128&gt; &amp; co" in out
    assert "&lt;384&gt;" in out
    # Highlighting only adds markup: the text a reader sees is the IR itself.
    assert pre_text(out) == [text.rstrip("\n") for text in STAGES.values()]


@given(st.text(alphabet=st.sampled_from(list("<>&\"'%!#@.:;/*()[]{}` \nabcxyzPRT0123456789_-$^")), max_size=200),
       st.sampled_from(["tk", "ptx", "sass", "python"]))
def test_any_text_roundtrips_through_the_highlighter(text, stage):
    out = highlight(text, stage)
    assert "<" not in re.sub(r'</?span( class="t-\w+")?>', "", out)
    assert html.unescape(re.sub(r"<[^>]+>", "", out)) == text


def test_mlir_marks_ops_values_types_attributes():
    out = highlight(TK, "tk")
    assert '<span class="t-op">arith.addf</span>' in out
    assert '<span class="t-op">"tk.load"</span>' in out
    assert '<span class="t-op">func.func</span>' in out
    assert '<span class="t-ssa">%arg0</span>' in out
    assert '<span class="t-ty">!tk.rt&lt;bf16, 16, 64&gt;</span>' in out
    assert '<span class="t-ty">vector&lt;4xf32&gt;</span>' in out
    assert '<span class="t-attr">#loc1</span>' in out
    assert '<span class="t-loc">loc(#loc1)</span>' in out
    assert '<span class="t-com">// a &lt; b &amp;&amp; c &gt; d</span>' in out


def test_mlir_attribute_keys_are_not_ops():
    out = highlight("func.func @k() attributes {nvvm.kernel, nvvm.maxntid = array<i32: 128>}", "tk")
    assert out.count('class="t-op"') == 1


def test_ptx_marks_instructions_registers_directives():
    out = highlight(PTX, "ptx")
    assert '<span class="t-op">ld.global.v4.f32</span>' in out
    assert '<span class="t-op">bra</span>' in out
    assert '<span class="t-pred">@%p1</span>' in out
    assert '<span class="t-reg">%rd4</span>' in out
    assert '<span class="t-dir">.reg</span>' in out
    assert '<span class="t-com">// 16 bytes</span>' in out


def test_sass_marks_opcodes_and_predicates():
    out = highlight(SASS, "sass")
    assert '<span class="t-op">HGMMA.64x128x16.F32.BF16</span>' in out
    assert '<span class="t-pred">@!P0</span>' in out
    assert '<span class="t-reg">UR4</span>' in out


def test_python_stage_is_only_escaped():
    out = highlight("def k(a): return a < 1 & 2", "python")
    assert out == "def k(a): return a &lt; 1 &amp; 2"


def test_highlighter_chosen_by_stage_name():
    assert 't-op' in highlight("mov.u32 %r1, %r2;", "ptx-sm_90a")
    assert 't-op' in highlight("MOV R1, R2 ;", "SASS")
    assert 't-op' not in highlight("MOV R1, R2 ;", "tk")


def test_first_tk_stage_is_shown_whole_up_to_a_limit():
    big = "".join(f"%{i} = arith.constant {i} : i32\n" for i in range(FULL_LINES + 1234))
    out = stages_html("big", {"tk": big})
    parse(out)
    assert '1,234 more lines: .show("tk") or .asm["tk"]' in out
    assert f"{FULL_LINES + 1234:,} lines, first {FULL_LINES:,} shown" in out
    shown = pre_text(out)[0].split("\n")
    assert len(shown) == FULL_LINES
    assert shown[-1] == f"%{FULL_LINES - 1} = arith.constant {FULL_LINES - 1} : i32"
    small = stages_html("small", {"tk": big[: big.index(f"%{FULL_LINES} ")]})
    assert "more lines" not in small


def test_other_listings_share_the_page_and_say_how_to_see_them_whole():
    ptx = "".join(f"\tadd.s32 \t%r{i}, %r{i}, 1;\n" for i in range(5000))
    sass = "".join(f"        /*{i:04x}*/ IADD3 R{i % 200}, R1, 0x1, RZ ;\n" for i in range(5000))
    out = stages_html("k", {"tk": TK, "ptx": ptx, "sass": sass})
    parse(out)
    shown = pre_text(out)
    assert len(shown[1].split("\n")) <= CUT_LINES and len(shown[2].split("\n")) <= CUT_LINES
    assert '.show("ptx") or .asm["ptx"]' in out and '.show("sass") or .asm["sass"]' in out
    assert "5,000 lines, first" in out
    # Shown lines are the stage's first lines, as they are.
    assert ptx.startswith(shown[1] + "\n") and sass.startswith(shown[2] + "\n")
    huge = {f"ptx{i}": ptx for i in range(40)}   # many stages: still one page's worth
    assert sum(map(len, pre_text(stages_html("k", {"tk": TK, **huge}))[1:])) <= PAGE_CHARS


def test_a_cut_listing_keeps_each_python_lines_kinds_of_instruction():
    """Past its first lines, a cut PTX listing keeps the first line of each
    opcode each Python line became, with a count in each gap."""
    ptx = [f"\tadd.s32 \t%r{i}, %r{i}, 1;" for i in range(5000)]
    ptx[3000], ptx[3001] = "\t@%p1 ex2.approx.f32 \t%r1, %r2;", "\tex2.approx.f32 \t%r3, %r4;"
    owners = [None] * 2000 + [7] * 2000 + [9] * 1000       # (lines 7 and 9 of the kernel)
    out = stages_html("k", {"tk": TK, "ptx": "\n".join(ptx)}, lines={"ptx": owners})
    parse(out)
    shown = pre_text(out)[1].split("\n")
    gaps = [l for l in shown if l.startswith("… ")]
    kept = [l for l in shown if not l.startswith("… ")]
    assert kept[-3:] == [ptx[2000], ptx[3000], ptx[4000]]   # add, ex2 for line 7; add for line 9
    assert kept[:-3] == ptx[:len(kept) - 3]                 # after the first lines
    assert gaps == [f"… {2000 - len(kept) + 3:,} lines not shown", "… 999 lines not shown",
                    "… 999 lines not shown"]
    assert f"5,000 lines, {len(kept)} shown" in out
    assert '… 999 more lines: .show("ptx") or .asm["ptx"]' in out
    assert f'<span class="t-py7">{highlight(ptx[3000], "ptx")}</span>' in out
    assert '<span class="t-note">… 999 lines not shown</span>' in out     # (untagged)


def test_instruction_name():
    assert instruction_name("\t@%p1 bra \t$L__BB0_2;") == "bra"
    assert instruction_name("\tret;") == "ret"
    assert instruction_name("        /*05b0*/  @!P0 MUFU.EX2 R27, R4 ;  /* 0x000 */") == "MUFU.EX2"

def _module(*ops):
    body = "".join(f"    %{i} = {op} loc(#loc{i})\n" for i, op in enumerate(ops))
    return f"module {{\n  func.func @k() {{\n{body}    return\n  }}\n}}\n"


def test_a_pass_stage_is_shown_as_a_diff_against_the_stage_before():
    ops = [f"arith.constant {i} : i32" for i in range(40)]
    before = _module(*ops)
    after = _module(*ops[:5], "nvvm.barrier0", *ops[5:])     # renumbers every later value
    out = stages_html("k", {"python": "def k(): pass\n", "tk": before, "tk-proxy-fences": after,
                            "tk-verify": after})
    parse(out)
    assert re.search(r"<summary>tk-proxy-fences<span[^>]*>46 lines, \+1 −0</span>", out)
    diff = pre_text(out)[2]
    assert diff.startswith("@@ -")
    assert "\n+    %5 = nvvm.barrier0 loc(#loc5)\n" in diff
    assert "arith.constant 39" not in diff            # renumbered, not changed
    assert '<span class="t-add">+' in out
    assert re.search(r"<summary>tk-verify<span[^>]*>46 lines, unchanged</span>", out)
    assert "the same text as tk-proxy-fences" in out


def test_a_stage_that_rewrites_everything_is_a_listing():
    before = _module(*[f"arith.constant {i} : i32" for i in range(20)])
    after = _module(*[f"llvm.mlir.constant({i} : i32) : i32" for i in range(20)])
    out = stages_html("k", {"tk": before, "tk-to-gpu": after})
    assert pre_text(out)[1] == after.rstrip("\n")


def test_stage_diff_matches_lines_modulo_numbering():
    d = stage_diff("%1 = a\n%2 = b(%1)\n^bb3:\n%3 = c(%2)\n", "%1 = a\n%2 = x\n%3 = b(%1)\n^bb4:\n%4 = c(%3)\n")
    assert (d.added, d.removed) == (1, 0)
    assert "+%2 = x" in d.text().split("\n")
    assert stage_diff("a\n", "a\n").unchanged


def test_listing_prints_plain_and_shows_highlighted():
    listing = Listing("k: ptx", "ptx", PTX)
    assert str(listing) == PTX and repr(listing) == PTX
    out = listing._repr_html_()
    parse(out)
    assert pre_text(out) == [PTX.rstrip("\n")]
    assert '<span class="t-op">ld.global.v4.f32</span>' in out


def test_listing_prints_itself_in_a_script(capsys, monkeypatch):
    """Outside IPython and the interactive prompt nothing displays a returned
    value, so a Listing (what compiled.show returns) prints its text once."""
    monkeypatch.delattr(sys, "ps1", raising=False)
    Listing("k: ptx", "ptx", PTX)
    assert capsys.readouterr().out == PTX
    Listing("k: tk", "tk", "no newline at the end")
    assert capsys.readouterr().out == "no newline at the end\n"


def test_listing_leaves_showing_to_ipython_and_the_prompt(capsys, monkeypatch):
    import types
    monkeypatch.delattr(sys, "ps1", raising=False)
    shell = types.ModuleType("IPython")
    shell.get_ipython = lambda: object()                  # a running IPython
    monkeypatch.setitem(sys.modules, "IPython", shell)
    Listing("k: ptx", "ptx", PTX)
    assert capsys.readouterr().out == ""
    shell.get_ipython = lambda: None                      # IPython imported, not running
    Listing("k: ptx", "ptx", PTX)
    assert capsys.readouterr().out == PTX
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)   # the prompt echoes the value
    Listing("k: ptx", "ptx", PTX)
    assert capsys.readouterr().out == ""


SCRIPT = """
import tk_mlir as tk
from tk_mlir import f32

@tk.kernel(num_warps=4)
def double(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (tk.block_id(0), 0), (16, 64)) * 2.0, (tk.block_id(0), 0))

compiled = double.compile(tk.spec((64, 64), tk.f32), tk.spec((64, 64), tk.f32))
compiled.show("tk")
print("---")
compiled.show("tk-allocate-smem", diff=True)
"""


def test_compiled_show_prints_in_a_plain_script(tmp_path):
    import subprocess
    script = tmp_path / "show.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    shown, diff = run.stdout.split("---\n")
    assert "tk.load" in shown and "tk.store" in shown and " │ " in shown   # the short form
    assert diff.startswith("@@ -") and "\n+" in diff, diff                 # what the pass changed


def test_meta_table_and_scoped_css():
    out = stages_html("gemm", {"tk": TK}, {"registers": 168, "shared memory": 232448, "spills": 8, "threads": 384})
    parse(out)
    assert "<th>registers</th>" in out and "<td>168</td>" in out
    assert "<td>232,448</td>" in out
    assert '<td class="t-bad">8</td>' in out  # spills stand out
    mixed = stages_html("k", {"tk": TK}, {"instructions": {"HGMMA": 4, "LDL": 3, "STL": 0},
                                          "ptxas warnings": ["(C7517) wgmma.wait_group <injected>"]})
    parse(mixed)
    assert '<div class="t-sub">instructions</div><table' in mixed
    assert "<td>4</td><td class=\"t-bad\">3</td><td>0</td>" in mixed
    assert '<ul class="t-warn"><li>(C7517) wgmma.wait_group &lt;injected&gt;</li></ul>' in mixed
    assert "<table" not in stages_html("gemm", {"tk": TK})
    # (With line info, the Python-line rules are scoped by the page's own id.)
    out = stages_html("gemm", {"tk": TK}, lines={"tk": [7] * TK.count("\n")})
    page_id = re.match(r'<div class="tk-mlir-stages" id="(tk\w+)">', out)[1]
    css = re.search(r"<style>(.*?)</style>", out, re.S).group(1)
    rules = [r.strip() for r in re.findall(r"([^{}]+)\{", css)]
    assert f"#{page_id}:has(.t-py7:hover" in css
    assert rules and all(all(sel.strip().startswith((".tk-mlir-stages", f"#{page_id}"))
                             for sel in re.split(r",(?![^()]*\))", r)) for r in rules)


@given(st.lists(st.sampled_from(["a", "b", "c", "}", "x = 1", ""]), max_size=40),
       st.lists(st.sampled_from(["a", "b", "c", "}", "x = 1", "y", ""]), max_size=40))
def test_stage_diff_rebuilds_both_sides(old, new):
    d = stage_diff("".join(l + "\n" for l in old), "".join(l + "\n" for l in new), context=10**6)
    assert d.unchanged == (old == new)
    if d.unchanged:
        return
    rows = [(m, t) for m, t in d.lines if m != "@"]
    assert [t for m, t in rows if m in " +"] == new
    assert [t for m, t in rows if m in " -"] == old
    assert (d.added, d.removed) == (sum(m == "+" for m, _ in rows), sum(m == "-" for m, _ in rows))


@given(st.lists(st.sampled_from(["a", "b", "c", "}", "x = 1", ""]), max_size=60),
       st.lists(st.sampled_from(["a", "b", "c", "}", "x = 1", "y", ""]), max_size=60))
def test_stage_diff_hunk_headers_count_their_lines(old, new):
    d = stage_diff("".join(l + "\n" for l in old), "".join(l + "\n" for l in new))
    text = d.text().split("\n") if d.lines else []
    starts = [i for i, l in enumerate(text) if l.startswith("@@ ")]
    for k, at in enumerate(starts):
        body = text[at + 1:starts[k + 1] if k + 1 < len(starts) else len(text)]
        a1, a_n, b1, b_n = map(int, re.match(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@", text[at]).groups())
        assert sum(l[:1] in " -" for l in body) == a_n and sum(l[:1] in " +" for l in body) == b_n
        assert [l[1:] for l in body if l[:1] in " -"] == old[a1 - 1:a1 - 1 + a_n]
