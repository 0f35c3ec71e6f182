"""Launch plans: the per-signature code between `kernel[grid](...)` and the driver.

A kernel call must cost little host time (the bar: a bare cuLaunchKernel
from cuda-python). So the first call with a new signature compiles the
kernel, checks every argument rule, and generates a small Python function
specialised to that signature (like Triton's generated launchers):

    def plan(grid, args, kwargs):
        if len(args) != 4 or len(kwargs) != 1: return False       # the guard: same
        v = kwargs.get('BLOCK', MISSING)                           # constexprs (type
        if type(v) is not KT0 or v != K0: return False             # and value), same
        a0, a1, a2, a3 = args                                      # tensor kinds
        if type(a0) not in TENSORS or a0.dtype is not D0 or a0.ndim != 2: return False
        ...
        p0 = a0.data_ptr(); s0 = a0.stride(); d0 = a0.shape ...
        key = (d0, s0, a0.get_device(), ...)
        if (p0 | ...) & 15 or key not in checked: ... full_check ...; checked.add(key)
        ... the grid, validated once per distinct tuple ...
        launch(grid[0], grid[1], grid[2], stream(), p0, d0[0], s0[0], ...)
        return True

A call whose arguments do not pass the guard goes back to the kernel, which
finds or makes another plan. Arguments that are not torch tensors take the
general path (`Kernel.launch_general`), which reads and checks every
argument on every call.
"""
from __future__ import annotations

import sys
from typing import Callable

from .runtime.arguments import ITEMSIZES as _ITEMSIZE, ArgumentError, check_tensor, tensor_info

_I32_MIN, _I32_MAX = -2**31, 2**31 - 1
# How each kind of kernel parameter (lowering/kernel.py) is passed to the driver.
PASSED_AS = {"ptr": "ptr", "dim": "i32", "stride": "i64", "i32": "i32", "f32": "f32",
             "tmap": "tmap"}


def torch_tensor_types() -> tuple:
    """The tensor classes the fast path reads directly: torch.Tensor and
    nn.Parameter (weights); other subclasses take the general path."""
    torch = sys.modules.get("torch")
    return (torch.Tensor, torch.nn.Parameter) if torch is not None else ()


def normalize_grid(grid, meta: dict, cluster: int = 1) -> tuple[int, int, int]:
    g = grid(meta) if callable(grid) else grid
    g = (g,) if isinstance(g, int) else tuple(g)
    if not 1 <= len(g) <= 3 or not all(isinstance(x, int) and not isinstance(x, bool)
                                       and 1 <= x < 2**31 for x in g):
        raise ArgumentError(f"grid must be 1 to 3 ints from 1 to 2**31-1, got {g!r}")
    if g[0] % cluster:
        raise ArgumentError(f"grid {g!r}: the kernel runs in clusters of {cluster} blocks along "
                            f"x (tk.use_cluster), so the grid's x must be a multiple of {cluster}")
    return g + (1,) * (3 - len(g))


def check_device(info, name: str, device: int) -> None:
    """Every tensor must live on the device the kernel is launched on."""
    index = info.device.partition(":")[2]
    if index and int(index) != device:
        raise ArgumentError(f"argument '{name}' is on {info.device}, but the kernel launches on "
                            f"cuda:{device} (torch's current device); move it, or launch under "
                            f"`with torch.cuda.device({index}):`")


def check_scalar(name: str, kind: str, value):
    if kind == "i32":
        if type(value) is not int or not _I32_MIN <= value <= _I32_MAX:
            raise ArgumentError(f"argument '{name}' = {value!r} must be an int that fits in 32 bits")
    elif type(value) not in (int, float):
        raise ArgumentError(f"argument '{name}' = {value!r} must be a float")


def tensor_map_arg(info, box, name: str):
    """The tensor map of tensor argument `name` for `box` (rows, cols, swizzle)."""
    from .runtime.tensor_maps import check_tma_tensor, tensor_map
    check_tma_tensor(name, info)
    return tensor_map(info, box)


