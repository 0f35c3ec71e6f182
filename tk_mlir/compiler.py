"""Compile one specialization of a kernel: frontend -> passes -> PTX -> cubin.

`compile_specialization` is the only place that touches MLIR; what it
produces is a CompiledKernel (compiled.py): plain data, stored in the disk
cache, so a cache hit in a new process never loads MLIR.

Without ptxas (no nvidia-cuda-nvcc: macOS) a kernel compiles to PTX and stops
there (compiled.py says what it can still do). Such a kernel is not put in
the disk cache, whose entries are whole kernels.

Here: the compile and the two-level disk lookup (`compile_cached`).
Elsewhere: the compiled kernel, its stage view and its disk cache form
(compiled.py), the stages as kept (stages.py), the specialization and its
key (specialization.py), stage dumps (dumps.py), ptxas and nvdisasm
(toolchain.py), ptxas's numbers (ptxas_output.py).
"""
from __future__ import annotations

import dataclasses
import json

from . import cache, knobs
from . import global_reads as _reads
from .compiled import CompiledKernel
from .dumps import dump_folder, write_stage
from .errors import CompilationError, InternalCompilerError
from .ptxas_output import ptxas_info
from .specialization import Specialization
from .stages import StageStore
from . import target

# ptxas keeps the PTX's .loc lines in the cubin, so the SASS shows which
# Python line each instruction came from (it changes no instruction).
PTXAS_ARGS = ("-lineinfo",)


# ------------------------------------------------------------------ compile

def compile_specialization(spec: Specialization, fn_node, globals_: dict) -> CompiledKernel:
    """Lower one specialization to a cubin (no cache involved). The user's
    mistakes are CompilationErrors at their lines; anything else that fails
    here is a bug of ours: an InternalCompilerError naming the kernel and
    the stage, chained to what was raised."""
    stage = ["setup"]     # the stage under way (_compile updates it), for an internal error
    try:
        return _compile(spec, fn_node, globals_, stage)
    except (CompilationError, InternalCompilerError, Warning):
        raise       # (a Warning: a tk-lint warning the user's filters made an error)
    except Exception as e:
        raise InternalCompilerError(f"{type(e).__name__}: {e}", spec.name, stage[0]) from e


def frontend_module(spec: Specialization, fn_node, globals_: dict):
    """(context, module): the tk IR the frontend builds for `spec`, before any
    pass (the GPU path lowers it; the interpreter runs it after the tk passes)."""
    from .frontend import FuncArg, build_kernel     # first: it imports MLIR without numpy
    from .params import expand_peers
    from mlir import ir
    from .dialects import contracts, tk as tk_dialect, types as T
    context = ir.Context()
    tk_dialect.load(context)
    with context:
        params = []
        for name, a in zip(spec.arg_names, spec.args):
            if a[0] == "pgl":         # the copies and the rank (params.expand_peers)
                gl = T.GL(a[1], tuple(a[2])).to_mlir()
                params += [FuncArg(n, kind, gl if kind == "gl" else ir.IntegerType.get_signless(32),
                                 peer_of=name) for n, kind in expand_peers(name, a[3])]
            elif a[0] == "gl":
                params.append(FuncArg(name, "gl", T.GL(a[1], tuple(a[2])).to_mlir()))
            elif a[0] == "i32":
                params.append(FuncArg(name, "i32", ir.IntegerType.get_signless(32)))
            else:
                params.append(FuncArg(name, "f32", ir.F32Type.get()))
        module = build_kernel(fn_node, spec.filename, globals_, spec.name, params,
                              dict(spec.constexprs), spec.num_warps)
        if not spec.fp_contract:
            contracts.NO_FP_CONTRACT.set(module.body.operations[0], True)
    return context, module


