"""The CUDA driver layer on a hand-written PTX vector add.

The toolchain tests assemble it with ptxas and need no GPU; the `gpu` tests
load it, launch it on torch tensors and time the launch path.
"""
import ctypes
import threading
import time

import pytest

from tk_mlir import toolchain
from tk_mlir.runtime import driver
from tk_mlir.runtime.arguments import check_tensor, tensor_info

# c[i] = a[i] + b[i] for i < n, one thread per element (f32).
VECTOR_ADD_PTX = r"""
.version 8.0
.target sm_90a
.address_size 64

.visible .entry vector_add(
    .param .u64 param_a,
    .param .u64 param_b,
    .param .u64 param_c,
    .param .u32 param_n
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<11>;

    ld.param.u64 %rd1, [param_a];
    ld.param.u64 %rd2, [param_b];
    ld.param.u64 %rd3, [param_c];
    ld.param.u32 %r2, [param_n];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.s32 %r1, %r3, %r4, %r5;
    setp.ge.u32 %p1, %r1, %r2;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd4, %rd1;
    cvta.to.global.u64 %rd5, %rd2;
    cvta.to.global.u64 %rd6, %rd3;
    mul.wide.u32 %rd7, %r1, 4;
    add.s64 %rd8, %rd4, %rd7;
    add.s64 %rd9, %rd5, %rd7;
    add.s64 %rd10, %rd6, %rd7;
    ld.global.f32 %f1, [%rd8];
    ld.global.f32 %f2, [%rd9];
    add.f32 %f3, %f1, %f2;
    st.global.f32 [%rd10], %f3;
DONE:
    ret;
}
"""
ARG_TYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)
BLOCK = 256

needs_ptxas = pytest.mark.skipif(toolchain.find_tool("ptxas") is None,
                                 reason="ptxas not found (pip install nvidia-cuda-nvcc)")


# --------------------------------------------------------- toolchain (CPU)

@needs_ptxas
def test_toolchain_ptxas_assembles_vector_add():
    cubin, log = toolchain.ptxas(VECTOR_ADD_PTX)
    assert cubin.startswith(b"\x7fELF")
    assert "vector_add" in log and "registers" in log     # -v reports per kernel


@needs_ptxas
def test_toolchain_ptxas_error_carries_the_log():
    bad = VECTOR_ADD_PTX.replace("add.f32 %f3", "add.f33 %f3")
    with pytest.raises(toolchain.ToolchainError, match="ptxas failed") as caught:
        toolchain.ptxas(bad)
    assert "add.f33" in caught.value.log or "error" in caught.value.log.lower()
    assert caught.value.log in str(caught.value)


def test_toolchain_missing_ptxas_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(toolchain, "find_tool", lambda name: None)
    with pytest.raises(toolchain.ToolchainError, match="nvidia-cuda-nvcc"):
        toolchain.ptxas(VECTOR_ADD_PTX)


def test_toolchain_find_tool_unknown_is_none():
    assert toolchain.find_tool("no-such-tool-tk-mlir") is None


# ------------------------------------------------------------------- GPU

@pytest.fixture(scope="module")
def torch_cuda():
    if not driver.has_gpu():
        pytest.skip("no CUDA GPU (driver.has_gpu() is False)")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch does not see a CUDA GPU")
    if driver.device_capability() != (9, 0):
        major, minor = driver.device_capability()
        pytest.skip(f"the test PTX targets sm_90a; this GPU is sm_{major}{minor}")
    return torch


@pytest.fixture(scope="module")
def vector_add(torch_cuda):
    if toolchain.find_tool("ptxas"):
        cubin, _ = toolchain.ptxas(VECTOR_ADD_PTX)
    else:
        cubin = VECTOR_ADD_PTX.encode()                   # the driver JIT-compiles PTX text
    module = driver.Module.load(cubin)
    assert driver.Module.load(cubin) is module            # one Module per (device, cubin)
    return module.function("vector_add")


def run_vector_add(torch, fn, n, stream=None, shared_bytes=0):
    a = torch.rand(n, device="cuda")
    b = torch.rand(n, device="cuda")
    c = torch.full_like(a, float("nan"))                  # poisoned: every element must be written
    grid = ((n + BLOCK - 1) // BLOCK, 1, 1)
    stream = driver.current_stream() if stream is None else stream
    fn.launch(grid, (BLOCK, 1, 1), shared_bytes, stream,
              (a.data_ptr(), b.data_ptr(), c.data_ptr(), n), ARG_TYPES)
    torch.cuda.synchronize()
    assert torch.equal(c, a + b)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1000, 1 << 20, 3 * (1 << 20) + 7])
