"""The side table of attention over packed sequences (varlen): which keys
each query row sees, made on the GPU from cu_seqlens by one kernel (no host
synchronisation), and the attention kernels' readers of it.

Packed q (total_q, H, D) and k (total_k, H_kv, D) are attended as one batch
of one long sequence each, (1, H, total, D) views; the sequences' borders,
causality and windows are all one rule per query row r: it sees the packed
keys [klo[r], khi[r]) (empty when khi <= klo). The dense kernels then only
need, besides their task schedule, each task's range of keys (the forward)
or query blocks (the backward) and, to mask only the blocks that cross a
border, the keys every row of a 64-row tile sees.

The tail, appended to a kernel's TASKS table (schedule part padded to a
multiple of 64 entries, so that 64-entry vectors of the tail are whole
vector loads), all i32, `rows` = total_q rounded up to ROW_ALIGN, `keys` =
total_k rounded up to 128:

    klo[rows] | khi[rows] | tiles: (lo_all, hi_all) per 64-row tile | qlo[keys] | qhi[keys]
              | ranges: (first, end) per task

Each pair sits in a slot of SLOT entries (the kernel writes it as one
register vector; vectors hold at least 8), each part padded to 64 entries.
`qlo`, `qhi` are the same rule seen from the keys: key j is seen by the
packed query rows [qlo[j], qhi[j]); the backward, whose tiles have keys for
rows, masks with them (two registers per thread for a row vector, where a
column vector of klo would take 16). `ranges` is the forward's keys
[first, end) per task of BM query rows (its key blocks start at `first`,
its first row's first key, so that a tile within one sequence starts its
walk with that sequence's keys and only its last block crosses a border;
(0, 1) when its rows see none), or the backward's query tiles per 128-key
K/V block. `offsets` finds the parts from the table's end.

Within a sequence, and across sequences in order, klo and khi never
decrease with the row (khi is clamped below at its sequence's first key, so
rows before the causal diagonal do not break it), nor qlo and qhi with the
key: a group of rows sees keys from its first row's klo to its last row's
khi, and every row of a tile within one sequence sees [klo(last), khi(first)).
"""
from __future__ import annotations

import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.kernels import checks

ROW_ALIGN = 384          # query rows padded to a multiple of every task's rows (128, 192)
EMPTY_LO = 1 << 30       # lo_all of a tile whose rows share no key (hi_all 0)
SLOT = 8                 # entries per (first, end) pair