def _compile(spec: Specialization, fn_node, globals_: dict, stage: list) -> CompiledKernel:
    from . import mlir_import  # noqa: F401  (first: it imports MLIR without numpy)
    from .lowering.pipeline import save_for_replay
    from .toolchain import ToolchainError, find_tool, start_ptxas

    folder = dump_folder(spec)
    stages = StageStore({"python": spec.source})

    def dump(index: int, name: str, text: str) -> None:
        if folder is not None:       # (checked writable above; a full disk still fails)
            write_stage(folder, index, name, text, knobs.DUMP_DIR.name)

    def on_stage(name: str, text: str) -> None:
        # Written as we go, so a failing pass leaves what came before.
        dump(len(stages), name, text)
        stages[name] = text
    dump(0, "python", spec.source)

    lowered, smem, cluster = _lowered(spec, fn_node, globals_, stage,
                                      on_stage if folder is not None else None)
    # ptxas runs in its own process while this one keeps the stages (as
    # bytecode, printed when read: tk_mlir/stages.py). Without ptxas the
    # kernel stops at PTX (the module's docstring).
    stage[0] = "ptxas"
    job = start_ptxas(lowered.ptx, spec.arch, PTXAS_ARGS) if find_tool("ptxas") is not None \
        else None
    stage[0] = "keeping the stages"
    try:
        stages.extend(lowered.stages)   # (snapshots written as bytecode)
    except BaseException:               # (Ctrl-C, say: ptxas is not left running)
        if job is not None:
            job.cancel()
        raise
    stage[0] = "ptxas"
    try:
        cubin, log = job.result() if job is not None else (None, "")
    except ToolchainError as e:
        path = save_for_replay("ptxas", lowered.ptx, ".ptx")
        raise InternalCompilerError(f"ptxas rejected the PTX:\n{e.log}\nthe PTX is in {path}; "
                                    f"reproduce with: ptxas -arch={spec.arch} "
                                    f"{' '.join(PTXAS_ARGS)} {path}",
                                    spec.name, "ptxas") from e
    if job is not None and lowered.widened_stores and _spilled(log):
        # Lane exchanges (lowering/lane_exchange.py) cost registers where the
        # stores are; where ptxas spilled, the kernel without them may spill
        # less, and then it is the one kept (its stages replace these).
        narrow, _, _ = _lowered(spec, fn_node, globals_, stage, None, narrow_stores=True)
        stage[0] = "ptxas"
        try:
            narrow_cubin, narrow_log = start_ptxas(narrow.ptx, spec.arch, PTXAS_ARGS).result()
        except ToolchainError:          # (the kernel as first assembled stands)
            narrow_log = log
        if _spilled(narrow_log) < _spilled(log):
            lowered, cubin, log = narrow, narrow_cubin, narrow_log
            stages = StageStore({"python": spec.source})
            stages.extend(lowered.stages)
            if folder is not None:          # (the same stages in order: the files replaced)
                for index, name in enumerate(stages):
                    dump(index, name, stages[name])
    if job is not None:
        stages["ptxas"] = log
    compiled = CompiledKernel(lowered.kernel_name, cubin,
                              [(p.arg, p.kind, p.index) for p in lowered.params],
                              spec.num_warps, smem, stages, log,
                              [(t.arg, t.rows, t.cols, t.swizzle, t.dtype)
                               for t in lowered.tensor_maps], cluster, spec.arch)
    if folder is not None:
        if compiled.assembled:
            dump(len(stages) - 1, "ptxas", log)
            if "sass" in compiled.asm:          # (nvdisasm installed)
                dump(len(stages), "sass", compiled.asm["sass"])
        compiled.dumped_to(folder)
    return compiled


def _lowered(spec: Specialization, fn_node, globals_: dict, stage: list, on_stage,
             narrow_stores: bool = False):
    """(Lowered, shared memory bytes, cluster size) of the kernel; with
    narrow_stores, register tiles leave for global memory as laid out (no
    lane exchanges: contracts.NARROW_STORES)."""
    from .dialects import contracts
    from .lowering.kernel import cluster_size
    from .lowering.pipeline import lower
    stage[0] = "frontend"
    with target.compiling_for(target.named(spec.arch)):
        context, module = frontend_module(spec, fn_node, globals_)
        with context:
            func = module.body.operations[0]
            if narrow_stores:
                contracts.NARROW_STORES.set(func, True)
            stage[0] = "lowering"
            lowered = lower(module, on_stage, spec.name)
            return lowered, contracts.SMEM_BYTES.get(func), cluster_size(func)