def test_vector_add_matches_torch(torch_cuda, vector_add, n):
    run_vector_add(torch_cuda, vector_add, n)


@pytest.mark.gpu
def test_device_queries(torch_cuda):
    assert driver.device_count() == torch_cuda.cuda.device_count()
    assert driver.device_capability() == torch_cuda.cuda.get_device_capability()


@pytest.mark.gpu
def test_current_stream_follows_torch(torch_cuda, vector_add):
    torch = torch_cuda
    assert driver.current_stream() == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert driver.current_stream() == side.cuda_stream != 0
        run_vector_add(torch, vector_add, 4096)


@pytest.mark.gpu
def test_launch_from_a_fresh_thread(torch_cuda, vector_add):
    # The thread makes no torch call, so (as far as the driver goes) it has no
    # current context: the launch must set one up itself.
    torch, n = torch_cuda, 10_000
    a, b = torch.rand(n, device="cuda"), torch.rand(n, device="cuda")
    c = torch.full_like(a, float("nan"))
    torch.cuda.synchronize()
    seen = {}

    def body():
        try:
            vector_add.launch(((n + BLOCK - 1) // BLOCK, 1, 1), (BLOCK, 1, 1), 0, 0,
                              (a.data_ptr(), b.data_ptr(), c.data_ptr(), n), ARG_TYPES)
            driver.check(driver.cu.cuCtxSynchronize())
        except BaseException as e:        # re-raised in the main thread
            seen["error"] = e

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert "error" not in seen, seen
    torch.cuda.synchronize()
    assert torch.equal(c, a + b)


@pytest.mark.gpu
def test_large_dynamic_shared_memory_opts_in(torch_cuda, vector_add):
    run_vector_add(torch_cuda, vector_add, 4096, shared_bytes=100 * 1024)


@pytest.mark.gpu
def test_bad_launch_raises_cuda_error(torch_cuda, vector_add):
    too_many_threads = (4096, 1, 1)
    expected = r"cuLaunchKernel\(vector_add.*CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(driver.CudaError, match=expected):
        vector_add.launch((1, 1, 1), too_many_threads, 0, 0, (0, 0, 0, 0), ARG_TYPES)
    # A launch refused for its configuration does not poison the context.
    run_vector_add(torch_cuda, vector_add, 1000)


@pytest.mark.gpu
def test_tensor_info_of_cuda_tensors(torch_cuda):
    t = torch_cuda.zeros(64, 128, device="cuda", dtype=torch_cuda.bfloat16)
    info = tensor_info(t, "x")
    assert (info.ptr, info.device, info.dtype) == (t.data_ptr(), f"cuda:{t.device.index}", "bf16")
    check_tensor(info, "x", dtype="bf16", rank=2, static_shape=(None, 128))


@pytest.mark.gpu
def test_launch_host_time(torch_cuda, vector_add, capsys):
    """Host time per launch (no assertion on time: benchmarks are not tests)."""
    torch = torch_cuda
    n, count = 4096, 10_000
    a, b = torch.rand(n, device="cuda"), torch.rand(n, device="cuda")
    c = torch.empty_like(a)
    grid, block = ((n + BLOCK - 1) // BLOCK, 1, 1), (BLOCK, 1, 1)
    handle, launch_kernel = vector_add.handle, driver.cu.cuLaunchKernel

    def raw():
        launch_kernel(handle, *grid, *block, 0, driver.current_stream(),
                      ((a.data_ptr(), b.data_ptr(), c.data_ptr(), n), ARG_TYPES), 0)

    def launch():
        vector_add.launch(grid, block, 0, driver.current_stream(),
                          (a.data_ptr(), b.data_ptr(), c.data_ptr(), n), ARG_TYPES)

    def call_path():
        # What a kernel call does per launch: read and check each tensor, then launch.
        ptrs = []
        for name, t in (("a", a), ("b", b), ("c", c)):
            info = tensor_info(t, name)
            check_tensor(info, name, dtype="f32", rank=1)
            ptrs.append(info.ptr)
        vector_add.launch(grid, block, 0, driver.current_stream(), (*ptrs, n), ARG_TYPES)

    results = {}
    for label, body in (("raw cuLaunchKernel (+ current_stream)", raw), ("Function.launch", launch),
                        ("tensor_info+check_tensor x3 + launch", call_path)):
        for _ in range(1000):
            body()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(count):
            body()
        results[label] = (time.perf_counter() - start) / count * 1e6
        torch.cuda.synchronize()
    assert torch.equal(c, a + b)
    with capsys.disabled():
        print()
        for label, us in results.items():
            print(f"  host time per launch, {label}: {us:.2f} us")
