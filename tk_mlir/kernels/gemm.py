"""matmul: a Hopper GEMM on torch tensors (on Blackwell: blackwell_gemm.py).

C = A @ B.T (B given as N x K, b_layout="nk", the layout of a Linear weight)
or C = A @ B (B given as K x N, "kn"); bf16 or f16 inputs, f32 accumulation,
bf16/f16/f32 output.

The kernel: TMA loads into a ring of swizzled shared tiles, wgmma on one
consumer warpgroup per 64 rows of a tile, a producer warpgroup, a persistent
grid walking output tiles in L2-friendly groups; the load-compute-finish
template (tk.lcf) does the pipeline, the kernel says what to load, compute
and store. M, N and K need not be multiples of the tiles: TMA reads zeros
past the edges (so the K tail adds nothing) and the stores are masked. Rows
that are not whole 16-byte vectors (K or N not a multiple of 8 for 16-bit
types, as TMA requires), or views that start mid-vector, go through copies
padded with zeros (`padded_rows`): any M, N, K, at the cost of those copies.

Which kernel runs is `plan(M, N, K, sms, layout=...)`'s choice: the
fastest of `candidate_plans` for shapes in the measured table
(gemm_plans.json, made on the GPU by benchmarks/gemm_plan_table.py), else a
heuristic you can read (`rules_plan`): shapes with enough 128 x 256 tiles
for the SMs take the autotuned kernel; fewer rows or columns take smaller
tiles, and when even those leave SMs idle, K is split among blocks
(`gemm_split_k_kernel`). `plan(...).why` says which. The ping-pong schedule
(PINGPONG: two consumer warpgroups taking whole tiles in turn, one's epilogue
under the other's MMAs) and stream-K (STREAM_K: all tiles' K steps cut evenly
among the blocks, shared tiles meeting as split-K's slices do) are among the
candidates; only the measured table chooses them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from types import MappingProxyType

import tk_mlir as tk
from tk_mlir import f32

from tk_mlir.kernels import blackwell_gemm, checks, eager
from tk_mlir.kernels.device import is_blackwell, num_sms
from tk_mlir.runtime.arguments import contiguous_strides
from tk_mlir.target import HOPPER

# SLICED_K's named barriers: the second consumer's partial written into the
# shared tile, and the tile read (free to rewrite). Apart from store_in_pieces'
# 1 + consumer and lcf's ping-pong 15 - consumer (SLICED_K takes no PINGPONG).
SLICES_WRITTEN, SLICES_FREE = 14, 13


@tk.func
def cluster_sum(C, partial, tasks, tile_of, BM, S):
    """gemm's CLUSTER_SPLIT epilogue, run by every warp of the block once the
    task loop is over: the cluster's S f32 partials (`partial` in each block,
    tile_of(cluster's task)'s) summed by the first warpgroup, block r taking
    rows r·BM/S .. into C. The first cluster_sync orders the partials'
    stores before the reads; the second keeps every block running until the
    others have read its tile."""
    tk.cluster_sync()
    task, r, rows = tk.block_id(0) // S, tk.cluster_rank(), BM // S
    # (one task per cluster: a cluster past them has none)
    if tk.warpgroup_id() == 0 and task < tasks:
        mine = partial.subtile(r, rows)
        total = tk.load(mine.in_block(0), scope="warpgroup")
        for k in tk.static_range(1, S):
            total = total + tk.load(mine.in_block(k), scope="warpgroup")
        if tk.grid_dim(0) < tasks * S:   # a cluster ran several tasks: `partial` holds
            total = total * float("nan")   # only its last one's, so no sum is right
        _, m, n = tile_of(task)
        tk.store(C, total.to(C.dtype), (m * S + r, n))
    tk.cluster_sync()


@tk.func
def gemm(A, B, C, B_KN, BM, BN, BK, STAGES, GROUP_M, TMA_STORE, EPI_N, CLUSTER, SPLIT_K=1,
         W=None, F=None, EPI_BUFFERS=1, STARTS=None, SIZES=None, LOG_G=0, SCATTER=None,
         GATHER=None, A_KM=False, ACCUMULATE=False, OFFS=None, SKIP_EMPTY=False,
         SCALES=None, PINGPONG=False, STREAM_K=False, CLUSTER_SPLIT=1, SLICED_K=False):
    """C = A @ B.T, or A @ B with B_KN, on a persistent grid (one block per SM);
    with A_KM, A is given as K x M (C = A.T @ ..., wgmma reading A transposed:
    a gradient's GEMM without a transposed copy); with ACCUMULATE, C += the
    product (each piece added by TMA reduce-add, rounded to C's 16-bit dtype
    before and after the add: a gradient summed over chunks in place).

    3-D A, B and C: one product per index of their first dim. Grouped (each
    product's rows its first ones, the tiles holding them computed and
    stored, rows past them in its last tile too), by one of two schedules:
    with STARTS (G + 1 ints), the tiles packed: product g takes the BM-row
    tiles STARTS[g] to STARTS[g + 1] - 1 counted over all products (a task
    finds its product by binary search; LOG_G the bits of G); with SIZES (G
    ints), product g's rows are its first SIZES[g] (clamped to [0, M]) and
    its tiles past them are skipped in place. Ragged, with OFFS (G ints):
    A is 2-D (rows of every product packed), B 3-D (one per product), C 2-D;
    product g takes A's and C's rows from OFFS[g - 1] (0 for g = 0) to
    OFFS[g] (clamped to [0, M]; see ragged_tile_of); a consumer's 64 rows
    that are all g's are stored, 64 rows g shares with other products are
    added into C (which must hold zeros there) by TMA reduce-add, the other
    products' rows as zeros; with SKIP_EMPTY, tiles holding none of their
    product's rows are skipped (see ragged_has_rows); LOG_G the bits of G.
    Tiles of BM x BN, BK deep
    through a ring of STAGES shared tiles; one consumer warpgroup per 64 rows
    of a tile (BM = 64: num_warps=8, 128: 12); GROUP_M tile rows share B tiles
    in L2; a 16-bit C leaves EPI_N columns at a time by TMA store (TMA_STORE)
    through EPI_BUFFERS staging tiles per consumer; CLUSTER blocks share B
    tiles by TMA multicast. SPLIT_K > 1 cuts K into that many slices, each its
    own task, whose f32 partial products meet in the workspace W; the last one
    of a tile stores it (tk.store_partial, counting in F).
    SCATTER = (ready, first): A is 3-D (W, rows / W, K), its first index an
    owner rank, B 2-D, C a tk.pgl of (rows / W, N); each tile of owner r's
    rows is added into rank r's copy by TMA reduce-add, owners walked from
    `first` on (wrapping around); ready(task, wg) runs before each of a
    consumer's tiles (the owners' copies must be ready before its first add).
    GATHER = (ready, first): A's rows arrive while the kernel runs (an
    all-gather); ready(m) runs before the first load of tile row m, and the
    walk over tile rows starts at `first` (wrapping around), so a rank starts
    with rows it already has. SCALES = (SA, SB): C = the product * SA * SB
    (scaled_matmul's dequantization), each f32 scale one value (a 0-d tensor)
    or a vector, SA one per row of C, SB one per column, applied to the f32
    accumulator before it leaves (each split-K part scaled: the sum is
    linear). STREAM_K (with W and F, SPLIT_K = 1): stream-K, all tiles' K steps
    cut evenly among the grid's blocks, each block walking its share in
    order across tile boundaries; a tile that two or more blocks share meets
    in W as split-K's slices do (tk.store_partial with their number), the
    others are stored whole. PINGPONG: two consumer warpgroups, each computing whole BM x BN
    tiles in turn (tk.lcf's pingpong), so one's epilogue overlaps the other's
    MMAs; for plain and batched products (B_KN, A_KM, ACCUMULATE), with at
    most 128 accumulator registers (BM x BN <= 128 x 128). CLUSTER_SPLIT = s
    (2, 4 or 8): split-K within clusters of s blocks, one tile per cluster
    (launch exactly tiles x s blocks, not a persistent grid: a smaller grid
    gives NaN, not a wrong sum): block r of a cluster
    takes K slice r, leaves its f32 partial in shared memory, and sums rows
    r·BM/s .. of every block's partial (distributed shared memory,
    tile.in_block) into C: no workspace, no atomics, the same sum in the same
    order on every run. SLICED_K (BM = 64; CUTLASS 2's sliced-K): two consumer
    warpgroups compute each tile over alternate K steps (tk.lcf's sliced), the
    second's f32 partial added to the first's through shared memory, so two
    warpgroups issue MMAs where one 64-row tile has one; for plain, batched
    and split-K products (A_KM, B_KN, ACCUMULATE)."""
    batched = len(A.shape) == 3
    b_outer = len(B.shape) == 3                    # (SCATTER: one B for every owner)
    assert SCATTER is None or (batched and not b_outer), \
        "SCATTER takes A as (W, rows / W, K), each owner's rows, and a 2-D B"
    grouped = STARTS is not None or SIZES is not None
    assert not A_KM or (not grouped and SCATTER is None and GATHER is None), \
        "A given as K x M (A_KM) is built for plain and batched products"
    assert SCALES is None or (OFFS is None and SCATTER is None and GATHER is None and
                              not ACCUMULATE and STARTS is None and SIZES is None), \
        "SCALES is built for plain and split-K products (a batch's products would share them)"
    assert not ACCUMULATE or (SCATTER is None and SPLIT_K == 1 and TMA_STORE
                              and C.dtype != "f32"), \
        "ACCUMULATE adds by TMA store pieces: a 16-bit C, TMA_STORE, no SPLIT_K or SCATTER"
    M, K = (A.shape[-1], A.shape[-2]) if A_KM else (A.shape[-2], A.shape[-1])
    N = B.shape[-1] if B_KN else B.shape[-2]
    # (SCATTER: the owners are the ranks, a compile-time count)
    batch = C.world_size if SCATTER is not None else A.shape[0] if batched else 1
    assert BM in (64, 128), f"BM={BM}: a tile has one consumer warpgroup per 64 rows, 1 or 2"
    assert SPLIT_K >= 1, f"SPLIT_K={SPLIT_K}: the number of K slices, an int >= 1"
    assert not PINGPONG or BM * BN <= 128 * 128, \
        f"PINGPONG takes tiles of BM x BN <= 128 x 128 (one warpgroup's accumulators), got " \
        f"{BM} x {BN}"
    assert not PINGPONG or (SPLIT_K == 1 and CLUSTER == 1 and not grouped and OFFS is None and
                            SCATTER is None and GATHER is None and SCALES is None), \
        "PINGPONG is built for plain and batched products: no SPLIT_K, CLUSTER, STARTS, " \
        "SIZES, OFFS, SCATTER, GATHER or SCALES"
    assert CLUSTER_SPLIT == 1 or (CLUSTER_SPLIT in (2, 4, 8) and SPLIT_K == 1 and
                                  CLUSTER == 1 and not batched and not b_outer and
                                  STARTS is None and SIZES is None and OFFS is None and
                                  SCALES is None and not ACCUMULATE and not PINGPONG and
                                  not STREAM_K and not A_KM and SCATTER is None and
                                  GATHER is None and BM % (8 * CLUSTER_SPLIT) == 0), \
        f"CLUSTER_SPLIT={CLUSTER_SPLIT}: 2, 4 or 8 blocks, for a plain 2-D product (no " \
        f"SPLIT_K, CLUSTER, grouping, SCALES, ACCUMULATE, PINGPONG, STREAM_K, A_KM, " \
        f"SCATTER or GATHER), BM a multiple of 8 rows per block"
    assert not SLICED_K or BM == 64, \
        f"SLICED_K takes tiles of BM = 64 rows (got {BM}): two warpgroups share one 64-row " \
        f"tile's K steps (gemm.sliced_config makes a config)"
    assert not SLICED_K or (CLUSTER == 1 and CLUSTER_SPLIT == 1 and not PINGPONG
                            and not STREAM_K and not grouped and OFFS is None
                            and SCATTER is None and GATHER is None), \
        "SLICED_K is built for plain, batched or split-K products: no CLUSTER, " \
        "CLUSTER_SPLIT, PINGPONG, STREAM_K, STARTS, SIZES, OFFS, SCATTER or GATHER"
    assert not STREAM_K or (SPLIT_K == 1 and W is not None and CLUSTER == 1 and not grouped
                            and OFFS is None and SCATTER is None and GATHER is None
                            and SCALES is None and not ACCUMULATE and not PINGPONG), \
        "STREAM_K takes the workspace W and counters F of split-K (SPLIT_K = 1) for plain or " \
        "batched products: no CLUSTER, STARTS, SIZES, OFFS, SCATTER, GATHER, SCALES, " \
        "ACCUMULATE or PINGPONG"
    # Consumer warpgroups; each takes 64 rows of a tile, whole tiles (PINGPONG),
    # or alternate K steps of a 64-row tile (SLICED_K: the first one stores it).
    consumers = 2 if PINGPONG or SLICED_K else BM // 64
    epilogue_consumers = 1 if SLICED_K else consumers     # (the warpgroups that store C)
    wg_rows = BM if PINGPONG else 64
    tiles_m, tiles_n = tk.cdiv(M, BM), tk.cdiv(N, BN)
    assert BN >= 64 or not B_KN, f"BN={BN}: B given as K x N takes tiles of 64 columns or more"
    # CLUSTER blocks take vertically adjacent tiles; each loads 1/CLUSTER of
    # the B tile they share and multicasts it to all (A·Bᵀ only).
    assert CLUSTER == 1 or not B_KN, "CLUSTER > 1 is built for B given as N x K"
    assert not grouped or (batched and CLUSTER == 1 and SPLIT_K == 1 and
                           (STARTS is None or SIZES is None)), \
        "grouped products (STARTS or SIZES, not both) take 3-D tensors, no CLUSTER and " \
        "no SPLIT_K"
    ragged = OFFS is not None
    assert not ragged or (not batched and b_outer and len(C.shape) == 2 and BM == 128
                          and CLUSTER == 1 and SPLIT_K == 1 and not A_KM and not grouped
                          and SCATTER is None and GATHER is None and not ACCUMULATE
                          and TMA_STORE and C.dtype != "f32"), \
        "ragged products (OFFS) take a 2-D A and C, a 3-D B, BM = 128 and a 16-bit C, " \
        "and none of STARTS, SIZES, SCATTER, GATHER, ACCUMULATE, A_KM, CLUSTER, SPLIT_K"
    if ragged:
        batch = B.shape[0]
    groups_m = tk.cdiv(tiles_m, CLUSTER)
    tiles = groups_m * tiles_n                     # per product
    tasks = batch * tiles if STARTS is None else tk.load(STARTS, (batch,)) * tiles_n
    # per K slice; TMA reads zeros past K
    k_steps = tk.cdiv(tk.cdiv(K, BK), SPLIT_K * CLUSTER_SPLIT)
    a_tile = (BK, BM) if A_KM else (BM, BK)
    b_tile = (BK, BN) if B_KN else (BN, BK)
    # 16-bit results leave through shared memory and TMA stores, EPI_N columns
    # at a time; f32 ones from registers.
    TMA_STORE = TMA_STORE and C.dtype != "f32" and SPLIT_K == 1 and CLUSTER_SPLIT == 1
    EPI_N = min(EPI_N, BN)
    c_tiles = None
    if TMA_STORE:
        # (16-bit C: a row of 64 or more columns fills the 128-byte swizzle)
        c_tiles = tk.shared_tiles(C.dtype, (wg_rows, EPI_N), epilogue_consumers * EPI_BUFFERS,
                                  swizzle=128 if EPI_N >= 64 else 2 * EPI_N)

    def tile_of(task):
        """(outer coordinates, m, n) of a task's tile: the products one after
        another (packed by STARTS: group_tile_of); with SPLIT_K, tasks take
        every tile's first K slice, then every second one, ..."""
        if STARTS is not None:
            outer, m, n = group_tile_of(task)
        else:
            task = task % (batch * tiles) if SPLIT_K > 1 else task
            outer = ()
            if batched:
                outer = (task // tiles,)
                if SCATTER is not None:
                    outer = ((task // tiles + SCATTER[1]) % batch,)
                task = task % tiles
            m, n = tk.grouped_tile(task, groups_m, tiles_n, GROUP_M)
            if GATHER is not None:
                m = (m + GATHER[1]) % tiles_m
        return outer, (m * CLUSTER + tk.cluster_rank() if CLUSTER > 1 else m), n

    def last_at_or_before(first_of, target):
        """The last product g (of batch, LOG_G bits) whose first_of(g) is at
        or before target, by binary search (first_of nondecreasing,
        first_of(0) <= target)."""
        g = 0
        for bit in tk.static_range(LOG_G - 1, -1, -1):
            probe = g + (1 << bit)
            if probe < batch:
                if first_of(probe) <= target:
                    g = probe
        return g

    def first_task_of(g):                            # (STARTS: g's first task)
        return tk.load(STARTS, (g,)) * tiles_n

    def group_tile_of(task):
        """The product g whose tasks hold `task` (the last g with
        STARTS[g] * tiles_n <= task, by binary search: empty products share
        their start with the next), and the tile of task - STARTS[g] * tiles_n
        among its STARTS[g + 1] - STARTS[g] tile rows."""
        g = last_at_or_before(first_task_of, task)
        first = tk.load(STARTS, (g,))
        rows = tk.load(STARTS, (g + 1,)) - first
        m, n = tk.grouped_tile(task - first * tiles_n, rows, tiles_n, GROUP_M)
        return (g,), m, n

    def sized_has_rows(task):
        """Whether a grouped task's tile holds rows of its product (below
        SIZES[g], clamped to [0, M]): the others are skipped."""
        outer, m, _ = tile_of(task)
        return m * BM < min(max(tk.load(SIZES, outer), 0), M)

    def rows_end(g):
        """The end of product g's rows, OFFS[g] clamped to [0, M] (g = -1: 0,
        a load before the tensor's start reads 0)."""
        return min(max(tk.load(OFFS, (g,)), 0), M)

    if ragged:
        # Slot p of product g is row tile p - g of A and C: a product's slots
        # start at its first row's tile + g, one more than the tiles before
        # it span (so a tile two products share has a slot in each).
        slots = rows_end(batch - 1) // BM + batch
        tasks = slots * tiles_n

    def first_slot_of(g):                            # (ragged: g's first slot)
        return rows_end(g - 1) // BM + g

    def ragged_tile_of(task):
        """(g, m, n, first, end) of a ragged task: its product g (the last
        whose first slot is at or before the task's, by binary search), the
        row tile m of A and C, its column tile n, and g's rows [first, end).
        Slots past a product's tiles (its rows end on a tile's edge, or it
        has none) hold none of g's rows: skipped with SKIP_EMPTY
        (ragged_has_rows), else computed and nothing stored."""
        slot, n = tk.grouped_tile(task, slots, tiles_n, GROUP_M)
        g = last_at_or_before(first_slot_of, slot)
        return g, slot - g, n, rows_end(g - 1), rows_end(g)

    def ragged_has_rows(task):
        """Whether a ragged task's tile holds rows of its product (a slot
        past its tiles, or of a product without rows, does not: skipped)."""
        _, m, _, first, end = ragged_tile_of(task)
        return first < end and m * BM < end

    def load(task, k, a, b, sem):
        if ragged:
            g, m, n, _, _ = task                     # (ragged_tile_of, once per task)
            tk.tma.load_async(a, A, (m, k), sem)
            tk.tma.load_async(b, B, (g, k, n) if B_KN else (g, n, k), sem)
        else:
            load_tiles(task, k, a, b, sem)

    def load_tiles(task, k, a, b, sem):
        if STARTS is not None:
            outer, m, n = task                       # (tile_of, once per task)
        elif STREAM_K:
            tile, first, _ = task                    # (stream_unit, once per task)
            outer, m, n = tile_of(tile)
            k += first
        else:
            outer, m, n = tile_of(task)
        if SPLIT_K > 1:
            k += (task // (batch * tiles)) * k_steps
        if CLUSTER_SPLIT > 1:                        # this block's K slice
            k += tk.cluster_rank() * k_steps
        if GATHER is not None:
            if k == 0:
                GATHER[0](m)
        tk.tma.load_async(a, A, (*outer, k, m) if A_KM else (*outer, m, k), sem)
        if CLUSTER > 1:
            part = tk.cluster_rank()
            tk.tma.load_async(b.subtile(part, BN // CLUSTER), B,
                              (*outer, n * CLUSTER + part, k), sem, multicast=(1 << CLUSTER) - 1)
        else:
            bo = outer if b_outer else ()
            tk.tma.load_async(b, B, (*bo, k, n) if B_KN else (*bo, n, k), sem)

    def setup(task, wg):
        return tk.zeros((wg_rows, BN), f32, layout="row", scope="warpgroup")

    def compute(acc, wg, a, b):
        if PINGPONG or SLICED_K:    # the whole tile
            acc = (tk.mma_AtB if B_KN else tk.mma_AtBt)(acc, a, b) if A_KM else \
                (tk.mma_AB if B_KN else tk.mma_ABt)(acc, a, b)
        elif A_KM:      # the warpgroup's 64 rows of C are 64 columns of the K x M tile
            acc = (tk.mma_AtB if B_KN else tk.mma_AtBt)(acc, a.column_block(wg), b)
        else:
            acc = (tk.mma_AB if B_KN else tk.mma_ABt)(acc, a.subtile(wg, 64), b)
        return acc

    def finish(acc, task, wg):
        if ragged:
            g, m, n, first, end = ragged_tile_of(task)
            top = BM * m + 64 * wg                   # the consumer's first row

            def rows_of_g(part, h):                  # other rows add zeros
                row = part.row_indices() + top
                return tk.where(row >= first, tk.where(row < end, part, 0.0), 0.0)

            if first <= top and min(top + 64, M) <= end:     # all its rows g's: stored
                tk.store_in_pieces(C, acc, 2 * m + wg, n * (BN // EPI_N), EPI_N, wg, c_tiles,
                                   EPI_BUFFERS)
            elif first < top + 64 and top < end and first < end:   # shared: added into zeros
                tk.store_in_pieces(C, acc, 2 * m + wg, n * (BN // EPI_N), EPI_N, wg, c_tiles,
                                   EPI_BUFFERS, rows_of_g, add=True)
        elif SLICED_K:
            store_slices(acc, task, wg)
        else:
            store_tile(acc, task, wg)

    def store_slices(acc, task, wg):
        """SLICED_K: the second consumer's partial into `slices` (once the first
        has read the task before's), the first's plus it stored by the first
        (named barriers SLICES_FREE and SLICES_WRITTEN, 8 warps). The block's
        tasks are block_id, + grid, ... (no cluster, no `active`): the first
        and last are known without counting."""
        if wg == 1:
            if task >= tk.grid_dim(0):               # not the block's first task
                tk.named_barrier(SLICES_FREE, warps=8)
            tk.store(slices, acc)
            tk.named_barrier_arrive(SLICES_WRITTEN, warps=8)
        else:
            tk.named_barrier(SLICES_WRITTEN, warps=8)
            total = acc + tk.load(slices, layout="row", scope="warpgroup")
            if task + tk.grid_dim(0) < tasks * SPLIT_K:
                tk.named_barrier_arrive(SLICES_FREE, warps=8)   # slices read: free to rewrite
            store_tile(total, task, 0)

    def row_scaled(acc, row):
        """acc times SA's rows (one value or a 64-row vector) and, when SB is
        one value, SB."""
        SA, SB = SCALES
        if len(SA.shape) > 0:
            acc = acc.mul_row(tk.load(SA, (row,), (64,), scope="warpgroup"))
            if len(SB.shape) == 0:
                acc = acc * tk.load(SB, ())
        else:
            acc = acc * (tk.load(SA, ()) if len(SB.shape) > 0 else
                         tk.load(SA, ()) * tk.load(SB, ()))
        return acc

    def col_scaled(first, cols):
        """piece(part, h) of store_in_pieces scaling `cols` columns at a
        time by SB from column piece `first` on (None: SB is one value,
        applied by row_scaled): a slice at a time, as a whole row's scales
        would hold BN / 4 registers through the epilogue."""
        SB = SCALES[1]

        def piece(part, h):
            return part.mul_col(tk.load(SB, (first + h,), (cols,), scope="warpgroup"))
        return piece if len(SB.shape) > 0 else None

    def store_tile(acc, task, wg):
        parts = 1
        if STREAM_K:
            task, _, _ = stream_unit(task)
            parts = stream_parts(task)
        outer, m, n = tile_of(task)
        row = m if PINGPONG or SLICED_K else consumers * m + wg  # in accumulator tiles
        piece = None
        if SCALES is not None:
            acc = row_scaled(acc, row)
            if SPLIT_K > 1:                          # the whole tile, before its part is added
                whole = col_scaled(n, BN)
                acc = acc if whole is None else whole(acc, 0)
            else:
                piece = col_scaled(n * (BN // EPI_N), EPI_N)
        if SCATTER is not None:
            SCATTER[0](task, wg)
            if row < tk.cdiv(M, 64):                 # (a 128-row tile's second half may be past M)
                tk.store_in_pieces(C[outer[0]], acc, row, n * (BN // EPI_N), EPI_N, wg, c_tiles,
                                   EPI_BUFFERS, add=True)
        elif SPLIT_K > 1:
            tk.store_partial(C, acc, (*outer, row, n), parts=SPLIT_K, workspace=W, counters=F)
        elif CLUSTER_SPLIT > 1:                      # for the cluster's sum, after the loop
            tk.store(partial.subtile(wg, 64), acc)
        elif parts > 1:                              # (STREAM_K: a shared tile)
            tk.store_partial(C, acc, (*outer, row, n), parts=parts, workspace=W, counters=F)
        else:
            tk.store_in_pieces(C, acc, row, n * (BN // EPI_N), EPI_N, wg, c_tiles, EPI_BUFFERS,
                               piece, outer=outer, add=ACCUMULATE)

    if STREAM_K:
        # Block b of the first `blocks` (at most one per K step) takes K steps
        # b·share + min(b, extra) .. of all tiles' in order; its o-th task is
        # the o-th tile that range meets (task = o·grid + b: lcf's task loop).
        steps = tk.cdiv(K, BK)
        total = tasks * steps
        grid = tk.grid_dim(0)
        blocks = min(grid, total)
        share, extra = total // blocks, total % blocks

        def block_start(b):
            return b * share + min(b, extra)

        def block_of(i):
            """The block whose range holds K step i (of all tiles')."""
            wide = extra * (share + 1)                  # the steps of the longer ranges
            return i // (share + 1) if i < wide else extra + (i - wide) // share

        def stream_unit(task):
            """(tile, first K step in it, K steps) of a stream-K task: 0 steps
            for a task past its block's range, or of a block past `blocks`."""
            b = task % grid
            lo, hi = block_start(b), block_start(b + 1)
            tile = lo // steps + task // grid
            first = max(lo, tile * steps)
            count = min(hi, tile * steps + steps) - first
            return tile, first - tile * steps, count if b < blocks else 0

        def stream_parts(tile):
            """How many blocks share a tile's K steps."""
            return block_of(tile * steps + steps - 1) - block_of(tile * steps) + 1

        def stream_steps(task):
            return stream_unit(task)[2]

        def stream_active(task):
            return stream_unit(task)[2] > 0

        units = tk.cdiv(tk.cdiv(total, blocks), steps) + 1     # tasks per block, at most
        tk.lcf(grid * units, 0, [(A.dtype, a_tile, 128), (B.dtype, b_tile, 128)],
               load, setup, compute, finish, stages=STAGES, consumers=consumers,
               plan=stream_unit, active=stream_active, task_iters=stream_steps)
    else:
        if CLUSTER_SPLIT > 1:    # (before the ring: tk.lcf starts the task loop)
            partial = tk.shared_tile(f32, (BM, BN), swizzle=0)
        if SLICED_K:
            slices = tk.shared_tile(f32, (64, BN), swizzle=128)
        tk.lcf(tasks * SPLIT_K, k_steps, [(A.dtype, a_tile, 128), (B.dtype, b_tile, 128)],
               load, setup, compute, finish, stages=STAGES, consumers=consumers,
               cluster=CLUSTER_SPLIT if CLUSTER_SPLIT > 1 else CLUSTER,
               shared_stages=CLUSTER_SPLIT == 1,
               plan=ragged_tile_of if ragged else tile_of if STARTS is not None else None,
               active=(ragged_has_rows if SKIP_EMPTY else None) if ragged else
               sized_has_rows if SIZES is not None else None, pingpong=PINGPONG,
               sliced=SLICED_K)
        if CLUSTER_SPLIT > 1:
            cluster_sum(C, partial, tasks, tile_of, BM, CLUSTER_SPLIT)


# The epilogue in 64-column pieces through two staging tiles per consumer (one
# piece written while the last one's TMA store reads): faster on Hopper, never
# slower (BENCHMARKS.md); the single-tile epilogue stays a candidate.
@tk.autotune(configs=[tk.Config(BN=256, STAGES=4, EPI_N=64, EPI_BUFFERS=2),
                      tk.Config(BN=256, STAGES=4, EPI_N=64, EPI_BUFFERS=2, GROUP_M=16),
                      tk.Config(BN=256, STAGES=4), tk.Config(BN=128, STAGES=6)],
             key=["A", "B", "C", "B_KN", "A_KM"])
@tk.kernel(num_warps=12)      # consumers: warpgroups 0 .. BM/64 - 1; the last one loads
def gemm_kernel(A: tk.gl, B: tk.gl, C: tk.gl, B_KN: tk.constexpr = False,
                BM: tk.constexpr = 128, BN: tk.constexpr = 256, BK: tk.constexpr = 64,
                STAGES: tk.constexpr = 4, GROUP_M: tk.constexpr = 8,
                TMA_STORE: tk.constexpr = True, EPI_N: tk.constexpr = 128,
                CLUSTER: tk.constexpr = 1, EPI_BUFFERS: tk.constexpr = 1,
                A_KM: tk.constexpr = False, ACCUMULATE: tk.constexpr = False,
                PINGPONG: tk.constexpr = False, SLICED_K: tk.constexpr = False):
    """C = A @ B.T, or A @ B with B_KN; A given as K x M with A_KM; C += the
    product with ACCUMULATE; two warpgroups taking whole tiles in turn with
    PINGPONG, or alternate K steps of each with SLICED_K (`gemm`). BM=64
    takes num_warps=8 (12 with PINGPONG or SLICED_K)."""
    gemm(A, B, C, B_KN, BM, BN, BK, STAGES, GROUP_M, TMA_STORE, EPI_N, CLUSTER,
         EPI_BUFFERS=EPI_BUFFERS, A_KM=A_KM, ACCUMULATE=ACCUMULATE, PINGPONG=PINGPONG,
         SLICED_K=SLICED_K)


@tk.kernel(num_warps=8)
def gemm_split_k_kernel(A: tk.gl, B: tk.gl, C: tk.gl, W: tk.gl[f32], F: tk.gl["i32"],
                        SPLIT_K: tk.constexpr, B_KN: tk.constexpr = False,
                        BM: tk.constexpr = 64, BN: tk.constexpr = 128, BK: tk.constexpr = 64,
                        STAGES: tk.constexpr = 8, GROUP_M: tk.constexpr = 8,
                        A_KM: tk.constexpr = False, STREAM_K: tk.constexpr = False,
                        SLICED_K: tk.constexpr = False):
    """`gemm` with K cut into SPLIT_K slices, or with STREAM_K (SPLIT_K = 1)
    all tiles' K steps cut evenly among the blocks; SLICED_K as gemm_kernel's
    (num_warps=12). W: f32 of C's shape, F: int32 of split_k_counters(...)
    elements; both zeros, and left zeros."""
    gemm(A, B, C, B_KN, BM, BN, BK, STAGES, GROUP_M, False, 128, 1, SPLIT_K, W, F, A_KM=A_KM,
         STREAM_K=STREAM_K, SLICED_K=SLICED_K)


@tk.kernel(num_warps=8)
def gemm_cluster_split_k_kernel(A: tk.gl, B: tk.gl, C: tk.gl, SPLIT: tk.constexpr = 4,
                                B_KN: tk.constexpr = False, BM: tk.constexpr = 64,
                                BN: tk.constexpr = 128, BK: tk.constexpr = 64,
                                STAGES: tk.constexpr = 6, GROUP_M: tk.constexpr = 8):
    """`gemm` with K cut into SPLIT slices taken by the SPLIT blocks of a
    cluster, their partials summed through distributed shared memory
    (CLUSTER_SPLIT). Launch cdiv(M, BM) x cdiv(N, BN) x SPLIT blocks."""
    gemm(A, B, C, B_KN, BM, BN, BK, STAGES, GROUP_M, False, 128, 1, CLUSTER_SPLIT=SPLIT)


def ring_stages(bm: int, bn: int, beside: int) -> int:
    """How many 64-deep stages of bm x bn tiles' A and B (16-bit, with their
    two semaphores) fit in shared memory beside `beside` bytes of other tiles
    (1 KB kept for alignment)."""
    return (HOPPER.max_shared_bytes - 1024 - beside) // ((bm + bn) * 64 * 2 + 16)


def cluster_split_config(bm: int, bn: int, split: int) -> dict:
    """gemm_cluster_split_k_kernel's config for bm x bn tiles in K slices of
    `split` blocks: the deepest ring (up to 8 stages) that fits beside the f32
    partial tile."""
    stages = min(8, ring_stages(bm, bn, bm * bn * 4))
    return dict(BM=bm, BN=bn, STAGES=stages, SPLIT=split, num_warps=4 * (bm // 64 + 1))


def split_k_counters(M: int, N: int, BN: int, batch: int = 1) -> int:
    """Counters gemm_split_k_kernel needs: one per thread of each 64 x BN
    tile of C (of each of `batch` products). A consumer's tile wholly past M
    is skipped by tk.store_partial, and counts nothing."""
    return batch * tk.cdiv(M, 64) * tk.cdiv(N, BN) * 128


def matmul(a, b, c=None, *, b_layout: str = "nk"):
    """C = A @ B.T (b_layout="nk": b is N x K) or C = A @ B ("kn": b is K x N).

    a: (M, K) and b: torch.bfloat16 or torch.float16 CUDA tensors of one dtype
    on one device. c: an (M, N) output of a 16-bit dtype or torch.float32 on
    their device, written in place (its memory apart from a's and b's); by
    default a new tensor of a's dtype. Batched: a (G, M, K), b (G, N, K) or
    (G, K, N) and c (G, M, N) make G independent products of one shape in
    one launch (as torch.bmm).
    Returns c. `plan` chooses the kernel (and the autotuned one its
    configuration per shape, dtype and layout on first use).

    Differentiable in a and b (without c): dA and dB are GEMMs of their own
    (grad_a, grad_b), each operand read as it lies, no transposed copy.
    Under torch.compile it runs as the custom op torch.ops.tk_mlir.matmul
    (tk_mlir/kernels/custom_ops.py), traced as one node, its result copied into c;
    eager calls launch directly (the op's dispatch would add host time to
    every call)."""
    import torch
    if torch.compiler.is_compiling():
        checked_grads(a, b, c, b_layout)
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir
        out = torch.ops.tk_mlir.matmul(a, b, b_layout, None if c is None else c.dtype)
        return out if c is None else c.copy_(out)
    # eager: no op dispatch, and a signature seen before was checked then (eager.py),
    # but for c's memory against a's and b's (the same signature may alias; under
    # torch.compile the op's result is copied into c, and traced tensors have no
    # addresses to compare)
    if c is not None:
        checks.written_apart("matmul", "c", c, a=a, b=b)
    key = (eager.tensor_key(a), eager.tensor_key(b), eager.tensor_key(c), b_layout,
           torch.is_grad_enabled())
    return _PREPARED.call(key, lambda: _prepare(a, b, c, b_layout), a, b, c)


# Eager matmul calls by signature (eager.py).
_PREPARED = eager.Prepared()


def checked_grads(a, b, c, b_layout: str) -> bool:
    """matmul's arguments checked; whether autograd records the call (then c,
    the output to write into, is refused)."""
    import torch
    check(a, b, c, b_layout, device=False)
    checks.output_outside_autograd("matmul", "c", c)
    grads = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if grads and c is not None:
        raise RuntimeError("matmul: c (the output to write into) does not take part in "
                           "autograd, and an input requires grad; leave out c (or call "
                           "under torch.no_grad())")
    checks.on_cuda("matmul", "a", a)            # (last: every other rule shows on CPU)
    return grads


def _prepare(a, b, c, b_layout: str):
    """After checking an eager call, `run(a, b, c) -> c` for calls like it:
    through autograd when it records them, else c allocated when None and
    the product launched, planned here when the operands are read as they
    lie (no padded copies)."""
    return _planned(a, b, c, b_layout, checked_grads(a, b, c, b_layout))


def _planned(a, b, c, b_layout: str, grads: bool):
    """_prepare's function for checked arguments (grads: autograd records
    the calls; its forward launches as a call without grads would)."""
    if grads:                                   # (c is None: checked_grads refuses it)
        from tk_mlir.kernels import custom_ops
        product = _planned(a, b, None, b_layout, False)
        gradients = eager.per_layout(lambda a, b: planned_grads(a, b, b_layout), 2)
        return lambda a, b, c: custom_ops.EagerMatmul.apply(a, b, b_layout, product, gradients)
    shape = output_shape(a, b, b_layout)       # (c: a's dtype and device, as a.new_empty)
    as_they_lie = a.is_cuda and not is_blackwell(a.get_device()) and \
        read_as_they_lie(a, b, c, shape[-1])
    if as_they_lie:
        (M, K), sms = a.shape[-2:], num_sms(a.get_device())
        product = planned_run(_plan(M, shape[-1], K, sms, a.shape[0] if a.dim() == 3 else 1,
                                    b_layout), b_layout, "mk", sms, same_signature=True)
    else:                                       # (padded copies where needed: launch's)
        def product(a, b, c):
            launch(a, b, c, b_layout)

    def run(a, b, c):
        c = a.new_empty(shape) if c is None else c
        product(a, b, c)
        return c
    return run


def planned_grads(a, b, b_layout: str):
    """`run(dc, a, b, need_a, need_b) -> (dA or None, dB or None)`: grad_a's and
    grad_b's products for an eager signature's a and b (laid out as these on
    every call: autograd's saved inputs), planned once and launched bound to
    the signature (planned_run, same_signature); dC, whose layout autograd
    chooses, is copied into the product's (contiguous, a's dtype) where it
    is not. Operands a kernel cannot read as they lie (rows that are not
    whole 16-byte vectors) and Blackwell take grad_a and grad_b per call."""
    import torch
    shape = output_shape(a, b, b_layout)
    dtype, device, size = a.dtype, a.device, a.element_size()
    M, N, K = shape[-2], shape[-1], a.shape[-1]
    # (CPU tensors too: the interpreter runs the same plans)
    bound = not is_blackwell(a.get_device()) and read_as_they_lie(a, b, None, N) and \
        _whole_vectors(K, size) == K            # (dA's rows: K wide)
    if not bound:
        return lambda dc, a, b, need_a, need_b: (grad_a(dc, b, b_layout) if need_a else None,
                                                 grad_b(dc, a, b_layout) if need_b else None)
    sms, batch, lead = num_sms(a.get_device()), (a.shape[0] if a.dim() == 3 else 1), shape[:-2]
    nk = b_layout == "nk"
    # dA = dC·B (b N x K: read as K x N) or dC·Bᵀ; dB = dCᵀ·A (N x K) or Aᵀ·dC (K x N),
    # the transposed operand read as K x M (grad_a's and grad_b's products)
    product_a = planned_run(_plan(M, K, N, sms, batch, "kn" if nk else "nk"),
                            "kn" if nk else "nk", "mk", sms, same_signature=True)
    product_b = planned_run(_plan(N, K, M, sms, batch, None) if nk else
                            _plan(K, N, M, sms, batch, None), "kn", "km", sms,
                            same_signature=True)
    da_shape, db_shape = (*lead, M, K), ((*lead, N, K) if nk else (*lead, K, N))
    strides = contiguous_strides(shape)

    def run(dc, a, b, need_a, need_b):
        dc = eager.laid_out(dc, shape, strides, dtype)
        da = db = None
        if need_a:
            da = torch.empty(da_shape, dtype=b.dtype, device=device)
            product_a(dc, b, da)
        if need_b:
            db = torch.empty(db_shape, dtype=dtype, device=device)
            product_b(*((dc, a) if nk else (a, dc)), db)
        return da, db
    return run


def check_b_layout(fn: str, b_layout) -> None:
    """b_layout is 'nk' (b is N x K) or 'kn' (b is K x N)."""
    if b_layout not in ("nk", "kn"):
        raise ValueError(f"{fn}: b_layout must be 'nk' (b is N x K) or 'kn' (b is K x N), "
                         f"got {b_layout!r}")


def check(a, b, c, b_layout: str, fn: str = "matmul", *, device: bool = True) -> None:
    """The arguments of matmul (or of `fn`, which takes them too), each rule with
    the argument that breaks it; device=False leaves out the CUDA-device check
    (last, for a caller with rules of its own to check first)."""
    import torch
    check_b_layout(fn, b_layout)
    kn = b_layout == "kn"
    inputs = (torch.bfloat16, torch.float16)
    checks.tensor(fn, "a", a, dtypes=inputs)
    if a.dim() not in (2, 3):
        raise ValueError(f"{fn}: a must be 2-D (M x K) or 3-D (G x M x K, a batch), got "
                         f"shape {tuple(a.shape)}")
    checks.tensor(fn, "b", b, ndim=a.dim(), dtypes=inputs)
    checks.like(fn, "b", b, "a", a)
    batch = tuple(a.shape[:-2])
    if tuple(b.shape[:-2]) != batch:
        raise ValueError(f"{fn}: a and b must have one batch size: a is {tuple(a.shape)}, "
                         f"b is {tuple(b.shape)}")
    M, K = a.shape[-2:]
    N, Kb = (b.shape[-1], b.shape[-2]) if kn else b.shape[-2:]
    if Kb != K:
        raise ValueError(f"{fn}: inner dimensions differ: a is {tuple(a.shape)} "
                         f"({'G x ' if batch else ''}M x K), b is {tuple(b.shape)} "
                         f"({'G x ' if batch else ''}{'K x N' if kn else 'N x K'}, "
                         f"b_layout={b_layout!r})")
    if c is not None:
        checks.tensor(fn, "c", c, ndim=a.dim(), dtypes=(*inputs, torch.float32))
        checks.like(fn, "c", c, "a", a, dtype=False)
        checks.shape(fn, "c", c, (*batch, M, N), "G x M x N" if batch else "M x N")
        checks.written_in_place(fn, "c", c)
    if device:
        checks.on_cuda(fn, "a", a)


def check_gradient(fn: str, dc, x, b_layout: str, of: str) -> None:
    """The arguments of a matmul gradient op (`fn`): dC (16-bit or f32) and the
    saved operand x that product needs: b for dA (of="a"), a for dB (of="b"),
    each rule with the argument that breaks it."""
    import torch
    check_b_layout(fn, b_layout)
    name = "b" if of == "a" else "a"
    checks.tensor(fn, name, x, dtypes=(torch.bfloat16, torch.float16))
    if x.dim() not in (2, 3):
        raise ValueError(f"{fn}: {name} must be 2-D or 3-D (a batch), got shape "
                         f"{tuple(x.shape)}")
    checks.tensor(fn, "dc", dc, ndim=x.dim(), dtypes=(torch.bfloat16, torch.float16,
                                                      torch.float32))
    checks.like(fn, "dc", dc, name, x, dtype=False)
    if tuple(dc.shape[:-2]) != tuple(x.shape[:-2]):
        raise ValueError(f"{fn}: dc and {name} must have one batch size: dc is "
                         f"{tuple(dc.shape)}, {name} is {tuple(x.shape)}")
    if of == "a":           # dC (M x N) against b's N
        n = x.shape[-1] if b_layout == "kn" else x.shape[-2]
        rule, ok = f"dc's columns must be b's N = {n} (b_layout={b_layout!r})", \
            dc.shape[-1] == n
    else:                   # dC (M x N) against a's M
        rule, ok = f"dc's rows must be a's M = {x.shape[-2]}", dc.shape[-2] == x.shape[-2]
    if not ok:
        raise ValueError(f"{fn}: {rule}, got dc of shape {tuple(dc.shape)}")
    checks.on_cuda(fn, name, x)


def output_shape(a, b, b_layout: str) -> tuple[int, ...]:
    """(M, N), or (G, M, N) for a batch, of C for checked a, b."""
    return (*a.shape[:-1], b.shape[-1] if b_layout == "kn" else b.shape[-2])


# ------------------------------------------------------------ the choice

# Tiles for shapes too small for the autotuned kernel's 128 x 256, largest
# first (a larger tile reads less of A and B per FLOP).
SMALL_TILES = ((128, 128), (64, 256), (64, 128))
BUSY = 0.75              # a grid of tiles keeps the SMs busy from this many tiles per SM
WIDE_N = 192             # the wider tile (16·k) when 128 x 128 tiles overflow one wave
MIN_SLICE_STEPS = 8      # K steps (of rules_plan's bk: 128 bytes) a split-K slice keeps


@dataclass(frozen=True)
class Plan:
    """What matmul launches for a shape: `kernel` is "autotuned" (gemm_kernel
    and its configs), "tiles" (gemm_kernel with `config`), "split_k"
    (gemm_split_k_kernel with `config`), "stream_k" (the same kernel with
    STREAM_K in `config`), "cluster_split_k" (gemm_cluster_split_k_kernel with
    `config`: a grid of tiles x SPLIT blocks) or "none" (M, N or K is 0: no
    kernel; C is zeroed when K is 0, left as it is when accumulating);
    scaled_matmul's plans name its own kernels the same way (scaled_gemm);
    `why` says which rule chose it.
    Plans are cached and shared: `config` is read-only."""
    kernel: str
    config: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    why: str = ""


def plan(M: int, N: int, K: int, sms: int, batch: int = 1, layout: str | None = None) -> Plan:
    """The kernel for `batch` M x N x K products on `sms` SMs (H200: 132).
    With `layout` ("nk" or "kn": how B lies), a single product whose (N, K)
    the measured table (`measured_plan`) holds for this SM count, at an M
    within a factor of two (and not past the largest measured), takes the
    table's fastest plan where it beat the rules' by MEASURED_MARGIN; every
    other shape takes `rules_plan`. Sizes are ints >= 0, sms >= 1."""
    M, N, K, sms, batch = _plan_arguments("plan", M, N, K, sms, batch, layout)
    return _plan(M, N, K, sms, batch, layout)


def _plan_arguments(fn: str, M, N, K, sms, batch=1, layout=None) -> tuple[int, ...]:
    """(M, N, K, sms, batch) as Python ints, checked: sizes ints >= 0 (numpy's
    too), sms >= 1, layout None, "nk" or "kn"; else a TypeError or ValueError
    naming gemm.`fn`'s argument."""
    if type(M) is type(N) is type(K) is type(batch) is type(sms) is int \
            and min(M, N, K, batch) >= 0 and sms >= 1 and layout in (None, "nk", "kn"):
        return M, N, K, sms, batch
    import numbers
    for name, value, least in (("M", M, 0), ("N", N, 0), ("K", K, 0), ("batch", batch, 0),
                               ("sms", sms, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"gemm.{fn}: {name} must be an int, got {value!r}")
        if value < least:
            raise ValueError(f"gemm.{fn}: {name} must be at least {least}, got {value}")
    if layout not in (None, "nk", "kn"):
        raise ValueError(f"gemm.{fn}: layout must be None, 'nk' or 'kn' (how B lies), got "
                         f"{layout!r}")
    return int(M), int(N), int(K), int(sms), int(batch)


@functools.lru_cache(maxsize=1024)     # matmul asks on every call: keep it off the host path
def _plan(M: int, N: int, K: int, sms: int, batch: int, layout: str | None) -> Plan:
    if layout is not None and batch == 1 and M * N * K:
        chosen = measured_plan(M, N, K, sms, layout)
        if chosen is not None:
            return chosen
    return rules_plan(M, N, K, sms, batch)


def rules_plan(M: int, N: int, K: int, sms: int, batch: int = 1, bk: int = 64) -> Plan:
    """The kernel for `batch` M x N x K products on `sms` SMs by rule: the
    tiles counted below are all the products' tiles. The rules (tuned on
    Hopper, see BENCHMARKS.md, GEMM small and skinny shapes):
    1. Enough 128 x 256 tiles (BUSY x SMs): the autotuned kernel.
    2. Few rows (M <= 128): the product streams B from memory, so the tile
       keeps its rows to what the MMA allows (64, or 128 for M > 64) and is
       128 columns wide; idle SMs then take slices of K (split-K).
    3. Otherwise the largest of SMALL_TILES that still makes BUSY x SMs
       tiles (else the smallest), and split-K when the tiles fill at most
       half of the SMs. 128 x 128 tiles that overflow one wave while
       128 x WIDE_N tiles fill one (at least BUSY x SMs of them) take the
       wider tile (256 x 11008 x 4096: 1.40x, H200, BENCHMARKS.md).
    A split keeps MIN_SLICE_STEPS K steps (of bk elements: 128 bytes) per
    slice at least."""
    M, N, K, sms, batch = _plan_arguments("rules_plan", M, N, K, sms, batch)

    def tiles(bm, bn):
        return batch * tk.cdiv(M, bm) * tk.cdiv(N, bn)
    if not batch * M * N * K:
        return Plan("none", why=f"{batch} x {M} x {N} x {K}: an empty product (C is empty or "
                                f"zeros)")
    if tiles(128, 256) >= BUSY * sms:
        return Plan("autotuned", why=f"{tiles(128, 256)} tiles of 128 x 256 keep {sms} SMs busy")
    if M <= 128:
        bm, bn = (64 if M <= 64 else 128), 128
        why = f"M={M} <= 128 rows: B streams from memory, tiles of {bm} x {bn}"
    else:
        bm, bn = next((t for t in SMALL_TILES if tiles(*t) >= BUSY * sms), SMALL_TILES[-1])
        why = f"{tiles(bm, bn)} tiles of {bm} x {bn} for {sms} SMs"
        if (bm, bn) == (128, 128) and BUSY * sms <= tiles(128, WIDE_N) <= sms < tiles(bm, bn):
            # 128-wide tiles take a second, partial wave; WIDE_N-wide ones fill one
            why += f" take two waves; {tiles(128, WIDE_N)} of 128 x {WIDE_N} fill one"
            bn = WIDE_N
    config = tile_config(bm, bn)
    steps = tk.cdiv(K, bk)
    parts = min(sms // max(1, tiles(bm, bn)), steps // MIN_SLICE_STEPS)
    if parts >= 2:                       # as many as slices of cdiv(steps, parts) steps need
        parts = tk.cdiv(steps, tk.cdiv(steps, parts))
    if parts >= 2 and (M <= 128 or 2 * tiles(bm, bn) <= sms):
        return Plan("split_k", MappingProxyType({**split_tile_config(bm, bn), "SPLIT_K": parts}),
                    f"{why}; {tiles(bm, bn)} tiles leave SMs idle: K in {parts} slices")
    return Plan("tiles", MappingProxyType(config), why)


def tile_config(bm: int, bn: int) -> dict:
    """gemm_kernel's config for bm x bn tiles: a ring of about 200 KB of
    shared memory (64 x 64: 12 stages of 16 KB), one consumer warpgroup per
    64 rows, and an epilogue whose pieces divide bn."""
    stages = 8 if bm == 64 and bn == 128 else 4 if bn >= WIDE_N else \
        12 if bm == 64 and bn <= 64 else 6
    config = dict(BM=bm, BN=bn, STAGES=stages, num_warps=4 * (bm // 64 + 1))
    if bn % 128:
        config["EPI_N"] = 64
    return config


def split_tile_config(bm: int, bn: int) -> dict:
    """gemm_split_k_kernel's config for bm x bn tiles (SPLIT_K to be added):
    tile_config's, less its TMA epilogue's pieces (the split kernel adds its
    slices into C through tk.store_partial)."""
    config = tile_config(bm, bn)
    config.pop("EPI_N", None)
    return config


def pingpong_config(bm: int, bn: int) -> dict:
    """gemm_kernel's PINGPONG config for bm x bn tiles (bm x bn <= 128 x 128):
    two consumer warpgroups taking whole tiles in turn, each staging its
    epilogue in 64-column pieces through two tiles, and the deepest ring of
    64-deep stages that fits beside them."""
    if bm not in (64, 128) or bn % 64 or not 64 <= bn <= 256 or bm * bn > 128 * 128:
        raise ValueError(f"gemm.pingpong_config: tiles of bm in (64, 128) rows and bn (64, "
                         f"128, 192 or 256: its epilogue's 64-column pieces) columns, bm x bn "
                         f"<= 128 x 128; got {bm} x {bn}")
    staging = 2 * 2 * bm * 64 * 2                    # consumers x buffers x (bm, 64) 16-bit
    stages = ring_stages(bm, bn, staging)
    return dict(BM=bm, BN=bn, STAGES=stages, EPI_N=64, EPI_BUFFERS=2, PINGPONG=True,
                num_warps=12)


def sliced_config(bn: int, split: bool = False) -> dict:
    """gemm_kernel's (split: gemm_split_k_kernel's, SPLIT_K to be added)
    SLICED_K config for 64 x bn tiles: two consumer warpgroups on alternate K
    steps, the second's partial summed through a 64 x bn f32 tile, and the
    deepest ring of an even number of stages that fits beside it (and the
    first one's epilogue staging tile, not split). At bn = 256 (not split:
    its partial stores spill) the partial and four stages fill shared memory,
    and C leaves from registers (TMA_STORE off)."""
    if type(bn) is not int or bn not in (64, 128, 256) or (split and bn == 256):
        raise ValueError(f"gemm.sliced_config: tiles of 64 x bn, bn 64 or 128, or 256 not "
                         f"split (a 64 x bn f32 partial beside the ring), got bn={bn}"
                         f"{' with split' if split else ''}")
    staging = 0 if split or bn == 256 else 64 * bn * 2
    stages = ring_stages(64, bn, 64 * bn * 4 + staging) // 2 * 2
    config = dict(BM=64, BN=bn, STAGES=stages, SLICED_K=True, num_warps=12)
    if bn == 256:
        config["TMA_STORE"] = False
    elif bn % 128 and not split:
        config["EPI_N"] = 64
    return config


def stream_k_config(bm: int, bn: int) -> dict:
    """gemm_split_k_kernel's STREAM_K config for bm x bn tiles (tile_config's,
    K steps cut evenly among the blocks)."""
    return {**split_tile_config(bm, bn), "SPLIT_K": 1, "STREAM_K": True}


# Tiles and K splits `candidate_plans` offers the measured table. 64 x 64
# tiles (a 12-stage ring) are for few rows, where B streams from memory:
# twice the blocks of 64 x 128 before any split (not yet in the table).
CANDIDATE_TILES = ((64, 64), (64, 128), (64, 256), (128, 128), (128, WIDE_N), (128, 256))
CANDIDATE_SPLIT_TILES = ((64, 64), (64, 128), (128, 128))
CANDIDATE_PINGPONG_TILES = ((128, 128), (64, 256))
# Tile widths of 64-row tiles whose K steps two warpgroups share (sliced-K),
# alone, and split (as CANDIDATE_SPLIT_TILES).
CANDIDATE_SLICED_WIDTHS = (64, 128, 256)
CANDIDATE_SLICED_SPLIT_WIDTHS = (64, 128)
CANDIDATE_SPLITS = (2, 3, 4, 6, 8, 12, 16)
MIN_CANDIDATE_SLICE_STEPS = 4
# Split-K across a cluster's blocks (gemm_cluster_split_k_kernel) among the
# candidates (see CLUSTER_SPLIT_KN for B as K x N).
CLUSTER_SPLIT_CANDIDATES = True
CANDIDATE_CLUSTER_SPLITS = (2, 4, 8)


def candidate_plans(M: int, N: int, K: int, sms: int) -> list[Plan]:
    """The plans `benchmarks/gemm_plan_table.py` times for one M x N x K
    product: the rules' plan first, the autotuned kernel, every tile of
    CANDIDATE_TILES, of CANDIDATE_PINGPONG_TILES (ping-pong) and of
    CANDIDATE_SLICED_WIDTHS (sliced-K), K splits of the split tiles and the
    sliced ones that keep at least MIN_CANDIDATE_SLICE_STEPS K steps per
    slice and at most two waves of blocks, stream-K over the split tiles
    where they make fewer than two waves, and (CLUSTER_SPLIT_CANDIDATES) K
    split across the blocks of a cluster likewise. Any of them computes any
    shape; they differ in speed only."""
    M, N, K, sms, _ = _plan_arguments("candidate_plans", M, N, K, sms)
    if not M * N * K:
        return [rules_plan(M, N, K, sms)]            # (an empty product: nothing to time)
    plans = [rules_plan(M, N, K, sms), Plan("autotuned", why="the autotuned kernel")]
    for bm, bn in CANDIDATE_TILES:
        plans.append(Plan("tiles", MappingProxyType(tile_config(bm, bn)),
                          f"tiles of {bm} x {bn}"))
    for bm, bn in CANDIDATE_PINGPONG_TILES:
        plans.append(Plan("tiles", MappingProxyType(pingpong_config(bm, bn)),
                          f"tiles of {bm} x {bn}, two warpgroups in turn (ping-pong)"))
    sliced = " K steps alternating between two warpgroups (sliced-K)"
    for bn in CANDIDATE_SLICED_WIDTHS:
        plans.append(Plan("tiles", MappingProxyType(sliced_config(bn)),
                          f"tiles of 64 x {bn},{sliced}"))
    for bm, bn in CANDIDATE_SPLIT_TILES:
        if tk.cdiv(M, bm) * tk.cdiv(N, bn) < 2 * sms:     # (stream-K: for a wave or two)
            plans.append(Plan("stream_k", MappingProxyType(stream_k_config(bm, bn)),
                              f"tiles of {bm} x {bn}, stream-K (K steps cut evenly among "
                              f"the blocks)"))
    steps = tk.cdiv(K, 64)
    split_tiles = [(bm, bn, split_tile_config(bm, bn), "") for bm, bn in CANDIDATE_SPLIT_TILES]
    split_tiles += [(64, bn, sliced_config(bn, split=True), "," + sliced)
                    for bn in CANDIDATE_SLICED_SPLIT_WIDTHS]
    for bm, bn, config, suffix in split_tiles:
        tiles = tk.cdiv(M, bm) * tk.cdiv(N, bn)
        for parts in CANDIDATE_SPLITS:
            parts = tk.cdiv(steps, tk.cdiv(steps, parts))    # (no slice without K steps)
            if parts >= 2 and tk.cdiv(steps, parts) >= MIN_CANDIDATE_SLICE_STEPS \
                    and tiles * parts <= 2 * sms:
                plans.append(Plan("split_k", MappingProxyType({**config, "SPLIT_K": parts}),
                                  f"tiles of {bm} x {bn}, K in {parts} slices{suffix}"))
        if config.get("SLICED_K"):
            continue                     # (a cluster's blocks split K, not its warpgroups)
        for split in CANDIDATE_CLUSTER_SPLITS if CLUSTER_SPLIT_CANDIDATES else ():
            if bm % (8 * split) == 0 and tk.cdiv(steps, split) >= MIN_CANDIDATE_SLICE_STEPS \
                    and tiles * split <= 2 * sms:
                plans.append(Plan("cluster_split_k",
                                  MappingProxyType(cluster_split_config(bm, bn, split)),
                                  f"tiles of {bm} x {bn}, K in the {split} blocks of a "
                                  f"cluster (their sum in distributed shared memory)"))
    unique = {}
    for p in plans:                      # (the rules' plan is often one of the others)
        unique.setdefault((p.kernel, tuple(sorted(p.config.items()))), p)
    return list(unique.values())


MEASURED_PLANS = "gemm_plans.json"       # beside this module; benchmarks/gemm_plan_table.py
# Whether the measured table's split-K-in-a-cluster plans are taken with B as
# K x N. Off: on one H100 (2026-12-06) gemm_cluster_split_k_kernel with B as
# K x N returned one slice's sum (relative error 0.71) or NaN at 128 x 4096 x
# 4096, SPLIT=2, where B as N x K was right; the cause is not found
# (BENCHMARKS.md). Those shapes take the rules' plan.
CLUSTER_SPLIT_KN = False
# A measured plan replaces the rules' only when it was this much faster (one
# timed run per candidate: smaller wins are within the noise).
MEASURED_MARGIN = 0.03


@functools.lru_cache(maxsize=1)
def measured_plans() -> dict:
    """The measured table (MEASURED_PLANS) indexed by (layout, sms, N, K):
    its rows (M, Plan), sorted by M; empty when the file is absent."""
    import json
    from pathlib import Path
    path = Path(__file__).with_name(MEASURED_PLANS)
    if not path.exists():
        return {}
    table = json.loads(path.read_text())
    index: dict = {}
    for row in table["plans"]:
        chosen = None                    # (the rules' plan, within the margin)
        taken = CLUSTER_SPLIT_KN or not (row["kernel"] == "cluster_split_k" and
                                         row["layout"] == "kn")
        if taken and row["us"] < (1 - MEASURED_MARGIN) * row["rules_us"]:
            why = (f"measured on {table['device']} ({table['measured']}): the fastest of "
                   f"{row['candidates']} plans at {row['M']} x {row['N']} x {row['K']} "
                   f"({row['us']:.1f} us; the rules' plan {row['rules_us']:.1f} us)")
            chosen = Plan(row["kernel"], MappingProxyType(dict(row["config"])), why)
        index.setdefault((row["layout"], table["sms"], row["N"], row["K"]), []).append(
            (row["M"], chosen))
    for rows in index.values():
        rows.sort(key=lambda r: r[0])
    return index


def measured_plan(M: int, N: int, K: int, sms: int, layout: str) -> Plan | None:
    """The measured table's plan for the nearest M (in ratio) of this (N, K),
    layout and SM count, if that M is within a factor of two of M and M is
    not past the largest M measured (more rows keep the rules' autotuned
    kernel); None otherwise, or where the rules' plan was as fast."""
    rows = measured_plans().get((layout, sms, N, K))
    if not rows or not 1 <= M <= rows[-1][0]:
        return None
    m, chosen = min(rows, key=lambda r: abs(math.log2(r[0] / M)))
    return chosen if m / 2 <= M <= 2 * m else None


def launch(a, b, c, b_layout: str, a_layout: str = "mk", accumulate: bool = False) -> None:
    """The planned kernel on checked tensors, into c; a_layout="km": a is
    given as K x M (a gradient's product, see grad_b); accumulate: c += the
    product, for a 16-bit c (a sum over chunks kept in place, each added
    rounded to c's dtype). Any M, N, K (padded_launch)."""
    if accumulate and c.element_size() != 2:
        raise TypeError(f"gemm.launch: accumulate=True adds into a 16-bit c, got {c.dtype}")
    padded_launch(lambda a, b, c: _launch(a, b, c, b_layout, a_layout, accumulate), a, b, c,
                  b_layout, a_layout, partial=accumulate)


def padded_launch(run, a, b, c, b_layout: str, a_layout: str = "mk",
                  partial: bool = False) -> None:
    """run(a, b, c) on operands kernels read as they lie: those whose rows are
    not whole 16-byte vectors (K = 250, a misaligned view) go through copies
    padded with zeros; the result goes straight into c unless c's rows need
    padding too, or the padded product is wider (N or M padded), then
    through a padded buffer copied back (partial=True: the buffer starts as
    c, for a run that writes only some of c's rows or adds into c)."""
    a2, b2 = padded_rows(a), padded_rows(b)
    m = a2.shape[-1] if a_layout == "km" else a2.shape[-2]     # (padded when a is K x M)
    n = b2.shape[-1] if b_layout == "kn" else b2.shape[-2]     # (padded when b is K x N)
    if (m, n) == tuple(c.shape[-2:]) and checks.readable(c):
        return run(a2, b2, c)
    c2 = c.new_empty(*c.shape[:-2], m, _whole_vectors(n, c.element_size()))
    if partial:
        c2[..., :c.shape[-2], :c.shape[-1]] = c
    run(a2, b2, c2)
    c.copy_(c2[..., :c.shape[-2], :c.shape[-1]])


def read_as_they_lie(a, b, c, n: int) -> bool:
    """Whether the kernels read a and b and write c (None: a new output of n
    columns in a's dtype) as they lie, with no padded copy (padded_launch's
    test, made once for a planned call)."""
    return checks.readable(a) and checks.readable(b) and \
        (checks.readable(c) if c is not None else _whole_vectors(n, a.element_size()) == n)


def padded_rows(t):
    """t when kernels can read it as it lies (`checks.readable`), else a copy
    whose last dim is padded with zeros to whole 16-byte vectors."""
    if checks.readable(t):
        return t
    n = t.shape[-1]
    out = t.new_zeros(*t.shape[:-1], _whole_vectors(n, t.element_size()))
    out[..., :n] = t
    return out


def _whole_vectors(n: int, itemsize: int) -> int:
    """n rounded up to whole 16-byte vectors of `itemsize`-byte elements."""
    per = 16 // itemsize
    return -(-n // per) * per


def _launch(a, b, c, b_layout: str, a_layout: str, accumulate: bool = False) -> None:
    km = a_layout == "km"
    M, K = (a.shape[-1], a.shape[-2]) if km else (a.shape[-2], a.shape[-1])
    N = c.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    device = a.get_device()
    if is_blackwell(device):
        if accumulate:                  # (its kernel stores only: through a product of its own)
            product = c.new_empty(c.shape)
            blackwell_gemm.launch(a, b, product, b_layout, a_layout)
            c += product
            return
        return blackwell_gemm.launch(a, b, c, b_layout, a_layout)
    sms = num_sms(device)
    chosen = _plan(M, N, K, sms, batch, None if km else b_layout)      # (ints: no checks)
    if accumulate:
        if chosen.kernel != "none":                  # (a sum of no products adds nothing)
            _accumulate(a, b, c, chosen, sms, b_layout == "kn", km)
    else:
        run_plan(chosen, a, b, c, b_layout, a_layout, sms)


def run_plan(chosen: Plan, a, b, c, b_layout: str, a_layout: str, sms: int) -> None:
    """c = the product by `chosen`'s kernel on checked, readable operands
    (M, N, K as they lie; the table script times each candidate here)."""
    planned_run(chosen, b_layout, a_layout, sms)(a, b, c)


def planned_run(chosen: Plan, b_layout: str, a_layout: str, sms: int,
                same_signature: bool = False):
    """`run(a, b, c)`: run_plan's launch for `chosen`, made once for calls
    repeating it (the kernel's launcher for the plan's grid and keywords;
    same_signature: every call's tensors are laid out as the first's,
    eager.launcher)."""
    if b_layout not in ("nk", "kn") or a_layout not in ("mk", "km"):
        raise ValueError(f"gemm.run_plan: b_layout must be 'nk' or 'kn' and a_layout 'mk' or "
                         f"'km', got {b_layout!r} and {a_layout!r}")
    kn, km = b_layout == "kn", a_layout == "km"
    if chosen.kernel == "none":
        return lambda a, b, c: c.zero_()             # a sum of no products
    if chosen.kernel == "cluster_split_k":
        if km:
            raise ValueError("gemm.run_plan: a cluster_split_k plan takes A as M x K")
        cfg = chosen.config
        return eager.launcher(gemm_cluster_split_k_kernel, same_signature)(
            lambda meta: tk.cdiv(meta["C"].shape[0], cfg["BM"]) *
            tk.cdiv(meta["C"].shape[1], cfg["BN"]) * cfg["SPLIT"], B_KN=kn, **cfg)
    return plan_launcher(chosen, gemm_kernel, gemm_split_k_kernel, sms, same_signature,
                         B_KN=kn, **_a_km(km))


def plan_launcher(chosen: Plan, tuned, split_kernel, sms: int, same_signature: bool = False,
                  **options):
    """`run(a, b, c, *rest)`: the launch of `chosen` (an "autotuned", "tiles",
    "split_k" or "stream_k" plan) over `sms` blocks, made once: `tuned` (an
    autotuned kernel, whose .kernel takes a tile plan's config) or
    `split_kernel`, which also takes the workspace views of its C (c) after
    *rest; `options`: keywords every launch passes; same_signature: as
    planned_run's."""
    if chosen.kernel == "autotuned":                 # (its dispatch picks the config)
        dispatch = tuned[(sms,)]
        return lambda *args: dispatch(*args, **options)
    if chosen.kernel == "tiles":
        return eager.launcher(tuned.kernel, same_signature)((sms,), **options, **chosen.config)
    cfg = chosen.config
    split = eager.launcher(split_kernel, same_signature)((sms,), **options, **cfg)

    def run_split(a, b, c, *rest):
        counters = split_k_counters(c.shape[-2], c.shape[-1], cfg["BN"],
                                    a.shape[0] if a.dim() == 3 else 1)
        split(a, b, c, *rest, *workspace_views(a.device, c.shape, counters))
    return run_split


def _accumulate(a, b, c, chosen: Plan, sms: int, kn: bool, km: bool) -> None:
    """c += the product by gemm_kernel with ACCUMULATE, which is never tuned
    (timing it would add into c at every launch): the config tuned for the
    same product stored, when there is one, else the first; a split-K plan
    takes its tiles unsplit (split-K's partial sums store, not add; a sliced
    one its ring re-sized beside the epilogue's staging tile, 64 x 256 ones
    64 x 128)."""
    if chosen.kernel == "autotuned":
        tuned = None
        if a.is_cuda:
            import torch
            with torch.cuda.device(a.device):       # (best_config asks the current device)
                tuned = gemm_kernel.best_config(a, b, c, B_KN=kn, **_a_km(km))
        config = (tuned or gemm_kernel.configs[0]).all_kwargs()
    elif chosen.config.get("SLICED_K"):    # (ACCUMULATE adds through staging tiles, which
        config = sliced_config(min(chosen.config["BN"], 128))   # 64 x 256 sliced has none)
    else:       # (a split plan's tiles, unsplit)
        config = {k: v for k, v in chosen.config.items()
                  if k not in ("SPLIT_K", "STREAM_K", "SPLIT")}
    gemm_kernel.kernel[(sms,)](a, b, c, B_KN=kn, **config, **_a_km(km), ACCUMULATE=True)


def _a_km(km: bool) -> dict:
    """A_KM passed only when set: a forward launch is the call it always was
    (the same launch plan and autotuning key)."""
    return {"A_KM": True} if km else {}


# ------------------------------------------------------------ gradients

def grad_a(dc, b, b_layout: str):
    """dA of C = matmul(a, b, b_layout=b_layout) given dC: dC·B for B as N x K,
    dC·Bᵀ for K x N, b read as it lies (no transposed copy). In b's dtype (an
    f32 dC is rounded to it first, as the GEMM's inputs are 16-bit)."""
    import torch
    dc = checks.kernel_operand(dc, b.dtype)
    K = b.shape[-1] if b_layout == "nk" else b.shape[-2]
    da = torch.empty(*dc.shape[:-1], K, dtype=b.dtype, device=dc.device)
    launch(dc, b, da, "kn" if b_layout == "nk" else "nk")
    return da


def grad_b(dc, a, b_layout: str):
    """dB of C = matmul(a, b, b_layout=b_layout) given dC, in b's layout:
    dCᵀ·A (N x K) or Aᵀ·dC (K x N), the transposed operand read as K x M by
    the kernel (A_KM), not copied. In a's dtype."""
    import torch
    dc = checks.kernel_operand(dc, a.dtype)
    batch, (M, K), N = a.shape[:-2], a.shape[-2:], dc.shape[-1]
    if b_layout == "nk":
        db = torch.empty(*batch, N, K, dtype=a.dtype, device=a.device)
        launch(dc, a, db, "kn", a_layout="km")
    else:
        db = torch.empty(*batch, K, N, dtype=a.dtype, device=a.device)
        launch(a, dc, db, "kn", a_layout="km")
    return db




# (device, stream) -> [f32 workspace, int32 counters, captured]: zeros, and
# left zeros by every split-K launch, so they are kept; one pair per stream,
# since two launches at once would share them. A pair a CUDA graph captured
# stays alive when a larger one replaces it (_CAPTURED): the graph uses it.
_WORKSPACES: dict = {}
_CAPTURED: list = []


def _workspace(device, elements: int, counters: int) -> list:
    """[w, f, captured, views]: a zeroed f32 workspace w of at least `elements`
    and int32 counters f of at least `counters` for the current stream, whether
    a graph captured them, and the views taken of them (workspace_views).
    While a CUDA graph is captured, the stream's kept pair if it is large
    enough (warm up on the capture stream first, as torch.cuda.graph
    advises), else a new pair made inside the graph, which zeroes it at every
    replay, and not kept. Graphs captured on one stream share its pair:
    replay them one at a time."""
    import torch
    from tk_mlir.runtime.driver import current_stream
    cuda = device.type == "cuda"
    capturing = cuda and torch.cuda.is_current_stream_capturing()
    key = (device.index, current_stream(device.index)) if cuda else None
    kept = _WORKSPACES.get(key)
    if kept is not None and kept[0].numel() >= elements and kept[1].numel() >= counters:
        kept[2] = kept[2] or capturing
        return kept
    w = torch.zeros(max(elements, kept[0].numel() if kept else 0), dtype=torch.float32,
                    device=device)
    f = torch.zeros(max(counters, kept[1].numel() if kept else 0), dtype=torch.int32,
                    device=device)
    pair = [w, f, capturing, {}]
    if not capturing:
        if kept is not None and kept[2]:
            _CAPTURED.append(kept)
        _WORKSPACES[key] = pair
    return pair


def workspace_views(device, shape, counters: int):
    """(W, F) as gemm_split_k_kernel takes them for a C of `shape`: views of
    the current stream's workspace pair (_workspace), taken once per shape and
    kept with the pair (so they go when it is replaced)."""
    pair = _workspace(device, math.prod(shape), counters)
    views = pair[3].get((shape, counters))
    if views is None:
        w, f = pair[0], pair[1]
        views = (w[:math.prod(shape)].view(shape), f[:counters])
        if len(pair[3]) >= 64:
            pair[3].clear()
        pair[3][(shape, counters)] = views
    return views