def torch_plan(names: list[str], values: list, n_positional: int, kwargs: dict,
               constexprs: list[int], gl_rules: dict[int, dict],
               params: list[tuple[int, str, int]], launch: Callable, stream: Callable,
               device: int, tensor_maps: list[tuple] = (), cluster: int = 1,
               reads: tuple = ()) -> Callable:
    """Generate the specialised plan for torch-tensor arguments like `values`
    (`constexprs`: positions of the compile-time parameters; `tensor_maps`:
    the box of each "tmap" parameter, CompiledKernel.tensor_maps; `reads`:
    the globals the code read, global_reads.GlobalRead)."""
    from .runtime.tensor_maps import CACHE, check_tma_tensor
    env = {"TENSORS": frozenset(torch_tensor_types()), "TAIL": tuple(values[n_positional:]),
           "MISSING": object(), "launch": launch, "stream": stream, "checked": set(),
           "normalize_grid": normalize_grid, "full_check": None, "NAMES": names,
           "scalar_check": check_scalar, "GRIDS": {}, "maps": CACHE.get, "CLUSTER": cluster}
    local = [f"a{i}" for i in range(len(names))]
    lines = ["def plan(grid, args, kwargs):",
             f"    if len(args) != {n_positional} or len(kwargs) != {len(kwargs)}:",
             "        return False"]
    # The keywords (constexprs, num_warps) and positional constexprs must be
    # the very values this plan was compiled for: same type, same value.
    for j, (k, v) in enumerate(kwargs.items()):
        env[f"K{j}"], env[f"KT{j}"] = v, type(v)
        lines += [f"    v = kwargs.get({k!r}, MISSING)",
                  f"    if type(v) is not KT{j} or v != K{j}:",
                  "        return False"]
    # The globals the code read must still hold what it saw: an identity test
    # each, the value compared only when the identity differs (global_reads.py).
    for j, r in enumerate(reads):
        env[f"R{j}"], env[f"S{j}"], env[f"N{j}"] = r, r.scope, r.name
        test = f"not R{j}.fresh()" if r.volatile else \
            f"S{j}.get(N{j}) is not R{j}.value and not R{j}.fresh()"
        lines += [f"    if {test}:",
                  "        return False   # a global changed: recompile"]
    if n_positional:
        lines.append(f"    {', '.join(local[:n_positional])}{',' if n_positional == 1 else ''}"
                     f" = args")
    for i in range(n_positional, len(names)):
        lines.append(f"    {local[i]} = TAIL[{i - n_positional}]")
    for i in constexprs:
        if i < n_positional:
            env[f"C{i}"], env[f"CT{i}"] = values[i], type(values[i])
            lines += [f"    if type({local[i]}) is not CT{i} or {local[i]} != C{i}:",
                      "        return False"]
    for i in gl_rules:
        env[f"D{i}"] = values[i].dtype
        a = local[i]
        lines.append(f"    if type({a}) not in TENSORS or {a}.dtype is not D{i} or "
                     f"{a}.ndim != {values[i].ndim}:")
        lines.append("        return False")
    scalars = {pos: kind for pos, kind, _ in params if kind in ("i32", "f32")}
    for pos, kind in scalars.items():
        ok = f"type({local[pos]}) is int" if kind == "i32" else \
            f"(type({local[pos]}) is float or type({local[pos]}) is int)"
        lines.append(f"    if not {ok}:")
        lines.append("        return False")
    for i in gl_rules:
        lines.append(f"    p{i} = {local[i]}.data_ptr(); s{i} = {local[i]}.stride(); "
                     f"d{i} = {local[i]}.shape")
    if gl_rules:
        # The device index is in the key: a tensor on another device than the
        # one this plan launches on fails full_check.
        key = ", ".join(f"d{i}, s{i}, {local[i]}.get_device()" for i in gl_rules)
        ptrs = " | ".join(f"p{i}" for i in gl_rules)
        lines += [f"    key = ({key},)",
                  f"    if ({ptrs}) & 15 or key not in checked:",
                  "        if not full_check(args + TAIL):",
                  "            return False   # tensors on another device: another plan",
                  "        checked.add(key)"]
    for pos, kind in scalars.items():
        if kind == "i32":
            lines.append(f"    if not {_I32_MIN} <= {local[pos]} <= {_I32_MAX}:")
            lines.append(f"        scalar_check(NAMES[{pos}], 'i32', {local[pos]})")
    values_code = []
    for pos, kind, dim in params:
        if kind == "tmap":
            _, rows, cols, swizzle, dtype = tensor_maps[dim]
            env[f"BOX{dim}"] = (rows, cols, swizzle)
            env[f"T{dim}"] = (dtype, _ITEMSIZE[dtype])
            values_code.append(f"maps(p{pos}, d{pos}, s{pos}, *T{dim}, BOX{dim})")
            continue
        values_code.append({"ptr": f"p{pos}", "dim": f"d{pos}[{dim}]",
                            "stride": f"s{pos}[{dim}]"}.get(kind, local[pos]))
    lines += ["    g = GRIDS.get(grid) if type(grid) is tuple else None   # validated before",
              "    if g is None:",
              "        g = normalize_grid(grid, dict(zip(NAMES, args + TAIL)), CLUSTER)",
              "        if type(grid) is tuple and len(GRIDS) < 4096:",
              "            GRIDS[grid] = g",
              "    grid = g",
              f"    launch(grid[0], grid[1], grid[2], stream(), {', '.join(values_code)})",
              "    return True"]

    with_maps = {pos for pos, kind, _ in params if kind == "tmap"}

    def full_check(all_values) -> bool:
        infos = [tensor_info(all_values[i], names[i]) for i in gl_rules]
        if any(info.device != f"cuda:{device}" for info in infos if info.device.startswith("cuda:")):
            return False     # the kernel (re)planned for the device the tensors are on
        for info, (i, rule) in zip(infos, gl_rules.items()):
            check_tensor(info, names[i], **rule)
            if i in with_maps:
                check_tma_tensor(names[i], info)
        return True
    env["full_check"] = full_check
    exec(compile("\n".join(lines), "<tk_mlir launch plan>", "exec"), env)
    plan = env["plan"]
    plan.source = "\n".join(lines)
    return plan
