"""The tk dialect, declared in one place.

Each op is one `OpDef` row below: its operands, results and attributes, and
its *traits* — what the passes need to know about it (does its lowering
synchronise the block? does it read shared memory through the async proxy?
is its result ready only after a wait?). Passes read traits, never lists of
op names. From the table we derive the IRDL definition (loaded into a
Context at run time; MLIR then parses, prints and verifies the ops) and a
Python OpView class per op, so passes see typed ops (`op.src`, `op.kind`)
instead of raw operand positions.

The rest of an op lives under the same name: its tile rule beside this
module, in tile_rules.py (`@rule`), its lowering in lowering/ (`@lowers`),
its builtin in tk_mlir/ (marked `@builds`); tests/test_registry.py checks
that every op has all three.

The IRDL constraints are deliberately loose (IRDL cannot express "a tile
whose rows divide 16"); tile_rules.py checks the tile rules and reports
them at the user's source line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from mlir import ir
from mlir.dialects import irdl
from mlir.dialects._ods_common import _cext

from . import contracts, layout as layouts, types as T

# The op lookup imports `tk_mlir.dialects.tk` when it meets a tk op: that is
# this module, so ops come back from the IR as the classes defined here.
_cext.globals.append_dialect_search_prefix("tk_mlir.dialects")

GENERIC, ASYNC = "generic", "async"     # the memory proxies (PTX memory model)


@dataclass(frozen=True)
class Access:
    """A shared-memory access by an op: through its operand `operand` when that
    operand is a shared tile, by the threads (generic proxy: ld/st.shared) or
    by an asynchronous unit (async proxy: TMA, wgmma)."""
    operand: str
    proxy: str


# A trait that depends on the op's types: (op, num_warps) -> value.
Predicate = Callable[[ir.Operation, int], bool]


@dataclass(frozen=True)
class OpDef:
    name: str
    operands: tuple[str, ...] = ()
    variadic: str | None = None          # one trailing variadic operand group
    results: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    same_type: tuple[str, ...] = ()      # operands/results that must share one type
    doc: str = ""
    # The op's name in the short form (dialects/short_form.py), from its
    # attributes, as the Python method reads: "{kind}_{axis}" -> tk.sub_row.
    # The attributes it names are not repeated there.
    mnemonic: str | None = None
    # The builtin a kernel writes, where it is not tk.<name> (messages name it).
    builtin: str | None = None
    # ---- traits
    block_barrier: Union[bool, Predicate] = False  # its lowering syncs the whole block
    thread_varying: bool = False         # its result differs between a block's threads
    lane_varying: bool = False           # ... and between the lanes of one warp
    warpgroup_varying: bool = False      # ... and between the threads of one warpgroup
    thread_run: int = 0                  # an index of the block's threads in runs of this
    #                                      many (aligned, ascending): 0 when it is not one
    one_thread: bool = False             # every thread that runs it issues it: meant for one
    #                                      elected thread (TMA copies, mbarrier arrivals)
    semaphore: bool = False              # allocates semaphores (attribute `arrivals`)
    setmaxnreg: bool = False             # moves registers between warpgroups (`count`, `action`)
    cluster: bool = False                # the kernel's cluster size (attribute `size`)
    named_barrier: str | None = None     # the operand naming the bar.sync id it counts
    #                                      attribute `warps` on
    tma: tuple[str, str] | None = None   # (tensor, shared tile) operands: one tensor map
    scratch: Callable[[ir.Operation, int], int] | None = None  # shared scratch bytes it needs
    layout: str | None = None            # vector layouts: "same" (all its vectors share
    #                                      one) or "broadcast" (the vector follows the tile)
    reads: tuple[Access, ...] = ()       # shared tiles it reads ...
    writes: tuple[Access, ...] = ()      # ... and writes, and through which proxy
    view_of: str | None = None           # its result is a part of this operand's shared memory
    remote_view: bool = False            # ... as another block of the cluster holds it
    remote_operand: str | None = None    # the operand that may be such a tile (remote_view)
    takes_arrays: bool = False           # may take a whole array of tiles or semaphores
    allocates: bool = False              # placed in shared memory by passes/smem.py
    tensor_memory: str | None = None     # its part in a tensor tile's life (passes/
    #                                      tensor_memory.py): "alloc", "free", "async" (a
    #                                      tcgen05 op that completes at a commit) or "commit"
    async_result: bool = False           # its result is ready only after an async_wait
    async_wait: bool = False             # waits for async results (attribute `pending`)
    int_tensor: str | None = None        # an operand that may be an i32 tensor (counters,
    #                                      scalars read one at a time), never one of tiles
    flag: str | None = None              # the operand holding a flag it releases or acquires
    #                                      (its scope must reach the flag's GPU)
    peer_copies: str | None = None       # the variadic operand holding a tk.pgl argument's
    #                                      copies: of any tensor dtype (i32 flags too), as the
    #                                      result that picks one
    # ---- cross-GPU ordering (passes/signal_order.py): a signal publishes the writes
    # before it; TMA writes must be complete and fenced at the signal's scope, across
    # proxies, first.
    bulk_write: bool = False             # writes global memory through the async proxy
    completes_bulk_writes: Union[bool, Callable[[ir.Operation], bool]] = False
    fence_scope: Callable[[ir.Operation], str] | None = None   # a memory fence, at this scope
    fences_proxies: Callable[[ir.Operation], bool] | None = None   # orders async-proxy accesses
    #                                      (TMA) with generic ones (flags)
    signal_scope: Callable[[ir.Operation], str] | None = None  # publishes prior writes

    def has_barrier(self, op, num_warps: int) -> bool:
        b = self.block_barrier
        return b(op, num_warps) if callable(b) else b


def _reduction_scratch(op, num_warps: int) -> int:
    """Bytes of f32 scratch a reduction needs to exchange partial results
    between warps (0 when the reduced axis stays within each warp)."""
    tile = T.parse(op.operands[0].type)
    layout = layouts.layout_of(tile, num_warps)
    keep = 0 if ir.StringAttr(op.attributes["axis"]).value == "row" else 1
    if not layout.warp_bits_along(1 - keep):
        return 0
    return T.scope_warps(tile.scope, num_warps) * 32 * layout.slice(keep).num_regs * 4


def _exchanges_across_warps(op, num_warps: int) -> bool:
    return _reduction_scratch(op, num_warps) > 0


def _stores_block_tile_to_shared(op, num_warps: int) -> bool:
    """A block-scope tile stored to shared memory is fenced by bar.sync on both
    sides (lowering/memory.py)."""
    return isinstance(T.parse(op.operands[0].type), (T.ST, T.SV)) and \
        T.parse(op.operands[1].type).scope == "block"


def _completes_writes(op) -> bool:
    """tma_wait(0) without `read`: the TMA writes are done, not just their reads."""
    a = op.attributes
    return ir.IntegerAttr(a["pending"]).value == 0 and not ir.BoolAttr(a["read"]).value


def _scope_attribute(op) -> str:
    return ir.StringAttr(op.attributes["scope"]).value


# Memory scopes of signals and fences, narrowest first (PTX .cta, .gpu, .sys).
SCOPES = ("cta", "gpu", "sys")

UNARY = ("exp", "exp2", "log", "abs", "neg", "relu", "sqrt", "rsqrt", "rcp")
BINARY = ("add", "sub", "mul", "div", "max", "min")
REDUCTIONS = ("sum", "max", "min")
AXES = ("row", "col")
CACHE_HINTS = ("normal", "stream")   # optional `cache` attribute of tk.load / tk.store


def wgmma_k(dtype: str) -> int:
    """The K of one wgmma instruction (tk.mma) on `dtype` operands: 32 bytes
    of each operand row, k16 for 16-bit types, k32 for fp8."""
    return 32 // T.itemsize(dtype)
LOGICAL = ("and", "or", "xor")       # elementwise on bool (masks) and i32 tiles
# tk.cmp predicates -> (arith.CmpIPredicate: signed ints, arith.CmpFPredicate:
# ordered, but `ne` unordered: NaN != x is true, as in Python).
COMPARISONS = {"lt": ("slt", "OLT"), "le": ("sle", "OLE"), "gt": ("sgt", "OGT"),
               "ge": ("sge", "OGE"), "eq": ("eq", "OEQ"), "ne": ("ne", "UNE")}

OPS: tuple[OpDef, ...] = (
    # Where this thread is.
    OpDef("block_id", results=("result",), attributes=("dim",), doc="blockIdx.{x,y,z}"),
    OpDef("grid_dim", results=("result",), attributes=("dim",), doc="gridDim.{x,y,z}"),
    OpDef("thread_id", results=("result",), thread_varying=True, lane_varying=True,
          warpgroup_varying=True, thread_run=1, doc="threadIdx.x within the block"),
    OpDef("lane_id", results=("result",), thread_varying=True, lane_varying=True,
          warpgroup_varying=True, doc="lane within the warp"),
    OpDef("warp_id", results=("result",), thread_varying=True, warpgroup_varying=True,
          thread_run=32, doc="warp within the block"),
    OpDef("warpgroup_id", results=("result",), thread_varying=True, thread_run=128,
          doc="warpgroup within the block"),
    OpDef("gl_dim", operands=("src",), results=("result",), attributes=("dim",),
          int_tensor="src", doc="run-time extent of a global layout dimension"),
    # Memory.
    OpDef("alloc_st", results=("result",), allocates=True,
          doc="a shared tile; placed by passes/smem.py"),
    OpDef("alloc_sv", results=("result",), allocates=True,
          doc="a shared vector; placed by passes/smem.py"),
    OpDef("load", operands=("src",), variadic="indices", results=("result",),
          attributes=("fill",), reads=(Access("src", GENERIC),), remote_operand="src",
          doc="gl -> rt/rv (tile coordinates; out-of-bounds elements read `fill`), st -> rt, "
              "sv -> rv"),
    OpDef("load_scalar", operands=("src",), variadic="indices", results=("result",),
          int_tensor="src",
          doc="one element of an i32 or f32 gl at element coordinates (every thread that runs "
              "it reads; 0 past the end)"),
    OpDef("store", operands=("dst", "value"), variadic="indices",
          writes=(Access("dst", GENERIC),), block_barrier=_stores_block_tile_to_shared,
          remote_operand="dst",
          doc="rt/rv -> gl (out-of-bounds elements are not written), rt -> st, rv -> sv"),
    OpDef("atomic_add", operands=("dst", "value"), variadic="indices",
          doc="f32 rt/rv added into an f32 gl at tile coordinates (red.global.add: each "
              "element once, out-of-bounds elements skipped, as tk.store)"),
    OpDef("store_partial", operands=("dst", "value", "workspace", "counters", "parts"),
          variadic="indices", int_tensor="counters",
          doc="f32 rt/rv, one of `parts` (i32) partial sums of dst's tile at tile coordinates "
              "(split-K): added into the f32 workspace (red.global.add); the last part to "
              "arrive, counted per thread in i32 counters, stores the sum into dst and leaves "
              "its workspace elements and counters zero"),
    OpDef("copy", operands=("dst", "src"), variadic="indices", block_barrier=True,
          reads=(Access("src", GENERIC),), writes=(Access("dst", GENERIC),),
          doc="gl <-> st by every thread of the block, between two block barriers"),
    OpDef("barrier", block_barrier=True, doc="block-wide barrier (bar.sync 0)"),
    OpDef("index", operands=("base", "index"), results=("result",), same_type=("base", "result"),
          view_of="base", takes_arrays=True,
          doc="element `index` of an array of shared tiles or semaphores (alloc_st/alloc_sem "
              "with a `count` hint)"),
    OpDef("subtile", operands=("src", "row"), results=("result",), view_of="src",
          doc="the result type's rows of a shared tile, from row `row` on"),
    OpDef("in_block", operands=("src", "rank"), results=("result",), same_type=("src", "result"),
          view_of="src", remote_view=True,
          doc="the shared tile `src` of block `rank` (an i32) of this block's cluster "
              "(distributed shared memory: mapa, ld/st.shared::cluster); only tk.load reads "
              "it and tk.store writes it"),
    OpDef("column_block", operands=("src", "index"), results=("result",), view_of="src",
          doc="column block `index` (an i32) of a swizzled shared tile (its rows x swizzle "
              "bytes, stored apart from the other blocks): a tile of its own, e.g. a wgmma "
              "operand"),
    # Hopper: semaphores (mbarriers), TMA, warpgroup MMA, warp specialization.
    OpDef("alloc_sem", results=("result",), attributes=("arrivals",), allocates=True,
          semaphore=True,
          block_barrier=True,   # initialised, then a block barrier
          doc="a semaphore (mbarrier) expecting `arrivals` arrivals per phase; placed by "
              "passes/smem.py and initialised once at the kernel's start"),
    OpDef("arrive", operands=("sem",), one_thread=True, doc="one arrival on a semaphore"),
    OpDef("expect_bytes", operands=("sem",), attributes=("bytes",), one_thread=True,
          builtin="tk.tma.expect_bytes",
          doc="one arrival that also expects `bytes` of TMA transactions this phase"),
    OpDef("wait", operands=("sem", "phase"),
          doc="wait until the semaphore's phase with parity `phase` has completed"),
    OpDef("wait_phase", operands=("sem", "phase"),
          doc="wait until the semaphore's phase number `phase` (0, 1, 2, ...) has completed: "
              "its parity on the GPU, the number in the interpreter's check"),
    OpDef("tma_load", operands=("dst", "src", "sem"), variadic="indices", tma=("src", "dst"),
          builtin="tk.tma.load_async",
          writes=(Access("dst", ASYNC),), one_thread=True,
          doc="TMA: global tile (or vector) at tile coordinates (element coordinates with "
              "the `elements` hint) -> shared tile (or shared vector), completing on sem"),
    OpDef("tma_store", operands=("dst", "src"), variadic="indices", tma=("dst", "src"),
          builtin="tk.tma.store_async",
          reads=(Access("src", ASYNC),), one_thread=True, bulk_write=True,
          doc="TMA: shared tile -> global tile at tile coordinates (or elements: as "
              "tma_load) (bulk async group)"),
    OpDef("tma_reduce_add", operands=("dst", "src"), variadic="indices", tma=("dst", "src"),
          builtin="tk.tma.reduce_add_async",
          reads=(Access("src", ASYNC),), one_thread=True, bulk_write=True,
          doc="TMA: global tile at tile coordinates (or elements: as tma_load) += shared "
              "tile (cp.reduce.async.bulk.tensor .add; the bulk async group of tma_store)"),
    OpDef("tma_commit", builtin="tk.tma.store_commit", doc="close the current bulk async group of TMA stores"),
    OpDef("tma_wait", attributes=("pending", "read"), completes_bulk_writes=_completes_writes,
          builtin="tk.tma.store_wait",
          doc="wait until at most `pending` TMA store groups are outstanding (read: until "
              "their shared sources may be overwritten)"),
    OpDef("tma_prefetch", operands=("src", "like"), tma=("src", "like"), builtin="tk.tma.prefetch",
          doc="prefetch the tensor map that TMA ops on src with tiles of like's type use"),
    OpDef("mma", operands=("acc", "a", "b"), results=("result",),
          attributes=("trans_a", "trans_b"),
          same_type=("acc", "result"), reads=(Access("a", ASYNC), Access("b", ASYNC)),
          async_result=True,
          doc="warpgroup MMA (wgmma): acc + op(a) op(b), a and b shared tiles; async until "
              "tk.mma_wait"),
    OpDef("mma_wait", attributes=("pending",), async_wait=True,
          doc="wait until at most `pending` warpgroup MMA groups are in flight"),
    # ---- Blackwell (sm_100a): tensor memory (TMEM) and tcgen05 (lowering/tensor_memory.py)
    OpDef("alloc_tt", results=("result",), allocates=True, block_barrier=True,
          tensor_memory="alloc",
          doc="a tile in tensor memory: warp 0 allocates its type's allocated_columns "
              "(tcgen05.alloc), whose address reaches every thread through an 8-byte shared "
              "word"),
    OpDef("free_tt", operands=("tile",), block_barrier=True, tensor_memory="free",
          doc="a block barrier, then warp 0 frees the tile's columns (tcgen05.dealloc)"),
    OpDef("tensor_mma", operands=("acc", "a", "b", "accumulate"),
          attributes=("trans_a", "trans_b", "pair"),
          reads=(Access("a", ASYNC), Access("b", ASYNC)), one_thread=True,
          tensor_memory="async",
          doc="tcgen05.mma: acc (a tensor-memory tile) = op(a) op(b) (+ acc when "
              "`accumulate`), a and b shared tiles; asynchronous until a tk.mma_commit's "
              "semaphore phase completes. pair: one MMA of the cluster's two blocks "
              "(cta_group::2), each holding its 128 rows of a and of acc and half of b"),
    OpDef("mma_commit", operands=("sem",), one_thread=True, tensor_memory="commit",
          doc="tcgen05.commit: one arrival on sem once the tcgen05.mma ops this thread "
              "issued before it are complete (in a pairing kernel: on sem in both blocks)"),
    OpDef("tensor_columns", operands=("src", "start"), results=("result",), view_of="src",
          doc="columns start.. of a tensor tile: a view (its lanes, the address `start` "
              "columns on)"),
    OpDef("tensor_load", operands=("src",), results=("result",),
          doc="tcgen05.ld: a tensor-memory tile into a register tile (tmem layout)"),
    OpDef("tensor_store", operands=("dst", "value"),
          doc="tcgen05.st: a register tile (tmem layout) into a tensor-memory tile"),
    OpDef("elect", results=("result",), attributes=("scope",), thread_varying=True,
          lane_varying=True, warpgroup_varying=True,
          doc="true on one thread of each warp (scope=warp) or warpgroup (elect.sync)"),
    OpDef("set_registers", attributes=("count", "action"), setmaxnreg=True,
          doc="setmaxnreg: this warpgroup's registers per thread (action inc or dec)"),
    OpDef("use_cluster", attributes=("size",), cluster=True,
          doc="launch the kernel in clusters of `size` blocks along x (.reqnctapercluster)"),
    # (cluster_rank varies between blocks, not between a block's threads.)
    OpDef("cluster_rank", results=("result",), doc="this block's rank in its cluster"),
    OpDef("cluster_sync", block_barrier=True,
          doc="barrier.cluster arrive + wait: every thread of the cluster"),
    OpDef("arrive_remote", operands=("sem", "cta"), one_thread=True, builtin="tk.arrive",
          doc="one arrival on the semaphore at the same place in block `cta` of the cluster"),
    OpDef("tma_load_multicast", operands=("dst", "src", "sem", "mask"), variadic="indices",
          builtin="tk.tma.load_async",
          tma=("src", "dst"), writes=(Access("dst", ASYNC),), one_thread=True,
          doc="TMA load delivered to the same shared tile and semaphore in every block of "
              "the cluster whose bit is set in `mask`"),
    OpDef("named_barrier", operands=("id",), attributes=("warps", "mode"), named_barrier="id",
          doc="named barrier `id` among `warps` warps (ids 1-15; 0 is the block barrier): "
              "mode sync waits for all of them (bar.sync), mode arrive counts this warp "
              "in and goes on (bar.arrive)"),
    # Peer memory and cross-GPU signals (tk.pgl arguments; tk_mlir/signals.py).
    OpDef("peer_select", operands=("rank",), variadic="peers", results=("result",),
          peer_copies="peers",
          doc="the copy of a tk.pgl tensor on rank `rank` (an i32 from 0 to the world size - "
              "1; traps outside): one of `peers`, which share one type"),
    OpDef("signal", operands=("flags", "value"), variadic="indices",
          attributes=("scope", "mode"), int_tensor="flags", one_thread=True,
          signal_scope=_scope_attribute, flag="flags",
          doc="release at `scope` (cta, gpu, sys): add `value` to (mode add: red.release) or "
              "store it into (mode set: st.release) one u32 element of an i32 gl; orders this "
              "thread's earlier writes, and those it observed, before it"),
    OpDef("wait_signal", operands=("flags", "expected"), variadic="indices",
          attributes=("scope", "timeout_ms"), int_tensor="flags", flag="flags",
          doc="spin (ld.acquire at `scope`) until one u32 element of an i32 gl reaches "
              "`expected` (wrapping compare: epoch counters never need resetting); after "
              "`timeout_ms` print where and trap"),
    OpDef("fence", attributes=("scope", "async_proxy"), fence_scope=_scope_attribute,
          fences_proxies=lambda op: ir.BoolAttr(op.attributes["async_proxy"]).value,
          doc="fence.acq_rel at `scope` (cta, gpu, sys): orders this thread's memory "
              "operations, completed TMA writes included, with its later ones; async_proxy: "
              "first fence.proxy.async.global, between its TMA (async proxy) accesses of "
              "global memory and its loads, stores and flags (generic proxy)"),
    # Values.
    OpDef("fill", results=("result",), attributes=("value",), doc="a tile of one value"),
    OpDef("cvt", operands=("src",), results=("result",), layout="same",
          doc="element type conversion"),
    *(OpDef(n, operands=("src",), results=("result",), same_type=("src", "result"),
            layout="same", doc=f"elementwise {n}") for n in UNARY),
    *(OpDef(n, operands=("lhs", "rhs"), results=("result",), same_type=("lhs", "result"),
            layout="same", doc=f"elementwise {n}; rhs is a tile of the same type or a scalar")
      for n in BINARY),
    OpDef("swap_pairs", operands=("src",), results=("result",), same_type=("src", "result"),
          layout="same",
          doc="each element of a register tile with its column neighbour (columns 2i and "
              "2i+1 trade places: the interleaved rotary layout's pairs); a register "
              "permutation within each thread (vec and row layouts hold column pairs)"),
    OpDef("transpose", operands=("src",), results=("result",),
          doc="a row-layout register tile as its transpose in the col layout, or back: each "
              "thread's registers hold the transposed elements (no data moves)"),
    OpDef("slice", operands=("src",), results=("result",), attributes=("row", "col"),
          doc="the result type's rows and columns of a register tile, from (row, col) on "
              "(the registers that hold them: no data moves)"),
    OpDef("reduce", operands=("src",), results=("result",), attributes=("kind", "axis"),
          scratch=_reduction_scratch, block_barrier=_exchanges_across_warps,
          mnemonic="{axis}_{kind}",
          doc="row (axis=row: one value per row) or column reduction of a tile to a vector"),
    OpDef("broadcast", operands=("src", "vec"), results=("result",),
          attributes=("kind", "axis"), same_type=("src", "result"), layout="broadcast",
          mnemonic="{kind}_{axis}",
          doc="tile (kind) vector, the vector repeated along rows (axis=row) or columns"),
    # Masks: indices, comparisons and selects (i32 and bool tiles live in registers only).
    OpDef("tile_index", operands=("src",), results=("result",), attributes=("axis",),
          thread_varying=True, lane_varying=True, warpgroup_varying=True, layout="same",
          doc="the i32 tile (vector) of src's shape and layout whose elements are their own "
              "index along `axis` (0: row, 1: column) within the tile"),
    *(OpDef(n, operands=("lhs", "rhs"), results=("result",), same_type=("lhs", "result"),
            layout="same", doc=f"elementwise {n} of bool (or i32) tiles; rhs a tile of the "
                               f"same type or a scalar") for n in LOGICAL),
    OpDef("cmp", operands=("lhs", "rhs"), results=("result",), attributes=("predicate",),
          layout="same", mnemonic="cmp_{predicate}", doc="elementwise comparison (COMPARISONS) to a bool tile; rhs a tile "
                             "of the same type or a scalar"),
    OpDef("select", operands=("mask", "a", "b"), results=("result",), layout="same",
          doc="elementwise mask ? a : b; a and b tiles of the result type or scalars"),
)
OPS_BY_NAME = {op.name: op for op in OPS}

TYPES = {
    "gl": ("dtype", "shape"),
    "st": ("dtype", "rows", "cols", "swizzle"),
    "rt": ("dtype", "rows", "cols", "layout", "scope"),
    "rv": ("dtype", "length", "layout", "scope"),
    "sv": ("dtype", "length"),
    "sem": (),
    "tt": ("dtype", "rows", "cols"),
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


def tile_scope(op) -> str | None:
    """The scope of op's register tiles and vectors (an op's share one), or
    None: the warps that run it together, each on its part."""
    for v in (*op.results, *op.operands):
        t = T.parse(v.type)
        if isinstance(t, (T.RT, T.RV)):
            return t.scope
    return None


def constant_int(v: ir.Value) -> int | None:
    """v's value when an arith.constant integer defines it, else None (an
    operand known at compile time: a column block's index, a barrier's id)."""
    if isinstance(v, ir.OpResult) and v.owner.name == "arith.constant":
        attr = v.owner.attributes["value"]
        if isinstance(attr, ir.IntegerAttr):
            return attr.value
    return None


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_")) + "Op"


def _make_opview(d: OpDef) -> type:
    cls = type(_camel(d.name), (TkOp,), {
        "OPERATION_NAME": f"tk.{d.name}", "_ODS_REGIONS": (0, True), "DEF": d,
        "__doc__": d.doc})
    return _cext.register_operation(_Dialect, replace=True)(cls)


OPVIEWS = {d.name: _make_opview(d) for d in OPS}
globals().update({cls.__name__: cls for cls in OPVIEWS.values()})


# ------------------------------------------------------- reading traits

def spelled(d: OpDef) -> str:
    """The op as a kernel writes it (its builtin), for messages."""
    return d.builtin or f"tk.{d.name}"


def op_def(op) -> OpDef | None:
    """The OpDef of a tk op (an Operation or OpView), None for any other op."""
    name = getattr(op, "operation", op).name
    return OPS_BY_NAME.get(name[3:]) if name.startswith("tk.") else None


def _operand(op, d: OpDef, name: str) -> ir.Value:
    return op.operands[d.operands.index(name)]


def array_count(op) -> int | None:
    """The element count of an allocation that makes an array (its `count`
    hint), None for a single tile or semaphore (or any other op)."""
    op = getattr(op, "operation", op)
    d = op_def(op)
    if d is None or not d.allocates:
        return None
    return contracts.COUNT.get(op, None)


def tma_operands(op) -> tuple[ir.Value, ir.Value] | None:
    """(tensor, shared tile) values of a TMA op, None for any other op."""
    op = getattr(op, "operation", op)
    d = op_def(op)
    if d is None or d.tma is None:
        return None
    return tuple(_operand(op, d, r) for r in d.tma)


def shared_accesses(op) -> list[tuple[str, str, ir.Value]]:
    """("read" | "write", proxy, shared tile value) for each shared tile op
    reads or writes (an access through an operand that is not a shared tile,
    e.g. tk.store to a global, is none)."""
    op = getattr(op, "operation", op)
    d = op_def(op)
    if d is None:
        return []
    out = []
    for kind, accesses in (("read", d.reads), ("write", d.writes)):
        for a in accesses:
            v = _operand(op, d, a.operand)
            if isinstance(T.parse(v.type), (T.ST, T.SV)):
                out.append((kind, a.proxy, v))
    return out


def shared_root(v: ir.Value) -> ir.Value:
    """The allocation a shared tile value is part of (through tk.index and
    tk.subtile views): two tiles may overlap only when their roots agree."""
    while isinstance(v, ir.OpResult):
        d = op_def(v.owner)
        if d is None or d.view_of is None:
            break
        v = _operand(v.owner, d, d.view_of)
    return v


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
    """Create `tk.<name>` at the current insertion point and location.
    Attributes beyond the op's own are hints declared in dialects/contracts.py
    (e.g. `cache`, `count`), set through their typed accessor."""
    d = OPS_BY_NAME[name]
    missing = set(d.attributes) - set(attributes)
    assert not missing, f"tk.{name} needs attributes {sorted(missing)}"
    hints = {k: v for k, v in attributes.items() if k not in d.attributes}
    op = ir.Operation.create(
        f"tk.{name}", results=list(results), operands=list(operands),
        attributes={k: _attr(v) for k, v in attributes.items() if k in d.attributes})
    for k, v in hints.items():
        contracts.BY_NAME[k].set(op, v)
    return op.opview
