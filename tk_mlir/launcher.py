"""Launch plans: the per-signature code between `kernel[grid](...)` and the driver.

A kernel call must cost little host time (the bar: a bare cuLaunchKernel from
cuda-python). The first call with a new signature compiles the kernel, checks
every argument rule, and generates a small Python function specialised to
that signature and device:

    def plan(grid, args, kwargs):
        if len(args) != 4 or len(kwargs) != 1: return False       # same arity,
        if kwargs is not TRUSTED:                                  # (a launcher's: known)
            v = kwargs.get('BLOCK', MISSING)                       # constexprs (type
            if type(v) is not K0_type or v != K0: return False    # and value),
        if S0.get(N0, ABSENT) is not R0.value and not R0.fresh(): return False  # globals,
        a0, a1, a2, a3 = args                                      # tensor kinds
        if type(a0) not in TENSORS or a0.dtype is not D0 or a0.ndim != 2: return False
        key = (a0_shape, a0_strides, a0.get_device(), ...)         # checked once per key
        maps = MAPS.get((key, a0_ptr, ...))                        # tensor maps, if any
        if maps is None:
            if (a0_ptr | ...) & 15 or key not in checked: ... full_check ...
            maps = remember_maps(...)                              # encoded once
        launch(grid[0], grid[1], grid[2], stream(), a0_ptr, a0_shape[0], ..., maps[0])
        return True

A plan returns False when its guard fails (or a global read changed:
global_reads.py); the kernel then finds or makes another plan. Arguments that
are not torch tensors take the general path (`Kernel.launch_general`), which
checks every argument on every call.

This module is the one generator of launch code. The plan and tk.autotune's
quick key read a call's arguments with `read_arguments`; the plan and the
general path's `launch_values_function` compute launch values with
`launch_value_code`; the device follows `launch_device`'s rule (in generated
code, `launch_device_code`); `define` makes each generated function.
"""
from __future__ import annotations

import operator
import sys
from typing import Callable, Sequence

from .dtypes import DTYPES
from .global_reads import ABSENT
from .params import (EMPTY, GL, PGL, PYTHON_NUMBER, AbiParam, KernelParams, constexpr_tag,
                     peer_pieces)
from .runtime.arguments import ArgumentError, check_tensor, tensor_info
from .runtime.peers import PeerTensor, read_peers
from .target import TARGETS

_I32_MIN, _I32_MAX = -2**31, 2**31 - 1


def torch_tensor_types() -> tuple:
    """The tensor classes the fast path reads directly: torch.Tensor and
    nn.Parameter (weights); other subclasses take the general path."""
    torch = sys.modules.get("torch")
    return (torch.Tensor, torch.nn.Parameter) if torch is not None else ()


# ------------------------------------------------------- generated code

def define(name: str, lines: list[str], env: dict, what: str) -> Callable:
    """The function `name` that the generated source `lines` define, with
    `env` as its globals (its constants and helpers). It keeps its source as
    `.source`; tracebacks name it `<tk_mlir {what}>`."""
    source = "\n".join(lines)
    exec(compile(source, f"<tk_mlir {what}>", "exec"), env)
    fn = env[name]
    fn.source = source
    return fn


def arg_var(i: int) -> str:
    """The variable generated code holds parameter i's argument in."""
    return f"a{i}"


def read_arguments(params: KernelParams, n_positional: int, keywords, wanted,
                   env: dict) -> list[str]:
    """Lines of a generated function of (args, kwargs), for calls of one
    shape (`n_positional` positional arguments, the keyword names
    `keywords`), that put the argument of each parameter in `wanted` in its
    `arg_var`: the positional ones unpacked from `args` in one step (the
    shape fixes how many), a keyword one read from `kwargs`. One the call
    leaves to its default is that constant, in `env`: no line reads it."""
    lines = []
    if n_positional:
        lines.append(f"    {''.join(arg_var(i) + ', ' for i in range(n_positional))}= args")
    for i in sorted(set(wanted)):
        if i < n_positional:
            continue
        p = params[i]
        if p.name in keywords:
            lines.append(f"    {arg_var(i)} = kwargs[{p.name!r}]")
        else:
            assert p.default is not EMPTY, f"{p.name}: bound, so passed or defaulted"
            env[arg_var(i)] = p.default
    return lines


