"""tk-to-gpu: rebuild a tk kernel (func.func) as a gpu.func in a gpu.module.

The walk goes op by op in program order, keeping a map from each tk-level
value to what it became: an SSA value, a `Fragment` (a register tile's
per-thread registers), or a reference to global/shared memory. tk ops go to
their registered lowering (lowering/{threads,memory,compute,reduce}.py);
scf.for/scf.if are rebuilt with tiles flattened into their registers (a tile
carried by a loop becomes one iter_arg per register); other ops (arith) are
cloned with remapped operands.

The kernel's parameters, in order, per tk argument:
  !tk.gl  -> !llvm.ptr<1>, one i32 per dynamic dim, one i64 stride (elements)
             per dim but the last (which is contiguous)
  i32/f32 -> itself
then one tensor map per (tensor, TMA box) the kernel's TMA ops use: a
generic !llvm.ptr to a 128-byte __grid_constant__ parameter (its attributes
are set on the llvm.func by `set_kernel_attributes`, after convert-gpu-to-nvvm,
which drops them from a gpu.func).
"""
from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, gpu, llvm, scf

from ..dialects import contracts as C, tk, types as T
from ..errors import error_at
from ..params import AbiParam
from .. import target
from . import (atomic, compute, masks, memory, mma, peers, reduce, flags, mbarriers,  # noqa: F401
               tensor_memory, threads, tma)  # (register their lowerings)
from .context import LOWERINGS, LoweringContext, c32, i32, i64, ptr
from .fragments import Fragment, GlobalRef, layout_of
from .mbarriers import init_semaphores
from .tma import TensorMapSpec, tensor_arguments, tensor_map_spec

GPU_MODULE = "tk_kernels"
SMEM_SYMBOL = "__tk_smem"


def tensor_map_specs(func) -> list[TensorMapSpec]:
    """The tensor maps the kernel's TMA ops use, in first-use order."""
    specs: list[TensorMapSpec] = []
    def visit(op):
        pair = tk.tma_operands(op)
        if pair is not None:
            gl, st = pair
            for arg in tensor_arguments(gl):
                spec = tensor_map_spec(arg.arg_number, T.parse(st.type))
                if spec not in specs:
                    specs.append(spec)
        return ir.WalkResult.ADVANCE
    func.operation.walk(visit)
    return specs


def kernel_params(arg_types: list[ir.Type], specs=()) -> list[AbiParam]:
    params = []
    for i, t in enumerate(arg_types):
        tk_t = T.parse(t)
        if isinstance(tk_t, T.GL):
            params.append(AbiParam(i, "ptr"))
            params += [AbiParam(i, "dim", d) for d, n in enumerate(tk_t.shape) if n is None]
            params += [AbiParam(i, "stride", d) for d in range(tk_t.rank - 1)]
        elif isinstance(t, ir.IntegerType):
            params.append(AbiParam(i, "i32"))
        elif isinstance(t, ir.F32Type):
            params.append(AbiParam(i, "f32"))
        else:
            raise TypeError(f"unsupported kernel argument type {t}")
    params += [AbiParam(spec.arg, "tmap", i) for i, spec in enumerate(specs)]
    return params


_PARAM_TYPES = {"ptr": lambda: ptr(1), "dim": i32, "stride": i64, "i32": i32,
                "f32": ir.F32Type.get, "tmap": lambda: ir.Type.parse("!llvm.ptr")}


