"""The side table of attention over packed sequences (varlen): which keys
each query row sees, made on the GPU from cu_seqlens without a
synchronisation, and the kernel-side readers of it.

Packed q (total_q, H, D) and k (total_k, H_kv, D) are attended as one batch
of one long sequence each, (1, H, total, D) views; the sequences' borders,
causality and windows are all one rule per query row r: it sees the packed
keys [klo[r], khi[r]) (empty: klo = EMPTY_LO, khi = 0). The dense kernels
then only need, besides their task schedule, each task's range of key (or
query) blocks and, to mask only the blocks that cross a border, the keys
every row of a 64-row tile sees.

The tail, appended to a kernel's TASKS table (schedule part padded to a
multiple of 64 entries, so that 64-entry vectors of the tail are whole
vector loads), all i32, `rows` = total_q rounded up to ROW_ALIGN:

    klo[rows] | khi[rows] | tiles: (lo_all, hi_all) per 64-row tile, padded to 64
              | qlo[keys] | qhi[keys] | ranges: (first, end) per task, padded to 64

`qlo`, `qhi` are the same rule seen from the keys (`keys` = total_k rounded
up to 128): key j is seen by the packed query rows [qlo[j], qhi[j]); the
backward, whose tiles have keys for rows, masks with them (two registers
per thread for a row vector, where a column vector of klo would take 16).

`ranges` is the forward's key blocks [first, end) per task of BM query rows,
or the backward's query tiles per 128-key K/V block. `offsets` finds the
parts from the table's end, as the host (`tail`) lays them out.
"""
from __future__ import annotations

import tk_mlir as tk

ROW_ALIGN = 384          # query rows padded to a multiple of every task's rows (128, 192)
EMPTY_LO = 1 << 30       # klo of a row that sees no key (khi 0): no key is in [EMPTY_LO, 0)


def _pad64(n):
    return (n + 63) // 64 * 64


@tk.func
def offsets(TASKS, n, n_kv, tasks):
    """(klo, khi, tiles, qlo, qhi, ranges): where each part of TASKS' tail
    starts, for n packed query rows, n_kv keys and `tasks` entries in `ranges`."""
    rows = tk.cdiv(n, ROW_ALIGN) * ROW_ALIGN
    keys = tk.cdiv(n_kv, 128) * 128
    ranges = TASKS.shape[0] - tk.cdiv(2 * tasks, 64) * 64
    qlo = ranges - 2 * keys
    tiles = qlo - tk.cdiv(rows // 32, 64) * 64
    return tiles - 2 * rows, tiles - rows, tiles, qlo, qlo + keys, ranges


@tk.func
def pair(TASKS, at, i):
    """Entries at + 2i and at + 2i + 1: tile i's (lo_all, hi_all) or task i's range."""
    return tk.load(TASKS, (at + 2 * i,)), tk.load(TASKS, (at + 2 * i + 1,))


@tk.func
def row_bound(TASKS, at, tile):
    """A bound (klo, khi, qlo or qhi: `at` is where that part starts) of each
    of the 64 rows of tile `tile`, an i32 vector (its layout follows its use)."""
    return tk.load(TASKS, (at // 64 + tile,), (64,), scope="warpgroup")


def bounds(cu_q, cu_k, total_q: int, total_k: int, causal: bool, window: tuple[int, int]):
    """(klo, khi, qlo, qhi), int64 torch tensors on cu_q's device, made without
    reading the offsets on the host (cu_q, cu_k: int32 (B+1,)): each query
    row's keys [klo, khi) (total_q rounded up to ROW_ALIGN rows) and each
    key's query rows [qlo, qhi) (total_k rounded up to 128); empty: (EMPTY_LO,
    0). Query i of a sequence sees its keys j with i + shift - left <= j <= i
    + shift + right (both counted from the sequence's start; shift = len_k -
    len_q, bottom-right aligned as FlashAttention; right = 0 with causal; -1:
    no bound on that side). A call's forward and backward share them."""
    import torch
    left, right = window[0], 0 if causal else window[1]
    # (first query, end query, first key, end key) of every sequence
    ends = torch.stack((cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])).long()

    def rule(n: int, offsets, queries: bool):
        """Each of n packed query rows' (or keys') [lo, hi) on the other side:
        its sequence's ends and the window measured from its diagonal `at`."""
        r = torch.arange(n, device=cu_q.device)
        b = (torch.searchsorted(offsets, r.to(offsets.dtype), right=True) - 1).clamp(
            0, ends.shape[1] - 1)
        sq, eq, sk, ek = ends[:, b]
        if queries:
            at, start, stop, below, above = r - sq + (ek - sk) - (eq - sq), sk, ek, left, right
            own = (r >= sq) & (r < eq)
        else:
            at, start, stop, below, above = r - sk - (ek - sk) + (eq - sq), sq, eq, right, left
            own = (r >= sk) & (r < ek)
        lo = start + (at - below).clamp(min=0) if below >= 0 else start
        hi = torch.minimum(stop, start + at + above + 1) if above >= 0 else stop
        empty = ~own | (hi <= lo)
        return torch.where(empty, EMPTY_LO, lo), torch.where(empty, 0, hi)

    rows = -(-max(total_q, 1) // ROW_ALIGN) * ROW_ALIGN
    keys = -(-max(total_k, 1) // 128) * 128
    return (*rule(rows, cu_q, True), *rule(keys, cu_k, False))


def tail(seen, total_q: int, total_k: int, *, forward_tasks: tuple[int, int] | None = None):
    """(tail, costs): the tail for `bounds`' four tensors and each task's cost
    (in key blocks or query tiles), torch tensors on their device; one cost
    per task the kernel decodes (cdiv(total_q, BM), or cdiv(total_k, 128)),
    while `ranges` runs on to the padded rows. forward_tasks=(BM, BN): ranges
    of BN-key blocks per BM-row task; else the backward's ranges of 64-row
    query tiles per 128-key K/V block."""
    import torch
    klo, khi, qlo, qhi = seen
    tiles = torch.stack((klo.view(-1, 64).amax(1), khi.view(-1, 64).amin(1)), 1).view(-1)
    if forward_tasks is not None:
        bm, bn = forward_tasks
        lo, hi = klo.view(-1, bm).amin(1), khi.view(-1, bm).amax(1)
        none = hi <= lo
        first = torch.where(none, 0, lo // bn)
        end = torch.where(none, 1, (hi + bn - 1) // bn)
        costs = (end - first)[:-(-max(total_q, 1) // bm)]   # the tasks the kernel decodes
    else:           # the query tiles that see any of a K/V block's keys
        lo, hi = qlo.view(-1, 128).amin(1), qhi.view(-1, 128).amax(1)
        none = hi <= lo
        first = torch.where(none, 0, lo // 64)
        end = torch.where(none, 1, (hi + 63) // 64)
        costs = end - first
    ranges = torch.stack((first, end), 1).view(-1)
    parts = [klo, khi, tiles, qlo, qhi, ranges]
    out = torch.cat([torch.nn.functional.pad(p, (0, -len(p) % 64)) for p in parts])
    return out.to(torch.int32), costs
