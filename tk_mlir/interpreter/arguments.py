"""The interpreter's argument checks: the GPU launch's, device aside.

An argument the GPU launch refuses is refused here too, with the same
message: the binding and annotation rules (params.py), the layout rules of
every tensor (runtime/arguments.check_tensor_rules: unit inner stride,
16-byte aligned data, rows of whole 16-byte vectors and 16-byte aligned row
starts, though numpy could read any layout), the tensor map rules of the
tensors TMA ops reach (check_tma_tensor) and the scalar rules
(launcher.check_scalar). Only the device differs: the interpreter takes
numpy arrays and CPU torch tensors (memory.GlobalArray).
"""
from __future__ import annotations

import numpy as np

from ..params import GL, PGL, expand_peers
from ..runtime.arguments import check_tensor_rules, check_tma_tensor, tensor_info
from ..runtime.peers import read_peers
from .memory import GlobalArray


def check_arguments(params, values: list, num_warps: int,
                    wrappers: dict | None = None) -> tuple[dict, tuple, dict]:
    """({parameter index: GlobalArray, or for a tk.pgl one its local copy's,
    each rank's copy's and the rank, as the kernel takes them}, the
    specialization key, {parameter name: what was read of its tensor, a
    TensorInfo or runtime/peers.PeerInfo}), each tensor checked by the GPU
    launch's rules. One GlobalArray per array (`wrappers`, by memory and
    layout, may be shared by several ranks' launches): who wrote or read an
    element is tracked per array, whichever argument, or view object of the
    same memory, reaches it."""
    wrappers = {} if wrappers is None else wrappers
    def wrap(obj, name):
        key = memory_key(obj)
        if key not in wrappers:
            wrappers[key] = (GlobalArray(obj, name), obj)    # (obj: keeps the memory alive)
        return wrappers[key][0]
    arrays = {i: wrap(values[i], params[i].name) for i in params.tensors}
    infos: dict = {}
    def read(obj, name):
        infos[name] = tensor_info(obj, name)
        return infos[name]
    sig = params.key(values, num_warps, read)
    for i in params.peer_tensors:
        p, name = values[i], params[i].name
        infos[name] = read_peers(p, name, lambda obj, n: infos[n])   # (key read each copy)
        copies = [n for n, kind in expand_peers(name, p.world_size) if kind == GL]
        arrays[i] = [*(wrap(c, n) for n, c in zip(copies, (p.local, *p.peers), strict=True)),
                     p.rank]
    for i, rule in params.tensor_rules(sig).items():
        for name, info in _copies(params[i], infos):
            check_tensor_rules(info, name, **rule)
    return arrays, sig, infos


def _copies(param, infos: dict) -> list[tuple[str, object]]:
    """(name, TensorInfo) of each array a tensor parameter's argument holds:
    itself, or a tk.pgl argument's copy of every rank."""
    info = infos[param.name]
    if param.kind != PGL:
        return [(param.name, info)]
    names = [n for n, kind in expand_peers(param.name, info.world_size) if kind == GL]
    return list(zip(names, (info.local, *info.peers), strict=True))


def launch_arguments(params, values: list, arrays: dict, infos: dict,
                     tma_args: frozenset[int]) -> list:
    """The kernel's arguments as the interpreter runs it (its entry block's
    order: per runtime parameter a GlobalArray or numpy scalar, a tk.pgl one
    its copies and rank), after the checks the GPU launch makes once the
    kernel is compiled: the tensor map rules of each argument a TMA op
    reaches (`tma_args`, by position) and the scalar rules."""
    from ..launcher import check_scalar
    _, tensors, names = params.abi_arguments(values, infos)
    for j in sorted(tma_args):
        check_tma_tensor(names[j], tensors[j])
    out = []
    for i in params.runtime:
        p = params[i]
        if p.kind == PGL:
            *copies, rank = arrays[i]
            out += [*copies, np.int32(rank)]
        elif p.kind == GL:
            out.append(arrays[i])
        else:
            check_scalar(p.name, p.kind, values[i])
            out.append((np.int32 if p.kind == "i32" else np.float32)(values[i]))
    return out


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
