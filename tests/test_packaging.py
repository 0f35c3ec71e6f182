"""The package imports whole however it is installed: a regular (non-editable)
install, run from the repository root where the source `tk_mlir/` comes
first on sys.path, must still find `tk_mlir.dialects`, `.passes`, `.lowering`
(they live beside `tk_mlir/` in the source tree), and the kernel library
`tk_mlir.kernels` ships in the install."""
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import sys, tk_mlir.dialects.tk as d, tk_mlir.passes.verify as p, "
         "tk_mlir.lowering.kernel as l\n"
         "from tk_mlir.kernels import attention, matmul, rms_norm, layer_norm\n"
         "print(d.__file__, p.__file__, l.__file__, "
         "*(sys.modules[f.__module__].__file__ for f in (matmul, rms_norm, layer_norm, attention)))")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    # Built from a copy: setuptools writes build/ beside the sources.
    source = tmp_path_factory.mktemp("source")
    for name in ("tk_mlir", "dialects", "passes", "lowering"):
        shutil.copytree(ROOT / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(source)],
                   check=True, capture_output=True)
    return target


def _import(cwd: Path, *path: Path) -> list[Path]:
    # -S: no site-packages .pth files, so no editable-install finder either;
    # the dependencies come from the site-packages directories named here.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*map(str, path), *site.getsitepackages()]))
    out = subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=cwd, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [Path(p) for p in out.stdout.split()]


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
