"""The tk.* functions a kernel calls (re-exported as `tk.load`, `tk.zeros`, ...).

Coordinates follow ThunderKittens: one index per dimension of the global
tensor; the last two (one, for a vector) count *tiles*, the outer ones count
elements. `tk.load(X, (b, r, 0), (64, 128))` reads rows 64*r .. 64*r+63 and
columns 0 .. 127 of X[b]. Tiles that run past the tensor's end are masked:
missing elements read as `fill`, and stores skip them.
"""
from __future__ import annotations

from mlir import ir

from .dialects import tk as tk_dialect, types as T
from .errors import CompilationError
from .language import builtin, compile_time_int, dtype_name, f32
from .values import (Global, Scalar, Shared, SharedVector, TensorTile, Tile, TileLike, as_scalar,
                     builds,
                     emit, fill as _fill, i32, int_operand, scalar_operand, tile_shape, wrap)

__all__ = ["block_id", "grid_dim", "num_warps", "thread_id", "lane_id", "warp_id", "warpgroup_id",
           "load", "store", "copy", "zeros", "full", "shared_tile", "shared_tiles", "barrier",
           "where", "shared_vector", "shared_vectors", "atomic_add", "store_partial"]


def _index(name: str, **attrs) -> Scalar:
    return Scalar(emit(name, [], i32(), **attrs))


def _dim(dim) -> int:
    if dim not in (0, 1, 2):
        raise CompilationError(f"dim must be 0, 1 or 2 (x, y, z), got {dim!r}")
    return dim


@builtin
@builds('block_id')
def block_id(dim=0) -> Scalar:
    """blockIdx along x (0), y (1) or z (2)."""
    return _index("block_id", dim=_dim(dim))


@builtin
@builds('grid_dim')
def grid_dim(dim=0) -> Scalar:
    return _index("grid_dim", dim=_dim(dim))


@builtin
def num_warps() -> int:
    """The kernel's warps per block, a compile-time int."""
    from .values import current
    return current.get().num_warps


@builtin
@builds('thread_id')
def thread_id() -> Scalar:
    return _index("thread_id")


@builtin
@builds('lane_id')
def lane_id() -> Scalar:
    return _index("lane_id")


@builtin
@builds('warp_id')
def warp_id() -> Scalar:
    return _index("warp_id")


@builtin
@builds('warpgroup_id')
def warpgroup_id() -> Scalar:
    return _index("warpgroup_id")


def _indices(idx) -> list[ir.Value]:
    idx = idx if isinstance(idx, (tuple, list)) else (idx,)
    out = []
    for i in idx:
        s = as_scalar(i)
        if s.kind != "int":
            raise CompilationError(f"tile coordinates must be integers, got {i!r}")
        out.append(s.value)
    return out


def _cache_attrs(cache) -> dict:
    if cache not in tk_dialect.CACHE_HINTS:
        raise CompilationError(f"cache must be one of {tk_dialect.CACHE_HINTS}, got {cache!r}")
    return {} if cache == "normal" else {"cache": cache}


