"""Attention over a KV cache for decoding, FlashAttention's flash_attn_with_kvcache:

    from tk_mlir.kernels import attention_with_kvcache
    o = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens)          # q (B, N_new, H, D)
    o = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k, v=v)   # append, then attend
    o = attention_with_kvcache(q, k_pages, v_pages, cache_seqlens, block_table=table)  # paged

A decode step has a few query rows per head and a long key sequence, so the
work is reading K and V once, at the memory's bandwidth. Two things make that
possible (flash-decoding):
- GQA packing: the G = H / H_kv query heads that share a K/V head, times the
  N_new new tokens, are the rows of one 64-row query tile (row t·G + g is
  token t of query head h_kv·G + g), so each K/V block is read once per K/V
  head, not once per query head.
- Split-KV: a (batch, K/V head)'s keys are cut into `splits` chunks of whole
  key blocks, one block of the grid each, so that a batch of a few sequences
  still fills every SM. Each chunk writes its normalised partial output and
  log-sum-exp (f32), and `kv_combine_kernel` merges them by their LSE (or,
  with FUSED_MERGE, the last chunk of each (batch, K/V head, row block) does,
  once the others have counted theirs done: `merge_last`, no second launch).
  The chunk boundaries come from the sequence's real length, read on the
  GPU, so the host never synchronises.
"""
from __future__ import annotations

import math

import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.kernels import checks, eager
from tk_mlir.kernels.device import num_sms
from tk_mlir.kernels.column_pieces import column_piece, max_rows, tile_rows
from tk_mlir.kernels.flash_attention import LN2, LOG2E, finite, tanh
from tk_mlir.runtime.arguments import vector_rows

ROWS = 64          # query rows per task (one consumer warpgroup's wgmma M)
MERGE_ROWS = 16    # rows per block of the merge (R = N_new·G is rarely more)
MERGE_UNROLL = 8   # splits whose partials the merge loads at once


