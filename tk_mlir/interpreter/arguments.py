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
    specialization key). One GlobalArray per array (`wrappers`, by id, may
    be shared by several ranks' launches): who wrote an element is tracked
    per array, whichever argument reaches it."""
    wrappers = {} if wrappers is None else wrappers
    def wrap(obj, name):
        if id(obj) not in wrappers:
            wrappers[id(obj)] = (GlobalArray(obj, name), obj)    # (obj: keeps the id unique)
        return wrappers[id(obj)][0]
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
