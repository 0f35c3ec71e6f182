"""Kernel tensor arguments: reading them (torch tensors, __cuda_array_interface__
and DLPack objects), checking them against a kernel's annotation, and
describing tensors without memory for compile-only use.

`tensor_info` + `check_tensor` run per tensor on every launch, so the torch
path reads the tensor's attributes directly and the checks are plain integer
tests; the messages are only built when a rule is broken.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

from ..dtypes import ARGUMENT_DTYPES, BY_TORCH_NAME, BY_TYPESTR, DTYPES
from ..errors import INTERPRET_HINT, ArgumentError, CudaUnavailable

# Every dtype fact here is a column of the one table, dtypes.DTYPES: a dtype
# named by torch, numpy or ml_dtypes (one name: 'bfloat16') or by a
# __cuda_array_interface__ typestr maps to its tk name through BY_TORCH_NAME
# or BY_TYPESTR. Dtypes kernels do not take are still named (f64, i64, bool):
# the annotation's check then refuses them by name, with the conversion.

# The dtypes (and typestrs) a kernel argument may hold, as refusals list them.
_TAKEN = f"(they take {', '.join(ARGUMENT_DTYPES)})"
_TAKEN_TYPESTRS = tuple(s for n in ARGUMENT_DTYPES for s in DTYPES[n].typestr)

# DLPack device types (dlpack.h) we read: CUDA memory, and CPU memory so that
# check_tensor can report the device rule by name.
_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_MANAGED = 1, 2, 13


@dataclass(frozen=True, init=False)
class TensorInfo:
    """A tensor argument as the launcher sees it. Strides are in elements."""
    ptr: int
    shape: tuple[int, ...]       # a torch.Size (a tuple) for torch tensors
    strides: tuple[int, ...]
    dtype: str                   # tk name: 'bf16', 'f16', 'f32', 'f8e4m3', 'i32', ...
    device: str                  # 'cuda:N' ('cuda' when the ordinal is unknown), 'cpu', 'meta'
    itemsize: int

    def __init__(self, ptr, shape, strides, dtype, device, itemsize):
        # One dict update instead of the six object.__setattr__ calls a frozen
        # dataclass generates: this runs per tensor per launch (~2x faster).
        self.__dict__.update(ptr=ptr, shape=shape, strides=strides, dtype=dtype,
                             device=device, itemsize=itemsize)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's type without memory, for compiling with no GPU."""
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int
    device: str = "meta"
    ptr = None       # not a field: lets check_tensor take specs and infos alike


# ------------------------------------------------------------------ dtypes

def canonical_dtype(dtype) -> str:
    """tk_mlir's name for a dtype given as a tk name ('bf16'), a tk dtype
    object, a torch dtype, a numpy/ml_dtypes dtype, a numpy scalar type or a
    dtype's name ('bfloat16')."""
    key = dtype
    numpy = sys.modules.get("numpy")
    if isinstance(key, type) and numpy is not None:      # np.float16 and the like
        try:
            key = numpy.dtype(key)
        except TypeError:
            pass
    if not isinstance(key, str):
        name = getattr(key, "name", None)                # tk DType, numpy dtype
        key = name if isinstance(name, str) else str(key)   # str(torch.bfloat16)
    key = key.removeprefix("torch.")
    if key in DTYPES:
        return key
    if key in BY_TORCH_NAME:
        return BY_TORCH_NAME[key]
    raise ArgumentError(f"unknown dtype {dtype!r}; {_supported_dtypes()}")


_torch_tensor_type: type | None = None        # torch.Tensor, once torch is imported
_torch_dtypes: dict = {}                       # torch.dtype -> (tk name, itemsize)
_cuda_device_names: dict[int, str] = {}        # ordinal -> 'cuda:N', to skip formatting


def _learn_torch(torch) -> None:
    """Resolve the dtype table against torch (we never import torch ourselves
    just to read a tensor: if it is not imported, no argument is a torch tensor)."""
    global _torch_tensor_type
    if _torch_tensor_type is None:
        for torch_name, tk in BY_TORCH_NAME.items():
            torch_dtype = getattr(torch, torch_name, None)   # fp8 needs torch >= 2.1
            if torch_dtype is not None:
                _torch_dtypes[torch_dtype] = (tk, DTYPES[tk].itemsize)
        _torch_tensor_type = torch.Tensor


