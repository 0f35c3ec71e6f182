"""The package imports whole however it is installed.

The wheel `pip install .` builds holds every module of the source tree:
every package under `tk_mlir/` (the interpreter, the runtime, the kernel
library, ...) and the top-level `dialects/`, `passes/`, `lowering/` as
`tk_mlir.dialects`, `.passes`, `.lowering`; each module imports from the
unpacked wheel alone. A regular (non-editable) install run from the
repository root, where the source `tk_mlir/` comes first on sys.path, still
finds `tk_mlir.dialects`, `.passes`, `.lowering` (they live beside `tk_mlir/`
in the source tree)."""
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("tk_mlir", "dialects", "passes", "lowering")
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")
PROBE = ("import sys, tk_mlir.dialects.tk as d, tk_mlir.passes.verify as p, "
         "tk_mlir.lowering.kernel as l\n"
         "from tk_mlir.kernels import attention, matmul, rms_norm, layer_norm\n"
         "print(d.__file__, p.__file__, l.__file__, "
         "*(sys.modules[f.__module__].__file__ for f in (matmul, rms_norm, layer_norm, attention)))")
# Imports every module found under the installed tk_mlir, one line per module.
WALK = """\
import importlib, pkgutil, tk_mlir
def fail(name):
    raise ImportError(f"walking {name}")
print("tk_mlir", tk_mlir.__file__)
for m in pkgutil.walk_packages(tk_mlir.__path__, "tk_mlir.", onerror=fail):
    print(m.name, importlib.import_module(m.name).__file__)
"""


def _source_modules() -> set[str]:
    """Every module the source tree has, by the name it installs under."""
    names = set()
    for top in SOURCES:
        package = "tk_mlir" if top == "tk_mlir" else f"tk_mlir.{top}"
        for f in (ROOT / top).rglob("*.py"):
            if "__pycache__" in f.parts:
                continue
            parts = f.relative_to(ROOT / top).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.add(".".join((package, *parts)))
    return names


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel of the source tree, unpacked: what `pip install .` lays down."""
    pytest.importorskip("setuptools")
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        shutil.copytree(ROOT / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in BUILD_FILES:
        shutil.copy(ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(dist), str(source)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("tk_mlir-*.whl")
    target = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    return target


def _run(code: str, cwd: Path, *path: Path) -> str:
    # -S: no site-packages .pth files, so no editable-install finder either;
    # the dependencies come from the site-packages directories named here.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*map(str, path), *site.getsitepackages()]))
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _import(cwd: Path, *path: Path) -> list[Path]:
    return [Path(p) for p in _run(PROBE, cwd, *path).split()]


def test_the_wheel_holds_every_module_of_the_source_tree(installed):
    in_wheel = {".".join(f.relative_to(installed).with_suffix("").parts).removesuffix(".__init__")
                for f in installed.rglob("*.py")}
    assert _source_modules() - in_wheel == set()       # e.g. {'tk_mlir.interpreter', ...}
    assert in_wheel - _source_modules() == set()
    assert {"tk_mlir.interpreter", "tk_mlir.interpreter.machine", "tk_mlir.runtime.driver",
            "tk_mlir.kernels.gemm", "tk_mlir.dialects.tk", "tk_mlir.passes.verify",
            "tk_mlir.lowering.kernel"} <= in_wheel
    assert not any(p.name in ("dialects", "passes", "lowering") for p in installed.iterdir())


def test_every_module_imports_from_the_unpacked_wheel_alone(installed, tmp_path):
    lines = [l.split(" ", 1) for l in _run(WALK, tmp_path, installed).splitlines()]
    imported = {name: Path(file) for name, file in lines}
    assert set(imported) == _source_modules()
    for name, file in imported.items():
        assert installed in file.parents, f"{name} came from {file}, not the wheel"


def test_regular_install_run_from_the_repository_root(installed):
    # The source tk_mlir/ shadows the installed one; its siblings come from
    # the same source tree, never half from each.
    for f in _import(ROOT, ROOT, installed):
        assert ROOT in f.parents and installed not in f.parents


def test_regular_install_run_elsewhere(installed, tmp_path):
    files = _import(tmp_path, installed)
    for f in files:
        assert installed in f.parents
    assert {f.relative_to(installed).as_posix() for f in files[3:]} == {
        "tk_mlir/kernels/gemm.py", "tk_mlir/kernels/norms.py",
        "tk_mlir/kernels/flash_attention.py"}
