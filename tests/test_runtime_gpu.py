"""The launch path on the GPU: argument kinds, plans, streams and errors."""
import pytest

torch = pytest.importorskip("torch")

import tk_mlir as tk
from tk_mlir import bf16, f32

pytestmark = pytest.mark.gpu


@tk.kernel(num_warps=4)
def axpy(X: tk.gl[f32], Y: tk.gl[f32], Z: tk.gl[f32], a: float, BM: tk.constexpr = 16):
    i = tk.block_id(0)
    tk.store(Z, tk.load(X, (i, 0), (BM, 64)) * a + tk.load(Y, (i, 0), (BM, 64)), (i, 0))


def _check(x, y, z, a):
    ref = x.double() * a + y.double()
    assert ((z.double() - ref).norm() / ref.norm()).item() < 1e-6


def _inputs(m=100):
    x, y = torch.rand(m, 64, device="cuda") - 0.5, torch.rand(m, 64, device="cuda") - 0.5
    return x, y, torch.full_like(x, float("nan"))


class CudaArray:
    """A tensor seen only through __cuda_array_interface__ (as CuPy or Numba pass it)."""

    def __init__(self, t):
        self._t = t
        self.__cuda_array_interface__ = t.__cuda_array_interface__


def test_cuda_array_interface_arguments():
    x, y, z = _inputs()
    axpy[(tk.cdiv(100, 16),)](CudaArray(x), CudaArray(y), CudaArray(z), 3.0)
    torch.cuda.synchronize()
    _check(x, y, z, 3.0)


def test_dlpack_arguments():
    x, y, z = _inputs()

    class DL:
        def __init__(self, t): self.t = t
        def __dlpack__(self, **kw): return self.t.__dlpack__(**kw)
        def __dlpack_device__(self): return self.t.__dlpack_device__()
    axpy[(tk.cdiv(100, 16),)](DL(x), DL(y), DL(z), 2.0)
    torch.cuda.synchronize()
    _check(x, y, z, 2.0)


def test_grid_callable_and_plans_per_signature():
    for m in (16, 100, 1000):
        x, y, z = _inputs(m)
        axpy[lambda a: (tk.cdiv(a["X"].shape[0], a["BM"]),)](x, y, z, 0.5, BM=16)
        torch.cuda.synchronize()
        _check(x, y, z, 0.5)