def launch_value_code(abi: Sequence[AbiParam], arg_vars: Sequence[str], tensor_maps,
                      env: dict) -> list[str]:
    """One Python expression per ABI parameter for its launch value, in code
    where runtime argument j is the variable `arg_vars[j]` and, for a tensor
    argument v, `{v}_ptr`, `{v}_shape` and `{v}_strides` hold its data pointer,
    shape and strides (elements). What the expressions use besides is added
    to `env`. (`tensor_maps`: CompiledKernel.tensor_maps, the box of each.)"""
    out = []
    for p in abi:
        v = arg_vars[p.arg]
        if p.kind == "tmap":
            from .runtime.tensor_maps import CACHE      # (loads the CUDA driver)
            _, rows, cols, swizzle, dtype = tensor_maps[p.index]
            env["tensor_map"] = CACHE.get
            env[f"TMAP{p.index}"] = (dtype, DTYPES[dtype].itemsize, (rows, cols, swizzle))
            out.append(f"tensor_map({v}_ptr, {v}_shape, {v}_strides, *TMAP{p.index})")
        else:
            out.append({"ptr": f"{v}_ptr", "dim": f"{v}_shape[{p.index}]",
                        "stride": f"{v}_strides[{p.index}]"}.get(p.kind, v))
    return out


def launch_values_function(abi: Sequence[AbiParam], tensor_maps) -> Callable:
    """`values(args, infos)`: the launch values from the runtime arguments
    and, per tensor argument (by runtime index), its TensorInfo. The general
    launch path's counterpart of the plan's inline code."""
    n = 1 + max((p.arg for p in abi), default=-1)
    env: dict = {}
    exprs = launch_value_code(abi, [f"r{j}" for j in range(n)], tensor_maps, env)
    tensors = sorted({p.arg for p in abi if p.kind in ("ptr", "dim", "stride", "tmap")})
    lines = ["def values(args, infos):"]
    lines += [f"    r{j} = args[{j}]" for j in range(n) if j not in tensors]
    lines += [f"    r{j}_ptr, r{j}_shape, r{j}_strides = infos[{j}].ptr, infos[{j}].shape, "
              f"infos[{j}].strides" for j in tensors]
    lines.append(f"    return ({''.join(e + ', ' for e in exprs)})")
    return define("values", lines, env, "launch values")


# ------------------------------------------------------------- the launch

def normalize_grid(grid, meta: dict | None, cluster: int = 1) -> tuple[int, int, int]:
    """The grid as three ints, within the targets' limits (max_grid, one for all).
    `grid`: an int, a tuple of 1 to 3 ints, or a function of the arguments
    by name (`meta`) returning one."""
    g = grid(meta) if callable(grid) else grid
    got = f"the grid function returned {g!r}" if callable(grid) else f"got {g!r}"
    try:
        g = tuple(_block_count(x) for x in (g if isinstance(g, (tuple, list)) else (g,)))
    except TypeError:
        g = ()
    if not 1 <= len(g) <= 3 or not all(x >= 1 for x in g):
        raise ArgumentError(f"grid must be an int or a tuple of 1 to 3 ints, each at least 1; "
                            f"{got}")
    for axis, n, limit in zip("xyz", g, min(t.max_grid for t in TARGETS.values())):
        if n > limit:
            raise ArgumentError(f"grid {g!r}: {axis} = {n} blocks is over the GPU's limit of "
                                f"{limit} along {axis} (x up to 2**31-1, y and z up to 65535); "
                                f"put the large count on x, or loop inside the kernel")
    if g[0] % cluster:
        raise ArgumentError(f"grid {g!r}: the kernel runs in clusters of {cluster} blocks along "
                            f"x (tk.use_cluster), so the grid's x must be a multiple of {cluster}")
    return g + (1,) * (3 - len(g))