def _cuda_device_name(ordinal: int) -> str:
    name = _cuda_device_names.get(ordinal)
    if name is None:
        name = _cuda_device_names[ordinal] = f"cuda:{ordinal}"
    return name


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


# ------------------------------------------------------------ reading args

def tensor_info(obj, name: str) -> TensorInfo:
    """Read a tensor argument. Raises ArgumentError naming `name` for objects
    that are not tensors; device and layout rules are check_tensor's job."""
    if type(obj) is _torch_tensor_type:
        return _from_torch(obj, name)
    return _tensor_info_other(obj, name)


def _from_torch(t, name: str) -> TensorInfo:
    dtype, itemsize = _torch_dtype(t, name)
    # str(t.device) costs ~0.3 µs; is_cuda + get_device a third of that.
    device = _cuda_device_name(t.get_device()) if t.is_cuda else t.device.type
    return TensorInfo(t.data_ptr(), t.shape, t.stride(), dtype, device, itemsize)


def _torch_dtype(t, name: str) -> tuple[str, int]:
    try:
        return _torch_dtypes[t.dtype]
    except KeyError:
        raise ArgumentError(f"argument {name!r} has dtype {t.dtype}, which tk_mlir kernels "
                            f"do not take {_TAKEN}") from None


def _tensor_info_other(obj, name: str) -> TensorInfo:
    torch = sys.modules.get("torch")
    if torch is not None:
        _learn_torch(torch)
        if isinstance(obj, torch.Tensor):       # subclasses, e.g. nn.Parameter
            return _from_torch(obj, name)
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:
        return _from_cuda_array_interface(interface, name)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        return _from_numpy(obj, name)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj, name)
    if hasattr(obj, "peers") and hasattr(obj, "local"):        # a tk.PeerTensor / peer_spec
        raise ArgumentError(f"argument {name!r} is a tk.gl parameter and takes one tensor; a "
                            f"{type(obj).__name__} (every rank's copy) goes to a tk.pgl "
                            f"parameter, or pass its .local")
    raise ArgumentError(f"argument {name!r}: expected a CUDA tensor (torch.Tensor, "
                        f"__cuda_array_interface__ or DLPack), got {type(obj).__name__}")


def _from_cuda_array_interface(interface: dict, name: str) -> TensorInfo:
    where = f"argument {name!r} (__cuda_array_interface__)"
    try:
        typestr = interface["typestr"]
        shape = tuple(int(d) for d in interface["shape"])
        ptr = int(interface["data"][0])
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise ArgumentError(f"{where}: malformed interface dict ({type(e).__name__}: {e}); "
                            f"it needs 'typestr', 'shape' and 'data'") from None
    if interface.get("mask") is not None:
        raise ArgumentError(f"{where}: masked arrays are not supported; pass the data "
                            f"without a mask")
    dtype = BY_TYPESTR.get(typestr)
    if dtype is None:
        if typestr[1:2] == "V":
            raise ArgumentError(
                f"{where}: typestr {typestr!r} is raw bytes and does not say which "
                f"{typestr[2:]}-byte type it holds (bf16 and fp8 have no typestr); pass "
                f"a torch tensor or a DLPack object instead")
        raise ArgumentError(f"{where}: typestr {typestr!r} is not a type tk_mlir kernels take "
                            f"(they take {', '.join(_TAKEN_TYPESTRS)})")
    itemsize = DTYPES[dtype].itemsize
    byte_strides = interface.get("strides")
    if byte_strides is None:                       # None means C-contiguous
        strides = contiguous_strides(shape)
    else:
        strides = _element_strides(byte_strides, itemsize, where)
    ordinal = _pointer_device(ptr)
    device = "cuda" if ordinal is None else _cuda_device_name(ordinal)
    return TensorInfo(ptr, shape, strides, dtype, device, itemsize)


