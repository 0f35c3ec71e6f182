"""Python line -> tk ops -> PTX -> SASS: each op's file:line reaches the PTX
as `.loc` lines, the cubin through ptxas -lineinfo and the SASS through
nvdisasm -g; `compiled.lines(n)` / `compiled.source_map` read them back, and
`python -m tk_mlir compile ... --line N` prints them."""
import re
import runpy
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest

import tk_mlir as tk
from tk_mlir import compiler, f32
from tk_mlir.cli import main
from tk_mlir.lowering import pipeline
from tk_mlir.toolchain import find_tool
from tk_mlir.source_map import ptx_by_line, sass_by_line

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
HERE = str(Path(__file__).resolve())
HAS_SASS = find_tool("ptxas") is not None and find_tool("nvdisasm") is not None


@tk.kernel(num_warps=4)
def exp2_rows(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (tk.block_id(0), 0), (16, 64))
    e = x.exp2()
    tk.store(Y, e, (tk.block_id(0), 0))


def line_with(text: str, path: str = HERE) -> int:
    return next(i for i, l in enumerate(Path(path).read_text().splitlines(), 1)
                if text in l and "line_with" not in l)


@pytest.fixture(scope="module")
def small():
    x = tk.spec((64, 64), "f32")
    return exp2_rows.compile(x, x)


def test_lines_takes_a_base_name_and_refuses_what_is_not_a_line(small):
    n = line_with("e = x.exp2()")
    by_name = small.lines(n, Path(HERE).name)
    assert by_name.file == HERE and by_name.ptx == small.lines(n).ptx
    with pytest.raises(ValueError, match="'elsewhere.py' names no single file with code"):
        small.lines(n, "elsewhere.py")
    for bad in ("8", 0, True, None):
        with pytest.raises(ValueError, match="line must be a line number"):
            small.lines(bad)
    count = len(Path(HERE).read_text().splitlines())
    with pytest.raises(ValueError, match=rf"has {count} lines, not {count + 1}"):
        small.lines(count + 1)


def test_a_line_maps_to_its_ops_ptx_and_sass(small):
    n = line_with("e = x.exp2()")
    code = small.lines(n)
    assert code.file == HERE and code.source.strip() == "e = x.exp2()"
    assert [re.sub(r"%\w+", "%", op) for op in code.ops] == ["% = tk.exp2 % : rt<f32, 16x64>"]
    assert code.ptx and all(i.startswith("ex2.approx") for i in code.ptx), code.ptx
    if HAS_SASS:
        assert code.sass and all("MUFU.EX2" in i for i in code.sass), code.sass
    load = small.lines(line_with("x = tk.load(X"))
    assert any("tk.load" in op for op in load.ops) and any(i.startswith("ld.global") for i in load.ptx)
    if HAS_SASS:
        assert any("LDG" in i for i in load.sass)
    # Lines with code are the kernel's; a blank line or the decorator has none.
    assert small.source_map.files() == [HERE]
    assert {c.line for c in small.source_map.lines()} <= set(range(n - 3, n + 2))
    assert small.lines(n - 4).ptx == ()


def _compiled_by(monkeypatch, run) -> list:
    """Every kernel compiled (or taken from a cache) while `run` runs."""
    from tk_mlir.kernel import Kernel
    seen = []
    original = Kernel._entry
    def recording(self, sig):
        entry = original(self, sig)
        seen.append(entry[1])
        return entry
    monkeypatch.setattr(Kernel, "_entry", recording)
    run()
    return seen


# Examples that only define kernels (no main compiling them): how to compile them.
_X, _B = tk.spec((1000, 1024), "f32"), tk.spec((1000, 2048), "bf16")
DEFINE_ONLY = {
    "softmax": lambda g: g["softmax_kernel"].compile(_X, _X, ROWS=4, BLOCK=1024),
    "fused_elementwise": lambda g: g["swiglu_kernel"].compile(_B, _B, _B, BM=16, BN=256),
}


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_ptx_has_loc_lines_for_its_kernel_source(example, monkeypatch, capsys):
    from tk_mlir.runtime.driver import has_gpu
    if has_gpu():
        pytest.skip("a GPU is present: the examples run whole in test_examples_gpu.py")
    def run_example():
        names = runpy.run_path(str(ROOT / "examples" / f"{example}.py"), run_name="__main__")
        if example in DEFINE_ONLY:
            DEFINE_ONLY[example](names)
    kernels = _compiled_by(monkeypatch, run_example)
    assert kernels, f"{example} compiled no kernel (add it to DEFINE_ONLY)"
    for k in kernels:
        source = k.source_map.file
        assert Path(source).is_file() and source.endswith(".py"), source
        ptx = k.asm["ptx"]
        files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]*)"', ptx, re.M))
        assert source in files.values(), (k.name, files)
        index = next(n for n, f in files.items() if f == source)
        assert len(re.findall(rf"^\s*\.loc\s+{index}\s+[1-9]\d*\s", ptx, re.M)) >= 3, k.name
        lines = [c for c in k.source_map.lines() if c.file == source and c.ptx]
        assert lines and all(c.source.strip() for c in lines), k.name  # real source lines


