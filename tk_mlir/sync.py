"""Synchronisation builtins: semaphores (mbarriers), named barriers, one
elected thread, and register reallocation between warpgroups.

    full = tk.semaphores(STAGES)                 # an array of mbarriers, 1 arrival each
    tk.wait(full[s], phase)                      # until the phase of parity `phase` completes
    tk.arrive(empty[s])                          # one arrival
    if tk.elect_leader():                        # one thread per warp, no serialization loop
        ...
    tk.decrease_registers(40)                    # setmaxnreg for this warpgroup
    tk.named_barrier(1, warps=8)                 # bar.sync 1, 256: wait for 8 warps
    tk.named_barrier_arrive(1, warps=8)          # bar.arrive 1, 256: count in, no wait

A semaphore's phase flips each time its arrivals (and expected TMA bytes)
complete; `tk.ring_phase(i, STAGES)` is the parity of the i-th use of slot
i % STAGES in a ring of STAGES semaphores.
"""
from __future__ import annotations

from .dialects import types as T
from .errors import CompilationError
from .language import builtin, compile_time_int
from .values import (Scalar, Semaphore, as_scalar, builds, emit, i32, int_operand,
                     scalar_binary)

__all__ = ["semaphore", "semaphores", "arrive", "wait", "wait_phase", "ring_phase", "elect_leader",
           "registers_per_thread", "increase_registers", "decrease_registers", "named_barrier", "use_cluster",
           "cluster_rank", "cluster_sync", "named_barrier_arrive"]


def _arrivals(arrivals) -> int:
    return compile_time_int(arrivals, "arrivals", 1, 2**20 - 1, "2**20-1")


@builtin
@builds('alloc_sem')
def semaphore(arrivals=1) -> Semaphore:
    """One semaphore whose phase completes after `arrivals` arrivals."""
    return Semaphore(emit("alloc_sem", [], T.Sem().to_mlir(), arrivals=_arrivals(arrivals)))


@builtin
@builds('alloc_sem')
def semaphores(count, arrivals=1) -> Semaphore:
    """An array of `count` semaphores, indexed with sems[i] (i may be a run-time value)."""
    return Semaphore(emit("alloc_sem", [], T.Sem().to_mlir(), arrivals=_arrivals(arrivals),
                          count=compile_time_int(count, "count", 1, 64)))


def _sem(s, what: str) -> Semaphore:
    if not isinstance(s, Semaphore):
        raise CompilationError(f"{what} takes a semaphore (tk.semaphore() or sems[i]), got {s!r}")
    return s


@builtin
@builds('arrive', 'arrive_remote')
def arrive(sem, cta=None) -> None:
    """One arrival on `sem` by each thread that runs it (guard it with
    tk.elect_leader() for one arrival per warp). cta=r arrives instead on the
    semaphore at the same place in block r of this block's cluster."""
    if cta is None:
        emit("arrive", [_sem(sem, "tk.arrive")])
        return
    _in_cluster("tk.arrive(..., cta=)")
    c = as_scalar(cta)
    if c.kind != "int":
        raise CompilationError(f"tk.arrive: cta must be an int (a rank in the cluster), got {cta!r}")
    emit("arrive_remote", [_sem(sem, "tk.arrive"), c])


def _in_cluster(what: str) -> int:
    from .values import current
    size = current.get().cluster
    if size == 1:
        raise CompilationError(f"{what} needs a cluster: call tk.use_cluster(n) first")
    return size


@builtin
@builds('use_cluster')
def use_cluster(size) -> None:
    """Launch this kernel in clusters of `size` blocks along x (2, 4 or 8); the
    grid's x must be a multiple of it. Call it once, at the kernel's top level."""
    from .values import current
    state = current.get()
    if size not in (1, 2, 4, 8):
        raise CompilationError(f"cluster size must be 1, 2, 4 or 8 (blocks along x), got {size!r}")
    if state.cluster != 1:
        raise CompilationError("tk.use_cluster is called once per kernel (tk.lcf calls it "
                               "with its cluster= argument: give the cluster size there)")
    if size > 1:
        emit("use_cluster", size=size)
        state.cluster = size


@builtin
@builds('cluster_rank')
def cluster_rank() -> Scalar:
    """This block's rank in its cluster (0 .. size-1)."""
    _in_cluster("tk.cluster_rank()")
    return Scalar(emit("cluster_rank", [], i32()))


@builtin
@builds('cluster_sync')
def cluster_sync() -> None:
    """Wait until every thread of every block of the cluster gets here."""
    _in_cluster("tk.cluster_sync()")
    emit("cluster_sync")


