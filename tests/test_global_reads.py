"""What a kernel reads from outside it is what the frontend resolved while
compiling it (global_reads.py), not a guess from the names in its source:

- a user module's attribute (`cfgmod.SCALE`), a class attribute
  (`Cfg.SCALE`), a global read by a plain helper called at compile time
  (`helper()` returning `BLOCK`) and a tk.func passed as a constexpr (by its
  code) are read: a new value compiles new code, in memory and from the disk
  cache in a new process;
- a name the kernel assigns (`i = tk.block_id(0)`, `x = tk.load(...)`) is not
  a read, however a notebook's globals are named: changing them recompiles
  nothing, and a global tensor is never kept alive by the kernel.
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
import weakref

import pytest

import tk_mlir as tk
from tk_mlir import compiler, f32

S = tk.spec((16, 16), "f32")

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
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TK_MLIR_ALWAYS_COMPILE", raising=False)

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


@pytest.fixture
def compiles(monkeypatch, tmp_path):
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = compiler.compile_specialization

    def spy(spec, *args):
        calls.append(spec.name)
        return real(spec, *args)
    monkeypatch.setattr(compiler, "compile_specialization", spy)
    return calls


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


class Cfg:
    SCALE = 1.5


@tk.kernel(num_warps=4)
def class_scaled(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * Cfg.SCALE, (0, 0))


def test_the_launch_plan_guards_an_attribute_read(monkeypatch):
    """The generated plan checks what the compile recorded (here a class
    attribute) through the reads' scope/name/value/volatile/fresh."""
    from tk_mlir import launcher
    from tk_mlir.compiler import CompiledKernel
    from tk_mlir.params import F32, KernelParams, Param
    from tk_mlir.runtime.arguments import describe
    values, num_warps = class_scaled.params.bind((S, S), {})
    reads, _ = class_scaled._entry(class_scaled.params.key(values, num_warps, describe))
    assert "SCALE" in [r.name for r in reads]
    params = KernelParams("k", [Param("a", F32)])
    compiled = CompiledKernel("k", b"", [(0, "f32", 0)], 4, 0, {}, "")
    calls = []
    plan = launcher.torch_plan(params, [1.5], 1, {}, {}, compiled,
                               lambda *a: calls.append(a), lambda: 0, 0, reads)
    assert plan((1,), (1.5,), {}) and len(calls) == 1
    monkeypatch.setattr(Cfg, "SCALE", 2.5)
    assert not plan((1,), (1.5,), {}) and len(calls) == 1
    monkeypatch.setattr(Cfg, "SCALE", 1.5)
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
