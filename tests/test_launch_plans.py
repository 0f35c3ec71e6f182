"""Launch plans' shortcuts, on the CPU with the driver call stubbed
(launcher.torch_plan, as benchmarks/launch_overhead.py --plan-only builds
one): a plan skips its keyword tests only for the very dict it was made
from, and finds its tensor maps by the tensors' key and every pointer, so a
misaligned pointer is checked even where the maps were found before."""
from __future__ import annotations

import pytest
import torch

import tk_mlir as tk
from tk_mlir import f32, launcher
from tk_mlir.runtime import tensor_maps


@tk.kernel(num_warps=4)
def tma_double(A: tk.gl, C: tk.gl[f32], B: tk.gl[f32], BLOCK: tk.constexpr = 64):
    """C = 2 A + B, A's 64 x BLOCK tiles in by TMA (a tensor map), B by threads."""
    a = tk.shared_tile(A.dtype, (64, BLOCK), swizzle=128)
    sem = tk.semaphore()
    i = tk.block_id(0)
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(sem, a)
        tk.tma.load_async(a, A, (i, 0), sem)
    tk.wait(sem, 0)
    x = tk.load(a, layout="row", scope="warpgroup").to(f32)
    b = tk.load(B, (i, 0), (64, BLOCK), layout="row", scope="warpgroup")
    tk.store(C, x + x + b, (i, 0))


class _Map:
    """A tensor map stand-in: the address the launch passes."""
    def __init__(self, address):
        self.address = address

    def getPtr(self):
        return self.address


@pytest.fixture
def stub_plan(monkeypatch):
    """(plan, launches, checks, kwargs): tma_double's plan for CPU tensors like
    the ones given, its launches recorded, full_check counted and refusing
    misaligned pointers (what the real one does, besides the device)."""
    encoded = []
    monkeypatch.setattr(tensor_maps, "encode",
                        lambda ptr, *rest: encoded.append(ptr) or _Map(1000 + len(encoded)))

    def make(args, kwargs):
        values, warps = tma_double.params.bind(args, kwargs)
        sig = tma_double.params.key(values, warps,
                                    lambda v, name: tk.spec(tuple(v.shape), "f32"))
        reads, compiled = tma_double._entry(sig)
        launches, checks = [], []
        plan = launcher.torch_plan(tma_double.params, values, len(args), kwargs,
                                   tma_double.params.tensor_rules(sig), compiled,
                                   lambda *a: launches.append(a), lambda: 0, 0, reads)

        def full_check(all_values):
            checks.append(all_values)
            return not any(v.data_ptr() & 15 for v in all_values if isinstance(v, torch.Tensor))
        plan.__globals__["full_check"] = full_check
        return plan, launches, checks, encoded
    return make


def test_only_the_plans_own_keywords_are_trusted(stub_plan):
    a, b, c = (torch.rand(128, 64) for _ in range(3))
    kwargs = {"BLOCK": 64}
    plan, launches, _, _ = stub_plan((a, c, b), kwargs)
    assert plan((2,), (a, c, b), kwargs)
    assert plan((2,), (a, c, b), {"BLOCK": 64})           # an equal dict: tested, passes
    assert not plan((2,), (a, c, b), {"BLOCK": 32})       # another value: another plan
    assert not plan((2,), (a, c, b), {"BLOCK": True})     # another type, though True == 1
    assert len(launches) == 2


def test_remembered_maps_hold_every_pointer(stub_plan):
    base = torch.rand(128 * 64 + 4)
    a, b = base[:128 * 64].view(128, 64), torch.rand(128, 64)
    c = torch.empty(128, 64)
    plan, launches, checks, encoded = stub_plan((a, c, b), {})
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
