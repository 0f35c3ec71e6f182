"""The command line: compile a kernel from a file and show its IR, no GPU
needed; read any cubin's loops; look at or empty the disk cache.

    python -m tk_mlir compile tk_mlir/kernels/norms.py::rmsnorm_kernel \\
        --arg 'bf16[256,4096]' --arg 'bf16[4096]' --arg 'bf16[256,4096]' --arg 1e-6 \\
        --const BLOCK=4096 --stage ptx
    python -m tk_mlir sass peer_kernel.cubin --loops 4
    python -m tk_mlir cache info
    python -m tk_mlir cache clean --older-than 7d

Exit status: 0 done, 1 the kernel does not compile (the message points at
its source), 2 a bad command line.
"""
from __future__ import annotations

import argparse
import ast
import html
import importlib.util
import os
import re
import sys
from pathlib import Path

from . import knobs
from .knobs import KnobError
from .cache import DiskCache
from .dtypes import ARGUMENT_DTYPES
from .errors import ArgumentError, CompilationError, _owner, debug, nearest_names
from .stages import tk_stage_names
from .dumps import writable_folder
from .kernel import Kernel
from .params import CONSTEXPR, GL, I32, PGL, BindError, Param
from .runtime.arguments import spec
from .runtime.peers import peer_spec
from .toolchain import ToolchainError

# --arg tensors: a dtype a kernel argument may hold (dtypes.py), and dims.
TENSOR_FORM = (f"DTYPE[D0,D1,...] such as bf16[4096,4096] "
               f"(DTYPE: {', '.join(ARGUMENT_DTYPES)})")
_TENSOR = re.compile(r"(\w+)\[\s*(\d+(?:\s*,\s*\d+)*)\s*\]")
_NAMED = re.compile(r"([A-Za-z_]\w*)=(.*)", re.S)


class UsageError(Exception):
    """A bad command line: reported argparse-style, exit status 2."""


class UserFileError(Exception):
    """The user's file raised while it was imported: reported as one
    `file:line: Error: message` line (the full traceback under
    TK_MLIR_DEBUG=1), exit status 1."""


def _user_file_error(e: Exception, path: Path) -> UserFileError:
    """`e`, raised while importing `path`, at the innermost line of the user's
    files (a SyntaxError at its own position)."""
    import traceback
    if isinstance(e, SyntaxError):
        return UserFileError(f"{e.filename}:{e.lineno}:{e.offset}: SyntaxError: {e.msg}")
    users = [(f.f_code.co_filename, line) for f, line in traceback.walk_tb(e.__traceback__)
             if _owner(f) == "user"]
    at = f"{users[-1][0]}:{users[-1][1]}: " if users else f"{path}: "
    return UserFileError(f"{at}{type(e).__name__}: {e} (while importing {path.name})")


# ------------------------------------------------------------ the kernel

def load_module(path: Path):
    """Import the file at `path`, with its folder on sys.path so that it can
    import its siblings. A private module name keeps it from replacing a module
    of the same name that is already imported."""
    name = "_tk_mlir_cli_" + re.sub(r"\W", "_", path.stem)
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None:
        raise UsageError(f"{path.name}: not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module              # dataclasses and pickling look it up
    sys.path.insert(0, str(path.parent))
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        if debug():
            raise                      # TK_MLIR_DEBUG=1: the full traceback
        raise _user_file_error(e, path) from e
    except SystemExit as e:             # (a script's main code, run at import)
        sys.modules.pop(name, None)
        raise UserFileError(f"{path}: exited while being imported (SystemExit({e.code!r})): "
                            f"put its script code under `if __name__ == \"__main__\":` so "
                            f"that importing it only defines its kernels") from None
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        sys.path.remove(str(path.parent))
    return module


def load_kernel(target: str) -> Kernel:
    """The kernel named by `FILE.py::KERNEL`."""
    file, sep, name = target.rpartition("::")
    if not sep:
        file, name = target, ""
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"{file}: no such file (expected FILE.py::KERNEL)")
    module = load_module(path)
    named = getattr(module, name, None) if name else None
    found = getattr(named, "kernel", named)     # @tk.autotune: the kernel it tunes
    if isinstance(found, Kernel):
        return found
    found = named           # (what the name is, for the message: a module's .kernel is not it)
    kernels = [n for n, v in vars(module).items()
               if isinstance(getattr(v, "kernel", v), Kernel)]
    if not name:
        problem = "name the kernel to compile: FILE.py::KERNEL"
    elif found is None:
        problem = f"{file} has no {name!r}"
    else:
        problem = f"{name!r} in {file} is a {type(found).__name__}, not a @tk.kernel"
    listing = f"the kernels in it are: {', '.join(kernels)}" if kernels else \
        "it defines no @tk.kernel"
    raise UsageError(f"{problem}; {listing}")