def _pointer_device(ptr: int) -> int | None:
    """The device that owns `ptr`, or None when unknown. The driver is
    imported here, not with this module: describing tensors for a compile
    must work without cuda-bindings (the launch then says it is missing)."""
    driver = sys.modules.get(__package__ + ".driver")   # (an import per call costs ~1 µs)
    if driver is None:
        try:
            from . import driver
        except CudaUnavailable:
            return None
    return driver.pointer_device(ptr)


def _element_strides(byte_strides, itemsize: int, where: str) -> tuple[int, ...]:
    if any(s % itemsize for s in byte_strides):
        raise ArgumentError(f"{where}: byte strides {tuple(byte_strides)} are not whole "
                            f"elements of {itemsize} bytes; make the array contiguous")
    return tuple(int(s) // itemsize for s in byte_strides)


def _from_numpy(array, name: str) -> TensorInfo:
    dtype = _numpy_dtype(array, f"argument {name!r}")
    itemsize = DTYPES[dtype].itemsize
    strides = _element_strides(array.strides, itemsize, f"argument {name!r}")
    return TensorInfo(array.ctypes.data, array.shape, strides, dtype, "cpu", itemsize)


def _numpy_dtype(array, where: str) -> str:
    dtype = BY_TORCH_NAME.get(array.dtype.name)      # ml_dtypes' bfloat16 is named 'bfloat16'
    if dtype is None:
        raise ArgumentError(f"{where} has numpy dtype {array.dtype}, which tk_mlir kernels "
                            f"do not take {_TAKEN}")
    return dtype


def _from_dlpack(obj, name: str) -> TensorInfo:
    device_type, ordinal = obj.__dlpack_device__()
    if device_type not in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED, _DLPACK_CPU):
        raise ArgumentError(f"argument {name!r} lives on DLPack device type {device_type}; "
                            f"tk_mlir kernels need CUDA tensors")
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        raise ArgumentError(f"argument {name!r} is a DLPack tensor; reading DLPack needs "
                            f"torch installed (or pass an object with "
                            f"__cuda_array_interface__)") from None
    _learn_torch(torch)
    # from_dlpack hands torch's current stream to the producer, which makes
    # its pending work on the tensor visible to our launch.
    return _from_torch(torch.from_dlpack(obj), name)


# ----------------------------------------------------------------- checks

def check_tensor(info: TensorInfo | TensorSpec, name: str, *, dtype: str, rank: int,
                 static_shape: tuple[int | None, ...] | None = None) -> None:
    """The GPU launch's check of a tensor argument: on a CUDA device, then
    `check_tensor_rules`. A TensorSpec (ptr None) skips the device rule.
    Raises ArgumentError naming the argument, the rule and a fix."""
    if info.ptr is not None and not info.device.startswith("cuda"):
        raise ArgumentError(f"argument {name!r} is on {info.device}; tk_mlir kernels need "
                            f"CUDA tensors: move it with .cuda(), or {INTERPRET_HINT}")
    check_tensor_rules(info, name, dtype=dtype, rank=rank, static_shape=static_shape)