@tk.kernel(num_warps=8)
def kv_cache_attention_kernel(Q: tk.gl, K: tk.gl, V: tk.gl, O: tk.gl, LSE: tk.gl,
                              SEQLENS: tk.gl, BLOCK_TABLE: tk.gl, OF: tk.gl, LSEF: tk.gl,
                              COUNTS: tk.gl, scale_log2: float,
                              added: int, group: int, capacity: int, left: int, right: int,
                              softcap: float,
                              D: tk.constexpr = 128, BN: tk.constexpr = 128,
                              PAGE: tk.constexpr = 0, STAGES: tk.constexpr = 2,
                              CAUSAL: tk.constexpr = True, LEFT: tk.constexpr = False,
                              SOFTCAP: tk.constexpr = False, SPLIT: tk.constexpr = True,
                              MERGE: tk.constexpr = False,
                              CONSUMER_REGISTERS: tk.constexpr = 232,
                              PRODUCER_REGISTERS: tk.constexpr = 40):
    """One chunk of the keys of one (batch, K/V head) for 64 packed query rows.

    Q: (B, H_kv, R, D), R = N_new·G query rows per K/V head, row t·G + g is
    token t of query head h_kv·G + g. K, V: the cache as (B, H_kv, N_max, D),
    or with PAGE > 0 as pages (num_pages, H_kv, PAGE, D) that BLOCK_TABLE
    (B, max_pages) i32 maps key block p of batch b to. SEQLENS (B,) i32: keys
    before this step's; `added` of them were appended this step (so batch b
    has SEQLENS[b] + added keys), `capacity` keys fit in its cache.
    A batch whose keys exceed the capacity gets NaN rows (no silent reads of
    another batch's cache; the host cannot look without a synchronisation).
    Row t stands at position p = n_keys - N_new + t (bottom-right aligned).
    CAUSAL: it sees keys j <= p + right (right = 0: causal; a window's right
    edge otherwise); LEFT: keys j >= p - left. Blocks wholly outside are not
    read. SOFTCAP: scores s·scale become softcap·tanh(s·scale / softcap).
    SPLIT: O (B·H_kv, splits, R, D) and LSE (B·H_kv, splits, R') f32 get the
    chunk's normalised output and log-sum-exp; else O (B, H_kv, R, D) in Q's
    dtype and LSE (B, H_kv, R') are final. R' >= R is a multiple of 4.
    MERGE (with SPLIT): the last chunk of each (batch, K/V head, row block)
    merges them all (merge_splits) into OF (B, H_kv, R, D) and LSEF (B, H_kv,
    R') once the others have counted their partials written in COUNTS
    (>= B·H_kv·cdiv(R, 64),) i32, zeroed: no second launch. Only the last
    chunks wait, on chunks that wait for nothing, and they are at most half
    the grid (splits >= 2), which is at most one block per SM (_splits): a
    waiting chunk never holds an SM that one it waits for needs, unless
    other work holds every other SM for good. Else OF, LSEF and COUNTS are
    unread.
    Grid (B·H_kv, cdiv(R, 64), splits): B·H_kv in x, whose limit is 2³¹ - 1
    (y and z stop at 65535). BN divides PAGE or PAGE divides BN."""
    tk.register_split(1, CONSUMER_REGISTERS, PRODUCER_REGISTERS)
    bh, rb, split = tk.block_id(0), tk.block_id(1), tk.block_id(2)
    splits = tk.grid_dim(2)
    H_KV = K.shape[1]
    b, hk = bh // H_KV, bh % H_KV
    n_keys = tk.load(SEQLENS, (b,)) + added
    new_tokens = Q.shape[2] // group
    base = n_keys - new_tokens                   # token t stands at key position base + t
    lo, hi = 0, tk.cdiv(min(n_keys, capacity), BN)          # the key blocks any row sees
    if LEFT:
        lo = max(base - left, 0) // BN
    if CAUSAL:
        hi = min(hi, tk.cdiv(max(base + new_tokens + right, 0), BN))
    per = tk.cdiv(max(hi - lo, 0), splits)
    first = lo + split * per
    last = min(first + per, hi)
    qs = tk.ring(Q.dtype, (ROWS, D), 1)
    ks = tk.ring(K.dtype, (BN, D), STAGES)
    vs = tk.ring(V.dtype, (BN, D), STAGES)

    def visible_scores(S, j):
        """The scores of key block j in log2 units (·scale·log2(e), or
        soft-capped) with -inf past n_keys and outside each row's window;
        only blocks that reach an edge are masked."""
        if SOFTCAP:      # softcap·tanh(s·scale / softcap), in log2 units
            S = tanh(S * (scale_log2 / (LOG2E * softcap))) * (softcap * LOG2E)
        else:
            S = S * scale_log2
        col0 = j * BN
        edge = col0 + BN > n_keys
        if CAUSAL:
            edge = edge | (col0 + BN - 1 > base + right)
        if LEFT:
            edge = edge | (col0 < base + new_tokens - 1 - left)
        if edge:
            key = S.col_indices() + col0
            row = S.row_indices() + rb * ROWS    # token t = row // G:
            visible = key < n_keys
            if CAUSAL:   # key <= base + t + right  <=>  (key - base - right)·G <= row
                visible = visible & ((key - (base + right)) * group <= row)
            if LEFT:     # key >= base + t - left  <=>  row < (key - base + left + 1)·G
                visible = visible & (row < (key - (base - left - 1)) * group)
            S = tk.where(visible, S, float("-inf"))
        return S

    def online_softmax(S, m, l):
        """One block's step of the online softmax on log2-unit scores: (P,
        new max, new sum, the factor alpha that rescales what came before)."""
        m_new = max(m, S.row_max())
        m_use = finite(m_new)
        alpha = (m - m_use).exp2()
        P = S.sub_row(m_use).exp2()
        return P, m_new, l * alpha + P.row_sum(), alpha

    def zero_tail(vt, j):
        """Zero the rows of V block j past n_keys: they hold whatever the
        cache holds (NaN too), and P's 0 there times NaN is not 0."""
        if j * BN + BN > n_keys:
            tail = tk.load(vt, layout="vec", scope="warpgroup")
            tk.store(vt, tk.where(tail.row_indices() + j * BN < n_keys, tail, 0.0))
            tk.named_barrier(1, warps=4)     # every warp's rows, before the wgmma

    if tk.warpgroup_id() == 1:
        tk.decrease_registers(PRODUCER_REGISTERS)
        if tk.elect_leader("warpgroup"):
            q, q_full = qs.fill(0)
            tk.tma.load_async(q, Q, (b, hk, rb, 0), q_full)
            for j in range(first, last):
                i = j - first
                kt, k_full = ks.fill(i)
                load_keys(kt, K, BLOCK_TABLE, b, hk, j, k_full, BN, PAGE, D)
                vt, v_full = vs.fill(i)
                load_keys(vt, V, BLOCK_TABLE, b, hk, j, v_full, BN, PAGE, D)
    else:
        tk.increase_registers(CONSUMER_REGISTERS)
        q = qs.wait(0)
        m = tk.full((ROWS,), float("-inf"), scope="warpgroup")
        l = tk.zeros((ROWS,), scope="warpgroup")
        acc = tk.zeros((ROWS, D), f32, layout="row", scope="warpgroup")
        if first < last:
            # FA3's order: block j's scores and its softmax run while
            # block j-1's P·V is in flight.
            k0 = ks.wait(0)
            S = tk.mma_ABt(tk.zeros((ROWS, BN), f32, layout="row", scope="warpgroup"), q,
                           k0)
            tk.mma_wait(0)
            ks.release(0)
            P, m, l, alpha = online_softmax(visible_scores(S, first), m, l)
            for j in range(first + 1, last):
                i = j - first
                k_next, v_prev = ks.wait(i), vs.wait(i - 1)
                S = tk.mma_ABt(tk.zeros((ROWS, BN), f32, layout="row", scope="warpgroup"),
                               q, k_next)
                acc = tk.mma_AB(acc, P.to(Q.dtype), v_prev)
                tk.mma_wait(1)
                ks.release(i)
                P, m, l, alpha = online_softmax(visible_scores(S, j), m, l)
                tk.mma_wait(0)
                vs.release(i - 1)
                acc = acc.mul_row(alpha)
            v_last = vs.wait(last - 1 - first)
            zero_tail(v_last, last - 1)      # (only the last block can end past n_keys)
            acc = tk.mma_AB(acc, P.to(Q.dtype), v_last)
            tk.mma_wait(0)
            vs.release(last - 1 - first)
        qs.release(0)
        inv = tk.where(l == 0.0, 0.0, l.rcp())
        lse = m * LN2 + l.log()
        if max(n_keys - capacity, added - n_keys) > 0:   # a bad cache_seqlens (past the cache,
            # or negative): NaN, not a wrong answer
            inv = inv + float("nan")
            lse = lse + float("nan")
        if SPLIT:
            tk.store(O, acc.mul_row(inv), (bh, split, rb, 0))
            tk.store(LSE, lse, (bh, split, rb))
            if MERGE:
                merge_last(O, LSE, OF, LSEF, COUNTS, bh, rb, split, splits, Q.shape[2], D)
        else:
            tk.store(O, acc.mul_row(inv).to(O.dtype), (b, hk, rb, 0))
            tk.store(LSE, lse, (b, hk, rb))