def _same_constexpr(expr: str, slot: str, v, env: dict) -> list[str]:
    """Plan lines returning False unless `expr` is the very constexpr value v
    this plan was compiled for: same type and value, and for floats and
    containers the same constexpr_tag (0.0 == -0.0, (1,) == (True,))."""
    env[slot], env[f"{slot}_type"] = v, type(v)
    test = f"type({expr}) is not {slot}_type or {expr} != {slot}"
    if type(v) in (float, tuple, list, frozenset):
        env[f"{slot}_tag"] = constexpr_tag(v)
        test += f" or TAG({expr}) != {slot}_tag"
    return [f"    if {test}:", "        return False"]


def _block_count(x) -> int:
    if isinstance(x, bool):
        raise TypeError("a bool is not a block count")
    return operator.index(x)          # ints, numpy ints, 0-d integer tensors


def launch_device(tensors: dict) -> int:
    """The device a launch runs on: the one its CUDA tensor arguments
    (`name -> TensorInfo`) share; torch's current device when none says."""
    from .runtime import driver
    on = {name: info.device for name, info in tensors.items() if info.device.startswith("cuda:")}
    devices = sorted(set(on.values()))
    if len(devices) > 1:
        listing = ", ".join(f"'{n}' on {d}" for n, d in on.items())
        raise ArgumentError(f"the tensor arguments are on different devices ({listing}); a "
                            f"kernel runs on one GPU: move them to one device, e.g. "
                            f"x.to('{devices[0]}')")
    return int(devices[0].partition(":")[2]) if devices else driver.default_device()


def arguments_device(params: KernelParams, values: list) -> int:
    """launch_device for bound `values`: each tensor argument read (a tk.pgl
    one's local copy), in parameter order."""
    on = {}
    for i in sorted(params.tensors + params.peer_tensors):
        name = params[i].name
        on[name] = tensor_info(values[i], name) if params[i].kind == GL else \
            read_peers(values[i], name, tensor_info).local
    return launch_device(on)


def launch_device_code(params: KernelParams, env: dict) -> tuple[list[int], list[str], str]:
    """launch_device's answer in generated code, for calls whose tensor
    arguments are torch tensors: (the parameters it reads, the tests that
    they are what it can read, the expression). That is the first tensor
    argument's device (a tk.pgl one's local copy's), or torch's current
    device when there is none: a launch goes ahead only when its CUDA tensors
    share one device and none is on the CPU (every path checks), so the
    first one's device is launch_device's whenever there is a launch."""
    first = min(params.tensors + params.peer_tensors, default=None)
    if first is None:
        from .runtime import driver
        env["DEFAULT_DEVICE"] = driver.default_device
        return [], [], "DEFAULT_DEVICE()"
    a = arg_var(first)
    env["TENSORS"] = frozenset(torch_tensor_types())
    if params[first].kind == GL:
        return [first], [f"type({a}) in TENSORS"], f"{a}.get_device()"
    env["PEER_TENSOR"] = PeerTensor
    return ([first], [f"type({a}) is PEER_TENSOR and type({a}.local) in TENSORS"],
            f"{a}.local.get_device()")


def check_scalar(name: str, kind: str, value):
    if kind == "i32":
        if type(value) is int and not _I32_MIN <= value <= _I32_MAX:
            raise ArgumentError(f"argument '{name}' = {value} is outside the 32-bit range "
                                f"[{_I32_MIN}, {_I32_MAX}] of a run-time int (split it, or "
                                f"pass it as a tk.constexpr)")
        if type(value) is not int:
            raise ArgumentError(f"argument '{name}' = {value!r} must be an int that fits in 32 "
                                f"bits{PYTHON_NUMBER}")
    elif type(value) not in (int, float):
        raise ArgumentError(f"argument '{name}' = {value!r} must be a float{PYTHON_NUMBER}")


