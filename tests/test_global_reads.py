"""global_reads.py: what a kernel's code read from outside it while it was
compiled, and the test that it has not changed before that code runs again.
A kernel never runs code compiled for an old value of a global it reads.

- What is read is what the frontend resolved, not a guess from the names in
  the source: a user module's attribute (`cfgmod.SCALE`), a class attribute
  (`Cfg.SCALE`), a global read by a plain helper called at compile time
  (`helper()` returning `BLOCK`), a global of an inlined @tk.func, of an
  autotuned kernel, and a tk.func passed as a constexpr (by its code): a new
  value compiles new code, in memory and from the disk cache in a new
  process, where each set of reads finds its code.
- A name the kernel assigns (`i = tk.block_id(0)`, `x = tk.load(...)`) or
  takes as a parameter, a decorator and an annotation are not reads,
  however a notebook's globals are named: changing them recompiles nothing.
  A global tensor is read by its kind (type, shape, dtype), never by its
  contents, and never kept alive by the kernel.
- A read is checked by identity, then by value (an equal new value reuses
  the code); the in-memory cache, the autotuner's key and the launch plans
  check the reads before running the code.
- Values a notebook re-binds are each read by what they are: a numpy scalar
  by value, a class or a closure made again in a cell as a new object (what
  was read through the old one is not taken for the new one's), a tk.func's
  defaults, an attribute-style dict that raises KeyError for unknown
  attributes, an attribute of a constexpr object or of a dict's item
  changed in place, what helpers and methods read through attributes, an
  installed package's constant, and a list of tensors by its tensors' kinds.

On the GPU: test_global_reads_gpu.py.
"""
import gc
import importlib
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import types
import weakref

import numpy as np
import pytest

import tk_mlir as tk
from tk_mlir import compiler, f32

S = tk.spec((16, 16), "f32")


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TK_MLIR_ALWAYS_COMPILE", raising=False)


KERNELS = """\
import tk_mlir as tk
from tk_mlir import f32
import {cfg}


class Cfg:
    SCALE = {value}


BLOCK = {value}


def helper():
    return BLOCK


@tk.func
def act(x):
    return x * {value}


@tk.kernel(num_warps=4)
def k_mod(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 16))
    tk.store(Y, x * {cfg}.SCALE, (0, 0))


@tk.kernel(num_warps=4)
def k_cls(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 16))
    tk.store(Y, x * Cfg.SCALE, (0, 0))


@tk.kernel(num_warps=4)
def k_fn(X: tk.gl[f32], Y: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 16))
    tk.store(Y, x * helper(), (0, 0))


@tk.kernel(num_warps=4)
def k_act(X: tk.gl[f32], Y: tk.gl[f32], ACT: tk.constexpr):
    x = tk.load(X, (0, 0), (16, 16))
    tk.store(Y, ACT(x), (0, 0))
"""

CHILD = """\
import json, sys
sys.path.insert(0, sys.argv[1])
from tk_mlir import compiler
import tk_mlir as tk
compiled = []
real = compiler.compile_specialization
def spy(spec, *args):
    compiled.append(spec.name)
    return real(spec, *args)
compiler.compile_specialization = spy
import {kern} as m
s = tk.spec((16, 16), "f32")
ptx = {{"k_mod": m.k_mod.compile(s, s).asm["ptx"], "k_cls": m.k_cls.compile(s, s).asm["ptx"],
       "k_fn": m.k_fn.compile(s, s).asm["ptx"], "k_act": m.k_act.compile(s, s, ACT=m.act).asm["ptx"]}}
print(json.dumps({{"ptx": ptx, "compiled": compiled}}))
"""


def constants(ptx: str) -> set[float]:
    """The f32 immediates of a PTX listing, but 0."""
    return {struct.unpack(">f", bytes.fromhex(h))[0]
            for h in re.findall(r"0f([0-9A-F]{8})", ptx)} - {0.0}