def check_tensor_rules(info: TensorInfo | TensorSpec, name: str, *, dtype: str, rank: int,
                       static_shape: tuple[int | None, ...] | None = None) -> None:
    """The rules a tensor argument obeys wherever the kernel runs (the GPU
    launch, through check_tensor, and the interpreter, on its CPU arrays):
    dtype, rank and static dims against the annotation, 32-bit dims, then the
    layout of 16-byte vector accesses (innermost stride 1, 16-byte aligned
    data, rows of whole 16-byte vectors, 16-byte aligned row starts). A
    TensorSpec (ptr None) skips the pointer rule. Raises ArgumentError naming
    the argument, the rule and a fix.

    Runs per tensor per launch: the passing path is flat integer tests; each
    message is built by a helper only when its rule is broken.
    """
    if info.dtype != dtype:
        _check_dtype(info, name, dtype)
    shape = info.shape
    if len(shape) != rank:
        raise ArgumentError(f"argument {name!r} has rank {len(shape)} (shape {tuple(shape)}), "
                            f"but the kernel's annotation wants rank {rank}")
    if static_shape is not None:
        for i, want in enumerate(static_shape):
            if want is not None and shape[i] != want:
                raise ArgumentError(f"argument {name!r} has shape {tuple(shape)}: dim {i} "
                                    f"must be {want} (the kernel's annotation fixes it)")
    if not rank:                       # one value: a scalar load, element-aligned
        if info.ptr is not None and info.ptr % info.itemsize:
            raise ArgumentError(f"argument {name!r}: data pointer {info.ptr:#x} of a 0-d "
                                f"{info.dtype} tensor is not {info.itemsize}-byte aligned; "
                                f"pass an aligned tensor, e.g. x.clone() (numpy: x.copy())")
        return
    if max(shape) >= 2**31:
        raise ArgumentError(f"argument {name!r} has shape {tuple(shape)}: kernels index with "
                            f"32-bit dims, each must be below 2**31")
    strides, itemsize, ptr = info.strides, info.itemsize, info.ptr
    if not vector_rows(shape, strides, itemsize, ptr):
        _vector_rows_error(info, name)


def vector_rows(shape, strides, itemsize: int, ptr: int | None) -> bool:
    """Whether a tensor's layout suits 16-byte vector accesses and TMA: its
    innermost stride 1, its data (unless ptr is None: a description) 16-byte
    aligned, rows of whole 16-byte vectors, every other dim stepping by whole
    16-byte vectors (a dim of size 1 is never stepped over)."""
    if strides[-1] != 1 or (ptr is not None and ptr & 15) or shape[-1] * itemsize & 15:
        return False
    return all(not (step < 0 or step * itemsize & 15) or n == 1
               for n, step in zip(shape[:-1], strides[:-1]))


def _vector_rows_error(info, name: str) -> None:
    """Raise the error of the vector_rows rule `info` breaks."""
    shape, strides, itemsize, ptr = info.shape, info.strides, info.itemsize, info.ptr
    rank = len(shape)
    if strides[-1] != 1:
        raise ArgumentError(f"argument {name!r} has strides {tuple(strides)}: the innermost "
                            f"dim must have stride 1 (rows contiguous in memory); pass a "
                            f"contiguous tensor, e.g. x.contiguous() (numpy: "
                            f"np.ascontiguousarray(x))")
    if ptr is not None and ptr & 15:
        raise ArgumentError(f"argument {name!r}: data pointer {ptr:#x} is not 16-byte aligned "
                            f"(a view that starts mid-row, like x[:, 3:] of a 2-D tensor or "
                            f"x[1:] of a 1-D one, does this); pass an "
                            f"aligned tensor, e.g. x.clone() (numpy: x.copy())")
    if shape[-1] * itemsize & 15:
        raise _row_size_error(info, name)
    for i in range(rank - 1):
        step = strides[i]
        # A dim of size 1 is never stepped over, so its stride does not matter.
        if (step < 0 or step * itemsize & 15) and shape[i] != 1:
            raise _row_start_error(info, name, i)


def check_tma_tensor(name: str, info: TensorInfo | TensorSpec) -> None:
    """The rules of a tensor a TMA op reads or writes (its tensor map's),
    beyond check_tensor_rules' (16-byte aligned base, unit inner stride,
    16-byte row steps): the GPU launch and the interpreter both apply them."""
    if 0 in info.shape:
        raise ArgumentError(f"argument {name!r} has shape {tuple(info.shape)}: TMA tensor maps "
                            f"need every dim non-empty")
    isz = info.itemsize
    for dim, step in enumerate(info.strides[:-1]):
        if step * isz >= 2**40:
            raise ArgumentError(f"argument {name!r}: dim {dim} steps {step * isz} bytes; a TMA "
                                f"tensor map allows strides below 2**40 bytes")
    if len(info.shape) > 5:
        raise ArgumentError(f"argument {name!r} has rank {len(info.shape)}; TMA tensor maps "
                            f"have at most 5 dims")


