"""The op registry: every tk op is declared once (dialects/tk.py) and has a
builtin that builds it, a tile rule and a lowering under its name; passes
read traits, not op names."""
from __future__ import annotations

import inspect
import pathlib
import re

import pytest

import tk_mlir
from tk_mlir import mma, ops, signals, sync, tensor_memory, tma, values
from tk_mlir.dialects import contracts, tk
from tk_mlir.lowering import kernel  # noqa: F401  (registers the lowerings)
from tk_mlir.lowering.context import LOWERINGS
from tk_mlir.dialects.tile_rules import RULES

BUILTIN_MODULES = (ops, sync, mma, tensor_memory, tma, values, signals)


def _marked_builtins() -> dict[str, list[str]]:
    """op name -> the builtins (functions or value-class methods) marked as building it."""
    found: dict[str, list[str]] = {}
    for module in BUILTIN_MODULES:
        for name, obj in vars(module).items():
            members = vars(obj).items() if inspect.isclass(obj) and \
                obj.__module__ == module.__name__ else [(name, obj)]
            for member_name, fn in members:
                for op in getattr(fn, "tk_ops", ()):
                    found.setdefault(op, []).append(f"{module.__name__}.{member_name}")
    return found


def test_every_op_has_a_builtin_a_rule_and_a_lowering():
    builtins = _marked_builtins()
    names = [d.name for d in tk.OPS]
    assert len(names) == len(set(names))
    missing = {
        "builtin": [n for n in names if n not in builtins],
        "verify rule": [n for n in names if n not in RULES],
        "lowering": [n for n in names if f"tk.{n}" not in LOWERINGS],
    }
    assert missing == {"builtin": [], "verify rule": [], "lowering": []}
    # ... and nothing is registered under a name the dialect does not have.
    assert set(builtins) <= set(names)
    assert set(RULES) <= set(names)
    assert {n.removeprefix("tk.") for n in LOWERINGS} <= set(names)


def test_the_registry_check_fails_for_an_op_without_a_rule(monkeypatch):
    """The completeness test can fail: an op added to the table alone is caught."""
    extra = tk.OpDef("new_op", doc="an op with nothing else")
    monkeypatch.setattr(tk, "OPS", tk.OPS + (extra,))
    try:
        test_every_op_has_a_builtin_a_rule_and_a_lowering()
    except AssertionError as e:
        assert "new_op" in str(e)
    else:
        raise AssertionError("an op with no builtin, rule or lowering passed")


def test_passes_read_traits_not_op_names():
    """No pass names a tk op: what a pass needs to know is a trait."""
    root = pathlib.Path(tk.__file__).resolve().parents[1] / "passes"
    for path in root.glob("*.py"):
        text = path.read_text()
        names = [n for n in re.findall(r'"tk\.([a-z_]+)"', text) if n in tk.OPS_BY_NAME]
        assert not names, f"{path.name} names tk ops {names}; read a trait instead"


def test_traits_are_declared_where_the_op_is():
    d = tk.OPS_BY_NAME
    assert d["mma"].async_result and d["mma_wait"].async_wait
    assert {a.proxy for a in d["mma"].reads} == {tk.ASYNC}
    assert [a.operand for a in d["store"].writes] == ["dst"]
    assert d["tma_store"].tma == ("dst", "src") and d["tma_load"].tma == ("src", "dst")
    assert {n for n, o in d.items() if o.thread_varying} == {
        "thread_id", "lane_id", "warp_id", "warpgroup_id", "elect", "tile_index"}
    assert {n for n, o in d.items() if o.allocates} == {"alloc_st", "alloc_sv", "alloc_sem",
                                                        "alloc_tt"}
    assert {n: o.tensor_memory for n, o in d.items() if o.tensor_memory} == {
        "alloc_tt": "alloc", "free_tt": "free", "tensor_mma": "async", "mma_commit": "commit"}


# ------------------------------------------------ contracts between stages

@tk_mlir.kernel(num_warps=4)
def _hinted(X: tk_mlir.gl[tk_mlir.f32], Y: tk_mlir.gl[tk_mlir.f32]):
    tiles = tk_mlir.shared_tiles(tk_mlir.f32, (16, 64), 2)
    x = tk_mlir.load(X, (0, 0), (64, 64), cache="stream")
    tk_mlir.store(tiles[0], tk_mlir.load(X, (0, 0), (16, 64)))
    tk_mlir.store(Y, x.sub_col(x.col_sum()), (0, 0), cache="stream")


def _attributes_beyond_the_ops_own(module_text: str) -> set[str]:
    """Names of attributes on tk ops beyond their OpDef's, and tk.* attributes
    of the kernel, in a stage's text; each declared one is read back through
    its accessor (which checks its type)."""
    from mlir import ir
    ctx = ir.Context()
    tk.load(ctx)
    found = set()
    with ctx:
        module = ir.Module.parse(module_text)

        def visit(op):
            d = tk.op_def(op)
            names = list(op.attributes)      # iterating gives the names
            extra = [n for n in names if (d is not None and n not in d.attributes) or
                     (op.name == "func.func" and n.startswith("tk."))]
            for n in extra:
                found.add(n)
                if n in contracts.BY_NAME:
                    contracts.BY_NAME[n].get(op)
            return ir.WalkResult.ADVANCE
        module.operation.walk(visit)
    return found


def test_every_attribute_the_tk_passes_write_is_declared():
    from tk_mlir.kernels.gemm import gemm_kernel
    spec = tk_mlir.spec
    hinted = _hinted.compile(spec((64, 64), "f32"), spec((64, 64), "f32"))
    gemm_ = gemm_kernel.compile(spec((384, 512), "bf16"), spec((256, 512), "bf16"),
                                     spec((384, 256), "bf16"), config=0)
    seen = set()
    for compiled in (hinted, gemm_):
        seen |= _attributes_beyond_the_ops_own(compiled.asm["tk-proxy-fences"])
    assert seen <= set(contracts.BY_NAME), seen - set(contracts.BY_NAME)
    # The kernels exercise the contracts the tk passes and builtins write.
    assert {"tk.num_warps", "count", "cache", "offset", "stride", "scratch_offset",
            "exchange_group", "exchange_sync_after", "tk.smem_align", "tk.smem_bytes"} <= seen


def test_a_contract_is_typed_and_names_its_writer():
    from mlir import ir
    ctx = ir.Context()
    with ctx, ir.Location.unknown():
        op = ir.Module.create().operation
        contracts.OFFSET.set(op, 128)
        assert contracts.OFFSET.get(op) == 128
        with pytest.raises(TypeError):
            contracts.OFFSET.set(op, "128")
        with pytest.raises(KeyError, match="tk-allocate-smem"):
            contracts.STRIDE.get(op)
        assert contracts.STRIDE.get(op, None) is None


def test_an_op_spelled_as_its_builtin_is_built_by_it():
    """Messages name an op as a kernel writes it (tk.spelled): where OpDef.builtin
    says so, that builtin is one marked as building the op."""
    builtins = _marked_builtins()
    for d in tk.OPS:
        module, _, fn = tk.spelled(d).rpartition(".")
        marked = {b.rpartition(".")[2]: b.startswith("tk_mlir.tma.") for b in builtins[d.name]}
        if d.builtin:
            assert marked.get(fn) == (module == "tk.tma"), (d.name, d.builtin, builtins[d.name])