_n = [0]


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    """Writes the kernel module and its config module under new names;
    returns (write(value), import())."""
    _n[0] += 1
    cfg, kern = f"gr_cfg_{os.getpid()}_{_n[0]}", f"gr_kern_{os.getpid()}_{_n[0]}"
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(value: float):
        (tmp_path / f"{cfg}.py").write_text(f"SCALE = {value}\n")
        (tmp_path / f"{kern}.py").write_text(KERNELS.format(cfg=cfg, value=value))
        (tmp_path / "child.py").write_text(CHILD.format(kern=kern))
        importlib.invalidate_caches()

    def load():
        for name in (cfg, kern):
            sys.modules.pop(name, None)
        return importlib.import_module(kern), importlib.import_module(cfg)

    yield write, load, tmp_path
    for name in (cfg, kern):
        sys.modules.pop(name, None)


def test_a_module_attribute_a_class_attribute_and_a_helpers_global(kernels):
    write, load, _ = kernels
    write(2.5)
    m, cfgmod = load()
    for k, change in [(m.k_mod, lambda v: setattr(cfgmod, "SCALE", v)),
                      (m.k_cls, lambda v: setattr(m.Cfg, "SCALE", v)),
                      (m.k_fn, lambda v: setattr(m, "BLOCK", v))]:
        before = k.compile(S, S)
        assert constants(before.asm["ptx"]) == {2.5}, k
        change(3.5)
        assert constants(k.compile(S, S).asm["ptx"]) == {3.5}, k
        change(2.5)
        assert k.compile(S, S) is before         # the earlier code, still in memory


def test_a_tk_func_constexpr_redefined(kernels):
    """A notebook cell re-run with a new body: a new tk.func, new code (in
    memory, and on disk: its key is its code, not its repr)."""
    write, load, _ = kernels
    write(2.5)
    m, _ = load()
    assert constants(m.k_act.compile(S, S, ACT=m.act).asm["ptx"]) == {2.5}
    write(3.5)
    m, _ = load()            # the same names, a new body
    assert constants(m.k_act.compile(S, S, ACT=m.act).asm["ptx"]) == {3.5}


def test_a_new_process_reads_the_new_values_from_the_disk_cache(kernels):
    write, _, tmp_path = kernels

    def child():
        proc = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path)],
                              capture_output=True, text=True, timeout=300,
                              env=dict(os.environ), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        return {k: constants(p) for k, p in out["ptx"].items()}, out["compiled"]

    write(2.5)
    first, compiled = child()
    assert all(c == {2.5} for c in first.values()) and len(compiled) == 4
    write(3.5)               # the files edited between two processes
    second, compiled = child()
    assert second == {k: {3.5} for k in first}, second
    assert sorted(compiled) == ["k_act", "k_cls", "k_fn", "k_mod"]
    write(2.5)
    third, compiled = child()
    assert third == first and compiled == []      # all from the disk cache


# ------------------------------------------------ locals are not reads

i = 0
x = None


@tk.kernel(num_warps=4)
def softmax(X: tk.gl[f32], Y: tk.gl[f32], ROWS: tk.constexpr, N: tk.constexpr):
    i = tk.block_id(0)
    x = tk.load(X, (i, 0), (ROWS, N), fill=float("-inf"))
    e = x.sub_row(x.row_max()).exp()
    tk.store(Y, e.div_row(e.row_sum()), (i, 0))


def test_a_loop_variable_named_like_a_local_recompiles_nothing(compiles):
    global i
    s = tk.spec((1000, 512), "f32")
    first = softmax.compile(s, s, ROWS=4, N=512)
    for i in range(3):
        assert softmax.compile(s, s, ROWS=4, N=512) is first
    assert compiles == ["softmax"]
    (reads, _), = softmax._compiled[next(iter(softmax._compiled))]
    assert [r.name for r in reads if not r.absent] == ["tk"]     # (and builtins: float)


