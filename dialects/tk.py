"""The tk dialect, declared in one place.

Each op is one `OpDef` row below. From that table we derive both the IRDL
definition (loaded into a Context at run time; MLIR then parses, prints and
verifies the ops) and a Python OpView class per op, so passes see typed ops
(`op.src`, `op.kind`) instead of raw operand positions.

The IRDL constraints are deliberately loose (IRDL cannot express "a tile
whose rows divide 16"); passes/verify.py checks the tile rules and reports
them at the user's source line.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlir import ir
from mlir.dialects import irdl
from mlir.dialects._ods_common import _cext

# The op lookup imports `tk_mlir.dialects.tk` when it meets a tk op: that is
# this module, so ops come back from the IR as the classes defined here.
_cext.globals.append_dialect_search_prefix("tk_mlir.dialects")


@dataclass(frozen=True)
class OpDef:
    name: str
    operands: tuple[str, ...] = ()
    variadic: str | None = None          # one trailing variadic operand group
    results: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    same_type: tuple[str, ...] = ()      # operands/results that must share one type
    doc: str = ""


UNARY = ("exp", "exp2", "log", "abs", "neg", "relu", "sqrt", "rsqrt")
BINARY = ("add", "sub", "mul", "div", "max", "min")
REDUCTIONS = ("sum", "max", "min")
AXES = ("row", "col")
CACHE_HINTS = ("normal", "stream")   # optional `cache` attribute of tk.load / tk.store

OPS: tuple[OpDef, ...] = (
    # Where this thread is.
    OpDef("block_id", results=("result",), attributes=("dim",), doc="blockIdx.{x,y,z}"),
    OpDef("grid_dim", results=("result",), attributes=("dim",), doc="gridDim.{x,y,z}"),
    OpDef("thread_id", results=("result",), doc="threadIdx.x within the block"),
    OpDef("lane_id", results=("result",), doc="lane within the warp"),
    OpDef("warp_id", results=("result",), doc="warp within the block"),
    OpDef("warpgroup_id", results=("result",), doc="warpgroup within the block"),
    OpDef("gl_dim", operands=("src",), results=("result",), attributes=("dim",),
          doc="run-time extent of a global layout dimension"),
    # Memory.
    OpDef("alloc_st", results=("result",), doc="a shared tile; placed by passes/smem.py"),
    OpDef("load", operands=("src",), variadic="indices", results=("result",),
          attributes=("fill",),
          doc="gl -> rt/rv (tile coordinates; out-of-bounds elements read `fill`), st -> rt"),
    OpDef("store", operands=("dst", "value"), variadic="indices",
          doc="rt/rv -> gl (out-of-bounds elements are not written), rt -> st"),
    OpDef("copy", operands=("dst", "src"), variadic="indices",
          doc="gl <-> st by every thread of the block, then a block barrier"),
    OpDef("barrier", doc="block-wide barrier (bar.sync 0)"),
    OpDef("index", operands=("base", "index"), results=("result",), same_type=("base", "result"),
          doc="element `index` of an array of shared tiles or semaphores (alloc_st/alloc_sem "
              "with a `count` hint)"),
    OpDef("subtile", operands=("src", "row"), results=("result",),
          doc="the result type's rows of a shared tile, from row `row` on"),
    # Hopper: semaphores (mbarriers), TMA, warpgroup MMA, warp specialization.
    OpDef("alloc_sem", results=("result",), attributes=("arrivals",),
          doc="a semaphore (mbarrier) expecting `arrivals` arrivals per phase; placed by "
              "passes/smem.py and initialised once at the kernel's start"),
    OpDef("arrive", operands=("sem",), doc="one arrival on a semaphore"),
    OpDef("expect_bytes", operands=("sem",), attributes=("bytes",),
          doc="one arrival that also expects `bytes` of TMA transactions this phase"),
    OpDef("wait", operands=("sem", "phase"),
          doc="wait until the semaphore's phase with parity `phase` has completed"),
    OpDef("tma_load", operands=("dst", "src", "sem"), variadic="indices",
          doc="TMA: global tile at tile coordinates -> shared tile, completing on sem"),
    OpDef("tma_store", operands=("dst", "src"), variadic="indices",
          doc="TMA: shared tile -> global tile at tile coordinates (bulk async group)"),
    OpDef("tma_commit", doc="close the current bulk async group of TMA stores"),
    OpDef("tma_wait", attributes=("pending", "read"),
          doc="wait until at most `pending` TMA store groups are outstanding (read: until "
              "their shared sources may be overwritten)"),
    OpDef("tma_prefetch", operands=("src", "like"),
          doc="prefetch the tensor map that TMA ops on src with tiles of like's type use"),
    OpDef("mma", operands=("acc", "a", "b"), results=("result",), attributes=("trans_a", "trans_b"),
          same_type=("acc", "result"),
          doc="warpgroup MMA (wgmma): acc + op(a) op(b), a and b shared tiles; async until "
              "tk.mma_wait"),
    OpDef("mma_wait", attributes=("pending",),
          doc="wait until at most `pending` warpgroup MMA groups are in flight"),
    OpDef("elect", results=("result",), attributes=("scope",),
          doc="true on one thread of each warp (scope=warp) or warpgroup (elect.sync)"),
    OpDef("set_registers", attributes=("count", "action"),
          doc="setmaxnreg: this warpgroup's registers per thread (action inc or dec)"),
    OpDef("use_cluster", attributes=("size",),
          doc="launch the kernel in clusters of `size` blocks along x (.reqnctapercluster)"),
    OpDef("cluster_rank", results=("result",), doc="this block's rank in its cluster"),
    OpDef("cluster_sync", doc="barrier.cluster arrive + wait: every thread of the cluster"),
    OpDef("arrive_remote", operands=("sem", "cta"),
          doc="one arrival on the semaphore at the same place in block `cta` of the cluster"),
    OpDef("tma_load_multicast", operands=("dst", "src", "sem", "mask"), variadic="indices",
          doc="TMA load delivered to the same shared tile and semaphore in every block of "
              "the cluster whose bit is set in `mask`"),
    OpDef("named_barrier", operands=("id",), attributes=("warps",),
          doc="bar.sync id among `warps` warps (ids 1-15; 0 is the block barrier)"),
    # Values.
    OpDef("fill", results=("result",), attributes=("value",), doc="a tile of one value"),
    OpDef("cvt", operands=("src",), results=("result",), doc="element type conversion"),
    *(OpDef(n, operands=("src",), results=("result",), same_type=("src", "result"),
            doc=f"elementwise {n}") for n in UNARY),
    *(OpDef(n, operands=("lhs", "rhs"), results=("result",), same_type=("lhs", "result"),
            doc=f"elementwise {n}; rhs is a tile of the same type or a scalar")
      for n in BINARY),
    OpDef("slice", operands=("src",), results=("result",), attributes=("row", "col"),
          doc="the result type's rows and columns of a register tile, from (row, col) on "
              "(the registers that hold them: no data moves)"),
    OpDef("reduce", operands=("src",), results=("result",), attributes=("kind", "axis"),
          doc="row (axis=row: one value per row) or column reduction of a tile to a vector"),
    OpDef("broadcast", operands=("src", "vec"), results=("result",),
          attributes=("kind", "axis"), same_type=("src", "result"),
          doc="tile (kind) vector, the vector repeated along rows (axis=row) or columns"),
)
OPS_BY_NAME = {op.name: op for op in OPS}

TYPES = {
    "gl": ("dtype", "shape"),
    "st": ("dtype", "rows", "cols", "swizzle"),
    "rt": ("dtype", "rows", "cols", "layout", "scope"),
    "rv": ("dtype", "length", "layout", "scope"),
    "sv": ("dtype", "length"),
    "sem": (),
}


# --------------------------------------------------------------------- IRDL

def _irdl_module() -> ir.Module:
    module = ir.Module.create()
    with ir.InsertionPoint(module.body):
        dialect = irdl.dialect("tk")
        with ir.InsertionPoint(dialect.body):
            for name, params in TYPES.items():
                t = irdl.type_(name)
                with ir.InsertionPoint(t.body):
                    if params:
                        irdl.parameters([irdl.any() for _ in params], list(params))
            for op in OPS:
                _irdl_op(op)
    return module


def _irdl_op(op: OpDef) -> None:
    definition = irdl.operation_(op.name)
    with ir.InsertionPoint(definition.body):
        shared = irdl.any() if op.same_type else None
        def constraint(n):
            return shared if n in op.same_type else irdl.any()
        names = list(op.operands) + ([op.variadic] if op.variadic else [])
        if names:
            single, many = irdl.Variadicity.single, irdl.Variadicity.variadic
            irdl.operands_([constraint(n) for n in names], names,
                           [single] * len(op.operands) + ([many] if op.variadic else []))
        if op.results:
            irdl.results_([constraint(n) for n in op.results], list(op.results),
                          [irdl.Variadicity.single] * len(op.results))
        if op.attributes:
            irdl.attributes_([irdl.any() for _ in op.attributes], list(op.attributes))


def load(context: ir.Context) -> None:
    """Make the tk dialect known to `context` (at most once: twice aborts)."""
    if context.is_registered_operation("tk.load"):
        return
    with context, ir.Location.unknown():
        irdl.load_dialects(_irdl_module())


# ------------------------------------------------------------------ OpViews

@_cext.register_dialect
class _Dialect(ir.Dialect):
    DIALECT_NAMESPACE = "tk"


class TkOp(ir.OpView):
    """Base of the tk OpViews: named access to operands and attributes."""
    DEF: OpDef

    def __getattr__(self, name):
        d = type(self).DEF
        if name in d.operands:
            return self.operation.operands[d.operands.index(name)]
        if name == d.variadic and name is not None:
            return list(self.operation.operands)[len(d.operands):]
        if name in d.attributes:
            return attribute_value(self.operation.attributes[name])
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")


def attribute_value(attr: ir.Attribute):
    """A Python value for the attribute kinds tk ops carry."""
    if isinstance(attr, (ir.IntegerAttr, ir.FloatAttr, ir.StringAttr, ir.BoolAttr)):
        return attr.value
    return attr


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_")) + "Op"


def _make_opview(d: OpDef) -> type:
    cls = type(_camel(d.name), (TkOp,), {
        "OPERATION_NAME": f"tk.{d.name}", "_ODS_REGIONS": (0, True), "DEF": d,
        "__doc__": d.doc})
    return _cext.register_operation(_Dialect, replace=True)(cls)


OPVIEWS = {d.name: _make_opview(d) for d in OPS}
globals().update({cls.__name__: cls for cls in OPVIEWS.values()})


# ------------------------------------------------------- hints and roles

ALLOCS = ("tk.alloc_st", "tk.alloc_sem")


def array_count(op) -> int | None:
    """The element count of an alloc_st/alloc_sem that makes an array (its
    `count` hint), None for a single tile or semaphore (or any other op)."""
    op = getattr(op, "operation", op)
    if op.name not in ALLOCS or "count" not in op.attributes:
        return None
    return ir.IntegerAttr(op.attributes["count"]).value


# Which named operands of each TMA op are the tensor and the shared tile
# (the pair that decides its tensor map).
TMA_OPERANDS = {"tma_load": ("src", "dst"), "tma_load_multicast": ("src", "dst"),
                "tma_store": ("dst", "src"), "tma_prefetch": ("src", "like")}


def tma_operands(op) -> tuple[ir.Value, ir.Value] | None:
    """(tensor, shared tile) values of a TMA op, None for any other op."""
    roles = TMA_OPERANDS.get(op.operation.name.removeprefix("tk."))
    if roles is None:
        return None
    d = OPS_BY_NAME[op.operation.name.removeprefix("tk.")]
    return tuple(op.operation.operands[d.operands.index(r)] for r in roles)


# ----------------------------------------------------------------- building

def _attr(value) -> ir.Attribute:
    if isinstance(value, ir.Attribute):
        return value
    if isinstance(value, bool):
        return ir.BoolAttr.get(value)
    if isinstance(value, int):
        return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), value)
    if isinstance(value, float):
        return ir.FloatAttr.get(ir.F32Type.get(), value)
    if isinstance(value, str):
        return ir.StringAttr.get(value)
    raise TypeError(f"no attribute for {value!r}")


def build(name: str, operands=(), results=(), **attributes) -> TkOp:
    """Create `tk.<name>` at the current insertion point and location."""
    d = OPS_BY_NAME[name]
    # Attributes beyond the declared ones are discardable hints (e.g. `cache`).
    missing = set(d.attributes) - set(attributes)
    assert not missing, f"tk.{name} needs attributes {sorted(missing)}"
    return ir.Operation.create(
        f"tk.{name}", results=list(results), operands=list(operands),
        attributes={k: _attr(v) for k, v in attributes.items()}).opview
