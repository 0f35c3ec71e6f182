"""The CUDA device facts the library's wrappers size their grids by."""
from __future__ import annotations

from tk_mlir.target import BLACKWELL

_SMS: dict[int, int] = {}
_CAPABILITIES: dict[int, tuple[int, int]] = {}


def num_sms(device: int | None = None) -> int:
    """SMs of a CUDA device (default: the current one), asked once per device:
    the query costs more host time than a launch, and persistent kernels ask
    on every call. A CPU tensor's device (-1: the CPU interpreter runs the
    kernel) has tk_mlir.interpreter.SMS simulated SMs."""
    if device is not None and device < 0:
        from tk_mlir import interpreter
        return interpreter.SMS
    if device is None:
        import torch
        device = torch.cuda.current_device()
    n = _SMS.get(device)
    if n is None:
        import torch
        n = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def compute_capability(device: int) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, asked once per device; None for a CPU
    tensor's device (-1: the interpreter runs the Hopper kernels)."""
    if device < 0:
        return None
    c = _CAPABILITIES.get(device)
    if c is None:
        import torch
        c = _CAPABILITIES[device] = tuple(torch.cuda.get_device_capability(device))
    return c


def is_blackwell(device: int) -> bool:
    """Whether the library's sm_100a kernels (blackwell_gemm.py) serve `device`."""
    return compute_capability(device) == BLACKWELL.compute_capability