def test_a_global_tensor_named_like_a_local_recompiles_nothing_and_dies(compiles):
    global x
    torch = pytest.importorskip("torch")
    codes = set()
    for M in (1024, 2048, 4096):       # a notebook's size sweep, global x and y
        x = torch.randn(M, 512)
        y = torch.empty_like(x)
        codes.add(id(softmax.compile(x, y, ROWS=4, N=512)))
    assert len(codes) == 1 and len(compiles) <= 1    # (the test above may have compiled it)
    alive = weakref.ref(x)
    x = y = None
    gc.collect()
    assert alive() is None             # the kernel does not keep the user's tensor


def test_a_module_attribute_is_a_read_of_the_modules_dict():
    """A module's identity alone says nothing of its attributes."""
    from tk_mlir.global_reads import Recorder
    mod = type(sys)("gr_some_module")
    mod.__file__ = "/nowhere/gr_some_module.py"
    mod.SCALE = 1.0
    rec = Recorder()
    rec.attribute(mod, "SCALE", 1.0)
    (read,) = rec.reads
    assert read.scope is vars(mod) and read.fresh()
    mod.SCALE = 2.0
    assert not read.fresh()


def test_a_plain_helpers_globals_and_closure_are_followed():
    from tk_mlir.global_reads import Recorder
    ns = {"__name__": "gr_ns"}
    exec(textwrap.dedent("""
        BLOCK = 64
        def inner():
            return BLOCK * 2
        def make(k):
            def helper():
                return inner() + k
            return helper
    """), ns)
    helper = ns["make"](3)
    rec = Recorder()
    rec.called(helper)
    reads = {r.name: r for r in rec.reads}
    assert {"inner", "BLOCK", "k"} <= set(reads)
    assert all(r.fresh() for r in rec.reads)
    ns["BLOCK"] = 128
    assert not reads["BLOCK"].fresh() and reads["k"].fresh()


BRANCHY = """\
import tk_mlir as tk
from tk_mlir import f32

USE_A = {use_a}
A = 2.5
B = 3.5


@tk.kernel(num_warps=4)
def k(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * (A if USE_A else B), (0, 0))
"""


def test_read_sets_that_depend_on_values_each_find_their_code_on_disk(tmp_path, compiles):
    """USE_A picks which global is read: two read sets for one kernel, each
    published; a new kernel object (a new process's) finds the code for
    either without compiling."""
    import importlib.util

    def load(use_a: bool):
        path = tmp_path / f"branchy_{use_a}.py"
        path.write_text(BRANCHY.format(use_a=use_a))
        # (one file name for both: the same source at the same place)
        (tmp_path / "branchy.py").write_text(path.read_text())
        spec = importlib.util.spec_from_file_location(f"branchy_{len(compiles)}_{use_a}",
                                                      tmp_path / "branchy.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    assert constants(load(True).k.compile(S, S).asm["ptx"]) == {2.5}
    m = load(False)
    assert constants(m.k.compile(S, S).asm["ptx"]) == {3.5}
    assert {r.name for r in m.k._compiled[next(iter(m.k._compiled))][0][0]} >= {"USE_A", "B"}
    assert len(compiles) == 2
    for use_a, value in ((True, 2.5), (False, 3.5), (True, 2.5)):
        assert constants(load(use_a).k.compile(S, S).asm["ptx"]) == {value}
    assert len(compiles) == 2                        # all from the disk
    assert len(list((tmp_path / "cache" / "reads").glob("*/*"))) == 2


class Guarded:
    SCALE = 1.5


@tk.kernel(num_warps=4)
def class_scaled(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * Guarded.SCALE, (0, 0))


def test_the_launch_plan_guards_an_attribute_read(monkeypatch):
    """The generated plan checks what the compile recorded (here a class
    attribute) through the reads' scope/name/value/volatile/fresh."""
    from tk_mlir import launcher
    from tk_mlir.compiled import CompiledKernel
    from tk_mlir.params import F32, KernelParams, Param
    reads = recorded(class_scaled, S, S)
    assert "SCALE" in [r.name for r in reads]
    params = KernelParams("k", [Param("a", F32)])
    compiled = CompiledKernel("k", b"", [(0, "f32", 0)], 4, 0, {}, "")
    calls = []
    plan = launcher.torch_plan(params, [1.5], 1, {}, {}, compiled,
                               lambda *a: calls.append(a), lambda: 0, 0, reads)
    assert plan((1,), (1.5,), {}) and len(calls) == 1
    monkeypatch.setattr(Guarded, "SCALE", 2.5)
    assert not plan((1,), (1.5,), {}) and len(calls) == 1
    monkeypatch.setattr(Guarded, "SCALE", 1.5)
    assert plan((1,), (1.5,), {}) and len(calls) == 2


@tk.kernel(num_warps=4)
def uses_a_builtin(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (max(8, 16), 16)), (0, 0))


