"""global_reads.py on the GPU (the rules: test_global_reads.py): a launch
(plan path and general path, a torch tensor or a __cuda_array_interface__
object) after a module attribute, a class attribute or a helper's global
changed runs new code, and so does an autotuned launch; a global tensor
named like the kernel's local neither recompiles nor stays alive."""
import gc
import types
import weakref

import pytest

torch = pytest.importorskip("torch")

import tk_mlir as tk
from tk_mlir import f32

pytestmark = pytest.mark.gpu

cfgmod = types.ModuleType("gr_gpu_cfg")     # a user module (not the stdlib's, not installed)
cfgmod.__file__ = __file__
cfgmod.SCALE = 2.5


class Cfg:
    SCALE = 2.5


BLOCK = 2.5


def helper():
    return BLOCK


@tk.kernel(num_warps=4)
def by_attrs(X: tk.gl[f32], Y: tk.gl[f32]):
    i = tk.block_id(0)
    x = tk.load(X, (i, 0), (16, 64))
    tk.store(Y, x * cfgmod.SCALE * Cfg.SCALE * helper(), (i, 0))


class CudaArray:
    def __init__(self, t):
        self.t, self.shape, self.dtype = t, tuple(t.shape), t.dtype
        self.__cuda_array_interface__ = t.__cuda_array_interface__


@pytest.mark.parametrize("wrap", ["torch", "cuda_array_interface"])
def test_changed_attributes_and_helper_globals_run_new_code(wrap, monkeypatch):
    global BLOCK
    wrapped = (lambda t: t) if wrap == "torch" else CudaArray
    cases = [(2.5, 2.5, 2.5), (3.0, 2.5, 2.5), (3.0, 1.5, 2.5), (3.0, 1.5, 0.5), (2.5, 2.5, 2.5)]
    try:
        for m, c, b in cases:
            monkeypatch.setattr(cfgmod, "SCALE", m)
            monkeypatch.setattr(Cfg, "SCALE", c)
            BLOCK = b
            x = torch.rand(64, 64, device="cuda") - 0.5
            y = torch.full_like(x, float("nan"))
            by_attrs[(4,)](wrapped(x), wrapped(y))
            torch.cuda.synchronize()
            ref = x.double() * m * c * b
            assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6, (m, c, b)
    finally:
        BLOCK = 2.5


x = None


@tk.kernel(num_warps=4)
def local_x(X: tk.gl[f32], Y: tk.gl[f32]):
    i = tk.block_id(0)
    x = tk.load(X, (i, 0), (16, 64))
    tk.store(Y, x * 2.0, (i, 0))


def test_a_global_tensor_named_like_a_local(monkeypatch):
    global x
    for m in (64, 128, 256):
        x = torch.rand(m, 64, device="cuda")
        y = torch.empty_like(x)
        local_x[(m // 16,)](x, y)
    torch.cuda.synchronize()
    assert len(local_x._plans) == 1 and len(local_x._compiled) == 1
    alive = weakref.ref(x)
    x = y = None
    gc.collect()
    assert alive() is None


@tk.autotune(configs=[tk.Config(BM=16), tk.Config(BM=32)], key=["X"], warmup=1, reps=2)
@tk.kernel(num_warps=4)
def tuned_by_attrs(X: tk.gl[f32], Y: tk.gl[f32], BM: tk.constexpr):
    i = tk.block_id(0)
    tk.store(Y, tk.load(X, (i, 0), (BM, 64)) * cfgmod.SCALE, (i, 0))


def test_autotuned_launches_after_a_global_changed_run_new_code(monkeypatch):
    # tk.autotune's quick path tries the plan that served the last call of the
    # same shape first; a plan whose globals changed turns it away.
    grid = lambda meta: (tk.cdiv(meta["X"].shape[0], meta["BM"]),)   # noqa: E731
    x = torch.rand(96, 64, device="cuda") - 0.5
    for scale in (2.5, 2.5, 3.0, 3.0, 0.5):
        monkeypatch.setattr(cfgmod, "SCALE", scale)
        y = torch.full_like(x, float("nan"))
        tuned_by_attrs[grid](x, y)
        torch.cuda.synchronize()
        assert torch.equal(y, x * scale), scale
