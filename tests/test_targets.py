"""Compile targets (tk_mlir/target.py): Hopper (sm_90a) by default,
Blackwell (sm_100a) by `@tk.kernel(target="sm_100a")`, checked without the
hardware: PTX for the chip, ptxas and nvdisasm where installed, the cache
keeping the two apart, the rules that differ (no wgmma on sm_100a), and the
launch check that refuses a device the code cannot run on."""
from __future__ import annotations

import re

import pytest

import tk_mlir as tk
from tk_mlir import f32, target
from tk_mlir.runtime import driver
from tk_mlir.runtime.arguments import describe
from tk_mlir.toolchain import find_tool

needs_ptxas = pytest.mark.skipif(find_tool("ptxas") is None, reason="needs ptxas")


def softmax_source():
    def softmax(X: tk.gl[f32], Y: tk.gl[f32], ROWS: tk.constexpr, BLOCK: tk.constexpr):
        tile = tk.block_id(0)
        x = tk.load(X, (tile, 0), (ROWS, BLOCK), fill=float("-inf"))
        e = x.sub_row(x.row_max()).exp()
        tk.store(Y, e.div_row(e.row_sum()), (tile, 0))
    return softmax


SPEC = (tk.spec((64, 512), tk.f32), tk.spec((64, 512), tk.f32))


def test_a_kernel_compiles_for_blackwell_down_to_ptx(monkeypatch):
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    hopper = tk.kernel(softmax_source(), num_warps=4).compile(*SPEC, ROWS=4, BLOCK=512)
    blackwell = tk.kernel(softmax_source(), num_warps=4, target="sm_100a").compile(
        *SPEC, ROWS=4, BLOCK=512)
    assert (hopper.arch, blackwell.arch) == ("sm_90a", "sm_100a")
    assert re.search(r"^\.target sm_100a$", blackwell.asm["ptx"], re.M)
    assert re.search(r"^\.version 8\.8$", blackwell.asm["ptx"], re.M)
    assert re.search(r"^\.target sm_90a$", hopper.asm["ptx"], re.M)


@needs_ptxas
def test_ptxas_assembles_it_for_sm_100a_and_nvdisasm_reads_it(monkeypatch):
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    compiled = tk.kernel(softmax_source(), num_warps=4, target="sm_100a").compile(
        *SPEC, ROWS=4, BLOCK=512)
    assert compiled.assembled and compiled.info["spill stores (bytes)"] == 0
    if find_tool("nvdisasm") is not None:
        assert re.search(r"\.target\s+sm_100a", compiled.asm["sass"])


def test_the_cache_keeps_the_targets_apart():
    hopper = tk.kernel(softmax_source(), num_warps=4)
    blackwell = tk.kernel(softmax_source(), num_warps=4, target="sm_100a")
    sig = hopper.params.key(hopper.params.bind(SPEC, dict(ROWS=4, BLOCK=512))[0], 4,
                            describe)
    keys = {k._specialization(sig).cache_key() for k in (hopper, blackwell)}
    assert len(keys) == 2


def test_wgmma_is_refused_for_blackwell_at_its_line():
    @tk.kernel(num_warps=4, target="sm_100a")
    def mma(A: tk.gl, B: tk.gl, C: tk.gl):
        a = tk.shared_tile(A.dtype, (64, 64), swizzle=128)
        tk.store(a, tk.load(A, (0, 0), (64, 64), layout="row", scope="warpgroup"))
        tk.barrier()
        acc = tk.mma_ABt(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), a, a)
        tk.mma_wait(0)
        tk.store(C, acc, (0, 0))
    spec = tk.spec((64, 64), tk.bf16)
    with pytest.raises(tk.CompilationError, match=r"tk.mma_\* into a register tile is wgmma, "
                       r"Hopper's \(sm_90a\) warpgroup MMA; sm_100a has none") as info:
        mma.compile(spec, spec, tk.spec((64, 64), tk.f32))
    assert "acc = tk.mma_ABt(" in str(info.value)


def test_an_unknown_target_is_refused_at_the_decorator():
    with pytest.raises(tk.CompilationError, match=r"target must be one of 'sm_90a', 'sm_100a', "
                                                  r"got 'sm_120'"):
        tk.kernel(softmax_source(), target="sm_120")


def test_the_interpreter_runs_a_blackwell_kernel():
    torch = pytest.importorskip("torch")
    k = tk.kernel(softmax_source(), num_warps=4, target="sm_100a")
    x = torch.randn(8, 512)
    y = torch.full_like(x, float("nan"))
    k.interpret[(2,)](x, y, ROWS=4, BLOCK=512)
    assert torch.allclose(y, torch.softmax(x, -1), atol=1e-6)


def test_a_device_the_code_cannot_run_on_is_refused_before_loading(monkeypatch):
    """The check every launch makes (CompiledKernel.function): sm_100a code
    on a compute capability 9.0 device, and sm_90a code on a 10.0 one."""
    assert target.BLACKWELL.supports((10, 0)) and not target.BLACKWELL.supports((9, 0))
    monkeypatch.setattr(driver, "device_identity", lambda device: ("NVIDIA H200", (9, 0)))
    with pytest.raises(driver.UnsupportedDevice, match=r"cannot run k on cuda:0 \(NVIDIA H200, "
                       r"compute capability 9.0\): it was compiled for sm_100a, which needs an "
                       r"NVIDIA Blackwell"):
        driver.require_target(0, "k", "sm_100a")
    driver.require_target(0, "k", "sm_90a")
    monkeypatch.setattr(driver, "device_identity", lambda device: ("NVIDIA B200", (10, 0)))
    with pytest.raises(driver.UnsupportedDevice, match=r"compiled for sm_90a, which needs an "
                                                       r"NVIDIA Hopper"):
        driver.require_target(0, "k", "sm_90a")


@pytest.mark.gpu
def test_gpu_launching_blackwell_code_on_the_h200_is_unsupported_device():
    torch = pytest.importorskip("torch")
    k = tk.kernel(softmax_source(), num_warps=4, target="sm_100a")
    x = torch.randn(8, 512, device="cuda")
    with pytest.raises(driver.UnsupportedDevice, match="compiled for sm_100a"):
        k[(2,)](x, torch.empty_like(x), ROWS=4, BLOCK=512)