def test_a_global_that_shadows_a_builtin_later_recompiles(monkeypatch):
    """The frontend found `max` among the builtins because no global had the
    name: a global `max` defined later is read instead."""
    before = uses_a_builtin.compile(S, S)
    monkeypatch.setitem(globals(), "max", lambda a, b: 16)
    assert uses_a_builtin.compile(S, S) is not before
    monkeypatch.delitem(globals(), "max")
    assert uses_a_builtin.compile(S, S) is before


def test_a_value_whose_repr_raises_is_read_by_identity():
    from tk_mlir.global_reads import GlobalRead

    class NoRepr:
        def __repr__(self):
            raise RuntimeError("no")
    obj = NoRepr()
    scope = {"OBJ": obj}
    read = GlobalRead(scope, "OBJ", obj)
    assert read.fresh()
    scope["OBJ"] = NoRepr()
    assert not read.fresh()


# ------------------------------- the in-memory cache, the launch plans, tk.autotune

SCALE = 2.5
HELPER_SCALE = 5.5
NAMESPACE = types.SimpleNamespace(SCALE=7.5)
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
    tk.store(Y, tk.load(X, (0, 0), (16, 64)) * NAMESPACE.SCALE, (0, 0))


@tk.autotune(configs=[tk.Config(BM=16)], key=["X"])
@tk.kernel(num_warps=4)
def tuned(X: tk.gl[f32], Y: tk.gl[f32], BM: tk.constexpr):
    tk.store(Y, tk.load(X, (0, 0), (BM, 64)) * SCALE, (0, 0))


@pytest.fixture
def restore_globals():
    global SCALE, HELPER_SCALE
    saved = SCALE, HELPER_SCALE, NAMESPACE.SCALE
    yield
    SCALE, HELPER_SCALE, NAMESPACE.SCALE = saved


def test_a_changed_global_recompiles(restore_globals):
    global SCALE
    before = scaled.compile(X, X)
    assert 2.5 in constants(before.asm["ptx"])
    SCALE = 3.5
    after = scaled.compile(X, X)
    assert after is not before
    assert 3.5 in constants(after.asm["ptx"]) and 2.5 not in constants(after.asm["ptx"])


def test_an_equal_new_value_reuses_the_code(restore_globals):
    global SCALE
    before = scaled.compile(X, X)
    SCALE = float("2.5")            # a new object, the same value
    assert scaled.compile(X, X) is before


def test_a_global_of_an_inlined_tk_func_recompiles(restore_globals):
    global HELPER_SCALE
    assert 5.5 in constants(via_helper.compile(X, X).asm["ptx"])
    HELPER_SCALE = 6.5
    assert 6.5 in constants(via_helper.compile(X, X).asm["ptx"])