def _sass_mix(cubin: bytes) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([find_tool("nvdisasm"), "-c", f.name], capture_output=True,
                             text=True, check=True).stdout
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", out)


@pytest.mark.skipif(not HAS_SASS, reason="needs ptxas and nvdisasm")
def test_line_info_changes_no_instruction_of_the_gemm(monkeypatch):
    from tk_mlir.kernels import gemm
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    a, b = tk.spec((384, 512), "bf16"), tk.spec((256, 512), "bf16")
    def build():
        return gemm.gemm_kernel.compile(a, b, tk.spec((384, 256), "bf16"), config=0)
    with_lines = build()
    stages = tuple(s for s in pipeline.GPU_STAGES if s != pipeline.DEBUG_LINES)
    monkeypatch.setattr(pipeline, "GPU_STAGES", stages)
    monkeypatch.setattr(pipeline, "GPU_STAGE_NAMES",
                        tuple(s if isinstance(s, str) else s[0] for s in stages))
    monkeypatch.setattr(compiler, "PTXAS_ARGS", ())
    without = build()
    assert ".loc" in with_lines.asm["ptx"] and ".loc" not in without.asm["ptx"]
    assert "//## File" in with_lines.asm["sass"]
    on, off = _sass_mix(with_lines.cubin), _sass_mix(without.cubin)
    assert len(on) == len(off) and Counter(on) == Counter(off)
    assert [i.split()[0] for i in on] == [i.split()[0] for i in off]   # same order too
    assert with_lines.info["registers"] == without.info["registers"]


def test_ptx_and_sass_readers():
    ptx = ('\t.loc\t1 7 3\n\tex2.approx.f32 \t%r1, %r2;\n$L__BB0_1:\n\t.loc\t1 0 3\n'
           '\tmov.b32 \t%r3, %r1;\n\t.loc\t1 9 1\n\t// begin inline asm\n\tret;\n'
           '\t.file\t1 "/k.py"\n')
    assert ptx_by_line(ptx) == {("/k.py", 7): ["ex2.approx.f32 \t%r1, %r2;"],
                                ("/k.py", 9): ["ret;"]}
    sass = ('\t//## File "/k.py", line 7\n        /*0010*/                   MUFU.EX2 R1, R2 ;'
            '  /* 0x1 */\n\t//## File "/k.py", line 9 inlined at "/k.py", line 2\n'
            '        /*0020*/              @!P0 EXIT ;\n')
    assert sass_by_line(sass) == {("/k.py", 7): ["/*0010*/ MUFU.EX2 R1, R2 ;"],
                                  ("/k.py", 9): ["/*0020*/ @!P0 EXIT ;"]}


# ------------------------------------------------------------------ CLI

CALL = [f"{HERE}::exp2_rows", "--arg", "f32[64,64]", "--arg", "f32[64,64]"]


def run(capsys, *argv):
    code = main(["compile", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.skipif(not HAS_SASS, reason="needs ptxas and nvdisasm")
def test_cli_prints_a_lines_sass(capsys):
    n = line_with("e = x.exp2()")
    code, out, err = run(capsys, *CALL, "--stage", "sass", "--line", str(n))
    assert code == 0, err
    assert out.strip() and all("MUFU.EX2" in l for l in out.splitlines()), out


def test_cli_prints_a_lines_ops_and_ptx(capsys):
    n = line_with("e = x.exp2()")
    code, out, err = run(capsys, *CALL, "--line", str(n))
    assert code == 0, err
    assert out.startswith(f"{HERE}:{n}: e = x.exp2()\n")
    assert re.search(r"^  tk \(1\):\n    %\d+ = tk\.exp2 %\d+ : rt<f32, 16x64>$", out, re.M)
    assert re.search(r"^  ptx \(\d+\):\n    ex2\.approx", out, re.M)
    code, out, _ = run(capsys, *CALL, "--line", f"test_source_map.py:{n}", "--stage", "ptx",
                       "--stage", "tk-verify")
    assert code == 0 and "==> ptx <==\nex2.approx" in out and "==> tk-verify <==\n%" in out
    code, out, _ = run(capsys, *CALL, "--line", str(n), "--stage", "llvm")   # any MLIR stage
    assert code == 0 and out.strip() and all(
        "ex2.approx" in l for l in out.splitlines()), out


def test_cli_line_errors_name_the_option(capsys):
    code, _, err = run(capsys, *CALL, "--line", "nope.py:3")
    assert code == 2 and "--line nope.py:3: no code came from a file 'nope.py'" in err
    code, _, err = run(capsys, *CALL, "--line", "x")
    assert code == 2 and "--line x: expected a line number" in err
    code, _, err = run(capsys, *CALL, "--line", "1", "--stage", "ptxas")
    assert code == 2 and "'ptxas' has no line info" in err
    code, _, err = run(capsys, *CALL, "--line", "1")
    assert code == 0 and "became no code; the lines that did:" in err
