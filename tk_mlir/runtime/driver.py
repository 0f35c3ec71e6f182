"""A thin, fast layer over the CUDA driver (cuda-python): contexts, modules,
functions and kernel launches.

Contexts: tk_mlir uses the device's *primary* context, the one the CUDA
runtime (and so PyTorch) uses, so pointers and streams from torch are valid
in our launches. Which device: torch's current device when torch is
importable and sees CUDA, else device 0.

Launch cost matters (a tiny kernel's call is mostly host time), so
`Function.launch` does one driver call and one integer test when all is
well; everything else (context fix-ups, error text) happens only after a
failure.

This is the one module that imports cuda-bindings, and nothing imports it
before a launch: without cuda-bindings, importing it raises CudaUnavailable,
which says what is missing, instead of an ImportError. Without a GPU (no
driver library, or no device), the first driver call raises NoGpu, which
says how to run the kernel on this machine's CPU instead (the interpreter).
"""
from __future__ import annotations

import functools
import sys
import threading
from contextlib import contextmanager
from typing import Callable

from ..errors import CudaUnavailable

try:
    from cuda.bindings import driver as cu
except ImportError as e:
    raise CudaUnavailable(str(e)) from None

_SUCCESS = cu.CUresult.CUDA_SUCCESS
_NO_DEVICE = cu.CUresult.CUDA_ERROR_NO_DEVICE      # cuInit's: a driver, and no GPU
# A launch fails with these when the function's context is not current on the
# calling thread (a fresh thread, or another device's context is current).
_WRONG_CONTEXT = frozenset({cu.CUresult.CUDA_ERROR_INVALID_CONTEXT,
                            cu.CUresult.CUDA_ERROR_INVALID_HANDLE})
# Above this, a kernel must opt in to more dynamic shared memory per block.
_DEFAULT_SHARED_LIMIT = 48 * 1024


class CudaError(RuntimeError):
    """A CUDA driver call failed; `code` is the CUresult, `name` its enum name."""

    def __init__(self, code, what: str | None = None):
        self.code = code
        self.name = (_error_text(cu.cuGetErrorName, code)
                     or getattr(code, "name", None) or f"CUresult {int(code)}")
        description = _error_text(cu.cuGetErrorString, code) or "unknown error"
        prefix = f"{what}: " if what else ""
        super().__init__(f"{prefix}{self.name}: {description}")


def _error_text(query, code) -> str | None:
    try:
        err, text = query(code)
    except Exception:        # the driver library itself may be missing
        return None
    return text.decode() if err == _SUCCESS and text else None


class NoGpu(CudaError):
    """No GPU can be used here: the driver library does not load, or it sees
    no device. A CudaError (code None when the library itself is missing)
    whose message says how to run the kernel on this machine's CPU."""

    def __init__(self, reason: str, code=None, kernel: str | None = None):
        from ..errors import INTERPRET_HINT
        self.code, self.name, self.reason = code, "no GPU", reason
        what = f"cannot launch {kernel}: " if kernel else ""
        RuntimeError.__init__(
            self, f"{what}no NVIDIA GPU can be used here ({reason}): launching a kernel needs "
                  f"one, with its driver; kernel.compile(...) and its .asm stages up to PTX "
                  f"need neither. To {INTERPRET_HINT}")


def check(result, what: str | None = None):
    """Unwrap cuda-python's `(CUresult, *values)`: raise CudaError on failure,
    else return None, the single value, or the tuple of values."""
    if result[0] != _SUCCESS:
        raise CudaError(result[0], what)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


# ---------------------------------------------------------------- devices

_lock = threading.RLock()
_initialized = False


def _init_driver() -> None:
    global _initialized
    if not _initialized:
        with _lock:
            if not _initialized:
                try:
                    result = cu.cuInit(0)
                except Exception as e:      # (cuda-bindings loads the driver library here)
                    raise NoGpu(f"the CUDA driver library does not load: {e}") from None
                if result[0] == _NO_DEVICE:
                    raise NoGpu("the CUDA driver sees no device", result[0])
                check(result, "cuInit")
                _initialized = True