def test_an_object_mutated_in_place_recompiles(restore_globals):
    assert 7.5 in constants(via_namespace.compile(X, X).asm["ptx"])
    NAMESPACE.SCALE = 8.5                 # same object, new attribute
    assert 8.5 in constants(via_namespace.compile(X, X).asm["ptx"])


@tk.func
def scaled_by_default(x, s=2.0):
    return x * s


def plain_scale(m=3.0, cfg={"m": 4.0}):         # noqa: B006 (a dict default changed in place)
    return m * cfg["m"]


@tk.kernel(num_warps=4)
def via_defaults(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, scaled_by_default(tk.load(X, (0, 0), (16, 64))) + plain_scale(), (0, 0))


def keyword_scale(*, s=3.0):
    return s


@tk.kernel(num_warps=4)
def via_keyword(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 64)) * keyword_scale(), (0, 0))


def test_a_helpers_defaults_replaced_in_place_recompile():
    """A function is one object whose code and defaults may be replaced in
    place: the launch's check sees a new defaults tuple or keyword default
    (by identity, cheaply), not an object in a default changed inside."""
    fn, plain = scaled_by_default.fn, plain_scale
    saved = fn.__defaults__, plain.__defaults__, dict(plain.__defaults__[1])
    try:
        ptx = via_defaults.compile(X, X).asm["ptx"]
        assert 2.0 in constants(ptx) and 12.0 in constants(ptx)
        fn.__defaults__ = (5.0,)
        ptx = via_defaults.compile(X, X).asm["ptx"]
        assert 5.0 in constants(ptx) and 2.0 not in constants(ptx)
        plain.__defaults__ = (10.0, plain.__defaults__[1])
        assert 40.0 in constants(via_defaults.compile(X, X).asm["ptx"])
        plain.__defaults__[1]["m"] = 0.25   # inside a default object: not looked into
        assert 40.0 in constants(via_defaults.compile(X, X).asm["ptx"])
        plain.__defaults__ = (0.5, {"m": 4.0})
        assert 2.0 in constants(via_defaults.compile(X, X).asm["ptx"])
        kw = keyword_scale.__kwdefaults__
        assert 3.0 in constants(via_keyword.compile(X, X).asm["ptx"])
        kw["s"] = 7.0                            # a keyword default replaced in its dict
        assert 7.0 in constants(via_keyword.compile(X, X).asm["ptx"])
    finally:
        fn.__defaults__, plain.__defaults__ = saved[0], saved[1]
        plain.__defaults__[1].update(saved[2])
        keyword_scale.__kwdefaults__["s"] = 3.0


@tk.func
def first_body(x):
    return x * 2.5


def second_body(x):
    return x * 3.5


@tk.kernel(num_warps=4)
def via_first_body(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, first_body(tk.load(X, (0, 0), (16, 64))), (0, 0))


def test_a_tk_funcs_code_replaced_in_place_compiles_its_new_body():
    """IPython's autoreload replaces a function's __code__: the kernel then
    inlines the new body (the tk.func's source is read again)."""
    saved = first_body.fn.__code__
    try:
        assert 2.5 in constants(via_first_body.compile(X, X).asm["ptx"])
        first_body.fn.__code__ = second_body.__code__
        ptx = via_first_body.compile(X, X).asm["ptx"]
        assert 3.5 in constants(ptx) and 2.5 not in constants(ptx)
    finally:
        first_body.fn.__code__ = saved


class RowsConfig:
    def __init__(self):
        self.r = 16

    def rows(self):
        return self.r


ROWS_CONFIG = RowsConfig()


@tk.kernel(num_warps=4)
def via_method(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (ROWS_CONFIG.rows(), 64)), (0, 0))


def test_a_bound_method_read_again_reuses_the_code(compiles):
    """Each read of ROWS_CONFIG.rows makes a new bound method: the same
    object's same function is the value read (it recompiled every call);
    what the method read still counts."""
    spec = tk.spec((32, 64), "f32")
    first = via_method.compile(spec, spec)
    assert via_method.compile(spec, spec) is first and compiles == ["via_method"]
    ROWS_CONFIG.r = 32
    try:
        assert via_method.compile(spec, spec) is not first
    finally:
        ROWS_CONFIG.r = 16


