"""A compiled kernel: what one specialization became, as plain data.

`CompiledKernel` holds the cubin, the kernel's parameters (its ABI), its
launch shape (warps, dynamic shared memory, cluster), ptxas's log and every
stage's text (a StageStore: stages.py); it loads its CUDA function on the
first launch on a device. It holds no MLIR object, so it is stored whole in
the disk cache (`to_entry` / `from_entry`) and a kernel read back in a new
process launches without importing MLIR.

Compiled without ptxas (no nvidia-cuda-nvcc: macOS), it has no cubin
(`assembled` is False): its stages up to PTX read as usual, and what needs
the cubin (SASS, ptxas's numbers, launching, a disk cache entry) raises
ToolNotFound saying how to get ptxas.

Reading it: `asm`, the stage view (StageView: the stored stages, plus the
SASS listing disassembled from the cubin on first read and kept in the disk
cache under the cubin's hash), `show`, `lines`, `summary`, the notebook page.
Making one is compiler.py's.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import cache, toolchain
from .dumps import writable_folder, write_stage
from .params import PASSED_AS, AbiParam, valid_num_warps
from .ptxas_output import ptxas_info
from .stages import StageStore, short_text, tk_stage_names
from .target import TARGETS


@dataclass
class CompiledKernel:
    """One specialization of a kernel, compiled (the module's docstring).

    Invariants: `params` are AbiParams and `stages` a StageStore (plain data:
    bytecode or text, no MLIR object), whatever the constructor was given;
    `_cubin` is None exactly when ptxas was missing, and then what needs the
    cubin raises ToolNotFound (require_cubin). `_functions` holds one loaded
    CUDA function per device, loaded once, under `_lock`."""
    name: str
    _cubin: bytes | None                   # None: compiled without ptxas (see .cubin)
    params: list[AbiParam]                 # the kernel's parameters (its ABI), in order
    num_warps: int
    smem_bytes: int
    stages: StageStore                     # name -> text (MLIR stages printed when read)
    ptxas_log: str
    # Per "tmap" parameter (its index): (arg, box rows, box cols, swizzle, dtype).
    tensor_maps: list[tuple] = field(default_factory=list)
    cluster: int = 1                       # blocks per cluster along x (tk.use_cluster)
    arch: str = "sm_90a"                   # the target it was compiled for (target.TARGETS)
    _functions: dict = field(default_factory=dict, repr=False)   # device -> Function
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _values: object = field(default=None, repr=False)   # launcher.launch_values_function
    _short: dict = field(default_factory=dict, repr=False)  # tk stage -> its short form
    _source_map: object = field(default=None, repr=False)   # source_map.SourceMap
    _dumped: set = field(default_factory=set, repr=False)   # folders holding its stages

    def __post_init__(self):
        self.params = [AbiParam(*p) for p in self.params]
        if not isinstance(self.stages, StageStore):
            self.stages = StageStore(self.stages)

    @property
    def assembled(self) -> bool:
        """Whether ptxas made the cubin (False: compiled without ptxas, so
        only the stages up to PTX exist)."""
        return self._cubin is not None

    def require_cubin(self, needed_for: str) -> bytes:
        """The cubin, or ToolNotFound saying that `needed_for` needs ptxas."""
        if self._cubin is None:
            raise toolchain.ToolNotFound("ptxas", needed_for)
        return self._cubin

    @property
    def cubin(self) -> bytes:
        """The kernel assembled by ptxas (ToolNotFound when compiled without it)."""
        return self.require_cubin("the cubin (.cubin)")

    def __repr__(self) -> str:
        """One line (the stages and the cubin are in .asm / ._repr_html_)."""
        if not self.assembled:
            return (f"<CompiledKernel {self.name}: {self.num_warps} warps, "
                    f"{self.smem_bytes} bytes shared memory, {len(self.asm)} IR stages "
                    f"(PTX, not assembled: no ptxas)>")
        info = ptxas_info(self.ptxas_log)
        spills = info.get("spill stores (bytes)", 0) + info.get("spill loads (bytes)", 0)
        parts = [f"{self.num_warps} warps ({self.num_threads} threads)",
                 f"{info['registers']} registers" if "registers" in info else None,
                 f"{spills} bytes spilled" if spills else "no spills",
                 f"{self.smem_bytes} bytes shared memory",
                 f"cluster {self.cluster}" if self.cluster > 1 else None,
                 f"{len(self.asm)} IR stages (.asm)"]
        return f"<CompiledKernel {self.name}: {', '.join(p for p in parts if p)}>"

    @property
    def ctypes(self) -> tuple:
        """The driver's type of each parameter (driver.ctypes_type)."""
        from .runtime.driver import ctypes_type
        return tuple(ctypes_type(p.passed_as) for p in self.params)

    def launch_values(self, args: list, infos: dict) -> tuple:
        """The launch values for the runtime arguments `args` and their
        TensorInfos by runtime index (launcher.launch_values_function)."""
        if self._values is None:
            from .launcher import launch_values_function    # (launch code is the runtime's)
            self._values = launch_values_function(self.params, self.tensor_maps)
        return self._values(args, infos)

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def asm(self) -> StageView:
        """Every stage's text: python, tk, each pass by name, llvm, ptx, ptxas,
        sass (disassembled on first access, when nvdisasm is installed)."""
        return StageView(self)

    @property
    def info(self) -> dict:
        """What ptxas reported: registers, spills, shared memory."""
        self.require_cubin("ptxas's numbers (.info)")
        return ptxas_info(self.ptxas_log) | {"threads": self.num_threads,
                                             "dynamic shared memory (bytes)": self.smem_bytes}

    @property
    def source_map(self):
        """Python line -> its tk ops, PTX lines and SASS instructions
        (tk_mlir/source_map.py), read from the stages' line info once."""
        if self._source_map is None:
            from .source_map import SourceMap, ops_by_line, ptx_by_line, sass_by_line
            asm = self.asm
            file, ops = ops_by_line(self.stages.stored(tk_stage_names()[-1]))
            sass = sass_by_line(asm["sass"]) if "sass" in asm else None
            self._source_map = SourceMap(file, ops, ptx_by_line(asm["ptx"]), sass)
        return self._source_map

    def lines(self, line: int, file: str | None = None):
        """What Python `line` (from 1) of the kernel's file (or of `file`: a
        path or base name of a file with code, e.g. a tk.func helper's)
        became: a LineCode with its tk ops, PTX lines and SASS instructions."""
        if isinstance(line, bool) or not isinstance(line, int) or line < 1:
            raise ValueError(f"lines: line must be a line number (an int from 1), got {line!r}")
        if file is not None:
            found = self.source_map.find_file(file)
            if found is None:
                raise ValueError(f"lines: {file!r} names no single file with code of this "
                                 f"kernel (none, or several: give the path); the files with "
                                 f"code: {', '.join(self.source_map.files())}")
            file = found
        import linecache
        count = len(linecache.getlines(file or self.source_map.file))
        if count and line > count:          # (a file no longer readable: no check)
            raise ValueError(f"lines: {file or self.source_map.file} has {count} lines, not "
                             f"{line}")
        return self.source_map.line(line, file)

    def _repr_html_(self) -> str:
        from .display import stages_html
        stages = {name: self._readable(name) for name in self.asm}
        lines = self.source_map.listing_lines(stages, tk_stage_names())
        return stages_html(self.name, stages, self.summary(), lines)

    def _readable(self, stage: str, generic: bool = False) -> str:
        """A stage as people read it: the tk stages in their short form
        (asm.short), unless `generic`; every other stage as asm has it."""
        if not generic and stage in tk_stage_names():
            return self.asm.short(stage)
        return self.asm[stage]

    def show(self, stage: str, diff: bool = False, generic: bool = False):
        """The whole of one stage (the notebook display cuts long ones):
        plain text when printed, highlighted in a notebook; the tk stages in
        their short form unless `generic=True` (MLIR's re-parsable text, as
        asm[stage]). `diff=True`: what the stage's pass changed, against the
        stage before it (stage_diff.py)."""
        from .display import Listing
        for name, flag in (("diff", diff), ("generic", generic)):
            if not isinstance(flag, bool):
                raise TypeError(f"show({name}={flag!r}): {name} must be True or False")
        names = list(self.asm)
        if stage not in names:
            if stage == "sass":
                self.asm[stage]     # (raises: nvdisasm is missing, naming its package)
            raise KeyError(f"show(stage={stage!r}): stage must be one of {', '.join(names)}")
        if not diff:
            return Listing(f"{self.name}: {stage}", stage, self._readable(stage, generic))
        at = names.index(stage)
        passes = names[names.index("tk") + 1:names.index("ptx")] if "ptx" in names else []
        if stage not in passes:
            raise ValueError(f"show({stage!r}, diff=True): diff shows what a pass changed, and "
                             f"{stage!r} is not a pass's stage (the passes': "
                             f"{', '.join(passes)})")
        from .stage_diff import stage_diff
        before = names[at - 1]
        text = stage_diff(self._readable(before, generic), self._readable(stage, generic)).text()
        return Listing(f"{self.name}: {stage} against {before}", stage,
                       text or f"({stage} changed nothing)", diff=True)

    def summary(self) -> dict:
        """The facts to check first: registers, spills, shared memory, blocks
        per SM, the SASS instruction mix, ptxas warnings (summary.py);
        `print(compiled.summary_text())` for the same as text."""
        from .summary import summary
        return summary(self)

    def summary_text(self) -> str:
        from .summary import summary_text
        return summary_text(self.summary())

    def function(self, device: int | None = None):
        """The CUDA function on `device` (default: the current one), loaded
        once per device, on first launch there."""
        if self._cubin is None:
            self.require_cubin(f"launching {self.name}")
        from .runtime import driver
        driver.require_gpu(self.name)
        device = driver.default_device() if device is None else device
        f = self._functions.get(device)
        if f is None:
            with self._lock:
                f = self._functions.get(device)
                if f is None:
                    driver.require_target(device, self.name, self.arch)
                    f = driver.Module.load(self.cubin, device).function(self.name)
                    f.set_max_dynamic_shared(self.smem_bytes)
                    self._functions[device] = f
        return f

    def persistent_grid(self, device: int | None = None) -> int:
        """Blocks for a persistent grid: as many as can be resident at once
        (one per SM for a kernel using all of an SM's shared memory; for a
        cluster kernel, whole clusters only, as many as the GPCs hold)."""
        from .runtime import driver
        f = self.function(device)
        if self.cluster == 1:
            return driver.device_attribute("multiprocessor_count", f.device)
        return self.cluster * f.max_active_clusters(self.cluster, self.num_threads,
                                                    self.smem_bytes)

    def occupancy_from_driver(self) -> tuple[int | None, str]:
        """(blocks of this kernel resident per SM, as the driver computes it on
        the current GPU; that GPU's name), or (None, why the driver cannot
        say: no GPU here, a GPU that cannot run the kernel, a refused query).
        The summary falls back on the target's limits (summary.py)."""
        from .errors import CudaUnavailable
        try:
            from .runtime import driver
            gpu = driver.has_gpu()
        except CudaUnavailable:             # no cuda-bindings: no GPU to ask
            gpu = False
        if not gpu:
            return None, "no GPU here"
        try:
            function = self.function()
            blocks = function.max_active_blocks(self.num_threads, self.smem_bytes)
            name, _ = driver.device_identity(function.device)
        except (driver.UnsupportedDevice, driver.CudaError) as e:
            return None, str(e)
        return blocks, name

    def dump(self, directory: str | os.PathLike, folder_name: str | None = None,
             what: str = "the dump folder") -> Path:
        """Every stage to `directory`/`folder_name` (default: the kernel's name),
        one numbered file each; a CompilationError naming `what` (the setting
        or option) when the folder cannot be written."""
        folder = writable_folder(Path(directory) / (folder_name or self.name), what)
        for i, (stage, text) in enumerate(self.asm.items()):
            write_stage(folder, i, stage, text, what)
        self._dumped.add(folder)
        return folder

    def dump_once(self, directory: str | os.PathLike, folder_name: str,
                  what: str = "the dump folder") -> Path:
        """`dump`, unless this kernel's stages were written to that folder
        before and it is still there (kernel.compile in a loop, with
        TK_MLIR_DUMP_DIR set, writes each stage once)."""
        folder = Path(directory) / folder_name
        if folder in self._dumped and folder.is_dir():
            return folder
        return self.dump(directory, folder_name, what)

    def dumped_to(self, folder: Path) -> None:
        """Record that the compiler wrote this kernel's stages to `folder`."""
        self._dumped.add(folder)

    # ---- disk cache entries

    def to_entry(self, kernel: dict | None = None) -> dict:
        """The disk cache's form of this kernel: cubin, meta.json, stages.json.
        `kernel` (Specialization.identity) names the kernel it holds, checked
        again by from_entry."""
        cubin = self.require_cubin("a disk cache entry")   # (compile_cached stores no other)
        meta = {"name": self.name, "params": self.params, "num_warps": self.num_warps,
                "smem_bytes": self.smem_bytes, "ptxas_log": self.ptxas_log,
                "tensor_maps": self.tensor_maps, "cluster": self.cluster, "arch": self.arch,
                "kernel": kernel}
        return {"cubin": cubin, "meta.json": json.dumps(meta),
                "stages.json": json.dumps(self.stages.to_json())}

    @classmethod
    def from_entry(cls, entry: dict, kernel: dict | None = None,
                   arch: str | None = None) -> CompiledKernel:
        """The kernel to_entry stored, or cache.DamagedEntry: a part missing,
        malformed or of the wrong type, or (`kernel` given) an entry that holds
        another kernel than `kernel` (its identity, or a cubin entry point of
        another name), or (`arch` given) code for another target."""
        try:
            return cls(**_decode_entry(entry, kernel, arch))
        except cache.DamagedEntry:
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise cache.DamagedEntry(f"cannot decode it: {type(e).__name__}: {e}") from None


def _decode_entry(entry: dict, kernel: dict | None, arch: str | None = None) -> dict:
    """CompiledKernel's fields from a disk cache entry, each checked for the
    type a launch relies on (a wrong one would fail far from here)."""
    meta = json.loads(entry["meta.json"])
    _require(isinstance(meta, dict), "meta.json is not an object")
    if kernel is not None and meta.get("kernel") != kernel:
        raise cache.DamagedEntry(f"it holds kernel {meta.get('kernel')!r}, not {kernel!r}")
    cubin = entry["cubin"]
    _require(isinstance(cubin, bytes) and bool(cubin), "the cubin is empty or not bytes")
    for name, kind in (("name", str), ("num_warps", int), ("smem_bytes", int),
                       ("ptxas_log", str), ("cluster", int), ("params", list),
                       ("tensor_maps", list)):
        _require(type(meta[name]) is kind, f"meta.json's {name} is not {kind.__name__}")
    _require(valid_num_warps(meta["num_warps"]) and meta["smem_bytes"] >= 0
             and meta["cluster"] >= 1, "meta.json's numbers are out of range")
    if kernel is not None:
        from .source import ptx_symbol
        _require(meta["name"] == ptx_symbol(kernel["name"]), f"meta.json names entry point "
                 f"{meta['name']!r}, not the kernel's {ptx_symbol(kernel['name'])!r}")
    stored = meta.get("arch", "sm_90a")    # (entries from before there were two targets)
    _require(stored in TARGETS, "meta.json's arch is not a target")
    _require(arch is None or stored == arch, f"it holds code for {stored}, not {arch}")
    arch = stored
    params = [AbiParam(*p) for p in meta["params"]]
    _require(all(type(p.arg) is int and p.kind in PASSED_AS and type(p.index) is int
                 for p in params), "meta.json's params are malformed")
    maps = [tuple(t) for t in meta["tensor_maps"]]
    _require(all(len(t) == 5 and all(type(x) is int for x in t[:4]) and type(t[4]) is str
                 for t in maps), "meta.json's tensor_maps are malformed")
    return dict(name=meta["name"], _cubin=cubin, params=params, num_warps=meta["num_warps"],
                smem_bytes=meta["smem_bytes"], stages=_decode_stages(entry["stages.json"]),
                ptxas_log=meta["ptxas_log"], tensor_maps=maps, cluster=meta["cluster"],
                arch=arch)


def _decode_stages(text: str) -> StageStore:
    """stages.json as a StageStore: name -> text, or MLIR bytecode as strict
    base64 (StageStore.to_json's form)."""
    data = json.loads(text)
    _require(isinstance(data, dict), "stages.json is not an object")
    for name, value in data.items():
        if isinstance(value, dict):
            blob = value.get("mlirbc")
            _require(isinstance(blob, str), f"stage {name!r} has no bytecode")
            base64.b64decode(blob, validate=True)     # (binascii.Error: a ValueError)
        else:
            _require(isinstance(value, str), f"stage {name!r} is not text")
    return StageStore.from_json(data)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise cache.DamagedEntry(what)


# ------------------------------------------------------------ the stage view

class StageView(Mapping):
    """A compiled kernel's stages as its reader sees them (`compiled.asm`), in
    pipeline order: the kernel's StageStore, plus the SASS listing, which is
    made only when it is read (nvdisasm costs more than the whole compile) and
    is kept in the disk cache under the cubin's hash, so a kernel read warm,
    in this process or another, needs no nvdisasm run.

    Not a StageStore of its own: the store holds what the compile made, this
    view adds what is made from the cubin on demand (sass), refuses with
    ToolNotFound what needs a tool that is missing (ptxas's stages without a
    cubin, sass without nvdisasm), and gives the tk stages' short form."""

    def __init__(self, kernel: CompiledKernel):
        self._kernel = kernel

    def __getitem__(self, name: str) -> str:
        kernel = self._kernel
        stages = kernel.stages
        if name in _AFTER_PTXAS and not kernel.assembled:
            kernel.require_cubin(_AFTER_PTXAS[name])
        if name == "sass" and "sass" not in stages:
            if not _has_nvdisasm():
                raise toolchain.ToolNotFound("nvdisasm", _AFTER_PTXAS["sass"])
            stages["sass"] = _cached_sass(kernel.cubin)
        if name not in stages:
            raise KeyError(f"asm[{name!r}]: no such stage; the stages are "
                           f"{', '.join(self._names())}")
        return stages[name]

    def short(self, name: str = "tk") -> str:
        """Tk stage `name` (tk or a tk pass) in the short form for reading
        (dialects/short_form.py: one line per op, short types, the source
        line as a gutter). `asm[name]` stays the generic, re-parsable text."""
        kernel = self._kernel
        if name not in tk_stage_names():
            raise ValueError(f"asm.short({name!r}): the short form is for the tk stages "
                             f"({', '.join(tk_stage_names())}); read {name!r} as asm[{name!r}]")
        if name not in kernel._short:
            kernel._short[name] = short_text(kernel.stages.stored(name))
        return kernel._short[name]

    def __contains__(self, name) -> bool:
        # (Mapping's would read the stage, and a missing tool is an error there.)
        return name in self._names()

    def _names(self) -> list[str]:
        names = list(self._kernel.stages)
        if "sass" not in names and self._kernel.assembled and _has_nvdisasm():
            names.append("sass")
        return names

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


# The stages made from the cubin, and what reading each is called in the error
# when there is no cubin (compiled without ptxas).
_AFTER_PTXAS = {"ptxas": "reading the ptxas stage (.asm['ptxas'])",
                "sass": "reading SASS (.asm['sass'])"}


def _has_nvdisasm() -> bool:
    return toolchain.find_tool("nvdisasm") is not None


# The disk cache, for SASS listings (compiler.py keeps the kernels in it).
_DISK = cache.DiskCache()


def _cached_sass(cubin: bytes) -> str:
    """The SASS of `cubin`, from the disk cache or disassembled and stored there."""
    key = cache.make_key(kind="sass", cubin=hashlib.sha256(cubin).hexdigest(),
                         nvdisasm=toolchain.find_tool("nvdisasm"))
    entry = _DISK.get(key)
    if entry is not None:
        if isinstance(entry.get("sass"), str):
            return entry["sass"]
        _DISK.discard(key, "no SASS listing in it")
    sass = toolchain.disassemble(cubin)
    if not sass.startswith("nvdisasm failed") and not cache.always_compile():
        _DISK.put(key, {"sass": sass})
    return sass
