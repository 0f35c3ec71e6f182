"""Launch plans' shortcuts, on the CPU with the driver call stubbed
(launcher.torch_plan, as benchmarks/launch_overhead.py --plan-only builds
one): a plan skips its keyword tests only for the very dict it was told to
trust (a Kernel.launcher's), and finds its tensor maps by the tensors' key and every pointer, so a
misaligned pointer is checked even where the maps were found before. A bound plan (a
_signature_launcher's, for tensors laid out as its first call's) launches with the same values
as the full plan, reading only the tensors' addresses."""
from __future__ import annotations

import pytest
import torch

import tk_mlir as tk
from tk_mlir import launcher
from tk_mlir.runtime import tensor_maps

from test_interpreter_arguments import scale, tma_double    # (a constexpr; a tensor map)


class _Map:
    """A tensor map stand-in: the address the launch passes."""
    def __init__(self, address):
        self.address = address

    def getPtr(self):
        return self.address


@pytest.fixture
def stub_plan(monkeypatch):
    """make(kernel, args, kwargs) -> (plan, launches, checks, encoded): the
    kernel's plan for CPU tensors like args, its launches recorded, full_check
    counted and refusing misaligned pointers (what the real one does,
    besides the device), the tensor maps' encodings recorded."""
    encoded = []
    monkeypatch.setattr(tensor_maps, "encode",
                        lambda ptr, *rest: encoded.append(ptr) or _Map(1000 + len(encoded)))

    def make(kernel, args, kwargs, bound=False):
        values, warps = kernel.params.bind(args, kwargs)
        sig = kernel.params.key(values, warps, lambda v, name: tk.spec(tuple(v.shape), "f32"))
        reads, compiled = kernel._entry(sig)
        launches, checks = [], []
        plan = launcher.torch_plan(kernel.params, values, len(args), kwargs,
                                   kernel.params.tensor_rules(sig), compiled,
                                   lambda *a: launches.append(a), lambda: 0, 0, reads, bound)

        def full_check(all_values):
            checks.append(all_values)
            return not any(v.data_ptr() & 15 for v in all_values if isinstance(v, torch.Tensor))
        plan.__globals__["full_check"] = full_check
        return plan, launches, checks, encoded
    return make


def test_only_a_trusted_dict_skips_the_keyword_tests(stub_plan):
    x, y = torch.rand(32, 64), torch.rand(32, 64)
    kwargs = {"COLS": 64}
    plan, launches, _, _ = stub_plan(scale, (x, y, 2.0), kwargs)
    assert plan((2,), (x, y, 2.0), kwargs)
    assert plan((2,), (x, y, 2.0), {"COLS": 64})          # an equal dict: tested, passes
    assert not plan((2,), (x, y, 2.0), {"COLS": 32})      # another value: another plan
    assert not plan((2,), (x, y, 2.0), {"COLS": 64.0})    # another type, though 64.0 == 64
    kwargs["COLS"] = 32                                    # not trusted: still tested
    assert not plan((2,), (x, y, 2.0), kwargs)
    # Trusted (a Kernel.launcher's dict, never changed: here changed, to show
    # that the tests are skipped for that very dict and for no other).
    trusted = {"COLS": 64}
    assert launcher.trust(plan, trusted) is plan
    trusted["COLS"] = 32
    assert plan((2,), (x, y, 2.0), trusted)
    assert not plan((2,), (x, y, 2.0), {"COLS": 32})
    assert len(launches) == 3


def test_remembered_maps_hold_every_pointer(stub_plan):
    base = torch.rand(128 * 64 + 4)
    a, b = base[:128 * 64].view(128, 64), torch.rand(128, 64)
    c = torch.empty(128, 64)
    plan, launches, checks, encoded = stub_plan(tma_double, (a, c, b), {})
    assert plan((2,), (a, c, b), {}) and plan((2,), (a, c, b), {})
    assert len(encoded) == 1 and len(checks) == 1        # maps and checks made once
    assert launches[0][-1] == launches[1][-1] == 1001    # the map passed by address
    # B has no tensor map, and its pointer moves to 4 bytes past a vector:
    # the maps' lookup misses, and the check refuses it.
    shifted = base[1:128 * 64 + 1].view(128, 64)
    assert not plan((2,), (a, c, shifted), {})
    # A at a new address: a new map, encoded once and then found.
    a2 = torch.rand(128, 64)
    assert plan((2,), (a2, c, b), {}) and plan((2,), (a2, c, b), {})
    assert len(encoded) == 2 and len(launches) == 4


def test_a_bound_plan_launches_as_the_full_plan_does(stub_plan):
    base = torch.rand(128 * 64 + 4)
    a, b, c = base[:128 * 64].view(128, 64), torch.rand(128, 64), torch.empty(128, 64)
    full, launches, checks, _ = stub_plan(tma_double, (a, c, b), {})
    bound, bound_launches, bound_checks, _ = stub_plan(tma_double, (a, c, b), {}, bound=True)
    # new tensors laid out as the first call's: the same launch, but for their addresses
    a2, b2, c2 = torch.rand(128, 64), torch.rand(128, 64), torch.empty(128, 64)
    for args in ((a, c, b), (a2, c2, b2), (a2, c2, b2)):
        assert full((2,), args, {}) and bound((2,), args, {})
    assert bound_launches == launches
    assert len(bound_checks) == 0 and len(checks) == 1     # the bound plan checks nothing
    # What it reads is only the addresses (the caller's promise holds the rest):
    # `b` is never read for its shape, and the full plan turns the misaligned
    # view away where the bound one, as promised, does not look.
    shifted = base[1:128 * 64 + 1].view(128, 64)
    assert not full((2,), (a, c, shifted), {}) and bound((2,), (a, c, shifted), {})


def test_a_bound_plan_still_tests_scalars_and_constexprs(stub_plan):
    x, y = torch.rand(32, 64), torch.rand(32, 64)
    bound, launches, _, _ = stub_plan(scale, (x, y, 2.0), {"COLS": 64}, bound=True)
    assert bound((2,), (x, y, 3.0), {"COLS": 64})
    assert not bound((2,), (x, y, "3"), {"COLS": 64})     # a str for a float: the full path
    assert not bound((2,), (x, y, 3.0), {"COLS": 32})     # another constexpr: another plan
    assert [launch[-1] for launch in launches] == [3.0]


def test_a_signature_launcher_binds_its_plan_at_the_second_call(stub_plan, monkeypatch):
    made = []

    def plan(args, kwargs, bound=False):
        made.append(bound)
        return stub_plan(scale, args, kwargs, bound)[0]
    monkeypatch.setattr(scale, "_plans", [])
    monkeypatch.setattr(scale, "_plan", plan)
    x, y = torch.rand(32, 64), torch.rand(32, 64)
    run = scale._signature_launcher((2,), COLS=64)
    run(x, y, 2.0)
    assert made == [False]           # a launcher called once never makes a bound plan
    run(x, y, 2.0)
    assert made == [False, True]
    run(x, y, 2.0)
    run(torch.rand(32, 64), torch.rand(32, 64), 1.0)
    assert made == [False, True]     # its bound plan launched them
    with pytest.raises(tk.ArgumentError, match="'s' .*must be a float"):
        run(x, y, "2")               # turned away by it, then the full path names the rule