def _spilled(log: str) -> int:
    """Bytes ptxas's -v log says it spilled (stores and loads)."""
    info = ptxas_info(log)
    return info.get("spill stores (bytes)", 0) + info.get("spill loads (bytes)", 0)


_DISK = cache.DiskCache()
_MAX_READ_SETS = 16   # read sets looked up on disk per specialization (global_reads.py)


def compile_cached(spec: Specialization, fn_node_factory, globals_: dict, constexprs: dict
                   ) -> tuple[tuple, CompiledKernel]:
    """The code for `spec` and what it read from outside the kernel: from the
    disk cache (two levels: the read sets recorded for `spec`, then the code
    for one set's current values; global_reads.py says why), or compiled,
    recording its reads, and published there."""
    disk = _DISK
    index_disk = cache.DiskCache(disk.root / "reads")     # the read sets, apart from the code
    if cache.always_compile():
        with _reads.recording(_reads.Recorder(constexprs, globals_)) as rec:
            compiled = compile_specialization(spec, fn_node_factory(), globals_)
        return tuple(rec.reads), compiled
    base = spec.cache_key()
    known = []
    for n in range(_MAX_READ_SETS):
        index_key = _index_key(base, n)
        described = _read_set(index_disk, index_key)
        if described is None:
            break
        known.append(described)
        reads = _reads.resolve(described, constexprs, globals_)
        if reads is None:
            continue
        full = dataclasses.replace(spec, globals_key=_reads.key_text(reads))
        compiled = _load(disk, full, spec.dump_name())
        if compiled is not None:
            return reads, compiled
    with _reads.recording(_reads.Recorder(constexprs, globals_)) as rec:
        compiled = compile_specialization(spec, fn_node_factory(), globals_)
    reads = tuple(rec.reads)
    described = _reads.describe(reads)
    if described is None or not compiled.assembled:
        # Found again in no other process, or PTX only (no ptxas here): an
        # entry is a whole kernel, cubin included, to whoever reads it.
        return reads, compiled
    full = dataclasses.replace(spec, globals_key=_reads.key_text(reads))
    disk.put(full.cache_key(), compiled.to_entry(spec.identity()))
    if described not in known and disk.path(full.cache_key()).is_dir():
        text = json.dumps(described)
        for n in range(len(known), _MAX_READ_SETS):
            key = _index_key(base, n)
            index_disk.put(key, {"reads.json": text})
            stored = index_disk.get(key)
            if stored is None or stored.get("reads.json") == text:
                break                # (another set there: another process took n)
    return reads, compiled


def _index_key(base: str, n: int) -> str:
    return cache.make_key(kind="tk-kernel-reads", base=base, n=n)


def _read_set(index_disk: cache.DiskCache, key: str):
    """The read set stored under `key` (global_reads.describe's form), or None:
    none there, or a damaged one (dropped)."""
    index = index_disk.get(key)
    if index is None:
        return None
    try:
        return json.loads(index["reads.json"])
    except (KeyError, TypeError, ValueError) as e:
        index_disk.discard(key, f"reads.json: {type(e).__name__}: {e}")
        return None


def _load(disk: cache.DiskCache, spec: Specialization, dump_name: str
          ) -> CompiledKernel | None:
    """The kernel for `spec` from `disk` (dumped to `dump_name` when
    TK_MLIR_DUMP_DIR is set, as a compile would), or None: a miss, or an entry
    that is not this kernel's (dropped)."""
    key = spec.cache_key()
    entry = disk.get(key)
    if entry is None:
        return None
    try:
        compiled = CompiledKernel.from_entry(entry, spec.identity(), spec.arch)
    except cache.DamagedEntry as why:
        disk.discard(key, why)
        return None
    dump_dir = knobs.dump_dir()
    if dump_dir is not None:
        compiled.dump_once(dump_dir, dump_name, knobs.DUMP_DIR.name)
    return compiled
