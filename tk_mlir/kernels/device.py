"""The CUDA device facts the library's wrappers size their grids by."""
from __future__ import annotations

_SMS: dict[int, int] = {}


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
