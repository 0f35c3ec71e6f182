"""Shared test setup: GPU tests skip cleanly where no CUDA GPU is present, and
every test compiles into a fresh, private disk cache."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def pytest_collection_modifyitems(config, items):
    from tk_mlir.errors import CudaUnavailable
    try:
        from tk_mlir.runtime.driver import has_gpu
    except CudaUnavailable:        # no cuda-bindings (macOS): the CPU tests still run
        def has_gpu():
            return False
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
