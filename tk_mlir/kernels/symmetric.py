"""What the multi-GPU kernels share on the host: their symmetric-memory
workspaces, the group's world size, and the checks of their arguments.

A workspace (buffers, flags, epoch counters on every rank of a group) is
made by a collective call, so every rank must ask for the same ones in the
same order, as every rank calls a collective with the same shapes. It is
made for a capacity (rows) and grown by doubling when a call needs more;
an outgrown one is kept alive, because a CUDA graph captured with it
replays into it. Making one inside a graph capture is refused: call the
function once, outside, first.
"""
from __future__ import annotations

from typing import Callable

from tk_mlir.signals import DEFAULT_TIMEOUT_MS  # noqa: F401  (the kernels' default)

_WORLD_SIZES: dict = {}


def resolve(group):
    """The process group `group` names (None: the default group, as
    torch.distributed reads it: a new one after destroy_process_group and
    init_process_group, so nothing cached for the old one is reused)."""
    if group is not None:
        return group
    import torch.distributed as dist
    return dist.group.WORLD


def world_size(group) -> int:
    """dist.get_world_size(group), asked once per group (it costs ~10 µs of
    host time, as much as the rest of a small all-reduce's launch)."""
    group = resolve(group)
    n = _WORLD_SIZES.get(group)
    if n is None:
        import torch.distributed as dist
        n = _WORLD_SIZES[group] = dist.get_world_size(group)
    return n


def group_key(group) -> tuple:
    """The group (the object: caches hold it, so its identity stays unique)
    and this rank's device."""
    import torch
    return resolve(group), torch.cuda.current_device()


class Workspaces:
    """The workspaces of one kernel family, by group, device and `key`:
    `make(group, key, capacity)` makes one (collectively); `get` returns the
    current one when it holds `need`, else a new one of at least twice the
    capacity."""

    def __init__(self, make: Callable):
        self.make, self.current, self.retired = make, {}, []

    def get(self, group, key: tuple, need: int, fn: str):
        full = (*group_key(group), *key)
        ws = self.current.get(full)
        if ws is not None and ws.capacity >= need:
            return ws
        _refuse_in_capture(fn, "this call needs a new symmetric-memory workspace (a collective "
                               "allocation)")
        if ws is not None:
            self.retired.append(ws)
        ws = self.current[full] = self.make(group, key,
                                            max(need, 2 * ws.capacity if ws else need))
        return ws


_GRIDS: dict = {}


def agreed_grid(group, fn: str) -> int:
    """The persistent grid every rank of the group launches: the fewest SMs
    among their GPUs (block b of one rank pairs with block b of the others,
    and counts of blocks are compared across ranks). A collective, once per
    group and device."""
    key = group_key(group)
    grid = _GRIDS.get(key)
    if grid is None:
        import torch
        import torch.distributed as dist
        _refuse_in_capture(fn, "a first call for this group agrees on a grid (a collective)")
        from tk_mlir.kernels.device import num_sms
        t = torch.tensor([num_sms(torch.cuda.current_device())], dtype=torch.int32,
                         device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        grid = _GRIDS[key] = int(t.item())
    return grid


def _refuse_in_capture(fn: str, why: str) -> None:
    import torch
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{fn}: {why}, which cannot happen inside a CUDA graph capture; call "
                           f"it once with this shape before capturing")


def zeroed_flags(shape, group):
    """An i32 peer tensor of flags, zero on every rank before any uses it."""
    import torch
    import torch.distributed as dist
    from tk_mlir.runtime.peers import peer_tensor
    flags = peer_tensor(shape, torch.int32, group)
    flags.local.zero_()
    dist.barrier(group)
    return flags


def flag_width(world: int) -> int:
    """Flags per row: one per rank, padded to whole 16-byte rows."""
    return -(-world // 4) * 4


def check_distributed(fn: str, name: str, t) -> None:
    """torch.distributed is up and t is on this rank's current CUDA device
    (where its symmetric memory lives). The checks of a wrapper's own rules
    come first: these need a GPU."""
    import torch
    import torch.distributed as dist
    from tk_mlir.kernels import checks
    from tk_mlir.kernel import _interpret_all
    ranks = ("the CPU interpreter runs its kernels with kernel.interpret_ranks[grid]([...]), "
             "one argument tuple per rank, as tests/test_peers.py does")
    if t.device.type == "cpu" and _interpret_all():
        raise ValueError(f"{fn} runs on GPUs only, not under TK_MLIR_INTERPRET=1 (its memory "
                         f"is shared between the ranks' GPUs); {ranks}")
    checks.on_cuda(fn, name, t, on_cpu=f" ({fn} runs on GPUs only; {ranks})")
    if not dist.is_initialized():
        raise RuntimeError(f"{fn} needs torch.distributed initialised (under torchrun: "
                           f"dist.init_process_group('nccl'))")
    if t.device.index != torch.cuda.current_device():
        raise ValueError(f"{fn}: {name} is on {t.device}, this rank's current device is "
                         f"cuda:{torch.cuda.current_device()} (torch.cuda.set_device(rank))")


def check_matmul(fn: str, a, b, b_layout: str, timeout_ms) -> tuple[int, int]:
    """A multi-GPU GEMM's arguments: matmul's rules for a 2-D a, the rows TMA
    needs (checked here: the kernel's tensors are the wrapper's own), then
    the group's; returns (a's rows, N)."""
    from tk_mlir.kernels.gemm import check, output_shape
    if getattr(a, "dim", lambda: 2)() != 2:
        raise ValueError(f"{fn}: a must be 2-D (rows x K), got shape {tuple(a.shape)}")
    check(a, b, None, b_layout, fn, device=False)
    check_timeout(fn, timeout_ms)
    rows, n = output_shape(a, b, b_layout)
    k, per_vector = a.shape[1], 16 // a.element_size()
    if k % per_vector:
        raise ValueError(f"{fn}: K ({k}, a's columns) must be a multiple of {per_vector}: TMA "
                         f"reads rows of whole 16-byte vectors")
    if n % per_vector:
        raise ValueError(f"{fn}: N ({n}, b's {'columns' if b_layout == 'kn' else 'rows'}) "
                         f"must be a multiple of {per_vector}: the output's rows are whole "
                         f"16-byte vectors for TMA")
    import torch
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        raise RuntimeError(f"{fn}: not differentiable (its gradients are not built; the "
                           f"result would silently carry none); an input requires grad: call "
                           f"it under torch.no_grad() or detach the inputs")
    check_distributed(fn, "a", a)
    return rows, n


def check_timeout(fn: str, timeout_ms) -> None:
    rule = f"{fn}: timeout_ms must be an int from 1 to 3600000, got {timeout_ms!r}"
    if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool):
        raise TypeError(rule)               # (a wrong kind of value)
    if not 1 <= timeout_ms <= 3_600_000:
        raise ValueError(rule)
