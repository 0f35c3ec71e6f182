"""The NVIDIA command-line tools tk_mlir runs (ptxas, nvdisasm, cuobjdump):
finding them, assembling PTX into a cubin, disassembling a cubin into SASS.
They are the compile's last steps, not the runtime's: none of this needs a
GPU, and nothing before PTX needs the tools: without them (macOS has no
wheels for them) a kernel still compiles to PTX, and what needs them says so
(ToolNotFound) when it is asked for.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .target import TARGET  # the default arch


class ToolchainError(RuntimeError):
    """A tool is missing or failed; `log` holds what it printed."""

    def __init__(self, message: str, log: str = ""):
        self.log = log
        super().__init__(f"{message}\n{log}".rstrip())


def _package_dirs(package: str, *parts: str) -> list[Path]:
    """`parts` under each location of `package`, found without importing it
    (importing triton, say, would cost half a second)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    roots = spec.submodule_search_locations if spec else None
    return [Path(root, *parts) for root in (roots or ())]


def find_tool(name: str) -> str | None:
    """Path of an NVIDIA tool, or None.

    Looks in the pip wheels' folder first (nvidia-cuda-nvcc & co. install into
    site-packages/nvidia/cu13/bin, the version pyproject pins), then PATH, and
    last in the ptxas that Triton bundles (the GPU machine has Triton but no
    nvcc wheel).
    """
    for folder in _package_dirs("nvidia", "cu13", "bin"):
        path = folder / name
        if os.access(path, os.X_OK):
            return str(path)
    found = shutil.which(name)
    if found:
        return found
    for folder in _package_dirs("triton", "backends", "nvidia", "bin"):
        path = folder / name
        if os.access(path, os.X_OK):
            return str(path)
    return None


# The pip package each tool comes in (pyproject.toml declares them; they may
# still be missing: no macOS wheels, or an install without dependencies).
_PACKAGES = {"ptxas": "nvidia-cuda-nvcc", "nvdisasm": "nvidia-cuda-nvdisasm",
             "cuobjdump": "nvidia-cuda-cuobjdump"}


class ToolNotFound(ToolchainError):
    """A tool that what was asked for needs is not installed; the message
    says what needed it and how to get it."""

    def __init__(self, name: str, needed_for: str):
        self.name = name
        super().__init__(f"{needed_for} needs {name} from the {_PACKAGES[name]} package, "
                         f"which is not installed: pip install {_PACKAGES[name]} (it lands in "
                         f"site-packages/nvidia/cu13/bin), or put CUDA's bin folder on PATH")


def require_tool(name: str, needed_for: str) -> str:
    """Path of a tool, or ToolNotFound saying that `needed_for` needs it."""
    path = find_tool(name)
    if path is None:
        raise ToolNotFound(name, needed_for)
    return path


def ptxas(ptx: str, arch: str = TARGET.arch, extra_args=()) -> tuple[bytes, str]:
    """Assemble PTX into a cubin for `arch`; returns (cubin, log).

    Runs with -v so the log reports registers, spills and shared memory per
    kernel. Raises ToolchainError carrying ptxas's messages on failure.
    """
    return start_ptxas(ptx, arch, extra_args).result()


class PtxasJob:
    """ptxas running in the background (a process of its own: the caller's
    Python keeps going, e.g. printing the IR stages, until result())."""

    def __init__(self, ptx: str, arch: str, extra_args=()):
        self.arch = arch
        self._tmp = tempfile.TemporaryDirectory(prefix="tk_mlir_ptxas_")
        src, self._out = Path(self._tmp.name, "kernel.ptx"), Path(self._tmp.name, "kernel.cubin")
        src.write_text(ptx)
        cmd = [require_tool("ptxas", "assembling PTX into a cubin"), f"-arch={arch}", "-v", *extra_args, str(src), "-o",
               str(self._out)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)

    def result(self) -> tuple[bytes, str]:
        """(cubin, log) once ptxas is done; ToolchainError if it failed. An
        exception while waiting (Ctrl-C) stops ptxas."""
        try:
            log = self._proc.communicate()[0].strip()
            if self._proc.returncode != 0:
                raise ToolchainError(f"ptxas failed (exit {self._proc.returncode}) assembling "
                                     f"for {self.arch}", log)
            return self._out.read_bytes(), log
        except BaseException:
            self.cancel()
            raise
        finally:
            self._tmp.cleanup()

    def cancel(self) -> None:
        """Stop ptxas (the caller will not read its result) and drop its files."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._tmp.cleanup()


def start_ptxas(ptx: str, arch: str = TARGET.arch, extra_args=()) -> PtxasJob:
    return PtxasJob(ptx, arch, extra_args)


def disassemble(cubin: bytes) -> str | None:
    """The SASS listing of `cubin` (nvdisasm -c -g: code only, with the source
    lines), nvdisasm's error text when it fails, or None without nvdisasm."""
    tool = find_tool("nvdisasm")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([tool, "-c", "-g", f.name], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else f"nvdisasm failed:\n{proc.stderr}"