def lower_to_gpu(module: ir.Module) -> tuple[ir.Module, list[AbiParam], list[TensorMapSpec], int]:
    """The gpu module of the tk kernel in `module`, its parameters, its
    tensor maps, and how many stores lane exchanges widened."""
    (func,) = module.body.operations
    name = ir.StringAttr(func.attributes["sym_name"]).value
    num_warps = C.NUM_WARPS.get(func)
    smem_bytes = C.SMEM_BYTES.get(func)
    entry = func.regions[0].blocks[0]
    specs = tensor_map_specs(func)
    params = kernel_params([a.type for a in entry.arguments], specs)

    out = ir.Module.create(func.location)
    out.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
    with ir.InsertionPoint(out.body), func.location:
        chip = target.current()     # one of target.TARGETS: a pair LLVM supports
        gmod = gpu.GPUModuleOp(GPU_MODULE, targets=ir.ArrayAttr.get([ir.Attribute.parse(
            f'#nvvm.target<chip = "{chip.arch}", features = "{chip.ptx_features}", '
            f'O = 3>')]))
        gmod.bodyRegion.blocks.append()
    with ir.InsertionPoint(gmod.bodyRegion.blocks[0]), func.location:
        if smem_bytes:
            # External linkage: ptxas demotes an internal zero-size global to a
            # static .shared variable at a fixed offset, which may overlap others.
            llvm.mlir_global(ir.Type.parse("!llvm.array<0 x i8>"), SMEM_SYMBOL,
                             ir.Attribute.parse("#llvm.linkage<external>"),
                             addr_space=3, alignment=16)
        fn_type = ir.FunctionType.get([_PARAM_TYPES[p.kind]() for p in params], [])
        kernel = gpu.GPUFuncOp(fn_type, sym_name=name, kernel=True,
                               known_block_size=[32 * num_warps, 1, 1])
        body = kernel.body.blocks.append(*fn_type.inputs)
    ctx = LoweringContext(num_warps)
    ctx.cluster = cluster_size(func)
    ctx.fp_contract = not C.NO_FP_CONTRACT.get(func, False)
    ctx.widen_stores = not C.NARROW_STORES.get(func, False)
    ctx.exchange_groups = _exchange_groups(func)
    ctx.calls_allowed = not _issues_async_mma(func)
    with ir.InsertionPoint(body), func.location:
        _bind_arguments(ctx, entry, params, body.arguments)
        for p, spec_value in zip(params, body.arguments):
            if p.kind == "tmap":
                ctx.tensor_maps[specs[p.index]] = spec_value
        if smem_bytes:
            align = C.SMEM_ALIGN.get(func, None)
            ctx.smem_base = _aligned_smem_base(align) if align else \
                llvm.mlir_addressof(ptr(3), SMEM_SYMBOL)
        ctx.lane(), ctx.uniform_warp()   # at the top, so they dominate every use
        init_semaphores(ctx, [op for op in entry.operations if op.name == "tk.alloc_sem"])
        _lower_block(ctx, entry)
        ctx.drop_unused_uniform_warp()   # (the others, unused, are DCE'd)
    C.GRID_CONSTANTS.set(kernel, tuple(i for i, p in enumerate(params) if p.kind == "tmap"))
    if ctx.uses_setmaxnreg:   # ptxas ignores setmaxnreg without .minnctapersm (C7508)
        C.MIN_CTAS.set(kernel, 1)
    C.MAX_THREADS.set(kernel, 32 * num_warps)
    if ctx.cluster > 1:
        C.CLUSTER.set(kernel, ctx.cluster)
    return out, params, specs, ctx.widened_stores


def cluster_size(func) -> int:
    """The kernel's cluster size (tk.use_cluster at its top level), 1 without."""
    for op in func.regions[0].blocks[0].operations:
        if op.name == "tk.use_cluster":
            return op.opview.size
    return 1


def _aligned_smem_base(align: int) -> ir.Value:
    """The dynamic shared memory base rounded up to `align` (passes/smem.py
    asks for that much more): swizzle patterns follow absolute address bits,
    and LLVM must not assume the alignment (it would fold the rounding)."""
    base = llvm.mlir_addressof(ptr(3), SMEM_SYMBOL)
    addr = llvm.ptrtoint(i32(), base)
    aligned = arith.andi(arith.addi(addr, c32(align - 1)), c32(-align))
    return llvm.getelementptr(ptr(3), base, [arith.subi(aligned, addr)], [-2**31],
                              ir.IntegerType.get_signless(8), llvm.GEPNoWrapFlags.inbounds)


