"""The op registry: every tk op is declared once (dialects/tk.py) and has a
builtin that builds it, a tile rule and a lowering under its name; passes
read traits, not op names."""
from __future__ import annotations

import inspect
import pathlib
import re

import tk_mlir  # noqa: F401  (loads the builtins)
from tk_mlir import mma, ops, sync, tma, values
from tk_mlir.dialects import tk
from tk_mlir.lowering import kernel  # noqa: F401  (registers the lowerings)
from tk_mlir.lowering.context import LOWERINGS
from tk_mlir.passes.verify import RULES

BUILTIN_MODULES = (ops, sync, mma, tma, values)


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
        "thread_id", "lane_id", "warp_id", "warpgroup_id", "elect"}
    assert {n for n, o in d.items() if o.allocates} == {"alloc_st", "alloc_sem"}
