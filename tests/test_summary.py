"""compiled.summary(): the facts a kernel author checks first, agreeing with
compiled.info (ptxas) and the SASS; occupancy from the target's limits here
(no GPU: the driver's number is a GPU test's)."""
import re
import sys
from pathlib import Path

import pytest

import tk_mlir as tk
from tk_mlir import summary as S
from tk_mlir.target import TARGET
from tk_mlir.toolchain import find_tool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from quickstart import softmax  # noqa: E402

pytestmark = pytest.mark.skipif(find_tool("ptxas") is None, reason="needs ptxas")


@pytest.fixture(scope="module")
def gemm():
    from tk_mlir.kernels.gemm import gemm_kernel
    a = tk.spec((4096, 4096), "bf16")
    return gemm_kernel.compile(a, a, a, config=0)


@pytest.fixture(scope="module")
def small():
    x = tk.spec((1000, 512), tk.f32)
    return softmax.compile(x, x, ROWS=4, N=512)


def test_numbers_agree_with_info(gemm, small):
    for compiled in (gemm, small):
        facts, info = compiled.summary(), compiled.info
        assert facts["registers"] == info["registers"]
        assert facts["spill stores (bytes)"] == info["spill stores (bytes)"] == 0
        assert facts["spill loads (bytes)"] == info["spill loads (bytes)"] == 0
        assert facts["threads"] == info["threads"]
        assert facts["dynamic shared memory (bytes)"] == info["dynamic shared memory (bytes)"]
    assert gemm.summary()["barriers"] == 16          # "used 16 barriers" in the log
    assert "used 16 barriers" in gemm.ptxas_log


@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="needs nvdisasm")
def test_instruction_mix_agrees_with_the_sass(gemm, small):
    mix = gemm.summary()["instructions (SASS, static)"]
    sass = gemm.asm["sass"]
    for op in ("HGMMA", "UTMALDG", "UTMASTG", "BAR"):
        lines = [l for l in sass.splitlines() if re.search(rf"\b{op}(\.|\s)", l) and "/*" in l]
        assert mix[op] == len(lines) > 0, op
    assert mix["LDL"] == mix["STL"] == 0
    assert mix["total"] == len(re.findall(r"^\s*/\*[0-9a-f]{4,}\*/", sass, re.M))
    small_mix = small.summary()["instructions (SASS, static)"]
    assert small_mix["MUFU"] > 0 and small_mix["SHFL"] > 0 and "HGMMA" not in small_mix


def test_occupancy_from_h200_limits():
    # The GEMM: 168 registers x 384 threads and 225 KiB shared fill an SM.
    assert S.blocks_per_sm_from_limits(168, 384, 230528) == (1, ["registers", "shared memory"])
    # 34 registers: 1,280 per warp (units of 256), 4 warps a block: 12 blocks.
    assert S.blocks_per_sm_from_limits(34, 128, 0) == (12, ["registers"])
    assert S.blocks_per_sm_from_limits(16, 1024, 0) == (2, ["threads"])
    assert S.blocks_per_sm_from_limits(16, 32, 0) == (32, ["blocks"])
    assert S.blocks_per_sm_from_limits(32, 128, 100 * 1024) == (2, ["shared memory"])
    assert S.blocks_per_sm_from_limits(32, 128, 228 * 1024) == (0, ["shared memory"])


def test_summary_occupancy_without_a_gpu(gemm):
    from tk_mlir.runtime import driver
    if driver.has_gpu():
        pytest.skip("a GPU is here: occupancy comes from the driver")
    facts = gemm.summary()
    assert facts["blocks per SM"] == 1 and facts["limited by"] == "registers, shared memory"
    assert f"{TARGET.arch} limits" in facts["occupancy from"]


def test_a_gpu_that_cannot_run_the_kernel_leaves_the_limits(gemm, monkeypatch):
    from tk_mlir.runtime import driver
    monkeypatch.setattr(driver, "has_gpu", lambda: True)

    def refuse(device=None):
        raise driver.UnsupportedDevice("cannot run gemm_kernel on cuda:0 (NVIDIA A100, 8.0)")
    monkeypatch.setattr(gemm, "function", refuse)
    facts = gemm.summary()
    assert facts["blocks per SM"] == 1
    assert facts["occupancy from"] == \
        f"{TARGET.arch} limits (cannot run gemm_kernel on cuda:0 (NVIDIA A100, 8.0))"


