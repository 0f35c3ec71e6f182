"""Signals between blocks and between GPUs: flags in global memory that one
thread releases and another acquires (PTX memory model: release/acquire at a
scope), and the fence that orders completed TMA writes before a signal.

    # rank r has written its tile into peer p's buffer with TMA:
    tk.tma.store_wait(0, read=False)      # the TMA writes are done ...
    tk.fence("sys", async_proxy=True)     # ... and ordered before what follows
    tk.signal(Flags[p], (block, r))       # red.release.sys.add: p may read them
    # rank p:
    tk.wait_signal(Flags, (block, q), epoch)   # ld.acquire.sys until >= epoch

Flags are u32 counters in an i32 tensor that only ever grow: a launch waits
for the count its epoch expects (the previous launches' signals plus its
own), so nothing resets them between launches and a kernel replays in a CUDA
graph unchanged (the compare wraps at 2^32). A wait that does not see its
value within `timeout_ms` traps (the launch fails with an error) instead of
hanging the GPU, printing where it waited unless the kernel issues warpgroup
MMAs (`calls_allowed`).

tk-verify checks that order between TMA writes and a signal
(passes/signal_order.py).
"""
from __future__ import annotations

from .dialects import tk as tk_dialect
from .errors import CompilationError
from .language import builtin, compile_time_int
from .ops import _indices
from .values import Global, as_scalar, builds, emit

__all__ = ["signal", "wait_signal", "fence"]

_MODES = ("add", "set")


def _scope(scope) -> str:
    if scope not in tk_dialect.SCOPES:
        raise CompilationError(f"scope must be one of {', '.join(map(repr, tk_dialect.SCOPES))} "
                               f"(block, GPU, system: another GPU), got {scope!r}")
    return scope


def _flags(flags, what: str) -> Global:
    if not isinstance(flags, Global) or flags.dtype != "i32":
        raise CompilationError(f"{what} takes a flag in an i32 tensor (a tk.gl[\"i32\"] or "
                               f"tk.pgl[\"i32\"] argument, or a peer's copy), got {flags!r}")
    return flags


def _flag_index(flags: Global, idx, what: str) -> list:
    """idx's values; a compile-time coordinate past a compile-time dim is an
    error here (on the GPU the flag traps)."""
    coords = idx if isinstance(idx, (tuple, list)) else (idx,)
    dims = flags.tk_type.shape
    for d, (c, extent) in enumerate(zip(coords, dims)):
        if isinstance(c, int) and not isinstance(c, bool) and extent is not None and \
                not 0 <= c < extent:
            raise CompilationError(f"{what}: flag coordinate {c} in dim {d} is outside the "
                                   f"flags' {extent} (shape {tuple(dims)})")
    return _indices(idx)


def _int(value, what: str):
    if isinstance(value, int) and not isinstance(value, bool):
        if not -2**31 <= value < 2**32:
            raise CompilationError(f"{what} must fit in 32 bits (a u32 count, or a negative "
                                   f"i32), got {value}")
        if value >= 2**31:
            value -= 2**32      # a u32 count: the i32 of the same bits
    s = as_scalar(value)
    if s.kind != "int":
        raise CompilationError(f"{what} must be an int, got {value!r}")
    return s


@builtin
@builds("signal")
def signal(flags, idx, value=1, *, scope="sys", mode="add"):
    """Release `value` into the flag `flags[idx]` (element coordinates): add it
    (mode="add", red.release) or store it (mode="set", st.release), at
    `scope`. Every thread that runs it signals: run it on one thread."""
    _flags(flags, "tk.signal")
    if mode not in _MODES:
        raise CompilationError(f"tk.signal: mode must be 'add' or 'set', got {mode!r}")
    emit("signal", [flags, _int(value, "tk.signal's value"),
                    *_flag_index(flags, idx, "tk.signal")],
         scope=_scope(scope), mode=mode)


# How long tk.wait_signal waits before it traps, by default: long enough for a
# rank that compiles or loads while the others wait (a trap ends the process's
# CUDA context), short of hanging for good.
DEFAULT_TIMEOUT_MS = 60_000


@builtin
@builds("wait_signal")
def wait_signal(flags, idx, expected, *, scope="sys", timeout_ms=DEFAULT_TIMEOUT_MS):
    """Spin until the flag `flags[idx]` reaches `expected` (acquire at
    `scope`; (flag - expected) as a signed 32-bit difference, so counters
    may wrap); after `timeout_ms` milliseconds print where and trap."""
    _flags(flags, "tk.wait_signal")
    timeout_ms = compile_time_int(timeout_ms, "tk.wait_signal's timeout_ms", 1, 3_600_000)
    emit("wait_signal", [flags, _int(expected, "tk.wait_signal's expected"),
                         *_flag_index(flags, idx, "tk.wait_signal")],
         scope=_scope(scope), timeout_ms=timeout_ms)


@builtin
@builds("fence")
def fence(scope="sys", *, async_proxy=False):
    """fence.acq_rel at `scope`: this thread's earlier memory operations
    (TMA writes completed by tk.tma.store_wait(0, read=False) among them) are
    ordered before its later ones, e.g. a tk.signal. async_proxy=True also
    orders them across proxies (fence.proxy.async.global): its TMA writes
    with a later signal, or a flag it acquired with its later TMA writes."""
    if not isinstance(async_proxy, bool):
        raise CompilationError(f"tk.fence: async_proxy must be True or False, got "
                               f"{async_proxy!r}")
    emit("fence", scope=_scope(scope), async_proxy=async_proxy)