def test_an_object_global_is_keyed_by_its_contents(restore_globals):
    """The autotuner's key (Kernel._globals_key), needed before any compile."""
    before = via_namespace._globals_key()
    NAMESPACE.SCALE = 5.0
    assert via_namespace._globals_key() != before


def test_an_autotuned_kernel_recompiles(restore_globals):
    global SCALE
    assert 2.5 in constants(tuned.compile(X, X, config=0).asm["ptx"])
    SCALE = 4.5
    assert 4.5 in constants(tuned.compile(X, X, config=0).asm["ptx"])


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
    from tk_mlir.compiled import CompiledKernel
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


# ---------------------------------------------------- values a notebook re-binds

NP_SCALE = 1 / np.sqrt(16.0)         # np.float64


@tk.kernel
def k_numpy(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * NP_SCALE, (0, 0))


def test_a_numpy_scalar_is_read_by_value(monkeypatch):
    assert constants(k_numpy.compile(S, S).asm["ptx"]) == {0.25}
    monkeypatch.setitem(globals(), "NP_SCALE", 1 / np.sqrt(64.0))
    assert constants(k_numpy.compile(S, S).asm["ptx"]) == {0.125}


class Cfg:
    SCALE = 2.5


@tk.kernel
def k_class(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * Cfg.SCALE, (0, 0))


def test_a_class_made_again_with_another_attribute(monkeypatch):
    assert constants(k_class.compile(S, S).asm["ptx"]) == {2.5}
    class Cfg:                                    # the cell run again, 3.5 this time
        SCALE = 3.5
    Cfg.__qualname__ = "Cfg"                      # same text as the first one
    monkeypatch.setitem(globals(), "Cfg", Cfg)
    assert constants(k_class.compile(S, S).asm["ptx"]) == {3.5}


def make_scale(v):
    def scale():
        return v
    return scale


get_scale = make_scale(2.5)


@tk.kernel
def k_closure(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * get_scale(), (0, 0))


def test_a_closure_made_again_by_its_factory(monkeypatch):
    assert constants(k_closure.compile(S, S).asm["ptx"]) == {2.5}
    monkeypatch.setitem(globals(), "get_scale", make_scale(3.5))
    assert constants(k_closure.compile(S, S).asm["ptx"]) == {3.5}


def make_scaled(default):
    @tk.func
    def scaled(x, s=default):
        return x * s
    return scaled


scaled_func = make_scaled(2.5)


@tk.kernel
def k_func_default(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, scaled_func(tk.load(X, (0, 0), (16, 16))), (0, 0))


def test_a_tk_func_default_is_part_of_it(monkeypatch):
    assert constants(k_func_default.compile(S, S).asm["ptx"]) == {2.5}
    monkeypatch.setitem(globals(), "scaled_func", make_scaled(3.5))
    assert constants(k_func_default.compile(S, S).asm["ptx"]) == {3.5}


class AttrDict(dict):
    __getattr__ = dict.__getitem__       # KeyError, not AttributeError, for other names


CFG = AttrDict(scale=2.5)


@tk.kernel
def k_attrdict(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * CFG.scale, (0, 0))


def test_an_attribute_style_dict_is_read_not_a_crash():
    assert constants(k_attrdict.compile(S, S).asm["ptx"]) == {2.5}
    CFG["scale"] = 3.5
    try:
        assert constants(k_attrdict.compile(S, S).asm["ptx"]) == {3.5}
    finally:
        CFG["scale"] = 2.5


class Settings:
    def __init__(self, scale):
        self.scale = scale


