"""`compiled.asm`: the kernel at every stage, in pipeline order, each stage
real text that MLIR reads back (and resumes from), shown in Jupyter one
collapsible block per stage, with ptxas's numbers in `compiled.info`.

One kernel touches every part of the pipeline: a shared tile and its copy,
a run-time loop carrying a tile, a cross-warp reduction (shared scratch),
a run-time if, scalars of both kinds.
"""
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from mlir import ir

import tk_mlir as tk
from tk_mlir import bf16, f32
from tk_mlir.dialects import tk as tk_dialect
from tk_mlir.lowering.pipeline import GPU_STAGE_NAMES, UPSTREAM, run_stage
from tk_mlir.toolchain import find_tool

HERE = Path(__file__).resolve()


@tk.kernel(num_warps=8)
def staged(X: tk.gl[bf16], Y: tk.gl[bf16], n: int, scale: float, BLOCK: tk.constexpr):
    row = tk.block_id(0)
    s = tk.shared_tile(bf16, (16, 64))  # S:shared
    tk.copy(s, X, (row, 0))
    tk.store(Y, tk.load(s), (row, 0))
    acc = tk.zeros((1, BLOCK))
    for i in range(n):
        x = tk.load(X, (row + i, 0), (1, BLOCK)).to(f32)
        acc = acc + x.mul_row((x * x).row_sum())
    if n > 2:
        acc = acc * scale
    tk.store(Y, acc.to(bf16), (row, 0))


TK_STAGES = ["tk", "tk-assign-layouts", "tk-verify", "tk-allocate-smem", "tk-proxy-fences"]
GPU_STAGES = ["tk-to-gpu", *GPU_STAGE_NAMES, "llvm"]
MLIR_STAGES = TK_STAGES + GPU_STAGES
HAS_NVDISASM = find_tool("nvdisasm") is not None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    # Compiled here, not read from a cache: the stages as the pipeline made them.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TK_MLIR_CACHE_DIR", str(tmp_path_factory.mktemp("stages-cache")))
        mp.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
        mp.delenv("TK_MLIR_DUMP_DIR", raising=False)
        x = tk.spec((64, 1024), "bf16")
        return staged.compile(x, x, 3, 0.5, BLOCK=1024)


def parse(text: str, with_tk: bool) -> tuple[ir.Context, ir.Module]:
    ctx = ir.Context()
    if with_tk:
        tk_dialect.load(ctx)
    with ctx:
        return ctx, ir.Module.parse(text)


def asm_of(module: ir.Module) -> str:
    # What the pipeline records (lowering/pipeline.py: stage_text).
    return module.operation.get_asm(enable_debug_info=True, large_elements_limit=64)


# ------------------------------------------------------------ the stages

def test_every_stage_in_order(compiled):
    expected = ["python", *MLIR_STAGES, "ptx", "ptxas"] + (["sass"] if HAS_NVDISASM else [])
    assert list(compiled.asm) == expected


def test_upstream_stage_names_are_the_pipeline(compiled):
    names = list(compiled.asm)
    at = names.index("tk-to-gpu")
    assert tuple(names[at + 1:at + 1 + len(GPU_STAGE_NAMES)]) == GPU_STAGE_NAMES
    assert set(UPSTREAM) <= set(GPU_STAGE_NAMES)
    assert "convert-scf-to-cf" in UPSTREAM and "reconcile-unrealized-casts" in UPSTREAM


@pytest.mark.parametrize("stage", ["python", *MLIR_STAGES, "ptx", "ptxas", "sass"])
def test_every_stage_has_text(compiled, stage):
    if stage == "sass" and not HAS_NVDISASM:
        pytest.skip("nvdisasm not found")
    text = compiled.asm[stage]
    assert isinstance(text, str) and text.strip()


def test_python_stage_is_the_kernel_source(compiled):
    assert compiled.asm["python"] == staged.source
    assert compiled.asm["python"].startswith("@tk.kernel(num_warps=8)\ndef staged(")