@builtin
@builds('load', 'tensor_load')
def load(src, idx=(), shape=None, *, layout="vec", scope="block", fill=0.0, dtype=None,
         cache="normal"):   # dtype: the tensor's (a different one is refused by tk-verify)
    """A register tile (2-D `shape`) or vector (1-D) read from a global tensor
    at tile coordinates `idx`; without a shape, one element of an i32 or f32
    tensor at element coordinates `idx` (a scalar, 0 past the end: sizes,
    offsets, flags), read by each thread that runs it; or the register tile of a shared tile, or the
    register vector of a shared vector (its layout follows its uses, e.g.
    `t.sub_col(v)`; scope= as for a tile), or a tensor tile's (Blackwell
    tensor memory: tcgen05.ld into the tmem layout, warpgroup scope).
    cache="stream" marks data read once (evicted first from L1/L2)."""
    if isinstance(src, SharedVector):
        return _load_shared_vector(src, idx, shape, scope, fill, dtype, cache)
    if isinstance(src, TensorTile):
        if idx != () or shape is not None or fill != 0.0 or dtype is not None or \
                cache != "normal" or layout not in ("vec", "tmem") or scope != "block":
            raise CompilationError("tk.load of a tensor tile reads the whole tile into a "
                                   "warpgroup's registers, in the tmem layout: idx, shape, "
                                   "fill, dtype, cache, layout and scope do not apply")
        tt = src.tk_type
        return Tile(emit("tensor_load", [src],
                         T.RT(tt.dtype, tt.rows, tt.cols, "tmem", "warpgroup").to_mlir()))
    if isinstance(src, Shared):
        if idx != () or shape is not None or fill != 0.0 or dtype is not None or cache != "normal":
            raise CompilationError("tk.load of a shared tile reads the whole tile: idx, shape, "
                                   "fill, dtype and cache do not apply (sub-tiles are not "
                                   "supported yet)")
        st = src.tk_type
        rt = T.RT(st.dtype, st.rows, st.cols, layout, scope)
        return Tile(emit("load", [src], rt.to_mlir(), fill=0.0))
    if not isinstance(src, Global):
        raise CompilationError(f"tk.load reads a tk.gl argument or a shared tile, got {src!r}")
    if shape is None and layout == "vec" and scope == "block" and fill == 0.0 and \
            dtype is None and cache == "normal":
        return _load_element(src, idx)
    shape = tile_shape(shape, "tk.load's shape=")
    dt = dtype_name(dtype) if dtype is not None else src.dtype
    t = T.RT(dt, shape[0], shape[1], layout, scope) if len(shape) == 2 else \
        T.RV(dt, shape[0], "auto", scope)
    if not isinstance(fill, (int, float)):
        raise CompilationError(f"fill must be a compile-time number, got {fill!r}")
    return wrap(emit("load", [src, *_indices(idx)], t.to_mlir(), fill=float(fill),
                     **_cache_attrs(cache)))


@builds('load_scalar')
def _load_element(src: Global, idx) -> Scalar:
    dtype = src.dtype
    if dtype not in ("i32", "f32"):
        raise CompilationError(f"tk.load(X, idx) without a shape reads one element of an i32 or "
                               f"f32 tensor; this tensor is {dtype}: give shape= for a tile or "
                               f"vector")
    element = i32() if dtype == "i32" else ir.F32Type.get()
    return Scalar(emit("load_scalar", [src, *_indices(idx)], element))


@builtin
@builds('store', 'tensor_store')
def store(dst, value, idx=(), *, cache="normal"):
    """Write a register tile or vector to a global tensor at tile coordinates
    `idx` (elements past the tensor's end are skipped), or into a shared tile
    or a tensor tile (a tmem-layout tile of warpgroup scope: tcgen05.st).
    cache="stream" marks data written once (st.global.cs)."""
    if not isinstance(value, TileLike):
        raise CompilationError(f"tk.store writes a register tile or vector, got {value!r}")
    if isinstance(dst, TensorTile):
        if idx != () or cache != "normal":
            raise CompilationError("tk.store to a tensor tile writes the whole of it: idx and "
                                   "cache do not apply")
        emit("tensor_store", [dst, value])
        return
    if not isinstance(dst, (Global, Shared, SharedVector)):
        raise CompilationError(f"tk.store writes to a tk.gl argument, a shared tile or a shared "
                               f"vector, got {dst!r}")
    shared = isinstance(dst, (Shared, SharedVector))
    if shared and (idx != () or cache != "normal"):
        raise CompilationError("tk.store to a shared tile or vector writes the whole of it: idx "
                               "and cache do not apply (sub-tiles are not supported yet)")
    emit("store", [dst, value, *([] if shared else _indices(idx))], **_cache_attrs(cache))


