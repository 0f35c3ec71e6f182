"""The example and library kernels' PTX and SASS: each compiles for sm_90a at a couple of
constexpr configurations, ptxas assembles it without spilling, and the code
has the instructions the design promises: 16-byte global accesses for vec
tiles, butterfly shuffles for row reductions, a block barrier only where a
reduction crosses warps, ex2.approx for exp. Needs no GPU (SASS checks need
nvdisasm). Also: TK_MLIR_DUMP_DIR writes every stage to a numbered file.
"""
from __future__ import annotations

import functools
import importlib
import re
from dataclasses import dataclass
from typing import Callable

import pytest

import tk_mlir as tk
from tk_mlir import bf16, f32
from tk_mlir.toolchain import find_tool

from filecheck_util import filecheck

ROWS = 1000          # not a multiple of any tile: masked edges are compiled in


def _example(module: str, name: str):
    """A kernel from examples/ (on sys.path via conftest). Most examples import
    torch for their host wrappers; without torch their tests skip."""
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name == "torch":
            pytest.skip("this example imports torch, which is not installed")
        raise


def _rmsnorm(block):
    from tk_mlir.kernels.norms import rmsnorm_kernel as k
    return k.compile(tk.spec((ROWS, block), bf16), tk.spec((block,), bf16),
                     tk.spec((ROWS, block), bf16), 1e-6, BLOCK=block)


def _layernorm(block, reload_wb=False):
    from tk_mlir.kernels.norms import layernorm_kernel as k
    return k.compile(tk.spec((ROWS, block), bf16), tk.spec((block,), bf16),
                     tk.spec((block,), bf16), tk.spec((ROWS, block), bf16), 1e-5,
                     BLOCK=block, RELOAD_WB=reload_wb)


def _softmax(rows, block):
    k = _example("softmax", "softmax_kernel")
    return k.compile(tk.spec((ROWS, block), f32), tk.spec((ROWS, block), f32),
                     ROWS=rows, BLOCK=block)


def _swiglu(bm, bn):
    k = _example("fused_elementwise", "swiglu_kernel")
    x = tk.spec((ROWS, 2048), bf16)
    return k.compile(x, x, x, BM=bm, BN=bn)


def _quickstart(rows, n):
    k = _example("quickstart", "softmax")
    return k.compile(tk.spec((ROWS, n), f32), tk.spec((ROWS, n), f32), ROWS=rows, N=n)


@dataclass(frozen=True)
class Example:
    kernel: str                  # the PTX entry's name
    build: Callable
    reductions: int              # row reductions (each: 5 shuffles)
    cross_warp: bool             # some reduction spans warps: shared memory + bar.sync
    exp: bool


EXAMPLES = {
    # 1 x BLOCK row over 8 warps: 256 columns fill the lanes, the warps replicate;
    # wider rows spread over the warps too.
    "rmsnorm-256": Example("rmsnorm_kernel", lambda: _rmsnorm(256), 1, False, False),
    "rmsnorm-4096": Example("rmsnorm_kernel", lambda: _rmsnorm(4096), 1, True, False),
    "layernorm-256": Example("layernorm_kernel", lambda: _layernorm(256), 2, False, False),
    "layernorm-8192-reload": Example("layernorm_kernel", lambda: _layernorm(8192, True), 2,
                                     True, False),
    # ROWS x BLOCK over 4 warps: one row per warp for ROWS=4; ROWS=1 spans the warps.
    "softmax-4x1024": Example("softmax_kernel", lambda: _softmax(4, 1024), 2, False, True),
    "softmax-1x4096": Example("softmax_kernel", lambda: _softmax(1, 4096), 2, True, True),
    "swiglu-32x256": Example("swiglu_kernel", lambda: _swiglu(32, 256), 0, False, True),
    "swiglu-16x512": Example("swiglu_kernel", lambda: _swiglu(16, 512), 0, False, True),
    "quickstart-4x512": Example("softmax", lambda: _quickstart(4, 512), 2, False, True),
    "quickstart-1x2048": Example("softmax", lambda: _quickstart(1, 2048), 2, True, True),
}


@functools.cache
def compiled(name: str):
    """Each configuration compiles once per session (a skip is not cached)."""
    return EXAMPLES[name].build()


examples = pytest.mark.parametrize("name", EXAMPLES)


# --------------------------------------------------------------------- PTX