def set_kernel_attributes(module: ir.Module) -> None:
    """After convert-gpu-to-nvvm: tensor-map parameters become 128-byte
    __grid_constant__ byval parameters, and kernels that reallocate registers
    get .minnctapersm 1 and .maxntid."""
    def visit(op):
        if op.name != "llvm.func" or not C.GRID_CONSTANTS.has(op):
            return ir.WalkResult.ADVANCE
        grid_constants = C.GRID_CONSTANTS.get(op)
        if grid_constants:
            n = len(op.regions[0].blocks[0].arguments)
            arg_attrs = [ir.DictAttr.get({}) for _ in range(n)]
            for i in grid_constants:
                arg_attrs[i] = ir.DictAttr.get({
                    "llvm.byval": ir.TypeAttr.get(ir.Type.parse("!llvm.array<128 x i8>")),
                    "llvm.align": ir.IntegerAttr.get(i64(), 64),
                    "nvvm.grid_constant": ir.UnitAttr.get()})
            op.attributes["arg_attrs"] = ir.ArrayAttr.get(arg_attrs)
        if C.MIN_CTAS.has(op):
            op.attributes["nvvm.minctasm"] = ir.IntegerAttr.get(i32(), C.MIN_CTAS.get(op))
            op.attributes["nvvm.maxntid"] = ir.DenseI32ArrayAttr.get(
                [C.MAX_THREADS.get(op), 1, 1])
        if C.CLUSTER.has(op):     # .reqnctapercluster: a plain launch forms clusters
            op.attributes["nvvm.cluster_dim"] = ir.DenseI32ArrayAttr.get(
                [C.CLUSTER.get(op), 1, 1])
        for contract in (C.GRID_CONSTANTS, C.MIN_CTAS, C.MAX_THREADS, C.CLUSTER):
            contract.remove(op)
        return ir.WalkResult.ADVANCE
    module.operation.walk(visit)


def _bind_arguments(ctx: LoweringContext, entry, params: list[AbiParam], new_args) -> None:
    by_arg: dict[int, dict] = {}
    for p, v in zip(params, new_args):
        by_arg.setdefault(p.arg, {})[(p.kind, p.index)] = v
    for i, old in enumerate(entry.arguments):
        t, got = T.parse(old.type), by_arg[i]
        if isinstance(t, T.GL):
            dims = [got[("dim", d)] if n is None else c32(n) for d, n in enumerate(t.shape)]
            strides = [got[("stride", d)] for d in range(t.rank - 1)]
            ctx.bind(old, GlobalRef(got[("ptr", 0)], dims, strides, t))
        else:
            ctx.bind(old, next(iter(got.values())))


def _issues_async_mma(func) -> bool:
    found = []
    def visit(op):
        d = tk.op_def(op)
        if d is not None and d.async_result:
            found.append(op)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE
    func.operation.walk(visit)
    return bool(found)


def _exchange_groups(func) -> dict[int, list]:
    """The reductions passes/smem.py grouped to share one cross-warp exchange."""
    groups: dict[int, list] = {}
    def visit(op):
        if C.EXCHANGE_GROUP.has(op):
            groups.setdefault(C.EXCHANGE_GROUP.get(op), []).append(op.opview)
        return ir.WalkResult.ADVANCE
    func.operation.walk(visit)
    return groups


# --------------------------------------------------------------- the walk

def _flatten(x) -> list[ir.Value]:
    if isinstance(x, Fragment):
        return list(x.regs)
    if isinstance(x, ir.Value):
        return [x]
    raise TypeError(f"{type(x).__name__} cannot cross a loop or branch boundary")


def _unflatten(ctx: LoweringContext, t: ir.Type, values: list[ir.Value]):
    """Rebuild what a tk value of type t lowers to from its flattened values;
    returns (the value, how many of `values` it used)."""
    tk_t = T.parse(t)
    if isinstance(tk_t, (T.RT, T.RV)):
        layout = layout_of(tk_t, ctx.num_warps)
        n = layout.num_regs
        return Fragment(list(values[:n]), layout, tk_t.dtype, tk_t.scope), n
    return values[0], 1


def _bind_flat(ctx: LoweringContext, olds, flat: list[ir.Value]) -> None:
    k = 0
    for old in olds:
        value, used = _unflatten(ctx, old.type, flat[k:])
        ctx.bind(old, value)
        k += used


