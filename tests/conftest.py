"""Shared test setup: GPU tests skip cleanly where no CUDA GPU is present,
every test compiles into a fresh, private disk cache and plans its eager
calls afresh, and the run ends with one line saying why tests were skipped."""
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
GPU_SKIP = "need a CUDA GPU (gpu marker)"
REASONS_SHOWN = 6        # the most common skip reasons, by name; the rest counted


def pytest_collection_modifyitems(config, items):
    from tk_mlir.errors import CudaUnavailable
    try:
        from tk_mlir.runtime.driver import has_gpu
    except CudaUnavailable:        # no cuda-bindings (macOS): the CPU tests still run
        def has_gpu():
            return False
    if has_gpu():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(autouse=True)
def fresh_eager_plans():
    """Each test checks and plans its eager calls afresh: a call remembered
    by an earlier test was planned under that test's patches (num_sms, a
    module's knob)."""
    eager = sys.modules.get("tk_mlir.kernels.eager")    # (not imported: nothing remembered)
    if eager is not None:
        eager.forget_all()


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ").strip() or "no reason given"


def pytest_terminal_summary(terminalreporter):
    """`skipped: 380 need a CUDA GPU (gpu marker), 20 need chromium, ...`:
    why tests skipped, most common first (`-rs` lists each test)."""
    reasons = Counter(_skip_reason(r) for r in terminalreporter.stats.get("skipped", ()))
    if not reasons:
        return
    parts = [f"{n} {reason}" for reason, n in reasons.most_common(REASONS_SHOWN)]
    rest = reasons.most_common()[REASONS_SHOWN:]
    if rest:
        parts.append(f"{sum(n for _, n in rest)} for {len(rest)} other reasons (-rs lists them)")
    terminalreporter.write_line("skipped: " + ", ".join(parts))


@pytest.fixture
def interpreted(monkeypatch):
    """The library on CPU tensors runs in the interpreter (TK_MLIR_INTERPRET=1)."""
    import tk_mlir.kernel  # noqa: F401  (the module: tk_mlir.kernel is the decorator)
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", True)


@pytest.fixture
def ptxas():
    """Skips a test that reads ptxas's output where ptxas is not installed."""
    from tk_mlir.toolchain import find_tool
    if find_tool("ptxas") is None:
        pytest.skip("ptxas not installed")


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """A disk cache of the test's own, at the returned folder (made by the
    first write): TK_MLIR_CACHE_DIR points there, the knobs that change what
    the cache holds or prints are unset, and its once-per-folder warnings
    are not given yet. The cache tests use it for every test (usefixtures)."""
    from tk_mlir import cache
    root = tmp_path / "cache"
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(root))
    for knob in ("TK_MLIR_ALWAYS_COMPILE", "TK_MLIR_DUMP_DIR", "TK_MLIR_CACHE_MAX_SIZE",
                 "TK_MLIR_PRINT_AUTOTUNING"):
        monkeypatch.delenv(knob, raising=False)
    monkeypatch.setattr(cache, "_warned", set())
    return root


@pytest.fixture
def compiles(monkeypatch):
    """The names of the specializations compiled while a test runs (a spy
    on compiler.compile_specialization): a cache hit compiles nothing."""
    from tk_mlir import compiler
    calls = []
    real = compiler.compile_specialization

    def spy(spec, *args):
        calls.append(spec.name)
        return real(spec, *args)
    monkeypatch.setattr(compiler, "compile_specialization", spy)
    return calls


@pytest.fixture(autouse=True)
def bound_launches_keep_their_layout(monkeypatch):
    """Every launcher Kernel._signature_launcher makes in a test is held to its
    promise: each call's tensors laid out as its first call's (shape,
    strides, dtype, 16-byte alignment), which a bound launch on the GPU no
    longer reads. A library path that let a tensor through in another layout
    (a gradient autograd hands over expanded, say) would launch wrong there;
    in the interpreter, it fails here. Scalars are left to the plan's own
    tests."""
    import torch
    from tk_mlir.kernel import Kernel
    real = Kernel._signature_launcher

    def held(self, grid, **constexprs):
        run, first = real(self, grid, **constexprs), []

        def launch(*args):
            layout = [(tuple(a.shape), a.stride(), a.dtype, a.data_ptr() & 15)
                      if isinstance(a, torch.Tensor) else None for a in args]
            first[:] = first or [layout]
            assert layout == first[0], \
                f"{self.__name__}: a launch bound to {first[0]} was given {layout}"
            return run(*args)
        return launch
    monkeypatch.setattr(Kernel, "_signature_launcher", held)


@pytest.fixture
def interpret(monkeypatch):
    """Library calls on CPU tensors run their kernels in the interpreter."""
    monkeypatch.setattr(sys.modules["tk_mlir.kernel"], "_INTERPRET_ALL", True)