def _check_dtype(info, name: str, want) -> None:
    want = canonical_dtype(want)         # accept tk dtype objects too, off the fast path
    if info.dtype == want:
        return
    torch_name = DTYPES[want].torch
    # (numpy's name too, for the dtypes numpy has: bf16 and fp8 need ml_dtypes)
    numpy = f"; numpy: x.astype({torch_name!r})" if DTYPES[want].typestr else ""
    hint = f" (torch: x.to(torch.{torch_name}){numpy})" if torch_name else ""
    raise ArgumentError(f"argument {name!r} has dtype {info.dtype}, but the kernel's "
                        f"annotation wants {want}; convert it{hint}")


def _row_size_error(info, name: str) -> ArgumentError:
    n, itemsize = info.shape[-1], info.itemsize
    return ArgumentError(f"argument {name!r} has shape {tuple(info.shape)}: its rows "
                         f"(innermost dim) are {n} x {itemsize} = {n * itemsize} bytes, but "
                         f"rows must be whole 16-byte vectors; pad the innermost dim to a "
                         f"multiple of {max(16 // itemsize, 1)} elements")


def _row_start_error(info, name: str, dim: int) -> ArgumentError:
    itemsize = info.itemsize
    step = info.strides[dim] * itemsize
    return ArgumentError(f"argument {name!r} has strides {tuple(info.strides)} (elements of "
                         f"{itemsize} bytes): dim {dim} steps {step} bytes, but every row "
                         f"must start 16-byte aligned (a non-negative multiple of 16 bytes); "
                         f"make it contiguous (x.contiguous(); numpy: np.ascontiguousarray(x)) "
                         f"or pad its rows to a multiple "
                         f"of {max(16 // itemsize, 1)} elements")


# ------------------------------------------------------- compile-only specs

def _supported_dtypes() -> str:
    return (f"the supported dtypes are {', '.join(ARGUMENT_DTYPES)} (tk names, tk.bf16, "
            f"or the torch / numpy dtypes)")


def check_element_type(name: str, what: str) -> None:
    """`name` (a canonical dtype name) must be an element type kernels take."""
    if name not in ARGUMENT_DTYPES:
        raise ArgumentError(f"{what} ({name}) is not an element type tk_mlir kernels take; "
                            f"{_supported_dtypes()}")


def spec(shape, dtype, strides=None) -> TensorSpec:
    """A tensor type without memory: `spec((4096, 4096), 'bf16')`. Strides
    (in elements) default to contiguous."""
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                               for d in dims):
        raise ArgumentError(f"tk.spec shape must be a tuple of non-negative ints, got {shape!r}")
    try:
        name = canonical_dtype(dtype)
    except ArgumentError:
        raise ArgumentError(f"tk.spec dtype {dtype!r} is not a dtype tk_mlir knows; "
                            f"{_supported_dtypes()}") from None
    check_element_type(name, f"tk.spec dtype {dtype!r}")
    steps = contiguous_strides(dims) if strides is None else tuple(strides)
    if len(steps) != len(dims):
        raise ArgumentError(f"spec strides {steps} do not match shape {dims}")
    return TensorSpec(dims, steps, name, DTYPES[name].itemsize)


def describe(obj, name: str = "tensor") -> TensorSpec:
    """The TensorSpec of a TensorSpec, TensorInfo, torch tensor on any device
    (meta included), numpy array, or anything tensor_info reads."""
    if isinstance(obj, TensorSpec):
        return obj
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        # Read the attributes, not data_ptr(): meta and fake tensors have no memory.
        _learn_torch(torch)
        dtype, itemsize = _torch_dtype(obj, name)
        return TensorSpec(tuple(obj.shape), obj.stride(), dtype, itemsize)
    if not isinstance(obj, TensorInfo):
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(obj, numpy.ndarray):
            dtype = _numpy_dtype(obj, f"{name!r}")
            itemsize = DTYPES[dtype].itemsize
            strides = _element_strides(obj.strides, itemsize, f"{name!r}")
            return TensorSpec(tuple(obj.shape), strides, dtype, itemsize)
        obj = tensor_info(obj, name)
    return TensorSpec(tuple(obj.shape), tuple(obj.strides), obj.dtype, obj.itemsize)