def _load_shared_vector(src: SharedVector, idx, shape, scope, fill, dtype, cache):
    if idx != () or shape is not None or fill != 0.0 or dtype is not None or cache != "normal":
        raise CompilationError("tk.load of a shared vector reads the whole vector: idx, shape, "
                               "fill, dtype and cache do not apply")
    sv = src.tk_type
    rv = T.RV(sv.dtype, sv.length, "auto", scope)   # "auto": tk-assign-layouts picks it
    return wrap(emit("load", [src], rv.to_mlir(), fill=0.0))


@builtin
@builds('atomic_add')
def atomic_add(dst, value, idx=()):
    """Add an f32 register tile or vector into an f32 tensor at tile
    coordinates `idx` (as tk.store: elements past the end are skipped), with
    atomic reductions (red.global.add), so that many blocks may accumulate
    into one place (each element once, whatever the layout)."""
    if not isinstance(value, TileLike):
        raise CompilationError(f"tk.atomic_add adds a register tile or vector, got {value!r}")
    if not isinstance(dst, Global):
        raise CompilationError(f"tk.atomic_add adds into a tk.gl tensor argument (global "
                               f"memory), got {dst!r}"
                               + ("; shared tiles have no atomic add: add in registers, or use "
                                  "tk.tma.reduce_add_async to add a shared tile into a tensor"
                                  if isinstance(dst, Shared) else ""))
    emit("atomic_add", [dst, value, *_indices(idx)])


@builtin
@builds('store_partial')
def store_partial(dst, value, idx=(), *, parts, workspace, counters):
    """Store `value`, one of `parts` partial sums of the tile of `dst` at tile
    coordinates `idx` (split-K: each part summed over a slice of K by its own
    block; `parts` may be a run-time int, as stream-K's varies by tile, the
    same in every part of a tile). Every part adds itself into `workspace`
    (an f32 tensor of dst's shape) with red.global.add; the last to arrive,
    counted per thread in `counters` (int32), reads the sum back, stores it
    into dst (converted to dst's dtype, elements past the end skipped as
    tk.store) and writes zeros over its workspace elements and counters. Both start as zeros and are
    left as zeros, so one pair serves launch after launch (not two launches
    at once). counters needs (tiles of dst) x (threads of the tile's scope)
    elements: a tile's slot is its row-major number among dst's tiles. The
    order of the f32 additions varies from run to run. On the GPU nothing
    checks the counters' size or the workspace's shape (out of range, the
    atomics go astray); the interpreter does, and says which."""
    if not isinstance(value, TileLike):
        raise CompilationError(f"tk.store_partial stores a register tile or vector, got {value!r}")
    for name, arg in (("dst", dst), ("workspace", workspace), ("counters", counters)):
        if not isinstance(arg, Global):
            raise CompilationError(f"tk.store_partial: {name} must be a tk.gl tensor argument "
                                   f"(global memory), got {arg!r}")
    p = int_operand(parts, 1, "tk.store_partial: parts must be an int >= 1 (the number of "
                              "partial sums of the tile; a run-time int too)")
    emit("store_partial", [dst, value, workspace, counters, p, *_indices(idx)])


@builtin
@builds('copy')
def copy(dst, src, idx=()):
    """Global <-> shared tile copy by all threads of the block, then a barrier."""
    if not ({type(dst), type(src)} == {Global, Shared}):
        raise CompilationError("tk.copy copies between a tk.gl argument and a shared tile")
    emit("copy", [dst, src, *_indices(idx)])


def _shape(shape, what: str) -> tuple:
    if not isinstance(shape, (tuple, list)):
        raise CompilationError(f"{what}: the first argument is the shape, (rows, cols) or "
                               f"(length,), got {shape!r}")
    return tuple(shape)


