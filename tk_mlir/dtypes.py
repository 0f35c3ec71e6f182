"""The one table of element types, read by every layer.

A row names a dtype once for each world it meets: the tk name kernels write
(`bf16`), its MLIR spelling, its size, torch's (and numpy's / ml_dtypes')
name, the `__cuda_array_interface__` typestrs, the TMA data type and the
wgmma operand type. Layers read the column they need; none keeps a table of
its own. This module imports nothing, so the lowest layer may read it.

Invariants: names are unique in every column that is not None; a dtype with
an `mlir` spelling is a tile dtype (registers); a `memory` dtype is also held
by shared tiles, loads, stores, TMA and MMA; an `argument` dtype may be held
by a kernel's gl argument (memory dtypes, and i32 for counters and index
tables); the rest are named only to refuse them clearly.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ElementType:
    """One row: a dtype as each layer names it."""
    name: str                       # the tk name: tk.bf16.name, "--arg bf16[...]"
    itemsize: int                   # bytes per element
    mlir: str | None = None         # the MLIR type spelling (None: not a tile dtype)
    torch: str | None = None        # torch.<name>; also numpy's / ml_dtypes' name
    typestr: tuple[str, ...] = ()   # __cuda_array_interface__ typestrs (none: bf16, fp8)
    tensor_map: str | None = None   # CU_TENSOR_MAP_DATA_TYPE_<this>
    wgmma: str | None = None        # nvvm.WGMMATypes.<this>
    memory: bool = False            # in shared tiles and memory ops, not registers only
    argument: bool = False          # a kernel's gl argument may hold it
    float: bool = False             # a floating-point type


def _by_name(*rows: ElementType) -> dict[str, ElementType]:
    return {r.name: r for r in rows}


def _memory_float(name, itemsize, mlir, torch, typestr, tensor_map, wgmma=None) -> ElementType:
    return ElementType(name, itemsize, mlir, torch, typestr, tensor_map, wgmma, memory=True,
                 argument=True, float=True)


DTYPES: dict[str, ElementType] = _by_name(
    _memory_float("bf16", 2, "bf16", "bfloat16", (), "BFLOAT16", "bf16"),
    _memory_float("f16", 2, "f16", "float16", ("<f2",), "FLOAT16", "f16"),
    _memory_float("f32", 4, "f32", "float32", ("<f4",), "FLOAT32"),
    # fp8: TMA copies bytes (sm_90 has no fp8 tensor-map type)
    _memory_float("f8e4m3", 1, "f8E4M3FN", "float8_e4m3fn", (), "UINT8", "e4m3"),
    _memory_float("f8e5m2", 1, "f8E5M2", "float8_e5m2", (), "UINT8", "e5m2"),
    # Indices and masks live in registers; an i32 tensor is an argument
    # (counters, sizes, index tables) read element by element.
    ElementType("i32", 4, "i32", "int32", ("<i4",), argument=True),
    ElementType("bool", 1, "i1", torch="bool"),
    # Named only to refuse them by name: no kernel takes them.
    ElementType("f64", 8, torch="float64", typestr=("<f8",), float=True),
    ElementType("i8", 1, torch="int8", typestr=("|i1", "<i1")),
    ElementType("u8", 1, torch="uint8", typestr=("|u1", "<u1")),
    ElementType("i16", 2, torch="int16", typestr=("<i2",)),
    ElementType("i64", 8, torch="int64", typestr=("<i8",)),
)

TILE_DTYPES = {n: d for n, d in DTYPES.items() if d.mlir}           # register tiles
MEMORY_DTYPES = tuple(n for n, d in DTYPES.items() if d.memory)     # shared / memory ops
ARGUMENT_DTYPES = tuple(n for n, d in DTYPES.items() if d.argument)  # gl arguments
BY_TORCH_NAME = {d.torch: n for n, d in DTYPES.items() if d.torch}
BY_TYPESTR = {s: n for n, d in DTYPES.items() for s in d.typestr}
BY_MLIR = {d.mlir: n for n, d in TILE_DTYPES.items()}