@functools.cache
def _torch_cuda():
    """The torch module when it is importable and sees a GPU, else None."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch
    except Exception:        # a broken torch install must not break launches
        pass
    return None


def default_device() -> int:
    """torch's current CUDA device when torch is in use, else 0."""
    torch = _torch_cuda()
    return torch.cuda.current_device() if torch is not None else 0


def device_count() -> int:
    _init_driver()
    return check(cu.cuDeviceGetCount(), "cuDeviceGetCount")


def device_capability(device: int | None = None) -> tuple[int, int]:
    """(major, minor) compute capability, e.g. (9, 0) for Hopper."""
    device = default_device() if device is None else device
    return (device_attribute("compute_capability_major", device),
            device_attribute("compute_capability_minor", device))


@functools.cache
def device_attribute(name: str, device: int) -> int:
    """A CUdevice_attribute of `device` by its lower-case name, e.g.
    "multiprocessor_count" (cached: attributes do not change)."""
    _init_driver()
    dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
    attr = getattr(cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name.upper()}")
    return int(check(cu.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({name})"))


@functools.cache
def device_identity(device: int) -> tuple[str, tuple[int, int]]:
    """(name, compute capability) of `device`, e.g. ("NVIDIA H200", (9, 0))."""
    _init_driver()
    dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
    name = check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(name, bytes) \
        else str(name)
    return name, device_capability(device)


class UnsupportedDevice(RuntimeError):
    """The device cannot run code built for tk_mlir's target (target.py)."""


def require_target(device: int, kernel: str, arch: str = "sm_90a") -> None:
    """Refuse, before any module is loaded, a device that code compiled for
    `arch` cannot run on (sm_90a code runs on compute capability 9.0 only,
    sm_100a on 10.0)."""
    from ..target import named
    target = named(arch)
    name, capability = device_identity(device)
    if not target.supports(capability):
        raise UnsupportedDevice(
            f"cannot run {kernel} on cuda:{device} ({name}, compute capability "
            f"{capability[0]}.{capability[1]}): it was compiled for {target.arch}, which "
            f"needs {target.description}")


@functools.cache
def has_gpu() -> bool:
    """True when the driver loads and sees at least one device; never raises."""
    return gpu_problem() is None


@functools.cache
def gpu_problem() -> str | None:
    """Why no GPU can be used here (None when one can); never raises."""
    try:
        return None if device_count() > 0 else "the CUDA driver sees no device"
    except NoGpu as e:
        return e.reason
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def require_gpu(kernel: str) -> None:
    """Refuse a launch of `kernel` where no GPU can be used, saying why and
    how to run it on this machine's CPU instead (NoGpu)."""
    if not has_gpu():
        raise NoGpu(gpu_problem() or "the CUDA driver sees no device", kernel=kernel)


def pointer_device(ptr: int) -> int | None:
    """The device ordinal that owns a device pointer, or None when the driver
    cannot tell (no GPU, or not a device pointer); never raises."""
    if not has_gpu():
        return None
    try:
        attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        err, ordinal = cu.cuPointerGetAttribute(attr, ptr)
    except Exception:
        return None
    return int(ordinal) if err == _SUCCESS else None


# --------------------------------------------------------------- contexts

_contexts: dict[int, cu.CUcontext] = {}     # device ordinal -> retained primary context


def primary_context(device: int) -> cu.CUcontext:
    """The device's primary context, retained once for the process."""
    ctx = _contexts.get(device)
    if ctx is None:
        with _lock:
            ctx = _contexts.get(device)
            if ctx is None:
                torch = _torch_cuda()
                if torch is not None:
                    torch.cuda.init()    # let torch set up CUDA before we touch it
                _init_driver()
                dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
                ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                _contexts[device] = ctx
    return ctx


@contextmanager
def using_context(device: int):
    """Run the body with `device`'s primary context current on this thread.

    If another context is current (torch working on another device), push
    ours and pop it afterwards so torch's notion of the current device is left
    alone. If none is current (a fresh thread), make ours current and leave it
    so, as torch would on its first CUDA call in that thread.
    """
    ctx = primary_context(device)
    current = int(check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent"))
    if current == int(ctx):
        yield
    elif current == 0:
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        yield
    else:
        check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")


# ---------------------------------------------------------------- streams

def _resolve_stream_getter():
    """A function device -> raw stream handle once torch is imported with a
    GPU, else None (torch may still be imported later, so this is retried)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if _torch_cuda() is None:
        return lambda device=None: 0
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    if raw is None or get_device is None:
        # Slower public route: builds a torch.cuda.Stream object per call.
        return lambda device=None: torch.cuda.current_stream(device).cuda_stream

    # torch.cuda.current_stream() builds a Stream object (µs); the private
    # raw getter (what torch.compile's generated code calls) returns the int.
    def current(device=None):
        return raw(get_device() if device is None else device)
    return current


_stream_getter = None


def current_stream(device: int | None = None) -> int:
    """torch's current CUDA stream on `device` (default: torch's current
    device) as a raw handle, or 0 (the legacy default stream) without torch."""
    global _stream_getter
    getter = _stream_getter
    if getter is None:
        getter = _stream_getter = _resolve_stream_getter()
        if getter is None:
            return 0
    return getter(device)


def stream_function(device: int) -> Callable[[], int]:
    """A function of no arguments giving torch's current stream on `device`
    as a raw handle: what a launch plan calls per launch (torch's private raw
    getter bound to the device, as torch.compile's generated code uses it)."""
    torch = sys.modules.get("torch")
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None) \
        if torch is not None and _torch_cuda() is not None else None
    return functools.partial(raw if raw is not None else current_stream, device)


# ------------------------------------------------------- modules, functions

class Module:
    """A cubin loaded into one device's primary context.

    `Module(image)` always loads; `Module.load(image, device)` returns the one
    Module per (device, image) and is what callers should use.
    """

    _cache: dict[tuple[int, bytes], Module] = {}

    def __init__(self, cubin: bytes, device: int | None = None):
        if not cubin.startswith(b"\x7fELF") and not cubin.endswith(b"\0"):
            cubin = bytes(cubin) + b"\0"     # PTX text: the driver JIT wants it NUL-terminated
        self.image = cubin                   # the driver may read it lazily: keep it alive
        self.device = default_device() if device is None else device
        with using_context(self.device):
            self.handle = check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")
        self._functions: dict[str, Function] = {}

    @classmethod
    def load(cls, cubin: bytes, device: int | None = None) -> Module:
        device = default_device() if device is None else device
        key = (device, bytes(cubin))
        module = cls._cache.get(key)
        if module is None:
            with _lock:
                module = cls._cache.get(key)
                if module is None:
                    module = cls._cache[key] = cls(key[1], device)
        return module

    def function(self, name: str) -> Function:
        fn = self._functions.get(name)
        if fn is None:
            handle = check(cu.cuModuleGetFunction(self.handle, name.encode()),
                           f"cuModuleGetFunction({name!r})")
            fn = self._functions[name] = Function(handle, name, self)
        return fn


class Function:
    """A kernel in a loaded Module."""

    __slots__ = ("handle", "name", "module", "device", "_shared_limit")

    def __init__(self, handle: cu.CUfunction, name: str, module: Module):
        self.handle = handle
        self.name = name
        self.module = module                 # keeps the module (and its image) loaded
        self.device = module.device
        self._shared_limit = _DEFAULT_SHARED_LIMIT

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Opt in to `nbytes` of dynamic shared memory per block (needed above 48 KiB)."""
        if nbytes <= self._shared_limit:
            return
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        with using_context(self.device):
            check(cu.cuFuncSetAttribute(self.handle, attr, nbytes),
                  f"{self.name}: cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes})")
        self._shared_limit = nbytes

    def max_active_blocks(self, threads: int, shared_bytes: int) -> int:
        """How many blocks of `threads` threads and `shared_bytes` of dynamic
        shared memory can be resident on one SM (the driver's occupancy)."""
        self.set_max_dynamic_shared(shared_bytes)
        with using_context(self.device):
            return int(check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self.handle, threads, shared_bytes),
                f"{self.name}: cuOccupancyMaxActiveBlocksPerMultiprocessor"))

    def max_active_clusters(self, cluster: int, threads: int, shared_bytes: int) -> int:
        """How many clusters of `cluster` blocks can be resident at once (the
        size of a persistent grid, in clusters): not every SM pairs up, as a
        cluster's blocks share a GPC."""
        self.set_max_dynamic_shared(shared_bytes)
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
        config.sharedMemBytes = shared_bytes
        with using_context(self.device):
            return int(check(cu.cuOccupancyMaxActiveClusters(self.handle, config),
                             f"{self.name}: cuOccupancyMaxActiveClusters"))

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int],
               shared_bytes: int, stream: int, args: tuple, arg_types: tuple) -> None:
        """Launch on `stream` (a raw handle; 0 = legacy default stream).

        `arg_types` holds one ctypes type per argument (c_void_p for pointers,
        c_int32, c_int64, c_float), or None for an object passed by value
        through its `getPtr()` (a CUtensorMap as a 128-byte grid constant).
        Build the tuple once per kernel and reuse it: cuda-python packs the
        values in C, which beats handing it a buffer filled in Python, and is
        thread-safe.
        """
        if shared_bytes > self._shared_limit:
            self.set_max_dynamic_shared(shared_bytes)
        err = cu.cuLaunchKernel(self.handle, *grid, *block, shared_bytes, stream,
                                (args, arg_types), 0)[0]
        if err:                              # CUresult is an int enum: 0 is success
            self._after_failed_launch(err, grid, block, shared_bytes, stream, args, arg_types)

    def _after_failed_launch(self, err, grid, block, shared_bytes, stream, args, arg_types):
        if err in _WRONG_CONTEXT:
            with using_context(self.device):
                err = cu.cuLaunchKernel(self.handle, *grid, *block, shared_bytes, stream,
                                        (args, arg_types), 0)[0]
        if err:
            raise CudaError(err, f"cuLaunchKernel({self.name}, grid={tuple(grid)}, "
                                 f"block={tuple(block)}, shared_bytes={shared_bytes}, "
                                 f"device={self.device})")

    def __repr__(self):
        return f"<Function {self.name} on cuda:{self.device}>"