@builtin
def zeros(shape, dtype=f32, *, layout="vec", scope="block"):
    return _fill(_shape(shape, "tk.zeros"), 0.0, dtype, layout=layout, scope=scope)


@builtin
def full(shape, value, dtype=f32, *, layout="vec", scope="block"):
    return _fill(_shape(shape, "tk.full"), value, dtype, layout=layout, scope=scope)


def _shared_type(dtype, shape, swizzle) -> T.ST:
    shape = tile_shape(shape, "a shared tile", ranks=(2,))
    if swizzle not in T.SWIZZLES:
        raise CompilationError(f"swizzle must be one of {T.SWIZZLES} (bytes), got {swizzle!r}")
    return T.ST(dtype_name(dtype), shape[0], shape[1], swizzle)


@builtin
@builds('alloc_st')
def shared_tile(dtype, shape, *, swizzle=0):
    """A tile in shared memory; its place is chosen by the allocation pass.
    swizzle=32/64/128 stores it in column blocks of that many bytes per row,
    XOR-swizzled as TMA writes and wgmma reads them (see DESIGN: shared tiles)."""
    return Shared(emit("alloc_st", [], _shared_type(dtype, shape, swizzle).to_mlir()))


@builtin
@builds('alloc_st')
def shared_tiles(dtype, shape, count, *, swizzle=0):
    """An array of `count` shared tiles (a ring of pipeline stages): tiles[i]
    with i a compile-time or run-time int."""
    return Shared(emit("alloc_st", [], _shared_type(dtype, shape, swizzle).to_mlir(),
                       count=compile_time_int(count, "count", 1, 64)))


def _shared_vector_type(dtype, length) -> T.SV:
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise CompilationError(f"a shared vector's length must be a positive compile-time int, "
                               f"got {length!r}")
    return T.SV(dtype_name(dtype), length)


@builtin
@builds('alloc_sv')
def shared_vector(dtype, length):
    """A vector of `length` elements in shared memory (128-byte aligned: a TMA
    destination); its place is chosen by the allocation pass. tk.load reads it
    as a register vector, tk.store writes one, tk.tma.load_async fills it."""
    return SharedVector(emit("alloc_sv", [], _shared_vector_type(dtype, length).to_mlir()))


@builtin
@builds('alloc_sv')
def shared_vectors(dtype, length, count):
    """An array of `count` shared vectors: vecs[i] with i a compile-time or
    run-time int."""
    return SharedVector(emit("alloc_sv", [], _shared_vector_type(dtype, length).to_mlir(),
                             count=compile_time_int(count, "count", 1, 64)))


@builtin
@builds('barrier')
def barrier():
    """Wait until every thread of the block reaches this point."""
    emit("barrier")


@builtin
@builds('select')
def where(mask, a, b):
    """Elementwise `a if mask else b`: mask a bool tile or vector (a comparison,
    e.g. `t.col_indices() <= t.row_indices()`), a and b tiles or vectors of the
    mask's shape and layout, or numbers (float('-inf'), a run-time scalar). The
    result has the tile operand's dtype (f32 when both are numbers)."""
    if not isinstance(mask, TileLike):
        raise CompilationError(f"tk.where: the mask must be a bool tile or vector (e.g. from "
                               f"a comparison), got {mask!r}; for numbers write "
                               f"`a if c else b`")
    tiles = [x for x in (a, b) if isinstance(x, TileLike)]
    # Scalar.kind and the Python number types share the names bool, int, float.
    kinds = {x.kind if isinstance(x, Scalar) else type(x).__name__ for x in (a, b)
             if not isinstance(x, TileLike)}
    dtype = tiles[0].dtype if tiles else "f32" if "float" in kinds else \
        "bool" if kinds == {"bool"} else "i32"
    a, b = (x if isinstance(x, TileLike) else scalar_operand(dtype, x) for x in (a, b))
    return wrap(emit("select", [mask, a, b], mask.tk_type.with_dtype(dtype).to_mlir()))
