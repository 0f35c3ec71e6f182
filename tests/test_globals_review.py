"""Globals a notebook re-binds, each read by what it is (second review of
issue 7's recorded reads): a numpy scalar by value, a class or a closure
re-made in a cell as a new object (what was read through the old one is not
taken for the new one's), a tk.func's defaults, an attribute-style dict that
raises KeyError for unknown attributes, a constexpr object's attribute, and
a list of tensors without its tensors' contents or their lifetimes."""
import gc
import re
import struct
import weakref

import numpy as np
import pytest

import tk_mlir as tk
from tk_mlir import compiler, f32

S = tk.spec((16, 16), "f32")


def constants(ptx: str) -> set[float]:
    return {struct.unpack(">f", bytes.fromhex(h))[0]
            for h in re.findall(r"0f([0-9A-F]{8})", ptx)} - {0.0}


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TK_MLIR_ALWAYS_COMPILE", raising=False)


SCALE = 1 / np.sqrt(16.0)            # np.float64


@tk.kernel
def k_numpy(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (0, 0), (16, 16)) * SCALE, (0, 0))


def test_a_numpy_scalar_is_read_by_value(monkeypatch):
    assert constants(k_numpy.compile(S, S).asm["ptx"]) == {0.25}
    monkeypatch.setitem(globals(), "SCALE", 1 / np.sqrt(64.0))
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


scaled = make_scaled(2.5)


@tk.kernel
def k_func_default(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, scaled(tk.load(X, (0, 0), (16, 16))), (0, 0))


def test_a_tk_func_default_is_part_of_it(monkeypatch):
    assert constants(k_func_default.compile(S, S).asm["ptx"]) == {2.5}
    monkeypatch.setitem(globals(), "scaled", make_scaled(3.5))
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