# ------------------------------------------------------- the fast launch path

# cuda-python's cuLaunchKernel spends most of its host time packing Python
# objects, so kernels launched many times call libcuda's cuLaunchKernel
# directly: the parameters are packed with one struct.pack_into into a buffer
# whose per-parameter addresses are fixed, and the call is one ctypes foreign
# call.
_PACK = {"ptr": "Q", "i32": "i", "i64": "q", "f32": "f"}


@functools.cache
def _libcuda_launch():
    """libcuda's cuLaunchKernel, called without ctypes argtypes (declared
    argtypes convert every argument on every call). The caller passes the
    64-bit handle, stream and pointer array as c_void_p objects and the
    seven unsigned dims as Python ints (C int: the same bits below 2**31)."""
    import ctypes
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    fn.restype = ctypes.c_int
    return fn


class PackedLauncher:
    """Launches one Function with parameters of fixed kinds ('ptr', 'i32',
    'i64', 'f32', and 'tmap': a tensor map given by the address of its 128
    bytes, which the caller keeps alive during the call). Thread-safe: the
    shared parameter buffer is filled and handed to the driver under a lock
    (the driver copies it during the call)."""

    def __init__(self, function: Function, kinds: tuple[str, ...]):
        import ctypes
        import struct
        self.function = function
        self.kinds = kinds
        # Tensor maps ('tmap') are not packed: the driver reads each from its
        # CUtensorMap's own 128 bytes, whose address is set per launch.
        packed = [k for k in kinds if k != "tmap"]
        fmt = "@" + "".join(_PACK[k] for k in packed)
        offsets = iter([struct.calcsize("@" + "".join(_PACK[k] for k in packed[:i + 1])) -
                        struct.calcsize("@" + _PACK[packed[i]]) for i in range(len(packed))])
        self._pack = struct.Struct(fmt).pack_into
        self._buffer = ctypes.create_string_buffer(max(struct.calcsize(fmt), 8))
        base = ctypes.addressof(self._buffer)
        self._pointers = (ctypes.c_void_p * max(len(kinds), 1))(
            *[0 if k == "tmap" else base + next(offsets) for k in kinds])
        self._maps = [i for i, k in enumerate(kinds) if k == "tmap"]
        self._handle = int(function.handle)
        self._launch = _libcuda_launch()
        self._lock = threading.Lock()

    def bind(self, threads: int, shared_bytes: int, in_context: bool = False) -> Callable:
        """A launch function `(gx, gy, gz, stream, *values)` for blocks of
        `threads` threads and `shared_bytes` of dynamic shared memory.
        `in_context`: push the function's device context around each launch
        (for launches on a device that is not torch's current one)."""
        f = self.function
        if shared_bytes > f._shared_limit:
            f.set_max_dynamic_shared(shared_bytes)
        import ctypes
        pack, buffer, pointers = self._pack, self._buffer, self._pointers
        handle, call, lock = ctypes.c_void_p(self._handle), self._launch, self._lock
        if in_context:
            call = _calling_in_context(call, f.device)
        void_p = ctypes.c_void_p

        maps = self._maps
        packed = [i for i in range(len(self.kinds)) if i not in maps]

        def launch_with_maps(gx, gy, gz, stream, *values):
            with lock:
                pack(buffer, 0, *[values[i] for i in packed])
                for i in maps:                  # (each map's address: launcher.remember_maps)
                    pointers[i] = values[i]
                err = call(handle, gx, gy, gz, threads, 1, 1, shared_bytes, void_p(stream),
                           pointers, None)
            if err:
                fail(err, gx, gy, gz, stream, values)

        def launch(gx, gy, gz, stream, *values):
            with lock:
                pack(buffer, 0, *values)
                err = call(handle, gx, gy, gz, threads, 1, 1, shared_bytes, void_p(stream),
                           pointers, None)
            if err:
                fail(err, gx, gy, gz, stream, values)

        def fail(err, gx, gy, gz, stream, values):
            # The slow path knows how to fix a missing context and name the error
            # (it passes a tensor map as an object with the address of its bytes).
            values = tuple(_MapAt(v) if k == "tmap" else v for k, v in zip(self.kinds, values))
            f._after_failed_launch(cu.CUresult(err), (gx, gy, gz), (threads, 1, 1),
                                   shared_bytes, stream, values,
                                   tuple(ctypes_type(k) for k in self.kinds))
        return launch_with_maps if maps else launch


class _MapAt:
    """A tensor map by the address of its 128 bytes, as cuda-python's
    cuLaunchKernel takes an object passed by value (its getPtr())."""

    def __init__(self, address: int):
        self._address = address

    def getPtr(self) -> int:
        return self._address


def _calling_in_context(call: Callable, device: int) -> Callable:
    """`call` with `device`'s primary context pushed around it: two libcuda
    calls, where launching from another device's context would fail and be
    retried on the slow path (Function._after_failed_launch)."""
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1")
    push, pop = lib.cuCtxPushCurrent_v2, lib.cuCtxPopCurrent_v2
    context = ctypes.c_void_p(int(primary_context(device)))
    popped = ctypes.byref(ctypes.c_void_p())

    def call_in_context(*args):
        err = push(context)
        if err:
            return err
        try:
            return call(*args)
        finally:
            pop(popped)
    return call_in_context


def ctypes_type(kind: str):
    """The kernelParams type cuda-python packs a parameter kind with (None: an
    object passed by value through its getPtr(), e.g. a CUtensorMap)."""
    import ctypes
    return {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64,
            "f32": ctypes.c_float, "tmap": None}[kind]