def _pad64(n: int) -> int:
    return -(-n // 64) * 64


@tk.func
def offsets(TASKS, n, n_kv, tasks):
    """(klo, khi, tiles, qlo, qhi, ranges): where each part of TASKS' tail
    starts, for n packed query rows, n_kv keys and `tasks` entries in `ranges`."""
    rows = tk.cdiv(n, ROW_ALIGN) * ROW_ALIGN
    keys = tk.cdiv(n_kv, 128) * 128
    ranges = TASKS.shape[0] - tk.cdiv(SLOT * tasks, 64) * 64
    qlo = ranges - 2 * keys
    tiles = qlo - tk.cdiv(SLOT * rows // 64, 64) * 64
    return tiles - 2 * rows, tiles - rows, tiles, qlo, qlo + keys, ranges


@tk.func
def forward_offsets(TASKS, n, n_kv, BM):
    """offsets() of the forward's tail: a range per BM padded query rows."""
    return offsets(TASKS, n, n_kv, tk.cdiv(n, ROW_ALIGN) * ROW_ALIGN // BM)


@tk.func
def backward_offsets(TASKS, n, n_kv):
    """offsets() of the backward's tail: a range per 128-key K/V block."""
    return offsets(TASKS, n, n_kv, tk.cdiv(n_kv, 128))


@tk.func
def pair(TASKS, at, i):
    """The pair in slot i of the part at `at`: tile i's (lo_all, hi_all) or
    task i's range."""
    return tk.load(TASKS, (at + SLOT * i,)), tk.load(TASKS, (at + SLOT * i + 1,))


@tk.func
def row_bound(TASKS, at, tile):
    """A bound (klo, khi, qlo or qhi: `at` is where that part starts) of each
    of the 64 rows of tile `tile`, an i32 vector (its layout follows its use)."""
    return tk.load(TASKS, (at // 64 + tile,), (64,), scope="warpgroup")


@tk.func
def sequence_of(CU, r, B, STEPS):
    """The sequence packed row r is in: the last b < B with CU[b] <= r (a
    binary search of STEPS >= log2(B) + 1 halvings)."""
    lo = 0
    hi = B
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        below = tk.load(CU, (mid,)) <= r
        lo = mid if below else lo
        hi = hi if below else mid
    return lo


@tk.func
def bound_at(r, own_s, own_e, oth_s, oth_e, BELOW, ABOVE):
    """(lo, hi) of rows r (a scalar, or an i32 vector of rows) of a sequence
    whose rows are [own_s, own_e) and whose other side is [oth_s, oth_e):
    the rule, with hi clamped below at oth_s (never decreasing)."""
    at = r - own_e + (oth_e - oth_s)          # the other side's diagonal entry, from oth_s
    lo = oth_s
    if BELOW >= 0:
        lo = oth_s + max(at - BELOW, 0)
    hi = oth_e
    if ABOVE >= 0:
        hi = min(oth_e, oth_s + at + ABOVE + 1)
    return lo, max(hi, oth_s)


@tk.func
def scalar_bound(r, OWN, OTH, b, BELOW, ABOVE):
    """bound_at of one row r of sequence b."""
    return bound_at(r, tk.load(OWN, (b,)), tk.load(OWN, (b + 1,)), tk.load(OTH, (b,)),
                    tk.load(OTH, (b + 1,)), BELOW, ABOVE)


@tk.func
def row_bounds_of_tile(OWN, OTH, r0, total, B, STEPS, BELOW, ABOVE):
    """(lo, hi) i32 vectors of the 64 packed rows from r0 (rows past `total`
    empty), and the sequences of its first and last rows."""
    r = tk.zeros((64,), f32).indices() + r0
    lo = r * 0
    hi = r * 0
    last = min(r0 + 63, total - 1)
    b0 = sequence_of(OWN, r0, B, STEPS)
    b1 = sequence_of(OWN, last, B, STEPS)
    if r0 < total:
        for b in range(b0, b1 + 1):
            s, e = tk.load(OWN, (b,)), tk.load(OWN, (b + 1,))
            blo, bhi = bound_at(r, s, e, tk.load(OTH, (b,)), tk.load(OTH, (b + 1,)), BELOW,
                                ABOVE)
            own = (r >= s) & (r < e)
            lo = tk.where(own, blo, lo)
            hi = tk.where(own, bhi, hi)
    return lo, hi, b0, b1


@tk.func
def store_pair(TAIL, at, i, first, end):
    """(first, end) into slot i of the part at `at` (a multiple of SLOT)."""
    k = tk.zeros((SLOT,), f32).indices()
    tk.store(TAIL, tk.where(k == 0, first, tk.where(k == 1, end, 0)), (at // SLOT + i,))


@tk.func
def group_range(OWN, OTH, first_row, rows, total, B, STEPS, BELOW, ABOVE, BLOCK):
    """(first, end) blocks of BLOCK entries of the other side that rows
    [first_row, first_row + rows) ∩ [0, total) see (at least one block;
    BLOCK = 1: the entries themselves)."""
    first = 0
    end = 1
    if first_row < total:
        last = min(first_row + rows, total) - 1
        lo, _ = scalar_bound(first_row, OWN, OTH, sequence_of(OWN, first_row, B, STEPS),
                             BELOW, ABOVE)
        _, hi = scalar_bound(last, OWN, OTH, sequence_of(OWN, last, B, STEPS), BELOW, ABOVE)
        first = lo // BLOCK if hi > lo else 0
        end = tk.cdiv(hi, BLOCK) if hi > lo else 1
    return first, end


@tk.kernel(num_warps=4)
def sequence_bounds_kernel(CU_Q: tk.gl, CU_K: tk.gl, TAIL: tk.gl, total_q: int, total_k: int,
                           B: int, STEPS: int, LEFT: tk.constexpr, RIGHT: tk.constexpr,
                           BM: tk.constexpr, FORWARD: tk.constexpr):
    """The tail (module docstring) for B sequences at offsets CU_Q, CU_K:
    block t < rows/64 writes query tile t's klo, khi and common keys (and,
    FORWARD, the range of task t·64/BM when it starts there); the blocks
    after it key tile u's qlo, qhi (and, not FORWARD, the range of K/V
    block u/2). RIGHT is 0 with causal. Grid (rows/64 + keys/64,)."""
    t = tk.block_id(0)
    rows = tk.cdiv(total_q, ROW_ALIGN) * ROW_ALIGN
    keys = tk.cdiv(total_k, 128) * 128
    tiles0 = 2 * rows
    qlo0 = tiles0 + tk.cdiv(SLOT * rows // 64, 64) * 64
    ranges0 = qlo0 + 2 * keys
    if t < rows // 64:
        r0 = t * 64
        lo, hi, b0, b1 = row_bounds_of_tile(CU_Q, CU_K, r0, total_q, B, STEPS, LEFT, RIGHT)
        tk.store(TAIL, lo, (t,))
        tk.store(TAIL, hi, (rows // 64 + t,))
        lo_all = EMPTY_LO
        hi_all = 0
        if (r0 + 63 < total_q) & (b0 == b1):
            lo_all, _ = scalar_bound(r0 + 63, CU_Q, CU_K, b0, LEFT, RIGHT)
            _, hi_all = scalar_bound(r0, CU_Q, CU_K, b0, LEFT, RIGHT)
        store_pair(TAIL, tiles0, t, lo_all, hi_all)
        if FORWARD:
            if t % (BM // 64) == 0:
                first, end = group_range(CU_Q, CU_K, r0, BM, total_q, B, STEPS, LEFT, RIGHT, 1)
                store_pair(TAIL, ranges0, t // (BM // 64), first, end)
    else:
        u = t - rows // 64
        lo, hi, _, _ = row_bounds_of_tile(CU_K, CU_Q, u * 64, total_k, B, STEPS, RIGHT, LEFT)
        tk.store(TAIL, lo, (qlo0 // 64 + u,))
        tk.store(TAIL, hi, (qlo0 // 64 + keys // 64 + u,))
        if not FORWARD:
            if u % 2 == 0:
                first, end = group_range(CU_K, CU_Q, u * 64, 128, total_k, B, STEPS, RIGHT,
                                         LEFT, 64)
                store_pair(TAIL, ranges0, u // 2, first, end)


def tail(cu_q, cu_k, total_q: int, total_k: int, causal: bool, window: tuple[int, int],
         *, forward_tasks: tuple[int, int] | None = None):
    """(tail, costs): the tail for cu_seqlens cu_q, cu_k (int32 (B+1,) on one
    device) by sequence_bounds_kernel, a torch tensor on that device made
    without reading the offsets on the host, and `costs()`, which makes each
    task's cost (blocks it reads) from it when called (a kept schedule needs
    none): one cost per task the kernel decodes (cdiv(total_q, BM), or
    cdiv(total_k, 128)). forward_tasks=(BM, BN): the forward's ranges (the
    cost of one: its keys in BN-key blocks); else the backward's. Query i
    of a sequence sees its keys j with i + shift - left <= j <= i + shift +
    right (both counted from the sequence's start; shift = len_k - len_q,
    bottom-right aligned as FlashAttention; right = 0 with causal; -1: no
    bound on that side)."""
    return planned_tail(total_q, total_k, causal, window, forward_tasks=forward_tasks)(cu_q, cu_k)


def planned_tail(total_q: int, total_k: int, causal: bool, window: tuple[int, int], *,
                 forward_tasks: tuple[int, int] | None = None, same_signature: bool = False):
    """`make(cu_q, cu_k, out=None) -> (tail, costs)`: `tail` for these
    totals and masks, its sizes and launch chosen once, written into `out`
    (a 1-D i32 view of `make.size` entries on a 16-byte boundary) where
    given; same_signature: every call's offsets are laid out as the first's
    (eager.launcher)."""
    from tk_mlir.kernels import eager
    left, right = window[0], 0 if causal else window[1]
    rows = -(-max(total_q, 1) // ROW_ALIGN) * ROW_ALIGN
    keys = -(-max(total_k, 1) // 128) * 128
    bm, bn = forward_tasks or (128, 128)
    tasks = rows // bm if forward_tasks else keys // 128
    parts = (2 * rows, _pad64(SLOT * rows // 64), 2 * keys, _pad64(SLOT * tasks))
    size, ranges_at = sum(parts), sum(parts[:3])
    done = -(-max(total_q, 1) // bm) if forward_tasks else keys // 128
    kernel = eager.launcher(sequence_bounds_kernel, same_signature)(
        (rows // 64 + keys // 64,), LEFT=left, RIGHT=right, BM=bm,
        FORWARD=forward_tasks is not None)
    totals = (max(total_q, 1), max(total_k, 1))

    def make(cu_q, cu_k, out=None):
        if out is None:
            out = cu_q.new_empty(size)
        sequences = len(cu_q) - 1
        kernel(*checks.int32_vectors(cu_q, cu_k), out, *totals, sequences,
               max(sequences, 1).bit_length() + 1)

        def costs():
            ranges = out[ranges_at:].view(-1, SLOT)
            span = (ranges[:done, 1] - ranges[:done, 0]).long()
            return (span + (bn - 1)).div_(bn, rounding_mode="floor").clamp_(min=1) \
                if forward_tasks else span
        return out, costs
    make.size = size
    return make
