"""A kernel never runs code compiled for an old value of a global it reads
(its own, a @tk.func's it inlines, through tk.autotune): the in-memory cache
and the launch plans check the globals the code read (global_reads.py)."""
import re
import types

import pytest

import tk_mlir as tk
from tk_mlir import f32

SCALE = 2.5
HELPER_SCALE = 5.5
CFG = types.SimpleNamespace(SCALE=7.5)
X = tk.spec((16, 64), "f32")


@tk.kernel(num_warps=4)
def scaled(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 64)) * SCALE, (0, 0))


@tk.func
def helper(x):
    return x * HELPER_SCALE


@tk.kernel(num_warps=4)
def via_helper(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, helper(tk.load(X, (0, 0), (16, 64))), (0, 0))


@tk.kernel(num_warps=4)
def via_namespace(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 64)) * CFG.SCALE, (0, 0))


@tk.autotune(configs=[tk.Config(BM=16)], key=["X"])
@tk.kernel(num_warps=4)
def tuned(X: tk.gl[f32], Y: tk.gl[f32], BM: tk.constexpr):
    tk.store(Y, tk.load(X, (0, 0), (BM, 64)) * SCALE, (0, 0))


def _f32_constants(ptx: str) -> set[float]:
    """The f32 immediates of a PTX listing (0fXXXXXXXX), as floats."""
    import struct
    return {struct.unpack(">f", bytes.fromhex(h))[0] for h in re.findall(r"0f([0-9A-F]{8})", ptx)}


@pytest.fixture
def restore_globals():
    global SCALE, HELPER_SCALE
    saved = SCALE, HELPER_SCALE, CFG.SCALE
    yield
    SCALE, HELPER_SCALE, CFG.SCALE = saved


def test_a_changed_global_recompiles(restore_globals):
    global SCALE
    before = scaled.compile(X, X)
    assert 2.5 in _f32_constants(before.asm["ptx"])
    SCALE = 3.5
    after = scaled.compile(X, X)
    assert after is not before
    assert 3.5 in _f32_constants(after.asm["ptx"]) and 2.5 not in _f32_constants(after.asm["ptx"])


def test_an_equal_new_value_reuses_the_code(restore_globals):
    global SCALE
    before = scaled.compile(X, X)
    SCALE = float("2.5")            # a new object, the same value
    assert scaled.compile(X, X) is before


def test_a_global_of_an_inlined_tk_func_recompiles(restore_globals):
    global HELPER_SCALE
    assert 5.5 in _f32_constants(via_helper.compile(X, X).asm["ptx"])
    HELPER_SCALE = 6.5
    assert 6.5 in _f32_constants(via_helper.compile(X, X).asm["ptx"])


def test_an_object_mutated_in_place_recompiles(restore_globals):
    assert 7.5 in _f32_constants(via_namespace.compile(X, X).asm["ptx"])
    CFG.SCALE = 8.5                 # same object, new attribute
    assert 8.5 in _f32_constants(via_namespace.compile(X, X).asm["ptx"])


def test_an_autotuned_kernel_recompiles(restore_globals):
    global SCALE
    assert 2.5 in _f32_constants(tuned.compile(X, X, config=0).asm["ptx"])
    SCALE = 4.5
    assert 4.5 in _f32_constants(tuned.compile(X, X, config=0).asm["ptx"])


def test_reads_check_by_identity_then_value(restore_globals):
    global SCALE
    (read,) = [r for r in recorded(scaled, X, X) if r.name == "SCALE"]
    assert read.fresh() and not read.volatile
    SCALE = float("2.5")
    assert read.fresh() and read.value is SCALE    # adopted: identity test next time
    SCALE = 2.75
    assert not read.fresh()
    del globals()["SCALE"]
    try:
        assert not read.fresh()
    finally:
        SCALE = 2.5


def test_the_launch_plan_guards_the_globals(restore_globals):
    """The generated plan tests each global before launching (no GPU: the
    plan is generated for a scalar-only signature with a launch function
    that records its call)."""
    from tk_mlir import launcher
    from tk_mlir.compiler import CompiledKernel
    from tk_mlir.params import F32, KernelParams, Param
    global SCALE
    params = KernelParams("k", [Param("a", F32)])
    compiled = CompiledKernel("k", b"", [(0, "f32", 0)], 4, 0, {}, "")
    reads = recorded(scaled, X, X)
    calls = []
    plan = launcher.torch_plan(params, [1.5], 1, {}, {}, compiled,
                               lambda *a: calls.append(a), lambda: 0, 0, reads)
    assert plan((1,), (1.5,), {}) and calls == [(1, 1, 1, 0, 1.5)]
    SCALE = 9.5
    assert not plan((1,), (1.5,), {}) and len(calls) == 1


BIG = None
SHAPED = None


def recorded(k, *args, **kwargs):
    """What compiling k for these arguments read from outside it."""
    from tk_mlir.runtime.arguments import describe
    values, num_warps = k.params.bind(args, kwargs)
    return k._entry(k.params.key(values, num_warps, describe))[0]


@tk.kernel(num_warps=4)
def shadowing(X: tk.gl[f32], Y: tk.gl[f32]):
    BIG = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, BIG, (0, 0))


@tk.kernel(num_warps=4)
def reads_a_shape(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, SHAPED.shape[1])), (0, 0))


def test_parameters_and_locals_are_not_reads(monkeypatch):
    """A module-level X beside a kernel taking X, or BIG beside a kernel that
    assigns its own BIG, is not a read: changing them recompiles nothing."""
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(globals(), "BIG", torch.zeros(512, 512))
    names = [r.name for r in recorded(shadowing, X, X)]
    assert "X" not in names and "Y" not in names and "BIG" not in names
    before = shadowing.compile(X, X)
    monkeypatch.setitem(globals(), "BIG", torch.zeros(64, 64))
    assert shadowing.compile(X, X) is before


def test_a_global_tensor_is_read_by_its_kind_and_not_kept_alive(monkeypatch):
    """A tensor the kernel reads (its shape) is read by its type, shape and
    dtype, checked by identity, and held weakly."""
    import gc
    import weakref
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(globals(), "SHAPED", torch.zeros(512, 64))
    (read,) = [r for r in recorded(reads_a_shape, X, X) if r.name == "SHAPED"]
    assert not read.volatile and read.text == "a torch.Tensor of shape (512, 64) f32 on cpu"
    SHAPED.fill_(1.0)                                 # contents: never part of the code
    assert read.fresh()
    monkeypatch.setitem(globals(), "SHAPED", torch.zeros(512, 64))
    assert read.fresh()                               # a new tensor of the same kind
    monkeypatch.setitem(globals(), "SHAPED", torch.zeros(64, 32))
    assert not read.fresh()
    monkeypatch.setitem(globals(), "SHAPED", torch.zeros(512, 64))
    alive = weakref.ref(SHAPED)
    reads_a_shape.compile(X, X)
    globals()["SHAPED"] = None       # (not monkeypatch: it would keep the tensor to restore)
    gc.collect()
    assert alive() is None                            # the reads held it weakly
    assert not read.fresh()


def test_decorators_and_annotations_are_not_reads():
    """Evaluated once at decoration, they cannot change the code later."""
    names = [r.name for r in recorded(scaled, X, X)]
    assert "f32" not in names and "SCALE" in names and "tk" in names