def test_tk_stages_show_the_passes_work(compiled):
    asm = compiled.asm
    assert '"tk.alloc_st"' in asm["tk"] and "scf.for" in asm["tk"] and "scf.if" in asm["tk"]
    assert "offset" not in re.findall(r'"tk\.alloc_st"\(\)[^\n]*', asm["tk"])[0]
    # The allocation pass places the shared tile and the reduction scratch.
    assert re.search(r'"tk\.alloc_st"\(\) [<{]+[^}]*offset = 0 : i64', asm["tk-allocate-smem"])
    assert "scratch_offset" in asm["tk-allocate-smem"]
    assert "tk.smem_bytes" in asm["tk-allocate-smem"]
    assert "gpu.module" in asm["tk-to-gpu"] and '"tk.' not in asm["tk-to-gpu"]
    assert "scf." not in asm["convert-scf-to-cf"]
    assert "llvm.func @staged" in asm["llvm"]


def test_locations_point_at_the_kernel_source(compiled):
    line = next(i for i, text in enumerate(HERE.read_text().splitlines(), 1)
                if text.endswith("# S:shared"))
    col = HERE.read_text().splitlines()[line - 1].index("tk.shared_tile") + 1
    assert f'loc("{HERE}":{line}:{col})' in compiled.asm["tk"]


def test_ptx_ptxas_sass(compiled):
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx and ".entry staged(" in ptx
    assert re.search(r"Used \d+ registers", compiled.asm["ptxas"])
    assert "staged" in compiled.asm["ptxas"]
    if HAS_NVDISASM:
        assert "staged" in compiled.asm["sass"]
        assert re.search(r"\bEXIT\b", compiled.asm["sass"])


# ------------------------------------------------------------ re-parsing

@pytest.mark.parametrize("stage", TK_STAGES)
def test_tk_stages_reparse_with_the_tk_dialect(compiled, stage):
    text = compiled.asm[stage]
    ctx, module = parse(text, with_tk=True)
    with ctx:
        assert module.operation.verify()
        assert asm_of(module) == text          # a fixed point: nothing lost in printing
    with pytest.raises(ir.MLIRError):
        parse(text, with_tk=False)             # the tk types need the dialect


@pytest.mark.parametrize("stage", GPU_STAGES)
def test_gpu_stages_reparse_with_upstream_dialects_only(compiled, stage):
    text = compiled.asm[stage]
    ctx, module = parse(text, with_tk=False)
    with ctx:
        assert module.operation.verify()
        assert asm_of(module) == text


def _pass(stage):
    """The step that turns the stage before `stage` into `stage` (the one an
    internal error's replay command runs)."""
    return lambda m: run_stage(stage, m)


@pytest.mark.parametrize("stage", MLIR_STAGES[1:-1])
def test_resume_from_any_stage(compiled, stage):
    """Each stage re-parsed and run through the next pass gives the next stage
    (pipeline.py: 'read (and re-parse and resume from) the IR between any two
    passes')."""
    names = list(compiled.asm)
    before = compiled.asm[names[names.index(stage) - 1]]
    ctx, module = parse(before, with_tk=True)
    with ctx:
        resumed = _pass(stage)(module)
        if stage != "convert-scf-to-cf":
            assert asm_of(resumed) == compiled.asm[stage]
            return
        # scf.for's custom syntax does not print its block arguments' locations,
        # so re-parsed ones point into the parsed text ("-":line:col) and
        # convert-scf-to-cf hands them to the new blocks: equal but for those.
        _, expected = parse(compiled.asm[stage], with_tk=True)
        plain = dict(enable_debug_info=False, large_elements_limit=64)
        assert resumed.operation.get_asm(**plain) == expected.operation.get_asm(**plain)


# ---------------------------------------------------------- display, info