def _abi_variables(params: KernelParams, values: list, local: list[str], peers: set,
                   env: dict) -> tuple[list[str], list]:
    """Per argument of the compiled kernel (params.abi_arguments' order): the
    plan's variable for it, and the parameter it reads (None for a piece of
    a tk.pgl argument, whose values are put in `env` as constants)."""
    arg_vars, source = [], []
    for i in params.runtime:
        if i not in peers:
            arg_vars.append(local[i])
            source.append(i)
            continue
        pieces = peer_pieces(params[i].name, read_peers(values[i], params[i].name, tensor_info))
        for k, (name, kind, piece) in enumerate(pieces):
            v = f"P{i}_{k}"
            if kind == GL:
                env.update({f"{v}_ptr": piece.ptr, f"{v}_shape": tuple(piece.shape),
                            f"{v}_strides": tuple(piece.strides), f"{v}_info": piece,
                            f"{v}_name": name})
            else:                                   # (its rank)
                env[v] = piece
            arg_vars.append(v)
            source.append(None)
    return arg_vars, source


# Tensor-map addresses a plan remembers, per (tensor key, pointers); when
# full, the table is cleared.
_MAX_REMEMBERED_MAPS = 1024


def _remembered_maps(abi, source: list, arg_vars: list[str], values: list[str],
                     pointers: list[str], env: dict) -> tuple[list[str], list[str], list[str]]:
    """The launch values with each tensor map given by the address of its 128
    bytes (how the launch passes it), and the plan lines that find them (one
    lookup per launch, `maps`, by the tensors' key and every tensor's
    pointer, `pointers`: None when new) and that make them (encoded, or found
    in the shared cache). The map of a tk.pgl copy is a constant: found
    here, once."""
    out, varying = list(values), []
    for j, p in enumerate(abi):
        if p.kind != "tmap":
            continue
        if source[p.arg] is not None:
            varying.append(j)
            continue
        v = arg_vars[p.arg]
        m = env["tensor_map"](env[f"{v}_ptr"], env[f"{v}_shape"], env[f"{v}_strides"],
                              *env[f"TMAP{p.index}"])
        env[f"CMAP{p.index}"], env[f"CMAP{p.index}_AT"] = m, m.getPtr()   # (env keeps m)
        out[j] = f"CMAP{p.index}_AT"
    if not varying:
        return out, [], []
    env["MAPS"], env["remember_maps"] = {}, remember_maps
    find = [f"    mkey = (key, {', '.join(pointers)})",
            "    maps = MAPS.get(mkey)"]
    make = [f"        maps = remember_maps(MAPS, mkey, "
            f"({''.join(values[j] + ', ' for j in varying)}))"]
    for n, j in enumerate(varying):
        out[j] = f"maps[{n}]"
    return out, find, make


def remember_maps(table: dict, key, maps: tuple) -> tuple:
    """(address of each map's 128 bytes, ..., maps): the entry a plan keeps
    under `key`; holding the entry holds the maps, so an address is good
    while a launch uses it, whatever is cleared meanwhile."""
    entry = (*[m.getPtr() for m in maps], maps)
    if len(table) >= _MAX_REMEMBERED_MAPS:
        table.clear()
    table[key] = entry
    return entry


def trust(plan: Callable, kwargs: dict) -> Callable:
    """`plan`, from now on skipping its keyword tests for the very dict
    `kwargs`, which it has just launched with (its tests passed) and which
    nothing changes (a Kernel.launcher's own). One dict at a time: a plan two
    launchers share tests the other's keywords again (still right, if slower)."""
    plan.__globals__["TRUSTED"] = kwargs
    return plan