@builtin
@builds('wait')
def wait(sem, phase) -> None:
    """Wait until the phase of `sem` with parity `phase` (0 or 1) has completed."""
    p = as_scalar(phase)
    if p.kind != "int":
        raise CompilationError(f"tk.wait: phase must be an int (0 or 1), got {phase!r}")
    emit("wait", [_sem(sem, "tk.wait"), p])


@builtin
@builds('wait_phase')
def wait_phase(sem, n) -> None:
    """Wait until phase number n (0, 1, 2, ...: the n-th completion) of `sem`
    has completed. The GPU waits on n's parity, which is right only while the
    semaphore has completed phase n - 1 and not phase n + 1: the interpreter
    checks exactly that. Use it where a warp waits for phases other warps
    consumed before it (a ping-pong consumer skipping the other's stages),
    which tk.wait's check, by the phases the warp itself waited for, would
    report as a wrap-around."""
    p = int_operand(n, 0, "tk.wait_phase: the phase number must be an int >= 0 (the n-th "
                          "completion, from 0)")
    emit("wait_phase", [_sem(sem, "tk.wait_phase"), p])


@builtin
def ring_phase(i, stages):
    """The parity to wait for at the i-th use of a ring of `stages` semaphores."""
    return scalar_binary("and", scalar_binary("floordiv", i, stages), 1)


@builtin
@builds('elect')
def elect_leader(scope="warp") -> Scalar:
    """True on exactly one thread of each warp (scope="warp") or of each
    warpgroup (scope="warpgroup"), chosen with elect.sync so that work under it
    (TMA issue, arrivals) needs no serialization loop."""
    if scope not in ("warp", "warpgroup"):
        raise CompilationError(f"elect_leader scope must be 'warp' or 'warpgroup', got {scope!r}")
    return Scalar(emit("elect", [], _i1(), scope=scope))


def _i1():
    from mlir import ir
    return ir.IntegerType.get_signless(1)


def _registers(count, action: str) -> None:
    if not isinstance(count, int) or not 24 <= count <= 256 or count % 8:
        raise CompilationError(f"register count must be a compile-time multiple of 8 from 24 to "
                               f"256, got {count!r}")
    emit("set_registers", count=count, action=action)


@builtin
def registers_per_thread() -> int:
    """Registers per thread a block of this kernel starts with (a compile-time
    int): the SM's register file shared by the block's threads, as ptxas sizes
    a kernel that reallocates. tk.increase_registers / decrease_registers
    only move registers between warpgroups: an increase waits until others
    give back enough, so a split of more than this (times the warpgroups)
    waits forever."""
    from . import target
    from .values import current
    return target.current().launch_registers(32 * current.get().num_warps)


@builtin
@builds('set_registers')
def increase_registers(count) -> None:
    """setmaxnreg.inc: this warpgroup may use `count` registers per thread."""
    _registers(count, "inc")


@builtin
@builds('set_registers')
def decrease_registers(count) -> None:
    """setmaxnreg.dec: this warpgroup gives registers back, keeping `count` per thread."""
    _registers(count, "dec")


@builtin
@builds('named_barrier')
def named_barrier(id, warps) -> None:
    """bar.sync among `warps` warps on barrier `id` (1-15; the block barrier is 0).
    Every warp of the group must reach it; e.g. the consumer warpgroups of a
    warp-specialized kernel: tk.named_barrier(1, warps=8)."""
    _named_barrier("named_barrier", id, warps, "sync")


@builtin
@builds('named_barrier')
def named_barrier_arrive(id, warps) -> None:
    """bar.arrive: count this warp in on barrier `id` among `warps` warps and
    go on without waiting. The barrier completes when `warps` warps have
    arrived or synced on it, releasing those waiting in tk.named_barrier(id,
    warps); e.g. ping-pong between two consumer warpgroups (8 warps): one
    waits with tk.named_barrier(1, 8) while the other signals it with
    tk.named_barrier_arrive(1, 8). Writes before the arrival are visible to
    the waiters once it completes."""
    _named_barrier("named_barrier_arrive", id, warps, "arrive")


def _named_barrier(what: str, id, warps, mode: str) -> None:
    # warps, not threads: PTX wants a thread count that is a multiple of 32.
    compile_time_int(warps, "warps", 1, 32)
    from .values import current
    if warps > current.get().num_warps:      # it could never complete: a hang
        raise CompilationError(f"{what}(warps={warps}) waits for more warps than the kernel "
                               f"has (num_warps={current.get().num_warps})")
    if isinstance(id, int) and not 1 <= id <= 15:
        raise CompilationError(f"a named barrier id must be from 1 to 15 (0 is the block "
                               f"barrier, tk.barrier()), got {id!r}")
    s = as_scalar(id)
    if s.kind != "int":
        raise CompilationError(f"{what} id must be an int, got {id!r}")
    emit("named_barrier", [s], warps=warps, mode=mode)