@tk.kernel
def k_const_object(X: tk.gl[f32], Y: tk.gl[f32], C: tk.constexpr):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * C.scale, (0, 0))


def test_an_attribute_of_a_constexpr_object_changed_in_place():
    c = Settings(2.5)
    assert constants(k_const_object.compile(S, S, C=c).asm["ptx"]) == {2.5}
    c.scale = 3.5
    assert constants(k_const_object.compile(S, S, C=c).asm["ptx"]) == {3.5}


W = None


@tk.kernel
def k_list(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * float(len(W)), (0, 0))


def test_a_list_of_tensors_is_read_by_its_tensors_kinds_and_not_kept(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(globals(), "W", [torch.rand(64, 64), torch.rand(64, 64)])
    k_list.compile(S, S)
    reads, _ = k_list._entry(next(iter(k_list._compiled)))
    text = next(r.text for r in reads if r.name == "W")
    assert "shape (64, 64)" in text and "tensor([" not in text     # kinds, not contents
    old = weakref.ref(W[0])
    globals()["W"] = [torch.rand(64, 64), torch.rand(64, 64)]   # (monkeypatch keeps the old)
    gc.collect()
    assert old() is None                                           # not kept alive
    calls = []
    real = compiler.compile_specialization
    monkeypatch.setattr(compiler, "compile_specialization",
                        lambda *a: calls.append(1) or real(*a))
    k_list.compile(S, S)                                           # same kinds: no compile
    assert not calls


CONFIGS = {"gemm": Settings(2.5)}


@tk.kernel
def k_item(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * CONFIGS["gemm"].scale, (0, 0))


def test_an_attribute_of_an_item_changed_in_place():
    assert constants(k_item.compile(S, S).asm["ptx"]) == {2.5}
    CONFIGS["gemm"].scale = 3.5
    try:
        assert constants(k_item.compile(S, S).asm["ptx"]) == {3.5}
    finally:
        CONFIGS["gemm"].scale = 2.5


class Tuning:
    SCALE = 2.5

    class Inner:
        SCALE = 2.5

    @classmethod
    def scale(cls):
        return cls.SCALE


INSTANCE = Settings(2.5)


def nested_scale():
    return Tuning.Inner.SCALE


def instance_scale():
    return INSTANCE.scale


@tk.kernel
def k_classmethod(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * Tuning.scale(), (0, 0))


@tk.kernel
def k_nested(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * nested_scale(), (0, 0))


@tk.kernel
def k_instance(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * instance_scale(), (0, 0))


@pytest.mark.parametrize("kernel, owner, name", [
    (k_classmethod, lambda: Tuning, "SCALE"),
    (k_nested, lambda: Tuning.Inner, "SCALE"),
    (k_instance, lambda: INSTANCE, "scale"),
])
def test_what_helpers_and_methods_read_through_attributes(kernel, owner, name, monkeypatch):
    assert constants(kernel.compile(S, S).asm["ptx"]) == {2.5}
    monkeypatch.setattr(owner(), name, 3.5)
    assert constants(kernel.compile(S, S).asm["ptx"]) == {3.5}


def test_a_constant_of_an_installed_package_is_read(tmp_path, monkeypatch):
    import importlib
    import sys
    site = tmp_path / "lib" / "site-packages"        # where pip puts a package
    site.mkdir(parents=True)
    (site / "tk_test_installed_consts.py").write_text("SCALE = 2.5\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    consts = importlib.import_module("tk_test_installed_consts")
    try:
        monkeypatch.setitem(globals(), "installed", consts)
        assert constants(k_installed.compile(S, S).asm["ptx"]) == {2.5}
        monkeypatch.setattr(consts, "SCALE", 3.5)
        assert constants(k_installed.compile(S, S).asm["ptx"]) == {3.5}
    finally:
        sys.modules.pop("tk_test_installed_consts", None)


installed = None


@tk.kernel
def k_installed(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * installed.SCALE, (0, 0))