def torch_plan(params: KernelParams, values: list, n_positional: int, kwargs: dict,
               gl_rules: dict[int, dict], compiled, launch: Callable, stream: Callable,
               device: int, reads: tuple = (), bound: bool = False) -> Callable:
    """Generate the specialised plan for torch-tensor arguments like `values`
    (bound to `params`) on `device`; `gl_rules`: check_tensor's rule per
    tensor position; `compiled`: the CompiledKernel (its ABI parameters,
    tensor maps and cluster); `reads`: the globals the code read
    (global_reads.GlobalRead). bound=True: a plan for callers that pass
    tensors with the very metadata of `values`' (type, dtype, shape, strides,
    device, 16-byte alignment; Kernel._signature_launcher's promise): it reads
    only their addresses, and their shapes and strides are constants."""
    from .runtime.tensor_maps import check_tma_tensor
    names = params.names
    # tk.pgl arguments: the plan holds the PeerTensor it was made for (a
    # frozen grouping of tensors that do not move) and guards on identity, so
    # its copies' pointers, extents and tensor maps are read once, here.
    peers = {i for i in gl_rules if params[i].kind == PGL}
    gl_rules = {i: rule for i, rule in gl_rules.items() if i not in peers}
    env = {"TENSORS": frozenset(torch_tensor_types()), "TAIL": tuple(values[n_positional:]),
           "MISSING": object(), "launch": launch, "stream": stream, "checked": set(),
           "rejected": set(),
           "normalize_grid": normalize_grid, "full_check": None, "NAMES": names,
           "TAG": constexpr_tag, "ABSENT": ABSENT,
           "scalar_check": check_scalar, "GRIDS": {}, "CLUSTER": compiled.cluster}
    local = [arg_var(i) for i in range(len(names))]
    lines = ["def plan(grid, args, kwargs):",
             f"    if len(args) != {n_positional} or len(kwargs) != {len(kwargs)}:",
             "        return False"]
    # The keywords (constexprs, num_warps) and positional constexprs must be
    # the very values this plan was compiled for: same type, same value.
    # A call passing the very dict the plan trusts (`trust`) skips these
    # tests; until then no dict is that object.
    env["TRUSTED"] = object()
    if kwargs:
        lines.append("    if kwargs is not TRUSTED:")
    for j, (k, v) in enumerate(kwargs.items()):
        lines.append(f"        v = kwargs.get({k!r}, MISSING)")
        lines += ["    " + line for line in _same_constexpr("v", f"K{j}", v, env)]
    # The globals the code read must still hold what it saw: an identity test
    # each, the value compared only when the identity differs (global_reads.py).
    for j, r in enumerate(reads):
        env[f"R{j}"], env[f"S{j}"], env[f"N{j}"] = r, r.scope, r.name
        test = f"not R{j}.fresh()" if r.volatile else \
            f"S{j}.get(N{j}, ABSENT) is not R{j}.value and not R{j}.fresh()"
        lines += [f"    if {test}:",
                  "        return False   # a global changed: recompile"]
    # (The keywords are constexprs, fixed above: the arguments the code
    # below reads are positional or defaults.)
    lines += read_arguments(params, n_positional, kwargs, params.runtime, env)
    for i in params.constexprs:
        if i < n_positional:
            lines += _same_constexpr(local[i], f"C{i}", values[i], env)
    # (The rank is in the shapes of `key` below: a tensor of another rank
    # fails full_check, and the kernel plans for its specialization.)
    for i in gl_rules if not bound else ():
        env[f"D{i}"] = values[i].dtype
        a = local[i]
        lines.append(f"    if type({a}) not in TENSORS or {a}.dtype is not D{i}:")
        lines.append("        return False")
    for i in peers:
        env[f"P{i}"] = values[i]
        lines += [f"    if {local[i]} is not P{i}:", "        return False"]
    abi = compiled.params
    arg_vars, source = _abi_variables(params, values, local, peers, env)
    for p in abi:              # (the peer copies' launch values are fixed: check them once)
        if p.kind == "tmap" and source[p.arg] is None:
            check_tma_tensor(env[f"{arg_vars[p.arg]}_name"], env[f"{arg_vars[p.arg]}_info"])
    scalars = {source[p.arg]: p.kind for p in abi
               if p.kind in ("i32", "f32") and source[p.arg] is not None}
    for pos, kind in scalars.items():
        ok = f"type({local[pos]}) is int" if kind == "i32" else \
            f"(type({local[pos]}) is float or type({local[pos]}) is int)"
        lines.append(f"    if not {ok}:")
        lines.append("        return False")
    for i in gl_rules:
        a = local[i]
        if bound:           # (the code reads {a}_shape and {a}_strides from env)
            env[f"{a}_shape"], env[f"{a}_strides"] = values[i].shape, values[i].stride()
            lines.append(f"    {a}_ptr = {a}.data_ptr()")
        else:
            lines.append(f"    {a}_ptr = {a}.data_ptr(); {a}_strides = {a}.stride(); "
                         f"{a}_shape = {a}.shape")
    launch_values = launch_value_code(abi, arg_vars, compiled.tensor_maps, env)
    launch_values, find_maps, make_maps = _remembered_maps(
        abi, source, arg_vars, launch_values, [f"{local[i]}_ptr" for i in gl_rules], env)
    if gl_rules and bound:      # (checked by the plan that launched them first)
        env["KEY"] = tuple(values[i].shape for i in gl_rules)
        lines += ["    key = KEY"] + find_maps + ["    if maps is None:"] + make_maps \
            if find_maps else []
    elif gl_rules:
        # The device index is in the key: a tensor on another device than the
        # one this plan launches on fails full_check.
        key = ", ".join(f"{local[i]}_shape, {local[i]}_strides, {local[i]}.get_device()"
                        for i in gl_rules)
        ptrs = " | ".join(f"{local[i]}_ptr" for i in gl_rules)
        # Keys full_check turned away (another device or rank) are remembered,
        # so tensors alternating between devices cost a set test, not a check.
        check = [f"    if ({ptrs}) & 15 or key not in checked:",
                 "        if key in rejected:",
                 "            return False",
                 "        if not full_check(args + TAIL):",
                 "            if len(rejected) < 4096:",
                 "                rejected.add(key)",
                 "            return False   # tensors on another device: another plan",
                 "        checked.add(key)"]
        lines.append(f"    key = ({key},)")
        # Remembered maps were made for checked tensors at these pointers: a
        # launch that finds them skips the check.
        lines += find_maps + ["    if maps is None:"] + ["    " + c for c in check] + make_maps \
            if find_maps else check
    for pos, kind in scalars.items():
        if kind == "i32":
            lines.append(f"    if not {_I32_MIN} <= {local[pos]} <= {_I32_MAX}:")
            lines.append(f"        scalar_check(NAMES[{pos}], 'i32', {local[pos]})")
    # A grid seen before (a tuple or int, or what a grid function returned)
    # was validated then; a grid function still runs per launch (it reads
    # the arguments).
    lines += ["    g = GRIDS.get(grid) if type(grid) is tuple or type(grid) is int else None",
              "    if g is None:",
              "        if callable(grid):",
              "            grid = grid(dict(zip(NAMES, args + TAIL)))",
              "        g = GRIDS.get(grid) if type(grid) is tuple or type(grid) is int else None",
              "        if g is None:",
              "            g = normalize_grid(grid, None, CLUSTER)",
              "            if (type(grid) is tuple or type(grid) is int) and len(GRIDS) < 4096:",
              "                GRIDS[grid] = g",
              "    grid = g",
              f"    launch(grid[0], grid[1], grid[2], stream(), {', '.join(launch_values)})",
              "    return True"]

    with_maps = {source[p.arg] for p in abi if p.kind == "tmap"}

    def full_check(all_values) -> bool:
        infos = [tensor_info(all_values[i], names[i]) for i in gl_rules]
        if any(info.device != f"cuda:{device}" for info in infos if info.device.startswith("cuda:")):
            return False     # the kernel (re)plans for the device the tensors are on
        if any(len(info.shape) != rule["rank"] for info, rule in zip(infos, gl_rules.values())):
            return False     # another rank: another specialization (or the rank error)
        for info, (i, rule) in zip(infos, gl_rules.items()):
            check_tensor(info, names[i], **rule)
            if i in with_maps:
                check_tma_tensor(names[i], info)
        return True
    env["full_check"] = full_check
    return define("plan", lines, env, "launch plan")