@examples
def test_ptx_targets_sm_90a(name):
    filecheck(compiled(name).asm["ptx"], """
        CHECK: .version
        CHECK-NEXT: .target sm_90a
        CHECK: .visible .entry [[KERNEL]](
    """, KERNEL=EXAMPLES[name].kernel)


@examples
def test_global_accesses_are_16_bytes(name):
    ptx = compiled(name).asm["ptx"]
    filecheck(ptx, """
        CHECK: ld.global.v4.b32 {%r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}}, [%rd{{[0-9]+}}{{(\\+[0-9]+)?}}];
        CHECK: st.global.v4.b32 [%rd{{[0-9]+}}{{(\\+[0-9]+)?}}], {%r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}, %r{{[0-9]+}}};
    """)
    # ... and only those: no narrower global load or store anywhere.
    filecheck(ptx, "CHECK-NOT: {{(ld|st)}}.global.{{[^v]}}")


@examples
def test_row_reductions_shuffle_across_all_lanes(name):
    ex = EXAMPLES[name]
    ptx = compiled(name).asm["ptx"]
    assert ptx.count("shfl.sync.bfly") == 5 * ex.reductions
    if not ex.reductions:
        filecheck(ptx, "CHECK-NOT: shfl.sync")
        return
    checks = [f"CHECK: shfl.sync.bfly.b32 %r{{{{[0-9]+}}}}, %r{{{{[0-9]+}}}}, {mask}, 31, -1;"
              for _ in range(ex.reductions) for mask in (1, 2, 4, 8, 16)]
    filecheck(ptx, "\n".join(checks))


@examples
def test_bar_sync_only_where_a_reduction_crosses_warps(name):
    ex, kernel = EXAMPLES[name], compiled(name)
    ptx = kernel.asm["ptx"]
    if ex.cross_warp:
        # partials to shared memory, one barrier, the other warps' partials back
        filecheck(ptx, """
            CHECK: .extern .shared .align 16 .b8 __tk_smem[];
            CHECK: shfl.sync.bfly.b32 {{.*}}, 16, 31, -1;
            CHECK: st.shared.b32
            CHECK-NEXT: bar.sync 0;
            CHECK: ld.shared.b32
        """)
        assert kernel.smem_bytes > 0
    else:
        filecheck(ptx, """
            CHECK-NOT: bar.sync
            CHECK-NOT: .shared
        """)
        assert kernel.smem_bytes == 0


@examples
def test_exp_uses_ex2_approx(name):
    ptx = compiled(name).asm["ptx"]
    if EXAMPLES[name].exp:
        filecheck(ptx, "CHECK: ex2.approx.ftz.f32 %r{{[0-9]+}}, %r{{[0-9]+}};")
    else:
        filecheck(ptx, "CHECK-NOT: ex2.approx")


@examples
def test_ptxas_assembles_it_without_spills(name):
    kernel = compiled(name)
    assert kernel.cubin.startswith(b"\x7fELF")
    filecheck(kernel.asm["ptxas"], """
        CHECK: Compiling entry function '[[KERNEL]]' for 'sm_90a'
        CHECK: 0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        CHECK: Used {{[0-9]+}} registers
    """, KERNEL=EXAMPLES[name].kernel)
    info = kernel.info
    assert info["spill stores (bytes)"] == 0 and info["spill loads (bytes)"] == 0, info
    assert info["registers"] <= 255, info


# -------------------------------------------------------------------- SASS

needs_nvdisasm = pytest.mark.skipif(find_tool("nvdisasm") is None, reason="nvdisasm not found")


@needs_nvdisasm
@examples
def test_sass_uses_128_bit_global_accesses(name):
    sass = compiled(name).asm["sass"]
    filecheck(sass, """
        CHECK: LDG.E.128 R{{[0-9]+}}, desc[UR{{[0-9]+}}][R{{[0-9]+}}.64{{(\\+0x[0-9a-f]+)?}}] ;
        CHECK: STG.E.128 desc[UR{{[0-9]+}}][R{{[0-9]+}}.64{{(\\+0x[0-9a-f]+)?}}], R{{[0-9]+}} ;
    """)
    narrow = re.findall(r"\b[LS]TG\.E(?!\.128)\S*", sass)
    assert not narrow, f"global accesses narrower than 16 bytes: {sorted(set(narrow))}"


