"""What one stage hands to the next: the attributes the tk passes write on
ops (and on the kernel's func.func) for later passes and the lowering.

Each is declared once here with its type, where it sits, who writes it and
who reads it; code reads and writes them only through these accessors, so a
misspelt name or a wrong type is an error at the accessor, not a silent
KeyError (or a default) three stages later. They stay ordinary MLIR
attributes, so every stage's text still shows them and can be parsed back.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlir import ir

_MISSING = object()


@dataclass(frozen=True)
class Contract:
    name: str            # the attribute's name in the IR
    type: type           # int, bool, str, or tuple (of ints)
    on: str              # which ops carry it
    written_by: str
    read_by: str
    bits: int = 64       # integer width in the IR (ints and tuples)

    def has(self, op) -> bool:
        return self.name in _operation(op).attributes

    def get(self, op, default=_MISSING):
        op = _operation(op)
        if self.name not in op.attributes:
            if default is _MISSING:
                raise KeyError(f"{op.name} has no {self.name!r} attribute: {self.written_by} "
                               f"should have set it")
            return default
        attr = op.attributes[self.name]
        if self.type is bool:
            return ir.BoolAttr(attr).value
        if self.type is int:
            return ir.IntegerAttr(attr).value
        if self.type is tuple:
            return tuple(ir.DenseI32ArrayAttr(attr))
        return ir.StringAttr(attr).value

    def set(self, op, value) -> None:
        if not isinstance(value, self.type):
            raise TypeError(f"{self.name} is {self.type.__name__}, got {value!r}")
        if self.type is bool:
            attr = ir.BoolAttr.get(value)
        elif self.type is int:
            attr = ir.IntegerAttr.get(ir.IntegerType.get_signless(self.bits), value)
        elif self.type is tuple:
            assert self.bits == 32, "tuples are dense i32 arrays"
            attr = ir.DenseI32ArrayAttr.get(list(value))
        else:
            attr = ir.StringAttr.get(value)
        _operation(op).attributes[self.name] = attr

    def remove(self, op) -> None:
        if self.has(op):
            del _operation(op).attributes[self.name]


def _operation(op) -> ir.Operation:
    return getattr(op, "operation", op)


# ---- written by the frontend (builtins)
NUM_WARPS = Contract("tk.num_warps", int, "the kernel's func.func", "the frontend",
                     "every tk pass, tk-to-gpu")
COUNT = Contract("count", int, "tk.alloc_st / tk.alloc_sv / tk.alloc_sem making an array",
                 "tk.shared_tiles, tk.semaphores", "tk-verify, tk-allocate-smem, tk-to-gpu")
CACHE = Contract("cache", str, "tk.load / tk.store of a global ('stream'; absent: normal)",
                 "tk.load, tk.store", "lowering/memory.py")
ELEMENTS = Contract("elements", bool, "tk.tma_load / tma_load_multicast / tma_store / "
                    "tma_reduce_add whose coordinates count elements (absent: tiles)",
                    "tk.tma.load_async, store_async, reduce_add_async (elements=True)",
                    "lowering/tma.py, the interpreter (tk_mlir/interpreter/hopper.py)")
SKIP_ONES = Contract("skip_ones", bool, "tk.broadcast of kind mul whose multiplies a warp may "
                     "skip when every factor it holds is 1 (absent: always multiply)",
                     "Tile.mul_row / mul_col (skip_ones=True)", "lowering/compute.py")
PEER_COPIES = Contract("tk.peer_copies", tuple,
                       "the kernel's func.func, when it takes tk.pgl arguments: the argument "
                       "numbers of their ranks' copies", "the frontend",
                       "tk-verify (passes/signal_order.py: flags on another GPU need scope sys)",
                       bits=32)
NO_FP_CONTRACT = Contract("tk.no_fp_contract", bool,
                          "the kernel's func.func, under @tk.kernel(fp_contract=False)",
                          "tk_mlir/compiler.py", "tk-to-gpu (lowering/compute.py: no fma)")

NARROW_STORES = Contract("tk.narrow_stores", bool,
                         "the kernel's func.func, when its stores widened by lane exchanges "
                         "made ptxas spill more", "tk_mlir/compiler.py",
                         "tk-to-gpu (lowering/lane_exchange.py: register tiles leave as laid out)")

# ---- written by tk-allocate-smem (passes/smem.py)
OFFSET = Contract("offset", int, "allocations: byte offset in dynamic shared memory",
                  "tk-allocate-smem", "lowering/memory.py, lowering/mbarriers.py")
STRIDE = Contract("stride", int, "allocations: bytes between the elements of an array",
                  "tk-allocate-smem", "lowering/memory.py, lowering/mbarriers.py")
SCRATCH_OFFSET = Contract("scratch_offset", int, "ops with a scratch trait that need it",
                          "tk-allocate-smem", "lowering/reduce.py")
EXCHANGE_GROUP = Contract("exchange_group", int, "cross-warp reductions sharing one barrier",
                          "tk-allocate-smem", "lowering/kernel.py, lowering/reduce.py")
EXCHANGE_SYNC_AFTER = Contract("exchange_sync_after", bool,
                               "cross-warp reductions: a barrier after the exchange",
                               "tk-allocate-smem", "lowering/reduce.py")
SMEM_ALIGN = Contract("tk.smem_align", int, "the kernel's func.func, when a tile is swizzled",
                      "tk-allocate-smem", "tk-to-gpu (rounds the base up at run time)")
SMEM_BYTES = Contract("tk.smem_bytes", int, "the kernel's func.func", "tk-allocate-smem",
                      "tk-to-gpu, tk_mlir/compiler.py (launch)")

# ---- written by tk-proxy-fences (passes/fences.py)
PROXY_FENCE = Contract("proxy_fence", bool,
                       "generic-proxy shared writes that an async-proxy read may follow",
                       "tk-proxy-fences", "lowering/memory.py (fence.proxy.async after them)")

# ---- written by tk-to-gpu on the gpu.func for tk-kernel-attributes, which turns
# them into what the NVVM lowering reads (it drops gpu.func argument attributes).
GRID_CONSTANTS = Contract("tk.grid_constants", tuple, "the kernel: tensor-map parameters",
                          "tk-to-gpu", "tk-kernel-attributes (byval grid constants)", bits=32)
MIN_CTAS = Contract("tk.min_ctas", int, "the kernel, when it reallocates registers",
                    "tk-to-gpu", "tk-kernel-attributes (.minnctapersm)", bits=32)
MAX_THREADS = Contract("tk.max_threads", int, "the kernel", "tk-to-gpu",
                       "tk-kernel-attributes (.maxntid)", bits=32)
CLUSTER = Contract("tk.cluster", int, "the kernel, when launched in clusters", "tk-to-gpu",
                   "tk-kernel-attributes (.reqnctapercluster)", bits=32)

CTA_PAIR = Contract("tk.cta_pair", bool, "the kernel's func.func and its tensor-memory ops, "
                    "when its tcgen05 MMAs pair the two blocks of a cluster (pair=True)",
                    "tk-verify (passes/tensor_memory.py)",
                    "lowering/tensor_memory.py (every tcgen05 op's cta_group::2) and the "
                    "interpreter (a commit arrives in both blocks)")

CONTRACTS = (NUM_WARPS, COUNT, CACHE, ELEMENTS, SKIP_ONES, OFFSET, STRIDE, SCRATCH_OFFSET,
             EXCHANGE_GROUP, EXCHANGE_SYNC_AFTER, SMEM_ALIGN, SMEM_BYTES, PROXY_FENCE,
             GRID_CONSTANTS, MIN_CTAS, MAX_THREADS, CLUSTER, NO_FP_CONTRACT, NARROW_STORES,
             PEER_COPIES, CTA_PAIR)
BY_NAME = {c.name: c for c in CONTRACTS}