class _Details(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stages = []

    def handle_starttag(self, tag, attrs):
        if tag == "details":
            self.stages.append(dict(attrs).get("data-stage"))


def test_repr_html_has_one_details_per_stage(compiled):
    page = compiled._repr_html_()
    parser = _Details()
    parser.feed(page)
    assert parser.stages == list(compiled.asm)
    assert page.count("<details") == page.count("</details>") == len(compiled.asm)


def test_info_has_registers_and_spills(compiled):
    info = compiled.info
    assert isinstance(info["registers"], int) and 0 < info["registers"] <= 255
    assert info["spill stores (bytes)"] == 0 and info["spill loads (bytes)"] == 0
    assert info["threads"] == 256
    assert info["dynamic shared memory (bytes)"] == compiled.smem_bytes > 16 * 64 * 2


def test_a_cache_hit_has_the_same_stages(compiled, tmp_path, monkeypatch):
    """A kernel read from the disk cache shows the same IR (the entry stores it)."""
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TK_MLIR_ALWAYS_COMPILE", raising=False)
    x = tk.spec((64, 1024), "bf16")
    fresh = tk.kernel(staged.fn, num_warps=8).compile(x, x, 3, 0.5, BLOCK=1024)
    hit = tk.kernel(staged.fn, num_warps=8).compile(x, x, 3, 0.5, BLOCK=1024)
    assert hit is not fresh
    assert hit.asm == fresh.asm
    assert list(hit.asm) == list(compiled.asm)
    for stage in compiled.asm:           # ptxas reports its own compile time
        strip = (lambda t: re.sub(r"Compile time = [\d.]+ ms", "", t)) if stage == "ptxas" \
            else (lambda t: t)
        assert strip(hit.asm[stage]) == strip(compiled.asm[stage]), stage


# ------------------------------------------------------------ SASS, cached

@pytest.mark.skipif(not HAS_NVDISASM, reason="nvdisasm not found")
def test_sass_is_disassembled_once_and_kept_in_the_disk_cache(compiled, tmp_path, monkeypatch):
    """asm["sass"] runs nvdisasm on first read and keeps the listing on disk
    (keyed by the cubin), so the kernel read warm -- here a copy that has not
    seen it, as a disk hit in a new process is -- runs no nvdisasm."""
    import dataclasses
    from tk_mlir import toolchain
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TK_MLIR_ALWAYS_COMPILE", raising=False)
    runs = []
    real = toolchain.disassemble
    monkeypatch.setattr(toolchain, "disassemble", lambda cubin: runs.append(1) or real(cubin))

    def fresh():
        return dataclasses.replace(compiled, _functions={},
                                   stages={k: v for k, v in compiled.stages.items()
                                           if k != "sass"})
    first = fresh().asm["sass"]
    assert runs == [1] and re.search(r"\bEXIT\b", first)
    assert fresh().asm["sass"] == first
    assert runs == [1]                       # the second read came from the disk cache


def test_stages_kept_as_bytecode_print_as_the_pipeline_prints(tmp_path, monkeypatch):
    # Without TK_MLIR_DUMP_DIR the MLIR stages are kept as bytecode and printed
    # when read; with it they are printed as they are made. Same text.
    from tk_mlir.compiled import CompiledKernel
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    monkeypatch.delenv("TK_MLIR_DUMP_DIR", raising=False)
    x = tk.spec((64, 1024), "bf16")
    fresh = staged.compile(x, x, 3, 0.5, BLOCK=1024)
    # No snapshot (a clone in the compile's MLIR context) outlives the compile.
    assert all(isinstance(fresh.stages._items[s], bytes) for s in MLIR_STAGES)
    kept = CompiledKernel.from_entry(fresh.to_entry()).stages      # as the disk cache has it
    assert all(isinstance(kept._items[s], bytes) for s in MLIR_STAGES)
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(tmp_path / "dump"))
    eager = staged.compile(x, x, 3, 0.5, BLOCK=1024).stages
    assert all(isinstance(eager._items[s], str) for s in MLIR_STAGES)
    assert [s for s in kept if s != "sass"] == [s for s in eager if s != "sass"]
    for stage in MLIR_STAGES:
        assert kept[stage] == eager[stage], stage
    assert 'loc("' in kept["tk"] and ".py" in kept["tk"]          # source locations kept