@needs_nvdisasm
@examples
def test_sass_shuffles_and_barriers(name):
    ex, sass = EXAMPLES[name], compiled(name).asm["sass"]
    if ex.reductions:
        filecheck(sass, "\n".join(f"CHECK: SHFL.BFLY PT, R{{{{[0-9]+}}}}, R{{{{[0-9]+}}}}, "
                                  f"{mask:#x}, 0x1f ;" for mask in (1, 2, 4, 8, 16)))
    else:
        filecheck(sass, "CHECK-NOT: SHFL")
    if ex.cross_warp:
        filecheck(sass, "CHECK: BAR.SYNC{{(.DEFER_BLOCKING)?}} 0x0 ;")
    else:
        filecheck(sass, "CHECK-NOT: BAR.")
    if ex.exp:
        filecheck(sass, "CHECK: MUFU.EX2")


# ------------------------------------------------------------ dump folders

def _fresh_quickstart_kernel() -> tk.Kernel:
    """A new Kernel object for the quickstart softmax: its in-process cache is
    empty, so compile() goes to the disk cache / compiler."""
    return tk.Kernel(_example("quickstart", "softmax").fn, num_warps=4)


def _compile_quickstart(kernel: tk.Kernel):
    return kernel.compile(tk.spec((ROWS, 512), f32), tk.spec((ROWS, 512), f32), ROWS=4, N=512)


def test_dump_dir_writes_one_numbered_file_per_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    kernel = _compile_quickstart(_fresh_quickstart_kernel())
    stages = dict(kernel.asm)        # with the SASS listing where nvdisasm exists
    (folder,) = (tmp_path / "dump").glob("softmax-*")    # one per specialization
    files = sorted(folder.iterdir())
    assert [f.name[:3] for f in files] == [f"{i:02d}-" for i in range(len(stages))]
    for f, (stage, text) in zip(files, stages.items()):
        assert f.read_text() == text, f"{f.name} is not stage {stage}"
    names = [f.name for f in files]
    assert names[:7] == ["00-python.py", "01-tk.mlir", "02-tk-assign-layouts.mlir",
                         "03-tk-verify.mlir", "04-tk-allocate-smem.mlir",
                         "05-tk-proxy-fences.mlir", "06-tk-to-gpu.mlir"]
    tail = ["llvm.mlir", "ptx.ptx", "ptxas.log"] + (["sass.sass"] if "sass" in stages else [])
    assert names[-len(tail):] == [f"{len(names) - len(tail) + i:02d}-{t}"
                                  for i, t in enumerate(tail)]
    assert "07-convert-scf-to-cf.mlir" in names
    assert any(re.fullmatch(r"\d\d-gpu\.module_convert-gpu-to-nvvm_.*\.mlir", n) for n in names)


def test_dump_dir_on_a_disk_cache_hit_writes_the_cached_stages(tmp_path, monkeypatch):
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TK_MLIR_ALWAYS_COMPILE", raising=False)
    first = _compile_quickstart(_fresh_quickstart_kernel())          # compiled, cached
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(tmp_path / "dump"))
    again = _compile_quickstart(_fresh_quickstart_kernel())          # a disk cache hit
    assert again.cubin == first.cubin
    (folder,) = (tmp_path / "dump").glob("softmax-*")    # one per specialization
    files = sorted(folder.iterdir())
    # compiled.dump() writes .asm, which has the SASS listing too where nvdisasm exists
    assert [f.read_text() for f in files] == list(again.asm.values())
    assert files[0].name == "00-python.py" and files[-1].suffix in (".log", ".sass")


@pytest.mark.skipif(find_tool("ptxas") is None, reason="needs ptxas")
def test_a_ptxas_job_given_up_stops_ptxas_and_drops_its_files():
    """Ctrl-C (or any error) between starting ptxas and reading its result:
    the job is cancelled, not left running with its temp folder."""
    import os
    from pathlib import Path
    from tk_mlir import toolchain
    from tk_mlir.kernels.gemm import gemm_kernel
    a = tk.spec((4096, 4096), bf16)
    ptx = gemm_kernel.compile(a, a, a, config=0).asm["ptx"]
    job = toolchain.start_ptxas(ptx, "sm_90a")
    folder = Path(job._tmp.name)
    job.cancel()
    assert job._proc.poll() is not None and not folder.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(job._proc.pid, 0)