def _lower_block(ctx: LoweringContext, block) -> list[ir.Value] | None:
    """Lower the ops of `block`; return the flattened operands of its terminator
    (scf.yield) for the caller to yield."""
    for op in block.operations:
        name = op.operation.name
        with op.location:
            if name in LOWERINGS:
                _apply(ctx, LOWERINGS[name], op)
            elif name == "scf.for":
                _lower_for(ctx, op)
            elif name == "scf.if":
                _lower_if(ctx, op)
            elif name == "scf.yield":
                return [v for o in op.operands for v in _flatten(ctx.lookup(o))]
            elif name == "func.return":
                gpu.ReturnOp([])
            elif name.startswith("tk."):
                raise error_at(op.location, f"no lowering for {name}")
            else:
                _clone(ctx, op)
    return None


def _apply(ctx: LoweringContext, rule, op) -> None:
    """Run op's lowering rule on what its operands became; bind its result."""
    out = rule(ctx, op, *[ctx.lookup(v) for v in op.operation.operands])
    results = op.operation.results
    if len(results):
        ctx.bind(results[0], out)
    else:
        assert out is None, f"{op.operation.name} has no result, its rule returned {out!r}"


def _clone(ctx: LoweringContext, op) -> None:
    if op.operation.regions and any(len(r.blocks) for r in op.operation.regions):
        raise error_at(op.location, f"cannot lower {op.operation.name} (it has regions)")
    new = op.operation.clone()
    for i, v in enumerate(op.operation.operands):
        new.operands[i] = ctx.lookup(v)
    for old, r in zip(op.operation.results, new.results):
        ctx.bind(old, r)


def _lower_for(ctx: LoweringContext, op) -> None:
    inits = [v for o in op.initArgs for v in _flatten(ctx.lookup(o))]
    loop = scf.ForOp(ctx.lookup(op.lowerBound), ctx.lookup(op.upperBound),
                     ctx.lookup(op.step), inits)
    outside = dict(ctx.in_flight)
    with ir.InsertionPoint(loop.body):
        ctx.bind(op.induction_variable, loop.induction_variable)
        _bind_flat(ctx, op.inner_iter_args, list(loop.inner_iter_args))
        ctx.depth += 1
        scf.YieldOp(_lower_block(ctx, op.body))
        ctx.depth -= 1
    yielded = list(op.body.operations)[-1].operands
    # MMA accumulators still in flight leave the loop as its results.
    ctx.in_flight = {v: d for v, d in outside.items() if v in ctx.in_flight} | \
        {r: ctx.depth for r, y in zip(op.results, yielded) if y in ctx.in_flight}
    _bind_flat(ctx, op.results, list(loop.results))


def _lower_if(ctx: LoweringContext, op) -> None:
    # Result types are only known after lowering the branches (a tile result
    # becomes N registers): lower into a result-less scf.if first, then move.
    draft = scf.IfOp(ctx.lookup(op.condition), [], has_else=len(op.elseRegion.blocks) > 0)
    outside = dict(ctx.in_flight)
    ctx.depth += 1
    yields, in_flight_results = [], set()
    for old_block, new_block in ((op.then_block, draft.then_block),
                                 (op.else_block if len(op.elseRegion.blocks) else None,
                                  draft.else_block if len(op.elseRegion.blocks) else None)):
        if old_block is None:
            continue
        ctx.in_flight = dict(outside)       # each branch sees only what came before the if
        with ir.InsertionPoint(new_block):
            yields.append(_lower_block(ctx, old_block) or [])
        yielded = list(old_block.operations)[-1].operands
        in_flight_results |= {r for r, y in zip(op.results, yielded) if y in ctx.in_flight}
    ctx.depth -= 1
    # (Outer accumulators are fenced only at their own depth, so both branches
    # leave them in flight.) Results yielded from in-flight MMAs stay in flight.
    ctx.in_flight = outside | {r: ctx.depth for r in in_flight_results}
    types = [v.type for v in yields[0]]
    final = scf.IfOp(ctx.lookup(op.condition), types, has_else=len(yields) > 1,
                     ip=ir.InsertionPoint(draft))
    blocks = [(draft.then_block, final.then_block)]
    if len(yields) > 1:
        blocks.append((draft.else_block, final.else_block))
    for (old, new), values in zip(blocks, yields):
        with ir.InsertionPoint(new):
            terminator = scf.YieldOp(values)
        for inner in list(old.operations):
            inner.move_before(terminator)
    draft.operation.erase()
    _bind_flat(ctx, op.results, list(final.results))