@tk.func
def load_keys(tile, X, BLOCK_TABLE, b, hk, j, full, BN, PAGE, D):
    """TMA loads of key block j (keys j·BN ...) of batch b, K/V head hk, into
    `tile`, arriving on `full`. Paged, a block within one page is one load; a
    block of several pages is one load per page and 64-column block (a
    swizzled tile's rows are contiguous within a column block only)."""
    if PAGE == 0:
        tk.tma.load_async(tile, X, (b, hk, j, 0), full)
    elif PAGE >= BN:
        page = tk.load(BLOCK_TABLE, (b, j * BN // PAGE))
        tk.tma.load_async(tile, X, (page, hk, (j * BN % PAGE) // BN, 0), full)
    else:
        for p in tk.static_range(BN // PAGE):
            page = tk.load(BLOCK_TABLE, (b, j * (BN // PAGE) + p))
            for c in tk.static_range(D // 64):
                tk.tma.load_async(tile.column_block(c).subtile(p, PAGE), X, (page, hk, 0, c),
                                  full)


@tk.func
def merge_last(OP, LSEP, O, LSE, COUNTS, bh, rb, split, splits, R, D):
    """After a chunk's partial is stored (OP, LSEP, by the consumer
    warpgroup): every chunk but the last counts it in COUNTS (its warps'
    stores, then one release at GPU scope); the last waits for the others'
    counts and merges the row block's partials (merge_splits, MERGE_ROWS
    rows at a time) into O and LSE."""
    counter = bh * tk.grid_dim(1) + rb
    leader = tk.elect_leader("warpgroup")
    tk.named_barrier(2, warps=4)               # the warpgroup's partial stores are made
    if split < splits - 1:
        if leader:
            tk.fence("gpu")
            tk.signal(COUNTS, (counter,), scope="gpu")
    else:
        if leader:
            tk.wait_signal(COUNTS, (counter,), splits - 1, scope="gpu")
        tk.named_barrier(2, warps=4)           # the others' partials, for every warp
        per_task = ROWS // MERGE_ROWS
        unroll = MERGE_UNROLL if D <= 128 else MERGE_UNROLL // 2     # (D=256: 8 would spill)
        for r in range(tk.cdiv(min(R - rb * ROWS, ROWS), MERGE_ROWS)):
            merge_splits(OP, LSEP, O, LSE, bh, rb * per_task + r, D, unroll)


@tk.func
def merge_splits(OP, LSEP, O, LSE, bh, rb, D, UNROLL):
    """Merge MERGE_ROWS rows (block rb) of the splits of kv_cache_attention_kernel
    (one warpgroup): O = Σ_s w_s·O_s / Σ_s w_s with w_s = exp(LSE_s − max
    LSE), and LSE = log Σ_s exp(LSE_s). UNROLL splits at a time: their loads
    are independent, so they are in flight together (one at a time, a merge
    of 16 splits took 15 µs of latency). OP (B·H_kv, splits, R, D), LSEP
    (B·H_kv, splits, R') f32; O (B, H_kv, R, D), LSE (B, H_kv, R') f32. A row
    no split saw gets 0 and -inf."""
    H_KV = O.shape[1]
    b, hk = bh // H_KV, bh % H_KV
    m = tk.full((MERGE_ROWS,), float("-inf"), scope="warpgroup")
    l = tk.zeros((MERGE_ROWS,), scope="warpgroup")
    acc = tk.zeros((MERGE_ROWS, D), f32, scope="warpgroup")
    for s0 in range(0, OP.shape[1], UNROLL):
        m_new = m
        for u in tk.static_range(UNROLL):       # (splits past the end read as -inf)
            m_new = max(m_new, tk.load(LSEP, (bh, s0 + u, rb), (MERGE_ROWS,),
                                       fill=float("-inf"), scope="warpgroup"))
        m_use = finite(m_new)
        alpha = (m - m_use).exp()
        acc = acc.mul_row(alpha)
        l = l * alpha
        for u in tk.static_range(UNROLL):
            w = (tk.load(LSEP, (bh, s0 + u, rb), (MERGE_ROWS,), fill=float("-inf"),
                         scope="warpgroup") - m_use).exp()
            acc = acc + tk.load(OP, (bh, s0 + u, rb, 0), (MERGE_ROWS, D),
                                scope="warpgroup").mul_row(w)
            l = l + w
        m = m_new
    tk.store(O, acc.mul_row(tk.where(l == 0.0, 0.0, l.rcp())).to(O.dtype), (b, hk, rb, 0))
    tk.store(LSE, finite(m) + l.log(), (b, hk, rb))


@tk.kernel(num_warps=4)
def kv_combine_kernel(OP: tk.gl, LSEP: tk.gl, O: tk.gl, LSE: tk.gl, D: tk.constexpr = 128,
                      UNROLL: tk.constexpr = MERGE_UNROLL):
    """merge_splits for MERGE_ROWS rows per block. Grid (B·H_kv, cdiv(R,
    MERGE_ROWS))."""
    merge_splits(OP, LSEP, O, LSE, tk.block_id(0), tk.block_id(1), D, UNROLL)


@tk.kernel(num_warps=4)
def kv_append_kernel(K_NEW: tk.gl, V_NEW: tk.gl, K_CACHE: tk.gl, V_CACHE: tk.gl,
                     SEQLENS: tk.gl, BLOCK_TABLE: tk.gl, capacity: int, HB: tk.constexpr,
                     D: tk.constexpr, PAGE: tk.constexpr = 0):
    """New token t of batch b (its H_kv keys and values) into the cache at
    key position SEQLENS[b] + t: K_NEW, V_NEW (B, N_new, H_kv, D); the caches
    (B, N_max, H_kv, D), or with PAGE > 0 pages (num_pages, PAGE, H_kv, D)
    mapped by BLOCK_TABLE (B, max_pages) i32. A batch whose SEQLENS is
    negative, or a position past capacity - 1, writes nothing (the attention
    kernel then gives NaN rows), as does a page number outside the pool (the
    stores are masked). HB: H_kv rounded up to a power of two. Grid (N_new, B)."""
    t, b = tk.block_id(0), tk.block_id(1)
    first = tk.load(SEQLENS, (b,))
    pos = first + t
    if (first >= 0) & (pos < capacity):     # (a negative pos would read BLOCK_TABLE[b, -1])
        page, row = b, pos
        if PAGE > 0:
            page, row = tk.load(BLOCK_TABLE, (b, pos // PAGE)), pos % PAGE
        piece = column_piece(D, HB)     # (the heads' rows in column pieces: any H_kv)
        for p in tk.static_range(D // piece):
            tk.store(K_CACHE, tk.load(K_NEW, (b, t, 0, p), (HB, piece)), (page, row, 0, p))
            tk.store(V_CACHE, tk.load(V_NEW, (b, t, 0, p), (HB, piece)), (page, row, 0, p))


# ------------------------------------------------------------------ host side

def _config(d: int, page: int) -> dict:
    """Key block and stages per head dim and page size (0: a dense cache).
    A paged block is whole pages (page <= BN, page dividing BN) or a part of
    one: the largest multiple of 16 up to BN that divides the page (pages of
    odd multiples of 16 above 128 take small blocks: 176 keys make 16).
    D=256's 64x256 f32 accumulator needs 256 registers (no spills); D=64's
    64x192 scores with the merge spill at 232 (12 bytes, in the key loop), not
    at 248 (a block per SM either way: its registers decide it)."""
    bn = {64: 192, 128: 128, 256: 64}[d]
    if page and bn % page:
        bn = max(c for c in range(16, bn + 1, 16) if page % c == 0)
    cfg = dict(BN=bn, STAGES=STAGES)
    if d == 64:
        cfg.update(CONSUMER_REGISTERS=248)
    if d == 256:
        cfg.update(CONSUMER_REGISTERS=256, PRODUCER_REGISTERS=24)
    return cfg


# K/V ring stages, and waves of one block per SM that the split-KV chunks fill.
STAGES = 2
WAVES = 1
# The split chunks merged by the last of them (kv_cache_attention_kernel's
# MERGE) instead of by kv_combine_kernel's second launch: the same GPU time on
# the H200 (BENCHMARKS.md), one launch fewer on the host.
FUSED_MERGE = True


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, k=None,
                           v=None, causal: bool = True, scale: float | None = None,
                           window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           return_lse: bool = False, *, softmax_scale: float | None = None,
                           window_size: tuple[int, int] | None = None,
                           return_softmax_lse: bool | None = None):
    """softmax(q·Kᵀ·scale)·V over the keys in a KV cache, FlashAttention's
    flash_attn_with_kvcache in its (B, N, H, D) layout.

    q: (B, N_new, H, D) bf16/f16, the new tokens' queries (N_new >= 1).
    k_cache, v_cache: (B, N_max, H_kv, D), H_kv dividing H; or, with
    block_table (B, max_pages) int32, pages (num_pages, page_size, H_kv, D),
    page_size a multiple of 16 from 16 to 256, block_table[b, p] holding
    keys p·page_size ... of batch b. cache_seqlens: (B,) int32, each batch's
    keys in the cache before this call. k, v: (B, N_new, H_kv, D), when given,
    are written into the cache at cache_seqlens first (in place), and the
    attention covers cache_seqlens + N_new keys; without them, cache_seqlens.
    New token t stands at key position p = n_keys - N_new + t (bottom-right
    aligned). causal: it sees keys j <= p. window=(left, right): keys in
    [p - left, p + right], -1 for no bound on that side (with causal, right
    is 0), as FlashAttention; key blocks wholly outside are never read.
    softcap > 0: scores s·scale become softcap·tanh(s·scale / softcap)
    (Gemma-2). D is 64, 128 or 256. Returns o (B, N_new, H, D), and with
    return_lse=True also the log-sum-exp (B, H, N_new) f32 (natural log; -inf
    for a row with no key).

    Lengths stay on the GPU (no synchronisation): a batch whose n_keys exceed
    its cache (N_max, or max_pages·page_size) gets NaN output rows; entries of
    block_table outside [0, num_pages) are not checked on the GPU (TMA reads
    zeros there), nor a table that sends an appended token to a page slot
    another append or a cached key takes; on CPU tensors (the interpreter)
    both are checked, as are the lengths. FlashAttention's keywords
    softmax_scale, window_size and return_softmax_lse are taken for scale,
    window and return_lse."""
    import torch
    if softmax_scale is not None or window_size is not None or return_softmax_lse is not None:
        scale, window, return_lse = checks.flash_names(
            "attention_with_kvcache", {"scale": scale, "window": window, "return_lse": return_lse},
            {"softmax_scale": softmax_scale, "window_size": window_size,
             "return_softmax_lse": return_softmax_lse})
    if torch.compiler.is_compiling():
        scale, left, right, softcap = _checked_call(q, k_cache, v_cache, cache_seqlens,
                                                    block_table, k, v, causal, scale, window,
                                                    softcap, return_lse)
        from tk_mlir.kernels import custom_ops  # noqa: F401  registers torch.ops.tk_mlir
        o, lse = torch.ops.tk_mlir.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens, block_table, k, v, causal, scale, left, right,
            softcap)
        return (o, lse) if return_lse else o
    # eager: a signature seen before was checked then (eager.py), but for the
    # lengths and pages of CPU tensors (the interpreter), read on every call,
    # and the caches' memory against what is read while they are written
    if k is not None:
        written_apart(q, k_cache, v_cache, k, v)
    key = (eager.tensor_key(q), eager.tensor_key(k_cache), eager.tensor_key(v_cache),
           eager.tensor_key(cache_seqlens), eager.tensor_key(block_table), eager.tensor_key(k),
           eager.tensor_key(v), eager.option_key(causal, scale, window, softcap, return_lse),
           torch.is_grad_enabled())
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table, k, v)
    return _PREPARED.call(key, lambda: _prepare(tensors, causal, scale, window, softcap,
                                                return_lse), *tensors)


# Eager calls by signature (eager.py).
_PREPARED = eager.Prepared()


def written_apart(q, k_cache, v_cache, k, v) -> None:
    """Appending k and v writes into the caches: neither cache may share
    memory with the other or with q, k or v (one tensor passed as both
    caches would take v over k)."""
    fn = "attention_with_kvcache"
    checks.written_apart(fn, "k_cache", k_cache, q=q, v_cache=v_cache, k=k, v=v)
    checks.written_apart(fn, "v_cache", v_cache, q=q, k=k, v=v)


def _checked_call(q, k_cache, v_cache, cache_seqlens, block_table, k, v, causal, scale,
                  window, softcap, return_lse=False) -> tuple[float, int, int, float]:
    """Every rule of a call, and its options as the kernels take them:
    (scale, left, right, softcap)."""
    import torch
    _check(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
    checks.flags("attention_with_kvcache", causal=causal, return_lse=return_lse)
    scale, left, right, softcap = checks.attention_options(
        "attention_with_kvcache", q.shape[-1], reach(q, k_cache, block_table), scale, window,
        softcap)
    checks.on_cuda("attention_with_kvcache", "q", q)
    if not torch.compiler.is_compiling():
        checks.warn_no_gradient("attention_with_kvcache", "use attention or attention_varlen",
                                q, k, v, k_cache, v_cache)
    return scale, left, right, softcap


def _prepare(tensors, causal, scale, window, softcap, return_lse):
    """After checking an eager call, `run(q, k_cache, v_cache, cache_seqlens,
    block_table, k, v)` for calls like it (`tensors`: this call's, in that
    order)."""
    q, k_cache, v_cache, cache_seqlens, block_table, k, v = tensors
    scale, left, right, softcap = _checked_call(*tensors, causal, scale, window, softcap,
                                                return_lse)
    run = planned(q, k_cache, block_table, k, causal, scale, left, right, softcap,
                  same_signature=True, with_lse=return_lse)
    if cache_seqlens.device.type == "cpu":      # (the interpreter: lengths cost nothing)
        unchecked, added = run, q.shape[1] if k is not None else 0

        def run(q, k_cache, v_cache, cache_seqlens, block_table, k, v):
            _check_values(cache_seqlens, block_table, k_cache, added)
            return unchecked(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
    if return_lse:
        return run
    return lambda *tensors: run(*tensors)[0]


def forward(q, k_cache, v_cache, cache_seqlens, block_table, k, v, causal: bool,
            scale: float, left: int = -1, right: int = -1, softcap: float = 0.0):
    """attention_with_kvcache on checked arguments: (o, lse)."""
    return planned(q, k_cache, block_table, k, causal, scale, left, right, softcap)(
        q, k_cache, v_cache, cache_seqlens, block_table, k, v)


def planned(q, k_cache, block_table, k, causal: bool, scale: float, left: int = -1,
            right: int = -1, softcap: float = 0.0, same_signature: bool = False,
            with_lse: bool = True):
    """`run(q, k_cache, v_cache, cache_seqlens, block_table, k, v) -> (o, lse)`:
    `forward` for checked arguments of these shapes (k: whether new tokens
    come), its configuration, split and launches chosen once; same_signature:
    every call's tensors are laid out as these (eager.launcher); without
    with_lse, lse is None (its views not made)."""
    import torch
    B, N_new, H, D = q.shape
    if not B * N_new * H:                # no rows: empty outputs, no launch (nothing appended)
        return lambda q, *rest: (q.new_empty(q.shape),
                                 q.new_empty(B, H, N_new, dtype=torch.float32))
    H_kv = k_cache.shape[2]
    G = H // H_kv
    R = N_new * G
    page = 0 if block_table is None else k_cache.shape[1]
    keys = capacity(k_cache, block_table)
    cfg = _config(D, page)
    tasks = B * H_kv * -(-R // ROWS)            # (batch, K/V head, row block)
    splits = _splits(tasks, -(-keys // cfg["BN"]), q.get_device())
    rp = -(-R // 4) * 4
    args = (scale * math.log2(math.e), 0 if k is None else N_new, G, keys, left,
            0 if causal else right, softcap or 1.0)
    cfg.update(CAUSAL=causal or right >= 0, LEFT=left >= 0, SOFTCAP=softcap > 0)
    merge = splits > 1 and FUSED_MERGE          # the last chunk of each row block merges
    attend = eager.launcher(kv_cache_attention_kernel, same_signature)(
        (B * H_kv, -(-R // ROWS), splits), D=D, PAGE=page, SPLIT=splits > 1, MERGE=merge, **cfg)
    combine = None if splits == 1 or merge else \
        eager.launcher(kv_combine_kernel, same_signature)((B * H_kv, -(-R // MERGE_ROWS)), D=D)
    append = None if k is None else eager.launcher(kv_append_kernel, same_signature)(
        (N_new, B), HB=tile_rows(H_kv), D=D, PAGE=page)
    counters = -(-tasks // 4) * 4               # the merge's, one a task: whole 16-byte rows
    # One new token (decoding): a K/V head's query rows are its G heads as q holds
    # them, so q, o and lse each take one view, not three or four.
    one = N_new == 1

    def run(q, k_cache, v_cache, cache_seqlens, block_table, k, v):
        seqlens = checks.int32_table(cache_seqlens)
        table = seqlens if block_table is None else checks.int32_table(block_table)  # (0: unread)
        if append is not None:          # the new tokens into the cache at cache_seqlens
            append(checks.kernel_operand(k), checks.kernel_operand(v), k_cache, v_cache,
                   seqlens, table, keys)
        # Query rows per K/V head: a view for one new token, a copy for several.
        q_rows = checks.kernel_operand(q.reshape(B, H_kv, R, D) if one else q.reshape(
            B, N_new, H_kv, G, D).transpose(1, 2).reshape(B, H_kv, R, D))
        o_rows = q.new_empty(B, H_kv, R, D)
        lse_rows = q.new_empty(B, H_kv, rp, dtype=torch.float32)
        if splits == 1:                 # the one chunk writes the result
            out, lse_out = o_rows, lse_rows
        else:
            out = q.new_empty(B * H_kv, splits, R, D, dtype=torch.float32)
            lse_out = q.new_empty(B * H_kv, splits, rp, dtype=torch.float32)
        counts = q.new_zeros(counters, dtype=torch.int32) if merge else seqlens  # (or unread)
        # The cache as the kernel reads it: (B or pages, H_kv, keys, D).
        attend(q_rows, k_cache.transpose(1, 2), v_cache.transpose(1, 2), out, lse_out, seqlens,
               table, o_rows, lse_rows, counts, *args)
        if combine is not None:
            combine(out, lse_out, o_rows, lse_rows)
        o = o_rows.view(B, N_new, H, D) if one else \
            o_rows.view(B, H_kv, N_new, G, D).transpose(1, 2).reshape(B, N_new, H, D)
        if not with_lse:
            return o, None
        lse = lse_rows[..., :R].reshape(B, H, N_new) if one else \
            lse_rows[..., :R].reshape(B, H_kv, N_new, G).permute(0, 1, 3, 2).reshape(B, H, N_new)
        return o, lse
    return run


def _splits(tasks: int, key_blocks: int, device: int) -> int:
    """Chunks per (batch, K/V head, row block): as many as give every SM a
    block at once, never more (a second wave cost 38% at B1 on the H200; the
    kernel holds one block per SM: setmaxnreg sizes it to the register file),
    each chunk at least two key blocks of the cache's capacity."""
    return max(1, min(WAVES * num_sms(device) // tasks, key_blocks // 2))


def capacity(k_cache, block_table) -> int:
    """The keys one sequence's cache holds: N_max, or max_pages·page_size."""
    return k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])


def reach(q, k_cache, block_table) -> int:
    """More than any distance between a new query and a key of the cache:
    a window side this wide bounds nothing (checks.window)."""
    return capacity(k_cache, block_table) + q.shape[1]


def _check(q, k_cache, v_cache, cache_seqlens, block_table, k, v) -> None:
    """Shapes, dtypes and devices, each with the rule it breaks."""
    import torch
    fn = "attention_with_kvcache"
    dtypes = (torch.bfloat16, torch.float16)
    checks.tensor(fn, "q", q, ndim=4, dtypes=dtypes)
    B, N_new, H, D = q.shape
    if D not in (64, 128, 256):
        raise ValueError(f"{fn}: head dim D must be 64, 128 or 256, got {D}")
    if N_new == 0:
        raise ValueError(f"{fn}: q must hold at least one new token (N_new >= 1), got shape "
                         f"{tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.tensor(fn, name, t, ndim=4, dtypes=dtypes)
        checks.like(fn, name, t, "q", q)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{fn}: k_cache and v_cache must have one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    H_kv = k_cache.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"{fn}: the cache's head dim must be q's D={D}, got k_cache "
                         f"{tuple(k_cache.shape)}")
    if H_kv == 0 or H % H_kv:
        raise ValueError(f"{fn}: the cache's K/V heads H_kv={H_kv} must divide the query heads "
                         f"H={H} (GQA/MQA)")
    checks.tensor(fn, "cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32,))
    checks.like(fn, "cache_seqlens", cache_seqlens, "q", q, dtype=False)
    checks.shape(fn, "cache_seqlens", cache_seqlens, (B,), "one length per batch")
    empty = k_cache.shape[1] == 0 if block_table is None else k_cache.shape[0] == 0
    if empty:
        what = "N_max, its keys per batch" if block_table is None else "num_pages"
        raise ValueError(f"{fn}: the cache must hold keys ({what} >= 1), got k_cache "
                         f"{tuple(k_cache.shape)}")
    if block_table is None:
        if k_cache.shape[0] != B:
            raise ValueError(f"{fn}: k_cache must be (B={B}, N_max, H_kv, D) without a "
                             f"block_table, got {tuple(k_cache.shape)}")
        if k is not None and k_cache.shape[1] < N_new:
            raise ValueError(f"{fn}: the cache holds N_max={k_cache.shape[1]} keys, fewer "
                             f"than the N_new={N_new} new tokens k and v to write")
    else:
        checks.tensor(fn, "block_table", block_table, ndim=2, dtypes=(torch.int32,))
        checks.like(fn, "block_table", block_table, "q", q, dtype=False)
        if block_table.shape[0] != B or block_table.shape[1] == 0:
            raise ValueError(f"{fn}: block_table must be (B={B}, max_pages), max_pages >= 1, "
                             f"got {tuple(block_table.shape)}")
        page = k_cache.shape[1]
        if page % 16 or not 16 <= page <= 256:
            raise ValueError(f"{fn}: the page size (k_cache.shape[1] with a block_table) must "
                             f"be a multiple of 16 from 16 to 256, got {page}")
        if k is not None and block_table.shape[1] * page < N_new:
            raise ValueError(f"{fn}: block_table maps {block_table.shape[1]} pages of {page} "
                             f"keys, fewer than the N_new={N_new} new tokens k and v to write")
        if block_table.stride(-1) != 1:
            raise ValueError(f"{fn}: block_table's rows must be contiguous (stride 1), got "
                             f"strides {tuple(block_table.stride())}")
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: k and v come together (the new tokens' keys and values), "
                         f"got {'k' if v is None else 'v'} alone")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            checks.tensor(fn, name, t, ndim=4, dtypes=dtypes)
            checks.like(fn, name, t, "q", q)
            checks.shape(fn, name, t, (B, N_new, H_kv, D), "the new tokens' keys/values")
        if tile_rows(H_kv) > max_rows(D):
            raise ValueError(f"{fn}: k and v have H_kv={H_kv} heads; the append copies a "
                             f"token's heads as one tile's rows, at most {max_rows(D)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name}'s last dim (D) must be contiguous (stride 1), got "
                             f"strides {tuple(t.stride())}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        # The kernels read the cache in place by TMA: the launch's rule, in the user's names.
        ptr = None if torch.compiler.is_compiling() else t.data_ptr()     # (fakes: no data)
        if not vector_rows(t.shape, t.stride(), t.element_size(), ptr):
            vector = 16 // t.element_size()
            raise ValueError(f"{fn}: {name}'s rows must start 16-byte aligned (the cache is "
                             f"read in place): its data pointer and its strides over the first "
                             f"three dims must be multiples of 16 bytes ({vector} elements), "
                             f"got strides {tuple(t.stride())}"
                             + (f" and a data pointer {ptr % 16} bytes past a 16-byte "
                                f"boundary" if ptr and ptr % 16 else ""))
        if k is not None:
            checks.written_in_place(fn, f"{name} (k and v are appended into it)", t)
    if cache_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_values(cache_seqlens, block_table, k_cache, N_new if k is not None else 0)


def _check_values(cache_seqlens, block_table, k_cache, added: int) -> None:
    """The lengths, and the pages they use, of CPU tensors (the interpreter),
    where reading them costs no synchronisation; `added`: the new tokens
    appended first."""
    _check_lengths(cache_seqlens, capacity(k_cache, block_table), added)
    if block_table is not None:
        _check_pages(block_table, cache_seqlens + added, k_cache.shape[1], k_cache.shape[0])
        _check_appends(block_table, cache_seqlens, added, k_cache.shape[1])


def _check_lengths(cache_seqlens, capacity: int, added: int) -> None:
    """On the CPU (the interpreter) the lengths cost nothing to read: check them."""
    negative = (cache_seqlens < 0).nonzero()
    if len(negative):
        b = int(negative[0, 0])
        raise ValueError(f"attention_with_kvcache: cache_seqlens[{b}] = {int(cache_seqlens[b])} "
                         f"is negative: a length counts the keys already in the cache")
    n = cache_seqlens.long() + added
    bad = (n > capacity).nonzero()
    if len(bad):
        b = int(bad[0, 0])
        raise ValueError(f"attention_with_kvcache: cache_seqlens[{b}] = "
                         f"{int(cache_seqlens[b])} plus {added} new tokens is outside the "
                         f"cache's 0..{capacity} keys")


def _check_appends(block_table, cache_seqlens, added: int, page: int) -> None:
    """On the CPU: every appended token goes to a page slot of its own, which
    no batch holds a cached key in (a table that maps two appends, or an
    append and a kept key, to one slot would have one overwrite the other; on
    the GPU, unchecked)."""
    import torch
    if not added:
        return
    def slot_of(positions):              # (B, n) key positions -> page * page_size + row
        return block_table.long().gather(1, positions // page) * page + positions % page
    lengths = cache_seqlens.long()
    slots = slot_of(lengths[:, None] + torch.arange(added)[None]).flatten()   # the appends'
    kept = torch.arange(int(lengths.max()))[None].expand(len(lengths), -1)  # cached positions
    held = slot_of(kept).masked_fill(kept >= lengths[:, None], -1)
    over = torch.isin(slots, held[held >= 0]).nonzero()
    if len(over):
        i = int(over[0, 0])
        slot, (b, t) = int(slots[i]), divmod(i, added)
        b1, j = (int(x) for x in (held == slot).nonzero()[0])
        raise ValueError(f"attention_with_kvcache: block_table sends batch {b}'s new token {t} "
                         f"to row {slot % page} of page {slot // page}, which holds batch "
                         f"{b1}'s cached key {j}: the append would overwrite it")
    seen: dict = {}
    for i, slot in enumerate(slots.tolist()):
        if slot in seen:
            (b0, t0), (b, t) = divmod(seen[slot], added), divmod(i, added)
            raise ValueError(f"attention_with_kvcache: block_table sends batch {b0}'s new token "
                             f"{t0} and batch {b}'s new token {t} to one slot (row "
                             f"{slot % page} of page {slot // page}): the appended k and v "
                             f"would overwrite each other")
        seen[slot] = i


def _check_pages(block_table, n_keys, page: int, num_pages: int) -> None:
    """On the CPU: the pages each batch's keys use name pages of the pool
    (on the GPU an entry out of range is not checked: TMA reads zeros)."""
    import torch
    used = torch.arange(block_table.shape[1])[None] < (n_keys.long()[:, None] + page - 1) // page
    bad = (used & ((block_table < 0) | (block_table >= num_pages))).nonzero()
    if len(bad):
        b, p = (int(i) for i in bad[0])
        raise ValueError(f"attention_with_kvcache: block_table[{b}, {p}] = "
                         f"{int(block_table[b, p])} is not a page of k_cache's {num_pages} "
                         f"(batch {b} uses its first {-(-int(n_keys[b]) // page)} entries)")
