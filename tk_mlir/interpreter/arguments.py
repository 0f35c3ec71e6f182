"""The interpreter's argument checks: the GPU path's binding and annotation
rules (dtype, rank, static dims: params.py), none of its device, stride or
alignment rules (numpy reads any layout)."""
from __future__ import annotations

from ..errors import ArgumentError
from ..params import GL, expand_peers
from ..runtime.arguments import describe
from .memory import GlobalArray


def check_arguments(params, values: list, num_warps: int,
                    wrappers: dict | None = None) -> tuple[dict, tuple]:
    """({parameter index: GlobalArray, or for a tk.pgl one its local copy's,
    each rank's copy's and the rank, as the kernel takes them}, the
    specialization key). One GlobalArray per array (`wrappers`, by memory
    and layout, may be shared by several ranks' launches): who wrote or read
    an element is tracked per array, whichever argument, or view object of
    the same memory, reaches it."""
    wrappers = {} if wrappers is None else wrappers
    def wrap(obj, name):
        key = memory_key(obj)
        if key not in wrappers:
            wrappers[key] = (GlobalArray(obj, name), obj)    # (obj: keeps the memory alive)
        return wrappers[key][0]
    arrays = {i: wrap(values[i], params[i].name) for i in params.tensors}
    sig = params.key(values, num_warps, describe)
    for i in params.peer_tensors:
        p = values[i]
        copies = [n for n, kind in expand_peers(params[i].name, p.world_size) if kind == GL]
        arrays[i] = [*(wrap(c, n) for n, c in zip(copies, (p.local, *p.peers), strict=True)),
                     p.rank]
    for i, rule in params.tensor_rules(sig).items():
        for a in (arrays[i] if i in params.peer_tensors else [arrays[i]]):
            _check_array(a, rule)
    return arrays, sig


def memory_key(obj) -> tuple:
    """What tells arrays apart: their first element's address, shape, strides
    and dtype (two view objects of the same elements are one array); the
    object itself for what has no address."""
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return (obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), str(obj.dtype))
    interface = getattr(obj, "__array_interface__", None)
    if interface is not None:
        return (interface["data"][0], tuple(interface["shape"]), interface.get("strides"),
                interface["typestr"])
    return ("object", id(obj))


def _check_array(a, rule: dict) -> None:
    if not isinstance(a, GlobalArray):
        return                                   # (a tk.pgl argument's rank)
    if a.dtype != rule["dtype"]:
        raise ArgumentError(f"argument {a.name!r} has dtype {a.dtype}, but the kernel's "
                            f"annotation wants {rule['dtype']}")
    for d, want in enumerate(rule["static_shape"]):
        if want is not None and a.shape[d] != want:
            raise ArgumentError(f"argument {a.name!r} has shape {a.shape}: dim {d} must be "
                                f"{want} (the kernel's annotation fixes it)")