def test_side_stream():
    x, y, z = _inputs(4096)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        axpy[(4096 // 16,)](x, y, z, 1.5)
    s.synchronize()
    _check(x, y, z, 1.5)


def test_misaligned_view_is_refused():
    x, y, z = _inputs()
    axpy[(1,)](x, y, z, 1.0)                       # a plan exists for aligned tensors
    flat = torch.rand(100 * 64 + 1, device="cuda")
    shifted = flat[1:].view(100, 64)               # data pointer 4 bytes past alignment
    with pytest.raises(tk.ArgumentError, match="16-byte aligned"):
        axpy[(1,)](shifted, y, z, 1.0)


def test_wrong_dtype_is_refused():
    x, y, z = _inputs()
    with pytest.raises(tk.ArgumentError, match="dtype"):
        axpy[(1,)](x.to(torch.bfloat16), y, z, 1.0)


def test_cpu_tensor_is_refused():
    x, y, z = _inputs()
    with pytest.raises(tk.ArgumentError, match="cpu"):
        axpy[(1,)](x.cpu(), y, z, 1.0)


@tk.kernel(num_warps=4)
def scale_by(X: tk.gl[f32], Y: tk.gl[f32], S: tk.constexpr):
    tk.store(Y, tk.load(X, (tk.block_id(0), 0), (16, 64)) * S, (tk.block_id(0), 0))


def test_positional_constexpr_changes_pick_other_code():
    x, _, y = _inputs(16)
    for s in (2.0, 3.0, 2.0):
        scale_by[(1,)](x, y, s)                       # S positional
        torch.cuda.synchronize()
        assert torch.allclose(y, x * s)


@tk.kernel(num_warps=4)
def shifted(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    i = tk.block_id(0)
    tk.store(Y, tk.load(X, (i - 1, 0), (16, 64), fill=7.0), (i, 0))   # block 0 reads tile -1
    tk.store(Y, tk.load(X, ((i - 1) % n, 0), (16, 64)) + 100.0, (i + n, 0))


def test_negative_tile_coordinates_are_masked_and_mod_is_pythons():
    base = torch.rand(64, 64, device="cuda")
    x = base[16:]                                     # memory before x exists: must not be read
    y = torch.full((96, 64), float("nan"), device="cuda")
    shifted[(3,)](x, y, 3)
    torch.cuda.synchronize()
    assert torch.all(y[:16] == 7.0)
    assert torch.equal(y[16:48], x[:32])
    assert torch.equal(y[48:64], x[32:48] + 100.0)    # (0 - 1) % 3 == 2
    assert torch.equal(y[64:96], x[:32] + 100.0)


@tk.kernel(num_warps=4)
def branch_scale(X: tk.gl[f32], Y: tk.gl[f32]):
    s = 1.0
    if tk.block_id(0) > 0:
        s = 2.0
    else:
        s = 3.0
    tk.store(Y, tk.load(X, (tk.block_id(0), 0), (16, 64)) * s, (tk.block_id(0), 0))


def test_constants_assigned_in_branches():
    x, _, y = _inputs(32)
    branch_scale[(2,)](x, y)
    torch.cuda.synchronize()
    assert torch.allclose(y[:16], x[:16] * 3.0) and torch.allclose(y[16:], x[16:] * 2.0)


def test_bad_grids_are_refused():
    x, y, z = _inputs()
    for grid in ((4.0,), (0,), (-1,), (2**32 + 2,)):
        with pytest.raises(tk.ArgumentError, match="grid"):
            axpy[grid](x, y, z, 1.0)


def test_parameter_arguments_take_the_fast_path():
    x, y, z = _inputs()
    px, py = torch.nn.Parameter(x, requires_grad=False), torch.nn.Parameter(y, requires_grad=False)
    axpy[(tk.cdiv(100, 16),)](px, py, z, 0.25)
    torch.cuda.synchronize()
    _check(x, y, z, 0.25)
    assert axpy._plans, "a plan was made for nn.Parameter arguments"


GLOBAL_SCALE = 2.5


@tk.kernel(num_warps=4)
def times_global(X: tk.gl[f32], Y: tk.gl[f32]):
    i = tk.block_id(0)
    tk.store(Y, tk.load(X, (i, 0), (16, 64)) * GLOBAL_SCALE, (i, 0))


@pytest.mark.parametrize("wrap", ["torch", "cuda_array_interface"])
def test_a_changed_global_is_used_at_the_next_launch(wrap):
    """Plan path (torch tensors) and general path: never the old code."""
    global GLOBAL_SCALE
    wrapped = (lambda t: t) if wrap == "torch" else CudaArray
    try:
        for scale in (2.5, 3.5, 2.5):
            GLOBAL_SCALE = scale
            x = torch.rand(64, 64, device="cuda") - 0.5
            y = torch.full_like(x, float("nan"))
            times_global[(4,)](wrapped(x), wrapped(y))
            torch.cuda.synchronize()
            ref = x.double() * scale
            assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6, scale
    finally:
        GLOBAL_SCALE = 2.5


@pytest.mark.parametrize("grid", [(1, 65536), (1, 1, 65536)])
def test_grid_over_the_cuda_limits_is_an_argument_error(grid):
    x, y, z = _inputs(16)
    with pytest.raises(tk.ArgumentError, match=f"{'yz'[len(grid) - 2]} = 65536 blocks is over"):
        axpy[grid](x, y, z, 1.0)


def test_the_device_is_checked_against_the_target():
    """On the H200 the check passes and names nothing; the refusal itself is
    tested on CPU (test_runtime_checks.py) with the capability query faked."""
    from tk_mlir.runtime import driver
    from tk_mlir.target import TARGET
    name, capability = driver.device_identity(torch.cuda.current_device())
    assert name == torch.cuda.get_device_name() and TARGET.supports(capability)


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@two_gpus
@pytest.mark.parametrize("wrap", ["torch", "cuda_array_interface"])
def test_tensors_on_another_gpu_launch_there(wrap):
    """torch's current device is 0, the tensors are on cuda:1: the kernel runs
    on cuda:1, on torch's current stream for cuda:1."""
    wrapped = (lambda t: t) if wrap == "torch" else CudaArray
    with torch.cuda.device(0):
        x = torch.rand(100, 64, device="cuda:1") - 0.5
        y = torch.rand(100, 64, device="cuda:1") - 0.5
        z = torch.full_like(x, float("nan"))
        side = torch.cuda.Stream(device="cuda:1")
        side.wait_stream(torch.cuda.current_stream("cuda:1"))
        with torch.cuda.stream(side):      # makes cuda:1 current: set 0 back
            torch.cuda.set_device(0)
            assert torch.cuda.current_stream("cuda:1") == side
            axpy[(tk.cdiv(100, 16),)](wrapped(x), wrapped(y), wrapped(z), 1.5)
            assert torch.cuda.current_device() == 0
            side.synchronize()
    _check(x, y, z, 1.5)
    # And again on cuda:0 (its own plan), then cuda:1 (the first plan).
    for device in ("cuda:0", "cuda:1"):
        x, y = (torch.rand(100, 64, device=device) - 0.5 for _ in range(2))
        z = torch.full_like(x, float("nan"))
        axpy[(tk.cdiv(100, 16),)](wrapped(x), wrapped(y), wrapped(z), 0.5)
        torch.cuda.synchronize(device)
        _check(x, y, z, 0.5)


@two_gpus
def test_tensors_on_two_gpus_are_refused():
    x = torch.rand(16, 64, device="cuda:0")
    y = torch.rand(16, 64, device="cuda:1")
    with pytest.raises(tk.ArgumentError, match="different devices.*'X' on cuda:0, 'Y' on cuda:1"):
        axpy[(1,)](x, y, torch.empty_like(x), 1.0)


@tk.kernel(num_warps=4)
def tagged(X: tk.gl[f32], Y: tk.gl[f32], C: tk.constexpr):
    s = 2.5 if C[0] is True else 3.5
    tk.store(Y, tk.load(X, (tk.block_id(0), 0), (16, 64)) * s, (tk.block_id(0), 0))


@pytest.mark.parametrize("by_keyword", [True, False])
def test_plans_tell_apart_constexprs_that_compare_equal(by_keyword):
    # (1,) == (True,) in Python; the kernel branches on `is True`.
    x = torch.rand(32, 64, device="cuda") - 0.5
    for c, scale in [((1,), 3.5), ((True,), 2.5), ((1,), 3.5)]:
        y = torch.full_like(x, float("nan"))
        if by_keyword:
            tagged[(2,)](x, y, C=c)
        else:
            tagged[(2,)](x, y, c)
        torch.cuda.synchronize()
        assert torch.equal(y, x * scale), c


def test_a_grid_function_runs_at_every_launch():
    # Its result is cached as validated, not the function's first answer.
    grid = lambda meta: (tk.cdiv(meta["X"].shape[0], 16),)   # noqa: E731
    for m in (32, 100, 48):
        x, y, z = _inputs(m)
        axpy[grid](x, y, z, 2.0)
        torch.cuda.synchronize()
        _check(x, y, z, 2.0)


@pytest.mark.parametrize("a", ["np.float64", "np.float32", "np.int64"])
def test_a_numpy_scalar_is_refused_by_name_not_dropped(a):
    """A first call whose scalar is numpy's: the plan made for it refuses it,
    and the general path says why (it once launched nothing, silently)."""
    import numpy as np
    value = eval(a)(2.0 if "float" in a else 2)
    x, y, z = _inputs()
    with pytest.raises(tk.ArgumentError, match=r"argument 'a'.* must be a float"):
        axpy[(tk.cdiv(100, 16),)](x, y, z, value, BM=16)
    axpy[(tk.cdiv(100, 16),)](x, y, z, float(value), BM=16)
    torch.cuda.synchronize()
    _check(x, y, z, 2.0)


def test_a_tma_kernel_launches_from_a_thread_with_no_current_context():
    """Autograd's device threads run a backward's first kernel before any CUDA
    call of their own: the tensor maps are encoded, and the kernel launched,
    under the tensors' device's primary context."""
    import threading
    from cuda.bindings import driver as cu
    from tk_mlir.kernels import matmul
    a, b = (torch.randn(384, 320, device="cuda").bfloat16() for _ in range(2))
    c = torch.full((384, 384), float("nan"), device="cuda").bfloat16()
    torch.cuda.synchronize()
    failures, contexts = [], []
    def run():
        try:
            contexts.append(int(cu.cuCtxGetCurrent()[1]))     # (none, on a fresh thread)
            matmul(a, b, c)
        except Exception as e:      # (reported in the main thread)
            failures.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not failures, (failures, contexts)
    ref = a.double() @ b.double().T
    assert ((c.double() - ref).norm() / ref.norm()).item() < 1e-2
