"""The interpreter's argument checks: the GPU path's binding and annotation
rules (dtype, rank, static dims: params.py), none of its device, stride or
alignment rules (numpy reads any layout)."""
from __future__ import annotations

from ..errors import ArgumentError
from ..runtime.arguments import describe
from .memory import GlobalArray


def check_arguments(params, values: list, num_warps: int) -> tuple[dict, tuple]:
    """({parameter index: GlobalArray}, the specialization key)."""
    if params.peer_tensors:
        names = ", ".join(params[i].name for i in params.peer_tensors)
        raise ArgumentError(f"{params.name} takes peer tensors (tk.pgl: {names}): their "
                            f"signals need every rank's kernel running at once, and the "
                            f"interpreter runs one launch; run it on GPUs (one GPU can hold "
                            f"every rank's copy: tk.PeerTensor.from_tensors)")
    arrays = {i: GlobalArray(values[i], params[i].name) for i in params.tensors}
    sig = params.key(values, num_warps, describe)
    for i, rule in params.tensor_rules(sig).items():
        a, name = arrays[i], params[i].name
        if a.dtype != rule["dtype"]:
            raise ArgumentError(f"argument {name!r} has dtype {a.dtype}, but the kernel's "
                                f"annotation wants {rule['dtype']}")
        for d, want in enumerate(rule["static_shape"]):
            if want is not None and a.shape[d] != want:
                raise ArgumentError(f"argument {name!r} has shape {a.shape}: dim {d} must be "
                                    f"{want} (the kernel's annotation fixes it)")
    return arrays, sig