def describe_params(kernel: Kernel) -> str:
    """What the kernel takes, for messages: `k takes --arg X (bf16 tensor), ...`."""
    runtime = [kernel.params[i].describe() for i in kernel.params.runtime]
    consts = [kernel.params[i].name for i in kernel.params.constexprs]
    text = f"{kernel.__name__} takes --arg {', '.join(runtime) or '(none)'}"
    return text + (f"; --const {', '.join(consts)}" if consts else "")


# ------------------------------------------------------------- arguments

def parse_arg(text: str, param) -> object:
    """One --arg value for `param`: a tensor spec for a tk.gl parameter, a number
    for an int or float one."""
    text = text.strip()
    if param.kind == PGL:      # DTYPE[dims]xW: a peer tensor of W ranks
        tensor, _, world = text.rpartition("x")
        if not world.isdigit() or not _TENSOR.fullmatch(tensor.strip()):
            raise UsageError(f"--arg {param.name}: a tk.pgl parameter takes {TENSOR_FORM} "
                             f"followed by xW, the world size (e.g. bf16[4,8192]x2), got "
                             f"{text!r}")
        local = parse_arg(tensor, Param(param.name, GL, param.dtype))
        try:
            return peer_spec(local.shape, local.dtype, int(world))
        except ArgumentError as e:
            raise UsageError(f"--arg {param.name}: {e}") from None
    if param.kind == GL:
        m = _TENSOR.fullmatch(text)
        if not m or m[1] not in ARGUMENT_DTYPES:
            raise UsageError(f"--arg {param.name}: expected {TENSOR_FORM}, got {text!r}")
        if param.dtype and m[1] != param.dtype:
            raise UsageError(f"--arg {param.name}: the kernel annotates it tk.gl[{param.dtype}], "
                             f"got {m[1]} ({text!r})")
        return spec(tuple(int(d) for d in m[2].split(",")), m[1])
    try:
        return int(text) if param.kind == I32 else float(text)
    except ValueError:
        want = "an int such as 7" if param.kind == I32 else "a float such as 1e-6 or 0.5"
        raise UsageError(f"--arg {param.name}: expected {want}, got {text!r}") from None


def bind_args(kernel: Kernel, texts: list[str]) -> dict:
    """--arg values by parameter name: `SPEC` fills the runtime parameters in
    order, `NAME=SPEC` names one."""
    runtime = [kernel.params[i] for i in kernel.params.runtime]
    by_name = {p.name: p for p in runtime}
    values, position = {}, 0
    for text in texts:
        named = _NAMED.fullmatch(text)
        if named:
            name, text = named[1], named[2]
            if name not in by_name:
                raise UsageError(f"--arg {name}=...: no runtime parameter {name!r}"
                                 f"{_did_you_mean(name, by_name)}; "
                                 f"{describe_params(kernel)}")
        elif position < len(runtime):
            name, position = runtime[position].name, position + 1
        else:
            raise UsageError(f"too many --arg values ({text!r} is one more); "
                             f"{describe_params(kernel)}")
        if name in values:
            raise UsageError(f"--arg {name} is given twice")
        values[name] = parse_arg(text, by_name[name])
    return values