def test_ptxas_warnings_are_listed():
    log = ("ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to "
           "determine register count at entry.\n"
           "ptxas info    : 0 bytes gmem\n"
           "ptxas info    : Used 4 registers, used 0 barriers, 1024 bytes smem\n")
    assert S.ptxas_warnings(log) == ["(C7508) Potential Performance Loss: 'setmaxnreg' ignored; "
                                     "unable to determine register count at entry."]
    assert S.static_shared_bytes(log) == 1024 and S.barriers(log) == 0


# nvdisasm -g's form: line annotations, labels, /*addr*/ instructions (predicated too).
LOOPS_SASS = """
        //## File "/k/kernel.py", line 10
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        //## File "/k/kernel.py", line 12
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
.L_x_2:
        //## File "/k/kernel.py", line 14
        /*0020*/                   IMAD.MOV.U32 R8, RZ, RZ, R24 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0038*/                   FMUL R10, R10, R11 ;
        //## File "/k/helpers.py", line 3
        /*0040*/                   STL [R1], R8 ;
        /*0050*/               @P0 BRA `(.L_x_2) ;
        //## File "/k/kernel.py", line 16
        /*0060*/                   MOV R9, R8 ;
        /*0070*/               @!P1 BRA `(.L_x_1) ;
.L_x_3:
        /*0080*/                   FADD R2, R2, R3 ;
        /*0090*/                   BRA `(.L_x_3) ;
        /*00a0*/                   BRA `(.L_x_4) ;
.L_x_4:
        /*00b0*/                   EXIT ;
"""


def test_loops_are_the_innermost_with_mmas_or_local_memory():
    """The inner loop (L_x_2) is reported, not the one around it, nor the
    loop without MMAs or local memory (L_x_3) or the forward branch; lines
    from the file most of its instructions name."""
    assert S.loops(LOOPS_SASS) == ["kernel.py:14-14: 5 instructions, 1 MMA, 1 moves, 1 LDL/STL"]


# Straight-line MMAs, an mbarrier wait whose retry ptxas placed after the
# kernel's EXIT: the retry path's jump back over the MMAs is not a loop.
RETRY_SASS = """
        //## File "/k/kernel.py", line 20
        /*0000*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R2 ;
        /*0010*/              @!P0 BRA `(.L_x_1) ;
.L_x_3:
        //## File "/k/kernel.py", line 21
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*0040*/                   EXIT ;
.L_x_1:
        /*0050*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R2 ;
        /*0060*/              @!P0 BRA `(.L_x_1) ;
        /*0070*/                   BRA `(.L_x_3) ;
"""


def test_a_slow_path_jumping_back_over_the_exit_is_not_a_loop():
    assert S.loops(RETRY_SASS) == []
    # (a loop with a predicated exit inside stays one)
    looped = RETRY_SASS.replace("/*0040*/                   EXIT ;",
                                "/*0040*/               @P1 EXIT ;\n"
                                "        /*0048*/               @P2 BRA `(.L_x_3) ;")
    assert S.loops(looped) == ["kernel.py:21-21: 4 instructions, 2 MMA, 0 moves, 0 LDL/STL"]


@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="needs nvdisasm")
def test_the_gemm_mainloop_is_listed_without_spills(gemm):
    loops = gemm.summary()["loops with MMAs or spills (SASS, static)"]
    assert loops and all(l.endswith(" 0 LDL/STL") for l in loops), loops
    assert any(re.search(r": \d+ instructions, [1-9]\d* MMA", l) for l in loops), loops


def test_summary_heads_the_page_and_prints_as_text(gemm):
    page = gemm._repr_html_()
    head = page[:page.index("<details")]
    assert "<th>registers</th><th>spill stores (bytes)</th>" in head and "<td>168</td>" in head
    assert "<th>HGMMA</th>" in head and "<th>blocks per SM</th>" in head
    assert '<div class="t-sub">ptxas warnings: none</div>' in head
    text = gemm.summary_text()
    assert re.search(r"^registers\s+168$", text, re.M)
    assert re.search(r"^instructions \(SASS, static\)\s+HGMMA \d+", text, re.M)
    assert re.search(r"^ptxas warnings\s+none$", text, re.M)


@pytest.mark.gpu
def test_occupancy_from_the_driver_agrees_with_the_limits(gemm, small):
    for compiled in (gemm, small):
        facts = compiled.summary()
        assert facts["occupancy from"].startswith("the driver")
        static = facts["static shared memory (bytes)"]
        expected, _ = S.blocks_per_sm_from_limits(facts["registers"], facts["threads"],
                                                  static + compiled.smem_bytes)
        assert facts["blocks per SM"] == expected