def bind_consts(kernel: Kernel, texts: list[str]) -> dict:
    """--const NAME=VALUE by name; VALUE is a Python literal, else a string."""
    names = {kernel.params[i].name for i in kernel.params.constexprs}
    consts = {}
    for text in texts:
        name, eq, raw = text.partition("=")
        name = name.strip()
        if not eq or not name:
            raise UsageError(f"--const {text!r}: expected NAME=VALUE such as BLOCK=4096")
        if name not in names:
            raise UsageError(f"--const {name}: no tk.constexpr parameter {name!r}"
                             f"{_did_you_mean(name, names)}; "
                             f"{describe_params(kernel)}")
        if name in consts:
            raise UsageError(f"--const {name} is given twice")
        try:
            consts[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            consts[name] = raw
    return consts


def _did_you_mean(name: str, names) -> str:
    close = nearest_names(name, names)
    return f" (did you mean {close[0]!r}?)" if close else ""


def bind(kernel: Kernel, args: argparse.Namespace) -> dict:
    """Every keyword argument of kernel.compile, or a UsageError (the
    binding is the kernel's own, params.KernelParams.bind)."""
    kwargs = bind_args(kernel, args.arg) | bind_consts(kernel, args.const)
    try:
        kernel.params.bind((), kwargs)
    except BindError as e:
        if not e.missing:
            raise
        missing = [("--const " if kernel.params[kernel.params.index[n]].kind == CONSTEXPR
                    else "--arg ") + n for n in e.missing]
        raise UsageError(f"missing {', '.join(missing)}; {describe_params(kernel)}") from None
    if args.num_warps is not None:
        kwargs["num_warps"] = args.num_warps
    return kwargs


# ---------------------------------------------------------------- output

def pick_stages(stages: dict[str, str], wanted: list[str]) -> list[str]:
    """Stage names for --stage values, each a name or a number from the listing."""
    names = list(stages)
    picked = []
    for w in wanted:
        if w in stages:
            picked.append(w)
        elif w.isdigit() and int(w) < len(names):
            picked.append(names[int(w)])
        else:
            raise UsageError(f"--stage {w}: no such stage; the stages are: {', '.join(names)}")
    return picked


def summary(compiled) -> str:
    """The stages listed, then the kernel's summary (compiled.summary_text():
    registers, spills, shared memory, occupancy, instruction mix, ptxas
    warnings); without ptxas it says so rather than failing: the PTX is there."""
    stages = compiled.asm
    lines = [f"{compiled.name}: {len(stages)} stages (--stage NAME or NUMBER prints one)"]
    lines += [f"  {i:02d}  {len(text.splitlines()):6d} lines  {stage}"
              for i, (stage, text) in enumerate(stages.items())]
    if not compiled.assembled:
        lines.append("not assembled: ptxas is not installed (pip install nvidia-cuda-nvcc)")
    lines.append("summary (--summary prints only this):")
    lines += [f"  {line}" for line in compiled.summary_text().splitlines()]
    return "\n".join(lines)


def html_page(title: str, fragment: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{html.escape(title)}</title>\n</head>\n<body>\n{fragment}\n</body>\n"
            f"</html>\n")


def compile_command(args: argparse.Namespace) -> int:
    kernel = load_kernel(args.target)
    for option, path in (("--dump-dir", args.dump_dir),
                         ("--html", args.html.parent if args.html else None)):
        if path is not None:      # before compiling: a bad folder costs no compile
            _usable_folder(path, option)
    if args.line is not None:
        split_line_arg(args.line)
    compiled = kernel.compile(**bind(kernel, args))
    stages = compiled.asm
    picked = pick_stages(stages, args.stage)
    # With --stage or --list-stages stdout carries only those; notes go to stderr.
    notes = sys.stderr if picked or args.list_stages else sys.stdout
    if args.dump_dir is not None:
        try:
            folder = compiled.dump(args.dump_dir, what="--dump-dir")
        except CompilationError as e:       # (checked before compiling; a full disk still fails)
            raise UsageError(e.message) from None
        print(f"dumped {len(stages)} stages to {folder}", file=notes)
    if args.html is not None:
        try:
            args.html.write_text(html_page(f"{compiled.name} (tk_mlir)", compiled._repr_html_()),
                                 encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--html {args.html}: cannot write it ({e.strerror})") from None
        print(f"wrote {args.html}", file=notes)
    if args.list_stages:
        print("\n".join(stages))
    if args.line is not None:
        print_line(compiled, picked, args.line)
        return 0
    if args.short and not any(name in tk_stage_names() for name in picked):
        raise UsageError("--short shows a tk stage in short: name one with --stage "
                         "(e.g. --stage tk --short); "
                         + (f"{', '.join(picked)} has no short form" if picked else
                            "no stage was named"))
    for name in picked:
        if len(picked) > 1:
            print(f"==> {name} <==")
        text = stage_text(stages, name, args.short)
        print(text, end="" if text.endswith("\n") else "\n")
    if args.summary:
        print(compiled.summary_text())
    elif not picked and not args.list_stages:
        print(summary(compiled))
    return 0


def stage_text(stages, name: str, short: bool) -> str:
    """A stage as --stage prints it: a tk stage in short under --short (the
    other stages have no short form and print in full)."""
    return stages.short(name) if short and name in tk_stage_names() else stages[name]


def print_line(compiled, picked: list[str], line_arg: str) -> None:
    """--line [FILE:]N: what that Python line became in each --stage (python,
    any MLIR stage, ptx, sass), or its tk ops, PTX and SASS without --stage."""
    source_map = compiled.source_map
    file, line = parse_line(line_arg, source_map)
    try:
        compiled.lines(line, file)          # (its rules: a line past the file's end)
    except ValueError as e:
        raise UsageError(f"--line {line_arg}: {e}") from None
    code = source_map.line(line, file)
    if not picked:
        print(code)
    for name in picked:
        if len(picked) > 1:
            print(f"==> {name} <==")
        print("\n".join(line_in_stage(compiled, code, name)))
    if not (code.ops or code.ptx or code.sass):
        lines = [str(c.line) for c in source_map.lines() if c.file == file]
        print(f"note: {file}:{line} became no code; the lines that did: "
              f"{', '.join(lines) or 'none'}", file=sys.stderr)


def parse_line(text: str, source_map) -> tuple[str, int]:
    """--line N (the kernel's file) or FILE:N (a file with code, by path or
    base name) -> (file, line)."""
    name, number = split_line_arg(text)
    if not name:
        return source_map.file, int(number)
    file = source_map.find_file(name)
    if file is None:
        raise UsageError(f"--line {text}: no code came from a file {name!r}; the files "
                         f"with code are: {', '.join(source_map.files())}")
    return file, int(number)


def split_line_arg(text: str) -> tuple[str, int]:
    """--line [FILE:]N -> (FILE or "", N); checked before compiling."""
    name, _, number = text.rpartition(":")
    if not number.isdigit():
        raise UsageError(f"--line {text}: expected a line number such as 42, or FILE:42")
    return name, int(number)


def line_in_stage(compiled, code, stage: str) -> list[str]:
    """What `code`'s line became in `stage`."""
    if stage == "python":
        return [code.source.rstrip("\n")]
    if stage == "ptx":
        return list(code.ptx)
    if stage == "sass":
        return list(code.sass)
    if stage in _TEXT_STAGES:
        raise UsageError(f"--line: the stage {stage!r} has no line info; --line works with "
                         f"--stage python, ptx, sass and every MLIR stage")
    from .source_map import ops_by_line     # an MLIR stage: its ops at that line
    _, ops = ops_by_line(compiled.stages.stored(stage))
    return ops.get((code.file, code.line), [])


_TEXT_STAGES = ("ptxas",)     # text that is not MLIR and has no .loc


def sass_command(args: argparse.Namespace) -> int:
    """The SASS of any cubin (ours, or a peer's: CuTe DSL keeps its own with
    CUTE_DSL_KEEP_CUBIN=1): its instruction mix and its loops that issue MMAs
    or spill, each with its opcodes by count."""
    from . import summary, toolchain
    path = args.cubin
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    data = path.read_bytes()
    if not data.startswith(b"\x7fELF"):
        raise UsageError(f"{path}: not a cubin (an ELF file, as ptxas writes it or CuTe DSL "
                         f"keeps it with CUTE_DSL_KEEP_CUBIN=1)")
    sass = toolchain.disassemble(data)
    if sass is None:
        raise UsageError("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    if sass.startswith("nvdisasm failed"):
        raise ToolchainError(f"{path}: {sass}")
    mix = summary.instruction_mix(sass)
    print(f"{path.name}: {mix['total']} SASS instructions; "
          + ", ".join(f"{op} {n}" for op, n in mix.items() if op != "total"))
    found = summary.loop_mixes(sass, args.loops, args.top)
    print("loops with MMAs or spills:" if found else "no loop issues an MMA or spills")
    print("\n".join(f"  {line}" for line in found))
    return 0


def _path_arg(text: str) -> Path:
    """A path option's value: ~ expanded; empty refused (an unset variable in a
    script, most likely; `.` names the working folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (write . for the working folder)")
    return Path(text).expanduser()


def _usable_folder(path: Path, option: str) -> None:
    """`option`'s folder must exist (--html) or be creatable (--dump-dir), and
    be writable: else a UsageError naming the option, the path and why."""
    if option == "--html" and not path.is_dir():
        why = "is a file, not a folder" if path.exists() else "does not exist"
        raise UsageError(f"{option}: the folder {str(path)!r} {why}")
    try:
        writable_folder(path, option)
    except CompilationError as e:
        raise UsageError(e.message) from None


# ----------------------------------------------------------------- cache

def _cache_folder(disk: DiskCache) -> str:
    """The cache folder as `cache` shows it: a file there is a usage error
    (nothing could be cached); a missing one is said to be (nothing cached yet)."""
    if disk.root.exists() and not disk.root.is_dir():
        raise UsageError(f"{knobs.CACHE_DIR.name}={str(disk.root)!r} is a file, not a folder: "
                         f"nothing can be cached there")
    return f"{disk.root}" + ("" if disk.root.exists() else " (missing: nothing cached yet)")


def cache_info(args: argparse.Namespace) -> int:
    """The disk cache's folder, entries, size and cap."""
    disk = DiskCache()
    cap = _knob(knobs.cache_max_size)
    folder = _cache_folder(disk)
    entries, size = disk.usage()
    rows = [("folder", f"{folder} ({knobs.CACHE_DIR.name})"),
            ("entries", str(entries)),
            ("size", human_bytes(size)),
            ("cap", f"{human_bytes(cap) if cap else 'none'} ({knobs.CACHE_MAX_SIZE.name}; "
                    f"the least recently used entries go first)")]
    print("\n".join(f"{name:<8} {value}" for name, value in rows))
    return 0


def cache_clean(args: argparse.Namespace) -> int:
    """Remove every entry of the disk cache, or those unused for --older-than."""
    older_than = parse_age(args.older_than) if args.older_than is not None else None
    disk = DiskCache()
    folder = _cache_folder(disk)
    entries, size = disk.clean(older_than)
    print(f"removed {entries} entries ({human_bytes(size)}) from {folder}")
    return 0


_AGE = re.compile(r"(\d+(?:\.\d*)?)\s*([smhdw]?)")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """--older-than AGE in seconds: a number with s, m, h, d or w (bare: seconds)."""
    m = _AGE.fullmatch(text.strip().lower())
    if not m:
        raise UsageError(f"--older-than {text}: expected an age such as 90s, 30m, 12h, 7d "
                         f"or 2w")
    return float(m[1]) * _SECONDS[m[2]]


def human_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit that keeps it at least 1."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _knob(read):
    """A knob's value, a bad one being a usage error (it names the knob)."""
    try:
        return read()
    except ValueError as e:
        raise UsageError(str(e)) from None


# ---------------------------------------------------------------- parser

def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="tk_mlir tile kernels: compile "
                                     "and inspect without a GPU.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = commands.add_parser(
        "compile", help="compile a kernel for given argument types and show its stages",
        description="Compile KERNEL from FILE.py for the given arguments and show its IR "
                    "stages (python, tk, each pass, llvm, ptx, ptxas, sass).",
        epilog=f"example: {prog} compile tk_mlir/kernels/norms.py::rmsnorm_kernel --arg "
               f"'bf16[256,4096]' --arg 'bf16[4096]' --arg 'bf16[256,4096]' --arg 1e-6 "
               f"--const BLOCK=4096 --stage ptx")
    c.add_argument("target", metavar="FILE.py::KERNEL", help="the file and the kernel in it")
    c.add_argument("--arg", action="append", default=[], metavar="SPEC",
                   help=f"one per runtime parameter, in order: a tensor {TENSOR_FORM}, or a "
                        f"scalar such as 7 or 1e-6; NAME=SPEC passes one by name")
    c.add_argument("--const", action="append", default=[], metavar="NAME=VALUE",
                   help="a tk.constexpr parameter; VALUE is a Python literal (else a string)")
    c.add_argument("--num-warps", type=int, metavar="N",
                   help="warps per block (default: the kernel's)")
    c.add_argument("--stage", action="append", default=[], metavar="NAME",
                   help="print this stage's text (a name or number from the listing; "
                        "repeatable)")
    c.add_argument("--short", action="store_true",
                   help="print the tk stages named by --stage in short (one line per op, "
                        "the Python line as a gutter) instead of MLIR's generic form")
    c.add_argument("--line", metavar="[FILE:]N",
                   help="what Python line N of the kernel's file (or of FILE) became: its tk "
                        "ops, PTX lines and SASS instructions, or only what it became in "
                        "each --stage (python, any MLIR stage, ptx, sass)")
    c.add_argument("--list-stages", action="store_true", help="print the stage names")
    c.add_argument("--summary", action="store_true",
                   help="print the kernel's summary: registers, spills, shared memory, "
                        "blocks per SM, the SASS instruction mix, ptxas warnings")
    c.add_argument("--dump-dir", type=_path_arg, metavar="DIR",
                   help="write every stage to DIR/KERNEL/NN-STAGE.*")
    c.add_argument("--html", type=_path_arg, metavar="OUT.html",
                   help="write the stages as a standalone HTML page")
    c.set_defaults(run=compile_command)

    d = commands.add_parser(
        "sass", help="the loops and instruction mix of any cubin (a peer's too)",
        description="Disassemble FILE.cubin (nvdisasm) and print its SASS instruction mix "
                    "and its innermost loops that issue MMAs or spill, each with its "
                    "opcodes by count: put a peer's kernel (CUTLASS, CuTe DSL's kept "
                    "cubins) beside `compile --summary` of ours.",
        epilog=f"example: {prog} sass flash_bwd_sm90.cubin --loops 4")
    d.add_argument("cubin", type=Path, metavar="FILE.cubin")
    d.add_argument("--loops", type=int, default=8, metavar="N", help="at most N loops (8)")
    d.add_argument("--top", type=int, default=12, metavar="K",
                   help="the K most frequent opcodes of each loop (12)")
    d.set_defaults(run=sass_command)

    k = commands.add_parser(
        "cache", help="show or empty the disk cache of compiled kernels",
        description=f"The disk cache of compiled kernels, SASS listings and autotuning "
                    f"choices: {knobs.CACHE_DIR.name} (default {knobs.CACHE_DIR.default}), "
                    f"capped at {knobs.CACHE_MAX_SIZE.name} (default "
                    f"{knobs.CACHE_MAX_SIZE.default}).")
    actions = k.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("info", help="the cache's folder, entries, size and cap").set_defaults(
        run=cache_info)
    clean = actions.add_parser("clean", help="remove every entry, or those not used lately")
    clean.add_argument("--older-than", metavar="AGE",
                       help="only entries last used more than AGE ago: 90s, 30m, 12h, 7d, 2w "
                            "(a bare number is seconds)")
    clean.set_defaults(run=cache_clean)
    return parser


def main(argv: list[str] | None = None, prog: str = "tk-mlir") -> int:
    """Run the command line; returns the exit status (argparse itself exits
    with 2 on malformed options, as usual)."""
    args = build_parser(prog).parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, ArgumentError, CompilationError, ToolchainError) if debug() else ():
        raise                          # TK_MLIR_DEBUG=1: the full traceback
    except (UsageError, ArgumentError, KnobError) as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (CompilationError, ToolchainError, UserFileError) as e:
        print(e, file=sys.stderr)
        return 1
    except BrokenPipeError:             # `... --stage ptx | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
